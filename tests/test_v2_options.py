"""The model options of torchvision's maskrcnn_resnet50_fpn_v2 (FPN batch norm, two RPN convs, a box head of
convs with batch norm and one FC layer, batch norm in the mask head) against torchvision's own modules on the
same weights; the whole model with them on; the default model unchanged; their config fields."""

import json

import numpy as np
import pytest
import tensorflow as tf
import torch
from torch import nn
from torchvision.models.detection.faster_rcnn import FastRCNNConvFCHead, FastRCNNPredictor
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.models.detection.rpn import RPNHead as TorchRPNHead
from torchvision.ops import FeaturePyramidNetwork
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

from mrcnn_tf2.arguments import parse
from mrcnn_tf2.config import Config, ConfigError
from mrcnn_tf2.model.backbone import ConvBN
from mrcnn_tf2.model.factory import BOX_ROI_SIZE, MASK_ROI_SIZE, build_model, choose_ops
from mrcnn_tf2.model.fpn import FPN
from mrcnn_tf2.model.heads import BoxHead, MaskHead, RPNHead
from tests.support import randomize, small_config, synthetic_batch, trainer_for

BATCH, NUM_ROIS, NUM_CLASSES, NUM_ANCHORS, WIDTH = 2, 3, 5, 3, 16
V2_OPTIONS = {"model.fpn_norm": "batch", "model.rpn_head_num_convs": 2, "model.fast_rcnn_num_convs": 4,
              "model.fast_rcnn_num_fcs": 1, "model.fast_rcnn_norm": "batch", "model.mrcnn_head_norm": "batch"}


# -- copying torchvision's weights into ours -------------------------------------------------------------------

class Copier:
    """Assigns torchvision modules' weights to our layers' variables, each once, checking shapes; `check_all`
    then asserts that every variable of our layer got one (a bias torchvision has no counterpart for fails)."""

    def __init__(self):
        self.assigned = set()

    def assign(self, variable, value):
        value = value.detach().numpy() if isinstance(value, torch.Tensor) else value
        assert tuple(variable.shape) == value.shape, variable.path
        assert id(variable) not in self.assigned, variable.path
        variable.assign(value)
        self.assigned.add(id(variable))

    def conv(self, ours, block):
        """A Conv2d, or a Conv2dNormActivation (Conv2d [+ BatchNorm2d] [+ ReLU]): our Conv2D or ConvBN."""
        modules = list(block) if isinstance(block, nn.Sequential) else [block]
        conv = modules[0]
        norms = [m for m in modules if isinstance(m, nn.BatchNorm2d)]
        kernel = conv.weight.detach().numpy().transpose(2, 3, 1, 0)  # OIHW -> HWIO
        assert isinstance(ours, ConvBN) == bool(norms), f"{ours.name}: batch norm in one model only"
        if norms:
            self.assign(ours.conv.kernel, kernel)
            bn = norms[0]
            for name, value in (("gamma", bn.weight), ("beta", bn.bias), ("moving_mean", bn.running_mean),
                                ("moving_variance", bn.running_var)):
                self.assign(getattr(ours.bn, name), value)
            assert conv.bias is None
        else:
            self.assign(ours.kernel, kernel)
            self.assign(ours.bias, conv.bias)

    def dense(self, ours, linear, chw_input=None):
        """A Linear [O, I] into a Dense [I, O]; chw_input (C, H, W): torchvision flattens [C, H, W] where we
        flatten [H, W, C], so the input rows are reordered as weights/convert_torchvision.py does."""
        weight = linear.weight.detach().numpy()
        if chw_input is not None:
            weight = weight.reshape((-1,) + chw_input).transpose(0, 2, 3, 1).reshape(weight.shape[0], -1)
        self.assign(ours.kernel, weight.T)
        self.assign(ours.bias, linear.bias)

    def check_all(self, layer):
        left = [v.path for v in layer.weights if id(v) not in self.assigned]
        assert not left, f"no torchvision weights for {left}"


def nchw(x):
    return torch.from_numpy(np.ascontiguousarray(np.asarray(x).transpose(0, 3, 1, 2)))


def nhwc(t):
    return t.detach().numpy().transpose(0, 2, 3, 1)


def assert_close(ours, theirs, what):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape, what
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max(), err_msg=what)


def torch_mode(module, training):
    return module.train() if training else module.eval()


# -- each option against torchvision's module ------------------------------------------------------------------

