"""Fashion-MNIST from IDX files: Debian's ``dataset-fashion-mnist``, a given folder, or torchvision's download.

IDX files (plain or gzip) are read with numpy; a damaged one is one line naming it. What a small file may
make the reader allocate is bounded first: a plain file's size must be what its header implies; a gzip file
may not claim more than :data:`MAX_RATIO` times its own size and is inflated in chunks up to its header's.
"""

from __future__ import annotations

import gzip
import logging
import math
import os
import zlib
from pathlib import Path

import numpy as np
import torchvision

from repmlp.data.inputs import InputError, not_regular
from repmlp.errors import UserError, first_line

__all__ = ["load_fashion_mnist", "find_fashion_mnist", "read_idx", "DEBIAN_DIR", "CLASSES"]

log = logging.getLogger(__name__)

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
           "Ankle boot"]  # fmt: skip
_FILES = {True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}  # fmt: skip
# After a failed download, "add --download" would send the user round in a circle: the other two ways.
HOW_TO_GET_OFFLINE = (
    "install Debian's package (sudo apt-get install dataset-fashion-mnist, or bash scripts/setup.sh) "
    "or pass --data-dir DIR with the four IDX files"
)
HOW_TO_GET = f"{HOW_TO_GET_OFFLINE}, or add --download to fetch them with torchvision"
# IDX type codes (third magic byte) -> big-endian numpy dtypes.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
MAX_BYTES = 4 << 30  # the most data an IDX file may hold (far above Fashion-MNIST's)
# A gzip file may inflate to MAX_RATIO times its size, or to _SMALL bytes (blank images compress far better).
MAX_RATIO, _SMALL, _CHUNK = 64, 64 << 20, 16 << 20


