"""Mask targets and mask pasting against NumPy point-by-point resampling with the pixel-centre convention; the
fused ops (mrcnn_tf2.ops.fused) of mask targets and of pasting with RLE encoding against their pure-TF twins
and that resampling.
"""

import numpy as np
import pytest
import tensorflow as tf
from pycocotools import mask as mask_utils

from mrcnn_tf2.evaluation import coco_metrics
from mrcnn_tf2.ops import fused, masks


def np_sample_box_mask(mask, box, y, x):
    """Value at image point (y, x) of an [M, M] mask attached to box; 0 outside the half-open box."""
    ymin, xmin, ymax, xmax = box
    if not (ymin <= y < ymax and xmin <= x < xmax):
        return 0.0
    size = mask.shape[0]
    u = min(max((y - ymin) * size / (ymax - ymin) - 0.5, 0.0), size - 1.0)
    v = min(max((x - xmin) * size / (xmax - xmin) - 0.5, 0.0), size - 1.0)
    u0, v0 = int(np.floor(u)), int(np.floor(v))
    u1, v1 = min(u0 + 1, size - 1), min(v0 + 1, size - 1)
    fu, fv = u - u0, v - v0
    return ((1 - fu) * (1 - fv) * mask[u0, v0] + (1 - fu) * fv * mask[u0, v1]
            + fu * (1 - fv) * mask[u1, v0] + fu * fv * mask[u1, v1])


def np_crop(image_mask, box, size):
    """Crop an [h, w] image mask to box at size x size: bilinear at the cells' image points (clamped)."""
    h, w = image_mask.shape
    ymin, xmin, ymax, xmax = box
    crop = np.zeros((size, size))
    for i in range(size):
        for j in range(size):
            # Image pixel p has its centre at p + 0.5.
            y = min(max(ymin + (i + 0.5) * (ymax - ymin) / size - 0.5, 0.0), h - 1.0)
            x = min(max(xmin + (j + 0.5) * (xmax - xmin) / size - 0.5, 0.0), w - 1.0)
            y0, x0 = int(y), int(x)
            y1, x1 = min(y0 + 1, h - 1), min(x0 + 1, w - 1)
            fy, fx = y - y0, x - x0
            crop[i, j] = ((1 - fy) * (1 - fx) * image_mask[y0, x0] + (1 - fy) * fx * image_mask[y0, x1]
                          + fy * (1 - fx) * image_mask[y1, x0] + fy * fx * image_mask[y1, x1])
    return crop.astype(np.float32)


def np_mask_target(roi, gt_box, crop, size):
    """[size, size] resampled (unthresholded) values at the RoI's grid points."""
    ymin, xmin, ymax, xmax = roi
    out = np.zeros((size, size))
    for i in range(size):
        for j in range(size):
            y = ymin + (i + 0.5) * (ymax - ymin) / size
            x = xmin + (j + 0.5) * (xmax - xmin) / size
            out[i, j] = np_sample_box_mask(crop, gt_box, y, x)
    return out


def rectangle_mask(hw, top, left, bottom, right):
    image_mask = np.zeros(hw, np.float32)
    image_mask[top:bottom, left:right] = 1.0
    return image_mask


def targets(rois, gt_boxes, crops, size):
    return masks.mask_targets(np.asarray(rois, np.float32)[None], np.asarray(gt_boxes, np.float32)[None],
                              np.asarray(crops, np.float32)[None], size).numpy()[0]


# ---------------------------------------------------------------------------------------------- mask_targets

def test_roi_equal_to_gt_box_reproduces_the_crop():
    gt_box = [10.0, 20.0, 42.0, 60.0]
    crop = np_crop(rectangle_mask((64, 80), 15, 25, 35, 50), gt_box, 16)
    got = targets([gt_box], [gt_box], [crop], 16)[0]
    np.testing.assert_array_equal(got, crop >= 0.5)
    assert 0 < got.sum() < got.size


def test_roi_shifted_by_half_its_width_gives_half_zeros():
    gt_box = [8.0, 8.0, 40.0, 40.0]
    crop = np_crop(rectangle_mask((48, 48), 12, 10, 30, 38), gt_box, 16)
    roi = [8.0, 24.0, 40.0, 56.0]
    got = targets([roi], [gt_box], [crop], 16)[0]
    np.testing.assert_array_equal(got[:, 8:], 0.0)
    np.testing.assert_array_equal(got[:, :8], crop[:, 8:] >= 0.5)
    assert got[:, :8].sum() > 0


