"""Converts a torchvision Mask R-CNN (maskrcnn_resnet50_fpn, or MaskRCNN on another ResNet-FPN) state dict into a
model directory of this package.

    python weights/convert_torchvision.py --input maskrcnn_resnet50_fpn_coco-bf2d0c1e.pth --output_dir runs/tv
    python main.py infer --preset torchvision --model_dir runs/tv --input 'photos/*.jpg' --visualize

Input: `torch.save(model.state_dict())` of torchvision.models.detection.maskrcnn_resnet50_fpn, or of a MaskRCNN on
`resnet_fpn_backbone` of ResNet-18, 34, 50 or 101 (the depth is read from the blocks: the zip format of
PyTorch >= 1.6 or the older non-zip format, in which torchvision's released COCO weights were saved), or an .npz
with the same keys. PyTorch is not needed: the file's pickle is read by an unpickler that builds nothing but
NumPy arrays and refuses every other object (a .pth pickle may name any Python function to be called on
loading). The current key spellings and those of older torchvision releases (FPN `inner_blocks.N.weight`,
`rpn.head.conv.weight`, `mask_head.mask_fcnN.weight`) are both read; every key must be used, and a missing,
unexpected or mis-shaped key is an error naming it. The number of classes comes from the class logits.

Output: DIR as training writes a model directory: a checkpoint (DIR/checkpoint, DIR/ckpt-0.*) of
`tf.train.Checkpoint(model=MaskRCNN, step=0)` and DIR/config.json (the `torchvision` preset, the file's number
of classes and ResNet depth), so `main.py eval|infer|export --model_dir DIR` restore it; and DIR/conversion.json (source,
batch-norm eps). DIR is written under a temporary name and renamed when complete, so a failed run leaves
nothing there; an existing DIR is replaced only if this converter wrote it.

Conventions of the conversion (exact up to float32 rounding):
  - Conv kernels OIHW -> HWIO, Linear weights transposed, ConvTranspose (in, out, kh, kw) -> (kh, kw, out, in).
  - fc6 reads torchvision's flattened [C, 7, 7] RoI features, ours flattened [7, 7, C]: its input rows are
    reordered.
  - Box deltas: torchvision's (dx, dy, dw, dh) per anchor (RPN) and per class (box predictor) become our
    (dy, dx, dh, dw), rows of the weights and biases permuted in each group of 4. The anchors of a cell come in
    torchvision's aspect-ratio order (0.5, 1, 2), which the preset's `model.anchors.aspect_ratios` keeps.
  - Batch norm y = (x - mean) * gamma / sqrt(var + eps_tv) + beta is folded into an affine map stored in our
    batch norm with zero mean and unit (var + eps): our epsilon (backbone.BN_EPSILON) then changes nothing.
    eps_tv: 1e-5 (nn.BatchNorm2d) when the state dict has num_batches_tracked keys; without them it comes
    from FrozenBatchNorm2d, which torchvision runs with eps 0 for its released COCO weights (overwrite_eps in
    torchvision/models/detection/mask_rcnn.py); a model trained with FrozenBatchNorm2d's own default needs
    --bn_eps 1e-5. num_batches_tracked values are not used.
"""

import argparse
import collections
import dataclasses
import io
import math
import os
import pickle
import re
import sys
import zipfile
import zlib

import numpy as np

from mrcnn_tf2 import files, presets, status
from mrcnn_tf2.cli import import_tensorflow
from mrcnn_tf2.config import Config, ConfigError

# TensorFlow and the model are imported inside the functions that use them, so that --help answers at once;
# main() starts TensorFlow first, as main.py does (import_tensorflow).

PRESET = "torchvision"
CONVERSION_FILE = "conversion.json"
# nn.BatchNorm2d's eps (torchvision builds maskrcnn_resnet50_fpn with it when no pretrained weights are given).
TORCH_BATCH_NORM_EPS = 1e-5
# torchvision's MaskRCNNHeads: four 3x3 convs (our MaskHead's default num_convs).
MASK_HEAD_CONVS = 4
# Side of the zero images that create the model's variables before they are assigned (2**max_level of the
# preset: the smallest input whose FPN levels all exist).
BUILD_SIDE = 64

# -- reading torch.save files without torch -------------------------------------------------------------------

