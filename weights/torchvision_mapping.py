"""torchvision's Mask R-CNN state dict mapped onto this package's MaskRCNN: which tensor goes to which variable,
the checks of a file's keys and shapes, and the conversion of the arrays. NumPy only: TensorFlow is not
imported here (the model's constants are read inside the functions that need them), and no file is read or
written (weights/torch_pickle.py reads, weights/convert_torchvision.py writes).

A layout is the list of `Entry`s of one torchvision architecture, in state-dict order: each names
torchvision's layer (its key prefix and weight shape), the kind of layer, and the attribute path of ours that
takes its weights. `layout_v1` is maskrcnn_resnet50_fpn (and MaskRCNN on resnet_fpn_backbone of ResNet-18, 34,
50 or 101), composed of one function per part (ResNet body, FPN, RPN head, box head, box predictor, mask head,
mask predictor); `layout_v2` is maskrcnn_resnet50_fpn_v2, the same body and predictors with its own FPN, RPN
head, box head and mask head. `find_version` tells them apart by their keys. The checks and the conversion
take any layout.
The class names of torchvision's COCO weights are here too (`COCO_CATEGORIES`, `coco_label_map`).

Conventions of the conversion (exact up to float32 rounding):
  - Conv kernels OIHW -> HWIO, Linear weights transposed, ConvTranspose (in, out, kh, kw) -> (kh, kw, out, in).
  - fc6 reads torchvision's flattened [C, 7, 7] RoI features, ours flattened [7, 7, C]: its input rows are
    reordered.
  - Box deltas: torchvision's (dx, dy, dw, dh) per anchor (RPN) and per class (box predictor) become our
    (dy, dx, dh, dw), rows of the weights and biases permuted in each group of 4. The anchors of a cell come in
    torchvision's aspect-ratio order (0.5, 1, 2), which the torchvision preset's `model.anchors.aspect_ratios`
    keeps.
  - v1's batch norm (FrozenBatchNorm2d) y = (x - mean) * gamma / sqrt(var + eps_tv) + beta is folded into an
    affine map stored in our batch norm with zero mean and unit (var + eps): our epsilon (backbone.BN_EPSILON)
    then changes nothing. v2's batch norms (nn.BatchNorm2d, which train when the model is fine-tuned) keep
    their gamma, beta and mean, and variance var + eps_tv - BN_EPSILON (var itself for eps_tv 1e-5).
    eps_tv (`choose_bn_eps`): 1e-5 (nn.BatchNorm2d) when the state dict has num_batches_tracked keys; without
    them it comes from FrozenBatchNorm2d, which torchvision runs with eps 0 for its released COCO weights
    (overwrite_eps in torchvision/models/detection/mask_rcnn.py); a model trained with FrozenBatchNorm2d's own
    default needs an override of 1e-5. num_batches_tracked values are not used.
Keys: the current spellings and those of older torchvision releases (FPN `inner_blocks.N.weight`,
`rpn.head.conv.weight`, `mask_head.mask_fcnN.weight`) are both read (`current_spellings`); every key must be
used, and a missing, unexpected or mis-shaped key is an error naming it (`check_tensors`).
"""

import collections
import dataclasses
import re

import numpy as np

# nn.BatchNorm2d's eps (torchvision builds maskrcnn_resnet50_fpn with it when no pretrained weights are given).
TORCH_BATCH_NORM_EPS = 1e-5
# torchvision's MaskRCNNHeads: four 3x3 convs (our MaskHead's default num_convs).
MASK_HEAD_CONVS = 4

