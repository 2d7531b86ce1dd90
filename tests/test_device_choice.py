"""The device-dependent op choice (`factory.choose_ops`): on a GPU no custom CPU op and no CPU conv route in
the model's traced graphs; on a CPU today's routes.

A GPU is faked with MRCNN_TF2_FAKE_GPU=1 (mrcnn_tf2.devices): the choice is the GPU's, the computation still
the CPU's. The graphs are read as GraphDefs, the functions they call (tf.cond branches, the XLA-compiled
layers) included, and each CPU route is recognised by what only it puts there:

- the fused ops: op types 'Mrcnn...' (ops/*.cc);
- conv_ops' custom gradient (the matrix-product kernel gradient): tf.custom_gradient's IdentityN, tagged
  with a '_gradient_op_type' of 'CustomGradient-...'; TensorFlow's own conv gradient instead gives every
  stride-1 Conv2D its stride-1 Conv2DBackpropFilter;
- oneDNN's batch-of-one routes: a forward Conv2DBackpropInput beyond the mask head's transposed conv (the
  transposed route), and convs over a batch of two made of the one image (split_conv2d's halves, a 1x1 conv's
  pixels in two columns).
"""

import collections

import keras
import pytest
import tensorflow as tf

import main
from mrcnn_tf2.arguments import parse
from mrcnn_tf2.config import ConfigError
from mrcnn_tf2.devices import FAKE_GPU_ENV
from mrcnn_tf2.model.factory import OpChoice, build_model, choose_ops
from mrcnn_tf2.ops import anchors as anchor_ops
from mrcnn_tf2.ops import conv as conv_ops
from mrcnn_tf2.ops import fused, masks
from mrcnn_tf2.runtime import train as train_runtime
from mrcnn_tf2.runtime.predictor import load_model, predict_function
from tests.support import SMALL_FLAGS, read_log, small_config, synthetic_batch

PREDICT_KEYS = ("images", "image_info", "source_ids")


@pytest.fixture(params=["CPU", "GPU"])
def device(request, monkeypatch):
    """The device the choice is made for: the real CPU, or a faked GPU."""
    if request.param == "CPU" and tf.config.list_physical_devices("GPU"):
        pytest.skip("a GPU is visible: a run here makes the GPU's choice")
    monkeypatch.setenv(FAKE_GPU_ENV, "1" if request.param == "GPU" else "0")
    return request.param


def config_for(custom_ops="auto", xla=False):
    """The small model (support.small_config) with every conv trainable (so that each gets a kernel gradient), run on
    batches of one image (where oneDNN's batch-of-one routes apply)."""
    config = small_config()
    config.model.freeze_blocks = ()
    config.runtime.custom_ops, config.runtime.xla = custom_ops, xla
    config.eval.eval_batch_size = 1
    return config


# -- the choice ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("custom_ops, xla, export, cpu, gpu", [
    # (fused stages, fused input pipeline and mask encoding, conv route) on the CPU and on the GPU
    ("auto", False, False, (True, True, conv_ops.WINOGRAD), (False, True, conv_ops.PLAIN)),
    ("auto", True, False, (True, True, conv_ops.CPU), (False, True, conv_ops.PLAIN)),
    ("off", False, False, (False, False, conv_ops.CPU), (False, False, conv_ops.PLAIN)),
    ("on", False, True, (False, False, conv_ops.PLAIN), (False, False, conv_ops.PLAIN)),  # export: 'on' ignored
])
def test_choose_ops_on_each_device(device, custom_ops, xla, export, cpu, gpu):
    ops = choose_ops(config_for(custom_ops, xla), export=export)
    stages, host, route = cpu if device == "CPU" else gpu
    assert (ops.device, ops.fused, ops.fused_host, ops.conv_route, ops.jit_dense) == (
        device, stages, host, route, xla and not export)
    # The host-side ops (tf.data, NumPy) follow the library, whatever the device.
    assert ops.rpn_targets is (fused.rpn_targets if host else anchor_ops.rpn_targets)
    assert ops.mask_encoder is (fused.encode_pasted_masks if host else masks.encode_pasted_masks)
    model = build_model(config_for(custom_ops, xla), export=export)
    assert model.proposal_generator.fused == model.mask_target_generator.fused == stages
    layers = (model.backbone, model.backbone.stem, model.fpn.lateral[2], model.rpn_head.score_conv,
              model.mask_head.convs[0])
    assert [layer.conv_route for layer in layers] == [route] * len(layers)


def test_custom_ops_on_is_an_error_on_a_gpu(monkeypatch):
    monkeypatch.setenv(FAKE_GPU_ENV, "1")
    with pytest.raises(ConfigError, match="--custom_ops: 'on' puts the fused ops in the model, and they have CPU "
                                          "kernels only.*use 'auto'"):
        choose_ops(config_for("on"))


def test_main_py_says_custom_ops_on_needs_a_cpu(monkeypatch, capsys, shapes_records, tmp_path):
    monkeypatch.setenv(FAKE_GPU_ENV, "1")
    status = main.main(["train", *SMALL_FLAGS, "--data_dir", shapes_records["data_dir"], "--model_dir",
                        str(tmp_path), "--steps_per_epoch", "1", "--custom_ops", "on"])
    assert status == 2
    assert "main.py: error: --custom_ops: 'on' puts the fused ops in the model" in capsys.readouterr().err


