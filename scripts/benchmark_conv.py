"""The convolution's three kernels at the model's costliest conv, and the kernel gradient as matrix products.

    .venv/bin/python scripts/benchmark_conv.py [--shape B H W C] [--repeats 3]
    TF_ENABLE_ONEDNN_OPTS=1 .venv/bin/python scripts/benchmark_conv.py

Times a 3x3 C->C conv, stride 1, 'SAME' (default: the FPN output conv and the RPN head's conv on P2 of an
832x1344 batch of 2): the forward conv, the input gradient, TensorFlow's kernel gradient
(Conv2DBackpropFilter), mrcnn_tf2.ops.conv.kernel_gradient, and the forward by Winograd's fused ops
(mrcnn_tf2.ops.fused.conv2d_3x3; the input gradient takes the same route with the flipped kernel), in
milliseconds (median of --repeats after one warm-up) and GFLOP/s of the direct conv's work, and checks that
the two kernel gradients and the two forwards agree. TensorFlow reads TF_ENABLE_ONEDNN_OPTS once, at
import: run the script once per setting to compare them.
"""
import argparse
import os
import time

import numpy as np


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=(2, 208, 336, 256), metavar=("B", "H", "W", "C"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    # After parsing, so that --help answers at once. Not main.py's start-up (import_tensorflow): that turns
    # oneDNN on, and this script compares TensorFlow's default with TF_ENABLE_ONEDNN_OPTS set by the caller.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from mrcnn_tf2.ops import conv as conv_ops
    from mrcnn_tf2.ops import fused as fused_ops

    fused_ops.load_library()  # fail here, clearly, when the library is not built
    batch, height, width, channels = args.shape
    kernel_shape = (3, 3, channels, channels)
    x = tf.random.normal(args.shape)
    out_grad = tf.random.normal(args.shape)
    kernel = tf.random.normal(kernel_shape, stddev=0.05)
    strides = [1, 1, 1, 1]
    kernels = {
        "forward": lambda: tf.nn.conv2d(x, kernel, 1, "SAME"),
        "input gradient": lambda: tf.raw_ops.Conv2DBackpropInput(
            input_sizes=args.shape, filter=kernel, out_backprop=out_grad, strides=strides, padding="SAME"),
        "kernel gradient, TensorFlow": lambda: tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=kernel_shape, out_backprop=out_grad, strides=strides, padding="SAME"),
        "kernel gradient, matrix products": lambda: conv_ops.kernel_gradient(x, out_grad, kernel_shape, "SAME"),
        "forward, Winograd (fused ops)": lambda: fused_ops.conv2d_3x3(x, kernel),
    }
    kernels = {name: tf.function(fn) for name, fn in kernels.items()}
    ours = kernels["kernel gradient, matrix products"]().numpy()
    theirs = kernels["kernel gradient, TensorFlow"]().numpy()
    error = np.abs(ours - theirs).max() / np.abs(theirs).max()
    direct = kernels["forward"]().numpy()
    winograd_error = np.abs(kernels["forward, Winograd (fused ops)"]().numpy() - direct).max() / np.abs(direct).max()
    gflop = 2.0 * batch * height * width * 9 * channels * channels / 1e9
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset")
    print(f"3x3 conv {channels}->{channels} on [{batch}, {height}, {width}, {channels}]: {gflop:.1f} GFLOP per kernel, "
          f"TF_ENABLE_ONEDNN_OPTS={onednn}; kernel gradients differ by {error:.1e} of the largest, "
          f"forwards by {winograd_error:.1e}")
    for name, fn in kernels.items():
        fn().numpy()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn().numpy()
            times.append(time.perf_counter() - start)
        seconds = float(np.median(times))
        print(f"  {name:34s} {1000 * seconds:8.0f} ms {gflop / seconds:6.0f} GFLOP/s")


if __name__ == "__main__":
    main()
