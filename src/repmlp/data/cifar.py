"""CIFAR-10 in torchvision's on-disk layout (``cifar-10-batches-py``), read without running pickled code.

The batches are pickles of ``{"data": uint8 (N, 3072), "labels": [int], ...}``. A restricted unpickler
accepts only what such a batch holds, so a small file can neither run code nor run for minutes or allocate
gigabytes: only the opcodes a batch uses, at most :data:`_MAX_OPS` of them; only numpy's array
reconstruction and a latin-1 ``_codecs.encode`` may be called, with checked arguments; dict keys are a
batch's names, checked before hashing; no nesting beyond a batch's and no memo reference to a container.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np

from repmlp.data.inputs import not_regular, read_bytes
from repmlp.errors import UserError, first_line

__all__ = ["load_cifar10", "find_cifar10"]

FOLDER, NUM_CLASSES = "cifar-10-batches-py", 10
_MAX_BATCH_BYTES = 256 << 20  # above a batch of all 50000 training images
# Far above a batch's opcodes (one per label); each makes at most one object: bounds time and memory.
_MAX_OPS = 2_000_000
_KEYS = frozenset({"batch_label", "labels", "data", "filenames"})  # torchvision's files
# numpy type strings a batch's arrays may have ('u1' pixels, integer labels; floats to name them as such).
_DTYPES = frozenset(f"{k}{n}" for k in "iu" for n in (1, 2, 4, 8)) | {"f4", "f8", "b1"}

try:  # numpy >= 2 (numpy.core is a deprecated alias there)
    from numpy._core.multiarray import _reconstruct
    from numpy._core.numeric import _frombuffer
except ImportError:  # numpy 1.x
    from numpy.core.multiarray import _reconstruct
    from numpy.core.numeric import _frombuffer


def _latin1_bytes(text: str, encoding: str = "utf-8") -> bytes:
    """``_codecs.encode`` limited to what protocol-2 pickles of ``bytes`` need: latin-1 text -> bytes."""
    if not isinstance(text, str) or encoding.lower().replace("-", "") not in ("latin1", "iso88591"):
        raise pickle.UnpicklingError(f"refusing _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


# The only globals a CIFAR batch (pickled by Python 2 numpy or a modern numpy) refers to (nothing is imported
# by a name the file gives).
_GLOBALS: dict[tuple[str, str], object] = {
    **{(f"{core}.multiarray", "_reconstruct"): _reconstruct for core in ("numpy.core", "numpy._core")},
    **{(f"{core}.numeric", "_frombuffer"): _frombuffer for core in ("numpy.core", "numpy._core")},
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_bytes,
}


def _scalar(x: object) -> bool:
    return not isinstance(x, (list, tuple, dict, set, frozenset))


def _check_items(items: list | tuple, inside: str) -> None:
    """Items placed in a list (``inside="list"``) or a tuple: scalars, or in a tuple a tuple of scalars."""
    for x in items:
        if not _scalar(x) and not (inside == "tuple" and isinstance(x, tuple) and all(map(_scalar, x))):
            raise pickle.UnpicklingError(f"a {type(x).__name__} nested in a {inside}")


def _check_pairs(items: list) -> None:
    """Key/value pairs of a dict: a batch's own key names; values scalars, lists or flat tuples."""
    for key, value in zip(items[::2], items[1::2], strict=True):
        if type(key) not in (str, bytes):  # checked before the key is hashed
            raise pickle.UnpicklingError(f"a dict key of type {type(key).__name__}")
        if (key.decode("latin1") if type(key) is bytes else key) not in _KEYS:
            raise pickle.UnpicklingError(f"unexpected key {key[:40]!r}")
        if isinstance(value, (dict, set, frozenset)):
            raise pickle.UnpicklingError(f"a {type(value).__name__} nested in a dict")
        if isinstance(value, tuple):
            _check_items(value, "tuple")


