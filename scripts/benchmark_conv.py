"""The convolution's three kernels at the model's costliest conv, and the kernel gradient as matrix products.

    .venv/bin/python scripts/benchmark_conv.py [--shape B H W C] [--repeats 3] [--dtype bfloat16]
    TF_ENABLE_ONEDNN_OPTS=1 .venv/bin/python scripts/benchmark_conv.py
    TF_ENABLE_ONEDNN_OPTS=1 .venv/bin/python scripts/benchmark_conv.py --shape 8 4 4 512 --repeats 20
    TF_ENABLE_ONEDNN_OPTS=1 .venv/bin/python scripts/benchmark_conv.py --strided 3 --shape 1 200 272 128
    TF_ENABLE_ONEDNN_OPTS=1 .venv/bin/python scripts/benchmark_conv.py --strided 3 --shape 2 100 136 256

Times a 3x3 C->C conv, stride 1, 'SAME' (default: the FPN output conv and the RPN head's conv on P2 of an
832x1344 batch of 2): the forward conv, the input gradient, TensorFlow's kernel gradient
(Conv2DBackpropFilter), mrcnn_tf2.ops.conv.kernel_gradient, the forward and the input gradient as one
matrix product of patches (mrcnn_tf2.ops.conv.patch_conv2d, the route of small maps), and the forward and the
kernel gradient by Winograd's fused ops with each output block, F(4x4, 3x3), F(5x5, 3x3) and F(6x6, 3x3)
(mrcnn_tf2.ops.fused.conv2d_3x3 and conv2d_3x3_kernel_gradient; the input gradient takes the forward's route with
the flipped kernel; the first line says which block fused.winograd_block picks for the shape), in milliseconds
(median of --repeats after one warm-up) and GFLOP/s of the direct conv's work, and checks that the kernel
gradients, the forwards and the input gradients agree. TensorFlow reads
TF_ENABLE_ONEDNN_OPTS once, at import: run the script once per setting to compare them. `--dtype bfloat16`
times the kernels in bfloat16, as `--amp` on a CPU runs them, and the forward by Winograd's float32 route between
casts (the fused Winograd conv is float32 only; the first line says whether mrcnn_tf2.ops.conv.conv2d takes that
route for this shape on this CPU): run it beside the float32 default to see what a CPU's bfloat16 instructions
give.

`--strided K` times instead a KxK C->C conv of stride 2 and padding (K - 1) // 2 (the ResNet's strided 3x3
convs), whose height and width are known only at run time, as in `main.py infer`: the direct conv and, when B
is 1, mrcnn_tf2.ops.conv.split_conv2d (the image as its two halves, the route conv2d takes for it in float32
under oneDNN; which is faster depends on the CPU); then its two gradients, each by its kernel with
explicit padding and by a 'VALID' kernel on the padded shape (the input gradient cropped after, the kernel
gradient on a padded copy of the input), the choice mrcnn_tf2.ops.conv's gradient makes.
"""
import argparse
import functools
import os
import time

import numpy as np


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=(2, 208, 336, 256), metavar=("B", "H", "W", "C"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--strided", type=int, metavar="K", help="a KxK stride-2 conv and its gradients instead")
    args = parser.parse_args(argv)
    # After parsing, so that --help answers at once. Not main.py's start-up (import_tensorflow): that turns
    # oneDNN on, and this script compares TensorFlow's default with TF_ENABLE_ONEDNN_OPTS set by the caller.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from mrcnn_tf2.ops import conv as conv_ops
    from mrcnn_tf2.ops import fused as fused_ops

    fused_ops.load_library()  # fail here, clearly, when the library is not built
    batch, height, width, channels = args.shape
    if args.strided is not None:
        return strided(args, tf, conv_ops)
    kernel_shape = (3, 3, channels, channels)
    # Fixed inputs: the same agreement figures on every run.
    x = tf.cast(tf.random.stateless_normal(args.shape, seed=[0, 1]), args.dtype)
    out_grad = tf.cast(tf.random.stateless_normal(args.shape, seed=[0, 2]), args.dtype)
    kernel = tf.cast(tf.random.stateless_normal(kernel_shape, seed=[0, 3], stddev=0.05), args.dtype)
    strides = [1, 1, 1, 1]
    kernels = {
        "forward": lambda: tf.nn.conv2d(x, kernel, 1, "SAME"),
        "input gradient": lambda: tf.raw_ops.Conv2DBackpropInput(
            input_sizes=args.shape, filter=kernel, out_backprop=out_grad, strides=strides, padding="SAME"),
        "kernel gradient, TensorFlow": lambda: tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=kernel_shape, out_backprop=out_grad, strides=strides, padding="SAME"),
        "kernel gradient, matrix products": lambda: conv_ops.kernel_gradient(x, out_grad, kernel_shape, "SAME"),
    }
    kernels["forward, matrix product of patches"] = lambda: conv_ops.patch_conv2d(x, kernel)
    kernels["input gradient, matrix product of patches"] = lambda: conv_ops.patch_conv2d(out_grad,
                                                                                        conv_ops.flipped(kernel))
    winograd = {}
    if args.dtype == "float32":
        for block in (4, 5, 6):
            winograd[f"forward, Winograd F({block}x{block}, 3x3)"] = (
                "forward", functools.partial(fused_ops.conv2d_3x3, x, kernel, block=block))
            winograd[f"kernel gradient, Winograd F({block}x{block}, 3x3)"] = (
                "kernel gradient, TensorFlow",
                functools.partial(fused_ops.conv2d_3x3_kernel_gradient, x, out_grad, block=block))
    else:  # conv_ops.conv2d's route for a bfloat16 conv of enough channels and tiles, on a CPU without AMX
        winograd["forward, Winograd's float32 route"] = ("forward", lambda: tf.cast(
            fused_ops.conv2d_3x3(tf.cast(x, tf.float32), tf.cast(kernel, tf.float32)), x.dtype))
    kernels.update({name: fn for name, (_, fn) in winograd.items()})
    kernels = {name: tf.function(fn) for name, fn in kernels.items()}

    def relative_error(name, reference):
        found, expected = (tf.cast(kernels[key](), tf.float32).numpy() for key in (name, reference))
        return np.abs(found - expected).max() / np.abs(expected).max()

    gradient_error = relative_error("kernel gradient, matrix products", "kernel gradient, TensorFlow")
    patch_error = max(relative_error("forward, matrix product of patches", "forward"),
                      relative_error("input gradient, matrix product of patches", "input gradient"))
    agreement = (f"kernel gradients differ by {gradient_error:.1e} of the largest, the products of patches by "
                 f"{patch_error:.1e}")
    chosen = fused_ops.winograd_block(args.shape[:3])
    agreement += (f", Winograd's by {max(relative_error(name, ref) for name, (ref, _) in winograd.items()):.1e}"
                  f" (it takes F({chosen}x{chosen}, 3x3) at this shape")
    if args.dtype == "bfloat16":
        routed = conv_ops.bfloat16_winograd(x, kernel, 1, "SAME", conv_ops.WINOGRAD)
        agreement += f"; conv2d takes this route here: {'yes' if routed else 'no'}"
    agreement += ")"
    gflop = 2.0 * batch * height * width * 9 * channels * channels / 1e9
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset")
    computed = kernels["forward"]().dtype.name  # what ran, not what was asked for
    print(f"3x3 conv {channels}->{channels} on [{batch}, {height}, {width}, {channels}] in {computed}: {gflop:.1f} "
          f"GFLOP per kernel, TF_ENABLE_ONEDNN_OPTS={onednn}; {agreement}")
    report(kernels, args.repeats, gflop)