# torch.save's legacy (non-zip) format starts with this magic number and protocol version, each pickled.
LEGACY_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL_VERSION = 1001
# The storage classes a state dict's tensors are pickled with (`torch.<Name>`) and their element types.
# bfloat16 has no NumPy type: its 16-bit patterns are read as uint16 and widened to float32.
STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": np.uint16, "LongStorage": np.int64, "IntStorage": np.int32,
}


# What the unpickler builds. Immutable, without attributes a pickle could set (its BUILD opcode sets the
# attributes of any object it holds): a file cannot alter them, nor the stand-ins shared by every load.
# A storage class `torch.<name>` is a marker of its element type, not callable.
_StorageType = collections.namedtuple("_StorageType", "name dtype")
# A storage the pickle refers to (persistent id): its key in the file, _StorageType and element count.
_Storage = collections.namedtuple("_Storage", "key storage_type numel")
# A tensor as the pickle rebuilds it: a strided view of a storage, read once the whole pickle is checked.
# Its fields are whatever the file passed: `_strided_copy` checks them.
_TensorView = collections.namedtuple("_TensorView", "storage offset size stride")


class _TensorRebuilder:
    """Stands in for torch._utils._rebuild_tensor and _rebuild_tensor_v2 (whose further arguments,
    requires_grad, backward hooks and metadata, mean nothing without torch)."""

    __slots__ = ()

    def __call__(self, storage, storage_offset, size, stride, *unused):
        return _TensorView(storage, storage_offset, size, stride)


# The only globals a state dict's pickle needs; anything else it names is refused.
ALLOWED_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _TensorRebuilder(),
    ("torch._utils", "_rebuild_tensor"): _TensorRebuilder(),
    ("collections", "OrderedDict"): collections.OrderedDict,
    **{("torch", name): _StorageType(name, np.dtype(dtype)) for name, dtype in STORAGE_DTYPES.items()},
}


class RefusedGlobal(ValueError):
    """The pickle names a global outside ALLOWED_GLOBALS."""


class _StateDictUnpickler(pickle.Unpickler):
    """Unpickles a state dict into `_TensorView`s, calling no code but ALLOWED_GLOBALS' stand-ins.

    `storages` collects the storages the pickle refers to, by key. Legacy files give persistent ids of six
    fields (the last, a storage view, always None since PyTorch 0.4), zip files of five.
    """

    def __init__(self, file, path):
        super().__init__(file)
        self.path = path
        self.storages = {}

    def find_class(self, module, name):
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise RefusedGlobal(
                f"{self.path}: refused to load {module}.{name}: a state dict holds only tensors and dicts, and "
                "any other object a pickle names could run code on loading"
            ) from None

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and _is_int(pid[4])
                and pid[4] >= 0 and (len(pid) == 5 or pid[5] is None)):
            raise pickle.UnpicklingError(f"unsupported persistent id {str(pid)[:100]}")
        storage = _Storage(pid[2], pid[1], pid[4])
        known = self.storages.setdefault(storage.key, storage)
        if known != storage:
            raise pickle.UnpicklingError(f"storage {storage.key} is declared twice, differently")
        return known


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _unpickle(unpickler):
    """unpickler.load(), any failure but a refusal turned into a ValueError naming the file."""
    try:
        return unpickler.load()
    except RefusedGlobal:
        raise
    # A damaged or hostile pickle fails in many ways (UnpicklingError, EOFError, TypeError from a stand-in
    # called with the wrong arguments, ...): all mean the same here.
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"{unpickler.path}: cannot unpickle it ({type(err).__name__}: {err})") from None


def _tensor_views(obj, path):
    """{key: _TensorView} of an unpickled state dict; raises ValueError naming the file if it is not one."""
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: holds a {type(obj).__name__}, not a state dict (a dict of tensors)")
    bad = [key for key, value in obj.items() if not (isinstance(key, str) and isinstance(value, _TensorView))]
    if bad:
        nested = [key for key in bad if isinstance(obj[key], dict)]
        hint = (f"; a training checkpoint? save its state dict alone, e.g. torch.save(checkpoint[{nested[0]!r}])"
                if nested else "")
        raise ValueError(f"{path}: not a state dict: {len(bad)} entries are not tensors "
                         f"({', '.join(map(repr, bad[:5]))}){hint}")
    return obj


