"""The one place that reads the config to build the model: parts in, `MaskRCNN` out.

It also makes the run's other model-shaped decisions once, for every user: `choose_ops` (the device's
convolutions, fused C++ ops or their pure-TF twins, XLA) for the model, the input pipeline's RPN targets
and the mask encoding of evaluation and inference; `build_anchors` for the model, whose `anchors` the
input pipeline labels.
"""

import dataclasses
import functools

from mrcnn_tf2.config import ConfigError
from mrcnn_tf2.devices import run_device
from mrcnn_tf2.model.backbone import ResNet
from mrcnn_tf2.model.fpn import FPN
from mrcnn_tf2.model.heads import BoxHead, MaskHead, RPNHead
from mrcnn_tf2.model.mask_rcnn import MaskRCNN
from mrcnn_tf2.model.stages import (AnchorGenerator, DetectionGenerator, MaskTargetGenerator, ProposalGenerator,
                                    RoIAligner, RoISampler)
from mrcnn_tf2.ops import anchors as anchor_ops
from mrcnn_tf2.ops import conv as conv_ops
from mrcnn_tf2.ops import fused as fused_ops
from mrcnn_tf2.ops import masks as mask_ops

# RoIAlign output sides of the box and mask heads (Mask R-CNN paper); the mask head doubles the latter.
BOX_ROI_SIZE = 7
MASK_ROI_SIZE = 14


@dataclasses.dataclass(frozen=True)
class OpChoice:
    """Which implementation each part of a run uses (see `choose_ops`).

    device: 'CPU' or 'GPU', where the model computes (`devices.run_device`).
    fused: the model's non-learned stages (proposals, RoIAlign, mask targets) run the fused C++ ops, else
      their pure-TF twins.
    fused_host: the input pipeline's RPN targets and the mask encoding of evaluation and inference run the
      fused C++ ops, else their twins. They run on the host (tf.data, NumPy) whatever the device.
    conv_route: `conv_ops.conv2d`'s route for the convs of backbone, FPN and heads (conv_ops.ROUTES).
    jit_dense: the learned layers are XLA-compiled (the non-learned stages run between them).
    mask_paste: how evaluation and inference paste masks into images (model.test.mask_paste): "exact" or
      "torchvision", which only the pure-NumPy encoder implements.
    """

    device: str
    fused: bool
    fused_host: bool
    conv_route: str
    jit_dense: bool
    mask_paste: str = "exact"

    @property
    def rpn_targets(self):
        """`ops.anchors.rpn_targets` or its fused twin (same signature, same targets for the same seed)."""
        return fused_ops.rpn_targets if self.fused_host else anchor_ops.rpn_targets

    @property
    def mask_encoder(self):
        """`ops.masks.encode_pasted_masks` with the chosen paste, or its fused twin (same signature, same RLE)."""
        if self.mask_paste != "exact":
            return functools.partial(mask_ops.encode_pasted_masks, paste=self.mask_paste)
        return fused_ops.encode_pasted_masks if self.fused_host else mask_ops.encode_pasted_masks

    def describe(self):
        """The choice in one line, which a run prints once at start-up."""
        onednn = ", oneDNN's batch-of-one routes" if conv_ops.ONEDNN else ""
        cpu = f"the CPU routes (kernel gradients as matrix products{onednn})"
        convs = {conv_ops.PLAIN: "TensorFlow's convolutions and gradients (cuDNN's on a GPU)",
                 conv_ops.CPU: cpu,
                 conv_ops.WINOGRAD: f"Winograd's fused op (float32 3x3) and {cpu}"}[self.conv_route]
        stages = "fused ops" if self.fused else "pure-TF twins"
        rpn_targets = "fused op" if self.rpn_targets is fused_ops.rpn_targets else "pure-TF twin"
        masks = "the fused op" if self.mask_encoder is fused_ops.encode_pasted_masks else "NumPy"
        xla = "on" if self.jit_dense else "off"
        return (f"ops on the {self.device}: convs by {convs}; proposals, RoIAlign and mask targets by the "
                f"{stages}; RPN targets (input pipeline) by the {rpn_targets}; mask encoding by {masks}; XLA {xla}")


