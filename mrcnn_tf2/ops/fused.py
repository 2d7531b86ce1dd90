"""Fused C++ custom ops (``ops/build/libmrcnn_ops.so``) behind the signatures of their pure-TF twins.

Each public function here takes exactly the arguments of its twin in ``mrcnn_tf2.ops`` (the 3x3 conv's
is ``tf.nn.conv2d`` at stride 1, 'SAME') and returns the same result (to float rounding);
the argument checks are the twin's own. The C++ sources are in ``ops/``, built by ``ops/build.sh`` (which
``scripts/setup.sh`` runs).

``use_fused(mode)`` says whether ``--custom_ops`` ``mode`` can run them: 'off' -> twins; 'auto' -> fused
when the library loads, else one warning and twins; 'on' -> fused, or ``CustomOpsUnavailable`` naming the
library and the reason. The run's choice is made once, from it, by ``mrcnn_tf2.model.factory.choose_ops``.
A custom op cannot be compiled into an XLA cluster: under --xla the model compiles only its dense layers
and these ops run between them (the 3x3 conv's, which would sit inside those layers, is then off). Exported
SavedModels use the twins, so that they load without the library (the factory's ``export`` argument).

This module must not read the config; the factory passes the decision to the stage objects and layers, and to
the runtime for the input pipeline and the mask encoding.
"""
import json
import os
import threading
import warnings

import numpy as np
import tensorflow as tf

from mrcnn_tf2.ops import anchors as anchor_ops
from mrcnn_tf2.ops import fixed
from mrcnn_tf2.ops import masks as mask_ops
from mrcnn_tf2.ops import roi_align, roi_ops

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Where ops/build.sh puts the library, and the JSON it writes next to it ({"tensorflow": version}).
LIBRARY_PATH = os.path.join(_REPO_ROOT, "ops", "build", "libmrcnn_ops.so")
BUILD_INFO_NAME = "BUILD_INFO.json"

MODES = ("auto", "on", "off")


class CustomOpsUnavailable(RuntimeError):
    """The fused-op library cannot be used (missing, built for another TensorFlow, or failed to load)."""


_lock = threading.Lock()
_library = None  # the loaded op module, once loaded
_load_error = None  # the CustomOpsUnavailable of a failed load, kept so that it is not retried
_warned = False


def _load(path):
    """Load the library at ``path`` after checking it was built for this TensorFlow; raise with the reason."""
    if not os.path.exists(path):
        raise CustomOpsUnavailable(f"fused-op library {path} is missing: build it with ops/build.sh "
                                   "(scripts/setup.sh does), or use --custom_ops off")
    info_path = os.path.join(os.path.dirname(path), BUILD_INFO_NAME)
    try:
        with open(info_path) as f:
            built_for = json.load(f)["tensorflow"]
    except (OSError, ValueError, KeyError) as error:
        raise CustomOpsUnavailable(f"fused-op library {path}: cannot read {info_path} ({error}); rebuild it "
                                   "with ops/build.sh") from error
    # A custom op compiled against another TF's headers can crash the process: refuse before loading it.
    if built_for != tf.__version__:
        raise CustomOpsUnavailable(f"fused-op library {path} was built for tensorflow {built_for}, this is "
                                   f"{tf.__version__}: rebuild it with ops/build.sh")
    try:
        return tf.load_op_library(path)
    except Exception as error:  # tf raises NotFoundError / InvalidArgumentError / OSError variants
        raise CustomOpsUnavailable(f"fused-op library {path} failed to load: {error}") from error


def load_library():
    """The loaded op module; raises ``CustomOpsUnavailable`` (once, then the same error again)."""
    global _library, _load_error
    with _lock:
        if _library is None and _load_error is None:
            try:
                _library = _load(LIBRARY_PATH)
            except CustomOpsUnavailable as error:
                _load_error = error
        if _load_error is not None:
            raise _load_error
        return _library