def _strided_copy(data, view, key, path):
    """The tensor `view` of the 1-D storage array `data` (storage offset, size and stride honoured), copied.

    Raises ValueError naming `key` when the view is malformed or reaches outside the storage.
    """
    size, stride, offset = view.size, view.stride, view.offset
    if not (isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride) and _is_int(offset)
            and offset >= 0 and all(_is_int(n) and n >= 0 for n in size + stride)):
        raise ValueError(f"{path}: tensor {key} has a malformed view (offset {offset!r}, size {size!r}, "
                         f"stride {stride!r})")
    if 0 in size:
        return np.zeros(size, data.dtype)
    # A state dict's tensor never has more elements than its storage (a stride-0 view that would is refused
    # rather than expanded into a copy of any size the file asks for).
    if math.prod(size) > data.size:
        raise ValueError(f"{path}: tensor {key} of size {size} has more elements than its storage ({data.size})")
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= data.size:
        raise ValueError(f"{path}: tensor {key} reaches element {last} of a storage of {data.size} elements")
    strides = tuple(s * data.itemsize for s in stride)
    return np.lib.stride_tricks.as_strided(data[offset:], shape=size, strides=strides, writeable=False).copy()


def _materialize(views, storage_bytes, byteorder, path):
    """{key: np.ndarray} of the checked `views`; storage_bytes(_Storage) -> its raw bytes in the file."""
    arrays, storages = {}, {}
    for key, view in views.items():
        storage = view.storage
        if not isinstance(storage, _Storage):
            raise ValueError(f"{path}: tensor {key} has no storage")
        if storage.key not in storages:
            dtype = storage.storage_type.dtype.newbyteorder(byteorder)
            raw = storage_bytes(storage)
            if len(raw) != storage.numel * dtype.itemsize:
                raise ValueError(f"{path}: storage {storage.key} holds {len(raw)} bytes, its tensors need "
                                 f"{storage.numel * dtype.itemsize}")
            storages[storage.key] = np.frombuffer(raw, dtype).astype(dtype.newbyteorder("="))
        array = _strided_copy(storages[storage.key], view, key, path)
        if storage.storage_type.name == "BFloat16Storage":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        arrays[key] = array
    return arrays