def strided(args, tf, conv_ops):
    """--strided: the direct conv (and, of one image, split_conv2d) with run-time sizes, and the two gradients by
    each pair of kernels, checked to agree."""
    batch, height, width, channels = args.shape
    size = args.strided
    x = tf.cast(tf.random.stateless_normal(args.shape, seed=[0, 1]), args.dtype)
    kernel = tf.cast(tf.random.stateless_normal((size, size, channels, channels), seed=[0, 3], stddev=0.05),
                     args.dtype)
    pad = (size - 1) // 2
    padding = [[0, 0], [pad, pad], [pad, pad], [0, 0]]
    signature = [tf.TensorSpec([batch, None, None, channels], args.dtype)]  # sizes known at run time only
    convs = {"direct": lambda image: tf.nn.conv2d(image, kernel, 2, padding)}
    if batch == 1:
        convs["halves (split_conv2d)"] = lambda image: conv_ops.split_conv2d(image, kernel, 2, padding)
    kernels = {name: functools.partial(tf.function(conv, input_signature=signature), x)
               for name, conv in convs.items()}
    direct = kernels["direct"]()
    gradient = dict(strides=[1, 2, 2, 1], out_backprop=tf.cast(tf.random.stateless_normal(direct.shape, seed=[0, 2]),
                                                               args.dtype))
    explicit = dict(gradient, padding="EXPLICIT", explicit_paddings=[p for pair in padding for p in pair])
    valid = dict(gradient, padding="VALID")
    padded_shape = [batch, height + 2 * pad, width + 2 * pad, channels]
    kernels.update({name: tf.function(fn) for name, fn in {
        "input gradient, explicit padding": lambda: tf.raw_ops.Conv2DBackpropInput(
            input_sizes=args.shape, filter=kernel, **explicit),
        "input gradient, 'VALID' cropped": lambda: tf.raw_ops.Conv2DBackpropInput(
            input_sizes=padded_shape, filter=kernel, **valid)[:, pad:pad + height, pad:pad + width],
        "kernel gradient, explicit padding": lambda: tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=kernel.shape, **explicit),
        "kernel gradient, 'VALID' padded copy": lambda: tf.raw_ops.Conv2DBackpropFilter(
            input=tf.pad(x, padding), filter_sizes=kernel.shape, **valid),
    }.items()})
    # The pairs that compute the same: each gradient's two ways, and the two forwards of one image.
    pairs = [(f"{name}, explicit padding", f"{name}, 'VALID' {how}")
             for name, how in (("input gradient", "cropped"), ("kernel gradient", "padded copy"))]
    if batch == 1:
        pairs.append(("direct", "halves (split_conv2d)"))
    error = max(np.abs(a - b).max() / np.abs(b).max()
                for a, b in ([tf.cast(kernels[name](), tf.float32).numpy() for name in pair] for pair in pairs))
    out_h, out_w = direct.shape[1:3]
    gflop = 2.0 * batch * out_h * out_w * size * size * channels * channels / 1e9
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset")
    print(f"{size}x{size}/2 conv {channels}->{channels} on {list(args.shape)} in {args.dtype}: {gflop:.1f} GFLOP "
          f"per kernel, TF_ENABLE_ONEDNN_OPTS={onednn}; each pair differs by at most {error:.1e} of the largest")
    report(kernels, args.repeats, gflop)


def report(kernels, repeats, gflop):
    """Prints each kernel's median milliseconds over `repeats` calls after one warm-up, and its GFLOP/s."""
    for name, fn in kernels.items():
        fn().numpy()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn().numpy()
            times.append(time.perf_counter() - start)
        seconds = float(np.median(times))
        print(f"  {name:42s} {1000 * seconds:8.1f} ms {gflop / seconds:6.0f} GFLOP/s")


if __name__ == "__main__":
    main()
