"""scripts/profile_step.py: op events read back from a real profile, and their grouping by model stage."""

import tensorflow as tf

from scripts import profile_step


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
