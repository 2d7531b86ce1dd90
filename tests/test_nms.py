"""ops/nms.py: per-image NonMaxSuppressionV5, its IoU convention at the threshold, static and unknown batch sizes."""
import numpy as np
import tensorflow as tf

from mrcnn_tf2.ops import nms

# Image 0: boxes 0 and 1 overlap by IoU 0.5 exactly (1x2 and 1x1 sharing a corner); box 2 is apart, box 3 is
# below the score threshold. Image 1: the same boxes, the scores reversed.
BOXES = np.array([[[0, 0, 1, 2], [0, 0, 1, 1], [5, 5, 6, 6], [8, 8, 9, 9]]] * 2, np.float32)
SCORES = np.array([[0.9, 0.8, 0.7, -1.0], [-1.0, 0.7, 0.8, 0.9]], np.float32)


def kept(indices, counts):
    return [indices[i, :counts[i]].tolist() for i in range(len(counts))]


def test_a_box_at_the_threshold_is_suppressed_only_at_threshold():
    above = nms.non_max_suppression(BOXES, SCORES, 3, 0.5, -0.5)
    at = nms.non_max_suppression(BOXES, SCORES, 3, 0.5, -0.5, at_threshold=True)
    assert kept(*[t.numpy() for t in above]) == [[0, 1, 2], [3, 2, 1]]  # IoU 0.5 is not above 0.5
    assert kept(*[t.numpy() for t in at]) == [[0, 2], [3, 2, 1]]  # ... but at it; image 1 keeps box 1 alone
    assert at[0].shape == (2, 3) and at[0].numpy()[0, 2] == 0  # padded with index 0


def test_an_unknown_batch_size_runs_each_image_in_a_loop_with_the_same_result():
    function = tf.function(lambda boxes, scores: nms.non_max_suppression(boxes, scores, 3, 0.5, -0.5, True),
                           input_signature=[tf.TensorSpec([None, 4, 4]), tf.TensorSpec([None, 4])])
    static = nms.non_max_suppression(BOXES, SCORES, 3, 0.5, -0.5, at_threshold=True)
    dynamic = function(BOXES, SCORES)
    for a, b in zip(static, dynamic):
        np.testing.assert_array_equal(a, b)
    assert any("While" in op.type for op in function.get_concrete_function().graph.get_operations())