def _check_call(func: Callable, args: object) -> None:
    """REDUCE: only the allowed functions, with the arguments numpy and pickle give them."""
    if type(args) is not tuple:
        raise pickle.UnpicklingError("call arguments that are not a tuple")
    if func is np.dtype:
        spec = args[0] if args else None
        text = spec.decode("latin1") if type(spec) is bytes else spec
        if type(text) is not str or text.lstrip("<>|=") not in _DTYPES:
            raise pickle.UnpicklingError(f"refusing numpy dtype {str(spec)[:20]!r}")
    elif func is _latin1_bytes or func is _frombuffer:
        pass  # bounded by the data they are given (the pickle's own bytes)
    elif func is _reconstruct:
        # numpy pickles an array as _reconstruct(ndarray, (0,), b"b") then sets its state: a larger shape
        # here would allocate an array of that shape before any data was read.
        if len(args) != 3 or args[0] is not np.ndarray or type(args[1]) is not tuple or args[1] != (0,):
            raise pickle.UnpicklingError("numpy _reconstruct with unexpected arguments")
    else:
        raise pickle.UnpicklingError(f"refusing to call {getattr(func, '__name__', type(func).__name__)}")


_Ops = pickle._Unpickler  # the pure-Python unpickler: its opcode table can be restricted and checked


def _target(obj: object, kind: type) -> None:
    """An opcode adds items only to a ``kind`` (the unpickler would call any object's ``append``)."""
    if type(obj) is not kind:
        raise pickle.UnpicklingError(f"adding items to a {type(obj).__name__}")


def _settable(obj: object) -> None:
    """BUILD sets the state of a numpy array or dtype only."""
    if not isinstance(obj, (np.ndarray, np.dtype)):
        raise pickle.UnpicklingError(f"refusing to set the state of a {type(obj).__name__}")


def _unshared(obj: object) -> None:
    """A memo reference (GET) to a scalar only: a shared container could expand to gigabytes."""
    if not _scalar(obj):
        raise pickle.UnpicklingError(f"a shared {type(obj).__name__} (memo reference)")


# Opcodes a batch uses that need no check (their data is read from the file; no call, no hashing).
_PLAIN = """PROTO FRAME STOP MARK NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG LONG1 LONG4 FLOAT
BINFLOAT STRING BINSTRING SHORT_BINSTRING UNICODE BINUNICODE SHORT_BINUNICODE BINUNICODE8 BINBYTES
SHORT_BINBYTES BINBYTES8 BYTEARRAY8 EMPTY_LIST EMPTY_TUPLE EMPTY_DICT GLOBAL STACK_GLOBAL PUT BINPUT
LONG_BINPUT MEMOIZE"""
# Checks of the unpickler's stack before an opcode runs (u.stack: the items since the last mark).
_BEFORE: dict[str, Callable[[_Ops], object]] = {
    "SETITEM": lambda u: (_target(u.stack[-3], dict), _check_pairs(u.stack[-2:])),
    "SETITEMS": lambda u: (_target(u.metastack[-1][-1], dict), _check_pairs(u.stack)),
    "DICT": lambda u: _check_pairs(u.stack),
    "REDUCE": lambda u: _check_call(u.stack[-2], u.stack[-1]),
    "BUILD": lambda u: _settable(u.stack[-2]),
    "APPEND": lambda u: (_target(u.stack[-2], list), _check_items(u.stack[-1:], "list")),
    "APPENDS": lambda u: (_target(u.metastack[-1][-1], list), _check_items(u.stack, "list")),
    "LIST": lambda u: _check_items(u.stack, "list"),
    "TUPLE": lambda u: _check_items(u.stack, "tuple"),
    **{f"TUPLE{n}": lambda u, n=n: _check_items(u.stack[-n:], "tuple") for n in (1, 2, 3)},
}
_AFTER = {name: lambda u: _unshared(u.stack[-1]) for name in ("GET", "BINGET", "LONG_BINGET")}


def _op(name: str) -> Callable[[_Ops], None]:
    """The unpickler's opcode ``name``, counted (:data:`_MAX_OPS`) and checked (:data:`_BEFORE`, :data:`_AFTER`)."""
    load, before, after = _Ops.dispatch[getattr(pickle, name)[0]], _BEFORE.get(name), _AFTER.get(name)

    def op(self: _Ops) -> None:
        self.ops += 1
        if self.ops > _MAX_OPS:
            raise pickle.UnpicklingError(f"more than {_MAX_OPS} pickle opcodes")
        if before:
            before(self)
        load(self)
        if after:
            after(self)

    return op


