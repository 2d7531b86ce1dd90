"""Instance masks: training targets per RoI (TensorFlow), pasting predictions into images (NumPy) and their
COCO run-length encoding (pycocotools), which evaluation and inference write.

Box format: ``[ymin, xmin, ymax, xmax]`` float32 pixels with continuous coordinates (width = xmax - xmin);
padded boxes are all -1.

Pixel-centre convention, shared by every mask here (and by ``data.pipeline.crop_instance_masks``) except
``paste_masks_torchvision``'s, which reproduces torchvision's pasting (see that function): an
``M x M`` mask attached to a box holds, at cell ``(i, j)``, the value at image point
``(ymin + (i + 0.5) * h / M, xmin + (j + 0.5) * w / M)``. Image pixel ``(py, px)`` has its centre at
``(py + 0.5, px + 0.5)``. Resampling a box's mask is bilinear between cell centres, constant (the edge
cell's value) between the outermost cell centres and the box edges, and 0 outside the box. A point is
inside a box when ``ymin <= y < ymax`` and ``xmin <= x < xmax`` (half-open, so that a box covering
``[0, h] x [0, w]`` covers every pixel exactly once).

Glossary: B batch, F RoI slots, M crop side, R output side, D detections.
"""
import numpy as np
import tensorflow as tf
from pycocotools import mask as mask_utils

from mrcnn_tf2.ops import box_ops

# Floor on box extents when dividing by them, so that empty boxes (which contain no point) stay finite.
_MIN_EXTENT = 1e-6


def _grid_in_crop(roi_start, roi_length, gt_start, gt_length, crop_size, output_size):
    """First and last RoI grid points along one axis, in crop_and_resize's normalised coordinates.

    The crop is edge-padded by one cell on each side, so its index coordinate ``u`` (cell ``k`` of the
    padded crop centred at ``u = k``) relates to an image coordinate ``y`` by
    ``u = (y - gt_start) * M / gt_length + 0.5``. crop_and_resize puts sample ``r`` of ``R`` at
    ``u = y1 * (M + 1) + r * (y2 - y1) * (M + 1) / (R - 1)``, i.e. its box corners are the *first and
    last sample centres*; so y1, y2 are the padded-crop coordinates of the RoI's first and last grid
    points ``roi_start + 0.5 * roi_length / R`` and ``roi_start + roi_length - 0.5 * roi_length / R``,
    divided by M + 1. (For R = 1 crop_and_resize samples the midpoint, which is then the RoI centre.)

    Args:
      roi_start, roi_length, gt_start, gt_length: [N] float32.
      crop_size: int M; output_size: int R.

    Returns:
      (first, last): [N] float32 normalised coordinates.
    """
    half_cell = 0.5 * roi_length / output_size
    cells_per_pixel = crop_size / tf.maximum(gt_length, _MIN_EXTENT)

    def to_crop(y):
        return ((y - gt_start) * cells_per_pixel + 0.5) / (crop_size + 1.0)

    return to_crop(roi_start + half_cell), to_crop(roi_start + roi_length - half_cell)


def _grid_inside(roi_start, roi_length, gt_start, gt_end, output_size):
    """[N, R] bool: whether each RoI grid point along one axis lies in [gt_start, gt_end)."""
    steps = (tf.range(output_size, dtype=tf.float32) + 0.5) / output_size
    points = roi_start[:, None] + steps * roi_length[:, None]
    return tf.logical_and(points >= gt_start[:, None], points < gt_end[:, None])