def use_fused(mode):
    """Whether to run the fused ops, for ``--custom_ops`` ``mode`` ('auto', 'on' or 'off').

    Raises:
      ValueError: unknown mode.
      CustomOpsUnavailable: mode 'on' and the library cannot be used (the message says why).
    """
    global _warned
    if mode not in MODES:
        raise ValueError(f"custom ops mode must be one of {MODES}, got {mode!r}.")
    if mode == "off":
        return False
    if mode == "on":
        load_library()
        return True
    try:
        load_library()
        return True
    except CustomOpsUnavailable as error:
        if not _warned:
            _warned = True
            warnings.warn(f"{error}; using the pure-TF ops instead", RuntimeWarning, stacklevel=2)
        return False


def _reset_for_tests():
    """Forget the loaded library, the load error and the warning (tests change LIBRARY_PATH)."""
    global _library, _load_error, _warned
    with _lock:
        _library, _load_error, _warned = None, None, False


# -- RoIAlign ---------------------------------------------------------------------------------------------

def multilevel_roi_align(features, boxes, output_size, sampling_ratio=2, aligned=True):
    """Fused ``roi_align.multilevel_roi_align``: same arguments, result and gradient (see its docstring).

    Args:
      features: {level: [B, H_l, W_l, C]} consecutive levels, one float dtype.
      boxes: [B, N, 4] float32 [ymin, xmin, ymax, xmax] in input pixels; padded rows all -1.
      output_size: int R; sampling_ratio: int s; aligned: bool, torchvision's convention.

    Returns:
      [B, N, R, R, C] in the features' dtype; differentiable w.r.t. the features only.
    """
    levels, features, boxes = roi_align.check_arguments(features, boxes, output_size, sampling_ratio, aligned)
    dtype = features[levels[0]].dtype
    # The kernel is float32-only; casting here is what the twin does too (float32 arithmetic whatever the
    # features' dtype), and the casts' gradients bring the float32 feature gradient back to the dtype.
    pooled = load_library().mrcnn_roi_align(
        [tf.cast(features[level], tf.float32) for level in levels], boxes, _level_index(boxes, levels),
        min_level=levels[0], output_size=output_size, sampling_ratio=sampling_ratio, aligned=aligned)
    return tf.cast(pooled, dtype)


def multilevel_roi_aligns(features, boxes, output_sizes, sampling_ratio=2, aligned=True):
    """[multilevel_roi_align(features, b, R) for b, R in zip(boxes, output_sizes)] with one feature gradient:
    each call's scatter adds into the gradient of the calls before it, in place. TensorFlow would hold one
    gradient of the features' size per call and sum them after (two P2-sized ones in a training step's
    backward pass, for the box and the mask heads).

    Args:
      features: {level: [B, H_l, W_l, C]} as multilevel_roi_align's.
      boxes: a list of [B, N_i, 4]; output_sizes: a list of ints R_i, one per call.

    Returns:
      a list of [B, N_i, R_i, R_i, C] in the features' dtype; differentiable w.r.t. the features only.
    """
    calls = [roi_align.check_arguments(features, b, size, sampling_ratio, aligned)
             for b, size in zip(boxes, output_sizes, strict=True)]
    levels, features = calls[0][:2]
    dtype = features[levels[0]].dtype
    boxes = [b for _, _, b in calls]
    indices = [_level_index(b, levels) for b in boxes]
    library = load_library()
    attrs = dict(min_level=levels[0], sampling_ratio=sampling_ratio, aligned=aligned)

    @tf.custom_gradient
    def align(*maps):
        pooled = [library.mrcnn_roi_align(maps, b, index, output_size=size, **attrs)
                  for b, index, size in zip(boxes, indices, output_sizes)]

        def grad(*pooled_grads):
            total = []
            for pooled_grad, b, index in zip(pooled_grads, boxes, indices):
                total = _features_grad(pooled_grad, b, index, maps, total, **attrs)
            return total

        return pooled, grad

    return [tf.cast(p, dtype) for p in align(*[tf.cast(features[level], tf.float32) for level in levels])]


def _level_index(boxes, levels):
    """[B, N] int32: each box's level (the twin's own rule, so that every box reads the same level in both
    implementations) as an index into `levels`."""
    return roi_align.assign_levels(boxes, levels[0], levels[-1]) - levels[0]