@pytest.mark.parametrize("training", [False, True])
def test_fpn_batch_norm_matches_torchvisions_fpn(rng, training):
    in_channels = [8, 16, 24, 32]
    theirs = randomize(FeaturePyramidNetwork(in_channels, WIDTH, extra_blocks=LastLevelMaxPool(),
                                             norm_layer=nn.BatchNorm2d), 0)
    features = {level: rng.normal(size=(BATCH, 64 >> level, 64 >> level, c)).astype(np.float32)
                for level, c in zip(range(2, 6), in_channels)}
    ours = FPN(min_level=2, max_level=6, num_filters=WIDTH, batch_norm=True)
    ours(features)
    copier = Copier()
    for i, level in enumerate(range(2, 6)):
        copier.conv(ours.lateral[level], theirs.inner_blocks[i])
        copier.conv(ours.output_convs[level], theirs.layer_blocks[i])
    copier.check_all(ours)
    got = ours(features, training=training)
    with torch.no_grad():
        want = torch_mode(theirs, training)({str(i): nchw(features[level]) for i, level in enumerate(range(2, 6))})
    for level, key in zip(range(2, 7), ["0", "1", "2", "3", "pool"]):
        assert_close(got[level].numpy(), nhwc(want[key]), f"P{level}")


def test_rpn_head_of_two_convs_matches_torchvisions(rng):
    theirs = randomize(TorchRPNHead(WIDTH, NUM_ANCHORS, conv_depth=2), 1)
    features = {level: rng.normal(size=(BATCH, 64 >> level, 64 >> level, WIDTH)).astype(np.float32)
                for level in range(2, 7)}
    ours = RPNHead(NUM_ANCHORS, num_filters=WIDTH, num_convs=2)
    ours(features)
    copier = Copier()
    for conv, block in zip(ours.convs, theirs.conv):
        copier.conv(conv, block)
    # Channels compared as they are: torchvision's (dx, dy, dw, dh) order is the weight converter's concern.
    copier.conv(ours.score_conv, theirs.cls_logits)
    copier.conv(ours.box_conv, theirs.bbox_pred)
    copier.check_all(ours)
    got = ours(features)
    with torch.no_grad():
        scores, boxes = theirs([nchw(features[level]) for level in range(2, 7)])
    for i, level in enumerate(range(2, 7)):
        assert_close(got["rpn_scores"][level].numpy(), nhwc(scores[i]), f"scores P{level}")
        assert_close(got["rpn_boxes"][level].numpy(), nhwc(boxes[i]), f"boxes P{level}")


@pytest.mark.parametrize("training", [False, True])
def test_box_head_of_convs_with_batch_norm_and_one_fc_matches_torchvisions(rng, training):
    hidden = 32
    head = FastRCNNConvFCHead((WIDTH, BOX_ROI_SIZE, BOX_ROI_SIZE), [WIDTH] * 4, [hidden], norm_layer=nn.BatchNorm2d)
    theirs = randomize(nn.Sequential(head, FastRCNNPredictor(hidden, NUM_CLASSES)), 2)
    rois = rng.normal(size=(BATCH, NUM_ROIS, BOX_ROI_SIZE, BOX_ROI_SIZE, WIDTH)).astype(np.float32)
    ours = BoxHead(NUM_CLASSES, mlp_head_dim=hidden, num_fcs=1, num_convs=4, conv_dim=WIDTH, batch_norm=True)
    ours(rois)
    assert ours.fc7 is None
    copier = Copier()
    for conv, block in zip(ours.convs, list(head)[:4]):
        copier.conv(conv, block)
    copier.dense(ours.fc6, head[5], chw_input=(WIDTH, BOX_ROI_SIZE, BOX_ROI_SIZE))
    copier.dense(ours.class_dense, theirs[1].cls_score)
    copier.dense(ours.box_dense, theirs[1].bbox_pred)
    copier.check_all(ours)
    got = ours(rois, training=training)
    with torch.no_grad():
        logits, deltas = torch_mode(theirs, training)(nchw(rois.reshape((-1,) + rois.shape[2:])))
    assert_close(got["class_logits"].numpy().reshape(-1, NUM_CLASSES), logits.numpy(), "class logits")
    assert_close(got["box_deltas"].numpy().reshape(-1, 4 * NUM_CLASSES), deltas.numpy(), "box deltas")