def test_the_choice_in_one_line(monkeypatch):
    monkeypatch.setattr(conv_ops, "ONEDNN", True)
    gpu = dict(device="GPU", fused=False, fused_host=True, conv_route=conv_ops.PLAIN, jit_dense=True)
    assert OpChoice(**gpu).describe() == (
        "ops on the GPU: convs by TensorFlow's convolutions and gradients (cuDNN's on a GPU); proposals, RoIAlign "
        "and mask targets by the pure-TF twins; RPN targets (input pipeline) by the fused op; mask encoding by "
        "the fused op; XLA on")
    cpu = dict(device="CPU", fused=True, fused_host=True, conv_route=conv_ops.WINOGRAD, jit_dense=False,
               mask_paste="torchvision")
    assert OpChoice(**cpu).describe() == (
        "ops on the CPU: convs by Winograd's fused op (float32 3x3) and the CPU routes (kernel gradients as "
        "matrix products, oneDNN's batch-of-one routes); proposals, RoIAlign and mask targets by the fused ops; "
        "RPN targets (input pipeline) by the fused op; mask encoding by NumPy; XLA off")


# -- the traced graphs -----------------------------------------------------------------------------------------

def graph_nodes(concrete):
    """The NodeDefs of a traced function and of every function it calls, with their output shapes."""
    graph = concrete.graph.as_graph_def(add_shapes=True)
    return [*graph.node, *(node for function in graph.library.function for node in function.node_def)]


def routes(nodes):
    """What each route leaves in a graph's nodes (module docstring)."""
    types = collections.Counter(node.op for node in nodes)

    def stride_1(op):
        return sum(node.op == op and list(node.attr["strides"].list.i) == [1, 1, 1, 1] for node in nodes)

    return {
        "custom ops": sorted({op for op in types if op.startswith("Mrcnn")}),
        "custom gradients": sum(node.attr["_gradient_op_type"].s.startswith(b"CustomGradient")
                                for node in nodes if node.op == "IdentityN"),
        "stride-1 convs": stride_1("Conv2D"),
        "stride-1 kernel gradients": stride_1("Conv2DBackpropFilter"),
        "transposed convs": types["Conv2DBackpropInput"],
        "convs over two halves": sum(node.attr["_output_shapes"].list.shape[0].dim[0].size == 2
                                     for node in nodes if node.op == "Conv2D"),
    }


# On the CPU, oneDNN's routes are there with its kernels only (marked onednn: `make test`'s second pass runs
# them with TensorFlow's own); a GPU's routes do not depend on it.
@pytest.mark.parametrize("device", [pytest.param("CPU", marks=pytest.mark.onednn), "GPU"], indirect=True)
@pytest.mark.parametrize("xla", [False, True])
def test_traced_train_and_predict_graphs_hold_the_devices_routes(device, xla):
    config = config_for("on" if device == "CPU" else "auto", xla)  # 'on' is an error on a GPU
    batch = synthetic_batch(config, objects_per_image=(2,))
    keras.utils.set_random_seed(0)
    model = build_model(config)
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    model.build()  # every layer built: the traces take the compiled path under --xla
    train = routes(graph_nodes(tf.function(model.compute_gradients, autograph=False).get_concrete_function(batch)))
    predict = routes(graph_nodes(predict_function(model).get_concrete_function(
        {key: batch[key] for key in PREDICT_KEYS})))
    winograd = device == "CPU" and not xla
    onednn = device == "CPU" and conv_ops.ONEDNN
    for graph in (train, predict):
        if device == "GPU":
            assert graph["custom ops"] == [], graph
        else:
            # The stages' fused ops, and Winograd's where --xla leaves the 3x3 convs to it.
            assert {"MrcnnProposeRois", "MrcnnRoiAlign"} <= set(graph["custom ops"]), graph
            assert ("MrcnnWinogradInput" in graph["custom ops"]) == winograd, graph
        assert (graph["custom gradients"] > 0) == (device == "CPU"), graph
        assert (graph["convs over two halves"] > 0) == onednn, graph
    # The forward's only transposed conv is the mask head's, unless oneDNN's transposed route runs.
    assert (predict["transposed convs"] > 1) == onednn, predict
    if device == "GPU":
        # TensorFlow's own gradient: each stride-1 conv of the model (all trainable) gets its kernel gradient
        # op. Counted in the predict graph: under --xla the train graph holds the compiled layers' forward
        # twice (the function, and its forward half for the gradient).
        assert train["stride-1 kernel gradients"] == predict["stride-1 convs"] > 0, (train, predict)
    else:
        assert train["stride-1 kernel gradients"] == 0, train  # kernel_gradient's matrix products instead


# -- the start-up line -----------------------------------------------------------------------------------------

def test_train_and_predictor_say_the_choice_once_at_start_up(monkeypatch, capsys, shapes_records, tmp_path):
    """A training run (a faked GPU's choice, run on the CPU: the model trains by the GPU's routes) and the
    predictor that eval, infer and export load their model with."""
    monkeypatch.setenv(FAKE_GPU_ENV, "1")
    _, config = parse(["train", *SMALL_FLAGS, "--data_dir", shapes_records["data_dir"], "--model_dir",
                       str(tmp_path), "--train_batch_size", "1", "--benchmark", "--benchmark_steps", "1",
                       "--use_synthetic_data"])
    line = choose_ops(config).describe()
    assert line.startswith("ops on the GPU: convs by TensorFlow's convolutions")
    assert train_runtime.Trainer(config).run() == 0
    out = capsys.readouterr().out.splitlines()
    assert [text for text in out if "ops on the" in text] == [f"[train] {line}"]
    assert [record["ops"] for record in read_log(tmp_path / "log.jsonl") if record["event"] == "start"] == [line]
    config.eval.eval_batch_size = 1
    load_model(config, require_checkpoint=False)
    assert [text for text in capsys.readouterr().out.splitlines() if "ops on the" in text] == [f"[model] {line}"]
