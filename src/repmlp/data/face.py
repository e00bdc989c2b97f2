"""Aligned face crops on disk (paper Sec. 4.3: 96x96 inputs).

Training data: one sub-folder per identity (``root/<identity>/<image>``, as MS1M-style sets unpack).
Verification pairs: LFW's ``pairs.txt`` (header ``<folds> <n>``, then ``name i j`` for a same-identity pair
and ``name1 i name2 j`` for a different one, image ``name/name_<i:04d>.<ext>``) or ``<path1> <path2> <0|1>``
lines (1 = same; paths relative to the image root). Identification: a probe and a gallery identity folder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from repmlp.data.inputs import InputError, not_regular, open_image, read_text
from repmlp.errors import UserError

__all__ = ["IMAGE_EXTENSIONS", "FaceFolder", "ImageList", "face_transform", "read_pairs", "VerificationPairs"]

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp", ".tif", ".tiff")
FACE_SIZE = 96
_MAX_PAIRS_BYTES = 64 << 20  # LFW's pairs.txt is 100 kB
_MAX_NUMBER = 10**6  # an image number (LFW's go to 530) or a count in a pairs file's header


def _is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS and not_regular(path) is None


def face_transform(size: int = FACE_SIZE, *, train: bool) -> Callable[[Image.Image], Tensor]:
    """PIL image -> ``(3, size, size)`` float in ``[-1, 1]`` (usual for face models), flipped at random in
    training; crops are aligned already, so only resized when not ``size`` (MS1M's 112x112 release)."""

    def transform(img: Image.Image) -> Tensor:
        img = img.convert("RGB")
        if img.size != (size, size):
            img = img.resize((size, size), Image.BILINEAR)
        x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).reshape(size, size, 3)
        x = x.permute(2, 0, 1).float().div_(127.5).sub_(1.0)
        if train and torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x

    return transform


class ImageList(Dataset):
    """Images from a list of paths with integer labels; ``(image, label)`` items."""

    def __init__(self, paths: list[Path], labels: list[int], transform: Callable[[Image.Image], Tensor]):
        self.paths, self.labels, self.transform = paths, labels, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        path = self.paths[index]
        try:
            with open_image(path) as img:  # a regular file of bounded size and pixel count
                x = self.transform(img)
        except InputError as exc:
            raise UserError(f"cannot read image {path}: {exc}") from None
        return x, self.labels[index]


class FaceFolder(ImageList):
    """Face crops ``root/<identity>/<image>``; labels follow the sorted folder names (``classes``). A
    :class:`~repmlp.errors.UserError` says why ``root`` is not such a folder; identity folders without images
    are skipped, loose images and special files named in the log."""

    def __init__(self, root: str | Path, transform: Callable[[Image.Image], Tensor] | None = None, *,
                 train: bool = False, size: int = FACE_SIZE) -> None:  # fmt: skip
        root = Path(root)
        if not root.exists():
            raise UserError(f"face image folder {root} does not exist")
        if not root.is_dir():
            raise UserError(f"{root} is not a folder (expected one sub-folder of images per identity)")
        identities = sorted(
            p for p in root.iterdir() if not_regular(p) == "a folder" and not p.name.startswith(".")
        )
        loose = [p.name for p in root.iterdir() if _is_image(p)]
        if not identities:
            raise UserError(f"{root} is not a face image folder: it has no identity sub-folders"
                            f"{f' (it holds {len(loose)} loose images)' if loose else ''}; expected "
                            "root/<identity>/<image>")  # fmt: skip
        paths, labels, classes, empty = [], [], [], []
        for folder in identities:
            entries = sorted(folder.iterdir())
            for p in entries:  # FIFOs, devices, sockets named as images: never opened
                if p.suffix.lower() in IMAGE_EXTENSIONS and (kind := not_regular(p)) not in (
                    None,
                    "a folder",
                ):
                    log.warning("%s: skipped (%s, not a regular file)", p, kind)
            images = [p for p in entries if _is_image(p)]
            if images:
                labels += [len(classes)] * len(images)
                paths += images
                classes.append(folder.name)
            else:
                empty.append(folder.name)
        if not paths:
            raise UserError(f"{root} is not a face image folder: none of its {len(identities)} sub-folders holds "
                            f"images with extension {', '.join(IMAGE_EXTENSIONS)}")  # fmt: skip
        if empty:
            log.warning(
                "%s: %d identity folders without images skipped (e.g. %s)", root, len(empty), empty[0]
            )
        if loose:
            log.warning("%s: %d images outside identity folders ignored", root, len(loose))
        super().__init__(paths, labels, transform or face_transform(size, train=train))
        self.root, self.classes = root, classes

    @property
    def identities(self) -> list[str]:
        """Identity name of every image, in dataset order."""
        return [self.classes[i] for i in self.labels]


