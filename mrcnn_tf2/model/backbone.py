"""ResNet 18/34/50/101 backbone: images in, the C2..C5 feature maps of its four residual groups out.

Architecture: 7x7/2 conv (64) + BN + ReLU, 3x3/2 max-pool, then four groups of residual blocks (conv2_x ..
conv5_x; bottleneck blocks with expansion 4 for depths 50/101, basic two-3x3 blocks for 18/34) with strides
4, 8, 16, 32. The first block of each group has a projection shortcut (1x1 conv + BN) where its shape
changes. ResNet v1.5 (default) puts a group's stride 2 in the 3x3 conv of its first bottleneck;
`stride_in_1x1=True` gives original ResNet v1 (stride in the first 1x1 conv), the layout of
keras.applications.ResNet50, whose ImageNet weights then load exactly.

Layer names follow keras.applications.ResNet50 ('conv1_conv', 'conv1_bn', 'conv2_block1_1_conv',
'conv2_block1_1_bn', 'conv2_block1_0_conv' for the shortcut, ...) so a weight converter can map by name.
Convolutions have no bias (BN follows); a converter folds keras.applications' conv bias b into the BN's
moving mean (mean - b), which is exact.
Every strided or padded conv and the max-pool pad symmetrically by (kernel - 1) // 2, as keras.applications'
explicit ZeroPadding2D and torchvision do (TF's 'same' would pad asymmetrically at stride 2).

Batch norm: epsilon 1e-5 and momentum 0.9 (Detectron/torchvision values; keras.applications uses
1.001e-5 and 0.99, a negligible difference for converted weights). Where BN runs on its moving statistics
(inference, freeze_bn, or a frozen block group) it is folded into the conv: kernel * scale and a bias,
so the graph holds one Conv2D + BiasAdd (+ Add) + ReLU that oneDNN fuses, with no per-pixel BN math and,
under mixed precision, no float32 round trip of the activations.

Tensors are NHWC. This module must not know about FPN levels beyond C2..C5, nor read the config.
"""

import keras
import tensorflow as tf

from mrcnn_tf2.model.tracking import TracksSublayers
from mrcnn_tf2.ops import conv as conv_ops
from mrcnn_tf2.ops import fixed

BN_EPSILON = 1e-5
BN_MOMENTUM = 0.9
# Blocks per residual group (conv2_x .. conv5_x) for each supported depth.
BLOCKS_PER_GROUP = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}
BOTTLENECK_DEPTHS = (50, 101)
# Width of the 3x3 convs in each group; bottleneck outputs are BOTTLENECK_EXPANSION times wider.
GROUP_FILTERS = (64, 128, 256, 512)
BOTTLENECK_EXPANSION = 4
STEM_FILTERS = 64
# Index of the stem in `freeze_blocks`; residual groups are 1..4 (conv2_x .. conv5_x).
STEM_GROUP = 0
NUM_GROUPS = len(GROUP_FILTERS)
# Feature level of each group's output: group g (1..4) gives C_{g+1} at stride 2**(g+1).
FIRST_LEVEL = 2
# Training recomputes the stem and the first group for their gradient from this size of the stem's output up
# (ResNet.call): 106 MiB at 800x1088, batch 2; the demo's 128x128, batch 8, gives 8 MiB, where keeping the
# activations is faster (docs/PERFORMANCE.md#memory).
RECOMPUTE_MIN_BYTES = 32 * 2**20


def he_normal_fan_out():
    """He init with fan_out (kaiming_normal mode='fan_out'), as torchvision and Detectron initialise convs."""
    return keras.initializers.VarianceScaling(scale=2.0, mode="fan_out", distribution="untruncated_normal")


@keras.saving.register_keras_serializable(package="mrcnn_tf2")
class Conv2D(keras.layers.Conv2D):
    """keras.layers.Conv2D (NHWC, equal strides, no dilation) computed by conv_ops.conv2d.

    `conv_route`: conv_ops.conv2d's route (conv_ops.ROUTES; WINOGRAD needs the fused-op library).
    call(inputs [B, H, W, C_in], residual=None) -> [B, H_out, W_out, filters]; `residual` (that shape) is
    added before the activation, in the block oneDNN fuses (the FPN's top-down sum).
    """

    def __init__(self, *args, conv_route=conv_ops.CPU, **kwargs):
        super().__init__(*args, **kwargs)
        self.conv_route = conv_route

    def call(self, inputs, residual=None):
        relu = self.activation is keras.activations.relu
        outputs = conv_ops.conv2d(inputs, self.kernel, self.strides[0], self.padding.upper(),
                                  bias=self.bias if self.use_bias else None, residual=residual, relu=relu,
                                  route=self.conv_route)
        return outputs if relu or self.activation is None else self.activation(outputs)

    def get_config(self):
        return {**super().get_config(), "conv_route": self.conv_route}


