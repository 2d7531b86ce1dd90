"""Converts keras.applications' ImageNet ResNet-50/101 weights into a checkpoint of this package's backbone.

    python weights/convert_keras_resnet.py --h5 ~/.keras/models/resnet50_weights_tf_dim_ordering_tf_kernels_notop.h5 \\
        --output weights/resnet50 [--depth 50]

Input: the weights file keras.applications.ResNet50/ResNet101 downloads (legacy Keras HDF5, with or without the
classifier top), a full model saved as legacy .h5, or a .keras model of the same architecture. Layers are
matched by their keras.applications names, which `mrcnn_tf2.model.backbone.ResNet` shares; the file must hold
exactly the conv and batch-norm layers of the chosen depth (a classifier top is ignored). Nothing is downloaded.

Output: a TF checkpoint of `tf.train.Checkpoint(backbone=ResNet(depth, stride_in_1x1=True))` at PREFIX
(PREFIX.index, PREFIX.data-*), read by the trainer with `--backbone_checkpoint PREFIX`, and PREFIX.json:
{"backbone": "resnet50", "stride_in_1x1": true, "source": <file name>, "input_mean_rgb": [...],
"input_std_rgb": [...]} (`mrcnn_tf2.model.pretrained.backbone_metadata`; the trainer checks it with that
module's `check_backbone_metadata`). Everything is written under a temporary prefix and renamed at the end,
the index last, so a checkpoint that can be read is complete.

Conventions of the conversion (all exact, up to float32 rounding):
  - keras.applications is ResNet v1 (stride in a block's first 1x1 conv): the backbone is built with
    stride_in_1x1=True, and the trainer must run with model.stride_in_1x1=true.
  - Its convs have a bias, ours do not (BN follows): BN(conv + b) with moving mean m equals BN(conv) with
    moving mean m - b.
  - Its BN epsilon (1.001e-5) differs from ours: the moving variance absorbs the difference, var + eps_keras
    - eps_ours, so that var + eps, the only way it is used, is unchanged.
  - Its ImageNet weights expect 'caffe' input: BGR channels, minus the BGR mean, on the 0..255 scale. This
    package's pipeline feeds RGB (pixel - IMAGENET_MEAN) / IMAGENET_STD. The first conv absorbs the difference:
    its kernel's input channels are reversed and scaled by the std, and the mean difference becomes a bias
    (folded into conv1's BN as above). That is exact away from the image border; within 3 pixels of it the
    zero padding stands for a pixel of the pipeline's mean instead of the caffe mean, less than 0.5 of 255 apart.
"""

import glob
import json
import os
import sys

import h5py
import numpy as np

from mrcnn_tf2 import files

# The shared command line, a sibling: run as a file, Python puts this folder first on sys.path; imported as
# weights.convert_keras_resnet (by the tests), it is a module of the weights package.
if __package__:
    from . import converter_cli
else:
    import converter_cli

# TensorFlow, Keras and the model are imported inside the functions that use them, so that --help answers
# at once; main() starts TensorFlow after parsing, as main.py does (converter_cli.run).

# Depths of keras.applications' ImageNet ResNets (keras.applications.ResNet50, ResNet101).
KERAS_DEPTHS = (50, 101)
# keras.applications.imagenet_utils 'caffe' mode subtracts this mean from BGR pixels; listed here in RGB order.
CAFFE_MEAN_RGB = (123.68, 116.779, 103.939)
# Layers of a file with the classifier top that the backbone has no use for.
TOP_LAYERS = frozenset({"predictions"})


def conv_bn_layers(resnet):
    """The ConvBN layers of a `ResNet`, stem first, each block's convs then its projection shortcut."""
    layers = [resnet.stem]
    for blocks in resnet.groups:
        for block in blocks:
            layers += block.convs + ([block.shortcut] if block.shortcut is not None else [])
    return layers


