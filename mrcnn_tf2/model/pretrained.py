"""The contract between a converted pretrained backbone and the model: its input normalisation and PREFIX.json.

weights/convert_keras_resnet.py writes a backbone checkpoint at PREFIX with `backbone_metadata` in
PREFIX.json; the trainer reads it back with `check_backbone_metadata` before loading the weights. The
ImageNet statistics live here because they are what an ImageNet-pretrained backbone was trained to see:
the input pipeline normalises images with them, and a checkpoint converted for other ones is refused.
"""

import json

import numpy as np
import tensorflow as tf

from mrcnn_tf2.config import ConfigError

# Per-channel RGB mean and standard deviation of ImageNet, on the 0..255 scale.
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)


def backbone_metadata(depth, source):
    """PREFIX.json of a keras.applications ResNet{depth} converted from the file named `source`.

    Returns:
      dict {"backbone": "resnet<depth>", "stride_in_1x1": True (keras.applications is ResNet v1),
      "source": source, "input_mean_rgb": [3 floats], "input_std_rgb": [3 floats]} (0..255 scale).
    """
    return {
        "backbone": f"resnet{depth}",
        "stride_in_1x1": True,
        "source": source,
        "input_mean_rgb": list(IMAGENET_MEAN),
        "input_std_rgb": list(IMAGENET_STD),
    }


def check_backbone_metadata(checkpoint_prefix, model_config):
    """Checks that a converted backbone checkpoint suits the model config, before the trainer loads it.

    Args:
      checkpoint_prefix: the --backbone_checkpoint prefix; its PREFIX.json is read when present.
      model_config: mrcnn_tf2.config.ModelConfig (reads .backbone and .stride_in_1x1).

    Returns:
      The metadata dict, or None when the checkpoint has no PREFIX.json (nothing to check).

    Raises:
      ConfigError (a ValueError) with key '--backbone' or 'model.stride_in_1x1' on a mismatch; ValueError
      naming the file when PREFIX.json is unreadable or the checkpoint expects another input normalisation.
    """
    path = f"{checkpoint_prefix}.json"
    if not tf.io.gfile.exists(path):
        return None
    try:
        with tf.io.gfile.GFile(path) as f:
            metadata = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: unreadable backbone metadata ({err})") from err
    if metadata.get("backbone") != model_config.backbone:
        raise ConfigError("--backbone", f"is {model_config.backbone}, but the backbone checkpoint {checkpoint_prefix} "
                                        f"holds {metadata.get('backbone')}")
    if bool(metadata.get("stride_in_1x1")) != model_config.stride_in_1x1:
        value = str(bool(metadata.get("stride_in_1x1"))).lower()
        raise ConfigError("model.stride_in_1x1", f"is {str(model_config.stride_in_1x1).lower()}, but the backbone "
                                                 f"checkpoint {checkpoint_prefix} needs "
                                                 f"--config_override model.stride_in_1x1={value}")
    for key, values in (("input_mean_rgb", IMAGENET_MEAN), ("input_std_rgb", IMAGENET_STD)):
        if key in metadata and not np.allclose(metadata[key], values):
            raise ValueError(f"{path}: the backbone was converted for {key} {metadata[key]}, the input pipeline "
                             f"uses {list(values)}; convert it again")
    return metadata


def load_backbone_checkpoint(backbone, checkpoint_prefix, name):
    """Reads the converted backbone checkpoint at `checkpoint_prefix` (weights/convert_keras_resnet.py's) into
    the built `backbone` (a model.backbone.ResNet, `name` its --backbone), every one of its variables.

    Raises ConfigError('--backbone_checkpoint') when the checkpoint holds no value for some of them: another
    depth, or a whole Mask R-CNN checkpoint (whose backbone sits under model/, for --init_checkpoint).
    """
    loaded = tf.train.Checkpoint(backbone=backbone).read(checkpoint_prefix)
    loaded.expect_partial()  # a converted backbone holds the classifier's head too
    try:
        loaded.assert_existing_objects_matched()
    except AssertionError:
        raise ConfigError("--backbone_checkpoint", f"{checkpoint_prefix} holds no weights of this model's {name} "
                                                   "(a Mask R-CNN checkpoint goes to --init_checkpoint)") from None