@keras.saving.register_keras_serializable(package="mrcnn_tf2")
class ConvBN(TracksSublayers, keras.layers.Layer):
    """Conv (no bias) + batch norm + optional ReLU, padding (kernel_size - 1) // 2 on each side.

    Holds its weights in a Conv2D sublayer named `name + '_conv'` and a BatchNormalization sublayer named
    `name + '_bn'` (keras.applications names); the conv itself runs here, so that BN on moving statistics
    can be folded into the kernel. Freeze the BN by setting `layer.bn.trainable = False`.

    Variables are read in float32 (autocast off) to fold precisely; the folded kernel and bias are cast
    once to the compute dtype, so mixed_bfloat16 convolves in bfloat16.

    Batch norm trains (batch statistics, moving averages updated) when called with training=True and its
    sublayer is trainable; otherwise it runs on its moving statistics, folded into the conv.

    `kernel_initializer`: the conv's (default He normal with fan_out); a Keras initializer or its config.

    call(inputs [B, H, W, C_in], residual=None, training=None, update_averages=True)
    -> [B, H / strides, W / strides, filters] in the compute dtype. `residual` (same shape as the output) is
    added before the ReLU: the end of a residual block, kept here so that Conv + BiasAdd + Add + ReLU stay
    adjacent for the fusion. `update_averages=False`: batch norm trains without updating the moving averages
    (a forward pass computed again for its gradient, `ResNet`).
    """

    def __init__(self, filters, kernel_size, strides=1, relu=True, conv_route=conv_ops.CPU, kernel_initializer=None,
                 **kwargs):
        super().__init__(autocast=False, **kwargs)
        self.filters = filters
        self.kernel_size = kernel_size
        self.strides = strides
        self.relu = relu
        self.conv_route = conv_route
        self.conv = keras.layers.Conv2D(
            filters, kernel_size, strides=strides, padding="same", use_bias=False,
            kernel_initializer=kernel_initializer or he_normal_fan_out(), name=f"{self.name}_conv",
        )
        self.bn = keras.layers.BatchNormalization(epsilon=BN_EPSILON, momentum=BN_MOMENTUM, name=f"{self.name}_bn")
        pad = (kernel_size - 1) // 2
        # Same output size as the sublayer's 'same', but symmetric: at stride 1 'SAME' is already symmetric
        # for odd kernels; strided convs need it spelled out.
        if strides == 1:
            self._padding = "SAME"
        elif pad == 0:
            self._padding = "VALID"
        else:
            self._padding = [[0, 0], [pad, pad], [pad, pad], [0, 0]]

    def build(self, input_shape):
        self.conv.build(input_shape)
        self.bn.build(tuple(input_shape[:-1]) + (self.filters,))

    def call(self, inputs, residual=None, training=None, update_averages=True):
        x = tf.cast(inputs, self.compute_dtype)
        if residual is not None:
            residual = tf.cast(residual, self.compute_dtype)
        kernel = self.conv.kernel
        if training and self.bn.trainable:
            x = self._train_batch_norm(conv_ops.conv2d(x, tf.cast(kernel, self.compute_dtype), self.strides,
                                                       self._padding, route=self.conv_route), update_averages)
            if residual is not None:
                x = x + residual
            return tf.nn.relu(x) if self.relu else x
        bn = self.bn
        scale = fixed.once(lambda gamma, variance: gamma * tf.math.rsqrt(variance + bn.epsilon), bn.gamma,
                            bn.moving_variance)
        bias = fixed.once(lambda beta, mean, scale: tf.cast(beta - mean * scale, self.compute_dtype), bn.beta,
                           bn.moving_mean, scale)
        return conv_ops.conv2d(x, kernel, self.strides, self._padding, bias=bias,
                               residual=residual, relu=self.relu, route=self.conv_route, kernel_scale=scale)

    def _train_batch_norm(self, x, update_averages):
        """Batch norm of `x` [B, H, W, C] on the batch's statistics, which update the moving averages as the
        BatchNormalization sublayer would (its momentum, the biased variance), in TensorFlow's fused kernel: one
        pass for the statistics and one to normalise, and as few backward, where the sublayer's call takes several
        (docs/PERFORMANCE.md#training-next-to-torchvision). The kernel computes in float32 whatever x's dtype
        (bfloat16 under --amp), as the sublayer does; the result has x's dtype."""
        bn = self.bn
        x, mean, variance = tf.compat.v1.nn.fused_batch_norm(x, bn.gamma, bn.beta, epsilon=bn.epsilon,
                                                             is_training=True)
        # The kernel returns the unbiased variance (times n / (n - 1)).
        count = tf.cast(tf.reduce_prod(tf.shape(x)[:-1]), tf.float32)
        variance *= (count - 1.0) / tf.maximum(count, 1.0)
        if not update_averages:
            return x
        bn.moving_mean.assign(bn.moving_mean * bn.momentum + mean * (1.0 - bn.momentum))
        bn.moving_variance.assign(bn.moving_variance * bn.momentum + variance * (1.0 - bn.momentum))
        return x

    def get_config(self):
        config = super().get_config()
        config.update(filters=self.filters, kernel_size=self.kernel_size, strides=self.strides, relu=self.relu,
                      conv_route=self.conv_route,
                      kernel_initializer=keras.initializers.serialize(self.conv.kernel_initializer))
        return config