def expected_layer_names(resnet):
    """keras.applications names of the weighted layers `resnet` takes weights from: '<ConvBN>_conv', '_bn'."""
    return {f"{layer.name}_{part}" for layer in conv_bn_layers(resnet) for part in ("conv", "bn")}


def check_layer_names(path, depth, names, expected):
    """Raises ValueError naming `path` unless `names` (weighted layers of the file) are `expected` (+ a top)."""
    missing = sorted(expected - set(names))
    unexpected = sorted(set(names) - expected - TOP_LAYERS)
    if missing or unexpected:
        raise ValueError(
            f"{path}: its layers do not match keras.applications ResNet{depth} ({len(missing)} missing, e.g. "
            f"{missing[:3]}; {len(unexpected)} unexpected, e.g. {unexpected[:3]}); is --depth {depth} right?"
        )


def _h5_weighted_layer_names(path):
    """Names of the layers with weights in a legacy Keras HDF5 file (weights-only or full model)."""
    try:
        with h5py.File(path, "r") as f:
            group = f["model_weights"] if "layer_names" not in f.attrs and "model_weights" in f else f
            if "layer_names" not in group.attrs:
                raise ValueError(f"{path}: not a Keras weights file (no 'layer_names' attribute)")
            names = [n.decode() if isinstance(n, bytes) else str(n) for n in group.attrs["layer_names"]]
            return [n for n in names if len(group[n].attrs.get("weight_names", ())) > 0]
    except (OSError, KeyError) as err:
        raise ValueError(f"{path}: cannot read it as a Keras HDF5 weights file ({err})") from err


def load_keras_resnet(path, depth, expected):
    """A keras.applications ResNet{depth} holding the weights of the file at `path`.

    Args:
      path: legacy Keras .h5/.hdf5 (weights-only or full model, with or without top) or a .keras model.
      depth: 50 or 101.
      expected: set of layer names the file must hold (`expected_layer_names`).

    Returns:
      A keras.Model whose layers `get_layer('<name>')` gives for every name in `expected`.

    Raises:
      ValueError naming `path` when it is missing, unreadable, or its layers do not match the depth.
    """
    import keras
    import tensorflow as tf

    if not tf.io.gfile.exists(path):
        raise ValueError(f"--h5 {path}: no such file")
    if path.endswith(".keras"):
        try:
            model = keras.models.load_model(path, compile=False)
        except Exception as err:  # Keras raises many types for a bad archive; all mean the same here.
            raise ValueError(f"{path}: cannot load it as a Keras model ({err})") from err
        check_layer_names(path, depth, [layer.name for layer in model.layers if layer.weights], expected)
        return model
    check_layer_names(path, depth, _h5_weighted_layer_names(path), expected)
    model = getattr(keras.applications, f"ResNet{depth}")(weights=None, include_top=False)
    # By name, so that a file with the classifier top loads into the model without it.
    model.load_weights(path, by_name=True)
    return model


def fold_input_normalization(kernel, bias, input_mean=None, input_std=None):
    """Rewrites keras.applications' first conv for RGB input normalised as (pixel - input_mean) / input_std.

    The original conv sees caffe input x_bgr[j] = pixel[2 - j] - CAFFE_MEAN_RGB[2 - j]; with
    pixel[c] = input_std[c] * x[c] + input_mean[c], conv(x_bgr, kernel) + bias equals
    conv(x, kernel[:, :, ::-1] * input_std) + bias + sum(kernel[:, :, ::-1] * (input_mean - CAFFE_MEAN_RGB)).

    Args:
      kernel: [KH, KW, 3, C] float, input channels in BGR order.
      bias: [C] float.
      input_mean, input_std: 3 floats each, RGB order, 0..255 scale; None: ImageNet's, as the pipeline's.

    Returns:
      (kernel [KH, KW, 3, C] float32 for RGB input, bias [C] float32).
    """
    from mrcnn_tf2.model.pretrained import IMAGENET_MEAN, IMAGENET_STD

    input_mean = IMAGENET_MEAN if input_mean is None else input_mean
    input_std = IMAGENET_STD if input_std is None else input_std
    kernel = np.asarray(kernel, np.float64)
    if kernel.ndim != 4 or kernel.shape[2] != 3:
        raise ValueError(f"kernel: expected [KH, KW, 3, C], got shape {kernel.shape}")
    rgb_kernel = kernel[:, :, ::-1, :]
    std = np.asarray(input_std, np.float64).reshape(1, 1, 3, 1)
    offset = np.asarray(input_mean, np.float64) - np.asarray(CAFFE_MEAN_RGB, np.float64)
    new_bias = np.asarray(bias, np.float64) + np.einsum("hwcd,c->d", rgb_kernel, offset)
    return (rgb_kernel * std).astype(np.float32), new_bias.astype(np.float32)


