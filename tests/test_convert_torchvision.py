"""Tests of weights/convert_torchvision.py (a torchvision Mask R-CNN state dict -> a model directory) and of the
modules it is made of: weights/torch_pickle.py (the reader) and weights/torchvision_mapping.py (the mapping).

torch and torchvision are test-only dependencies: the tests build torchvision models, save their state dicts
with torch.save and compare the layers' outputs with ours; the converter itself reads the files without torch.
"""
import collections
import json
import os
import pickletools
import re
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import tensorflow as tf
import torch
import torchvision
from torchvision.models.detection import MaskRCNN
from torchvision.models.detection._utils import overwrite_eps
from torchvision.models.detection.backbone_utils import _resnet_fpn_extractor, resnet_fpn_backbone
from torchvision.ops.misc import FrozenBatchNorm2d

from mrcnn_tf2 import arguments, presets, status
from mrcnn_tf2.config import load_saved_config
from mrcnn_tf2.runtime import predictor
from mrcnn_tf2.runtime.predictor import load_model
from tests.support import ROOT, maskrcnn_resnet50_fpn, randomize, run_converter
from weights import convert_torchvision as conv
from weights import torch_pickle
from weights import torchvision_mapping as tv

# The module's torchvision models and their conversions are module fixtures: its tests run on one pytest-xdist
# worker, which makes them once.
pytestmark = pytest.mark.xdist_group("convert_torchvision")
# Inputs of the equivalence test: a multiple of 64, and a multiple of 32 that is not one of 64 (odd C5, P6
# subsampled from it).
IMAGE_SIZES = ((256, 320), (224, 288))
NUM_ROIS = 12
# Tolerance of a compared output, relative to its largest magnitude (float32 through 50 layers).
RELATIVE_TOLERANCE = 1e-4
FROZEN_CLASSES = 7  # the FrozenBatchNorm2d model's classes: the converter reads them from the state dict


def frozen_mask_rcnn(num_classes, seed):
    """maskrcnn_resnet50_fpn as torchvision builds it with pretrained weights (FrozenBatchNorm2d), randomised,
    run with eps 0 like its released COCO weights."""
    torch.manual_seed(seed)
    backbone = _resnet_fpn_extractor(torchvision.models.resnet50(weights=None, norm_layer=FrozenBatchNorm2d), 3)
    model = randomize(MaskRCNN(backbone, num_classes=num_classes), seed)
    overwrite_eps(model, 0.0)
    return model


def checkpoint_values(model_dir):
    """{variable name: value} of the model in the newest checkpoint of `model_dir`."""
    reader = tf.train.load_checkpoint(str(model_dir))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map() if name.startswith("model/")}


def assert_same_checkpoints(a, b):
    values_a, values_b = checkpoint_values(a), checkpoint_values(b)
    assert values_a.keys() == values_b.keys()
    different = [name for name in values_a if not np.array_equal(values_a[name], values_b[name])]
    assert not different, f"{len(different)} variables differ, e.g. {different[:3]}"


def assert_close(ours, theirs, what):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    assert ours.shape == theirs.shape, what
    scale = np.abs(theirs).max()
    assert scale > 0, f"{what}: all zero, compares nothing"
    error = np.abs(ours - theirs).max()
    assert error <= RELATIVE_TOLERANCE * scale, f"{what}: max error {error:.3g} of max magnitude {scale:.3g}"


def to_nhwc(tensor):
    return tf.constant(tensor.detach().numpy().transpose(0, 2, 3, 1))


# -- fixtures: torchvision models, their files, their conversions ----------------------------------------------


@pytest.fixture(scope="module")
def torch_models(torchvision_v1):
    """{'batch_norm': the suite's maskrcnn_resnet50_fpn (conftest's torchvision_v1: nn.BatchNorm2d, eps 1e-5, 91
    classes, randomised), 'frozen': the FrozenBatchNorm2d build at eps 0 with FROZEN_CLASSES classes}."""
    batch_norm = maskrcnn_resnet50_fpn()
    batch_norm.load_state_dict(torch.load(torchvision_v1["state_dict"], weights_only=True))
    assert isinstance(batch_norm.backbone.body.bn1, torch.nn.BatchNorm2d)
    return {"batch_norm": batch_norm.eval(), "frozen": frozen_mask_rcnn(FROZEN_CLASSES, 1)}


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("torchvision")