def check_target_arguments(rois, gt_boxes, gt_mask_crops, output_size):
    """Validate ``mask_targets``' arguments (shared with its fused twin).

    Returns:
      (rois [B, F, 4] float32, gt_boxes [B, F, 4] float32, gt_mask_crops [B, F, M, M] float32) tensors.
    """
    if not isinstance(output_size, int) or output_size < 1:
        raise ValueError(f"output_size must be a positive int, got {output_size!r}.")
    rois = tf.convert_to_tensor(rois, dtype=tf.float32)
    gt_boxes = tf.convert_to_tensor(gt_boxes, dtype=tf.float32)
    gt_mask_crops = tf.cast(tf.convert_to_tensor(gt_mask_crops), tf.float32)
    box_ops.check_last_dim(rois, 4, "rois")
    box_ops.check_last_dim(gt_boxes, 4, "gt_boxes")
    if rois.shape.rank != 3 or gt_boxes.shape.rank != 3:
        raise ValueError(f"rois and gt_boxes must be [B, F, 4], got {rois.shape} and {gt_boxes.shape}.")
    crop_shape = gt_mask_crops.shape
    if crop_shape.rank != 4 or crop_shape[2] is None or crop_shape[2] != crop_shape[3]:
        raise ValueError(f"gt_mask_crops must be [B, F, M, M] with a static M, got shape {crop_shape}.")
    return rois, gt_boxes, gt_mask_crops


def mask_targets(rois, gt_boxes, gt_mask_crops, output_size):
    """Binary mask target of each RoI, resampled from its matched GT instance's box-aligned crop.

    Args:
      rois: [B, F, 4] float32 RoIs [ymin, xmin, ymax, xmax] in pixels; padded rows all -1.
      gt_boxes: [B, F, 4] float32 the GT box matched to each RoI; padded rows all -1.
      gt_mask_crops: [B, F, M, M] float (any float dtype) the matched instance's mask cropped to its GT
        box, pixel-centre convention (module docstring); M >= 1.
      output_size: int R.

    Returns:
      [B, F, R, R] float32 in {0, 1}: 1 where the bilinearly resampled mask at the RoI's grid point
      ``(roi_ymin + (i + 0.5) * roi_h / R, roi_xmin + (j + 0.5) * roi_w / R)`` is >= 0.5 and that point is
      inside the GT box. All zeros (no NaN) for padded RoIs, padded GT boxes and GT boxes with zero
      height or width.
    """
    rois, gt_boxes, gt_mask_crops = check_target_arguments(rois, gt_boxes, gt_mask_crops, output_size)
    crop_size = gt_mask_crops.shape[2]

    batch, num_rois = tf.shape(rois)[0], tf.shape(rois)[1]
    flat_rois = tf.reshape(rois, [-1, 4])
    flat_gt = tf.reshape(gt_boxes, [-1, 4])
    r_ymin, r_xmin, r_ymax, r_xmax = tf.unstack(flat_rois, axis=1)
    g_ymin, g_xmin, g_ymax, g_xmax = tf.unstack(flat_gt, axis=1)
    y1, y2 = _grid_in_crop(r_ymin, r_ymax - r_ymin, g_ymin, g_ymax - g_ymin, crop_size, output_size)
    x1, x2 = _grid_in_crop(r_xmin, r_xmax - r_xmin, g_xmin, g_xmax - g_xmin, crop_size, output_size)

    # Edge padding makes bilinear sampling constant between the outermost cell centres and the box edges.
    crops = tf.reshape(gt_mask_crops, [-1, crop_size, crop_size])
    crops = tf.pad(crops, [[0, 0], [1, 1], [1, 1]], mode="SYMMETRIC")
    sampled = tf.image.crop_and_resize(
        crops[..., None], tf.stack([y1, x1, y2, x2], axis=1), tf.range(tf.shape(crops)[0]),
        [output_size, output_size], method="bilinear", extrapolation_value=0.0)[..., 0]

    inside = tf.logical_and(
        _grid_inside(r_ymin, r_ymax - r_ymin, g_ymin, g_ymax, output_size)[:, :, None],
        _grid_inside(r_xmin, r_xmax - r_xmin, g_xmin, g_xmax, output_size)[:, None, :])
    # Padded and empty GT boxes contain no point of the half-open test; a padded RoI's grid collapses
    # onto (-1, -1), which a GT box may contain, so it is masked explicitly.
    valid = tf.logical_not(box_ops.is_padding(flat_rois))
    keep = tf.logical_and(tf.logical_and(sampled >= 0.5, inside), valid[:, None, None])
    return tf.reshape(tf.cast(keep, tf.float32), [batch, num_rois, output_size, output_size])