def conv_layer(filters, kernel_size, batch_norm, relu, kernel_initializer, conv_route, name):
    """A stride-1 'same' conv of the FPN or a head: with `batch_norm` a ConvBN (conv without bias, since the
    norm's beta shifts, then batch norm, then the ReLU if `relu`), else a Conv2D with a zero-initialised bias.

    Both are called as layer(inputs [B, H, W, C_in], residual=None, training=None) -> [B, H, W, filters],
    `residual` added before the ReLU (a Conv2D ignores `training`). A ConvBN's batch norm trains with batch
    statistics under training=True unless frozen (its `bn.trainable` False; `ResNet(freeze_bn=True)` freezes
    the backbone's only): torchvision trains the FPN's and heads' batch norms of maskrcnn_resnet50_fpn_v2,
    from scratch and when fine-tuning alike. Under Horovod each rank normalises by its own batch's statistics
    and updates its own moving averages (no cross-rank batch norm); rank 0's are the ones checkpointed.
    """
    if batch_norm:
        return ConvBN(filters, kernel_size, relu=relu, conv_route=conv_route, kernel_initializer=kernel_initializer,
                      name=name)
    return Conv2D(filters, kernel_size, padding="same", activation="relu" if relu else None,
                  kernel_initializer=kernel_initializer, bias_initializer="zeros", conv_route=conv_route, name=name)


@keras.saving.register_keras_serializable(package="mrcnn_tf2")
class ResidualBlock(TracksSublayers, keras.layers.Layer):
    """One residual block, named like keras.applications ('conv3_block1'); sublayers '<name>_<i>'.

    Bottleneck (`bottleneck=True`): 1x1 (filters) -> 3x3 (filters) -> 1x1 (4 * filters); the block's stride
    sits in the 3x3 conv (v1.5) or in the first 1x1 (`stride_in_1x1=True`, v1). Basic: 3x3 -> 3x3, stride
    in the first. A projection shortcut '<name>_0' (1x1 conv, stride, BN) replaces the identity where the
    stride or width changes.

    call(inputs [B, H, W, C_in], training=None, update_averages=True) -> [B, H / strides, W / strides, C_out]
    in the compute dtype (`update_averages` as ConvBN's).
    """

    def __init__(self, filters, strides, bottleneck, stride_in_1x1, projection, conv_route=conv_ops.CPU, **kwargs):
        super().__init__(**kwargs)
        self.filters = filters
        self.strides = strides
        self.bottleneck = bottleneck
        self.stride_in_1x1 = stride_in_1x1
        self.projection = projection
        self.conv_route = conv_route
        out_filters = filters * BOTTLENECK_EXPANSION if bottleneck else filters
        if bottleneck:
            stride_1x1, stride_3x3 = (strides, 1) if stride_in_1x1 else (1, strides)
            specs = [(filters, 1, stride_1x1), (filters, 3, stride_3x3), (out_filters, 1, 1)]
        else:
            specs = [(filters, 3, strides), (filters, 3, 1)]
        # The last conv's ReLU comes after the shortcut is added (ConvBN's `residual`).
        self.convs = [ConvBN(f, k, s, conv_route=conv_route, name=f"{self.name}_{i}")
                      for i, (f, k, s) in enumerate(specs, 1)]
        self.shortcut = (ConvBN(out_filters, 1, strides, relu=False, conv_route=conv_route, name=f"{self.name}_0")
                         if projection else None)

    def build(self, input_shape):
        # The convs' variables depend on channels only. Without this method Keras would build the block by
        # tracing `call` symbolically before its first real call.
        channels = input_shape[-1]
        if self.shortcut is not None:
            self.shortcut.build((None, None, None, channels))
        for conv in self.convs:
            conv.build((None, None, None, channels))
            channels = conv.filters

    def call(self, inputs, training=None, update_averages=True):
        flags = dict(training=training, update_averages=update_averages)
        residual = inputs if self.shortcut is None else self.shortcut(inputs, **flags)
        x = inputs
        for conv in self.convs[:-1]:
            x = conv(x, **flags)
        return self.convs[-1](x, residual=residual, **flags)

    def get_config(self):
        config = super().get_config()
        config.update(
            filters=self.filters, strides=self.strides, bottleneck=self.bottleneck,
            stride_in_1x1=self.stride_in_1x1, projection=self.projection, conv_route=self.conv_route,
        )
        return config


