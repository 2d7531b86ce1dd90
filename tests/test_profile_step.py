"""scripts/profile_step.py: op events read back from a real profile, and their grouping by model stage."""

import pytest
import tensorflow as tf

from scripts import profile_step


@pytest.mark.onednn  # the kernels' names in the profile are oneDNN's or TensorFlow's
def test_op_events_are_read_from_a_profile(tmp_path):
    @tf.function
    def step(x):
        return tf.reduce_sum(tf.matmul(x, x, name="product"))

    x = tf.random.normal([64, 64])
    step(x)
    tf.profiler.experimental.start(str(tmp_path))
    for _ in range(3):
        step(x)
    tf.profiler.experimental.stop()
    events = list(profile_step.op_events(str(tmp_path)))
    matmuls = [(name, seconds) for name, kind, seconds in events if kind == "MatMul"]
    assert [name for name, _ in matmuls] == ["product"] * 3
    assert all(seconds > 0 for _, seconds in matmuls)
    assert {kind for _, kind, _ in events} >= {"MatMul", "Sum"}


def test_ops_are_grouped_by_the_layer_scope_else_by_type():
    assert profile_step.stage_of("gradient_tape/mask_head_1/mask_conv2_1/convolution/Conv2DBackpropInput",
                                 "Conv2DBackpropInput") == "mask_head"
    assert profile_step.stage_of("res_net_1/conv2_block1_1/conv2_block1_1_1/Conv2D", "Conv2D") == "backbone"
    assert profile_step.stage_of("box_head/dense/MatMul", "MatMul") == "box_head"
    assert profile_step.stage_of("MrcnnRoiAlignGrad", "MrcnnRoiAlignGrad") == "other: MrcnnRoiAlignGrad"
    # A scope that only starts like a layer's name is not that layer.
    assert profile_step.stage_of("fpn_output/x", "Conv2D") == "other: Conv2D"


def test_onednn_kernels_are_read_as_the_ops_they_replace():
    """The names that TF_ENABLE_ONEDNN_OPTS=1 gives the kernels (those of a train step among them)."""
    for kernel, op in [("_MklMatMul", "MatMul"), ("_MklNativeConv2D", "Conv2D"),
                       ("_MklNativeConv2DBackpropInput", "Conv2DBackpropInput"),
                       ("_MklNativeConv2DBackpropFilterWithBias", "Conv2DBackpropFilter"),
                       ("_MklNativeFusedConv2D", "_FusedConv2D"), ("_MklNativeFusedMatMul", "_FusedMatMul"),
                       ("_MklNativePadWithFusedConv2D", "_FusedConv2D"), ("_MklEinsum", "Einsum"),
                       ("_MklNativeFusedBatchNormV3", "FusedBatchNormV3"), ("_MklLayerNorm", "_MklLayerNorm"),
                       ("Conv2D", "Conv2D"), ("_FusedMatMul", "_FusedMatMul"), ("MrcnnRoiAlign", "MrcnnRoiAlign")]:
        assert profile_step.op_type(kernel) == op, kernel


def test_the_tensors_live_at_the_memory_peak():
    """--memory's reading of the allocator's events: the peak counts what is allocated and not yet freed, in time
    order, and lists those tensors, largest first; a free of memory allocated before the profile is ignored."""
    events = [(40, False, 0xA, 0, "", ""), (10, True, 0xA, 100, "a", "[25]"), (20, True, 0xB, 300, "b", "[75]"),
              (30, False, 0xB, 0, "", ""), (35, True, 0xC, 50, "c", "[2,25]"), (36, False, 0xF, 0, "", ""),
              (50, True, 0xD, 320, "d", "[80]")]
    assert profile_step.live_at_peak(events) == (400, [(300, "b", "[75]"), (100, "a", "[25]")])
    assert profile_step.live_at_peak(events[:2] + events[3:]) == (370, [(320, "d", "[80]"), (50, "c", "[2,25]")])