def _axis_weights(start, end, mask_size, num_pixels):
    """Pixels of one axis whose centres lie in [start, end), each with its two mask cells and their weights.

    Returns:
      (first, low, high, w_low, w_high): index of the first covered pixel (int); for the n (possibly 0)
      covered pixels first .. first + n - 1, [n] intp lower and upper mask cells (equal at the mask's edges)
      and [n] float32 bilinear weights of each (w_low + w_high = 1).
    """
    # Pixel p is covered when start <= p + 0.5 < end.
    first = min(max(int(np.ceil(start - 0.5)), 0), num_pixels)
    stop = min(max(int(np.ceil(end - 0.5)), first), num_pixels)
    centres = np.arange(first, stop, dtype=np.float32) + 0.5
    coords = (centres - start) * (mask_size / max(end - start, _MIN_EXTENT)) - 0.5
    coords = np.clip(coords, 0.0, mask_size - 1.0)
    low = np.floor(coords)
    frac = coords - low
    low = low.astype(np.intp)
    return first, low, np.minimum(low + 1, mask_size - 1), 1.0 - frac, frac


def check_paste_arguments(masks, boxes, image_hw, threshold):
    """Validate ``paste_masks``' arguments (shared with its fused twin).

    Returns:
      (masks [D, R, R] float32 array, boxes [D, 4] float32 array, height, width).
    """
    masks = np.asarray(masks, dtype=np.float32)
    boxes = np.asarray(boxes, dtype=np.float32)
    if masks.ndim != 3 or masks.shape[1] != masks.shape[2] or masks.shape[1] < 1:
        raise ValueError(f"masks must be [D, R, R] with R >= 1, got shape {masks.shape}.")
    if boxes.shape != (masks.shape[0], 4):
        raise ValueError(f"boxes must be [D, 4] with D = {masks.shape[0]}, got shape {boxes.shape}.")
    if len(image_hw) != 2 or any(int(v) != v or v < 0 for v in image_hw):
        raise ValueError(f"image_hw must be two non-negative ints (h, w), got {image_hw!r}.")
    if threshold is not None and not np.isfinite(threshold):
        raise ValueError(f"threshold must be None or a finite number, got {threshold!r}.")
    return masks, boxes, int(image_hw[0]), int(image_hw[1])


def paste_masks(masks, boxes, image_hw, threshold=None):
    """Paste box-aligned mask predictions into full-image masks (evaluation side, NumPy, one image).

    Only each box's pixel region is resampled (separable bilinear, rows first), so the cost grows with the
    boxes' area, not with D * h * w.

    Args:
      masks: [D, R, R] float32 mask probabilities, pixel-centre convention relative to their box.
      boxes: [D, 4] float32 boxes [ymin, xmin, ymax, xmax] in pixels of the target image; they may
        reach past the image (clipped) or be empty (empty mask).
      image_hw: (h, w) ints, size of the target image.
      threshold: None, or a float: then return ``probability >= threshold`` inside the box.

    Returns:
      [D, h, w] float32 probabilities, or uint8 in {0, 1} when ``threshold`` is given; 0 outside each box.
    """
    masks, boxes, height, width = check_paste_arguments(masks, boxes, image_hw, threshold)
    mask_size = masks.shape[1]
    out = np.zeros((masks.shape[0], height, width), np.float32 if threshold is None else np.uint8)
    for d, (ymin, xmin, ymax, xmax) in enumerate(boxes.tolist()):
        top, y_low, y_high, y_w_low, y_w_high = _axis_weights(ymin, ymax, mask_size, height)
        left, x_low, x_high, x_w_low, x_w_high = _axis_weights(xmin, xmax, mask_size, width)
        if y_low.size == 0 or x_low.size == 0:
            continue
        # Separable bilinear resize of the box region only, rows first, each value from its two neighbouring
        # cells. Elementwise rather than as matrix products, so that the float operations are fixed (a BLAS
        # product's summation order and use of FMA are not): the fused RLE encoder repeats them bit for bit.
        by_rows = masks[d][y_low] * y_w_low[:, None] + masks[d][y_high] * y_w_high[:, None]  # [rows, R]
        region = by_rows[:, x_low] * x_w_low + by_rows[:, x_high] * x_w_high  # [rows, cols]
        if threshold is not None:
            region = region >= threshold
        out[d, top:top + y_low.size, left:left + x_low.size] = region
    return out