@keras.saving.register_keras_serializable(package="mrcnn_tf2")
class ResNet(TracksSublayers, keras.Model):
    """ResNet backbone (v1.5 by default) returning the outputs of its four residual groups.

    Args:
      depth: 18, 34, 50 or 101.
      stride_in_1x1: False (v1.5, stride in the bottleneck's 3x3 conv) or True (v1, as keras.applications).
      freeze_bn: BN always uses its moving statistics (also with training=True) and its gamma/beta are
        not trainable: the small per-device batches of detection training give poor batch statistics.
      freeze_blocks: block-group indices whose layers are not trainable (and whose BN is therefore frozen
        too): 0 the stem (conv1), 1 conv2_x, 2 conv3_x, 3 conv4_x, 4 conv5_x.
      conv_route: conv_ops.conv2d's route for every conv (conv_ops.ROUTES; the factory picks it per device).

    call(images, training=None):
      images: [B, H, W, 3] float, H and W multiples of 32 (any size works; then strides round up).
      Returns {2: C2, 3: C3, 4: C4, 5: C5}, C_l of shape [B, H / 2**l, W / 2**l, C_l channels]
      (64/128/256/512 for depths 18/34, four times that for 50/101) in the policy's compute dtype.
    """

    def __init__(self, depth=50, stride_in_1x1=False, freeze_bn=True, freeze_blocks=(0, 1), conv_route=conv_ops.CPU,
                 **kwargs):
        super().__init__(**kwargs)
        if depth not in BLOCKS_PER_GROUP:
            raise ValueError(f"ResNet depth {depth} is not one of {sorted(BLOCKS_PER_GROUP)}")
        freeze_blocks = tuple(int(g) for g in freeze_blocks)
        if any(not STEM_GROUP <= g <= NUM_GROUPS for g in freeze_blocks):
            raise ValueError(f"freeze_blocks {freeze_blocks}: indices must be in [{STEM_GROUP}, {NUM_GROUPS}]")
        self.depth = depth
        self.stride_in_1x1 = bool(stride_in_1x1)
        self.freeze_bn = bool(freeze_bn)
        self.freeze_blocks = freeze_blocks
        self.conv_route = conv_route
        bottleneck = depth in BOTTLENECK_DEPTHS
        self.stem = ConvBN(STEM_FILTERS, 7, strides=2, conv_route=conv_route, name="conv1")
        self.groups = []
        in_filters = STEM_FILTERS
        for g, (num_blocks, filters) in enumerate(zip(BLOCKS_PER_GROUP[depth], GROUP_FILTERS), 1):
            strides = 1 if g == 1 else 2
            out_filters = filters * BOTTLENECK_EXPANSION if bottleneck else filters
            self.groups.append([
                ResidualBlock(
                    filters, strides if b == 1 else 1, bottleneck, self.stride_in_1x1,
                    projection=b == 1 and (strides != 1 or in_filters != out_filters), conv_route=conv_route,
                    name=f"conv{g + 1}_block{b}",
                )
                for b in range(1, num_blocks + 1)
            ])
            in_filters = out_filters
        frozen = [self.stem] if STEM_GROUP in freeze_blocks else []
        frozen += [block for g in freeze_blocks if g != STEM_GROUP for block in self.groups[g - 1]]
        for layer in frozen:
            layer.trainable = False
        if self.freeze_bn:
            for layer in self._flatten_layers(include_self=False):
                if isinstance(layer, keras.layers.BatchNormalization):
                    layer.trainable = False

    @property
    def channels(self):
        """{level: channels} of the features `call` returns."""
        return {level: blocks[-1].convs[-1].filters for level, blocks in enumerate(self.groups, FIRST_LEVEL)}

    def build(self, input_shape):
        if len(input_shape) != 4 or input_shape[-1] != 3:
            raise ValueError(f"ResNet expects images [B, H, W, 3], got shape {tuple(input_shape)}")
        self.stem.build((None, None, None, 3))
        channels = STEM_FILTERS
        for block in (block for blocks in self.groups for block in blocks):
            block.build((None, None, None, channels))
            channels = block.convs[-1].filters
        super().build(input_shape)

    def call(self, images, training=None):
        first = self.stem.trainable_weights + [w for block in self.groups[0] for w in block.trainable_weights]
        if training and first and self.conv_route != conv_ops.PLAIN and _stem_bytes(images) >= RECOMPUTE_MIN_BYTES:
            # The stem and the first group, whose activations are the largest, keep none for the backward
            # pass: their gradient computes them again, a few percent of a step's multiply-adds for a third of
            # the backbone's memory (docs/PERFORMANCE.md). Measured on the CPU routes only; small batches keep
            # their activations, which cost little memory, and the time.
            x = _recomputed(self._stem_and_first_group, images)
        else:
            x = self._stem_and_first_group(images, training)
        features = {FIRST_LEVEL: x}
        for level, blocks in enumerate(self.groups[1:], FIRST_LEVEL + 1):
            for block in blocks:
                x = block(x, training=training)
            features[level] = x
        return features

    def _stem_and_first_group(self, images, training=True, update_averages=True):
        """images [B, H, W, 3] -> C2 [B, H / 4, W / 4, C]: the stem, the max pooling and the first group."""
        flags = dict(training=training, update_averages=update_averages)
        x = self.stem(images, **flags)
        # Padded by one pixel on each side, as torchvision's and keras.applications' are. XLA and the export
        # converters do not take pooling with explicit padding: there the padding is a separate op (zeros: the
        # stem's output is post-ReLU, so >= 0), whose output the gradient keeps (a copy of the stem's output).
        padding = [[0, 0], [1, 1], [1, 1], [0, 0]]
        if self.conv_route == conv_ops.WINOGRAD:
            x = tf.nn.max_pool2d(x, 3, 2, padding, name="pool1_pool")
        else:
            x = tf.nn.max_pool2d(tf.pad(x, padding), 3, 2, "VALID", name="pool1_pool")
        for block in self.groups[0]:
            x = block(x, **flags)
        return x

    def get_config(self):
        config = super().get_config()
        config.update(
            depth=self.depth, stride_in_1x1=self.stride_in_1x1, freeze_bn=self.freeze_bn,
            freeze_blocks=list(self.freeze_blocks), conv_route=self.conv_route,
        )
        return config


