"""The Keras Mask R-CNN: wires backbone, FPN, heads and the non-learned stages; computes the losses.

The model builds nothing itself: `mrcnn_tf2.model.factory.build_model(config)` makes the parts and passes
them in. It must not read the config, nor hold op details (those live in `mrcnn_tf2.ops`).
"""

import keras
import tensorflow as tf

from mrcnn_tf2.model import losses as loss_fns
from mrcnn_tf2.model.stages import align_together
from mrcnn_tf2.model.tracking import TracksSublayers

# RoIs are pooled from P2..P5 (Mask R-CNN's level rule never reaches P6, which only feeds the RPN).
ROI_MAX_LEVEL = 5


class MaskRCNN(TracksSublayers, keras.Model):
    """Mask R-CNN with a ResNet-FPN backbone.

    Inputs: a dict of batched tensors as `mrcnn_tf2.data.pipeline.InputPipeline` makes them:
      images [B, H, W, 3] float32 (ImageNet-normalised, padded bottom/right to the model's image size),
      image_info [B, 5] float32 [scaled_h, scaled_w, 1 / scale, original_h, original_w];
      for training also gt_boxes [B, M, 4] (pixels of the padded input, [ymin, xmin, ymax, xmax], -1 padded),
      gt_classes [B, M] int32 (-1 padded), gt_masks [B, M, S, S] float32 (each instance's mask cropped to
      its box), rpn_score_targets {level: [B, H_l, W_l, A]} int32, rpn_box_targets {level: [B, H_l, W_l, 4A]}.

    Training (`call(inputs, training=True)`, `train_step`): the raw head outputs and the sampled targets;
    `compute_losses` turns them into the loss dict (loss_rpn_score, loss_rpn_box, loss_fast_rcnn_class,
    loss_fast_rcnn_box, loss_mask, loss_l2, loss_total), all float32 scalars.

    Inference (`call(inputs)`, `predict_step`): detection_boxes [B, D, 4] float32 in original-image pixels,
    detection_scores [B, D] float32 in [0, 1], detection_classes [B, D] int32 (1..num_classes-1, 0 in
    empty slots), detection_masks [B, D, R, R] float32 mask probabilities inside each box (with the mask
    branch), num_detections [B] int32; predict_step adds image_info and source_ids.

    Example:
      model = build_model(config)                                      # mrcnn_tf2.model.factory
      model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
      inputs = InputPipeline(config, training=True, anchors=model.anchors,
                             rpn_targets=choose_ops(config).rpn_targets)  # mrcnn_tf2.data.pipeline
      model.fit(inputs.dataset(pattern, 2), steps_per_epoch=10)
      detections = model.predict_on_batch(eval_batch)
    """

    def __init__(self, backbone, fpn, rpn_head, box_head, mask_head, proposal_generator, roi_sampler,
                 box_roi_aligner, mask_roi_aligner, mask_target_generator, detection_generator, anchor_generator,
                 image_size, loss_weights, l2_weight_decay, jit_dense=False, **kwargs):
        super().__init__(**kwargs)
        self.backbone = backbone
        self.fpn = fpn
        self.rpn_head = rpn_head
        self.box_head = box_head
        self.mask_head = mask_head  # None: Faster R-CNN
        self.proposal_generator = proposal_generator
        self.roi_sampler = roi_sampler
        self.box_roi_aligner = box_roi_aligner
        self.mask_roi_aligner = mask_roi_aligner
        self.mask_target_generator = mask_target_generator
        self.detection_generator = detection_generator
        self.anchor_generator = anchor_generator
        # (H, W) of the training input (and of evaluation's unless batches are padded to their own size).
        self.image_size = tuple(int(v) for v in image_size)
        self.loss_weights = dict(loss_weights)
        self.l2_weight_decay = l2_weight_decay
        self.jit_dense = jit_dense
        # (layer, training) -> the layer's XLA-compiled call; kept out of Keras' attribute tracking.
        object.__setattr__(self, "_compiled_layers", {})

    @property
    def anchors(self):
        """{level: [H_l*W_l*A, 4] float32 NumPy} the anchor boxes the RPN head's outputs refer to on an input
        of `image_size`, row-major over (y, x, anchor): the training input labels these (RPN targets), so
        both use the same boxes."""
        return self.anchor_generator.at(self.image_size)

    def build(self, input_shape=None):
        """Creates every variable from the parts' shapes, without a pass through the model (Keras's default
        traces `call` symbolically): a checkpoint then restores before anything runs, and no trace creates a
        variable (in a tf.function each is lifted out with an initialisation graph of its own, which made the
        first trace several times longer). `input_shape` (of the inputs' dict) is not needed."""
        self.backbone.build((None, None, None, 3))
        self.fpn.build({level: (None, None, None, c) for level, c in self.backbone.channels.items()})
        feature = (None, None, None, self.fpn.num_filters)
        self.rpn_head.build({level: feature for level in range(self.fpn.min_level, self.fpn.max_level + 1)})
        size = self.box_roi_aligner.output_size
        self.box_head.build((None, None, size, size, self.fpn.num_filters))
        if self.mask_head is not None:
            size = self.mask_roi_aligner.output_size
            self.mask_head.build([(None, None, size, size, self.fpn.num_filters), (None, None)])

    def _batch_anchors(self, images, features):
        """{level: [M_l, 4]} the anchors of this batch: its padded size and its feature grids, static when the
        shapes are (then constants, equal to `anchors` at `image_size`)."""
        return self.anchor_generator(_spatial_shape(images),
                                     {level: _spatial_shape(f) for level, f in features.items()})

    def _dense(self, layer, inputs, training):
        """layer(inputs, training=training); under jit_dense XLA-compiled once the layer is built.

        Only the learned layers (backbone, FPN, heads) are compiled: the non-learned stages in between may
        run fused custom ops, which XLA cannot compile. A layer's first call builds its variables outside
        any compiled function.
        """
        if not (self.jit_dense and layer.built):
            return layer(inputs, training=training)
        key = (id(layer), training)
        if key not in self._compiled_layers:
            self._compiled_layers[key] = tf.function(lambda x: layer(x, training=training), jit_compile=True,
                                                          autograph=False)
        return self._compiled_layers[key](inputs)

    def _features(self, images, training):
        """[B, H, W, 3] -> FPN features {level: [B, H/2**level, W/2**level, C]}."""
        return self._dense(self.fpn, self._dense(self.backbone, images, training), training)

    def call(self, inputs, training=False):
        """Training: head outputs and targets (see `forward_train`); inference: detections."""
        if training:
            return self.forward_train(inputs, training=True)
        return self.detect(inputs)

    def forward_train(self, inputs, training):
        """The loss branch: RPN outputs, sampled RoIs with their targets, box and mask head outputs.

        `training` sets the layers' mode only (test_step runs this branch with layers in inference mode).
        Returns a dict of [B, ...] tensors that `compute_losses` consumes.
        """
        image_hw = inputs["image_info"][:, :2]
        features = self._features(inputs["images"], training)
        outputs = self._dense(self.rpn_head, features, training)
        # Proposals and sampled RoIs are treated as constants: no gradient flows into box coordinates.
        proposals = self.proposal_generator(
            _stop_gradient(outputs["rpn_scores"]), _stop_gradient(outputs["rpn_boxes"]),
            self._batch_anchors(inputs["images"], features), image_hw, training=True,
        )
        sample = self.roi_sampler(tf.stop_gradient(proposals["rois"]), inputs["gt_boxes"], inputs["gt_classes"])
        roi_maps = {level: f for level, f in features.items() if level <= ROI_MAX_LEVEL}
        if self.mask_head is None:
            box_features = self.box_roi_aligner(roi_maps, sample["rois"])
        else:
            # Both RoIAligns at once: their gradients of the feature maps are one (align_together).
            fg = self._foreground_slots(sample)
            box_features, mask_features = align_together(
                [self.box_roi_aligner, self.mask_roi_aligner], roi_maps, [sample["rois"], sample["rois"][:, fg]])
        outputs.update(self._dense(self.box_head, box_features, training))
        outputs.update(sample)
        if self.mask_head is not None:
            outputs.update(self._mask_branch_train(inputs, mask_features, sample, fg, training))
        return outputs

    def _foreground_slots(self, sample):
        """The slice of the first F sampled slots, which hold every foreground RoI.

        sample_rois puts foreground slots first and never samples more than max_foreground of them, so
        the first F = (most foreground slots of any image in the batch, at least 1) slots hold every
        foreground RoI; slots after an image's own foreground are masked by mask_valid. F is dynamic: the
        mask head, the costliest part of the step, runs on no slot that no image needs.
        """
        is_fg = sample["is_foreground"][:, :self.roi_sampler.max_foreground]
        return slice(0, tf.maximum(tf.reduce_max(tf.reduce_sum(tf.cast(is_fg, tf.int32), axis=1)), 1))

    def _mask_branch_train(self, inputs, mask_features, sample, fg, training):
        """Mask logits and targets for the foreground RoIs, the slots `fg` (`_foreground_slots`), from their
        RoI features [B, F, S, S, C]."""
        fg_rois = sample["rois"][:, fg]
        fg_classes = sample["class_targets"][:, fg]
        fg_gt = sample["matched_gt_indices"][:, fg]
        return {
            "mask_logits": self._dense(self.mask_head, (mask_features, fg_classes), training),
            "mask_targets": self.mask_target_generator(
                fg_rois, sample["matched_gt_boxes"][:, fg], tf.gather(inputs["gt_masks"], fg_gt, batch_dims=1)
            ),
            "mask_valid": sample["is_foreground"][:, fg],
        }

    def compute_losses(self, inputs, outputs):
        """{loss name: float32 scalar} from `forward_train`'s outputs and the input targets.

        Terms are weighted as configured; loss_total is their sum, the L2 term included.
        """
        weights = self.loss_weights
        losses = loss_fns.rpn_losses(
            outputs["rpn_scores"], outputs["rpn_boxes"], inputs["rpn_score_targets"], inputs["rpn_box_targets"]
        )
        losses["loss_rpn_box"] *= weights["rpn_box"]
        losses.update(
            loss_fns.fast_rcnn_losses(
                outputs["class_logits"], outputs["box_deltas"], outputs["class_targets"], outputs["box_targets"],
                outputs["is_valid"],
            )
        )
        losses["loss_fast_rcnn_box"] *= weights["fast_rcnn_box"]
        if self.mask_head is not None:
            losses.update(loss_fns.mask_loss(outputs["mask_logits"], outputs["mask_targets"], outputs["mask_valid"]))
            losses["loss_mask"] *= weights["mask"]
        losses.update(loss_fns.l2_loss(self.trainable_variables, self.l2_weight_decay))
        losses["loss_total"] = tf.add_n(list(losses.values()))
        return losses

    def detect(self, inputs):
        """Inference: detections in original-image pixels (see the class docstring)."""
        image_info = inputs["image_info"]
        image_hw = image_info[:, :2]
        features = self._features(inputs["images"], training=False)
        rpn = self._dense(self.rpn_head, features, False)
        proposals = self.proposal_generator(rpn["rpn_scores"], rpn["rpn_boxes"],
                                            self._batch_anchors(inputs["images"], features), image_hw, training=False)
        roi_maps = {level: f for level, f in features.items() if level <= ROI_MAX_LEVEL}
        heads = self._dense(self.box_head, self.box_roi_aligner(roi_maps, proposals["rois"]), False)
        detections = self.detection_generator(heads["class_logits"], heads["box_deltas"], proposals["rois"], image_hw)
        boxes = detections["detection_boxes"]  # pixels of the padded input
        if self.mask_head is not None:
            mask_features = self.mask_roi_aligner(roi_maps, boxes)
            mask_logits = self._dense(self.mask_head, (mask_features, detections["detection_classes"]), False)
            detections["detection_masks"] = tf.sigmoid(mask_logits)
        # Per axis, original / resized size: the resize stretched each axis by its own rounded ratio.
        detections["detection_boxes"] = boxes * tf.tile(image_info[:, None, 3:5] / image_info[:, None, 0:2], [1, 1, 2])
        return detections

    def compute_gradients(self, data, loss_multiplier=1.0):
        """(losses, gradients of loss_total * loss_multiplier w.r.t. trainable_variables).

        Under mixed_float16 the multiplier carries the loss scale (`optimizer.scale_loss(1.0)`), which the
        LossScaleOptimizer's apply_gradients divides out again.
        """
        with tf.GradientTape() as tape:
            losses = self.compute_losses(data, self.forward_train(data, training=True))
            # The L2 loss's gradients are added after the tape's, each once its kernel's gradient exists.
            taped = tf.add_n([value for name, value in losses.items() if name not in ("loss_l2", "loss_total")])
            scaled = taped * loss_multiplier
        gradients = tape.gradient(scaled, self.trainable_variables)
        return losses, loss_fns.add_l2_gradients(self.trainable_variables, gradients, self.l2_weight_decay,
                                                 loss_multiplier)

    def train_step(self, data):
        # Keras's compile wraps the optimizer in a LossScaleOptimizer under mixed_float16.
        losses, gradients = self.compute_gradients(data, self.optimizer.scale_loss(1.0))
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        return losses

    def test_step(self, data):
        return self.compute_losses(data, self.forward_train(data, training=False))

    def predict_step(self, data):
        detections = self.detect(data)
        detections.update({key: data[key] for key in ("image_info", "source_ids") if key in data})
        return detections


def _spatial_shape(tensor):
    """(H, W) ints of a [B, H, W, C] tensor when static, else its int32 [2] dynamic shape."""
    static = tensor.shape[1:3]
    return tuple(static) if static.is_fully_defined() else tf.shape(tensor)[1:3]


def _stop_gradient(tensors):
    return {level: tf.stop_gradient(t) for level, t in tensors.items()}