def _fma32(a, b, c):
    """float32 ``a * b + c`` rounded once, as the fused multiply-add a compiler makes of it (NumPy has none).

    The float32 product is exact in float64, so only the float64 sum and its rounding to float32 round. That
    double rounding can differ from one rounding only where the float64 sum is exactly halfway between two
    float32 (or is below float32's normal range); there the sum is rounded to odd instead (nudged one
    float64 step toward the exact value if inexact and even), after which rounding to float32 is exact
    (float64 has more than the 24 + 2 bits that round-to-odd needs).

    Args:
      a, b, c: float32 arrays (broadcastable).

    Returns:
      float32 array.
    """
    product = a.astype(np.float64) * b
    total = product + c
    result = total.astype(np.float32)
    bits = total.view(np.int64)
    # Low 29 of the 52 fraction bits 100...0: a float32 tie; biased exponent below 1023 - 126: float32-subnormal.
    suspect = ((bits & 0x1FFFFFFF) == 0x10000000) | ((bits & 0x7FF0000000000000) < (897 << 52))
    suspect = np.flatnonzero(suspect & (total != 0))  # a float64 sum that rounds to 0 is exactly 0
    if suspect.size:
        product, total = product.flat[suspect], total.flat[suspect]
        addend = np.broadcast_to(c, result.shape).flat[suspect].astype(np.float64)
        # Knuth's TwoSum: total + error == product + addend exactly.
        back = total - product
        error = (product - (total - back)) + (addend - back)
        nudge = (error != 0) & ((total.view(np.int64) & 1) == 0)
        total = np.where(nudge, np.nextafter(total, np.copysign(np.inf, error)), total)
        result.flat[suspect] = total.astype(np.float32)
    return result


def _aten_linear_axis(input_size, output_size, start, stop):
    """ATen's bilinear (align_corners=False) taps along one axis for output cells start .. stop - 1.

    Float32 as ATen computes them: scale input / output; source ``scale * (i + 0.5) - 0.5`` rounded once
    (ATen's multiply-add is fused; the float64 product is exact and, where the source is not negative, so
    is the float64 difference) and clamped at 0; lower cell its floor (at most input - 1), upper cell the
    next one (the same at the last cell), weights ``1 - f`` and ``f`` of the fraction f.

    Returns:
      (low, high, w_low, w_high): [stop - start] intp cells and float32 weights.
    """
    scale = np.float32(input_size) / np.float32(output_size)
    centres = np.arange(start, stop, dtype=np.float64) + 0.5
    source = np.maximum(np.float64(scale) * centres - 0.5, 0.0).astype(np.float32)
    low = np.minimum(source.astype(np.intp), input_size - 1)
    frac = np.clip(source - low.astype(np.float32), np.float32(0), np.float32(1))
    return low, low + (low < input_size - 1), np.float32(1) - frac, frac


def _aten_bilinear_window(mask, out_h, out_w, rows, cols):
    """Window ``[rows[0]:rows[1], cols[0]:cols[1]]`` of F.interpolate(mask, (out_h, out_w), "bilinear",
    align_corners=False) on the CPU (AVX2 / AVX-512), bit for bit, for a float32 [S, S] mask (one channel).

    ATen picks one of two kernels by the output size, with different float operations: outputs with
    out_h + out_w <= 128 go to its channels-last kernel (the four products of the corner weights summed in
    one fused chain), larger ones to its generic separable kernel (along x, then along y). Only the window
    is computed, so the cost follows the window's area.

    Returns:
      [rows[1] - rows[0], cols[1] - cols[0]] float32.
    """
    size = mask.shape[0]
    y_low, y_high, y_w_low, y_w_high = _aten_linear_axis(size, out_h, *rows)
    x_low, x_high, x_w_low, x_w_high = _aten_linear_axis(size, out_w, *cols)
    y_w_low, y_w_high = y_w_low[:, None], y_w_high[:, None]
    if out_h + out_w <= 128:
        low_row, high_row = mask[y_low], mask[y_high]
        chain = _fma32(low_row[:, x_low], y_w_low * x_w_low, low_row[:, x_high] * (y_w_low * x_w_high))
        chain = _fma32(high_row[:, x_low], y_w_high * x_w_low, chain)
        return _fma32(high_row[:, x_high], y_w_high * x_w_high, chain)
    along_x = _fma32(mask[:, x_low], x_w_low, mask[:, x_high] * x_w_high)  # [S, cols]
    return _fma32(along_x[y_low], y_w_low, along_x[y_high] * y_w_high)


