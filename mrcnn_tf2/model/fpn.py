"""Feature Pyramid Network: backbone maps {2: C2, ..., 5: C5} in, equal-width maps {min_level..max_level} out.

Each backbone level gets a lateral 1x1 conv; the top-down path adds the 2x nearest-neighbour upsampled
coarser sum; a 3x3 conv then smooths each sum (Lin et al. 2017). Levels above 5 are not computed from
the backbone: P6 = P5 subsampled with stride 2, which is NVIDIA's and Detectron's max-pool with pool size
1 and stride 2, and each further level subsamples the one below it the same way.

Convs carry a bias and use Caffe2's XavierFill (uniform, variance 1 / fan_in) as Detectron and
torchvision's FPN do. With `batch_norm` (torchvision's maskrcnn_resnet50_fpn_v2) every lateral and output
conv is followed by batch norm and has no bias; a lateral's norm comes before the top-down sum
(backbone.conv_layer says how the norms train). Tensors are NHWC; levels are int dict keys. This module
must not know about anchors or heads.
"""

import keras
import tensorflow as tf

from mrcnn_tf2.model.backbone import conv_layer
from mrcnn_tf2.model.tracking import TracksSublayers
from mrcnn_tf2.ops import conv as conv_ops

# The backbone's finest and coarsest levels (C2 at stride 4, C5 at stride 32).
BACKBONE_MIN_LEVEL = 2
BACKBONE_MAX_LEVEL = 5


def xavier_fill():
    """Caffe2's XavierFill: uniform with variance 1 / fan_in (torchvision's kaiming_uniform_(a=1))."""
    return keras.initializers.VarianceScaling(scale=1.0, mode="fan_in", distribution="uniform")


def upsample2x(x, pooled_gradient=False):
    """Nearest-neighbour 2x upsampling, [B, H, W, C] -> [B, 2H, 2W, C], one broadcast copy.

    pooled_gradient: the gradient as a 2x2 pooling (each input pixel's gradient is the sum of its 2x2 copies':
    their average times 4, exact, a power of two) in place of the broadcast's own, a Sum over the copy axes
    between H and W that TensorFlow's CPU kernels reduce slowly (P2's at 832x1088 batch 2: 71 ms, pooled 6 ms).
    """
    if not pooled_gradient:
        return _broadcast2x(x)

    @tf.custom_gradient
    def upsample(x):
        def grad(out_grad):
            return tf.nn.avg_pool2d(out_grad, 2, 2, "VALID") * 4

        return _broadcast2x(x), grad

    return upsample(x)


def _broadcast2x(x):
    shape = tf.shape(x)
    batch, height, width, channels = shape[0], shape[1], shape[2], shape[3]
    # A reshape, not x[:, :, None, :, None, :]: TFLite's builtin StridedSlice takes no new axis.
    x = tf.broadcast_to(tf.reshape(x, [batch, height, 1, width, 1, channels]), [batch, height, 2, width, 2, channels])
    static = x.shape
    out = tf.reshape(x, [batch, 2 * height, 2 * width, channels])
    return tf.ensure_shape(out, [static[0], _times2(static[1]), _times2(static[3]), static[5]])


def _times2(dim):
    return None if dim is None else 2 * dim


@keras.saving.register_keras_serializable(package="mrcnn_tf2")
class FPN(TracksSublayers, keras.layers.Layer):
    """Feature pyramid over ResNet features.

    Args:
      min_level: finest output level, in [2, 5].
      max_level: coarsest output level, >= 5; levels above 5 are stride-2 subsamplings.
      num_filters: width of every output map.
      conv_route: conv_ops.conv2d's route for every conv (conv_ops.ROUTES; the factory picks it per device);
        the CPU routes also take `upsample2x`'s pooled gradient.
      batch_norm: batch norm after every conv, which then has no bias (layers `backbone.ConvBN`).

    call(features, training=None):
      features: {level: [B, H / 2**level, W / 2**level, C_level]} for levels min_level..5 (others ignored);
        H and W multiples of 2**5 so each map is exactly twice the next coarser one.
      Returns {level: [B, H / 2**level, W / 2**level, num_filters]} for min_level..max_level in the
      compute dtype (levels above 5: ceil of the size below / 2).
    """

    def __init__(self, min_level=2, max_level=6, num_filters=256, conv_route=conv_ops.CPU, batch_norm=False, **kwargs):
        super().__init__(**kwargs)
        if not BACKBONE_MIN_LEVEL <= min_level <= BACKBONE_MAX_LEVEL:
            raise ValueError(f"FPN min_level {min_level} must be in [{BACKBONE_MIN_LEVEL}, {BACKBONE_MAX_LEVEL}]")
        if max_level < BACKBONE_MAX_LEVEL:
            raise ValueError(f"FPN max_level {max_level} must be >= {BACKBONE_MAX_LEVEL}")
        self.min_level = min_level
        self.max_level = max_level
        self.num_filters = num_filters
        self.conv_route = conv_route
        self.batch_norm = batch_norm
        levels = range(min_level, BACKBONE_MAX_LEVEL + 1)
        conv = dict(filters=num_filters, batch_norm=batch_norm, relu=False, kernel_initializer=xavier_fill(),
                    conv_route=conv_route)
        self.lateral = {level: conv_layer(kernel_size=1, name=f"fpn_lateral{level}", **conv) for level in levels}
        self.output_convs = {level: conv_layer(kernel_size=3, name=f"fpn_output{level}", **conv) for level in levels}

    def build(self, input_shape):
        missing = [level for level in self.lateral if level not in input_shape]
        if missing:
            raise ValueError(f"FPN needs backbone levels {sorted(self.lateral)}; missing {missing}")
        for level in self.lateral:
            self.lateral[level].build(input_shape[level])
            self.output_convs[level].build(tuple(input_shape[level][:-1]) + (self.num_filters,))

    def call(self, features, training=None):
        top_down = None
        outputs = {}
        for level in range(BACKBONE_MAX_LEVEL, self.min_level - 1, -1):
            # The CPU routes' pooled gradient; PLAIN keeps TensorFlow's own (a GPU's, an exported model's).
            upsampled = None if top_down is None else upsample2x(top_down, self.conv_route != conv_ops.PLAIN)
            top_down = self.lateral[level](features[level], upsampled, training=training)
            outputs[level] = self.output_convs[level](top_down, training=training)
        for level in range(BACKBONE_MAX_LEVEL + 1, self.max_level + 1):
            # Every other pixel, as a 1x1 max pool of stride 2 (torchvision's LastLevelMaxPool): OpenVINO
            # infers the wrong shape for a strided slice of a dynamic size.
            outputs[level] = tf.nn.max_pool2d(outputs[level - 1], 1, 2, "VALID")
        return {level: outputs[level] for level in range(self.min_level, self.max_level + 1)}

    def get_config(self):
        config = super().get_config()
        config.update(min_level=self.min_level, max_level=self.max_level, num_filters=self.num_filters,
                      conv_route=self.conv_route, batch_norm=self.batch_norm)
        return config