@pytest.fixture(scope="module")
def state_dict_files(torch_models, torchvision_v1, files_dir):
    """{kind: path of torch.save(model.state_dict())}."""
    paths = {"batch_norm": torchvision_v1["state_dict"], "frozen": files_dir / "frozen.pth"}
    torch.save(torch_models["frozen"].state_dict(), paths["frozen"])
    return paths


@pytest.fixture(scope="module")
def converted(state_dict_files, torchvision_v1, files_dir):
    """{kind: (model_dir, stdout)} of the converter run with its default eps on each state dict."""
    model_dir = files_dir / "frozen_model"
    code, out, err = run_converter("--input", state_dict_files["frozen"], "--output_dir", model_dir)
    assert code == status.OK, err
    return {"batch_norm": (torchvision_v1["model_dir"], torchvision_v1["converter_output"]), "frozen": (model_dir, out)}


@pytest.fixture(scope="module")
def our_models(converted):
    """{kind: our MaskRCNN restored from the converted directory}.

    'batch_norm' (91 classes) goes the way of `main.py eval --preset torchvision --model_dir DIR`: the
    command line's config, then predictor.load_model (at a small image size: the weights do not depend on
    it). 'frozen' (FROZEN_CLASSES classes, so without --preset, whose num_classes is 91) is restored into the
    converter's own build, which load_model's trace would only repeat.
    """
    models = {}
    model_dir = converted["batch_norm"][0]
    _, config = arguments.parse(["eval", "--preset", "torchvision", "--model_dir", str(model_dir),
                                 "--eval_batch_size", "1", "--custom_ops", "off"])
    config.set("data.image_size", IMAGE_SIZES[0])
    loaded = load_model(config, export=True)
    assert loaded.checkpoint == str(model_dir / "ckpt-0") and loaded.step == 0
    models["batch_norm"] = loaded.model
    _, config = arguments.parse(["eval", "--model_dir", str(converted["frozen"][0])])
    assert config.model.num_classes == FROZEN_CLASSES
    models["frozen"] = conv.build_model_variables(config)
    for kind, model in models.items():
        # Every variable of the model restored, and every value of the checkpoint used.
        checkpoint = tf.train.Checkpoint(model=model, step=tf.Variable(0, dtype=tf.int64))
        checkpoint.save_counter  # noqa: B018  (created, so that the checkpoint's counter is consumed too)
        checkpoint.read(tf.train.latest_checkpoint(str(converted[kind][0]))).assert_consumed()
    return models


# -- equivalence of the learned layers -------------------------------------------------------------------------