@tf.RegisterGradient("MrcnnRoiAlign")
def _roi_align_grad(op, grad):
    """Feature gradients by the C++ scatter kernel; boxes and levels get none (the twin stops them too)."""
    num_levels = op.get_attr("num_levels")
    features = op.inputs[:num_levels]
    boxes, levels = op.inputs[num_levels], op.inputs[num_levels + 1]
    attrs = {name: op.get_attr(name) for name in ("min_level", "sampling_ratio", "aligned")}
    return _features_grad(grad, boxes, levels, features, [], **attrs) + [None, None]


def _features_grad(grad, boxes, levels, features, base, **attrs):
    """MrcnnRoiAlignGrad: one RoIAlign's output gradient grad [B, N, R, R, C] scattered onto `features` (a list
    of [B, H_l, W_l, C]), added into `base` (a list like it, or []). Returns a list like `features`."""
    sizes = tf.stack([tf.shape(feature)[1:3] for feature in features])  # [L, 2]
    grads = load_library().mrcnn_roi_align_grad(grad, boxes, levels, sizes, base, num_levels=len(features), **attrs)
    for feature_grad, feature in zip(grads, features):
        feature_grad.set_shape(feature.shape)
    return list(grads)


# -- mask targets -----------------------------------------------------------------------------------------

def mask_targets(rois, gt_boxes, gt_mask_crops, output_size):
    """Fused ``masks.mask_targets``: the same {0, 1} targets, bit for bit (see its docstring).

    Args:
      rois: [B, F, 4] float32 [ymin, xmin, ymax, xmax] pixels; padded rows all -1.
      gt_boxes: [B, F, 4] float32 matched GT boxes; gt_mask_crops: [B, F, M, M] float crops.
      output_size: int R.

    Returns:
      [B, F, R, R] float32 in {0, 1}.
    """
    rois, gt_boxes, gt_mask_crops = mask_ops.check_target_arguments(rois, gt_boxes, gt_mask_crops, output_size)
    return load_library().mrcnn_mask_targets(rois, gt_boxes, gt_mask_crops, output_size=output_size)


# -- proposals --------------------------------------------------------------------------------------------

def multilevel_propose_rois(rpn_scores, rpn_boxes, anchors, image_hw, pre_nms_topn, post_nms_topn,
                            nms_threshold, min_size=0.0):
    """Fused ``roi_ops.multilevel_propose_rois``: same arguments and result (see its docstring).

    Args:
      rpn_scores: {level: [B, H_l, W_l, A]} logits; rpn_boxes: {level: [B, H_l, W_l, 4A]} deltas;
      anchors: {level: [M_l, 4]}; image_hw: [B, 2] valid image size; the rest: ints and floats.

    Returns:
      {'rois': [B, post_nms_topn, 4] float32 (-1 padded), 'roi_scores': [B, post_nms_topn] float32 (0 padded)}.
    """
    level_inputs, image_hw = roi_ops.flatten_level_inputs(rpn_scores, rpn_boxes, anchors, image_hw)
    logits, deltas, level_anchors = (list(parts) for parts in zip(*level_inputs))
    rois, roi_scores = load_library().mrcnn_propose_rois(
        logits, deltas, level_anchors, image_hw, pre_nms_topn=pre_nms_topn, post_nms_topn=post_nms_topn,
        nms_threshold=nms_threshold, min_size=min_size)
    return {"rois": rois, "roi_scores": roi_scores}


# -- RPN anchor targets -----------------------------------------------------------------------------------