def test_nested_roi_matches_oracle_and_the_image_rectangle():
    image_mask = rectangle_mask((64, 64), 20, 16, 44, 40)
    gt_box = [18.0, 14.0, 46.0, 42.0]
    crop = np_crop(image_mask, gt_box, 28)
    roi = [22.0, 12.0, 38.0, 28.0]  # inside vertically, sticks out on the left
    got = targets([roi], [gt_box], [crop], 8)[0]
    want = np_mask_target(roi, gt_box, crop, 8)
    np.testing.assert_array_equal(got, want >= 0.5)
    # Grid points (y, x) = (23 + 2i, 13 + 2j): inside the rectangle from column j = 2 (x = 17) on; the
    # column x = 13 is left of the GT box.
    np.testing.assert_array_equal(got[:, 2:], 1.0)
    np.testing.assert_array_equal(got[:, :2], 0.0)


def test_random_rois_match_oracle(rng):
    num, size, out_size = 10, 12, 7
    gt = np.sort(rng.uniform(0, 60, size=(num, 2, 2)), axis=1)
    gt_boxes = np.stack([gt[:, 0, 0], gt[:, 0, 1], gt[:, 1, 0] + 2, gt[:, 1, 1] + 2], axis=-1).astype(np.float32)
    jitter = rng.uniform(-6, 6, size=(num, 4)).astype(np.float32)
    rois = gt_boxes + jitter
    crops = rng.uniform(0, 1, size=(2, num, size, size)).astype(np.float32)
    got = masks.mask_targets(np.stack([rois, rois[::-1]]), np.stack([gt_boxes, gt_boxes[::-1]]), crops,
                             out_size).numpy()
    for b, (r, g) in enumerate([(rois, gt_boxes), (rois[::-1], gt_boxes[::-1])]):
        for n in range(num):
            values = np_mask_target(r[n], g[n], crops[b, n], out_size)
            undecided = np.abs(values - 0.5) < 1e-4  # float rounding may fall either side of 0.5
            np.testing.assert_array_equal(got[b, n][~undecided], (values >= 0.5)[~undecided])


def test_grid_points_on_the_gt_box_edges():
    """Half-open box: a grid point on ymin/xmin is inside, one on ymax/xmax is outside."""
    got = targets([[-1.0, -1.0, 15.0, 15.0]], [[0.0, 0.0, 8.0, 8.0]], [np.ones((4, 4))], 8)[0]
    # Grid points at 0, 2, 4, ..., 14 on both axes; 0..6 are inside [0, 8).
    want = np.zeros((8, 8))
    want[:4, :4] = 1.0
    np.testing.assert_array_equal(got, want)