def _read_torch_zip(path, archive):
    """The state dict of a zip-format torch.save file: <name>/data.pkl, its storages <name>/data/<key>."""
    names = set(archive.namelist())
    pickles = [name for name in names if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise ValueError(f"{path}: a zip archive, but not one torch.save wrote (no <name>/data.pkl)")
    prefix = pickles[0][:-len("data.pkl")]
    byteorder = "<"
    if f"{prefix}byteorder" in names:
        byteorder = {b"little": "<", b"big": ">"}.get(archive.read(f"{prefix}byteorder").strip())
        if byteorder is None:
            raise ValueError(f"{path}: unknown byte order in {prefix}byteorder")
    unpickler = _StateDictUnpickler(io.BytesIO(archive.read(pickles[0])), path)
    views = _tensor_views(_unpickle(unpickler), path)

    def storage_bytes(storage):
        name = f"{prefix}data/{storage.key}"
        if name not in names:
            raise ValueError(f"{path}: storage {name} is missing from the archive")
        return archive.read(name)

    return _materialize(views, storage_bytes, byteorder, path)


def _read_torch_legacy(path, f):
    """The state dict of a legacy torch.save file: pickles of the magic number, protocol version, system
    info, the state dict and its storage keys; then each storage as an int64 element count and its bytes."""
    header = [_unpickle(_StateDictUnpickler(f, path)) for _ in range(3)]
    if header[0] != LEGACY_MAGIC_NUMBER or header[1] != LEGACY_PROTOCOL_VERSION or not isinstance(header[2], dict):
        raise ValueError(f"{path}: a pickle, but not a file torch.save wrote (no torch.save header)")
    byteorder = "<" if header[2].get("little_endian", True) else ">"
    unpickler = _StateDictUnpickler(f, path)
    views = _tensor_views(_unpickle(unpickler), path)
    keys = _unpickle(_StateDictUnpickler(f, path))
    if not (isinstance(keys, list) and all(isinstance(key, str) for key in keys)):
        raise ValueError(f"{path}: malformed list of storage keys")
    data = {}
    for key in keys:
        storage = unpickler.storages.get(key)
        if storage is None:
            raise ValueError(f"{path}: storage {key} is listed but no tensor refers to it")
        count = np.frombuffer(f.read(8), np.dtype(np.int64).newbyteorder(byteorder))
        nbytes = storage.numel * storage.storage_type.dtype.itemsize
        if count.size != 1 or count[0] != storage.numel:
            raise ValueError(f"{path}: storage {key} is truncated or does not match its tensors")
        data[key] = f.read(nbytes)
        if len(data[key]) != nbytes:
            raise ValueError(f"{path}: truncated file (storage {key})")

    def storage_bytes(storage):
        if storage.key not in data:
            raise ValueError(f"{path}: storage {storage.key} is missing from the file")
        return data[storage.key]

    return _materialize(views, storage_bytes, byteorder, path)


def _read_npz(path):
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {key: np.asarray(npz[key]) for key in npz.files}
    except ValueError as err:  # object arrays (they would need pickle), malformed .npy headers
        raise ValueError(f"{path}: cannot read it as an .npz of arrays ({err})") from None


def read_state_dict(path):
    """{key: np.ndarray} of a state dict file, without torch and without running code from the file.

    Args:
      path: a torch.save file of a dict of tensors (zip or legacy format), or an .npz.

    Returns:
      The arrays as stored (float16/32/64, int32/64; bfloat16 widened to float32), copies owning their data.

    Raises:
      ValueError naming `path`: missing, truncated or corrupt, not a dict of tensors, or its pickle names a
      global other than ALLOWED_GLOBALS (e.g. `os.system`: refused before anything is called).
    """
    if not os.path.isfile(path):
        raise ValueError(f"--input {path}: no such file")
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                if all(name.endswith(".npy") for name in archive.namelist()):
                    return _read_npz(path)
                return _read_torch_zip(path, archive)
        with open(path, "rb") as f:
            head = f.read(4)
            if head.startswith(b"PK\x03\x04"):
                raise ValueError(f"{path}: a truncated or corrupt zip archive (no central directory)")
            if head[:1] == pickle.PROTO:
                f.seek(0)
                return _read_torch_legacy(path, f)
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as err:
        raise ValueError(f"{path}: cannot read it: truncated or corrupt ({err})") from None
    raise ValueError(f"{path}: neither a torch.save file (zip or legacy pickle) nor an .npz")


# -- the torchvision model's keys ------------------------------------------------------------------------------

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

CONV_BN, CONV, DENSE, DECONV = "conv_bn", "conv", "dense", "deconv"


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

    kind: CONV_BN (conv without bias + batch norm), CONV (with bias), DENSE (Linear), DECONV (ConvTranspose2d).
    key: torchvision's prefix of KEY.weight (and KEY.bias).
    shape: torchvision's shape of KEY.weight.
    target: attribute path of our layer in MaskRCNN: names and list indices / dict keys, e.g.
      ("backbone", "groups", 0, 1, "convs", 2).
    bn_key: CONV_BN: torchvision's prefix of the batch norm.
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
        if self.kind == CONV_BN:
            return {f"{self.key}.weight": self.shape,
                    **{f"{self.bn_key}.{name}": self.shape[:1] for name in BN_PARAMETERS}}
        outputs = self.shape[1] if self.kind == DECONV else self.shape[0]
        return {f"{self.key}.weight": self.shape, f"{self.key}.bias": (outputs,)}


def torchvision_layout(config):
    """The Entries of torchvision's Mask R-CNN for `config` (the preset, with its number of classes and ResNet
    depth), in state-dict order."""
    from mrcnn_tf2.model.backbone import (BLOCKS_PER_GROUP, BOTTLENECK_DEPTHS, BOTTLENECK_EXPANSION, GROUP_FILTERS,
                                          STEM_FILTERS)
    from mrcnn_tf2.model.factory import BOX_ROI_SIZE

    model = config.model
    depth = int(model.backbone.removeprefix("resnet"))
    expansion = BOTTLENECK_EXPANSION if depth in BOTTLENECK_DEPTHS else 1
    width, classes, anchors = model.fpn_num_filters, model.num_classes, model.num_anchors
    entries = [Entry(CONV_BN, "backbone.body.conv1", (STEM_FILTERS, 3, 7, 7), ("backbone", "stem"),
                     bn_key="backbone.body.bn1")]
    in_channels = STEM_FILTERS
    for group, (num_blocks, filters) in enumerate(zip(BLOCKS_PER_GROUP[depth], GROUP_FILTERS)):
        out_channels = filters * expansion
        for block in range(num_blocks):
            prefix, target = f"backbone.body.layer{group + 1}.{block}", ("backbone", "groups", group, block)
            block_in = in_channels if block == 0 else out_channels
            if expansion == 1:  # BasicBlock
                shapes = ((filters, block_in, 3, 3), (filters, filters, 3, 3))
            else:  # Bottleneck
                shapes = ((filters, block_in, 1, 1), (filters, filters, 3, 3), (out_channels, filters, 1, 1))
            entries += [Entry(CONV_BN, f"{prefix}.conv{i}", shape, target + ("convs", i - 1), bn_key=f"{prefix}.bn{i}")
                        for i, shape in enumerate(shapes, 1)]
            # A projection where the block changes the stride or the width (not ResNet-18/34's first block).
            if block == 0 and (group > 0 or in_channels != out_channels):
                entries.append(Entry(CONV_BN, f"{prefix}.downsample.0", (out_channels, in_channels, 1, 1),
                                     target + ("shortcut",), bn_key=f"{prefix}.downsample.1"))
        in_channels = out_channels
    # FPN blocks i = 0..3 serve ResNet's layer1..layer4, our levels 2..5.
    for i, filters in enumerate(GROUP_FILTERS):
        entries += [
            Entry(CONV, f"backbone.fpn.inner_blocks.{i}.0", (width, filters * expansion, 1, 1),
                  ("fpn", "lateral", i + 2)),
            Entry(CONV, f"backbone.fpn.layer_blocks.{i}.0", (width, width, 3, 3), ("fpn", "output_convs", i + 2)),
        ]
    hidden, mask_width = model.fast_rcnn_mlp_head_dim, model.mrcnn_head_num_filters
    entries += [
        Entry(CONV, "rpn.head.conv.0.0", (width, width, 3, 3), ("rpn_head", "conv")),
        Entry(CONV, "rpn.head.cls_logits", (anchors, width, 1, 1), ("rpn_head", "score_conv")),
        Entry(CONV, "rpn.head.bbox_pred", (4 * anchors, width, 1, 1), ("rpn_head", "box_conv"), swap_xy=True),
        Entry(DENSE, "roi_heads.box_head.fc6", (hidden, width * BOX_ROI_SIZE ** 2), ("box_head", "fc6"),
              chw_input=(width, BOX_ROI_SIZE, BOX_ROI_SIZE)),
        Entry(DENSE, "roi_heads.box_head.fc7", (hidden, hidden), ("box_head", "fc7")),
        Entry(DENSE, "roi_heads.box_predictor.cls_score", (classes, hidden), ("box_head", "class_dense")),
        Entry(DENSE, "roi_heads.box_predictor.bbox_pred", (4 * classes, hidden), ("box_head", "box_dense"),
              swap_xy=True),
    ]
    entries += [Entry(CONV, f"roi_heads.mask_head.{i}.0", (mask_width, width if i == 0 else mask_width, 3, 3),
                      ("mask_head", "convs", i)) for i in range(MASK_HEAD_CONVS)]
    entries += [
        Entry(DECONV, "roi_heads.mask_predictor.conv5_mask", (mask_width, mask_width, 2, 2), ("mask_head", "deconv")),
        Entry(CONV, "roi_heads.mask_predictor.mask_fcn_logits", (classes, mask_width, 1, 1), ("mask_head", "logits")),
    ]
    return entries


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
    counters = {f"{entry.bn_key}.{BN_COUNTER}" for entry in entries if entry.kind == CONV_BN}
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
    norms = [entry.bn_key for entry in entries if entry.kind == CONV_BN]
    counted = [key for key in norms if f"{key}.{BN_COUNTER}" in tensors]
    if len(counted) == len(norms):
        return TORCH_BATCH_NORM_EPS, f"{BN_COUNTER} keys: nn.BatchNorm2d, whose eps is 1e-5"
    if not counted:
        return 0.0, (f"no {BN_COUNTER} keys: FrozenBatchNorm2d, run with eps 0 as torchvision's released COCO "
                     "weights are; pass --bn_eps 1e-5 for a model trained with FrozenBatchNorm2d's default eps")
    raise ValueError(f"{path}: {len(counted)} of {len(norms)} batch norms have {BN_COUNTER} keys: their eps is "
                     "ambiguous; pass --bn_eps")


# -- the conversion -------------------------------------------------------------------------------------------


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
    if entry.kind == CONV_BN:
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
    degenerate = [f"{entry.bn_key}.running_var" for entry in entries if entry.kind == CONV_BN
                  and not np.all(tensors[f"{entry.bn_key}.running_var"].astype(np.float64) + eps > 0)]
    if degenerate:
        raise ValueError(f"{path}: running_var + eps {eps:g} is not positive in {', '.join(degenerate)}; "
                         "pass a larger --bn_eps")
    return [(entry, convert_entry(entry, tensors, eps)) for entry in entries]


def _resolve(obj, attributes):
    """obj.a[i].b ... for attributes ('a', i, 'b', ...): names are attributes, others list indices or dict keys."""
    for attribute in attributes:
        obj = getattr(obj, attribute) if isinstance(attribute, str) else obj[attribute]
    return obj


def torchvision_config(num_classes, depth, output_dir):
    """Config() with the torchvision preset, `num_classes` and ResNet `depth`: what the model directory's
    config.json holds."""
    config = Config()
    for key, value in presets.values(PRESET).items():
        config.set(key, value)
    config.set("model.num_classes", num_classes)
    config.set("model.backbone", f"resnet{depth}")
    config.set("runtime.model_dir", output_dir)
    config.validate()
    return config


def build_model_variables(config):
    """build_model(config, export=True) (pure TF ops) with every variable created, by running its learned
    layers once on zeros."""
    import tensorflow as tf

    from mrcnn_tf2.model.factory import BOX_ROI_SIZE, MASK_ROI_SIZE, build_model

    model = build_model(config, export=True)
    width = config.model.fpn_num_filters
    features = model.fpn(model.backbone(tf.zeros([1, BUILD_SIDE, BUILD_SIDE, 3]), training=False), training=False)
    model.rpn_head(features)
    model.box_head(tf.zeros([1, 1, BOX_ROI_SIZE, BOX_ROI_SIZE, width]))
    model.mask_head((tf.zeros([1, 1, MASK_ROI_SIZE, MASK_ROI_SIZE, width]), tf.zeros([1, 1], tf.int32)))
    return model


def assign_weights(model, converted):
    """Assigns `convert_all`'s values to `model`'s variables.

    Raises RuntimeError when a value does not fit its variable or a variable of the model gets no value: the
    layout and the model disagree (a bug, not bad input).
    """
    assigned = set()
    for entry, values in converted:
        layer = _resolve(model, entry.target)
        for attributes, value in values:
            variable = _resolve(layer, attributes)
            if tuple(variable.shape) != value.shape:
                raise RuntimeError(f"{entry.key}: converted to {value.shape}, but {variable.path} is "
                                   f"{tuple(variable.shape)}")
            variable.assign(value)
            assigned.add(id(variable))
    left = [variable.path for variable in model.weights if id(variable) not in assigned]
    if left:
        raise RuntimeError(f"no torchvision weights for {len(left)} variables of the model: {', '.join(left)}")


def write_model_dir(model, config, output_dir, metadata):
    """Writes output_dir as training would (checkpoint ckpt-0 of model and step 0, config.json) plus
    conversion.json (`metadata`), under a temporary name renamed at the end (an existing output_dir is
    replaced). Raises RuntimeError when the checkpoint would miss some of the model's variables."""
    import tensorflow as tf

    output_dir = os.path.abspath(output_dir)
    os.makedirs(os.path.dirname(output_dir), exist_ok=True)
    with files.atomic_path(output_dir) as temporary:
        checkpoint = tf.train.Checkpoint(model=model, step=tf.Variable(0, dtype=tf.int64, trainable=False))
        prefix = tf.train.CheckpointManager(checkpoint, temporary, max_to_keep=1).save(checkpoint_number=0)
        # TF's checkpoints follow its object graph, not Keras' layer tracking: check nothing was left out.
        saved = [name for name, _ in tf.train.list_variables(prefix) if name.startswith("model/")]
        expected = len({id(variable) for variable in model.weights})
        if len(saved) != expected:
            raise RuntimeError(f"the checkpoint holds {len(saved)} of the model's {expected} variables")
        config.save(temporary)
        files.write_json(os.path.join(temporary, CONVERSION_FILE), metadata, indent=2)


def check_output_dir(output_dir):
    """Raises ValueError unless output_dir may be written: absent, empty, or written by this converter."""
    if os.path.lexists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"--output_dir {output_dir}: exists and is not a directory")
    if (os.path.isdir(output_dir) and os.listdir(output_dir)
            and not os.path.isfile(os.path.join(output_dir, CONVERSION_FILE))):
        raise ValueError(f"--output_dir {output_dir}: not empty and not written by this converter (it would be "
                         "replaced); choose another directory")


