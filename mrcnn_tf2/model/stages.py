"""The non-learned stages of Mask R-CNN: objects that bind an op to its parameters.

The model receives these as parts, like its layers, so that `call` reads as the pipeline and the factory
alone maps config to parameters. They hold no weights and must not read the config. Stages with a fused
C++ op take `fused`: True runs `mrcnn_tf2.ops.fused`, False the pure-TF twin (same signature and result);
the factory decides (`factory.choose_ops`).

Glossary: B batch, P proposals, S sampled RoIs, F foreground RoI slots, D detections, K classes.
"""

from mrcnn_tf2.ops import anchors as anchor_ops
from mrcnn_tf2.ops import fused as fused_ops
from mrcnn_tf2.ops import masks, postprocess, roi_align, roi_ops, sampling


class AnchorGenerator:
    """The anchors of a padded input: each level's base anchors over its feature grid (`grid_anchors`).

    The stride of a level is the padded input's size // the level's grid size, as torchvision computes it
    (`anchors.level_strides`): 2**level when the size is divisible by it; otherwise the coarse levels' grids
    round up (a stride-2 conv or pool of an odd size) and their stride comes out below 2**level (800 px over a
    13-cell P6: 61).
    """

    def __init__(self, min_level, max_level, num_scales, aspect_ratios, anchor_scale, offset, round_corners):
        self.params = dict(min_level=min_level, max_level=max_level, num_scales=num_scales,
                           aspect_ratios=aspect_ratios, anchor_scale=anchor_scale, offset=offset,
                           round_corners=round_corners)
        self.offset = offset
        self.base = {level: anchor_ops.base_anchors(level, num_scales, aspect_ratios, anchor_scale, round_corners)
                     for level in range(min_level, max_level + 1)}

    def at(self, image_size):
        """{level: [H_l*W_l*A, 4] float32 NumPy} the anchors of a fixed input size (`generate_anchors`)."""
        return anchor_ops.generate_anchors(image_size=image_size, **self.params)

    def __call__(self, image_hw, grids):
        """(H, W) of the padded input, {level: (H_l, W_l)} -> {level: [H_l*W_l*A, 4] float32}.

        Python ints give constant anchors; int32 [2] tensors (dynamic sizes) give them computed in the graph.
        """
        return {level: anchor_ops.grid_anchors(self.base[level], grids[level],
                                               anchor_ops.level_strides(image_hw, grids[level]), self.offset)
                for level in self.base}


class ProposalGenerator:
    """RPN outputs -> proposals, with separate train and test budgets (`multilevel_propose_rois`)."""

    def __init__(self, train_pre_nms_topn, train_post_nms_topn, train_nms_threshold,
                 test_pre_nms_topn, test_post_nms_topn, test_nms_threshold, min_size, fused=False):
        self.fused = fused
        self._propose = fused_ops.multilevel_propose_rois if fused else roi_ops.multilevel_propose_rois
        self.train = dict(pre_nms_topn=train_pre_nms_topn, post_nms_topn=train_post_nms_topn,
                          nms_threshold=train_nms_threshold, min_size=min_size)
        self.test = dict(pre_nms_topn=test_pre_nms_topn, post_nms_topn=test_post_nms_topn,
                         nms_threshold=test_nms_threshold, min_size=min_size)

    def __call__(self, rpn_scores, rpn_boxes, anchors, image_hw, training):
        """{level: [B,H,W,A]}, {level: [B,H,W,4A]}, {level: [M_l,4]}, [B,2] -> {'rois' [B,P,4], 'roi_scores'}."""
        params = self.train if training else self.test
        return self._propose(rpn_scores, rpn_boxes, anchors, image_hw, **params)


class RoISampler:
    """Proposals + ground truth -> the RoIs the heads train on, with their targets (`sample_rois`)."""

    def __init__(self, batch_size_per_im, fg_fraction, fg_thresh, bg_thresh_hi, bg_thresh_lo, bbox_reg_weights):
        self.params = dict(batch_size_per_im=batch_size_per_im, fg_fraction=fg_fraction, fg_thresh=fg_thresh,
                           bg_thresh_hi=bg_thresh_hi, bg_thresh_lo=bg_thresh_lo,
                           bbox_reg_weights=bbox_reg_weights)
        # Foreground slots the mask branch trains on: the most the sampler can return.
        self.max_foreground = int(round(batch_size_per_im * fg_fraction))

    def __call__(self, proposals, gt_boxes, gt_classes):
        """[B,P,4], [B,K,4], [B,K] -> sample_rois' dict of [B,S,...] tensors."""
        return sampling.sample_rois(proposals, gt_boxes, gt_classes, **self.params)


class RoIAligner:
    """Multilevel RoIAlign at a fixed output size (`multilevel_roi_align`); `aligned` is torchvision's."""

    def __init__(self, output_size, sampling_ratio=2, aligned=True, fused=False):
        self.output_size = output_size
        self.sampling_ratio = sampling_ratio
        self.aligned = aligned
        self.fused = fused
        self._align = fused_ops.multilevel_roi_align if fused else roi_align.multilevel_roi_align

    def __call__(self, features, boxes):
        """{level: [B,H_l,W_l,C]}, [B,N,4] -> [B,N,output_size,output_size,C]."""
        return self._align(features, boxes, self.output_size, self.sampling_ratio, self.aligned)


def align_together(aligners, features, boxes):
    """[aligner(features, b) for aligner, b in zip(aligners, boxes)] with one feature gradient where the
    aligners are fused and sample alike (`fused_ops.multilevel_roi_aligns`): each adds into the gradient of the
    ones before it in place, where TensorFlow would hold one gradient of the features' size per aligner."""
    if all(a.fused for a in aligners) and len({(a.sampling_ratio, a.aligned) for a in aligners}) == 1:
        return fused_ops.multilevel_roi_aligns(features, boxes, [a.output_size for a in aligners],
                                               aligners[0].sampling_ratio, aligners[0].aligned)
    return [aligner(features, b) for aligner, b in zip(aligners, boxes, strict=True)]


class MaskTargetGenerator:
    """GT mask crops of matched instances -> per-RoI mask targets (`mask_targets`)."""

    def __init__(self, output_size, fused=False):
        self.output_size = output_size
        self.fused = fused
        self._targets = fused_ops.mask_targets if fused else masks.mask_targets

    def __call__(self, rois, matched_gt_boxes, matched_gt_masks):
        """[B,F,4], [B,F,4], [B,F,M,M] -> [B,F,R,R] float32 in {0, 1}."""
        return self._targets(rois, matched_gt_boxes, matched_gt_masks, self.output_size)


class DetectionGenerator:
    """Box head outputs -> final detections per image (`generate_detections`)."""

    def __init__(self, max_detections, nms_threshold, score_threshold, min_box_size, bbox_reg_weights):
        self.params = dict(max_detections=max_detections, nms_threshold=nms_threshold,
                           score_threshold=score_threshold, min_box_size=min_box_size,
                           bbox_reg_weights=bbox_reg_weights)

    def __call__(self, class_logits, box_deltas, rois, image_hw):
        """[B,N,K], [B,N,K,4], [B,N,4], [B,2] -> dict of detection_* [B,D,...] and num_detections [B]."""
        return postprocess.generate_detections(class_logits, box_deltas, rois, image_hw, **self.params)
