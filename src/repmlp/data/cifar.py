"""CIFAR-10 in torchvision's on-disk layout (``cifar-10-batches-py``), read without running pickled code.

The batches are Python pickles of ``{"data": uint8 array (N, 3072), "labels": [int], ...}``: the one
pickled format this project reads, an exception to "never unpickle" made because it is the data set's own
distribution format. A restricted unpickler allows only the builtin containers, the numpy array
reconstruction functions and a latin-1-only stand-in for ``_codecs.encode`` (how protocol-2 pickles written
by Python 3 spell ``bytes``), so a file that tries to call anything else fails to load instead of executing it.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import numpy as np

from repmlp.data.inputs import not_regular, read_bytes
from repmlp.errors import UserError

__all__ = ["load_cifar10", "find_cifar10"]

TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_FILES = ["test_batch"]
FOLDER = "cifar-10-batches-py"
# A CIFAR-10 batch is 30 MB; anything far larger is not one.
_MAX_BATCH_BYTES = 1 << 30

# The only globals a CIFAR batch (pickled by Python 2 numpy or by a modern numpy) refers to.
_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
}


def _latin1_bytes(text: str, encoding: str = "utf-8") -> bytes:
    """``_codecs.encode`` limited to what protocol-2 pickles of ``bytes`` need: latin-1 text -> bytes."""
    if not isinstance(text, str) or encoding.lower().replace("-", "") not in ("latin1", "iso88591"):
        raise pickle.UnpicklingError(f"refusing _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: ANN201 - pickle API
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if (module, name) == ("_codecs", "encode"):
            return _latin1_bytes
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _load_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch file -> ``(images uint8 (N, 3, 32, 32), labels int64 (N,))``."""
    if not_regular(path) == "missing":
        raise UserError(f"CIFAR-10 batch missing: {path}")
    raw = read_bytes(path, _MAX_BATCH_BYTES, "CIFAR-10 batch")  # regular files only, bounded
    try:
        obj = _RestrictedUnpickler(io.BytesIO(raw), encoding="latin1").load()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad file
        raise UserError(f"{path} is not a CIFAR-10 batch ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} is not a CIFAR-10 batch (not a dict)")
    obj = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}
    data, labels = obj.get("data"), obj.get("labels")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise UserError(f"{path} is not a CIFAR-10 batch ('data' is not a uint8 (N, 3072) array)")
    if not isinstance(labels, (list, np.ndarray)) or len(labels) != len(data):
        raise UserError(f"{path} is not a CIFAR-10 batch ('labels' missing or of the wrong length)")
    if len(data) == 0:
        raise UserError(f"{path} holds no examples")
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise UserError(f"{path} is not a CIFAR-10 batch ('labels' are not integers)") from None
    if labels.ndim != 1 or labels.min() < 0 or labels.max() > 9:
        raise UserError(f"{path} has labels outside 0..9")
    return data.reshape(-1, 3, 32, 32), labels


def find_cifar10(data_dir: str | os.PathLike) -> Path:
    """The ``cifar-10-batches-py`` folder in or at ``data_dir``."""
    root = Path(data_dir)
    for cand in (root / FOLDER, root):
        if (cand / "test_batch").is_file() or (cand / "data_batch_1").is_file():
            return cand
    if not root.exists():
        raise UserError(f"data folder not found: {root}")
    raise UserError(
        f"no CIFAR-10 in {root}: expected torchvision's layout {root / FOLDER}/data_batch_1..5 and test_batch "
        "(torchvision.datasets.CIFAR10(root, download=True) creates it)"
    )


def load_cifar10(data_dir: str | os.PathLike, train: bool) -> tuple[np.ndarray, np.ndarray]:
    """Images ``(N, 3, 32, 32)`` uint8 and labels ``(N,)`` int64 of the train or test split."""
    folder = find_cifar10(data_dir)
    parts = [_load_batch(folder / name) for name in (TRAIN_FILES if train else TEST_FILES)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
