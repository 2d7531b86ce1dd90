"""Mask R-CNN's losses: pure float32 functions of head outputs and targets, each returning scalars.

Normalisations (what each sum is divided by) follow Detectron and torchvision: the RPN terms by the number
of anchors sampled for the loss, the Fast R-CNN terms by the number of valid sampled RoIs, the mask term
by the number of foreground mask pixels. An image or batch with nothing to learn from (no sampled anchor,
no foreground RoI) gives a zero loss that still depends on the outputs, so gradients stay connected.

This module must not sample, match or encode: targets arrive ready from the input pipeline and the RoI
sampler.

Glossary: B batch, A anchors per cell, S sampled RoIs per image, F foreground RoI slots per image,
K classes (with background 0), R mask resolution.
"""

import tensorflow as tf

# Smooth-L1 transition point of the RPN box loss (Detectron, torchvision): small deltas are quadratic.
RPN_SMOOTH_L1_BETA = 1.0 / 9.0
# Smooth-L1 transition point of the Fast R-CNN box loss (NVIDIA's Huber delta 1).
FAST_RCNN_SMOOTH_L1_BETA = 1.0


def smooth_l1(diff, beta):
    """Elementwise smooth-L1: 0.5 * d**2 / beta where |d| < beta, |d| - 0.5 * beta elsewhere."""
    abs_diff = tf.abs(diff)
    return tf.where(abs_diff < beta, 0.5 * tf.square(diff) / beta, abs_diff - 0.5 * beta)


def _flatten_levels(tensors, last):
    """{level: [B, H, W, C]} -> [B, sum(H*W*C) / last, last], levels in ascending order."""
    batch = tf.shape(next(iter(tensors.values())))[0]
    return tf.concat([tf.reshape(tf.cast(tensors[k], tf.float32), [batch, -1, last]) for k in sorted(tensors)], 1)


def rpn_losses(rpn_scores, rpn_boxes, rpn_score_targets, rpn_box_targets):
    """RPN objectness and box losses.

    Args:
      rpn_scores: {level: [B, H, W, A]} objectness logits.
      rpn_boxes: {level: [B, H, W, 4A]} box deltas (dy, dx, dh, dw) per anchor.
      rpn_score_targets: {level: [B, H, W, A]} int32: 1 positive, 0 negative, -1 not sampled.
      rpn_box_targets: {level: [B, H, W, 4A]} float32 encoded targets (weights 1), used where positive.

    Returns:
      {'loss_rpn_score': binary cross-entropy summed over sampled anchors / number sampled,
       'loss_rpn_box': smooth-L1 (beta 1/9) summed over positive anchors / number sampled}.
    """
    scores = _flatten_levels(rpn_scores, 1)[..., 0]
    labels = _flatten_levels(rpn_score_targets, 1)[..., 0]
    sampled = tf.cast(labels >= 0, tf.float32)
    positive = tf.cast(labels > 0, tf.float32)
    normalizer = tf.maximum(tf.reduce_sum(sampled), 1.0)
    bce = tf.nn.sigmoid_cross_entropy_with_logits(labels=positive, logits=scores)
    deltas = _flatten_levels(rpn_boxes, 4)
    targets = _flatten_levels(rpn_box_targets, 4)
    box = tf.reduce_sum(smooth_l1(deltas - targets, RPN_SMOOTH_L1_BETA), axis=-1)
    return {
        "loss_rpn_score": tf.reduce_sum(bce * sampled) / normalizer,
        "loss_rpn_box": tf.reduce_sum(box * positive) / normalizer,
    }