def _stem_bytes(images):
    """Bytes of the stem's output for `images` [B, H, W, 3] (float32), or infinity where a size is unknown."""
    batch, height, width = images.shape[:3]
    if None in (batch, height, width):
        return float("inf")
    return batch * -(-height // 2) * -(-width // 2) * STEM_FILTERS * 4


def _recomputed(forward, inputs):
    """forward(inputs) [training, averages updated] under a gradient that computes it again rather than keeping
    its activations for the backward pass: the memory of a layer's activations for the cost of its forward.

    `inputs` are data (images): they get no gradient. The recomputation trains batch norm on the same batch
    statistics without updating the moving averages again, so values and gradients are those of the plain
    call (the same kernels on the same inputs).
    """
    @tf.custom_gradient
    def run(x):
        def grad(out_grad, variables=None):
            # After the output gradient arrives: TensorFlow's executor would otherwise recompute as soon as the
            # inputs exist, during the forward pass, and hold it all until the gradient came.
            with tf.control_dependencies([out_grad]):
                again = tf.identity(x)
            trained = [v for v in variables or () if v.trainable]
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(trained)
                outputs = forward(again, update_averages=False)
            gradients = iter(tape.gradient(outputs, trained, output_gradients=out_grad))
            return None, [next(gradients) if v.trainable else None for v in variables or ()]

        return forward(x), grad

    return run(inputs)
