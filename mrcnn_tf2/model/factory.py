"""The one place that reads the config to build the model: parts in, `MaskRCNN` out.

It also makes the run's other model-shaped decisions once, for every user: `choose_ops` (fused C++ ops or
their pure-TF twins, XLA) for the model, the input pipeline's RPN targets and the mask encoding of
evaluation and inference; `build_anchors` for the model, whose `anchors` the input pipeline labels.
"""

import dataclasses
import functools

from mrcnn_tf2.model.backbone import ResNet
from mrcnn_tf2.model.fpn import FPN
from mrcnn_tf2.model.heads import BoxHead, MaskHead, RPNHead
from mrcnn_tf2.model.mask_rcnn import MaskRCNN
from mrcnn_tf2.model.stages import (AnchorGenerator, DetectionGenerator, MaskTargetGenerator, ProposalGenerator,
                                    RoIAligner, RoISampler)
from mrcnn_tf2.ops import anchors as anchor_ops
from mrcnn_tf2.ops import fused as fused_ops
from mrcnn_tf2.ops import masks as mask_ops

# RoIAlign output sides of the box and mask heads (Mask R-CNN paper); the mask head doubles the latter.
BOX_ROI_SIZE = 7
MASK_ROI_SIZE = 14


@dataclasses.dataclass(frozen=True)
class OpChoice:
    """Which implementation each part of a run uses (see `choose_ops`).

    fused: the non-learned stages (proposals, RoIAlign, mask targets), the input pipeline's RPN targets and
      the mask encoding of evaluation and inference run the fused C++ ops, else their pure-TF twins.
    fused_convs: the 3x3 convs of backbone, FPN, RPN head and mask head run the fused Winograd op.
    jit_dense: the learned layers are XLA-compiled (the non-learned stages run between them).
    mask_paste: how evaluation and inference paste masks into images (model.test.mask_paste): "exact" or
      "torchvision", which only the pure-NumPy encoder implements.
    """

    fused: bool
    fused_convs: bool
    jit_dense: bool
    mask_paste: str = "exact"

    @property
    def rpn_targets(self):
        """`ops.anchors.rpn_targets` or its fused twin (same signature, same targets for the same seed)."""
        return fused_ops.rpn_targets if self.fused else anchor_ops.rpn_targets

    @property
    def mask_encoder(self):
        """`ops.masks.encode_pasted_masks` with the chosen paste, or its fused twin (same signature, same RLE)."""
        if self.mask_paste != "exact":
            return functools.partial(mask_ops.encode_pasted_masks, paste=self.mask_paste)
        return fused_ops.encode_pasted_masks if self.fused else mask_ops.encode_pasted_masks


def choose_ops(config, export=False):
    """The one decision of which ops a run uses: every part that has a fused twin asks here.

    runtime.custom_ops picks fused ops or twins (`fused.use_fused`: 'auto' falls back to the twins, with one
    warning, when the library is unusable); runtime.xla compiles the learned layers, which then cannot hold
    the fused convs. `export=True`: the pure-TF twins and no XLA, whatever the flags say, because an
    exported SavedModel must load in any TensorFlow process without the ops library.

    Args:
      config: a mrcnn_tf2.config.Config (reads runtime.custom_ops and runtime.xla).
      export: the choice for an exported model.

    Returns:
      an `OpChoice`.

    Raises:
      fused.CustomOpsUnavailable: custom_ops is 'on' and the library is unusable.
    """
    fused = not export and fused_ops.use_fused(config.runtime.custom_ops)
    xla = config.runtime.xla and not export
    # The 3x3 convs' fused ops would sit inside the XLA-compiled layers, which cannot hold them.
    return OpChoice(fused=fused, fused_convs=fused and not xla, jit_dense=xla, mask_paste=config.model.test.mask_paste)


def build_anchor_generator(config):
    """The model's `AnchorGenerator` (config.model.anchors)."""
    anchors = config.model.anchors
    return AnchorGenerator(anchors.min_level, anchors.max_level, anchors.num_scales, anchors.aspect_ratios,
                           anchors.anchor_scale, offset=anchors.anchor_offset,
                           round_corners=anchors.round_base_anchors)


