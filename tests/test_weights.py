"""Tests of weights/convert_keras_resnet.py (keras.applications ResNet-50 weights -> backbone checkpoint) and of
mrcnn_tf2.model.pretrained, which checks such a checkpoint's metadata before training."""
import json
import os

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

from mrcnn_tf2 import status
from mrcnn_tf2.config import ConfigError, ModelConfig
from mrcnn_tf2.model.backbone import ResNet
from mrcnn_tf2.model.pretrained import IMAGENET_MEAN, IMAGENET_STD, check_backbone_metadata, load_backbone_checkpoint
from weights import convert_keras_resnet as conv

SIDE = 64
CAFFE_MEAN_BGR = np.array([103.939, 116.779, 123.68], np.float32)
FEATURE_LAYERS = {2: "conv2_block3_out", 3: "conv3_block4_out", 4: "conv4_block6_out", 5: "conv5_block3_out"}


def write_keras2_weights_h5(model, path, skip=()):
    """Writes `model`'s weights as Keras 2's save_weights did, the format of keras.applications' downloads.

    Root attribute 'layer_names' lists every layer; a group per layer lists its 'weight_names'
    ('<layer>/<weight>:0', stored as nested groups). Layers in `skip` are left out.
    """
    layers = [layer for layer in model.layers if layer.name not in skip]
    with h5py.File(path, "w") as f:
        f.attrs["layer_names"] = [layer.name.encode() for layer in layers]
        f.attrs["backend"] = b"tensorflow"
        f.attrs["keras_version"] = b"2.2.4"
        for layer in layers:
            group = f.create_group(layer.name)
            names = [f"{layer.name}/{w.name}:0" for w in layer.weights]
            group.attrs["weight_names"] = [n.encode() for n in names]
            for name, weight in zip(names, layer.weights):
                group.create_dataset(name, data=np.asarray(weight))


@pytest.fixture(scope="module")
def keras_resnet(tmp_path_factory):
    """(keras.applications ResNet50 64x64 with random conv biases and BN statistics, path of its Keras 2 .h5)."""
    # Module scope (built once for the file) cannot take the function-scoped `rng` fixture: same seed here.
    rng = np.random.default_rng(0)
    model = keras.applications.ResNet50(weights=None, include_top=False, input_shape=(SIDE, SIDE, 3))
    for layer in model.layers:
        if isinstance(layer, keras.layers.Conv2D):
            layer.bias.assign(rng.normal(0.0, 0.5, layer.bias.shape))
        elif isinstance(layer, keras.layers.BatchNormalization):
            channels = layer.gamma.shape
            layer.gamma.assign(rng.uniform(0.5, 1.5, channels))
            layer.beta.assign(rng.normal(0.0, 0.5, channels))
            layer.moving_mean.assign(rng.normal(0.0, 0.5, channels))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, channels))
    path = str(tmp_path_factory.mktemp("keras") / "resnet50_weights_tf_dim_ordering_tf_kernels_notop.h5")
    write_keras2_weights_h5(model, path)
    return model, path


def keras_outputs(model, caffe_images, names):
    """Outputs of the named layers of the keras model, inference mode, as NumPy arrays."""
    probe = keras.Model(model.input, {name: model.get_layer(name).output for name in names})
    outputs = probe(caffe_images, training=False)
    return [np.asarray(outputs[name]) for name in names]


def restore_like_trainer(prefix, depth=50):
    """A fresh backbone (the trainer's freeze settings) loaded by the trainer's loader of --backbone_checkpoint."""
    backbone = ResNet(depth, stride_in_1x1=True, freeze_bn=True, freeze_blocks=(0, 1))
    backbone(tf.zeros([1, SIDE, SIDE, 3]), training=False)
    load_backbone_checkpoint(backbone, prefix, f"resnet{depth}")
    return backbone


def assert_close(actual, expected, tol=1e-4):
    scale = np.abs(expected).max()
    assert scale > 0
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale)