def test_padding_and_degenerate_boxes_give_zeros_inside_tf_function():
    box = [4.0, 4.0, 20.0, 20.0]
    pad = [-1.0] * 4
    rois = np.array([[box, pad, box, pad, box, pad]], np.float32)
    # The last GT box reaches past the image corner, so it contains the padded RoI's point (-1, -1).
    gt_boxes = np.array([[box, box, pad, pad, [8.0, 8.0, 8.0, 20.0], [-4.0, -4.0, 20.0, 20.0]]], np.float32)
    crops = np.ones((1, 6, 6, 6), np.float32)
    crops[0, 2:4] = -1.0  # padded GT slots hold -1 masks
    fn = tf.function(masks.mask_targets, reduce_retracing=True)
    got = fn(rois, gt_boxes, tf.constant(crops, tf.bfloat16), 4).numpy()
    assert got.dtype == np.float32 and got.shape == (1, 6, 4, 4)
    np.testing.assert_array_equal(got[0, 0], 1.0)
    np.testing.assert_array_equal(got[0, 1:], 0.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(output_size=0), "output_size"),
    (dict(rois=np.zeros((1, 2, 3), np.float32)), "rois"),
    (dict(gt_mask_crops=np.zeros((1, 2, 4, 5), np.float32)), "gt_mask_crops"),
])
def test_mask_targets_bad_arguments(kwargs, match):
    args = dict(rois=np.zeros((1, 2, 4), np.float32), gt_boxes=np.zeros((1, 2, 4), np.float32),
                gt_mask_crops=np.zeros((1, 2, 4, 4), np.float32), output_size=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        masks.mask_targets(**args)


# ---------------------------------------------------------------------------------------- fused mask_targets

def random_mask_target_inputs(rng, batch, num, crop_size):
    """Matched RoIs and GT boxes with crops, including padding, empty, inverted and outside boxes."""
    gt = np.sort(rng.uniform(-10, 90, size=(batch, num, 2, 2)), axis=2)
    gt_boxes = np.stack([gt[..., 0, 0], gt[..., 0, 1], gt[..., 1, 0] + 1, gt[..., 1, 1] + 1], -1).astype(np.float32)
    rois = gt_boxes + rng.uniform(-8, 8, size=gt_boxes.shape).astype(np.float32)
    crops = rng.uniform(0, 1, size=(batch, num, crop_size, crop_size)).astype(np.float32)
    rois[0, 0] = -1.0  # padded RoI
    gt_boxes[0, 1] = -1.0  # padded GT
    crops[0, 1] = -1.0
    gt_boxes[0, 2] = [20.0, 20.0, 20.0, 40.0]  # empty GT box
    rois[0, 3] = [30.0, 30.0, 10.0, 10.0]  # inverted RoI
    rois[0, 4] = [-40.0, -40.0, -20.0, -20.0]  # RoI outside the image
    gt_boxes[0, 5] = rois[0, 5] = [-4.0, -4.0, 30.0, 30.0]  # past the corner, GT and RoI alike
    return rois, gt_boxes, crops


@pytest.mark.parametrize("output_size, crop_size", [(28, 14), (7, 12), (1, 5), (4, 1)])
def test_mask_targets_bit_equal_to_twin_and_oracle(rng, output_size, crop_size):
    rois, gt_boxes, crops = random_mask_target_inputs(rng, 2, 12, crop_size)
    got = fused.mask_targets(rois, gt_boxes, crops, output_size).numpy()
    want = masks.mask_targets(rois, gt_boxes, crops, output_size).numpy()
    assert got.shape == (2, 12, output_size, output_size) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    assert 0 < got.sum() < got.size
    for b in range(2):
        for n in range(12):
            if rois[b, n].max() < 0:
                continue  # padding: all zeros, checked above through the twin
            values = np_mask_target(rois[b, n], gt_boxes[b, n], crops[b, n], output_size)
            decided = np.abs(values - 0.5) >= 1e-4
            np.testing.assert_array_equal(got[b, n][decided], (values >= 0.5)[decided])


def test_mask_targets_no_rois_bfloat16_crops_and_tf_function(rng):
    empty = np.zeros((2, 0, 4), np.float32)
    assert fused.mask_targets(empty, empty, np.zeros((2, 0, 6, 6), np.float32), 8).shape == (2, 0, 8, 8)
    rois, gt_boxes, crops = random_mask_target_inputs(rng, 2, 8, 6)
    fn = tf.function(fused.mask_targets, reduce_retracing=True)
    got = fn(rois, gt_boxes, tf.constant(crops, tf.bfloat16), 14).numpy()
    want = masks.mask_targets(rois, gt_boxes, tf.constant(crops, tf.bfloat16), 14).numpy()
    np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------------------------- paste_masks

def np_paste(mask, box, hw):
    out = np.zeros(hw)
    for py in range(hw[0]):
        for px in range(hw[1]):
            out[py, px] = np_sample_box_mask(mask, box, py + 0.5, px + 0.5)
    return out


def test_pasted_ones_cover_the_pixels_whose_centres_are_in_the_box():
    boxes = np.array([[2.5, 3.2, 7.5, 9.0], [0.0, 0.0, 12.0, 16.0], [5.4, 1.0, 5.6, 2.0]], np.float32)
    got = masks.paste_masks(np.ones((3, 5, 5), np.float32), boxes, (12, 16))
    for d, (ymin, xmin, ymax, xmax) in enumerate(boxes):
        centres_y = np.arange(12) + 0.5
        centres_x = np.arange(16) + 0.5
        cover = ((centres_y >= ymin) & (centres_y < ymax))[:, None] & ((centres_x >= xmin) & (centres_x < xmax))
        np.testing.assert_array_equal(got[d], cover)
    assert got[0].sum() == 5 * 6 and got[1].sum() == 12 * 16 and got[2].sum() == 1


def test_paste_matches_oracle_with_partly_outside_boxes(rng):
    hw = (20, 24)
    boxes = np.array([[3.3, 4.1, 15.7, 11.2], [-6.0, 15.0, 9.0, 40.0], [-3.0, -4.0, 30.0, 30.0]], np.float32)
    probs = rng.uniform(size=(3, 6, 6)).astype(np.float32)
    got = masks.paste_masks(probs, boxes, hw)
    assert got.dtype == np.float32 and got.shape == (3, 20, 24)
    for d in range(3):
        np.testing.assert_allclose(got[d], np_paste(probs[d], boxes[d], hw), atol=1e-5)
    binary = masks.paste_masks(probs, boxes, hw, threshold=0.5)
    assert binary.dtype == np.uint8
    np.testing.assert_array_equal(binary, got >= 0.5)


def test_crop_then_paste_round_trip():
    image_mask = rectangle_mask((48, 64), 11, 7, 37, 52)
    box = np.array([9.6, 5.3, 38.2, 53.9], np.float32)
    crop = np_crop(image_mask, box, 28)
    pasted = masks.paste_masks(crop[None], box[None], (48, 64), threshold=0.5)[0]
    iou = np.logical_and(pasted, image_mask).sum() / np.logical_or(pasted, image_mask).sum()
    assert iou > 0.95


def test_paste_agrees_with_mask_targets_on_pixel_centres(rng):
    """mask_targets with a RoI whose grid points are the pixel centres equals the thresholded paste."""
    hw = 16
    gt_box = np.array([2.7, 3.1, 13.2, 11.6], np.float32)
    crop = rng.uniform(size=(7, 7)).astype(np.float32)
    pasted = masks.paste_masks(crop[None], gt_box[None], (hw, hw), threshold=0.5)[0]
    got = targets([[0.0, 0.0, hw, hw]], [gt_box], [crop], hw)[0]
    np.testing.assert_array_equal(got, pasted)


def test_empty_boxes_and_no_detections():
    boxes = np.array([[5.0, 5.0, 5.0, 9.0], [30.0, 30.0, 40.0, 40.0], [8.0, 2.0, 4.0, 6.0]], np.float32)
    got = masks.paste_masks(np.ones((3, 4, 4), np.float32), boxes, (20, 20))
    assert not got.any()
    assert masks.paste_masks(np.zeros((0, 4, 4), np.float32), np.zeros((0, 4), np.float32), (5, 6)).shape == (0, 5, 6)


@pytest.mark.parametrize("args, match", [
    ((np.zeros((2, 4, 5)), np.zeros((2, 4)), (8, 8)), "masks"),
    ((np.zeros((2, 4, 4)), np.zeros((3, 4)), (8, 8)), "boxes"),
    ((np.zeros((2, 4, 4)), np.zeros((2, 4)), (8,)), "image_hw"),
    ((np.zeros((2, 4, 4)), np.zeros((2, 4)), (8, 8), float("nan")), "threshold"),
])
def test_paste_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        masks.paste_masks(*args)


# --------------------------------------------------------------------------------- fused encode_pasted_masks

def assert_same_rle(masks_in, boxes, hw, threshold):
    """The fused encoder's RLE is the twin's, byte for byte; returns the decoded [h, w, D] uint8 masks."""
    got = fused.encode_pasted_masks(masks_in, boxes, hw, threshold)
    want = coco_metrics.encode_pasted_masks(masks_in, boxes, hw, threshold)
    assert len(got) == len(want) == len(boxes)
    for fused_rle, twin_rle in zip(got, want):
        assert fused_rle["size"] == twin_rle["size"] == list(hw)
        assert isinstance(fused_rle["counts"], bytes) and fused_rle["counts"] == twin_rle["counts"]
    if not got:
        return np.zeros(tuple(hw) + (0,), np.uint8)
    decoded = mask_utils.decode(got)
    np.testing.assert_array_equal(decoded, mask_utils.decode(want))
    return decoded


def test_encoded_masks_equal_twin_and_oracle(rng):
    hw = (20, 24)
    boxes = np.array([[3.3, 4.1, 15.7, 11.2], [-6.0, 15.0, 9.0, 40.0], [-3.0, -4.0, 30.0, 30.0],
                      [0.0, 0.0, 20.0, 24.0],  # the whole image
                      [30.0, 30.0, 40.0, 40.0],  # wholly outside
                      [5.0, 5.0, 5.0, 9.0],  # zero height
                      [2.0, 7.0, 12.0, 7.0],  # zero width
                      [8.0, 2.0, 4.0, 6.0],  # inverted
                      [5.4, 1.0, 5.6, 2.0]], np.float32)  # covers one pixel centre
    probs = rng.uniform(size=(len(boxes), 6, 6)).astype(np.float32)
    for threshold in (0.5, 0.3):
        decoded = assert_same_rle(probs, boxes, hw, threshold)
        for d in range(len(boxes)):
            # The oracle samples in float64: only pixels this close to the threshold may come out otherwise.
            oracle = np_paste(probs[d], boxes[d], hw)
            decided = np.abs(oracle - threshold) > 1e-5
            np.testing.assert_array_equal(decoded[..., d][decided], (oracle >= threshold)[decided])
        assert_same_rle(probs[:, :1, :1], boxes, hw, threshold)  # 1x1 masks


def test_encoded_masks_edge_cases():
    def rle_of(mask):
        return mask_utils.encode(np.asfortranarray(mask[..., None].astype(np.uint8)))[0]["counts"]

    for hw in ((5, 6), (0, 6), (5, 0)):  # no detections
        decoded = assert_same_rle(np.zeros((0, 4, 4), np.float32), np.zeros((0, 4), np.float32), hw, 0.5)
        assert decoded.shape == hw + (0,)
    hw = (5, 6)
    whole = np.array([[0.0, 0.0, 5.0, 6.0], [-2.0, -3.0, 9.0, 8.0]], np.float32)
    # Every pixel 1 (the RLE starts with an empty run of 0s), or 0 (a single run): the mask is constant.
    for value, threshold, want in ((1.0, 0.5, 1), (0.5, 0.5, 1), (0.4999, 0.5, 0), (0.0, 0.3, 0)):
        got = fused.encode_pasted_masks(np.full((2, 3, 3), value, np.float32), whole, hw, threshold)
        assert [rle["counts"] for rle in got] == [rle_of(np.full(hw, want))] * 2
        assert_same_rle(np.full((2, 3, 3), value, np.float32), whole, hw, threshold)
    inside = np.array([[1.2, 2.1, 3.9, 4.4]], np.float32)
    assert fused.encode_pasted_masks(np.zeros((1, 1, 1), np.float32), inside, hw, 0.5)[0]["counts"] == rle_of(
        np.zeros(hw))
    assert_same_rle(np.ones((1, 1, 1), np.float32), inside, hw, 0.5)
    assert_same_rle(np.ones((1, 2, 2), np.float32), inside, (0, 6), 0.5)  # an image of no pixels: one run of 0


def test_encoded_masks_agree_bit_for_bit_at_the_threshold(rng):
    """Thresholds equal to pasted probabilities: a pixel 1 ulp lower flips (as ~10% of thresholds do
    against BLAS matrix products, which round otherwise)."""
    hw = (60, 80)
    centres = rng.uniform(0, 1, size=(20, 2)) * hw
    sides = rng.uniform(2, 50, size=(20, 2))
    boxes = np.concatenate([centres - sides / 2, centres + sides / 2], axis=1).astype(np.float32)
    probs = rng.uniform(size=(20, 28, 28)).astype(np.float32)
    # The twin's probabilities, pasted as it pastes them for encoding (the transposed problem).
    pasted = masks.paste_masks(probs.transpose(0, 2, 1), boxes[:, [1, 0, 3, 2]], hw[::-1])
    for threshold in rng.choice(pasted[pasted > 0], size=32, replace=False).tolist():
        decoded = assert_same_rle(probs, boxes, hw, threshold)
        assert (decoded.transpose(2, 1, 0) == (pasted >= threshold)).all()


def test_encoded_masks_of_many_detections(rng):
    hw = (480, 640)
    centres = rng.uniform(-0.1, 1.1, size=(300, 2)) * hw
    sides = rng.uniform(0, 300, size=(300, 2))
    boxes = np.concatenate([centres - sides / 2, centres + sides / 2], axis=1).astype(np.float32)
    probs = rng.uniform(size=(300, 28, 28)).astype(np.float32)
    for threshold in (0.5, 0.3):
        assert_same_rle(probs, boxes, hw, threshold)


@pytest.mark.parametrize("args, match", [
    ((np.zeros((2, 4, 5)), np.zeros((2, 4)), (8, 8), 0.5), "masks"),
    ((np.zeros((2, 4, 4)), np.zeros((3, 4)), (8, 8), 0.5), "boxes"),
    ((np.zeros((2, 4, 4)), np.zeros((2, 4)), (8,), 0.5), "image_hw"),
    ((np.zeros((2, 4, 4)), np.zeros((2, 4)), (8, -1), 0.5), "image_hw"),
    ((np.zeros((2, 4, 4)), np.zeros((2, 4)), (8, 8), float("nan")), "threshold"),
    ((np.zeros((2, 4, 4)), np.zeros((2, 4)), (8, 8), None), "threshold"),
])
@pytest.mark.parametrize("encode", [fused.encode_pasted_masks, coco_metrics.encode_pasted_masks])
def test_encoded_masks_bad_arguments_are_the_twins(encode, args, match):
    with pytest.raises(ValueError, match=match):
        encode(*args)