def rpn_targets(anchors, gt_boxes, image_size, positive_overlap=0.7, negative_overlap=0.3,
                batch_size_per_im=256, fg_fraction=0.5, seed=None):
    """Fused ``anchors.rpn_targets``: same arguments, and for the same ``seed`` the same targets.

    The op does the IoU matching and the subsampling; the random keys are drawn here exactly as the
    twin draws them, and the few sampled positives are encoded by the twin's own code.

    Args:
      anchors: {level: [H_l*W_l*A, 4]} from ``generate_anchors``; gt_boxes: [K, 4] float32, -1 padded;
      image_size: (H, W); seed: optional [2] stateless seed; the rest as in the twin.

    Returns:
      {'rpn_score_targets': {level: [H_l, W_l, A] int32}, 'rpn_box_targets': {level: [H_l, W_l, 4A] float32}}.
    """
    levels, level_anchors, grids, gt_boxes = anchor_ops.check_target_inputs(anchors, gt_boxes, image_size)
    num_anchors = sum(int(boxes.shape[0]) for boxes in level_anchors)
    keys = anchor_ops.sampling_keys([num_anchors], seed)
    labels, positive_indices = load_library().mrcnn_rpn_labels(
        level_anchors, gt_boxes, keys, grid_heights=[h for h, _ in grids], grid_widths=[w for _, w in grids],
        positive_overlap=positive_overlap, negative_overlap=negative_overlap,
        max_positives=int(batch_size_per_im * fg_fraction), batch_size_per_im=batch_size_per_im)
    return anchor_ops.targets_from_labels(levels, level_anchors, grids, anchor_ops.real_ground_truth(gt_boxes),
                                          labels, positive_indices)


# -- 3x3 convolution by Winograd's F(m x m, 3x3), m = 4, 5 or 6 -------------------------------------------------

# The kernel transforms G ((m + 2) x 3) of the output blocks' sides m, Lavin & Gray (2015); the pixels' transforms
# B^T and A^T are in ops/winograd_op.cc. U = G g G^T for every channel pair is one matrix product with kron(G, G)
# ((m + 2)^2 x 9): U[(m + 2) a + b] = sum over taps (i, j) of G[a, i] G[b, j] g[i, j].
_WINOGRAD_G = {
    4: np.array([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6], [1 / 24, 1 / 12, 1 / 6],
                 [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]]),
    5: np.array([[-2 / 9, -2 / 9, -2 / 9], [2 / 9, -2 / 9, 2 / 9], [1 / 45, 2 / 45, 4 / 45], [-1 / 45, 2 / 45, -4 / 45],
                 [16 / 45, 8 / 45, 4 / 45], [-16 / 45, 8 / 45, -4 / 45], [0, 0, 1]]),
    6: np.array([[1, 0, 0], [-2 / 9, -2 / 9, -2 / 9], [-2 / 9, 2 / 9, -2 / 9], [1 / 90, 1 / 45, 2 / 45],
                 [1 / 90, -1 / 45, 2 / 45], [32 / 45, 16 / 45, 8 / 45], [32 / 45, -16 / 45, 8 / 45], [0, 0, 1]]),
}
_WINOGRAD_KERNEL_TRANSFORM = {m: np.kron(g, g).astype(np.float32) for m, g in _WINOGRAD_G.items()}
# The most bytes of transformed tiles (or of their products) computed at once: an eighth of P2's at 800x1088,
# batch 2, which lowers a training step's peak memory and not its speed (CHANGELOG). Less than half of a
# P2-sized tensor: TensorFlow's CPU allocator serves a request from a free block of less than twice its size
# whole, and a band's tensors would otherwise take the blocks of freed P2 gradients whole.
_WINOGRAD_BAND_BYTES = 32 * 2**20


# The fewest 6x6 output blocks (over the batch) for F(6x6, 3x3): its 64 matrix products of fewer rows each run
# slower, and below this it was no faster than F(4x4, 3x3) (a map of 50x68 at batch 1, 108 blocks) or slower.
WINOGRAD_6X6_MIN_BLOCKS = 256