@pytest.mark.parametrize("training", [False, True])
def test_mask_head_with_batch_norm_matches_torchvisions(rng, training):
    filters = 8
    head = MaskRCNNHeads(WIDTH, [filters] * 4, 1, norm_layer=nn.BatchNorm2d)
    predictor = MaskRCNNPredictor(filters, filters, NUM_CLASSES)
    theirs = randomize(nn.Sequential(head, predictor), 3)
    rois = rng.normal(size=(BATCH, NUM_ROIS, MASK_ROI_SIZE, MASK_ROI_SIZE, WIDTH)).astype(np.float32)
    classes = rng.integers(0, NUM_CLASSES, size=(BATCH, NUM_ROIS)).astype(np.int32)
    ours = MaskHead(NUM_CLASSES, num_filters=filters, batch_norm=True)
    ours((rois, classes))
    copier = Copier()
    for conv, block in zip(ours.convs, head):
        copier.conv(conv, block)
    # ConvTranspose2d [I, O, KH, KW] -> Keras Conv2DTranspose [KH, KW, O, I].
    copier.assign(ours.deconv.kernel, predictor.conv5_mask.weight.detach().numpy().transpose(2, 3, 1, 0))
    copier.assign(ours.deconv.bias, predictor.conv5_mask.bias)
    copier.conv(ours.logits, predictor.mask_fcn_logits)
    copier.check_all(ours)
    got = ours((rois, classes), training=training).numpy()
    with torch.no_grad():
        every_class = torch_mode(theirs, training)(nchw(rois.reshape((-1,) + rois.shape[2:]))).numpy()
    want = every_class[np.arange(BATCH * NUM_ROIS), classes.reshape(-1)]
    assert_close(got.reshape(want.shape), want, "mask logits")


def test_v2_layers_rebuild_from_their_config(rng):
    features = {level: rng.normal(size=(1, 64 >> level, 64 >> level, 8)).astype(np.float32) for level in range(2, 6)}
    rois = rng.normal(size=(1, NUM_ROIS, BOX_ROI_SIZE, BOX_ROI_SIZE, 8)).astype(np.float32)
    mask_inputs = (rng.normal(size=(1, NUM_ROIS, MASK_ROI_SIZE, MASK_ROI_SIZE, 8)).astype(np.float32),
                   np.zeros((1, NUM_ROIS), np.int32))
    for layer, inputs in [(FPN(num_filters=8, batch_norm=True), features),
                          (RPNHead(NUM_ANCHORS, num_filters=8, num_convs=2), {2: features[2]}),
                          (BoxHead(NUM_CLASSES, 16, num_fcs=1, num_convs=2, conv_dim=8, batch_norm=True), rois),
                          (MaskHead(NUM_CLASSES, num_filters=8, num_convs=2, batch_norm=True), mask_inputs)]:
        want = layer(inputs)
        rebuilt = type(layer).from_config(layer.get_config())
        assert rebuilt.get_config() == layer.get_config()
        rebuilt(inputs)
        rebuilt.set_weights(layer.get_weights())
        for a, b in zip(tf.nest.flatten(want), tf.nest.flatten(rebuilt(inputs))):
            np.testing.assert_array_equal(b.numpy(), a.numpy())


# -- the whole model -------------------------------------------------------------------------------------------

def v2_config(custom_ops="off"):
    """The small test model with every v2 option on, its widths narrowed for speed, run op by op (tracing the
    update step would take four times as long as building and running it)."""
    config = small_config()
    for key, value in V2_OPTIONS.items():
        config.set(key, value)
    config.model.fpn_num_filters, config.model.fast_rcnn_conv_dim, config.model.mrcnn_head_num_filters = 32, 32, 16
    config.runtime.custom_ops = custom_ops
    config.runtime.eagerly = True
    config.train.init_learning_rate = 0.005  # the warm-up starts here: the first update must move the weights
    config.validate()
    return config


@pytest.mark.parametrize("custom_ops", ["on", "off"])
def test_model_with_v2_options_trains_and_predicts(custom_ops):
    config = v2_config(custom_ops)
    batch = synthetic_batch(config)
    trainer = trainer_for(config)
    trainer.build()
    model = trainer.model
    # The new convs take the run's conv route (Winograd's fused op for the 3x3 ones with custom ops on).
    route = choose_ops(config).conv_route
    layers = [model.fpn.lateral[2], model.fpn.output_convs[2], model.rpn_head.convs[1], model.box_head.convs[3],
              model.mask_head.convs[0]]
    assert [layer.conv_route for layer in layers] == [route] * len(layers)
    fpn_bn, backbone_bn = model.fpn.output_convs[2].bn, model.backbone.stem.bn
    before = [v.numpy() for v in (fpn_bn.gamma, fpn_bn.moving_mean, backbone_bn.moving_mean)]
    losses, _ = trainer.update_function()([batch])
    assert all(np.isfinite(value.numpy()) for value in losses.values())
    # The FPN's and heads' batch norm trains (batch statistics, moving averages, affine) although
    # model.freeze_bn freezes the backbone's.
    after = [v.numpy() for v in (fpn_bn.gamma, fpn_bn.moving_mean, backbone_bn.moving_mean)]
    assert not np.array_equal(after[0], before[0]) and not np.array_equal(after[1], before[1])
    np.testing.assert_array_equal(after[2], before[2])
    detections = model.predict_step(batch)
    assert np.isfinite(detections["detection_scores"].numpy()).all()
    assert detections["detection_masks"].shape[-2:] == (config.model.mrcnn_resolution,) * 2