def convert_file(path, output_dir, bn_eps=None):
    """Converts the torchvision Mask R-CNN state dict at `path` into the model directory `output_dir`.

    Args:
      path: .pth (torch.save of the state dict) or .npz with its keys.
      output_dir: the model directory to write (see the module docstring).
      bn_eps: eps of torchvision's batch norms; None: by the num_batches_tracked rule.

    Returns:
      The metadata written to conversion.json: source, num_classes, tensors (converted), ignored
      (num_batches_tracked), bn_eps and bn_eps_rule.

    Raises:
      ValueError naming the file or flag on bad input (nothing is written then); RuntimeError when the model
      and the layout disagree.
    """
    if bn_eps is not None and not (np.isfinite(bn_eps) and bn_eps >= 0):
        raise ValueError(f"--bn_eps {bn_eps}: must be a finite number >= 0")
    check_output_dir(output_dir)
    tensors, original = current_spellings(read_state_dict(path), path)
    num_classes, depth = check_is_mask_rcnn(tensors, path)
    try:
        config = torchvision_config(num_classes, depth, output_dir)
    except ConfigError as err:  # e.g. fewer than 2 classes
        raise ValueError(f"{path}: {err}") from None
    entries = torchvision_layout(config)
    check_tensors(tensors, entries, path, original)
    eps, rule = choose_bn_eps(tensors, entries, path, bn_eps)
    converted = convert_all(tensors, entries, eps, path)
    model = build_model_variables(config)
    assign_weights(model, converted)
    used = sum(len(entry.torch_shapes()) for entry in entries)
    metadata = {"source": os.path.basename(path), "num_classes": config.model.num_classes,
                "backbone": config.model.backbone, "tensors": used,
                "ignored": len(tensors) - used, "bn_eps": eps, "bn_eps_rule": rule}
    write_model_dir(model, config, output_dir, metadata)
    return metadata


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True,
                        help="torch.save(model.state_dict()) of a torchvision Mask R-CNN (.pth), or an .npz of its keys")
    parser.add_argument("--output_dir", required=True,
                        help="model directory to write (checkpoint, config.json), for main.py --model_dir")
    parser.add_argument("--bn_eps", type=float, default=None,
                        help="eps of the model's batch norms (default: 1e-5 with num_batches_tracked keys, else 0 "
                             "as torchvision's released COCO weights)")
    return parser


def main(argv=None):
    """Command-line entry; returns the exit status (`mrcnn_tf2.status`): OK, BAD_INPUT when the file cannot be
    converted (nothing is written), FAILURE when the model would not take every weight."""
    args = build_parser().parse_args(argv)
    import_tensorflow()
    try:
        metadata = convert_file(args.input, args.output_dir, args.bn_eps)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return status.BAD_INPUT
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return status.FAILURE
    print(f"batch norm eps {metadata['bn_eps']:g} ({metadata['bn_eps_rule']})")
    print(f"wrote {args.output_dir}: {metadata['tensors']} tensors converted ({metadata['ignored']} "
          f"{BN_COUNTER} ignored), {metadata['num_classes']} classes, from {metadata['source']}")
    return status.OK


if __name__ == "__main__":
    sys.exit(main())
