"""Write an ImageNet-like JPEG image folder of any size: ``<out>/{train,val}/<class>/*.JPEG``.

ImageNet's training images are mostly 500x375, 375x500 or 500x333 pixels (about 400x350 on average) and
JPEGs of about 110 KB; what a loader delivers depends on both (decode time grows with the pixels, read
time with the bytes), so the images here have those sizes and, with detail at several scales (smooth
colour fields, edges and fine texture), file sizes like ImageNet's at JPEG quality 90. The content is
random: this folder measures loaders, not models.

    python3 scripts/make_image_folder.py /tmp/imagenet-like --train 1000 --val 200 --classes 10
"""

from __future__ import annotations

import argparse
import multiprocessing
from pathlib import Path

import numpy as np

# (width, height, share): ImageNet's commonest sizes; the rest are drawn between 200 and 800 pixels a side.
_COMMON = ((500, 375, 0.45), (375, 500, 0.15), (500, 333, 0.12), (333, 500, 0.04))


def image_size(rng: np.random.Generator) -> tuple[int, int]:
    """A ``(width, height)`` drawn as ImageNet's are distributed (roughly)."""
    u, acc = rng.random(), 0.0
    for w, h, share in _COMMON:
        acc += share
        if u < acc:
            return w, h
    return int(rng.integers(200, 801)), int(rng.integers(200, 801))


def image_pixels(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """``(height, width, 3)`` uint8: random colour fields at several scales plus fine texture."""
    from PIL import Image

    out = np.zeros((height, width, 3), np.float32)
    for cells, weight in ((3, 90.0), (12, 45.0), (48, 25.0)):
        small = rng.normal(0, 1, (cells, cells, 3)).astype(np.float32)
        lo, hi = small.min(), small.max()
        img = Image.fromarray(((small - lo) / (hi - lo + 1e-6) * 255).astype(np.uint8))
        out += (np.asarray(img.resize((width, height), Image.BICUBIC), np.float32) - 128) * weight / 128
    out += rng.normal(0, 12, (height, width, 1)).astype(np.float32)  # sensor-like grain
    return np.clip(out + 128, 0, 255).astype(np.uint8)


def _write_one(job: tuple[Path, str, int, int, int, int]) -> int:
    """Write image ``i`` of ``split``; its pixels depend on ``(seed, split, i)`` alone. Returns its bytes."""
    from PIL import Image

    root, split, i, classes, seed, quality = job
    rng = np.random.default_rng([seed, ("train", "val").index(split), i])
    folder = root / split / f"n{i % classes:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{split}_{i:08d}.JPEG"
    w, h = image_size(rng)
    Image.fromarray(image_pixels(rng, w, h)).save(path, quality=quality)
    return path.stat().st_size


def write_folder(
    root: Path, train: int, val: int, classes: int, seed: int = 0, quality: int = 90, jobs: int = 1
) -> int:
    """Write ``train`` and ``val`` images spread over ``classes`` class folders in ``jobs`` processes;
    returns the bytes written. The folder is the same whatever ``jobs`` is."""
    work = [(root, split, i, classes, seed, quality) for split, n in (("train", train), ("val", val))
            for i in range(n)]  # fmt: skip
    if jobs <= 1:
        return sum(map(_write_one, work))
    with multiprocessing.Pool(jobs) as pool:
        return sum(pool.imap_unordered(_write_one, work, chunksize=16))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the folder to write (train/ and val/ inside)")
    p.add_argument("--train", type=int, default=1000, help="training images (default: 1000)")
    p.add_argument("--val", type=int, default=200, help="validation images (default: 200)")
    p.add_argument("--classes", type=int, default=10, help="class folders (default: 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quality", type=int, default=90, help="JPEG quality (default: 90)")
    p.add_argument("--jobs", type=int, default=1, help="processes writing images (default: 1)")
    args = p.parse_args()
    if min(args.train, args.val) < 0 or args.classes < 1:
        p.error("--train and --val must be >= 0 and --classes >= 1")
    total = write_folder(args.out, args.train, args.val, args.classes, args.seed, args.quality, args.jobs)
    n = args.train + args.val
    print(f"wrote {n} JPEGs to {args.out}: {total / max(n, 1) / 1e3:.0f} KB each on average")


if __name__ == "__main__":
    main()
