"""2-D convolution whose kernel gradient is computed as matrix products, and faster routes for a batch of one.

TensorFlow's oneDNN CPU kernel for a convolution's kernel (filter) gradient is slow at the sizes of a
full-resolution model: on this 2-core AVX2 CPU, for the FPN's and the RPN head's 3x3 256->256 conv on P2
of an 832x1344 batch of 2, it ran at 27 GFLOP/s against 189 GFLOP/s for the forward conv. The same
gradient written as one matrix product per kernel tap (`kernel_gradient`: [C_in, N] x [N, C_out] over the
N pixels of the batch, the input rows offset by the tap) runs at 131 GFLOP/s there
(`TF_ENABLE_ONEDNN_OPTS=1 scripts/benchmark_conv.py`); with TensorFlow's own kernels (oneDNN off) it is
faster too (129 vs 106 GFLOP/s). `conv2d` is tf.nn.conv2d with that gradient for stride-1 convs; the
input gradient stays TensorFlow's kernel.

oneDNN also runs a batch of one image through its im2col-GEMM forward convolution, 54 GFLOP/s for that
P2 conv at batch 1, while the same conv's input gradient (a transposed convolution) runs at 186 GFLOP/s.
A stride-1 conv with symmetric padding is the transposed conv of the kernel flipped in space with its
input and output channels swapped, so under oneDNN `conv2d` computes a batch of one that way. A strided
conv has no such twin; its batch of one runs as a batch of two, the image's top and bottom halves
(`split_conv2d`): the ResNet's 3x3/2 128->128 conv on 208x336 took 80 ms as one image, 39 ms as halves.
A 1x1 conv needs neither: its image's pixels are a batch of two images of one column by a reshape (and a
zero pixel for an odd count), and run in oneDNN's batch kernel with the bias, residual and ReLU fused
(`conv2d` takes them: the transposed route leaves them as separate passes over memory); 64->256 + residual
+ ReLU on 208x336 went from 42 to 36 ms. A strided 1x1 conv is the stride-1 conv of every stride-th pixel.
In bfloat16 oneDNN's direct kernels are the faster ones at batch 1 (its batch-of-one im2col is float32's),
so bfloat16 (and float16, not measured, rare on a CPU) takes neither the transposed nor the split route:
P2's 3x3 256->256 conv with bias at 200x200 45.8 ms direct against 48.3 transposed, the 3x3/2 128->128 on
400x400 12.3 against 17.4 split.

With the fused ops on (route WINOGRAD, the layers' choice), a float32 3x3 stride-1 'SAME' conv of at least
WINOGRAD_MIN_TILES 4x4 output blocks instead runs Winograd's F(4x4, 3x3) (`fused_ops.conv2d_3x3`): 36 matrix
products over the 4x4 output blocks do the work of the 144 of a direct conv (on large maps F(6x6, 3x3), 64 for 324,
and on the mask head's 14x14 RoIs F(5x5, 3x3), 49 for 225: `fused_ops.winograd_block`), and the input gradient, the
conv of the flipped kernel, goes the same way; so does the kernel gradient (`fused_ops.conv2d_3x3_kernel_gradient`),
in place of `kernel_gradient`. The P2 conv at batch 1 took 193 ms against 450 ms by the transposed route; the mask
head's convs over 100 RoIs 72 ms against 121 ms. Its rounding differs from a direct conv's by about 1e-5 of the
output's scale (2e-5 by F(5x5, 3x3) or F(6x6, 3x3)). A bfloat16 3x3 conv of many channels and tiles takes the
same route in float32 between casts where the CPU's bfloat16 is AVX-512's, not AMX's (BFLOAT16_WINOGRAD): its
output, rounded to bfloat16, is as close to the exact conv as the direct bfloat16 conv's.

On small maps, at most PATCH_MAX_PIXELS output pixels per image (the demo's conv5 at 4x4 or 3x3, the small
FPN levels), the direct kernels run far under their speed on larger ones: a 3x3 stride-1 'SAME' conv there is one
matrix product of every output pixel's 3x3 patch of input pixels (`patch_conv2d`), and so is its input gradient,
the conv of the flipped kernel. On one thread of the Xeon without bfloat16, [8, 4, 4, 512] -> 512 (oneDNN on):
forward 20.6 -> 12.9 ms, input gradient 19.9 -> 16.9 ms; with oneDNN off TensorFlow's input gradient took
174.7 ms, the product 39.1 ms (`scripts/benchmark_conv.py --shape 8 4 4 512`). At 6x6 the direct conv was
faster again (6.9 against 7.6 ms).

Where a function is traced on fixed weights (`ops.fixed`: inference on loaded weights), what a conv computes from
its weights alone (the kernel's read and cast, a batch norm folded in, Winograd's kernel transform) is computed
when it is traced, not in every call.

All of the above answers a CPU's kernels. The fused ops have CPU kernels only: on a GPU they would run on
the host, their tensors copied there and back. The oneDNN routes and the matrix-product gradient were
measured against oneDNN's kernels only, and cost extra passes over memory (a flipped kernel, halves, one
product per tap); a GPU runs cuDNN's own kernels instead. `conv2d`'s `route` says which convolution runs;
the model's layers take it from `mrcnn_tf2.model.factory.choose_ops`, which picks it for the run's device:

- PLAIN: tf.nn.conv2d and TensorFlow's own gradients, nothing else (on a GPU, cuDNN's kernels; in an
  exported model, the convolution every converter takes, whichever machine exported it);
- CPU: the matrix-product kernel gradient, and oneDNN's batch-of-one routes when its kernels are on;
- WINOGRAD: CPU, with Winograd's fused route for the 3x3 convs it suits.

Tensors are NHWC; kernels [KH, KW, C_in, C_out].
"""