def winograd_block(shape):
    """The output blocks' side m (4, 5 or 6) of the Winograd route for an input of `shape` (B, H, W; None where
    unknown): the m whose F(m x m, 3x3) takes the fewest matrix products, the smaller m (the more accurate) at a
    tie.

    F(m x m, 3x3) takes (m + 2)^2 products per block of m x m output pixels, ceil(H / m) ceil(W / m) blocks per
    image: on a large map F(6x6, 3x3) takes the fewest (1.78 per pixel, against 1.96 and 2.25), and its
    transforms write the fewest bytes; it runs on maps of at least WINOGRAD_6X6_MIN_BLOCKS blocks. A 14x14 map
    (the mask head's RoIs) takes 441 by F(5x5, 3x3), 576 by the others. A map whose size is known only at run
    time is a large one (the model's maps of images of any size): 6.
    """
    batch, height, width = shape
    if height is None or width is None:
        return 6
    blocks = {m: -(-height // m) * -(-width // m) for m in (4, 5, 6)}
    if (batch or 1) * blocks[6] < WINOGRAD_6X6_MIN_BLOCKS:
        del blocks[6]
    return min(blocks, key=lambda m: ((m + 2) ** 2 * blocks[m], m))


def _chosen_block(block, shape):
    """`block` (4, 5 or 6) as given, or `winograd_block`'s choice for an input of `shape` if None."""
    if block is None:
        return winograd_block(shape)
    if block not in _WINOGRAD_KERNEL_TRANSFORM:
        raise ValueError(f"block must be 4, 5 or 6 (F(m x m, 3x3)), got {block}")
    return block


def _winograd_kernel(kernel, block):
    """U = G g G^T of every channel pair: [3, 3, C_in, C_out] -> [(m + 2)^2, C_in, C_out], m = block."""
    transform = _WINOGRAD_KERNEL_TRANSFORM[block]
    return tf.reshape(tf.matmul(transform, tf.reshape(kernel, [9, -1])), [transform.shape[0], *kernel.shape[2:]])


def conv2d_3x3(inputs, kernel, bias=None, relu=False, block=None):
    """Fused tf.nn.conv2d(inputs, kernel, 1, 'SAME') for a 3x3 kernel, by Winograd's F(m x m, 3x3), then + bias
    and ReLU if asked.

    (m + 2)^2 matrix products [T, C_in] x [C_in, C_out] over the T m x m output blocks replace the 9 m^2 of a
    direct conv (m = block, by default `winograd_block`'s choice); the kernels transform the pixels to and from
    Winograd's domain, the output transform adding the bias and applying the ReLU as it writes each block (no
    passes of their own).
    Float rounding differs from the twin's by about 1e-5 of the output's scale (m = 4) or 2e-5 (m = 5 or 6). No
    gradient: conv_ops.conv2d's custom gradient has its own.

    Args:
      inputs: [B, H, W, C_in] float32.
      kernel: [3, 3, C_in, C_out] float32.
      bias: [C_out] float32 or None.
      relu: whether max(output, 0) ends it.
      block: m, 4, 5 or 6; None: `winograd_block`'s choice for the input's shape.

    Returns:
      [B, H, W, C_out] float32.
    """
    library = load_library()
    in_channels, out_channels = inputs.shape[3], kernel.shape[3]
    block = _chosen_block(block, inputs.shape[:3])
    # After the input: in a backward pass the flipped kernel is there long before the output gradient, and
    # the executor would transform every conv's kernel at once and hold them all ((m + 2)^2 x C_in x C_out each).
    with tf.control_dependencies([inputs]):
        transformed = fixed.once(lambda k: _winograd_kernel(k, block), kernel)
    # Band after band into one buffer, each band's tiles and products made after the previous band's are
    # gone: a large conv's tiles and products (about twice its input's and its output's memory) are never all
    # there.
    outputs = None
    for first_line, lines in _winograd_bands(inputs.shape[:3], max(in_channels, out_channels), block):
        with tf.control_dependencies([] if outputs is None else [outputs]):
            tiles = library.mrcnn_winograd_input(inputs, first_line=first_line, lines=lines, block=block)
        products = tf.matmul(tiles, transformed)  # [(m + 2)^2, T_band, C_out]
        epilogue = dict(bias=[] if bias is None else [bias], relu=relu, first_line=first_line, block=block)
        outputs = (library.mrcnn_winograd_output(products, tf.shape(inputs)[:3], **epilogue) if outputs is None
                   else library.mrcnn_winograd_output_into(outputs, products, **epilogue))
    outputs.set_shape(inputs.shape[:3] + kernel.shape[3:])
    return outputs


def conv2d_3x3_kernel_gradient(inputs, out_grad, block=None):
    """Gradient with respect to the kernel of conv2d_3x3 (or tf.nn.conv2d at stride 1, 'SAME'), by Winograd's
    F(m x m, 3x3) too (m = block, by default `winograd_block`'s choice): the (m + 2)^2 products [C_in, T] x
    [T, C_out] of the input's tiles and the output gradient's (dM = A dY A^T per m x m block, ops/winograd_op.cc)
    do the work of the 9 m^2 of a direct kernel gradient, and U = G g G^T transposed (dg = G^T dU G) brings their
    sum back to the 3x3 taps. Float rounding differs from TensorFlow's kernel gradient by about 1e-5 of the
    gradient's scale.

    Args:
      inputs: [B, H, W, C_in] float32, the conv's input.
      out_grad: [B, H, W, C_out] float32, the gradient of the loss with respect to the conv's output.
      block: m, 4, 5 or 6; None: `winograd_block`'s choice for the input's shape.

    Returns:
      [3, 3, C_in, C_out] float32.
    """
    library = load_library()
    in_channels, out_channels = inputs.shape[3], out_grad.shape[3]
    block = _chosen_block(block, inputs.shape[:3])
    # The input's tiles need only the forward's input, so TensorFlow's executor would transform it as soon as
    # the forward pass had it and hold the tiles until the gradient arrived: the tiles of every such conv at
    # once. So the first band waits for the output gradient, and each later band for the sum so far (one band's
    # tiles at a time).
    summed = out_grad
    for first_line, lines in _winograd_bands(inputs.shape[:3], max(in_channels, out_channels), block):
        with tf.control_dependencies([summed]):
            tiles = library.mrcnn_winograd_input(inputs, first_line=first_line, lines=lines, block=block)
            grad_tiles = library.mrcnn_winograd_output_adjoint(out_grad, first_line=first_line, lines=lines,
                                                               block=block)
        products = tf.matmul(tiles, grad_tiles, transpose_a=True)  # [(m + 2)^2, C_in, C_out]
        summed = products if summed is out_grad else summed + products
    transform = _WINOGRAD_KERNEL_TRANSFORM[block]
    kernel_grad = tf.matmul(transform, tf.reshape(summed, [transform.shape[0], -1]), transpose_a=True)
    return tf.reshape(kernel_grad, [3, 3, in_channels, out_channels])


def _winograd_bands(shape, channels, block):
    """(first_line, lines) of the bands of tile lines (an image's tile row: ops/winograd_op.cc) that Winograd's
    route takes in turn, for an input of `shape` (B, H, W; None where unknown), at most `channels` channels in
    or out and blocks of `block` x `block` pixels: nearly equal bands of at most _WINOGRAD_BAND_BYTES of tiles,
    or one band of all (-1) if the size is known only at run time."""
    batch, height, width = shape
    if None in (batch, height, width):
        return [(0, -1)]
    lines, line_bytes = batch * -(-height // block), (block + 2) ** 2 * 4 * -(-width // block) * channels
    bands = max(1, min(lines, -(-lines * line_bytes // _WINOGRAD_BAND_BYTES)))
    sizes = [lines // bands + (i < lines % bands) for i in range(bands)]
    return [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]


# -- mask pasting and RLE encoding (evaluation, NumPy in, pycocotools RLE out) -----------------------------

def encode_pasted_masks(masks, boxes, image_hw, threshold):
    """Fused ``masks.encode_pasted_masks``: the same RLE, byte for byte (see its docstring).

    The op pastes each mask into its box region and emits the full-image mask's uncompressed run lengths
    (the zeros around the box are counted, not materialised); pycocotools compresses them.

    Args:
      masks: [D, R, R] float32 probabilities; boxes: [D, 4] float32 [ymin, xmin, ymax, xmax] pixels;
      image_hw: (h, w) ints; threshold: float.

    Returns:
      list of D dicts {'size': [h, w], 'counts': bytes}, pycocotools' compressed RLE.
    """
    masks, boxes, height, width = mask_ops.check_encode_arguments(masks, boxes, image_hw, threshold)
    if not len(masks):
        return []  # frPyObjects cannot take an empty list
    counts, splits = load_library().mrcnn_paste_masks_rle(masks, boxes, height=height, width=width,
                                                          threshold=float(threshold))
    return mask_ops.compress_run_lengths(counts.numpy(), splits.numpy().tolist(), height, width)

