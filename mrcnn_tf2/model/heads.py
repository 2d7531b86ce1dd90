"""Mask R-CNN's learned heads: RPN (on every FPN level), box head and mask head (on RoI features).

Glossary: B batch, L FPN levels, A anchors per cell, N RoIs per image, K classes (0 = background),
C feature channels, S RoI side.

Output dtype: the final layer of every head is a float32 layer (dtype='float32'), so logits and deltas are
float32 even under a mixed precision policy: the losses, proposal decoding and NMS run in float32, and
bfloat16 deltas would lose the precision box decoding needs. The hidden layers follow the global policy.

Initialisers follow Detectron: RPN convs normal(0.01), class logits normal(0.01), box deltas
normal(0.001), mask logits normal(0.001) (Detectron2), all with zero bias; FC layers Caffe2 XavierFill
(uniform, variance 1 / fan_in); the other mask convs and the box head's convs He normal with fan_out.

Options of torchvision's maskrcnn_resnet50_fpn_v2: more RPN convs (`num_convs`), convs before a single FC
layer in the box head, batch norm in the box and mask heads' convs (`batch_norm`: a conv without bias, then
batch norm, then ReLU; backbone.conv_layer says how the norms train).

This module must not decode boxes, select RoIs or compute losses.
"""

import math

import keras
import tensorflow as tf

from mrcnn_tf2.model.backbone import Conv2D, conv_layer, he_normal_fan_out
from mrcnn_tf2.model.fpn import xavier_fill
from mrcnn_tf2.model.tracking import TracksSublayers
from mrcnn_tf2.ops import conv as conv_ops

RPN_INIT_STDDEV = 0.01
CLASS_INIT_STDDEV = 0.01
BOX_INIT_STDDEV = 0.001
MASK_LOGITS_INIT_STDDEV = 0.001
BOX_CODE_SIZE = 4  # (dy, dx, dh, dw)


def _normal(stddev):
    return keras.initializers.RandomNormal(stddev=stddev)


@keras.saving.register_keras_serializable(package="mrcnn_tf2")
class RPNHead(TracksSublayers, keras.layers.Layer):
    """Region proposal head, one set of weights shared by all levels.

    num_convs 3x3 convs (num_filters, ReLU each), then two 1x1 convs: objectness (one logit per anchor) and
    box deltas. Layers `rpn_conv`, `rpn_conv2`, ... (`convs`), `rpn_scores`, `rpn_boxes`.

    Args:
      num_anchors: A, anchors per feature-map cell.
      num_filters: width of the 3x3 convs.
      conv_route: conv_ops.conv2d's route for its convs (conv_ops.ROUTES; the factory picks it per device).
      num_convs: number of 3x3 convs (torchvision's conv_depth: 1 in Mask R-CNN v1, 2 in v2).

    call(features, training=None):
      features: {level: [B, H_l, W_l, C]} FPN maps.
      Returns {'rpn_scores': {level: [B, H_l, W_l, A]} float32 logits,
               'rpn_boxes': {level: [B, H_l, W_l, 4A]} float32 deltas}. Channels [4a, 4a + 4) of
      rpn_boxes are (dy, dx, dh, dw) of anchor a, whose objectness is channel a of rpn_scores; the anchor
      generator orders a cell's anchors the same way.
    """

    def __init__(self, num_anchors, num_filters=256, conv_route=conv_ops.CPU, num_convs=1, **kwargs):
        super().__init__(**kwargs)
        if num_convs < 1:
            raise ValueError(f"RPNHead num_convs {num_convs} must be >= 1")
        self.num_anchors = num_anchors
        self.num_filters = num_filters
        self.conv_route = conv_route
        self.num_convs = num_convs
        conv = dict(bias_initializer="zeros", conv_route=conv_route)
        self.convs = [conv_layer(num_filters, 3, batch_norm=False, relu=True,
                                 kernel_initializer=_normal(RPN_INIT_STDDEV), conv_route=conv_route,
                                 name="rpn_conv" if i == 1 else f"rpn_conv{i}")
                      for i in range(1, num_convs + 1)]
        # The first conv also under the attribute checkpoints written before num_convs existed name it by.
        self.conv = self.convs[0]
        self.score_conv = Conv2D(
            num_anchors, 1, kernel_initializer=_normal(RPN_INIT_STDDEV), dtype="float32", name="rpn_scores", **conv,
        )
        self.box_conv = Conv2D(
            BOX_CODE_SIZE * num_anchors, 1, kernel_initializer=_normal(RPN_INIT_STDDEV), dtype="float32",
            name="rpn_boxes", **conv,
        )

    def build(self, input_shape):
        shape = next(iter(input_shape.values()))
        hidden = tuple(shape[:-1]) + (self.num_filters,)
        for conv, conv_input in zip(self.convs, [shape] + [hidden] * (self.num_convs - 1)):
            conv.build(conv_input)
        self.score_conv.build(hidden)
        self.box_conv.build(hidden)

    def call(self, features, training=None):
        scores, boxes = {}, {}
        for level, feature in features.items():
            hidden = feature
            for conv in self.convs:
                hidden = conv(hidden)
            scores[level] = self.score_conv(hidden)
            boxes[level] = self.box_conv(hidden)
        return {"rpn_scores": scores, "rpn_boxes": boxes}

    def get_config(self):
        config = super().get_config()
        config.update(num_anchors=self.num_anchors, num_filters=self.num_filters, conv_route=self.conv_route,
                      num_convs=self.num_convs)
        return config


