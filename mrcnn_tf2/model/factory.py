"""The one place that reads the config to build the model: parts in, `MaskRCNN` out."""

from mrcnn_tf2.model.backbone import ResNet
from mrcnn_tf2.model.fpn import FPN
from mrcnn_tf2.model.heads import BoxHead, MaskHead, RPNHead
from mrcnn_tf2.model.mask_rcnn import MaskRCNN
from mrcnn_tf2.model.stages import (DetectionGenerator, MaskTargetGenerator, ProposalGenerator, RoIAligner,
                                    RoISampler)
from mrcnn_tf2.ops.anchors import generate_anchors
from mrcnn_tf2.ops.fused import use_fused

# RoIAlign output sides of the box and mask heads (Mask R-CNN paper); the mask head doubles the latter.
BOX_ROI_SIZE = 7
MASK_ROI_SIZE = 14


def build_model(config, export=False):
    """A MaskRCNN for `config` (a mrcnn_tf2.config.Config), with freshly initialised weights.

    The non-learned stages run the fused C++ ops as `runtime.custom_ops` says, except with `export=True`:
    an exported SavedModel must load without the ops library. `runtime.xla` compiles the dense layers. Raises `fused.CustomOpsUnavailable` when custom_ops is 'on' and the library is unusable.
    """
    config = config.resolved()
    model, data = config.model, config.data
    fused = not export and use_fused(config.runtime.custom_ops)
    # The 3x3 convs' fused ops would sit inside the XLA-compiled layers of --xla, which cannot hold them.
    fused_convs = fused and not config.runtime.xla
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
        box_roi_aligner=RoIAligner(BOX_ROI_SIZE, fused=fused),
        mask_roi_aligner=RoIAligner(MASK_ROI_SIZE, fused=fused),
        mask_target_generator=MaskTargetGenerator(model.mrcnn_resolution, fused=fused),
        detection_generator=DetectionGenerator(
            max_detections=model.test.test_detections_per_image,
            nms_threshold=model.test.test_nms,
            bbox_reg_weights=tuple(model.bbox_reg_weights),
        ),
        anchors=generate_anchors(
            anchors.min_level, anchors.max_level, anchors.num_scales, anchors.aspect_ratios,
            anchors.anchor_scale, data.image_size,
        ),
        jit_dense=config.runtime.xla and not export,
        loss_weights={
            "rpn_box": model.loss.rpn_box_loss_weight,
            "fast_rcnn_box": model.loss.fast_rcnn_box_loss_weight,
            "mask": model.loss.mrcnn_weight_loss_mask,
        },
        l2_weight_decay=config.train.l2_weight_decay,
    )