def _copy_conv_bn(target, conv, bn, path, input_normalization=None):
    """Assigns keras layers `conv` (+ bias) and `bn` to the ConvBN `target`, folding bias and epsilon into BN."""
    from mrcnn_tf2.model.backbone import BN_EPSILON

    kernel = np.asarray(conv.kernel, np.float32)
    bias = np.asarray(conv.bias, np.float32) if conv.use_bias else np.zeros(kernel.shape[-1], np.float32)
    if input_normalization is not None:
        kernel, bias = fold_input_normalization(kernel, bias, *input_normalization)
    channels = kernel.shape[-1]
    values = [
        (target.conv.kernel, kernel),
        (target.bn.gamma, np.asarray(bn.gamma, np.float32) if bn.scale else np.ones(channels, np.float32)),
        (target.bn.beta, np.asarray(bn.beta, np.float32) if bn.center else np.zeros(channels, np.float32)),
        (target.bn.moving_mean, np.asarray(bn.moving_mean, np.float32) - bias),
        (target.bn.moving_variance, np.asarray(bn.moving_variance, np.float32) + np.float32(bn.epsilon - BN_EPSILON)),
    ]
    for variable, value in values:
        if tuple(variable.shape) != value.shape:
            raise ValueError(f"{path}: {variable.path} has shape {value.shape} in the file, the backbone "
                             f"needs {tuple(variable.shape)}")
        variable.assign(value)


def convert_keras_resnet(keras_model, depth, path="keras model", input_mean=None, input_std=None):
    """Our ResNet(depth, stride_in_1x1=True) with the weights of a keras.applications ResNet.

    Args:
      keras_model: keras.applications ResNet{depth} (or a model with the same layer names), built.
      depth: 50 or 101.
      path: names the source in errors.
      input_mean, input_std: RGB normalisation (0..255 scale) of the images the backbone will see; None:
        the pipeline's. CAFFE_MEAN_RGB with std (1, 1, 1) keeps keras' own input, channels reversed.

    Returns:
      A built `ResNet` (freeze_bn and freeze_blocks at their defaults; they do not affect the variables).
    """
    from mrcnn_tf2.model.backbone import ResNet

    resnet = ResNet(depth, stride_in_1x1=True)
    resnet.build((None, None, None, 3))
    for layer in conv_bn_layers(resnet):
        conv, bn = keras_model.get_layer(f"{layer.name}_conv"), keras_model.get_layer(f"{layer.name}_bn")
        normalization = (input_mean, input_std) if layer is resnet.stem else None
        _copy_conv_bn(layer, conv, bn, path, normalization)
    return resnet


def _temporary_files(temporary):
    """The files of the checkpoint (and its JSON) written at the prefix `temporary`."""
    return glob.glob(f"{glob.escape(temporary)}.*")


def _commit_all(temporary, prefix):
    """Renames the files `temporary`.* to `prefix`.*, the index last: until then no checkpoint is readable."""
    names = sorted(_temporary_files(temporary), key=lambda name: name.endswith(".index"))
    # An older checkpoint at the prefix must not look complete while its data is being replaced.
    files.remove(f"{prefix}.index")
    for name in names:
        files.commit(name, prefix + name[len(temporary):])