@dataclass
class VerificationPairs:
    """Pairs of images to verify: ``first[i]``, ``second[i]`` and whether they share an identity."""

    first: list[Path]
    second: list[Path]
    same: list[bool]
    folds: int | None  # as declared by an LFW header, else None


def _number(token: str, where: str, what: str) -> int:
    """A pairs file's count or image number: ASCII digits up to :data:`_MAX_NUMBER`, else a :class:`UserError`
    at ``where`` (``int`` alone takes Unicode digits and fails on 5000 digits)."""
    if not (token.isascii() and token.isdigit()) or len(token) > 7 or int(token) > _MAX_NUMBER:
        raise UserError(f"{where}: {what} {token[:20]!r} is not a number from 0 to {_MAX_NUMBER}")
    return int(token)


def _lfw_image(root: Path, name: str, number: str, where: str) -> Path:
    stem = root / name / f"{name}_{_number(number, where, 'image number'):04d}"
    for ext in IMAGE_EXTENSIONS:
        if not_regular(stem.with_suffix(ext)) is None:  # never raises (is_file does for a name too long)
            return stem.with_suffix(ext)
    raise UserError(
        f"{where}: names {name[:80]} {number}, but no image {str(stem)[:200]}.<jpg|png|...> exists"
    )


def read_pairs(pairs_file: str | Path, root: str | Path) -> VerificationPairs:
    """Read verification pairs (LFW ``pairs.txt`` or ``path1 path2 same`` lines); see the module doc."""
    pairs_file, root = Path(pairs_file), Path(root)
    if not_regular(pairs_file) == "missing":
        raise UserError(f"pairs file {pairs_file} does not exist")
    text = read_text(pairs_file, _MAX_PAIRS_BYTES, "pairs file")  # a regular file, bounded
    lines = [ln.split() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    if not lines:
        raise UserError(f"pairs file {pairs_file} is empty")
    folds = None
    lfw = len(lines[0]) == 2 and all(t.isdigit() for t in lines[0])  # LFW's header: "<folds> <n>"
    if lfw:
        folds = _number(lines[0][0], f"{pairs_file}:1", "the number of folds")
        _number(lines[0][1], f"{pairs_file}:1", "the number of pairs per fold")
        lines = lines[1:]
    first, second, same = [], [], []
    for number, tokens in enumerate(lines, start=2 if lfw else 1):
        where = f"{pairs_file}:{number}"
        if lfw and len(tokens) in (3, 4):  # name i j (same identity) or name1 i name2 j
            a = _lfw_image(root, tokens[0], tokens[1], where)
            b = _lfw_image(root, tokens[-2] if len(tokens) == 4 else tokens[0], tokens[-1], where)
            is_same = len(tokens) == 3
        elif not lfw and len(tokens) == 3 and tokens[2] in ("0", "1"):
            a, b, is_same = root / tokens[0], root / tokens[1], tokens[2] == "1"
            for p in (a, b):
                if not_regular(p) is not None:
                    raise UserError(f"{where}: image {str(p)[:200]} does not exist")
        else:
            text = " ".join(tokens)  # quoted in part: a line may be megabytes long
            raise UserError(f"{where}: cannot parse {text[:80] + ('...' if len(text) > 80 else '')!r} (expected "
                            "LFW pairs.txt lines or '<path1> <path2> <0|1>')")  # fmt: skip
        first.append(a)
        second.append(b)
        same.append(is_same)
    return VerificationPairs(first, second, same, folds)
