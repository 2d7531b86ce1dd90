"""Converts a torchvision Mask R-CNN state dict (maskrcnn_resnet50_fpn, MaskRCNN on another ResNet-FPN, or
maskrcnn_resnet50_fpn_v2) into a model directory of this package.

    python weights/convert_torchvision.py --input maskrcnn_resnet50_fpn_coco-bf2d0c1e.pth --output_dir runs/tv
    python main.py infer --preset torchvision --model_dir runs/tv --input 'photos/*.jpg' --visualize
    python weights/convert_torchvision.py --input maskrcnn_resnet50_fpn_v2_coco-73cbd019.pth --output_dir runs/tv2
    python main.py infer --preset torchvision_v2 --model_dir runs/tv2 --input 'photos/*.jpg' --visualize

Input: `torch.save(model.state_dict())` of torchvision.models.detection.maskrcnn_resnet50_fpn, of a MaskRCNN on
`resnet_fpn_backbone` of ResNet-18, 34, 50 or 101 (the depth is read from the blocks), or of
maskrcnn_resnet50_fpn_v2 (v1 and v2 are told apart by their keys, and the run says which), in either torch.save
format, or an .npz with the same keys. PyTorch is not needed: weights/torch_pickle.py reads the file and runs
nothing from it. weights/torchvision_mapping.py places every tensor (current and older key spellings; a
missing, unexpected or mis-shaped key is an error naming it) and holds the conventions of the conversion
(layouts, batch-norm folding and its eps, box-delta order). The number of classes comes from the class logits.

Output: DIR as training writes a model directory: a checkpoint (DIR/checkpoint, DIR/ckpt-0.*) of
`tf.train.Checkpoint(model=MaskRCNN, step=0)` and DIR/config.json (the `torchvision` or `torchvision_v2`
preset, the file's number of classes and ResNet depth), so `main.py eval|infer|export --model_dir DIR` restore
it; DIR/conversion.json (source, model, preset, batch-norm eps); and, for a model of COCO's 91 classes,
DIR/label_map.json {"category id": "name"} of torchvision's COCO categories, which `main.py infer` names the
classes by. DIR is written under a temporary name and renamed when complete, so a failed run leaves nothing
there; an existing DIR is replaced only if this converter wrote it. With --preset, a file of the other version
is refused, naming both.

This file writes and parses flags; TensorFlow and the model are imported inside the functions that build and
write the model, so that --help answers at once (`converter_cli.run` starts TensorFlow after parsing).
"""

import os
import sys

import numpy as np

from mrcnn_tf2 import files, presets
from mrcnn_tf2.config import Config, ConfigError

# The converters' siblings: run as a file, Python puts this folder first on sys.path; imported as
# weights.convert_torchvision (by the tests), they are modules of the weights package.
if __package__:
    from . import converter_cli, torch_pickle
    from . import torchvision_mapping as tv
else:
    import converter_cli
    import torch_pickle
    import torchvision_mapping as tv

CONVERSION_FILE = "conversion.json"


def _resolve(obj, attributes):
    """obj.a[i].b ... for attributes ('a', i, 'b', ...): names are attributes, others list indices or dict keys."""
    for attribute in attributes:
        obj = getattr(obj, attribute) if isinstance(attribute, str) else obj[attribute]
    return obj


def torchvision_config(preset, num_classes, depth, output_dir):
    """Config() with the `preset` of the file's version (torchvision or torchvision_v2), `num_classes` and ResNet
    `depth`: what the model directory's config.json holds."""
    config = Config()
    for key, value in presets.values(preset).items():
        config.set(key, value)
    config.set("model.num_classes", num_classes)
    config.set("model.backbone", f"resnet{depth}")
    config.set("runtime.model_dir", output_dir)
    config.validate()
    return config


def build_model_variables(config):
    """build_model(config, export=True) (pure TF ops) with every variable created."""
    from mrcnn_tf2.model.factory import build_model

    model = build_model(config, export=True)
    model.build()
    return model


def assign_weights(model, converted):
    """Assigns `convert_all`'s values to `model`'s variables.

    Raises RuntimeError when a value does not fit its variable or a variable of the model gets no value: the
    layout and the model disagree (a bug, not bad input).
    """
    assigned = set()
    for entry, values in converted:
        layer = _resolve(model, entry.target)
        for attributes, value in values:
            variable = _resolve(layer, attributes)
            if tuple(variable.shape) != value.shape:
                raise RuntimeError(f"{entry.key}: converted to {value.shape}, but {variable.path} is "
                                   f"{tuple(variable.shape)}")
            variable.assign(value)
            assigned.add(id(variable))
    left = [variable.path for variable in model.weights if id(variable) not in assigned]
    if left:
        raise RuntimeError(f"no torchvision weights for {len(left)} variables of the model: {', '.join(left)}")


def write_model_dir(model, config, output_dir, metadata, label_map=None):
    """Writes output_dir as training would (checkpoint ckpt-0 of model and step 0, config.json) plus
    conversion.json (`metadata`) and, given a `label_map` {category id: name}, label_map.json, all under a
    temporary name renamed at the end (an existing output_dir is replaced). Raises RuntimeError when the
    checkpoint would miss some of the model's variables."""
    import tensorflow as tf

    from mrcnn_tf2.runtime.predictor import LABEL_MAP_FILE

    output_dir = os.path.abspath(output_dir)
    os.makedirs(os.path.dirname(output_dir), exist_ok=True)
    with files.atomic_path(output_dir) as temporary:
        checkpoint = tf.train.Checkpoint(model=model, step=tf.Variable(0, dtype=tf.int64, trainable=False))
        prefix = tf.train.CheckpointManager(checkpoint, temporary, max_to_keep=1).save(checkpoint_number=0)
        # TF's checkpoints follow its object graph, not Keras' layer tracking: check nothing was left out.
        saved = [name for name, _ in tf.train.list_variables(prefix) if name.startswith("model/")]
        expected = len({id(variable) for variable in model.weights})
        if len(saved) != expected:
            raise RuntimeError(f"the checkpoint holds {len(saved)} of the model's {expected} variables")
        config.save(temporary)
        files.write_json(os.path.join(temporary, CONVERSION_FILE), metadata, indent=2)
        if label_map:
            files.write_json(os.path.join(temporary, LABEL_MAP_FILE), label_map, indent=2)  # JSON keys: "1", ...