import tensorflow as tf
from tensorflow.python.util import _pywrap_util_port  # the one way to ask whether oneDNN's kernels are on

from mrcnn_tf2.devices import cpu_flags
from mrcnn_tf2.ops import fixed
from mrcnn_tf2.ops import fused as fused_ops

ONEDNN = _pywrap_util_port.IsMklEnabled()

PLAIN, CPU, WINOGRAD = "plain", "cpu", "winograd"
ROUTES = (PLAIN, CPU, WINOGRAD)


def kernel_gradient(inputs, out_grad, kernel_shape, padding):
    """Gradient of a stride-1 conv's loss with respect to its kernel, one matrix product per kernel tap.

    Args:
      inputs: [B, H, W, C_in] the conv's input.
      out_grad: [B, H_out, W_out, C_out] gradient of the loss with respect to the conv's output.
      kernel_shape: (KH, KW, C_in, C_out) Python ints.
      padding: 'SAME', 'VALID' or explicit [[0, 0], [top, bottom], [left, right], [0, 0]].

    Returns:
      [KH, KW, C_in, C_out] in the dtype of `inputs`.
    """
    kh, kw, c_in, c_out = kernel_shape
    if padding == "VALID":
        padding = [[0, 0], [0, 0], [0, 0], [0, 0]]
    elif padding == "SAME":  # at stride 1 TensorFlow pads k - 1 in all, the odd pixel after
        padding = [[0, 0], [(kh - 1) // 2, kh // 2], [(kw - 1) // 2, kw // 2], [0, 0]]
    if padding != [[0, 0], [0, 0], [0, 0], [0, 0]]:  # no copy for the many 1x1 convs
        inputs = tf.pad(inputs, padding)
    width = tf.shape(inputs)[2]  # of the padded input: W_out + KW - 1; its height is H_out + KH - 1
    # Tap (i, j) multiplies output pixel (y, x) by padded pixel (y + i, x + j). With the output gradient
    # zero-padded to the same grid and both flattened to rows of pixels, that pixel is the row
    # i * width + j further on, in the same image, so the tap's input rows are one contiguous block of the
    # flattened input: a view TensorFlow slices without copying (a shifted copy per tap cost 10% of a step).
    # The rows that a block reaches past the output pixels meet zero gradient rows and add nothing.
    if kh > 1 or kw > 1:
        out_grad = tf.pad(out_grad, [[0, 0], [0, kh - 1], [0, kw - 1], [0, 0]])
    grad = tf.reshape(out_grad, [-1, c_out])  # [B * H_p * W_p, C_out]
    rows = tf.shape(grad)[0] - (kh - 1) * width - (kw - 1)  # the same count for every tap: the last one's
    pixels = tf.reshape(inputs, [-1, c_in])
    grad = grad[:rows]
    # Every tap's first row at once: one slice and one matrix product per tap in the graph, which a 7x7
    # kernel has 49 of (a slice with its own offset arithmetic each made the step's trace much longer).
    starts = (tf.constant([[i] for i in range(kh) for _ in range(kw)]) * width
              + tf.constant([[j] for j in range(kw)] * kh))  # [KH * KW, 1]
    begins, ends, unit = tf.unstack(starts), tf.unstack(starts + rows), tf.constant([1])
    taps = [tf.matmul(tf.strided_slice(pixels, begin, end, unit), grad, transpose_a=True)
            for begin, end in zip(begins, ends)]
    return tf.reshape(tf.stack(taps), [kh, kw, c_in, c_out])


def flipped(kernel):
    """[KH, KW, C_in, C_out] -> [KH, KW, C_out, C_in], flipped in space: the kernel whose 'SAME' conv is
    the transposed conv of `kernel` (odd sides)."""
    return tf.transpose(tf.reverse(kernel, [0, 1]), [0, 1, 3, 2])


def transposed_conv2d(inputs, kernel):
    """tf.nn.conv2d(inputs, kernel, 1, 'SAME') for odd kernel sides, computed as a transposed convolution.

    Args:
      inputs: [B, H, W, C_in].
      kernel: [KH, KW, C_in, C_out], KH and KW odd.

    Returns:
      [B, H, W, C_out].
    """
    out_shape = tf.concat([tf.shape(inputs)[:3], [kernel.shape[3]]], 0)
    outputs = tf.nn.conv2d_transpose(inputs, flipped(kernel), out_shape, 1, "SAME")
    outputs.set_shape(inputs.shape[:3] + kernel.shape[3:])
    return outputs


def split_conv2d(inputs, kernel, strides, padding):
    """tf.nn.conv2d of a batch of one image, computed as a batch of two: its top and its bottom half.

    Args:
      inputs: [1, H, W, C_in].
      kernel: [KH, KW, C_in, C_out].
      strides: int.
      padding: 'VALID' or explicit [[0, 0], [top, bottom], [left, right], [0, 0]].

    Returns:
      [1, H_out, W_out, C_out].
    """
    if padding != "VALID":
        inputs = tf.pad(inputs, padding)
    kh = kernel.shape[0]
    rows = inputs.shape[1]  # static or None
    static_hw = [None if n is None else (n - k) // strides + 1 for n, k in zip(inputs.shape[1:3], kernel.shape[:2])]
    if 0 in static_hw:
        # An image shorter or narrower than the kernel: an empty output, nothing to compute. oneDNN's Conv2D
        # would return a tensor shaped like its input instead (TensorFlow's MklConvOp allocates an empty
        # output with the input's shape), which the halves' reshape or concat below cannot take.
        out_hw = (tf.shape(inputs)[1:3] - kernel.shape[:2]) // strides + 1
        outputs = tf.zeros(tf.concat([[1], out_hw, [kernel.shape[3]]], 0), inputs.dtype)
        outputs.set_shape([1, *static_hw, kernel.shape[3]])
        return outputs
    out_h = (tf.shape(inputs)[1] - kh) // strides + 1
    half = (out_h + 1) // 2
    if rows is not None and rows % (2 * strides) == 0 and kh <= strides:
        # The halves need no common row (a 1x1/2 shortcut conv): the image's rows as two images, no copy.
        halves = tf.reshape(inputs, tf.concat([[2, rows // 2], tf.shape(inputs)[2:]], 0))
    else:
        span = (half - 1) * strides + kh  # the input rows of `half` output rows
        bottom = (out_h - half) * strides  # the bottom half's first input row; for an odd H_out it repeats a row
        halves = tf.concat([inputs[:, :span], inputs[:, bottom:bottom + span]], 0)
    halves = tf.nn.conv2d(halves, kernel, strides, "VALID")  # [2, half, W_out, C_out]
    static_out_h = static_hw[0]
    if static_out_h is not None and static_out_h % 2 == 0:  # the halves' rows in order: a reshape, no copy
        outputs = tf.reshape(halves, [1, static_out_h, tf.shape(halves)[2], kernel.shape[3]])
    else:
        outputs = tf.concat([halves[:1, :out_h - half], halves[1:]], 1)
    outputs.set_shape([1, static_out_h, halves.shape[2], kernel.shape[3]])
    return outputs


# The fewest 4x4 output blocks for which Winograd's route pays: its kernel transform (36 x C_in x C_out) is
# paid per call, the matrix products grow with the blocks. Measured forward and backward: 8 blocks of
# 512->512 took 9.5 ms against 7.1 direct (forward) and 24 of 256->256 9.2 against 7.8 (forward and
# gradients); from 32 blocks up it was as fast or faster (77 blocks of 512->512: 20 against 32 ms).
WINOGRAD_MIN_TILES = 32


def _winograd(inputs, kernel, strides, padding, route):
    """Whether the conv takes Winograd's fused route: a float32 3x3 stride-1 'SAME' conv, route WINOGRAD,
    and enough output blocks (or sizes known only at run time)."""
    if not (route == WINOGRAD and strides == 1 and padding == "SAME" and tuple(kernel.shape[:2]) == (3, 3)
            and inputs.dtype == tf.float32):
        return False
    batch, height, width = inputs.shape[:3]
    if None in (batch, height, width):
        return True
    return batch * -(-height // 4) * -(-width // 4) >= WINOGRAD_MIN_TILES


# bfloat16 3x3 convs with at least these input channels and Winograd tiles over the batch (of
# `fused_ops.winograd_block`'s m) run Winograd's float32 route between casts (`conv2d`). On a CPU without AMX
# (no amx_bf16 in /proc/cpuinfo) bfloat16 runs on avx512_bf16's dot products, at most twice float32's
# multiply-adds per instruction (or is emulated, slower still), and Winograd's 4-5x fewer multiply-adds win on
# wide maps of enough tiles (FPN levels P2 to P4 and ResNet stage 4 at 800 px, the mask head's RoIs); narrower
# maps, or fewer tiles (stage 5), were as fast or faster direct (docs/PERFORMANCE.md, "On an AMD EPYC with
# bfloat16 and no AMX"). AMX's tile products run bfloat16 at many times float32's rate: there bfloat16 stays direct.
BFLOAT16_WINOGRAD = "amx_bf16" not in (cpu_flags() or ())
BFLOAT16_WINOGRAD_MIN_CHANNELS = 256
BFLOAT16_WINOGRAD_MIN_TILES = 100


def bfloat16_winograd(inputs, kernel, strides, padding, route):
    """Whether a bfloat16 conv runs as Winograd's float32 route (BFLOAT16_WINOGRAD's sizes): a Python bool, or
    a boolean scalar tensor where the batch or the image's size is known only at run time."""
    if not (BFLOAT16_WINOGRAD and route == WINOGRAD and inputs.dtype == tf.bfloat16 and strides == 1
            and padding == "SAME" and tuple(kernel.shape[:2]) == (3, 3)
            and kernel.shape[2] >= BFLOAT16_WINOGRAD_MIN_CHANNELS):
        return False
    block = fused_ops.winograd_block(inputs.shape[:3])
    batch, height, width = (tf.shape(inputs)[i] if size is None else size for i, size in enumerate(inputs.shape[:3]))
    return batch * ((height + block - 1) // block) * ((width + block - 1) // block) >= BFLOAT16_WINOGRAD_MIN_TILES


# The most output pixels per image (H * W, known when tracing) of a stride-1 'SAME' conv with an odd kernel that
# runs as one matrix product of patches (`patch_conv2d`) where Winograd's route does not take it.
PATCH_MAX_PIXELS = 16


def _patched(inputs, kernel, strides, padding, route):
    """Whether the conv takes `patch_conv2d`: a float32 stride-1 'SAME' conv with odd kernel sides on a CPU
    route, of at most PATCH_MAX_PIXELS output pixels per image, that Winograd's route does not take."""
    height, width = inputs.shape[1:3]
    return (route != PLAIN and strides == 1 and padding == "SAME" and kernel.shape[0] % 2 == 1
            and kernel.shape[1] % 2 == 1 and inputs.dtype == tf.float32 and None not in (height, width)
            and height * width <= PATCH_MAX_PIXELS and not _winograd(inputs, kernel, strides, padding, route))


def patch_conv2d(inputs, kernel):
    """tf.nn.conv2d(inputs, kernel, 1, 'SAME') for odd kernel sides, as one matrix product of every output
    pixel's KH x KW patch of input pixels: [B * H * W, KH * KW * C_in] x [KH * KW * C_in, C_out].

    Args:
      inputs: [B, H, W, C_in], H and W known when tracing.
      kernel: [KH, KW, C_in, C_out], KH and KW odd.

    Returns:
      [B, H, W, C_out].
    """
    kh, kw, c_in, c_out = kernel.shape
    height, width = inputs.shape[1:3]
    padded = tf.pad(inputs, [[0, 0], [kh // 2, kh // 2], [kw // 2, kw // 2], [0, 0]])
    patches = tf.concat([padded[:, i:i + height, j:j + width] for i in range(kh) for j in range(kw)], 3)
    outputs = tf.matmul(tf.reshape(patches, [-1, kh * kw * c_in]), tf.reshape(kernel, [-1, c_out]))
    return tf.reshape(outputs, [-1, height, width, c_out])


def _forward(inputs, kernel, strides, padding, route):
    """The conv of the CPU routes: by Winograd's fused route, a matrix product of patches, or a faster oneDNN
    route where possible (module docstring)."""
    def direct():
        return tf.nn.conv2d(inputs, kernel, strides, padding)

    if _winograd(inputs, kernel, strides, padding, route):
        return fused_ops.conv2d_3x3(inputs, kernel)
    if _patched(inputs, kernel, strides, padding, route):
        return patch_conv2d(inputs, kernel)
    if strides == 1 and padding == "SAME" and kernel.shape[0] % 2 == 1 and kernel.shape[1] % 2 == 1:
        batch_of_one = lambda: transposed_conv2d(inputs, kernel)  # noqa: E731
    elif strides > 1 and padding != "SAME":
        batch_of_one = lambda: split_conv2d(inputs, kernel, strides, padding)  # noqa: E731
    else:
        return direct()
    if not ONEDNN or inputs.dtype != tf.float32 or inputs.shape[0] not in (1, None):
        return direct()
    if inputs.shape[0] == 1:
        return batch_of_one()
    return tf.cond(tf.shape(inputs)[0] == 1, batch_of_one, direct)


def conv2d(inputs, kernel, strides=1, padding="SAME", bias=None, residual=None, relu=False, route=CPU,
           kernel_scale=None):
    """relu(tf.nn.conv2d(inputs, kernel) + bias + residual) (no dilation), the block oneDNN fuses into one
    kernel, by `route`; on the CPU routes the kernel gradient at stride 1 is `kernel_gradient`.

    Args:
      inputs: [B, H, W, C_in].
      kernel: [KH, KW, C_in, C_out], static shape, same dtype as inputs.
      strides: int.
      padding: 'SAME', 'VALID' or explicit [[0, 0], [top, bottom], [left, right], [0, 0]] Python ints.
      bias: [C_out] or None.
      residual: [B, H_out, W_out, C_out] or None.
      relu: whether a ReLU ends the block.
      route: PLAIN, CPU or WINOGRAD (module docstring). WINOGRAD: a float32 3x3 stride-1 'SAME' conv runs
        Winograd's fused ops (`fused_ops.conv2d_3x3`), and so does a bfloat16 one of BFLOAT16_WINOGRAD's sizes,
        in float32 (output cast back); the kernel gradient is CPU's either way.
      kernel_scale: [C_out] float32 or None. The conv's kernel is then tf.cast(kernel * kernel_scale,
        inputs.dtype) (a frozen batch norm folded in; `kernel` float32). The CPU routes' gradient makes that
        product again when the output gradient comes rather than keep it from the forward pass: a trained
        backbone's folded kernels, as many bytes as its weights, are otherwise all held from the forward pass
        to their convs' gradients.

    Returns:
      [B, H_out, W_out, C_out].
    """
    if route not in ROUTES:
        raise ValueError(f"conv route {route!r} is not one of {ROUTES}")
    # A variable read inside the custom gradient would need the `variables` protocol; read it here.
    kernel = fixed.once(tf.convert_to_tensor, kernel)
    by_winograd = bfloat16_winograd(inputs, kernel, strides, padding, route)
    if by_winograd is not False:
        def in_float32():
            x, b, r = (None if t is None else tf.cast(t, tf.float32) for t in (inputs, bias, residual))
            w = fixed.once(lambda k: tf.cast(k, tf.float32), kernel)
            return tf.cast(_block(x, w, kernel_scale, strides, padding, b, r, relu, route), inputs.dtype)

        if by_winograd is True:
            return in_float32()
        return tf.cond(by_winograd, in_float32,
                       lambda: _block(inputs, kernel, kernel_scale, strides, padding, bias, residual, relu, route))
    if route != PLAIN and tuple(kernel.shape[:2]) == (1, 1):
        if (strides > 1 and padding in ("SAME", "VALID") and ONEDNN and inputs.shape[0] == 1
                and inputs.dtype == tf.float32):
            # A strided 1x1 conv reads every stride-th pixel (no padding at either setting): those pixels, a
            # quarter of the image at stride 2, make the stride-1 conv below, rather than halves of the image.
            inputs, strides = _subsampled(inputs, strides), 1
        if strides == 1:
            padding = "SAME"  # 'VALID' is the same conv for a 1x1 kernel, and 'SAME' can take the batch-of-one route
            if ONEDNN and inputs.shape[0] == 1:
                return _pixel_pairs(lambda x, r: _block(x, kernel, kernel_scale, 1, padding, bias, r, relu, route),
                                    inputs, residual, *kernel.shape[2:])
    return _block(inputs, kernel, kernel_scale, strides, padding, bias, residual, relu, route)


def _subsampled(inputs, stride):
    """inputs[:, ::stride, ::stride]: [B, H, W, C] -> [B, ceil(H / stride), ceil(W / stride), C].

    TensorFlow's strided slice of two inner axes runs element by element (a 208x272x256 image at stride 2 took
    longer than a 1x1 conv of the result); as a reshape to [B, H / s, s, W / s, s C] (the image zero-padded to
    multiples of s) and a unit-stride slice of whole pixels it runs as copies of C contiguous values."""
    shape = tf.shape(inputs)
    padded = tf.pad(inputs, [[0, 0], [0, -shape[1] % stride], [0, -shape[2] % stride], [0, 0]])
    size = tf.shape(padded)
    grid = tf.reshape(padded, tf.stack([size[0], size[1] // stride, stride, size[2] // stride, stride * size[3]]))
    outputs = grid[:, :, 0, :, :shape[3]]
    static = [None if n is None else -(-n // stride) for n in inputs.shape[1:3]]
    outputs.set_shape([inputs.shape[0], *static, inputs.shape[3]])
    return outputs


def _pixel_pairs(block, inputs, residual, c_in, c_out):
    """A 1x1 conv's `block(x, residual)` of one image run as a batch of two: a 1x1 conv treats every pixel
    alike, so the image's pixels are also two images of one column each, a zero pixel appended to an odd
    count and its output dropped. oneDNN's batch kernel then fuses bias, residual and ReLU (the transposed
    route leaves them as separate passes over memory). For an even count the pad and the cut forward their
    inputs: no copy.

    Args:
      block: ([2, P, 1, c_in], [2, P, 1, c_out] or None) -> [2, P, 1, c_out], P = ceil(H * W / 2).
      inputs: [1, H, W, c_in].
      residual: [1, H, W, c_out] or None.
      c_in, c_out: Python ints.

    Returns:
      [1, H, W, c_out].
    """
    shape = tf.shape(inputs)
    pixels = shape[1] * shape[2]

    def paired(tensor, grid, channels):
        flat = tf.pad(tf.reshape(tensor, [-1, channels]), [[0, pixels % 2], [0, 0]])
        return tf.reshape(flat, tf.concat([grid, [channels]], 0))

    x = paired(inputs, [2, (pixels + 1) // 2, 1], c_in)
    # The residual shaped by x's shape: grappler then sees the conv's output and the residual as one shape
    # when the image's size is known only at run time, as its fusion of the add into oneDNN's conv requires.
    outputs = block(x, None if residual is None else paired(residual, tf.shape(x)[:3], c_out))
    outputs = tf.reshape(tf.reshape(outputs, [-1, c_out])[:pixels], tf.concat([shape[:3], [c_out]], 0))
    outputs.set_shape(inputs.shape[:3] + [c_out])
    return outputs


def _folded(kernel, scale, dtype):
    """The conv's kernel [KH, KW, C_in, C_out] in `dtype`: kernel * scale [C_out], or kernel if scale is None."""
    return kernel if scale is None else tf.cast(kernel * scale, dtype)


def _block(inputs, kernel, scale, strides, padding, bias, residual, relu, route):
    """conv2d's block: the conv (on the CPU routes under its custom gradient) followed by the ops oneDNN
    fuses into it, or Winograd's output transform applies."""
    if (route != PLAIN and residual is None and (bias is not None or relu)
            and _winograd(inputs, kernel, strides, padding, route)):
        return _cpu_conv(inputs, kernel, scale, strides, padding, route, bias, relu)
    if route == PLAIN:
        outputs = tf.nn.conv2d(inputs, _folded(kernel, scale, inputs.dtype), strides, padding)
    else:
        outputs = _cpu_conv(inputs, kernel, scale, strides, padding, route)
    if bias is not None:
        outputs = tf.nn.bias_add(outputs, bias)
    if residual is not None:
        outputs = outputs + residual
    return tf.nn.relu(outputs) if relu else outputs


def _cpu_conv(inputs, kernel, scale, strides, padding, route, bias=None, relu=False):
    """The conv of the CPU routes (`_forward`) of kernel * scale (`_folded`) under their gradient:
    `kernel_gradient` at stride 1, both gradients by Winograd's route where the forward took it. bias and
    relu, for a conv that takes Winograd's route only: its output transform adds the bias and applies the
    ReLU, and the gradient is theirs too (TensorFlow's kernels of BiasAdd's and Relu's gradients)."""
    kernel_shape = tuple(kernel.shape)
    has_scale = scale is not None

    @tf.custom_gradient
    def convolve(x, raw, *extra):
        scales, biases = extra[:has_scale], extra[has_scale:]

        def grad(out_grad):
            if relu:
                out_grad = tf.raw_ops.ReluGrad(gradients=out_grad, features=outputs)
            bias_grads = [tf.raw_ops.BiasAddGrad(out_backprop=out_grad)] if biases else []
            if not scales:
                return (*conv_grad(out_grad, raw), *bias_grads)
            # The folded kernel made again once the output gradient exists: made from the forward pass's
            # values alone, the executor would run it at once and hold it until the gradient came.
            with tf.control_dependencies([out_grad]):
                folded = _folded(raw, scales[0], x.dtype)
            input_grad, kernel_grad = conv_grad(out_grad, folded)
            kernel_grad = tf.cast(kernel_grad, tf.float32)
            return input_grad, kernel_grad * scales[0], tf.reduce_sum(kernel_grad * raw, [0, 1, 2]), *bias_grads

        def conv_grad(out_grad, w):
            if _winograd(x, w, strides, padding, route):
                # The input gradient of a 3x3 'SAME' conv is the conv of the kernel flipped in space with
                # its channels swapped, and the kernel gradient has Winograd's form too.
                # The kernel gradient first: then the conv's input can go before the backward pass goes on,
                # and the two gradients' tiles are never made at once.
                kernel_grad = fused_ops.conv2d_3x3_kernel_gradient(x, out_grad)
                with tf.control_dependencies([kernel_grad]):
                    input_grad = fused_ops.conv2d_3x3(out_grad, flipped(w))
                return input_grad, kernel_grad
            if strides == 1:
                if _patched(x, w, strides, padding, route):  # the conv of the flipped kernel, as above
                    input_grad = patch_conv2d(out_grad, flipped(w))
                else:
                    input_grad = tf.nn.conv2d_transpose(out_grad, w, tf.shape(x), 1, padding)
                return input_grad, kernel_gradient(x, out_grad, kernel_shape, padding)
            # Strided convs are few (the stem, a group's first block): TensorFlow's gradients of the conv
            # itself, whatever route the forward took (measured alone they were faster than
            # kernel_gradient on strided copies of the input, and than the gradients of split_conv2d).
            conv = dict(strides=[1, strides, strides, 1], out_backprop=out_grad, padding=padding)
            if isinstance(padding, str):
                return (tf.raw_ops.Conv2DBackpropInput(input_sizes=tf.shape(x), filter=w, **conv),
                        tf.raw_ops.Conv2DBackpropFilter(input=x, filter_sizes=tf.shape(w), **conv))
            # Explicit padding: the input gradient is a 'VALID' conv's on the padded shape, cropped, faster on
            # every shape measured under oneDNN (1.0 to 1.7x at ResNet-50's strided convs and the demo's;
            # docs/PERFORMANCE.md) and as fast without it. The kernel gradient keeps the explicit kernel
            # in float32 (a 'VALID' one on a padded copy was up to 1.8x slower); below float32 it takes the copy:
            # oneDNN's bfloat16 gradient kernels take no explicit padding, and TensorFlow's fallback was 30 to
            # 60x slower.
            valid = dict(conv, padding="VALID")
            padded_shape = tf.shape(x) + tf.constant([sum(pair) for pair in padding])
            input_grad = tf.raw_ops.Conv2DBackpropInput(input_sizes=padded_shape, filter=w, **valid)
            input_grad = tf.slice(input_grad, [0, padding[1][0], padding[2][0], 0], tf.shape(x))
            if x.dtype != tf.float32:
                kernel_grad = tf.raw_ops.Conv2DBackpropFilter(input=tf.pad(x, padding), filter_sizes=tf.shape(w),
                                                              **valid)
            else:
                kernel_grad = tf.raw_ops.Conv2DBackpropFilter(
                    input=x, filter_sizes=tf.shape(w), explicit_paddings=[p for pair in padding for p in pair],
                    **dict(conv, padding="EXPLICIT"))
            return input_grad, kernel_grad

        w = fixed.once(lambda k, s: _folded(k, s, x.dtype), raw, scales[0]) if scales else raw
        if biases or relu:
            outputs = fused_ops.conv2d_3x3(x, w, *biases, relu=relu)
        else:
            outputs = _forward(x, w, strides, padding, route)
        return outputs, grad

    # Variables read here, as conv2d reads the kernel.
    return convolve(inputs, kernel, *[tf.convert_to_tensor(tensor) for tensor in (scale, bias) if tensor is not None])