def _paste_torchvision(masks, boxes, height, width, threshold, transposed):
    """``paste_masks_torchvision`` on arguments ``check_paste_arguments`` has checked; ``transposed`` returns
    [D, w, h] (each pasted mask transposed, the layout ``encode_pasted_masks`` needs) instead of [D, h, w]."""
    if not np.isfinite(boxes).all():
        raise ValueError("boxes must be finite.")
    mask_size = masks.shape[1]
    # torchvision pads each mask with a zero cell per side and widens its box to match, about its centre, by
    # the float32 factor (R + 2) / R, in float32; then truncates the corners toward zero (so -0.7 -> 0, not
    # -1) into integer pixels of an inclusive box, covering x2 - x1 + 1 columns (the "+1" of the legacy
    # integer-box convention, even though the float box is continuous).
    padded = np.pad(masks, ((0, 0), (1, 1), (1, 1)))
    widen = np.float32((mask_size + 2) / mask_size)
    ymin, xmin, ymax, xmax = boxes.T
    half_h = (ymax - ymin) * np.float32(0.5) * widen
    half_w = (xmax - xmin) * np.float32(0.5) * widen
    centre_y = (ymax + ymin) * np.float32(0.5)
    centre_x = (xmax + xmin) * np.float32(0.5)
    corners = np.stack([centre_y - half_h, centre_x - half_w, centre_y + half_h, centre_x + half_w], axis=1)
    corners = corners.astype(np.int64).tolist()

    shape = (masks.shape[0], width, height) if transposed else (masks.shape[0], height, width)
    out = np.zeros(shape, np.float32 if threshold is None else np.uint8)
    for d, (y1, x1, y2, x2) in enumerate(corners):
        # The pasted window, clipped to the image. torchvision sizes the resized mask max(y2 - y1 + 1, 1):
        # the floor of 1 only matters for an inverted box (y2 < y1), whose window is empty anyway; boxes
        # without a pixel in the image (where torchvision's slicing raises or pastes nothing) paste nothing.
        top, bottom = max(y1, 0), min(y2 + 1, height)
        left, right = max(x1, 0), min(x2 + 1, width)
        if bottom <= top or right <= left:
            continue
        region = _aten_bilinear_window(padded[d], y2 - y1 + 1, x2 - x1 + 1,
                                       (top - y1, bottom - y1), (left - x1, right - x1))
        if threshold is not None:
            region = region > threshold
        if transposed:
            out[d, left:right, top:bottom] = region.T
        else:
            out[d, top:bottom, left:right] = region
    return out


def paste_masks_torchvision(masks, boxes, image_hw, threshold=None):
    """Paste box-aligned mask predictions into full-image masks as torchvision's Mask R-CNN does
    (``roi_heads.paste_masks_in_image``); NumPy, one image. Bit for bit against PyTorch's AVX2 and AVX-512
    CPU kernels; its baseline kernels (no fused multiply-add) differ in the last bit; CUDA's kernel is not
    reproduced.

    Each [R, R] mask is padded with a zero cell per side to [R + 2, R + 2] and its box widened by
    (R + 2) / R about its centre; the widened box's corners are truncated toward zero to integer pixels
    (x1, y1, x2, y2) of an inclusive box; the padded mask is resized bilinearly (align_corners=False, no
    antialiasing) to (y2 - y1 + 1) x (x2 - x1 + 1) pixels and pasted at (y1, x1), clipped to the image.
    Unlike ``paste_masks`` (pixel-centre convention) this shifts a mask by up to a pixel and fades its
    edges into the zero padding. Only each box's window in the image is resampled, so the cost grows
    with the boxes' area, not with D * h * w.

    Args:
      masks: [D, R, R] float32 mask probabilities relative to their box.
      boxes: [D, 4] float32 finite boxes [ymin, xmin, ymax, xmax] in pixels of the target image (torchvision
        pastes with the boxes mapped to the original image, in [x1, y1, x2, y2] order); they may reach past
        the image (clipped) or miss it (empty mask).
      image_hw: (h, w) ints, size of the target image.
      threshold: None, or a float: then return ``probability > threshold`` (torchvision's users threshold
        its float masks with ``> 0.5``).

    Returns:
      [D, h, w] float32 probabilities, or uint8 in {0, 1} when ``threshold`` is given; 0 outside each
      widened box.
    """
    masks, boxes, height, width = check_paste_arguments(masks, boxes, image_hw, threshold)
    return _paste_torchvision(masks, boxes, height, width, threshold, transposed=False)


