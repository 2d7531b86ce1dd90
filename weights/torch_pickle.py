"""Reads a PyTorch state dict file into NumPy arrays without torch and without running code from the file.

    read_state_dict("maskrcnn_resnet50_fpn_coco-bf2d0c1e.pth") -> {"backbone.body.conv1.weight": array, ...}

Formats: torch.save's zip format (PyTorch >= 1.6), its older non-zip ("legacy") format, in which torchvision's
released COCO weights were saved, and an .npz of the same keys. A .pth pickle may name any Python function to
be called on loading: this reader's unpickler builds nothing but NumPy arrays from the file's tensors and
refuses every other global the pickle names, before anything is called. Anything that is not a dict of
tensors is refused with a ValueError naming the file.

This module knows nothing of any model (the converters map the keys) and imports neither torch nor
TensorFlow, so that any converter can read its input with it.
"""

import collections
import io
import math
import os
import pickle
import zipfile
import zlib

import numpy as np

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
      The arrays as stored (float16/32/64, int32/64; bfloat16 widened to float32), copies owning their data,
      in the file's order.

    Raises:
      ValueError naming `path`: missing, truncated or corrupt, not a dict of tensors, or its pickle names a
      global other than ALLOWED_GLOBALS (e.g. `os.system`: refused before anything is called).
    """
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file")
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

