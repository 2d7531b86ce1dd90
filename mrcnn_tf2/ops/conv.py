"""2-D convolution whose kernel gradient is computed as matrix products.

TensorFlow's oneDNN CPU kernel for a convolution's kernel (filter) gradient is slow at the sizes of a
full-resolution model: on this 2-core AVX2 CPU, for the FPN's and the RPN head's 3x3 256->256 conv on P2
of an 832x1344 batch of 2, it ran at 27 GFLOP/s against 189 GFLOP/s for the forward conv. The same
gradient written as one matrix product per kernel tap (`kernel_gradient`: the input shifted by the tap,
[C_in, N] x [N, C_out] over the N output pixels of the batch) runs at 128 GFLOP/s there
(`TF_ENABLE_ONEDNN_OPTS=1 scripts/benchmark_conv.py`); with TensorFlow's own kernels (oneDNN off) the two
are about as fast (103 vs 94 GFLOP/s). `conv2d` is tf.nn.conv2d with that gradient for stride-1 convs; the
input gradient stays TensorFlow's kernel.

oneDNN also runs a batch of one image through its im2col-GEMM forward convolution, 54 GFLOP/s for that
P2 conv at batch 1, while the same conv's input gradient (a transposed convolution) runs at 186 GFLOP/s.
A stride-1 conv with symmetric padding is the transposed conv of the kernel flipped in space with its
input and output channels swapped, so under oneDNN `conv2d` computes a batch of one that way.

Tensors are NHWC; kernels [KH, KW, C_in, C_out].
"""

import tensorflow as tf
from tensorflow.python.util import _pywrap_util_port  # the one way to ask whether oneDNN's kernels are on

ONEDNN = _pywrap_util_port.IsMklEnabled()


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
    padded = tf.pad(inputs, padding)
    out_shape = tf.shape(out_grad)
    out_h, out_w = out_shape[1], out_shape[2]
    # [N, C_out] with N = B * H_out * W_out: every output pixel of the batch is one row of the product.
    grad = tf.reshape(out_grad, [-1, c_out])
    taps = []
    for i in range(kh):
        for j in range(kw):
            # The input pixels that tap (i, j) multiplies, for every output pixel: [B, H_out, W_out, C_in],
            # a copy as large as the input. Taken only once the previous tap's product is done, so that at
            # most two copies are alive, not KH * KW.
            with tf.control_dependencies(taps[-1:]):
                shifted = padded[:, i:i + out_h, j:j + out_w]
            taps.append(tf.matmul(tf.reshape(shifted, [-1, c_in]), grad, transpose_a=True))
    return tf.reshape(tf.stack(taps), [kh, kw, c_in, c_out])


def transposed_conv2d(inputs, kernel):
    """tf.nn.conv2d(inputs, kernel, 1, 'SAME') for odd kernel sides, computed as a transposed convolution.

    Args:
      inputs: [B, H, W, C_in].
      kernel: [KH, KW, C_in, C_out], KH and KW odd.

    Returns:
      [B, H, W, C_out].
    """
    flipped = tf.transpose(tf.reverse(kernel, [0, 1]), [0, 1, 3, 2])  # [KH, KW, C_out, C_in] as conv2d_transpose wants
    out_shape = tf.concat([tf.shape(inputs)[:3], [kernel.shape[3]]], 0)
    outputs = tf.nn.conv2d_transpose(inputs, flipped, out_shape, 1, "SAME")
    outputs.set_shape(inputs.shape[:3] + kernel.shape[3:])
    return outputs


def _forward(inputs, kernel, padding):
    """The stride-1 conv, by the faster oneDNN kernel where a batch of one is possible (module docstring)."""
    def direct():
        return tf.nn.conv2d(inputs, kernel, 1, padding)

    transposable = ONEDNN and padding == "SAME" and kernel.shape[0] % 2 == 1 and kernel.shape[1] % 2 == 1
    if not transposable or inputs.shape[0] not in (1, None):
        return direct()
    if inputs.shape[0] == 1:
        return transposed_conv2d(inputs, kernel)
    outputs = tf.cond(tf.shape(inputs)[0] == 1, lambda: transposed_conv2d(inputs, kernel), direct)
    outputs.set_shape(inputs.shape[:3] + kernel.shape[3:])
    return outputs


def conv2d(inputs, kernel, strides=1, padding="SAME"):
    """tf.nn.conv2d (no dilation) whose kernel gradient, at stride 1, is `kernel_gradient`.

    Args:
      inputs: [B, H, W, C_in].
      kernel: [KH, KW, C_in, C_out], static shape, same dtype as inputs.
      strides: int.
      padding: 'SAME', 'VALID' or explicit [[0, 0], [top, bottom], [left, right], [0, 0]] Python ints.

    Returns:
      [B, H_out, W_out, C_out], what tf.nn.conv2d returns.
    """
    if strides != 1:
        # The stem's 7x7 over 3 channels would be 49 products of 3 rows each; strided convs are few (the
        # stem, a group's first block): they keep TensorFlow's kernel gradient.
        return tf.nn.conv2d(inputs, kernel, strides, padding)
    # A variable read inside the custom gradient would need the `variables` protocol; read it here.
    kernel = tf.convert_to_tensor(kernel)
    kernel_shape = tuple(kernel.shape)

    @tf.custom_gradient
    def convolve(x, w):
        def grad(out_grad):
            input_grad = tf.nn.conv2d_transpose(out_grad, w, tf.shape(x), 1, padding)
            return input_grad, kernel_gradient(x, out_grad, kernel_shape, padding)

        return _forward(x, w, padding), grad

    return convolve(inputs, kernel)