def fast_rcnn_losses(class_logits, box_deltas, class_targets, box_targets, valid):
    """Box head classification and regression losses.

    Args:
      class_logits: [B, S, K] logits.
      box_deltas: [B, S, K, 4] class-specific deltas.
      class_targets: [B, S] int32 in [0, K), 0 = background.
      box_targets: [B, S, 4] float32 encoded targets of the matched GT (bbox_reg_weights applied).
      valid: [B, S] bool, False for RoI slots left empty by the sampler.

    Returns:
      {'loss_fast_rcnn_class': softmax cross-entropy averaged over valid RoIs,
       'loss_fast_rcnn_box': smooth-L1 (beta 1) of the GT class's deltas, summed over foreground RoIs
       and divided by the number of valid RoIs}.
    """
    class_logits = tf.cast(class_logits, tf.float32)
    box_deltas = tf.cast(box_deltas, tf.float32)
    weight = tf.cast(valid, tf.float32)
    normalizer = tf.maximum(tf.reduce_sum(weight), 1.0)
    ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.maximum(class_targets, 0), logits=class_logits)
    # The deltas predicted for each RoI's own GT class: [B, S, K, 4] -> [B, S, 4].
    own_deltas = tf.gather(box_deltas, tf.maximum(class_targets, 0), batch_dims=2)
    foreground = weight * tf.cast(class_targets > 0, tf.float32)
    box = tf.reduce_sum(smooth_l1(own_deltas - box_targets, FAST_RCNN_SMOOTH_L1_BETA), axis=-1)
    return {
        "loss_fast_rcnn_class": tf.reduce_sum(ce * weight) / normalizer,
        "loss_fast_rcnn_box": tf.reduce_sum(box * foreground) / normalizer,
    }


def mask_loss(mask_logits, mask_targets, valid):
    """Mask branch loss.

    Args:
      mask_logits: [B, F, R, R] logits of each foreground RoI's GT class channel.
      mask_targets: [B, F, R, R] float32 in {0, 1}.
      valid: [B, F] bool, True for foreground RoIs (slots beyond them are padding).

    Returns:
      {'loss_mask': binary cross-entropy averaged over the pixels of valid RoIs}.
    """
    mask_logits = tf.cast(mask_logits, tf.float32)
    weight = tf.cast(valid, tf.float32)[:, :, None, None]
    bce = tf.nn.sigmoid_cross_entropy_with_logits(labels=mask_targets, logits=mask_logits)
    pixels = tf.reduce_sum(weight) * float(mask_logits.shape[-1] * mask_logits.shape[-2])
    return {"loss_mask": tf.reduce_sum(bce * weight) / tf.maximum(pixels, 1.0)}


def l2_loss(variables, weight_decay):
    """{'loss_l2': weight_decay * sum(w**2) / 2} over the kernels among `variables` (no biases, no batch norm).

    Args:
      variables: Keras or tf variables; those whose path/name marks a bias or a batch-norm parameter
        (gamma, beta, moving statistics) are left out.
      weight_decay: float L2 coefficient.
    """
    kernels = [v for v in variables if is_decayed(v)]
    total = tf.add_n([tf.nn.l2_loss(tf.cast(v, tf.float32)) for v in kernels]) if kernels else tf.constant(0.0)
    return {"loss_l2": weight_decay * total}


def add_l2_gradients(variables, gradients, weight_decay, multiplier=1.0):
    """`gradients` (of the other losses) plus those of l2_loss times `multiplier`: g + multiplier * weight_decay * w
    for the decayed kernels, each computed once g exists. The L2 loss's own gradients, taped, need only the
    variables: TensorFlow's executor would make them all at the start of the backward pass and hold them to
    its end (a copy of every trained kernel at the step's peak).

    Args:
      variables: the variables `gradients` belong to, in order.
      gradients: one tensor (or None: no path from the other losses) per variable.
      weight_decay: float L2 coefficient; multiplier: float or scalar tensor (a loss scale).

    Returns:
      list of the gradients with the L2 loss's added (None stays None for a variable without weight decay).
    """
    summed = []
    for variable, gradient in zip(variables, gradients):
        if weight_decay and is_decayed(variable):
            dependencies = [] if gradient is None else [gradient]
            with tf.control_dependencies(dependencies):
                decay = tf.cast(tf.convert_to_tensor(variable), tf.float32) * (multiplier * weight_decay)
            gradient = decay if gradient is None else gradient + tf.cast(decay, gradient.dtype)
        summed.append(gradient)
    return summed


def is_decayed(variable):
    """Whether weight decay applies: Keras names convolution and dense weights 'kernel', while biases are
    'bias' and batch-norm parameters 'gamma', 'beta', 'moving_mean', 'moving_variance'."""
    name = getattr(variable, "path", None) or variable.name
    return name.rsplit("/", 1)[-1].split(":")[0] == "kernel"