def test_converted_backbone_matches_keras_features(keras_resnet, tmp_path, rng):
    model, path = keras_resnet
    depth = 50
    loaded = conv.load_keras_resnet(path, depth, conv.expected_layer_names(ResNet(depth, stride_in_1x1=True)))
    # Input normalised with the caffe mean (and the pipeline's std): zero padding then means the same pixel
    # to both models, and the features must agree everywhere.
    resnet = conv.convert_keras_resnet(loaded, depth, path, input_mean=CAFFE_MEAN_BGR[::-1], input_std=IMAGENET_STD)
    prefix = conv.write_checkpoint(resnet, str(tmp_path / "ckpt" / "resnet50"), {"backbone": "resnet50"})
    backbone = restore_like_trainer(prefix)

    pixels = rng.uniform(0.0, 255.0, (2, SIDE, SIDE, 3)).astype(np.float32)
    ours = backbone((pixels - CAFFE_MEAN_BGR[::-1]) / np.float32(IMAGENET_STD), training=False)
    expected = keras_outputs(model, pixels[..., ::-1] - CAFFE_MEAN_BGR, list(FEATURE_LAYERS.values()))
    for level, reference in zip(FEATURE_LAYERS, expected):
        assert ours[level].shape == reference.shape
        assert_close(np.asarray(ours[level]), reference)