@keras.saving.register_keras_serializable(package="mrcnn_tf2")
class BoxHead(TracksSublayers, keras.layers.Layer):
    """Fast R-CNN box head: num_convs 3x3 convs (ReLU), one or two FC layers (ReLU), then class logits and
    class-specific box deltas.

    Detectron's head is two FC layers (the default); torchvision's maskrcnn_resnet50_fpn_v2 has four convs
    with batch norm and one FC layer. Layers `box_conv1`, ... (`convs`), `fc6`, `fc7` (absent with one FC
    layer: `fc7` is None), `class_logits`, `box_deltas`.

    Args:
      num_classes: K, background included.
      mlp_head_dim: width of the FC layers.
      num_fcs: 1 or 2 FC layers.
      num_convs: number of 3x3 convs before them (0: none).
      conv_dim: width of the convs.
      batch_norm: batch norm after every conv, which then has no bias (layers `backbone.ConvBN`).
      conv_route: conv_ops.conv2d's route for the convs (conv_ops.ROUTES; the factory picks it per device).

    call(roi_features, training=None):
      roi_features: [B, N, S, S, C] RoIAlign output (S = 7 in Mask R-CNN).
      Returns {'class_logits': [B, N, K] float32,
               'box_deltas': [B, N, K, 4] float32 (dy, dx, dh, dw) for each class}.
      Reshape trail: [B, N, S, S, C] -> [B*N, S, S, C] -> convs -> [B*N, S, S, C'] -> [B*N, S*S*C'] -> FCs
      -> [B*N, K], [B*N, 4K] -> [B, N, K], [B, N, K, 4] (C' = conv_dim, or C without convs). fc6 reads the
      flattened [S, S, C'] (torchvision flattens [C', S, S]: a weight converter reorders fc6's input rows).
    """

    def __init__(self, num_classes, mlp_head_dim=1024, num_fcs=2, num_convs=0, conv_dim=256, batch_norm=False,
                 conv_route=conv_ops.CPU, **kwargs):
        super().__init__(**kwargs)
        if num_fcs not in (1, 2):
            raise ValueError(f"BoxHead num_fcs {num_fcs} must be 1 or 2")
        if num_convs < 0:
            raise ValueError(f"BoxHead num_convs {num_convs} must be >= 0")
        self.num_classes = num_classes
        self.mlp_head_dim = mlp_head_dim
        self.num_fcs = num_fcs
        self.num_convs = num_convs
        self.conv_dim = conv_dim
        self.batch_norm = batch_norm
        self.conv_route = conv_route
        self.convs = [conv_layer(conv_dim, 3, batch_norm=batch_norm, relu=True, kernel_initializer=he_normal_fan_out(),
                                 conv_route=conv_route, name=f"box_conv{i}")
                      for i in range(1, num_convs + 1)]
        fc = dict(units=mlp_head_dim, activation="relu", kernel_initializer=xavier_fill(), bias_initializer="zeros")
        self.fc6 = keras.layers.Dense(name="fc6", **fc)
        self.fc7 = keras.layers.Dense(name="fc7", **fc) if num_fcs == 2 else None
        self.class_dense = keras.layers.Dense(
            num_classes, kernel_initializer=_normal(CLASS_INIT_STDDEV), bias_initializer="zeros", dtype="float32",
            name="class_logits",
        )
        self.box_dense = keras.layers.Dense(
            BOX_CODE_SIZE * num_classes, kernel_initializer=_normal(BOX_INIT_STDDEV), bias_initializer="zeros",
            dtype="float32", name="box_deltas",
        )

    def build(self, input_shape):
        if len(input_shape) != 5:
            raise ValueError(f"BoxHead expects RoI features [B, N, S, S, C], got shape {tuple(input_shape)}")
        shape = (None,) + tuple(input_shape[2:])
        for conv in self.convs:
            conv.build(shape)
            shape = shape[:-1] + (self.conv_dim,)
        self.fc6.build((None, math.prod(shape[1:])))
        if self.fc7 is not None:
            self.fc7.build((None, self.mlp_head_dim))
        self.class_dense.build((None, self.mlp_head_dim))
        self.box_dense.build((None, self.mlp_head_dim))

    def call(self, roi_features, training=None):
        batch, num_rois = _batch_and_rois(roi_features)
        x = tf.reshape(roi_features, [-1] + list(roi_features.shape[2:]))
        for conv in self.convs:
            x = conv(x, training=training)
        x = self.fc6(tf.reshape(x, [-1, math.prod(x.shape[1:])]))
        if self.fc7 is not None:
            x = self.fc7(x)
        return {
            "class_logits": tf.reshape(self.class_dense(x), [batch, num_rois, self.num_classes]),
            "box_deltas": tf.reshape(self.box_dense(x), [batch, num_rois, self.num_classes, BOX_CODE_SIZE]),
        }

    def get_config(self):
        config = super().get_config()
        config.update(num_classes=self.num_classes, mlp_head_dim=self.mlp_head_dim, num_fcs=self.num_fcs,
                      num_convs=self.num_convs, conv_dim=self.conv_dim, batch_norm=self.batch_norm,
                      conv_route=self.conv_route)
        return config