def default_cache_dir() -> Path:
    """Where ``--download`` puts the data when no ``--data-dir`` is given."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "repmlp" / "data"


def _find_file(folder: Path, stem: str) -> Path | None:
    """The IDX file ``stem`` (``.gz`` or not) in ``folder``; one there but not a regular file (a FIFO would
    block the reader) is a :class:`UserError` naming it."""
    for name in (stem + ".gz", stem, stem.replace("-idx", ".idx")):
        kind = not_regular(folder / name)
        if kind is None:
            return folder / name
        if kind not in ("missing", "a folder"):
            raise UserError(f"{folder / name} is {kind}, not a regular file")
    return None


def _complete(folder: Path) -> bool:
    return all(_find_file(folder, stem) for pair in _FILES.values() for stem in pair)


def find_fashion_mnist(data_dir: str | os.PathLike | None, download: bool = False) -> Path:
    """The folder holding the four IDX files: ``data_dir`` or its ``FashionMNIST/raw`` (torchvision's
    layout); without ``data_dir``, Debian's folder then the download cache, else torchvision's download."""
    if data_dir is not None:
        roots = [Path(data_dir)]
        if not roots[0].exists() and not download:
            raise UserError(f"data folder not found: {roots[0]} ({HOW_TO_GET})")
    else:
        roots = [DEBIAN_DIR, default_cache_dir()]
    for root in roots:
        for folder in (root, root / "FashionMNIST" / "raw"):
            if folder.is_dir() and _complete(folder):
                return folder
    if download or data_dir is None:
        if not download:
            log.info("Fashion-MNIST not installed in %s; trying torchvision's downloader", DEBIAN_DIR)
        return _download(roots[-1])
    raise UserError(f"no Fashion-MNIST IDX files in {roots[0]} ({HOW_TO_GET})")


def _download(root: Path) -> Path:
    try:
        for train in (True, False):
            torchvision.datasets.FashionMNIST(str(root), train=train, download=True)
    except Exception as exc:  # noqa: BLE001 - network, disk: all end the same way for the user
        raise UserError(f"Fashion-MNIST is not installed and the download into {root} failed "
                        f"({first_line(exc)}); {HOW_TO_GET_OFFLINE}") from None  # fmt: skip
    folder = root / "FashionMNIST" / "raw"
    if not _complete(folder):
        raise UserError(f"torchvision's download left no IDX files in {folder}; {HOW_TO_GET_OFFLINE}")
    return folder


def load_fashion_mnist(folder: Path, train: bool) -> tuple[np.ndarray, np.ndarray]:
    """Images ``(N, 1, 28, 28)`` uint8 and labels ``(N,)`` int64 of one split; labels must be integers in
    ``0..9`` (an IDX file may hold -1, NaN or 2.5), else a :class:`UserError` naming the file."""
    img_stem, lbl_stem = _FILES[train]
    image_file, label_file = _find_file(folder, img_stem), _find_file(folder, lbl_stem)
    images = read_idx(image_file)
    if images.dtype != np.uint8:
        raise UserError(f"{image_file} holds {images.dtype} values, not Fashion-MNIST's uint8 pixels")
    labels = read_idx(label_file)
    if labels.dtype.kind not in "iu":
        raise UserError(f"{label_file} holds {labels.dtype} labels, not Fashion-MNIST's integer classes 0..9")
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise UserError(
            f"Fashion-MNIST files in {folder} do not match (images {images.shape}, labels {labels.shape})"
        )
    if len(labels) == 0:
        raise UserError(f"{label_file} holds no examples: the {'training' if train else 'test'} set is empty")
    if images.shape[1:] != (28, 28):
        raise UserError(
            f"{image_file} holds {images.shape[1]}x{images.shape[2]} images, not Fashion-MNIST's 28x28"
        )
    outside = (labels < 0) | (labels >= len(CLASSES))
    if outside.any():
        index = int(np.argmax(outside))
        raise UserError(
            f"{label_file}: label {index} is {labels[index]}, outside Fashion-MNIST's classes 0..9"
        )
    return images[:, None], labels.astype(np.int64)


def _read_exactly(f, n: int, path: Path, what: str) -> bytearray:  # noqa: ANN001 - a binary file object
    """``n`` bytes of ``f`` in chunks: memory grows with the data there, not with what the header claims."""
    data = bytearray()
    while len(data) < n:
        chunk = f.read(min(_CHUNK, n - len(data)))
        if not chunk:
            raise UserError(
                f"{path} is truncated or malformed ({len(data)} {what} bytes, the header says {n})"
            )
        data += chunk
    return data


def _check_size(path: Path, f, header: int, need: int, shape: str) -> None:  # noqa: ANN001 - file object
    """Refuse a header whose ``need`` data bytes the file cannot hold (a plain file of another size, a gzip
    file that would inflate more than :data:`MAX_RATIO` times), before reading the data."""
    size = os.fstat((f.fileobj if isinstance(f, gzip.GzipFile) else f).fileno()).st_size
    if not isinstance(f, gzip.GzipFile) and size != header + need:
        raise UserError(f"{path} is truncated or malformed: its header claims a {shape} array ({need} bytes), "
                        f"the file holds {size - header} bytes of data")  # fmt: skip
    if isinstance(f, gzip.GzipFile) and need > max(_SMALL, MAX_RATIO * size):
        raise UserError(f"{path}: its header claims a {shape} array ({need} bytes), more than {MAX_RATIO} times "
                        f"the {size}-byte compressed file (a decompression bomb?)")  # fmt: skip


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """An IDX file (``.gz`` or not) as an array of its header's shape; :class:`UserError` for a file that
    is not IDX, is truncated or corrupt, or too large."""
    path = Path(path)
    if (kind := not_regular(path)) is not None:
        raise InputError(f"cannot read {path}: it is {kind}, not a regular file")
    try:
        with (
            open(path, "rb") as raw,
            gzip.GzipFile(fileobj=raw, mode="rb") if path.suffix == ".gz" else raw as f,
        ):
            magic = f.read(4)
            if len(magic) < 4 or magic[0] != 0 or magic[1] != 0 or magic[2] not in _IDX_DTYPES:
                raise UserError(f"{path} is not an IDX file (bad magic number)")
            if (ndim := magic[3]) == 0:
                raise UserError(f"{path} is not an IDX file (bad header: no dimensions)")
            dims = tuple(int(d) for d in np.frombuffer(_read_exactly(f, 4 * ndim, path, "header"), ">u4"))
            dtype = np.dtype(_IDX_DTYPES[magic[2]])
            need, shape = math.prod(dims) * dtype.itemsize, "x".join(map(str, dims))
            if need > MAX_BYTES:
                raise UserError(
                    f"{path}: its header claims a {shape} array ({need} bytes), more than the limit"
                )
            _check_size(path, f, 4 + 4 * ndim, need, shape)
            data = _read_exactly(f, need, path, "data")
            if f.read(1):
                raise UserError(f"{path} is malformed (data beyond the {need} bytes its header gives)")
    except (OSError, EOFError, zlib.error) as exc:
        # gzip.BadGzipFile is an OSError; a corrupt deflate stream is a zlib.error; a cut one EOFError.
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise UserError(f"cannot read {path}: {reason} (corrupt or truncated?)") from None
    # uint8 data is used as read (no copy); wider types become native byte order.
    return np.frombuffer(data, dtype).reshape(dims).astype(dtype.newbyteorder("="), copy=False)