def test_cli_writes_complete_checkpoint_for_pipeline_input(keras_resnet, tmp_path, rng):
    model, path = keras_resnet
    prefix = str(tmp_path / "out" / "resnet50")
    assert conv.main(["--h5", path, "--output", prefix]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == [
        "resnet50.data-00000-of-00001", "resnet50.index", "resnet50.json"]
    with open(f"{prefix}.json") as f:
        metadata = json.load(f)
    assert metadata == {"backbone": "resnet50", "stride_in_1x1": True, "source": os.path.basename(path),
                        "input_mean_rgb": list(IMAGENET_MEAN), "input_std_rgb": list(IMAGENET_STD)}
    assert check_backbone_metadata(prefix, ModelConfig(stride_in_1x1=True)) == metadata

    # The pipeline's normalisation differs from keras' caffe input: the stem must give keras' conv1 output
    # wherever its 7x7 window (3 pixels each side at stride 2) stays inside the image.
    backbone = restore_like_trainer(prefix)
    pixels = rng.uniform(0.0, 255.0, (1, SIDE, SIDE, 3)).astype(np.float32)
    ours = np.asarray(backbone.stem((pixels - np.float32(IMAGENET_MEAN)) / np.float32(IMAGENET_STD), training=False))
    (expected,) = keras_outputs(model, pixels[..., ::-1] - CAFFE_MEAN_BGR, ["conv1_relu"])
    inner = slice(2, SIDE // 2 - 1)
    assert_close(ours[:, inner, inner], expected[:, inner, inner])


def test_fold_input_normalization_matches_numpy_oracle(rng):
    kernel = rng.normal(size=(3, 3, 3, 4))
    bias = rng.normal(size=4)
    mean, std = (120.0, 110.0, 100.0), (50.0, 60.0, 70.0)
    patch = rng.uniform(0.0, 255.0, (3, 3, 3))  # RGB pixels under one 3x3 window
    new_kernel, new_bias = conv.fold_input_normalization(kernel, bias, mean, std)
    assert new_kernel.dtype == np.float32 and new_kernel.shape == kernel.shape and new_bias.shape == (4,)
    for d in range(4):
        caffe = bias[d]
        ours = new_bias[d]
        for h in range(3):
            for w in range(3):
                for j in range(3):  # keras' input channel j is BGR: pixel channel 2 - j
                    caffe += kernel[h, w, j, d] * (patch[h, w, 2 - j] - CAFFE_MEAN_BGR[j])
                for c in range(3):
                    ours += new_kernel[h, w, c, d] * (patch[h, w, c] - mean[c]) / std[c]
        assert ours == pytest.approx(caffe, rel=1e-5, abs=1e-3)
    with pytest.raises(ValueError, match="kernel"):
        conv.fold_input_normalization(np.zeros((3, 3, 4, 4)), np.zeros(4))


def test_full_models_with_top_are_accepted(tmp_path, rng):
    model = keras.applications.ResNet50(weights=None, include_top=True, input_shape=(SIDE, SIDE, 3), classes=7)
    conv_layer, bn = model.get_layer("conv4_block2_3_conv"), model.get_layer("conv4_block2_3_bn")
    conv_layer.bias.assign(rng.normal(size=conv_layer.bias.shape))
    bn.moving_mean.assign(rng.normal(size=bn.moving_mean.shape))
    for name in ("model.keras", "model.h5"):  # Keras 3's format and the legacy full-model HDF5
        path = str(tmp_path / name)
        model.save(path)
        prefix = str(tmp_path / name.replace(".", "_"))
        assert conv.main(["--h5", path, "--output", prefix]) == 0
        restored = restore_like_trainer(prefix).groups[2][1].convs[2]
        assert restored.name == "conv4_block2_3"
        np.testing.assert_array_equal(np.asarray(restored.conv.kernel), np.asarray(conv_layer.kernel))
        np.testing.assert_allclose(np.asarray(restored.bn.moving_mean),
                                   np.asarray(bn.moving_mean) - np.asarray(conv_layer.bias), atol=1e-6)


def test_bad_input_files_fail_naming_the_file(keras_resnet, tmp_path, capsys):
    _, path = keras_resnet
    prefix = str(tmp_path / "out" / "resnet")
    missing = str(tmp_path / "missing.h5")
    assert conv.main(["--h5", missing, "--output", prefix]) == status.BAD_INPUT
    assert f"--h5 {missing}: no such file" in capsys.readouterr().err

    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"not an hdf5 file")
    assert conv.main(["--h5", str(junk), "--output", prefix]) == status.BAD_INPUT
    assert f"{junk}: cannot read it as a Keras HDF5 weights file" in capsys.readouterr().err

    # ResNet-50's file lacks conv4_block7..23 of ResNet-101.
    assert conv.main(["--h5", path, "--output", prefix, "--depth", "101"]) == status.BAD_INPUT
    err = capsys.readouterr().err
    assert f"{path}: its layers do not match keras.applications ResNet101" in err and "conv4_block10_1_bn" in err

    incomplete = str(tmp_path / "incomplete.h5")
    write_keras2_weights_h5(keras_resnet[0], incomplete, skip={"conv3_block2_2_bn"})
    assert conv.main(["--h5", incomplete, "--output", prefix]) == status.BAD_INPUT
    err = capsys.readouterr().err
    assert "1 missing" in err and "conv3_block2_2_bn" in err and "0 unexpected" in err
    assert not (tmp_path / "out").exists()


def test_check_backbone_metadata_names_the_mismatched_setting(tmp_path):
    prefix = str(tmp_path / "resnet50")
    assert check_backbone_metadata(prefix, ModelConfig()) is None  # no PREFIX.json: nothing to check
    metadata = {"backbone": "resnet50", "stride_in_1x1": True, "source": "x.h5",
                "input_mean_rgb": list(IMAGENET_MEAN), "input_std_rgb": list(IMAGENET_STD)}

    def check(config, **changes):
        with open(f"{prefix}.json", "w") as f:
            json.dump({**metadata, **changes}, f)
        return check_backbone_metadata(prefix, config)

    assert check(ModelConfig(backbone="resnet50", stride_in_1x1=True))["source"] == "x.h5"
    with pytest.raises(ConfigError) as err:
        check(ModelConfig(backbone="resnet101", stride_in_1x1=True))
    assert err.value.key == "--backbone" and "holds resnet50" in str(err.value)
    with pytest.raises(ConfigError) as err:
        check(ModelConfig(backbone="resnet50", stride_in_1x1=False))
    assert err.value.key == "model.stride_in_1x1"
    assert "--config_override model.stride_in_1x1=true" in str(err.value)
    with pytest.raises(ValueError, match="input_std_rgb"):
        check(ModelConfig(stride_in_1x1=True), input_std_rgb=[1.0, 1.0, 1.0])
    with open(f"{prefix}.json", "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="resnet50.json: unreadable"):
        check_backbone_metadata(prefix, ModelConfig())


def test_a_backbone_checkpoint_that_is_no_prefix_or_holds_another_model_is_named(tmp_path):
    """A model directory or a missing prefix is refused before anything starts (`check_inputs`); a checkpoint
    without this backbone's weights (another model's, here a lone variable's) when it is read."""
    from mrcnn_tf2.arguments import check_inputs, parse

    for path in (str(tmp_path), str(tmp_path / "none")):
        config = parse(["train", "--data_dir", str(tmp_path), "--backbone_checkpoint", path])[1]
        with pytest.raises(ConfigError, match=f"^--backbone_checkpoint: {path} is not a checkpoint prefix "
                                              f"\\(no {path}.index\\)"):
            check_inputs("train", config)
    prefix = tf.train.Checkpoint(other=tf.Variable(1.0)).write(str(tmp_path / "other"))
    backbone = ResNet(18)
    backbone(tf.zeros([1, SIDE, SIDE, 3]), training=False)
    with pytest.raises(ConfigError, match=f"^--backbone_checkpoint: {prefix} holds no weights of this model's "
                                          "resnet18 \\(a Mask R-CNN checkpoint goes to --init_checkpoint\\)$"):
        load_backbone_checkpoint(backbone, prefix, "resnet18")