def check_encode_arguments(masks, boxes, image_hw, threshold):
    """Validate ``encode_pasted_masks``' arguments (shared with its fused twin): ``paste_masks``' checks, and
    a threshold is required.

    Returns:
      (masks [D, R, R] float32 array, boxes [D, 4] float32 array, height, width).
    """
    if threshold is None:
        raise ValueError("threshold must be a finite number, got None.")
    return check_paste_arguments(masks, boxes, image_hw, threshold)


# How ``encode_pasted_masks`` pastes: "exact" as ``paste_masks``, "torchvision" as ``paste_masks_torchvision``.
PASTE_METHODS = ("exact", "torchvision")


def encode_pasted_masks(masks, boxes, image_hw, threshold, paste="exact"):
    """COCO RLE of each mask pasted into the image and thresholded (NumPy and pycocotools).

    Both pastes write [D, w, h] in C order, which is the [h, w, D] Fortran layout pycocotools encodes: no
    transposing copy of the D full-image masks ("exact" pastes the transposed problem, x for y; "torchvision"
    transposes each box's window, since its float operations are not symmetric in x and y). The fused twin,
    ``ops.fused.encode_pasted_masks``, gives the "exact" RLE without the full-image masks.

    Args:
      masks: [D, R, R] float32 probabilities relative to their box (``paste_masks``).
      boxes: [D, 4] float32 [ymin, xmin, ymax, xmax] pixels, unclipped (the frames the masks were
        predicted in); pasting clips them to the image.
      image_hw: (h, w) ints; threshold: float.
      paste: one of PASTE_METHODS: "exact", ``paste_masks`` (foreground where probability >= threshold),
        or "torchvision", ``paste_masks_torchvision`` (foreground where probability > threshold).

    Returns:
      list of D dicts {'size': [h, w], 'counts': bytes}, pycocotools' compressed RLE.
    """
    if paste not in PASTE_METHODS:
        raise ValueError(f"paste must be one of {PASTE_METHODS}, got {paste!r}.")
    masks, boxes, height, width = check_encode_arguments(masks, boxes, image_hw, threshold)
    if paste == "torchvision":
        pasted = _paste_torchvision(masks, boxes, height, width, threshold, transposed=True)
    else:
        pasted = paste_masks(masks.transpose(0, 2, 1), boxes[:, [1, 0, 3, 2]], (width, height), threshold)
    return mask_utils.encode(pasted.transpose(2, 1, 0))


def compress_run_lengths(counts, splits, height, width):
    """pycocotools' compressed RLE of D masks given as uncompressed run lengths (the fused encoder's output).

    Args:
      counts: [N] int run lengths of the D masks one after another, each mask's in COCO order (column-major,
        starting with a run of zeros).
      splits: D + 1 ints: mask d's runs are counts[splits[d]:splits[d + 1]].
      height, width: ints, the image size every mask covers.

    Returns:
      list of D dicts {'size': [height, width], 'counts': bytes}, as ``encode_pasted_masks`` returns them.
    """
    return mask_utils.frPyObjects([{"size": [height, width], "counts": counts[start:stop]}
                                   for start, stop in zip(splits[:-1], splits[1:])], height, width)