def check_output_dir(output_dir):
    """Raises ValueError unless output_dir may be written: absent, empty, or written by this converter."""
    if os.path.lexists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"--output_dir {output_dir}: exists and is not a directory")
    if (os.path.isdir(output_dir) and os.listdir(output_dir)
            and not os.path.isfile(os.path.join(output_dir, CONVERSION_FILE))):
        raise ValueError(f"--output_dir {output_dir}: not empty and not written by this converter (it would be "
                         "replaced); choose another directory")


def convert_file(path, output_dir, bn_eps=None, preset=None):
    """Converts the torchvision Mask R-CNN state dict at `path` into the model directory `output_dir`.

    Args:
      path: .pth (torch.save of the state dict) or .npz with its keys.
      output_dir: the model directory to write (see the module docstring).
      bn_eps: eps of torchvision's batch norms; None: by the num_batches_tracked rule.
      preset: the preset the file is expected under (torchvision: v1, torchvision_v2: v2); None: whichever the
        keys say.

    Returns:
      The metadata written to conversion.json: source, model (torchvision's builder), preset, num_classes,
      tensors (converted), ignored
      (num_batches_tracked), bn_eps and bn_eps_rule. A model of COCO's 91 classes also gets label_map.json
      (`torchvision_mapping.coco_label_map`).

    Raises:
      ValueError naming the file or flag on bad input (nothing is written then); RuntimeError when the model
      and the layout disagree.
    """
    if bn_eps is not None and not (np.isfinite(bn_eps) and bn_eps >= 0):
        raise ValueError(f"--bn_eps {bn_eps}: must be a finite number >= 0")
    check_output_dir(output_dir)
    tensors, original = tv.current_spellings(torch_pickle.read_state_dict(path), path)
    num_classes, depth = tv.check_is_mask_rcnn(tensors, path)
    version = tv.VERSIONS[tv.find_version(tensors, path)]
    if preset is not None and preset != version["preset"]:
        expected = next(known for known in tv.VERSIONS.values() if known["preset"] == preset)
        raise ValueError(f"{path}: holds torchvision's {version['builder']} (it has {version['key']}), but "
                         f"--preset {preset} is {expected['builder']}: pass --preset {version['preset']}")
    try:
        config = torchvision_config(version["preset"], num_classes, depth, output_dir)
    except ConfigError as err:  # e.g. fewer than 2 classes
        raise ValueError(f"{path}: {err}") from None
    entries = version["layout"](config)
    tv.check_tensors(tensors, entries, path, original)
    eps, rule = tv.choose_bn_eps(tensors, entries, path, bn_eps)
    converted = tv.convert_all(tensors, entries, eps, path)
    model = build_model_variables(config)
    assign_weights(model, converted)
    used = sum(len(entry.torch_shapes()) for entry in entries)
    metadata = {"source": os.path.basename(path), "model": version["builder"], "preset": version["preset"],
                "num_classes": config.model.num_classes,
                "backbone": config.model.backbone, "tensors": used,
                "ignored": len(tensors) - used, "bn_eps": eps, "bn_eps_rule": rule}
    write_model_dir(model, config, output_dir, metadata, tv.coco_label_map(num_classes))
    return metadata


def build_parser():
    parser = converter_cli.build_parser(__doc__)
    parser.add_argument("--input", required=True,
                        help="torch.save(model.state_dict()) of a torchvision Mask R-CNN (.pth), or an .npz of its "
                             "keys")
    parser.add_argument("--output_dir", required=True,
                        help="model directory to write (checkpoint, config.json), for main.py --model_dir")
    parser.add_argument("--preset", choices=[known["preset"] for known in tv.VERSIONS.values()], default=None,
                        help="refuse a file that is not this preset's model (torchvision: maskrcnn_resnet50_fpn, "
                             "torchvision_v2: maskrcnn_resnet50_fpn_v2); default: whichever its keys say")
    parser.add_argument("--bn_eps", type=float, default=None,
                        help="eps of the model's batch norms (default: 1e-5 with num_batches_tracked keys, else 0 "
                             "as torchvision's released COCO weights)")
    return parser


def convert(args):
    """convert_file of the parsed flags; returns the lines that report it."""
    metadata = convert_file(args.input, args.output_dir, args.bn_eps, args.preset)
    return [f"found torchvision's {metadata['model']}: use --preset {metadata['preset']}",
            f"batch norm eps {metadata['bn_eps']:g} ({metadata['bn_eps_rule']})",
            f"wrote {args.output_dir}: {metadata['tensors']} tensors converted ({metadata['ignored']} "
            f"{tv.BN_COUNTER} ignored), {metadata['num_classes']} classes, from {metadata['source']}"]


def main(argv=None):
    """Command-line entry; returns the exit status (`mrcnn_tf2.status`): OK, BAD_INPUT when the file cannot be
    converted (nothing is written), FAILURE when the model would not take every weight."""
    return converter_cli.run(build_parser(), argv, convert)


if __name__ == "__main__":
    sys.exit(main())