def built_model(config):
    """build_model(config) with every variable created (its learned layers run once on zeros)."""
    model = build_model(config)
    features = model.fpn(model.backbone(tf.zeros([1, 64, 64, 3])))
    model.rpn_head(features)
    width = config.model.fpn_num_filters
    model.box_head(tf.zeros([1, 1, BOX_ROI_SIZE, BOX_ROI_SIZE, width]))
    model.mask_head((tf.zeros([1, 1, MASK_ROI_SIZE, MASK_ROI_SIZE, width]), tf.zeros([1, 1], tf.int32)))
    return model


def test_default_model_keeps_its_variables_and_checkpoint_keys(tmp_path):
    model = built_model(small_config())
    weights = ["kernel", "bias"]
    want = [f"fpn/fpn_{kind}{level}/{w}" for level in range(2, 6) for kind in ("lateral", "output") for w in weights]
    want += [f"rpn_head/{layer}/{w}" for layer in ("rpn_conv", "rpn_scores", "rpn_boxes") for w in weights]
    want += [f"box_head/{layer}/{w}" for layer in ("fc6", "fc7", "class_logits", "box_deltas") for w in weights]
    want += [f"mask_head/{layer}/{w}" for layer in ("mask_conv1", "mask_conv2", "mask_conv3", "mask_conv4",
                                                   "mask_deconv", "mask_logits") for w in weights]
    parts = (model.fpn, model.rpn_head, model.box_head, model.mask_head)
    # Variable paths start with the part's Keras name, which is numbered per process ("fpn_2"): compared without.
    got = [f"{name}/{v.path.split('/', 1)[1]}"
           for part, name in zip(parts, ("fpn", "rpn_head", "box_head", "mask_head")) for v in part.weights]
    assert sorted(got) == sorted(want)
    # Checkpoints written before rpn_head_num_convs existed hold the RPN conv under its attribute `conv`.
    prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    rpn_keys = {name.split("/")[2] for name, _ in tf.train.list_variables(prefix) if name.startswith("model/rpn_head/")}
    assert rpn_keys == {"conv", "score_conv", "box_conv"}


# -- config ----------------------------------------------------------------------------------------------------

def test_saved_config_without_the_v2_keys_loads_with_the_defaults(tmp_path):
    saved = Config().to_dict()
    for key in V2_OPTIONS:
        section, name = key.split(".")
        del saved[section][name]
    del saved["model"]["fast_rcnn_conv_dim"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    _, config = parse(["eval", "--model_dir", str(tmp_path)])
    defaults = Config().model
    for key in [*V2_OPTIONS, "model.fast_rcnn_conv_dim"]:
        assert config.get(key) == getattr(defaults, key.split(".")[1]), key
    assert (config.model.fpn_norm, config.model.rpn_head_num_convs, config.model.fast_rcnn_num_convs,
            config.model.fast_rcnn_num_fcs) == ("none", 1, 0, 2)


def test_v2_keys_define_the_model_of_a_saved_run(tmp_path, capsys):
    config = Config()
    config.set("model.fpn_norm", "batch")
    config.save(str(tmp_path))
    _, loaded = parse(["eval", "--model_dir", str(tmp_path)])
    assert loaded.model.fpn_norm == "batch"
    with pytest.raises(SystemExit):
        parse(["eval", "--model_dir", str(tmp_path), "--config_override", "model.fpn_norm=none"])
    assert "model.fpn_norm = none contradicts batch saved in" in capsys.readouterr().err


@pytest.mark.parametrize("key, value, match", [
    ("model.fpn_norm", "group", "model.fpn_norm: 'group' is not one of"),
    ("model.fast_rcnn_norm", "bn", "model.fast_rcnn_norm: 'bn' is not one of"),
    ("model.mrcnn_head_norm", "", "model.mrcnn_head_norm: '' is not one of"),
    ("model.rpn_head_num_convs", "0", "model.rpn_head_num_convs: 0 must be >= 1"),
    ("model.fast_rcnn_num_fcs", "3", "model.fast_rcnn_num_fcs: 3 must be 1 or 2"),
    ("model.fast_rcnn_num_convs", "-1", "model.fast_rcnn_num_convs: -1 must be >= 0"),
    ("model.fast_rcnn_conv_dim", "0", "model.fast_rcnn_conv_dim: 0 must be >= 1"),
])
def test_bad_v2_values_are_config_errors(key, value, match):
    config = Config()
    config.override(key, value)
    with pytest.raises(ConfigError, match=match):
        config.validate()