def _check_complete(prefix, resnet):
    """Raises RuntimeError unless the checkpoint at `prefix` holds every variable of `resnet`.

    tf.train.Checkpoint follows TF's object graph, not Keras' layer tracking: layers that only Keras tracks
    (held in lists, with Keras 3.15) are silently left out, and a reader built the same way would not notice.
    """
    import tensorflow as tf

    saved = [name for name, _ in tf.train.list_variables(prefix) if name != "_CHECKPOINTABLE_OBJECT_GRAPH"]
    expected = len({id(variable) for variable in resnet.weights})
    if len(saved) != expected:
        raise RuntimeError(f"tf.train.Checkpoint(backbone=...) saved {len(saved)} of the backbone's {expected} "
                           "variables: some of its layers are not in TF's object graph")


def write_checkpoint(resnet, prefix, metadata):
    """Writes tf.train.Checkpoint(backbone=resnet) at `prefix` and `metadata` to PREFIX.json, atomically.

    Returns the prefix. Raises RuntimeError when the checkpoint would miss some of the backbone's variables.
    On failure the temporary files are removed and `prefix` is left as it was.
    """
    import tensorflow as tf

    directory = os.path.dirname(prefix)
    if directory:
        os.makedirs(directory, exist_ok=True)
    # The checkpoint's files are written together under one temporary prefix, then committed one by one.
    temporary = files.temporary_path(prefix)
    try:
        tf.train.Checkpoint(backbone=resnet).write(temporary)
        _check_complete(temporary, resnet)
        with open(f"{temporary}.json", "w", encoding="utf-8") as f:
            json.dump(metadata, f, indent=2)
        _commit_all(temporary, prefix)
    finally:
        for name in _temporary_files(temporary):
            files.remove(name)
    return prefix


def convert_file(path, prefix, depth=50):
    """Converts the keras.applications ResNet weights at `path` into a backbone checkpoint at `prefix`.

    Returns the metadata written to PREFIX.json. Raises ValueError naming the file on bad input.
    """
    from mrcnn_tf2.model.backbone import ResNet
    from mrcnn_tf2.model.pretrained import backbone_metadata

    if depth not in KERAS_DEPTHS:
        raise ValueError(f"--depth {depth}: keras.applications weights convert for depths {list(KERAS_DEPTHS)}")
    expected = expected_layer_names(ResNet(depth, stride_in_1x1=True))
    keras_model = load_keras_resnet(path, depth, expected)
    resnet = convert_keras_resnet(keras_model, depth, path)
    metadata = backbone_metadata(depth, os.path.basename(path))
    write_checkpoint(resnet, prefix, metadata)
    return metadata


def build_parser():
    parser = converter_cli.build_parser(__doc__)
    parser.add_argument("--h5", required=True, help="keras.applications ResNet weights (.h5) or model (.h5/.keras)")
    parser.add_argument("--output", required=True, help="checkpoint prefix to write (PREFIX.index, PREFIX.json)")
    parser.add_argument("--depth", type=int, choices=KERAS_DEPTHS, default=50, help="ResNet depth")
    return parser


def convert(args):
    """convert_file of the parsed flags; returns the line that reports it."""
    metadata = convert_file(args.h5, args.output, args.depth)
    return [f"wrote {args.output} ({metadata['backbone']}, stride_in_1x1=true) from {metadata['source']}"]


def main(argv=None):
    """Command-line entry; returns the exit status (`mrcnn_tf2.status`): OK, BAD_INPUT when the file cannot be
    converted, or FAILURE when the backbone's checkpoint would miss variables (nothing is written then)."""
    return converter_cli.run(build_parser(), argv, convert)


if __name__ == "__main__":
    sys.exit(main())