class _RestrictedUnpickler(_Ops):
    """The pure-Python unpickler with only the opcodes in ``_PLAIN``, ``_BEFORE`` and ``_AFTER`` (any other
    one is a ``KeyError`` naming its byte), and only the globals in ``_GLOBALS``."""

    dispatch = {getattr(pickle, name)[0]: _op(name) for name in [*_PLAIN.split(), *_BEFORE, *_AFTER]}
    ops = 0

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in _GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module[:60]}.{name[:60]}")
        return _GLOBALS[module, name]


def _labels(path: Path, labels: object, n: int) -> np.ndarray:
    """A batch's ``labels`` (``n`` ints in 0..9, or a 1-D integer array) -> ``(n,)`` int64."""
    if isinstance(labels, np.ndarray):
        if labels.dtype.kind not in "iu" or labels.ndim != 1:
            raise UserError(
                f"{path}: 'labels' is a {labels.dtype} array of shape {labels.shape}, not class numbers"
            )
    elif isinstance(labels, list):
        # Python ints only (numpy would truncate floats), one by one: before a huge int reaches numpy.
        bad = next((i for i, v in enumerate(labels) if type(v) is not int or not 0 <= v < NUM_CLASSES), None)
        if bad is not None:
            value = labels[bad]
            kind = "outside 0..9" if type(value) is int else f"a {type(value).__name__}, not a class number"
            raise UserError(f"{path}: label {bad} is {str(value)[:20]}, {kind}")
    else:
        raise UserError(f"{path} is not a CIFAR-10 batch ('labels' is a {type(labels).__name__}, not a list)")
    if len(labels) != n:
        raise UserError(f"{path} is not a CIFAR-10 batch ({len(labels)} labels for {n} images)")
    values = np.asarray(labels, dtype=np.int64)
    if values.min() < 0 or values.max() >= NUM_CLASSES:
        raise UserError(f"{path} has labels outside 0..{NUM_CLASSES - 1}")
    return values


def _load_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch file -> ``(images uint8 (N, 3, 32, 32), labels int64 (N,))``."""
    if not_regular(path) == "missing":
        raise UserError(f"CIFAR-10 batch missing: {path}")
    raw = read_bytes(path, _MAX_BATCH_BYTES, "CIFAR-10 batch")  # regular files only, bounded
    try:
        obj = _RestrictedUnpickler(io.BytesIO(raw), encoding="latin1").load()
    except KeyError as exc:  # an opcode outside the table
        code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
        what = f"pickle opcode {bytes([code])!r}" if code is not None else f"key {first_line(exc)[:60]}"
        raise UserError(f"{path} is not a CIFAR-10 batch (it uses {what}, which a batch does not)") from None
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad file
        reason = first_line(exc)[:200]
        raise UserError(f"{path} is not a CIFAR-10 batch ({type(exc).__name__}: {reason})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} is not a CIFAR-10 batch (not a dict)")
    obj = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}
    data = obj.get("data")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise UserError(f"{path} is not a CIFAR-10 batch ('data' is not a uint8 (N, 3072) array)")
    if len(data) == 0:
        raise UserError(f"{path} holds no examples")
    return data.reshape(-1, 3, 32, 32), _labels(path, obj.get("labels"), len(data))


def find_cifar10(data_dir: str | os.PathLike) -> Path:
    """The ``cifar-10-batches-py`` folder in or at ``data_dir``."""
    root = Path(data_dir)
    for cand in (root / FOLDER, root):
        # not_regular, not is_file: it never raises (is_file does for a name too long)
        if not_regular(cand / "test_batch") is None or not_regular(cand / "data_batch_1") is None:
            return cand
    if not_regular(root) == "missing":
        raise UserError(f"data folder not found: {root}")
    raise UserError(
        f"no CIFAR-10 in {root}: expected torchvision's layout {root / FOLDER}/data_batch_1..5 and test_batch "
        "(torchvision.datasets.CIFAR10(root, download=True) creates it)"
    )


def load_cifar10(data_dir: str | os.PathLike, train: bool) -> tuple[np.ndarray, np.ndarray]:
    """Images ``(N, 3, 32, 32)`` uint8 and labels ``(N,)`` int64 of the train or test split."""
    folder = find_cifar10(data_dir)
    names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
    parts = [_load_batch(folder / name) for name in names]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