@pytest.mark.timeout(300)  # the first of them builds and converts two torchvision ResNet-50 Mask R-CNNs
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["batch_norm", "frozen"])
@pytest.mark.parametrize("image_size", IMAGE_SIZES)
def test_converted_layers_compute_what_torchvisions_compute(kind, image_size, torch_models, our_models):
    theirs, ours = torch_models[kind], our_models[kind]
    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.standard_normal((1, 3) + image_size, dtype=np.float32))
    with torch.no_grad():
        their_features = list(theirs.backbone(images).values())  # '0'..'3', 'pool': P2..P6
        their_scores, their_boxes = theirs.rpn.head(their_features)
    our_features = ours.fpn(ours.backbone(to_nhwc(images), training=False), training=False)
    assert sorted(our_features) == [2, 3, 4, 5, 6]
    for level, feature in zip(range(2, 7), their_features):
        assert_close(our_features[level], to_nhwc(feature), f"P{level}")
    # The RPN head on torchvision's features, so that its mapping is tested alone.
    rpn = ours.rpn_head({level: to_nhwc(f) for level, f in zip(range(2, 7), their_features)})
    for level, scores, boxes in zip(range(2, 7), their_scores, their_boxes):
        assert_close(rpn["rpn_scores"][level], to_nhwc(scores), f"RPN objectness P{level}")
        # Ours (dy, dx, dh, dw) per anchor; the same permutation maps it back to torchvision's (dx, dy, dw, dh).
        ours_as_theirs = tf.gather(rpn["rpn_boxes"][level], tv.xy_swap_order(boxes.shape[1]), axis=-1)
        assert_close(ours_as_theirs, to_nhwc(boxes), f"RPN deltas P{level}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["batch_norm", "frozen"])
def test_converted_box_and_mask_heads_compute_what_torchvisions_compute(kind, torch_models, our_models):
    theirs, ours = torch_models[kind], our_models[kind]
    rng = np.random.default_rng(1)
    box_features = torch.from_numpy(rng.standard_normal((NUM_ROIS, 256, 7, 7), dtype=np.float32))
    mask_features = torch.from_numpy(rng.standard_normal((NUM_ROIS, 256, 14, 14), dtype=np.float32))
    num_classes = theirs.roi_heads.box_predictor.cls_score.out_features
    classes = np.concatenate([[0, num_classes - 1], rng.integers(0, num_classes, NUM_ROIS - 2)])
    with torch.no_grad():
        class_logits, box_deltas = theirs.roi_heads.box_predictor(theirs.roi_heads.box_head(box_features))
        mask_logits = theirs.roi_heads.mask_predictor(theirs.roi_heads.mask_head(mask_features))
    box = ours.box_head(to_nhwc(box_features)[None])
    assert_close(box["class_logits"][0], class_logits, "class logits")
    # [N, K, (dy, dx, dh, dw)] -> torchvision's [N, K * (dx, dy, dw, dh)].
    ours_deltas = tf.reshape(box["box_deltas"][0], [NUM_ROIS, -1])
    assert_close(tf.gather(ours_deltas, tv.xy_swap_order(4 * num_classes), axis=1), box_deltas, "box deltas")
    masks = ours.mask_head((to_nhwc(mask_features)[None], tf.constant(classes[None], tf.int32)))
    assert_close(masks[0], mask_logits.numpy()[np.arange(NUM_ROIS), classes], "mask logits")


def test_the_batch_norm_eps_follows_num_batches_tracked_and_is_printed(converted):
    for kind, eps in (("batch_norm", 1e-5), ("frozen", 0.0)):
        model_dir, out = converted[kind]
        with open(model_dir / conv.CONVERSION_FILE) as f:
            assert json.load(f)["bn_eps"] == eps
        assert out.splitlines()[1].startswith(f"batch norm eps {eps:g} (")  # after the version found
    assert "num_batches_tracked keys: nn.BatchNorm2d" in converted["batch_norm"][1]
    assert "no num_batches_tracked keys: FrozenBatchNorm2d" in converted["frozen"][1]


def test_the_model_directory_holds_a_training_checkpoint_and_the_presets_config(converted, state_dict_files):
    model_dir, out = converted["frozen"]
    assert sorted(os.listdir(model_dir)) == ["checkpoint", "ckpt-0.data-00000-of-00001", "ckpt-0.index",
                                             "config.json", conv.CONVERSION_FILE]
    assert tf.train.latest_checkpoint(str(model_dir)) == str(model_dir / "ckpt-0")
    saved = load_saved_config(str(model_dir))
    for key, value in presets.values("torchvision").items():
        assert saved[key] == (FROZEN_CLASSES if key == "model.num_classes" else value), key
    summary = out.splitlines()[2]
    assert summary == (f"wrote {model_dir}: 307 tensors converted (0 num_batches_tracked ignored), "
                       f"{FROZEN_CLASSES} classes, from frozen.pth")
    assert "53 num_batches_tracked ignored" in converted["batch_norm"][1]
    # Nothing but the directory: no temporary left beside it.
    assert not [name for name in os.listdir(model_dir.parent) if ".tmp-" in name or ".old-" in name]


def test_a_coco_model_directory_holds_torchvisions_class_names_and_another_none(converted):
    coco_dir, other_dir = converted["batch_norm"][0], converted["frozen"][0]  # 91 and FROZEN_CLASSES classes
    assert predictor.read_label_map(str(coco_dir / predictor.LABEL_MAP_FILE)) == tv.coco_label_map(91)
    assert not (other_dir / predictor.LABEL_MAP_FILE).exists()
    # What `main.py infer --model_dir DIR` names the classes by.
    _, config = arguments.parse(["infer", "--preset", "torchvision", "--model_dir", str(coco_dir)])
    names = predictor.category_names(config)
    assert names[1] == "person" and names[90] == "toothbrush" and names[12] == "12"  # 12: no COCO category


def test_the_coco_names_are_those_of_torchvisions_coco_weights():
    weights = torchvision.models.detection.MaskRCNN_ResNet50_FPN_Weights.COCO_V1
    assert list(tv.COCO_CATEGORIES) == weights.meta["categories"]
    label_map = tv.coco_label_map(len(tv.COCO_CATEGORIES))
    assert len(label_map) == 80 and min(label_map) == 1 and max(label_map) == 90
    assert tv.coco_label_map(FROZEN_CLASSES) is None


# -- other inputs of the same weights --------------------------------------------------------------------------


def old_spellings(state_dict):
    """The state dict with the keys of older torchvision releases (as in its released COCO weights' file)."""
    renamed = collections.OrderedDict()
    for key, value in state_dict.items():
        parts = key.split(".")
        if key.startswith(("backbone.fpn.inner_blocks.", "backbone.fpn.layer_blocks.")):
            key = ".".join(parts[:4] + parts[5:])  # backbone.fpn.inner_blocks.N.0.weight -> ...N.weight
        elif key.startswith("rpn.head.conv.0.0."):
            key = f"rpn.head.conv.{parts[-1]}"
        elif key.startswith("roi_heads.mask_head."):
            key = f"roi_heads.mask_head.mask_fcn{int(parts[2]) + 1}.{parts[-1]}"
        renamed[key] = value
    return renamed


@pytest.mark.slow
def test_npz_and_old_key_spellings_convert_to_the_same_weights(torch_models, converted, files_dir):
    state_dict = torch_models["frozen"].state_dict()
    npz = files_dir / "frozen.npz"
    np.savez(npz, **{key: value.numpy() for key, value in state_dict.items()})
    old = files_dir / "frozen_old_spellings.pth"
    renamed = old_spellings(state_dict)
    assert {"backbone.fpn.inner_blocks.0.weight", "rpn.head.conv.weight",
            "roi_heads.mask_head.mask_fcn4.bias"} <= renamed.keys()
    torch.save(renamed, old)
    model_dir = files_dir / "again"
    # The second run replaces the first's directory (which this converter wrote).
    for path in (npz, old):
        code, _, err = run_converter("--input", path, "--output_dir", model_dir)
        assert code == status.OK, err
        assert_same_checkpoints(model_dir, converted["frozen"][0])


@pytest.mark.slow
def test_bn_eps_override_changes_the_folding_and_is_printed(torch_models, state_dict_files, converted, files_dir):
    model_dir = files_dir / "eps"
    code, out, err = run_converter("--input", state_dict_files["frozen"], "--output_dir", model_dir,
                                   "--bn_eps", "1e-5")
    assert code == status.OK, err
    assert out.splitlines()[1] == "batch norm eps 1e-05 (--bn_eps)"
    state_dict = torch_models["frozen"].state_dict()
    overridden, default = checkpoint_values(model_dir), checkpoint_values(converted["frozen"][0])
    for ours, bn in (("model/backbone/stem/bn", "backbone.body.bn1"),
                     ("model/backbone/conv4_block6/conv4_block6_3/bn", "backbone.body.layer3.5.bn3")):
        gamma, beta, mean, var = (state_dict[f"{bn}.{name}"].double().numpy() for name in tv.BN_PARAMETERS)
        for values, eps in ((overridden, 1e-5), (default, 0.0)):
            scale = gamma / np.sqrt(var + eps)
            np.testing.assert_allclose(values[f"{ours}/gamma/.ATTRIBUTES/VARIABLE_VALUE"], scale, rtol=1e-6)
            np.testing.assert_allclose(values[f"{ours}/beta/.ATTRIBUTES/VARIABLE_VALUE"], beta - mean * scale,
                                       rtol=1e-6, atol=1e-6)
            assert not values[f"{ours}/moving_mean/.ATTRIBUTES/VARIABLE_VALUE"].any()
            assert np.all(values[f"{ours}/moving_variance/.ATTRIBUTES/VARIABLE_VALUE"] + np.float32(1e-5) == 1)
        # The variances reach 1e-6: eps 1e-5 changes those channels' scale several-fold.
        assert np.min(overridden[f"{ours}/gamma/.ATTRIBUTES/VARIABLE_VALUE"]
                      / default[f"{ours}/gamma/.ATTRIBUTES/VARIABLE_VALUE"]) < 0.5


# -- reading torch.save files without torch ---------------------------------------------------------------------


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_the_reader_honours_dtype_offset_size_and_stride(tmp_path, zip_format):
    base = torch.arange(24, dtype=torch.float32) / 7
    tensors = collections.OrderedDict(
        transposed=base[:12].reshape(3, 4).t(),  # strides (1, 4)
        offset_view=base[5:11].reshape(2, 3),  # shares base's storage from element 5
        whole=base,
        every_other=base[::2],
        half=torch.linspace(-2, 2, 5).half(),
        double=torch.linspace(-2, 2, 5).double(),
        bfloat16=torch.linspace(-2, 2, 5).bfloat16(),
        counter=torch.tensor(7),
    )
    path = tmp_path / "tensors.pth"
    torch.save(tensors, path, _use_new_zipfile_serialization=zip_format)
    assert zipfile.is_zipfile(path) is zip_format
    read = torch_pickle.read_state_dict(str(path))
    assert list(read) == list(tensors)
    for key, tensor in tensors.items():
        expected = tensor.float().numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()
        assert read[key].dtype == expected.dtype and read[key].shape == expected.shape, key
        np.testing.assert_array_equal(read[key], expected, err_msg=key)


def test_the_reader_and_the_mapping_import_neither_tensorflow_nor_torch(tmp_path):
    path = tmp_path / "tensors.pth"
    torch.save({"w": torch.arange(6.0).reshape(2, 3)}, path)
    code = ("import sys\nfrom weights import torch_pickle, torchvision_mapping\n"
            "print(torch_pickle.read_state_dict(sys.argv[1])['w'].tolist())\n"
            "print(sorted(name for name in ('tensorflow', 'keras', 'torch') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]", "[]"]


def test_a_file_with_both_spellings_of_a_key_is_refused():
    tensors = {"rpn.head.conv.weight": np.zeros(1), "rpn.head.conv.0.0.weight": np.zeros(1)}
    with pytest.raises(ValueError, match=r"f\.pth: rpn\.head\.conv\.weight and rpn\.head\.conv\.0\.0\.weight"):
        tv.current_spellings(tensors, "f.pth")


# -- bad input: exit status 2, the file and the problem named, nothing written -----------------------------------


def os_system_pickle(marker):
    """A pickle whose GLOBAL opcode names os.system, called with 'touch <marker>' if anything unpickles it."""
    command = f"touch {marker}".encode()
    # PROTO 2, GLOBAL 'os system', BINUNICODE command, TUPLE1, REDUCE (the call), STOP.
    return b"\x80\x02cos\nsystem\nX" + struct.pack("<I", len(command)) + command + b"\x85R."


def write_torch_zip(path, data_pkl):
    """A zip laid out as torch.save's, holding `data_pkl`."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")


def assert_refused(tmp_path, path, *expected, output_dir=None):
    """Runs the converter on `path`: exit status 2, stderr naming the file and each of `expected`, and
    output_dir left as it was (absent by default), with no temporary beside it."""
    output_dir = output_dir or tmp_path / "model"
    before = sorted(os.listdir(output_dir)) if output_dir.exists() else None
    code, out, err = run_converter("--input", path, "--output_dir", output_dir)
    assert code == status.BAD_INPUT, (out, err)
    assert str(path) in err, err
    for text in expected:
        assert text in err, err
    assert (sorted(os.listdir(output_dir)) if output_dir.exists() else None) == before
    assert not [name for name in os.listdir(output_dir.parent) if ".tmp-" in name]
    return err


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_a_pickle_naming_os_system_is_refused_without_running_it(tmp_path, zip_format):
    marker = tmp_path / "pwned"
    payload = os_system_pickle(marker)
    assert ("GLOBAL", "os system") in [(op.name, arg) for op, arg, _ in pickletools.genops(payload)]
    path = tmp_path / "evil.pth"
    if zip_format:
        write_torch_zip(path, payload)
    else:
        path.write_bytes(payload)
    # The command-line program, as a user runs it; it must not import torch either (`-X importtime` lists every
    # module imported on stderr).
    result = subprocess.run([sys.executable, "-X", "importtime", "weights/convert_torchvision.py", "--input",
                             str(path), "--output_dir", str(tmp_path / "m")], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == status.BAD_INPUT, result.stderr
    assert "| tensorflow" in result.stderr  # the list is there: the converter starts TensorFlow
    assert not re.search(r"\| +torch(\.|$)", result.stderr, re.MULTILINE)
    assert f"{path}: refused to load os.system" in result.stderr
    assert not marker.exists()
    assert not (tmp_path / "m").exists()


def test_a_truncated_file_is_refused_and_leaves_the_previous_model(tmp_path, state_dict_files):
    truncated = tmp_path / "truncated.pth"
    data = state_dict_files["frozen"].read_bytes()
    truncated.write_bytes(data[:len(data) // 2])
    previous = tmp_path / "model"
    previous.mkdir()
    (previous / conv.CONVERSION_FILE).write_text("{}")
    assert_refused(tmp_path, truncated, "truncated or corrupt", output_dir=previous)
    legacy = tmp_path / "legacy.pth"
    torch.save(collections.OrderedDict(w=torch.ones(1000)), legacy, _use_new_zipfile_serialization=False)
    legacy.write_bytes(legacy.read_bytes()[:-100])
    assert_refused(tmp_path, legacy, "truncated")


def test_a_file_that_is_not_a_state_dict_is_refused(tmp_path):
    listing = tmp_path / "list.pth"
    torch.save([torch.ones(2)], listing)
    assert_refused(tmp_path, listing, "holds a list, not a state dict")
    checkpoint = tmp_path / "checkpoint.pth"
    torch.save({"model": {"w": torch.ones(2)}, "epoch": 3}, checkpoint)
    assert_refused(tmp_path, checkpoint, "not a state dict", "torch.save(checkpoint['model'])")
    text = tmp_path / "notes.pth"
    text.write_text("weights")
    assert_refused(tmp_path, text, "neither a torch.save file")


def test_a_resnet50_classifier_is_not_a_mask_rcnn(tmp_path):
    path = tmp_path / "resnet50.pth"
    torch.save(torchvision.models.resnet50(weights=None).state_dict(), path)
    assert_refused(tmp_path, path, "not a torchvision Mask R-CNN state dict", "backbone.body (ResNet)",
                   "roi_heads.mask_predictor (mask predictor)", "its keys begin with bn1, conv1, fc, layer1")


@pytest.mark.slow
@pytest.mark.parametrize("depth", [18, 101])
def test_other_resnet_depths_convert_and_compute_what_torchvision_computes(tmp_path, depth):
    """MaskRCNN on resnet_fpn_backbone of ResNet-18 (basic blocks, no projection in its first block) and
    ResNet-101: the depth is read from the blocks and the backbone + FPN features agree."""
    torch.manual_seed(depth)
    backbone = resnet_fpn_backbone(backbone_name=f"resnet{depth}", weights=None, trainable_layers=5,
                                   norm_layer=torch.nn.BatchNorm2d)
    theirs = randomize(MaskRCNN(backbone, num_classes=5), depth)
    path = tmp_path / f"maskrcnn_resnet{depth}.pth"
    torch.save(theirs.state_dict(), path)
    code, _, err = run_converter("--input", path, "--output_dir", tmp_path / "model")
    assert code == status.OK, err
    assert load_saved_config(str(tmp_path / "model"))["model.backbone"] == f"resnet{depth}"
    with open(tmp_path / "model" / conv.CONVERSION_FILE) as f:
        assert json.load(f)["backbone"] == f"resnet{depth}"
    _, config = arguments.parse(["eval", "--model_dir", str(tmp_path / "model")])
    ours = conv.build_model_variables(config)
    checkpoint = tf.train.Checkpoint(model=ours, step=tf.Variable(0, dtype=tf.int64))
    checkpoint.save_counter  # noqa: B018
    checkpoint.read(tf.train.latest_checkpoint(str(tmp_path / "model"))).assert_consumed()
    images = torch.from_numpy(np.random.default_rng(depth).standard_normal((1, 3) + IMAGE_SIZES[1], dtype=np.float32))
    with torch.no_grad():
        their_features = list(theirs.backbone(images).values())
    our_features = ours.fpn(ours.backbone(to_nhwc(images), training=False), training=False)
    for level, feature in zip(range(2, 7), their_features):
        assert_close(our_features[level], to_nhwc(feature), f"P{level}")


def test_a_resnet_of_no_known_depth_is_refused_naming_its_blocks(tmp_path):
    torch.manual_seed(0)
    resnet = torchvision.models.resnet.ResNet(torchvision.models.resnet.Bottleneck, [2, 2, 2, 2])
    path = tmp_path / "maskrcnn_resnet26.pth"
    torch.save(MaskRCNN(_resnet_fpn_extractor(resnet, 5), num_classes=3).state_dict(), path)
    assert_refused(tmp_path, path, "its ResNet has (2, 2, 2, 2) bottleneck blocks per stage, which is no depth",
                   "ResNet-50 (3, 4, 6, 3)")


@pytest.fixture(scope="module")
def frozen_state_dict(torch_models):
    return torch_models["frozen"].state_dict()


@pytest.mark.parametrize("case", ["missing", "unexpected", "mis-shaped", "all three"])
def test_missing_unexpected_and_mis_shaped_keys_are_all_named(tmp_path, frozen_state_dict, case):
    state_dict = collections.OrderedDict(frozen_state_dict)
    expected = []
    if case in ("missing", "all three"):
        del state_dict["roi_heads.box_head.fc7.bias"], state_dict["backbone.body.layer2.3.bn2.running_var"]
        expected += ["2 missing: backbone.body.layer2.3.bn2.running_var, roi_heads.box_head.fc7.bias"]
    if case in ("unexpected", "all three"):
        state_dict["roi_heads.extra.weight"] = torch.ones(3)
        state_dict["backbone.fpn.inner_blocks.4.weight"] = torch.ones(3)  # an old spelling, named as in the file
        expected += ["2 unexpected: backbone.fpn.inner_blocks.4.weight, roi_heads.extra.weight"]
    if case in ("mis-shaped", "all three"):
        state_dict["rpn.head.cls_logits.weight"] = torch.ones(6, 256, 1, 1)
        expected += ["1 mis-shaped: rpn.head.cls_logits.weight [6, 256, 1, 1], expected [3, 256, 1, 1]"]
    path = tmp_path / "maskrcnn.pth"
    torch.save(state_dict, path)
    assert_refused(tmp_path, path, "does not match torchvision's Mask R-CNN", *expected)


def test_an_output_dir_this_converter_did_not_write_is_not_replaced(tmp_path, state_dict_files):
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    (output_dir / "ckpt-100.index").write_text("a training run")
    code, _, err = run_converter("--input", state_dict_files["frozen"], "--output_dir", output_dir)
    assert code == status.BAD_INPUT and f"--output_dir {output_dir}: not empty" in err
    assert os.listdir(output_dir) == ["ckpt-100.index"]


# -- torchvision's v2 (maskrcnn_resnet50_fpn_v2) ---------------------------------------------------------------


def test_the_converter_says_which_version_it_found(torchvision_v1, torchvision_v2):
    assert "found torchvision's maskrcnn_resnet50_fpn: use --preset torchvision\n" in torchvision_v1["converter_output"]
    assert "found torchvision's maskrcnn_resnet50_fpn_v2: use --preset torchvision_v2\n" in \
        torchvision_v2["converter_output"]
    saved = json.loads((torchvision_v2["model_dir"] / "config.json").read_text())["model"]
    assert (saved["fpn_norm"], saved["rpn_head_num_convs"], saved["fast_rcnn_num_convs"]) == ("batch", 2, 4)


@pytest.mark.parametrize("version, preset", [("v1", "torchvision_v2"), ("v2", "torchvision")])
def test_a_file_of_the_other_version_than_the_preset_is_refused_naming_both(request, tmp_path, version, preset):
    fixture = request.getfixturevalue(f"torchvision_{version}")
    code, out, err = run_converter("--input", fixture["state_dict"], "--output_dir", tmp_path / "model",
                                   "--preset", preset)
    assert code == status.BAD_INPUT, (out, err)
    found, other = ("maskrcnn_resnet50_fpn", "maskrcnn_resnet50_fpn_v2")[::1 if version == "v1" else -1]
    assert f"holds torchvision's {found} (" in err and f"--preset {preset} is {other}" in err, err
    assert not (tmp_path / "model").exists()


def test_a_v2_file_with_missing_unexpected_and_mis_shaped_keys_names_them(tmp_path, torchvision_v2):
    state_dict = torch.load(torchvision_v2["state_dict"], weights_only=True)
    del state_dict["backbone.fpn.layer_blocks.1.1.running_mean"], state_dict["rpn.head.conv.1.0.bias"]
    state_dict["roi_heads.box_head.6.weight"] = torch.ones(3)
    state_dict["roi_heads.box_head.5.weight"] = torch.ones(1024, 256)
    path = tmp_path / "maskrcnn_v2.pth"
    torch.save(state_dict, path)
    assert_refused(tmp_path, path, "2 missing: backbone.fpn.layer_blocks.1.1.running_mean, rpn.head.conv.1.0.bias",
                   "1 unexpected: roi_heads.box_head.6.weight",
                   "1 mis-shaped: roi_heads.box_head.5.weight [1024, 256], expected [1024, 12544]")