# The categories of torchvision's COCO weights by class index (torchvision.models._meta._COCO_CATEGORIES):
# index = COCO category id, "__background__" at 0, "N/A" where COCO has no category.
COCO_CATEGORIES = (
    "__background__", "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "N/A", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse",
    "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "N/A", "backpack", "umbrella", "N/A", "N/A",
    "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball", "kite", "baseball bat",
    "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle", "N/A", "wine glass", "cup", "fork",
    "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza",
    "donut", "cake", "chair", "couch", "potted plant", "bed", "N/A", "dining table", "N/A", "N/A", "toilet",
    "N/A", "tv", "laptop", "mouse", "remote", "keyboard", "cell phone", "microwave", "oven", "toaster", "sink",
    "refrigerator", "N/A", "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)
# COCO_CATEGORIES' marker of an id without a category.
NO_CATEGORY = "N/A"


# -- the torchvision model's keys --------------------------------------------------------------------------------------

# Older torchvision releases (before its layers became Conv2dNormActivation blocks) spelled these keys
# without the block index; their _load_from_state_dict hooks rename them the same way.
OLD_SPELLINGS = (
    (re.compile(r"backbone\.fpn\.(inner_blocks|layer_blocks)\.(\d+)\.(weight|bias)"),
     lambda m: f"backbone.fpn.{m[1]}.{m[2]}.0.{m[3]}"),
    (re.compile(r"rpn\.head\.conv\.(weight|bias)"), lambda m: f"rpn.head.conv.0.0.{m[1]}"),
    (re.compile(r"roi_heads\.mask_head\.mask_fcn(\d+)\.(weight|bias)"),
     lambda m: f"roi_heads.mask_head.{int(m[1]) - 1}.0.{m[2]}"),
)
# The parts of a torchvision Mask R-CNN state dict, by key prefix: a file without one of them is another model.
PARTS = {
    "backbone.body.": "ResNet", "backbone.fpn.": "FPN", "rpn.head.": "RPN head",
    "roi_heads.box_head.": "box head", "roi_heads.box_predictor.": "box predictor",
    "roi_heads.mask_head.": "mask head", "roi_heads.mask_predictor.": "mask predictor",
}
CLASS_LOGITS_KEY = "roi_heads.box_predictor.cls_score.weight"
MASK_LOGITS_KEY = "roi_heads.mask_predictor.mask_fcn_logits.weight"
BN_PARAMETERS = ("weight", "bias", "running_mean", "running_var")
BN_COUNTER = "num_batches_tracked"
RESNET_BLOCK = re.compile(r"backbone\.body\.layer(\d+)\.(\d+)\.")

# CONV_BN: conv + batch norm folded into a fixed affine map (v1's FrozenBatchNorm2d); CONV_NORM: conv + batch
# norm whose weights and statistics are kept (v2's nn.BatchNorm2d, which trains when fine-tuned).
CONV_BN, CONV_NORM, CONV, DENSE, DECONV = "conv_bn", "conv_norm", "conv", "dense", "deconv"
NORM_KINDS = (CONV_BN, CONV_NORM)


def current_spellings(tensors, path):
    """(tensors under torchvision's current key names, {current name: name in the file} of renamed keys).

    Raises ValueError naming both keys when the file spells one tensor both ways.
    """
    renamed, original = {}, {}
    for key, value in tensors.items():
        new = key
        for pattern, spell in OLD_SPELLINGS:
            match = pattern.fullmatch(key)
            if match:
                new = spell(match)
        if new in renamed:
            raise ValueError(f"{path}: {original.get(new, new)} and {key} are the same tensor in two spellings")
        renamed[new] = value
        if new != key:
            original[new] = key
    return renamed, original


@dataclasses.dataclass(frozen=True)
class Entry:
    """One layer of torchvision's Mask R-CNN and the layer of our MaskRCNN that takes its weights.

    kind: CONV_BN or CONV_NORM (conv without bias + batch norm), CONV (with bias), DENSE (Linear), DECONV
      (ConvTranspose2d).
    key: torchvision's prefix of KEY.weight (and KEY.bias).
    shape: torchvision's shape of KEY.weight.
    target: attribute path of our layer in MaskRCNN: names and list indices / dict keys, e.g.
      ("backbone", "groups", 0, 1, "convs", 2).
    bn_key: CONV_BN, CONV_NORM: torchvision's prefix of the batch norm.
    swap_xy: the outputs come in groups of 4 box deltas (dx, dy, dw, dh); ours are (dy, dx, dh, dw).
    chw_input: DENSE: the input is a flattened [C, H, W] map (torchvision's RoI features); ours flattens [H, W, C].
    """

    kind: str
    key: str
    shape: tuple
    target: tuple
    bn_key: str = ""
    swap_xy: bool = False
    chw_input: tuple = ()

    def torch_shapes(self):
        """{torchvision key: shape} of the tensors this layer takes (num_batches_tracked aside)."""
        if self.kind in NORM_KINDS:
            return {f"{self.key}.weight": self.shape,
                    **{f"{self.bn_key}.{name}": self.shape[:1] for name in BN_PARAMETERS}}
        outputs = self.shape[1] if self.kind == DECONV else self.shape[0]
        return {f"{self.key}.weight": self.shape, f"{self.key}.bias": (outputs,)}


# -- layout v1: maskrcnn_resnet50_fpn, one function per part -----------------------------------------------------------


def resnet_entries(depth, norm=CONV_BN):
    """The Entries of torchvision's ResNet-`depth` body (backbone.body): the stem, then each block's convs and
    its projection shortcut, their batch norms converted as `norm` (CONV_BN or CONV_NORM)."""
    from mrcnn_tf2.model.backbone import BLOCKS_PER_GROUP, GROUP_FILTERS, STEM_FILTERS

    entries = [Entry(norm, "backbone.body.conv1", (STEM_FILTERS, 3, 7, 7), ("backbone", "stem"),
                     bn_key="backbone.body.bn1")]
    in_channels = STEM_FILTERS
    for group, (num_blocks, filters, out_channels) in enumerate(
            zip(BLOCKS_PER_GROUP[depth], GROUP_FILTERS, resnet_widths(depth))):
        for block in range(num_blocks):
            prefix, target = f"backbone.body.layer{group + 1}.{block}", ("backbone", "groups", group, block)
            block_in = in_channels if block == 0 else out_channels
            if out_channels == filters:  # BasicBlock
                shapes = ((filters, block_in, 3, 3), (filters, filters, 3, 3))
            else:  # Bottleneck
                shapes = ((filters, block_in, 1, 1), (filters, filters, 3, 3), (out_channels, filters, 1, 1))
            entries += [Entry(norm, f"{prefix}.conv{i}", shape, target + ("convs", i - 1), bn_key=f"{prefix}.bn{i}")
                        for i, shape in enumerate(shapes, 1)]
            # A projection where the block changes the stride or the width (not ResNet-18/34's first block).
            if block == 0 and (group > 0 or in_channels != out_channels):
                entries.append(Entry(norm, f"{prefix}.downsample.0", (out_channels, in_channels, 1, 1),
                                     target + ("shortcut",), bn_key=f"{prefix}.downsample.1"))
        in_channels = out_channels
    return entries


def resnet_widths(depth):
    """Output channels of ResNet-`depth`'s four stages (layer1..layer4), the FPN's inputs."""
    from mrcnn_tf2.model.backbone import BOTTLENECK_DEPTHS, BOTTLENECK_EXPANSION, GROUP_FILTERS

    expansion = BOTTLENECK_EXPANSION if depth in BOTTLENECK_DEPTHS else 1
    return tuple(filters * expansion for filters in GROUP_FILTERS)


def fpn_entries(in_widths, width):
    """The Entries of torchvision's FPN of 3x3 output convs with bias on stages of `in_widths` channels: block
    i = 0..3 serves ResNet's layer(i+1), our level i+2."""
    entries = []
    for i, in_width in enumerate(in_widths):
        entries += [
            Entry(CONV, f"backbone.fpn.inner_blocks.{i}.0", (width, in_width, 1, 1), ("fpn", "lateral", i + 2)),
            Entry(CONV, f"backbone.fpn.layer_blocks.{i}.0", (width, width, 3, 3), ("fpn", "output_convs", i + 2)),
        ]
    return entries


def rpn_head_entries(width, anchors):
    """The Entries of torchvision's RPNHead of one 3x3 conv, on `width` channels with `anchors` per cell."""
    return [
        Entry(CONV, "rpn.head.conv.0.0", (width, width, 3, 3), ("rpn_head", "conv")),
        Entry(CONV, "rpn.head.cls_logits", (anchors, width, 1, 1), ("rpn_head", "score_conv")),
        Entry(CONV, "rpn.head.bbox_pred", (4 * anchors, width, 1, 1), ("rpn_head", "box_conv"), swap_xy=True),
    ]


def box_head_entries(width, hidden):
    """The Entries of torchvision's TwoMLPHead (fc6, fc7 of `hidden` units) on RoI features of `width` channels."""
    from mrcnn_tf2.model.factory import BOX_ROI_SIZE

    return [
        Entry(DENSE, "roi_heads.box_head.fc6", (hidden, width * BOX_ROI_SIZE ** 2), ("box_head", "fc6"),
              chw_input=(width, BOX_ROI_SIZE, BOX_ROI_SIZE)),
        Entry(DENSE, "roi_heads.box_head.fc7", (hidden, hidden), ("box_head", "fc7")),
    ]


def box_predictor_entries(hidden, classes):
    """The Entries of torchvision's FastRCNNPredictor: class logits and per-class box deltas on `hidden` features."""
    return [
        Entry(DENSE, "roi_heads.box_predictor.cls_score", (classes, hidden), ("box_head", "class_dense")),
        Entry(DENSE, "roi_heads.box_predictor.bbox_pred", (4 * classes, hidden), ("box_head", "box_dense"),
              swap_xy=True),
    ]


def mask_head_entries(width, mask_width):
    """The Entries of torchvision's MaskRCNNHeads of MASK_HEAD_CONVS 3x3 convs with bias, `mask_width` wide."""
    return [Entry(CONV, f"roi_heads.mask_head.{i}.0", (mask_width, width if i == 0 else mask_width, 3, 3),
                  ("mask_head", "convs", i)) for i in range(MASK_HEAD_CONVS)]


def mask_predictor_entries(mask_width, classes):
    """The Entries of torchvision's MaskRCNNPredictor: the 2x up-sampling deconv and the per-class logits."""
    return [
        Entry(DECONV, "roi_heads.mask_predictor.conv5_mask", (mask_width, mask_width, 2, 2), ("mask_head", "deconv")),
        Entry(CONV, "roi_heads.mask_predictor.mask_fcn_logits", (classes, mask_width, 1, 1), ("mask_head", "logits")),
    ]


def layout_v1(config):
    """The Entries of torchvision's Mask R-CNN v1 (maskrcnn_resnet50_fpn) for `config` (the torchvision preset,
    with its number of classes and ResNet depth), in state-dict order."""
    model = config.model
    depth = int(model.backbone.removeprefix("resnet"))
    width, hidden, mask_width = model.fpn_num_filters, model.fast_rcnn_mlp_head_dim, model.mrcnn_head_num_filters
    return (resnet_entries(depth) + fpn_entries(resnet_widths(depth), width)
            + rpn_head_entries(width, model.num_anchors) + box_head_entries(width, hidden)
            + box_predictor_entries(hidden, model.num_classes) + mask_head_entries(width, mask_width)
            + mask_predictor_entries(mask_width, model.num_classes))


# -- layout v2: maskrcnn_resnet50_fpn_v2, v1's body and predictors with its own FPN and heads -------------------------


def fpn_entries_v2(in_widths, width):
    """The Entries of torchvision's FPN with batch norm after every lateral (inner) and output (layer) conv."""
    entries = []
    for i, in_width in enumerate(in_widths):
        for blocks, shape, target in (("inner_blocks", (width, in_width, 1, 1), "lateral"),
                                      ("layer_blocks", (width, width, 3, 3), "output_convs")):
            entries.append(Entry(CONV_NORM, f"backbone.fpn.{blocks}.{i}.0", shape, ("fpn", target, i + 2),
                                 bn_key=f"backbone.fpn.{blocks}.{i}.1"))
    return entries


def rpn_head_entries_v2(width, anchors, convs):
    """The Entries of torchvision's RPNHead(conv_depth=`convs`): 3x3 convs with bias, then the two outputs."""
    return ([Entry(CONV, f"rpn.head.conv.{j}.0", (width, width, 3, 3), ("rpn_head", "convs", j)) for j in range(convs)]
            + rpn_head_entries(width, anchors)[1:])


def box_head_entries_v2(width, conv_dim, convs, hidden):
    """The Entries of torchvision's FastRCNNConvFCHead: `convs` 3x3 convs of `conv_dim` with batch norm, then
    (after its Flatten, index `convs`) one Linear of `hidden` units on the flattened [conv_dim, 7, 7] map."""
    from mrcnn_tf2.model.factory import BOX_ROI_SIZE

    entries = [Entry(CONV_NORM, f"roi_heads.box_head.{i}.0", (conv_dim, width if i == 0 else conv_dim, 3, 3),
                     ("box_head", "convs", i), bn_key=f"roi_heads.box_head.{i}.1") for i in range(convs)]
    return entries + [Entry(DENSE, f"roi_heads.box_head.{convs + 1}", (hidden, conv_dim * BOX_ROI_SIZE ** 2),
                            ("box_head", "fc6"), chw_input=(conv_dim, BOX_ROI_SIZE, BOX_ROI_SIZE))]


def mask_head_entries_v2(width, mask_width):
    """The Entries of torchvision's MaskRCNNHeads with batch norm in each of its MASK_HEAD_CONVS 3x3 convs."""
    return [Entry(CONV_NORM, f"roi_heads.mask_head.{i}.0", (mask_width, width if i == 0 else mask_width, 3, 3),
                  ("mask_head", "convs", i), bn_key=f"roi_heads.mask_head.{i}.1") for i in range(MASK_HEAD_CONVS)]


def layout_v2(config):
    """The Entries of torchvision's Mask R-CNN v2 (maskrcnn_resnet50_fpn_v2) for `config` (the torchvision_v2
    preset, with its number of classes and ResNet depth), in state-dict order. Every batch norm is nn.BatchNorm2d
    and is kept (CONV_NORM), the backbone's too."""
    model = config.model
    depth = int(model.backbone.removeprefix("resnet"))
    width, hidden, mask_width = model.fpn_num_filters, model.fast_rcnn_mlp_head_dim, model.mrcnn_head_num_filters
    return (resnet_entries(depth, CONV_NORM) + fpn_entries_v2(resnet_widths(depth), width)
            + rpn_head_entries_v2(width, model.num_anchors, model.rpn_head_num_convs)
            + box_head_entries_v2(width, model.fast_rcnn_conv_dim, model.fast_rcnn_num_convs, hidden)
            + box_predictor_entries(hidden, model.num_classes) + mask_head_entries_v2(width, mask_width)
            + mask_predictor_entries(mask_width, model.num_classes))


# Each version's layout and preset, and a key only its state dicts hold.
VERSIONS = {
    "v1": dict(layout=layout_v1, preset="torchvision", builder="maskrcnn_resnet50_fpn",
               key="roi_heads.box_head.fc6.weight"),
    "v2": dict(layout=layout_v2, preset="torchvision_v2", builder="maskrcnn_resnet50_fpn_v2",
               key="roi_heads.box_head.0.0.weight"),
}


def find_version(tensors, path):
    """'v1' or 'v2': which torchvision Mask R-CNN the state dict `tensors` is, by VERSIONS' keys. Raises
    ValueError naming the file and both keys when it holds neither or both."""
    found = [version for version, known in VERSIONS.items() if known["key"] in tensors]
    if len(found) != 1:
        keys = " nor ".join(known["key"] for known in VERSIONS.values()) if not found else " and ".join(
            VERSIONS[version]["key"] for version in found)
        raise ValueError(f"{path}: neither torchvision's Mask R-CNN v1 nor v2: it holds "
                         f"{'neither ' + keys if not found else keys}")
    return found[0]


# -- checks of a state dict --------------------------------------------------------------------------------------------


def check_is_mask_rcnn(tensors, path):
    """Raises ValueError naming the file unless `tensors` holds every part of a torchvision Mask R-CNN on a
    ResNet of a depth this package builds (naming the parts missing, or the blocks per stage found). Returns
    (number of classes, ResNet depth): the classes read from the class logits (or the mask logits when those
    are missing: the full check names the key), the depth from the blocks per stage and whether they are
    bottlenecks (a conv3)."""
    from mrcnn_tf2.model.backbone import BLOCKS_PER_GROUP, BOTTLENECK_DEPTHS

    missing = [f"{prefix.rstrip('.')} ({part})" for prefix, part in PARTS.items()
               if not any(key.startswith(prefix) for key in tensors)]
    if missing:
        tops = sorted({key.split(".")[0] for key in tensors})
        raise ValueError(f"{path}: not a torchvision Mask R-CNN state dict: it has no keys of {', '.join(missing)}; "
                         f"its keys begin with {', '.join(tops) or 'nothing'}")
    blocks = collections.defaultdict(set)
    for key in tensors:
        match = RESNET_BLOCK.match(key)
        if match:
            blocks[int(match[1])].add(int(match[2]))
    counts = tuple(max(blocks[layer], default=-1) + 1 for layer in range(1, max(blocks, default=0) + 1))
    bottleneck = "backbone.body.layer1.0.conv3.weight" in tensors
    depths = [depth for depth, known in BLOCKS_PER_GROUP.items()
              if known == counts and (depth in BOTTLENECK_DEPTHS) == bottleneck]
    if not depths:
        known = ", ".join(f"ResNet-{depth} {blocks}" for depth, blocks in BLOCKS_PER_GROUP.items())
        raise ValueError(f"{path}: its ResNet has {counts} {'bottleneck' if bottleneck else 'basic'} blocks per "
                         f"stage, which is no depth this package builds ({known})")
    for key, dims in ((CLASS_LOGITS_KEY, 2), (MASK_LOGITS_KEY, 4)):
        if key in tensors and tensors[key].ndim == dims:
            return int(tensors[key].shape[0]), depths[0]
    raise ValueError(f"{path}: the number of classes is unknown: neither {CLASS_LOGITS_KEY} [K, D] nor "
                     f"{MASK_LOGITS_KEY} [K, C, 1, 1] is in it")


def check_tensors(tensors, entries, path, original=None):
    """Raises ValueError naming the file and listing every missing, unexpected, mis-shaped, non-float or
    non-finite key (num_batches_tracked of a batch norm is expected or not, at will).

    `original`: {current key: key in the file} of keys `current_spellings` renamed, for the messages.
    """
    original = original or {}
    expected = {key: shape for entry in entries for key, shape in entry.torch_shapes().items()}
    counters = {f"{entry.bn_key}.{BN_COUNTER}" for entry in entries if entry.kind in NORM_KINDS}
    present = [key for key in expected if key in tensors]
    floating = [key for key in present if np.issubdtype(tensors[key].dtype, np.floating)]
    problems = {
        "missing": [key for key in expected if key not in tensors],
        "unexpected": sorted(original.get(key, key) for key in tensors if key not in expected and key not in counters),
        "mis-shaped": [f"{original.get(key, key)} {list(tensors[key].shape)}, expected {list(expected[key])}"
                       for key in present if tensors[key].shape != expected[key]],
        "not floating point": [f"{original.get(key, key)} ({tensors[key].dtype})" for key in present
                               if key not in floating],
        "not finite": [original.get(key, key) for key in floating if not np.all(np.isfinite(tensors[key]))],
    }
    found = [f"{len(keys)} {kind}: {', '.join(keys)}" for kind, keys in problems.items() if keys]
    if found:
        raise ValueError(f"{path}: does not match torchvision's Mask R-CNN: {'; '.join(found)}")


def choose_bn_eps(tensors, entries, path, override=None):
    """(eps of torchvision's batch norms, why) for the state dict `tensors` (see the module docstring).

    Raises ValueError naming the file when only some batch norms have num_batches_tracked and no `override`
    is given.
    """
    if override is not None:
        return float(override), "--bn_eps"
    norms = [entry.bn_key for entry in entries if entry.kind in NORM_KINDS]
    counted = [key for key in norms if f"{key}.{BN_COUNTER}" in tensors]
    if len(counted) == len(norms):
        return TORCH_BATCH_NORM_EPS, f"{BN_COUNTER} keys: nn.BatchNorm2d, whose eps is 1e-5"
    if not counted:
        return 0.0, (f"no {BN_COUNTER} keys: FrozenBatchNorm2d, run with eps 0 as torchvision's released COCO "
                     "weights are; pass --bn_eps 1e-5 for a model trained with FrozenBatchNorm2d's default eps")
    raise ValueError(f"{path}: {len(counted)} of {len(norms)} batch norms have {BN_COUNTER} keys: their eps is "
                     "ambiguous; pass --bn_eps")


# -- the conversion of the arrays --------------------------------------------------------------------------------------


def fold_batch_norm(gamma, beta, mean, var, eps):
    """torchvision's batch norm as y = x * scale + shift: (scale, shift), [C] float64 each.

    gamma, beta, mean, var: [C] (weight, bias, running_mean, running_var); eps: its epsilon.
    """
    scale = np.asarray(gamma, np.float64) / np.sqrt(np.asarray(var, np.float64) + eps)
    return scale, np.asarray(beta, np.float64) - np.asarray(mean, np.float64) * scale


def xy_swap_order(size):
    """Index array [size] (size a multiple of 4) that reorders groups of (dx, dy, dw, dh) into (dy, dx, dh, dw)."""
    return np.arange(size).reshape(-1, 4)[:, [1, 0, 3, 2]].reshape(-1)


def conv_kernel(weight):
    """PyTorch Conv2d weight [O, I, KH, KW] -> TF kernel [KH, KW, I, O]; ConvTranspose2d weight [I, O, KH, KW]
    -> Keras Conv2DTranspose kernel [KH, KW, O, I] (the same transpose; neither flips the kernel)."""
    return np.transpose(weight, (2, 3, 1, 0))


def dense_kernel(weight, chw_input=()):
    """PyTorch Linear weight [O, I] -> Keras Dense kernel [I, O].

    chw_input (C, H, W): the input is torchvision's flatten of [C, H, W]; the kernel's rows are reordered to
    read our flatten of [H, W, C] instead.
    """
    if not chw_input:
        return np.transpose(weight)
    outputs = weight.shape[0]
    return np.transpose(weight.reshape((outputs,) + tuple(chw_input)), (2, 3, 1, 0)).reshape(-1, outputs)


def convert_entry(entry, tensors, eps):
    """[(attribute path of a variable in the entry's layer, float32 value)] of one torchvision layer."""
    from mrcnn_tf2.model.backbone import BN_EPSILON

    weight = tensors[f"{entry.key}.weight"].astype(np.float64)
    if entry.kind == CONV_NORM:
        gamma, beta, mean, var = (tensors[f"{entry.bn_key}.{name}"].astype(np.float64) for name in BN_PARAMETERS)
        # Kept as a batch norm that may train; our epsilon is BN_EPSILON, so the variance takes the difference.
        values = [(("conv", "kernel"), conv_kernel(weight)), (("bn", "gamma"), gamma), (("bn", "beta"), beta),
                  (("bn", "moving_mean"), mean), (("bn", "moving_variance"), var + eps - BN_EPSILON)]
    elif entry.kind == CONV_BN:
        scale, shift = fold_batch_norm(*(tensors[f"{entry.bn_key}.{name}"] for name in BN_PARAMETERS), eps)
        # Our batch norm keeps the folded affine map with moving mean 0 and this moving variance: in float32,
        # it + BN_EPSILON is exactly 1, so its scale gamma * rsqrt(var + eps) is gamma (to rsqrt's last bit).
        unit_variance = np.float32(1.0) - np.float32(BN_EPSILON)
        values = [(("conv", "kernel"), conv_kernel(weight)), (("bn", "gamma"), scale), (("bn", "beta"), shift),
                  (("bn", "moving_mean"), np.zeros_like(scale)),
                  (("bn", "moving_variance"), np.full_like(scale, unit_variance))]
    else:
        bias = tensors[f"{entry.key}.bias"].astype(np.float64)
        if entry.swap_xy:
            order = xy_swap_order(weight.shape[0])
            weight, bias = weight[order], bias[order]
        kernel = dense_kernel(weight, entry.chw_input) if entry.kind == DENSE else conv_kernel(weight)
        values = [(("kernel",), kernel), (("bias",), bias)]
    return [(path, value.astype(np.float32)) for path, value in values]


def convert_all(tensors, entries, eps, path):
    """[(entry, convert_entry(...))] for every entry. Raises ValueError naming every batch norm whose
    running_var + eps is not positive (its scale would be infinite)."""
    degenerate = [f"{entry.bn_key}.running_var" for entry in entries if entry.kind in NORM_KINDS
                  and not np.all(tensors[f"{entry.bn_key}.running_var"].astype(np.float64) + eps > 0)]
    if degenerate:
        raise ValueError(f"{path}: running_var + eps {eps:g} is not positive in {', '.join(degenerate)}; "
                         "pass a larger --bn_eps")
    return [(entry, convert_entry(entry, tensors, eps)) for entry in entries]


# -- class names -------------------------------------------------------------------------------------------------------


def coco_label_map(num_classes):
    """{COCO category id: name} of torchvision's COCO weights (ids 1..90 without COCO_CATEGORIES' gaps) when
    `num_classes` is theirs (91: background and ids 1..90); None for any other number of classes, whose
    names this module cannot know."""
    if num_classes != len(COCO_CATEGORIES):
        return None
    return {class_id: name for class_id, name in enumerate(COCO_CATEGORIES) if class_id and name != NO_CATEGORY}
