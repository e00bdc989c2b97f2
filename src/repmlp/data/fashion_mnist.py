"""Fashion-MNIST from IDX files: Debian's ``dataset-fashion-mnist``, a given folder, or torchvision's download."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torchvision

from repmlp.data.idx import read_idx
from repmlp.data.inputs import not_regular
from repmlp.errors import UserError, first_line

__all__ = ["load_fashion_mnist", "find_fashion_mnist", "DEBIAN_DIR", "CLASSES"]

log = logging.getLogger(__name__)

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# After a failed download, "add --download" would send the user round in a circle: the other two ways.
HOW_TO_GET_OFFLINE = (
    "install Debian's package (sudo apt-get install dataset-fashion-mnist, or bash scripts/setup.sh) "
    "or pass --data-dir DIR with the four IDX files"
)
HOW_TO_GET = f"{HOW_TO_GET_OFFLINE}, or add --download to fetch them with torchvision"


def default_cache_dir() -> Path:
    """Where ``--download`` puts the data when no ``--data-dir`` is given."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "repmlp" / "data"


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
    """The folder holding the four Fashion-MNIST IDX files.

    Searched: ``data_dir`` and its ``FashionMNIST/raw`` (torchvision's layout); without ``data_dir``,
    Debian's folder then the download cache. With ``download``, torchvision fetches missing files.
    """
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
    if download:
        return _download(roots[-1])
    if data_dir is None:
        # No explicit folder and no Debian package: torchvision's downloader is the documented fallback.
        log.info("Fashion-MNIST not installed in %s; trying torchvision's downloader", DEBIAN_DIR)
        return _download(roots[-1])
    raise UserError(f"no Fashion-MNIST IDX files in {roots[0]} ({HOW_TO_GET})")


def _download(root: Path) -> Path:
    try:
        for train in (True, False):
            torchvision.datasets.FashionMNIST(str(root), train=train, download=True)
    except Exception as exc:  # noqa: BLE001 - network, disk: all end the same way for the user
        msg = first_line(exc)
        raise UserError(
            f"Fashion-MNIST is not installed and the download into {root} failed ({msg}); {HOW_TO_GET_OFFLINE}"
        ) from None
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