class ClassMaskLogits(Conv2D):
    """The mask head's 1x1 logits conv (kernel [1, 1, C, K]) applied to one class column per RoI.

    A Conv2D for its weights (the per-class conv's, as checkpoints hold them) and for its own dtype policy
    (float32 logits under mixed precision).

    call((features [N, R, R, C], classes [N] int in [0, K))) -> [N, R, R] logits of each RoI's class.
    """

    def build(self, input_shape):
        """input_shape: the features' [N, R, R, C]."""
        super().build(input_shape)
        self.input_spec = None  # Conv2D's spec admits one input; call takes (features, classes)

    def call(self, inputs):
        features, classes = inputs
        # Selected by one-hot products, not gathers: dense gradients, which the optimizer, gradient
        # accumulation and the allreduce take as they take every other one (a gather's are IndexedSlices).
        one_hot = tf.one_hot(tf.cast(classes, tf.int32), self.filters, dtype=features.dtype)  # [N, K]
        kernel = tf.matmul(self.kernel[0, 0], one_hot, transpose_b=True)  # [C, N]
        bias = tf.linalg.matvec(one_hot, self.bias)  # [N]
        return tf.einsum("nyxc,cn->nyx", features, kernel) + bias[:, None, None]


@keras.saving.register_keras_serializable(package="mrcnn_tf2")
class MaskHead(TracksSublayers, keras.layers.Layer):
    """Mask head: num_convs 3x3 convs (ReLU), a 2x2 stride-2 transposed conv (ReLU), 1x1 class logits.

    Layers `mask_conv1`, ... (`convs`), `mask_deconv`, `mask_logits`.

    Args:
      num_classes: K, background included (its logits column is read only for padded slots).
      num_filters: width of the convs and the transposed conv.
      num_convs: number of 3x3 convs.
      conv_route: conv_ops.conv2d's route for the 3x3 convs (conv_ops.ROUTES; the factory picks it per device).
      batch_norm: batch norm after every 3x3 conv, which then has no bias (layers `backbone.ConvBN`). In
        training its batch statistics are over the RoIs the head runs on: every image's first F slots, F the
        most foreground RoIs of any image in the batch, so they include the background slots of images with
        fewer (torchvision's are over foreground RoIs only).

    call((roi_features, classes), training=None):
      roi_features: [B, N, S, S, C] RoIAlign output (S = 14 in Mask R-CNN).
      classes: [B, N] int32 in [0, K): the class whose mask each RoI needs (padded slots may use 0).
      Returns [B, N, 2S, 2S] float32 mask logits of each RoI's class. The 1x1 logits conv ([1, 1, C, K],
      the `mask_logits` layer's weights) is applied to that class's column alone: training and inference
      only ever read one class's mask, and all K channels cost K times the reads and products.
      Reshape trail: [B, N, S, S, C] -> [B*N, S, S, C] -> convs -> [B*N, 2S, 2S, C] -> [B, N, 2S, 2S].
    """

    def __init__(self, num_classes, num_filters=256, num_convs=4, conv_route=conv_ops.CPU, batch_norm=False,
                 **kwargs):
        super().__init__(**kwargs)
        self.num_classes = num_classes
        self.num_filters = num_filters
        self.num_convs = num_convs
        self.conv_route = conv_route
        self.batch_norm = batch_norm
        self.convs = [conv_layer(num_filters, 3, batch_norm=batch_norm, relu=True,
                                 kernel_initializer=he_normal_fan_out(), conv_route=conv_route, name=f"mask_conv{i}")
                      for i in range(1, num_convs + 1)]
        self.deconv = keras.layers.Conv2DTranspose(
            num_filters, 2, strides=2, activation="relu", name="mask_deconv", kernel_initializer=he_normal_fan_out(),
            bias_initializer="zeros",
        )
        # Small logits at the start (mask loss ~ log 2), whatever the number of classes: He init with
        # fan_out = K would give logits of std ~ sqrt(2 / K) times the activations.
        self.logits = ClassMaskLogits(num_classes, 1, dtype="float32", name="mask_logits",
                                      kernel_initializer=_normal(MASK_LOGITS_INIT_STDDEV),
                                      bias_initializer="zeros")

    def build(self, input_shape):
        feature_shape = input_shape[0]
        if len(feature_shape) != 5:
            raise ValueError(f"MaskHead expects RoI features [B, N, S, S, C], got shape {tuple(feature_shape)}")
        shape = (None,) + tuple(feature_shape[2:])
        for conv in self.convs:
            conv.build(shape)
            shape = shape[:-1] + (self.num_filters,)
        self.deconv.build(shape)
        self.logits.build((None, 2 * shape[1], 2 * shape[2], self.num_filters))

    def call(self, inputs, training=None):
        roi_features, classes = inputs
        batch, num_rois = _batch_and_rois(roi_features)
        x = tf.reshape(roi_features, [-1] + list(roi_features.shape[2:]))
        for conv in self.convs:
            x = conv(x, training=training)
        x = self.logits((self.deconv(x), tf.reshape(classes, [-1])))
        return tf.reshape(x, [batch, num_rois] + list(x.shape[1:]))

    def get_config(self):
        config = super().get_config()
        config.update(num_classes=self.num_classes, num_filters=self.num_filters, num_convs=self.num_convs,
                      conv_route=self.conv_route, batch_norm=self.batch_norm)
        return config


def _batch_and_rois(roi_features):
    """B (dynamic) and N (static where known) of [B, N, ...] RoI features."""
    num_rois = roi_features.shape[1]
    return tf.shape(roi_features)[0], tf.shape(roi_features)[1] if num_rois is None else num_rois