def build_anchors(config):
    """The anchor boxes of the model input's size, {level: [H_l*W_l*A, 4] float32 NumPy}: the model's
    `anchors`, which the input pipeline labels."""
    return build_anchor_generator(config).at(config.data.image_size)


def build_model(config, export=False):
    """A MaskRCNN for `config` (a mrcnn_tf2.config.Config), with freshly initialised weights.

    Its ops are those `choose_ops(config, export)` decides: with `export=True` the pure-TF twins, so that
    an exported SavedModel loads without the ops library. Raises `fused.CustomOpsUnavailable` when
    custom_ops is 'on' and the library is unusable.
    """
    config = config.resolved()
    model = config.model
    ops = choose_ops(config, export)
    fused, fused_convs = ops.fused, ops.fused_convs
    anchors, rpn, roi = model.anchors, model.rpn, model.roi
    if model.mrcnn_resolution != 2 * MASK_ROI_SIZE:
        raise ValueError(f"mrcnn_resolution {model.mrcnn_resolution}: the mask head outputs {2 * MASK_ROI_SIZE}")
    return MaskRCNN(
        backbone=ResNet(
            depth=int(model.backbone.removeprefix("resnet")),
            stride_in_1x1=model.stride_in_1x1,
            freeze_bn=model.freeze_bn,
            freeze_blocks=tuple(model.freeze_blocks),
            fused=fused_convs,
        ),
        fpn=FPN(min_level=anchors.min_level, max_level=anchors.max_level, num_filters=model.fpn_num_filters,
                fused=fused_convs),
        rpn_head=RPNHead(num_anchors=model.num_anchors, num_filters=model.fpn_num_filters, fused=fused_convs),
        box_head=BoxHead(num_classes=model.num_classes, mlp_head_dim=model.fast_rcnn_mlp_head_dim),
        mask_head=(MaskHead(num_classes=model.num_classes, num_filters=model.mrcnn_head_num_filters,
                            fused=fused_convs)
                   if model.include_mask else None),
        proposal_generator=ProposalGenerator(
            train_pre_nms_topn=rpn.train_rpn_pre_nms_topn,
            train_post_nms_topn=rpn.train_rpn_post_nms_topn,
            train_nms_threshold=rpn.train_rpn_nms_threshold,
            test_pre_nms_topn=rpn.test_rpn_pre_nms_topn,
            test_post_nms_topn=rpn.test_rpn_post_nms_topn,
            test_nms_threshold=rpn.test_rpn_nms_thresh,
            min_size=rpn.rpn_min_size,
            fused=fused,
        ),
        roi_sampler=RoISampler(
            batch_size_per_im=roi.batch_size_per_im,
            fg_fraction=roi.fg_fraction,
            fg_thresh=roi.fg_thresh,
            bg_thresh_hi=roi.bg_thresh_hi,
            bg_thresh_lo=roi.bg_thresh_lo,
            bbox_reg_weights=tuple(model.bbox_reg_weights),
        ),
        box_roi_aligner=RoIAligner(BOX_ROI_SIZE, aligned=model.roi_align_aligned, fused=fused),
        mask_roi_aligner=RoIAligner(MASK_ROI_SIZE, aligned=model.roi_align_aligned, fused=fused),
        mask_target_generator=MaskTargetGenerator(model.mrcnn_resolution, fused=fused),
        detection_generator=DetectionGenerator(
            max_detections=model.test.test_detections_per_image,
            nms_threshold=model.test.test_nms,
            score_threshold=model.test.test_score_threshold,
            min_box_size=model.test.test_min_box_size,
            bbox_reg_weights=tuple(model.bbox_reg_weights),
        ),
        anchor_generator=build_anchor_generator(config),
        image_size=config.data.image_size,
        jit_dense=ops.jit_dense,
        loss_weights={
            "rpn_box": model.loss.rpn_box_loss_weight,
            "fast_rcnn_box": model.loss.fast_rcnn_box_loss_weight,
            "mask": model.loss.mrcnn_weight_loss_mask,
        },
        l2_weight_decay=config.train.l2_weight_decay,
    )