def choose_ops(config, export=False):
    """The one decision of which ops a run uses: every part that has a fused twin, and every conv, asks here.

    On a CPU: runtime.custom_ops picks fused ops or twins (`fused.use_fused`: 'auto' falls back to the
    twins, with one warning, when the library is unusable), the convs take the CPU routes (conv_ops), the
    float32 3x3 ones Winograd's fused op unless runtime.xla compiles the learned layers, which cannot hold
    it. On a GPU (`devices.run_device`): the fused ops have CPU kernels only, so the model holds none:
    its convs are TensorFlow's (cuDNN's) and its stages the pure-TF twins; 'auto' keeps the fused ops
    that run on the host anyway (the input pipeline's RPN targets, the mask encoding), and 'on', which
    asks for them in the model too, is an error. `export=True`: the pure-TF twins, plain convolutions and
    no XLA, whatever the flags say, because an exported model must load in any TensorFlow process without
    the ops library, and convert to other runtimes whichever machine exported it.

    Args:
      config: a mrcnn_tf2.config.Config (reads runtime.custom_ops, runtime.xla, model.test.mask_paste).
      export: the choice for an exported model.

    Returns:
      an `OpChoice`.

    Raises:
      fused.CustomOpsUnavailable: custom_ops is 'on' and the library is unusable.
      ConfigError: custom_ops is 'on' and the model computes on a GPU.
    """
    device = run_device()
    if config.runtime.custom_ops == "on" and device == "GPU" and not export:
        raise ConfigError("--custom_ops", "'on' puts the fused ops in the model, and they have CPU kernels only: "
                                          "on this GPU they would run on the host, their tensors copied there "
                                          "and back; use 'auto' (the fused ops in the input pipeline and the "
                                          "mask encoding, cuDNN and the pure-TF twins in the model) or 'off'")
    library = not export and fused_ops.use_fused(config.runtime.custom_ops)
    fused = library and device == "CPU"
    xla = config.runtime.xla and not export
    if device == "GPU" or export:
        conv_route = conv_ops.PLAIN
    elif fused and not xla:  # Winograd's op would sit inside the XLA-compiled layers, which cannot hold it
        conv_route = conv_ops.WINOGRAD
    else:
        conv_route = conv_ops.CPU
    return OpChoice(device=device, fused=fused, fused_host=library, conv_route=conv_route, jit_dense=xla,
                    mask_paste=config.model.test.mask_paste)


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
    custom_ops is 'on' and the library is unusable, `ConfigError` when it is 'on' on a GPU.
    """
    config = config.resolved()
    model = config.model
    ops = choose_ops(config, export)
    fused, conv_route = ops.fused, ops.conv_route
    anchors, rpn, roi = model.anchors, model.rpn, model.roi
    if model.mrcnn_resolution != 2 * MASK_ROI_SIZE:
        raise ValueError(f"mrcnn_resolution {model.mrcnn_resolution}: the mask head outputs {2 * MASK_ROI_SIZE}")
    return MaskRCNN(
        backbone=ResNet(
            depth=int(model.backbone.removeprefix("resnet")),
            stride_in_1x1=model.stride_in_1x1,
            freeze_bn=model.freeze_bn,
            freeze_blocks=tuple(model.freeze_blocks),
            conv_route=conv_route,
        ),
        fpn=FPN(min_level=anchors.min_level, max_level=anchors.max_level, num_filters=model.fpn_num_filters,
                conv_route=conv_route, batch_norm=model.fpn_norm == "batch"),
        rpn_head=RPNHead(num_anchors=model.num_anchors, num_filters=model.fpn_num_filters, conv_route=conv_route,
                         num_convs=model.rpn_head_num_convs),
        box_head=BoxHead(num_classes=model.num_classes, mlp_head_dim=model.fast_rcnn_mlp_head_dim,
                         num_fcs=model.fast_rcnn_num_fcs, num_convs=model.fast_rcnn_num_convs,
                         conv_dim=model.fast_rcnn_conv_dim, batch_norm=model.fast_rcnn_norm == "batch",
                         conv_route=conv_route),
        mask_head=(MaskHead(num_classes=model.num_classes, num_filters=model.mrcnn_head_num_filters,
                            conv_route=conv_route, batch_norm=model.mrcnn_head_norm == "batch")
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
