"""Fine-tuning from a model trained on other real data vs training from scratch, same steps (docs/using.md).

Fashion-MNIST's real images are written out as two ImageFolders: A holds five classes (T-shirt/top,
Trouser, Pullover, Dress, Coat) with many images, B the other five (Sandal, Shirt, Sneaker, Bag, Ankle
boot) with a few hundred training images per class. ``repmlp_fmnist`` is trained on A; then, for each
seed, two runs on B with identical options and steps: one from scratch, one with ``--init`` of A's
``model.safetensors`` (B's classifier has the same five outputs but other classes; it is loaded as timm
would, which is no help and no harm). Every number printed comes from the runs' own ``metrics.csv`` /
``repmlp eval``; every command is printed. Runs already finished in ``--out`` are reused.

    python3 benchmarks/finetune_fmnist.py --out runs/finetune-demo          # about 4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import hardware

A_CLASSES = (0, 1, 2, 3, 4)
B_CLASSES = (5, 6, 7, 8, 9)


def write_folder(root: Path, classes: tuple[int, ...], per_class: dict[str, int]) -> Path:
    """``root/{train,val}/<NN_name>/<i>.png`` from the real Fashion-MNIST (train split -> train/, test -> val/)."""
    from PIL import Image

    from repmlp.data.fashion_mnist import CLASSES, find_fashion_mnist, load_fashion_mnist

    if (root / "done").exists():
        return root
    folder = find_fashion_mnist(None)
    for split, train in (("train", True), ("val", False)):
        images, labels = load_fashion_mnist(folder, train=train)
        for c in classes:
            d = root / split / f"{c}_{CLASSES[c].replace('/', '-').replace(' ', '-')}"
            d.mkdir(parents=True, exist_ok=True)
            for i, idx in enumerate((labels == c).nonzero()[0][: per_class[split]]):
                Image.fromarray(images[idx, 0]).save(d / f"{i:05d}.png")
    (root / "done").write_text("")
    return root


def repmlp(*args: object) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "repmlp", *map(str, args)]
    print("$", " ".join(["repmlp", *map(str, args)]), flush=True)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.exit(f"failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return res


def train(out: Path, data: Path, common: list[str], *extra: object) -> float:
    """Train into ``out`` (reused when finished); its last validation top-1 (%) from metrics.csv."""
    if not (out / "model.safetensors").exists():
        t = time.perf_counter()
        # A run killed part-way continues from its checkpoint (bitwise the same result).
        resume = ["--resume"] if (out / "checkpoint.safetensors").exists() else []
        repmlp(
            "train", "--dataset", "imagefolder", "--data-dir", data, *common, *extra, "--output", out, *resume
        )
        print(f"  {time.perf_counter() - t:.0f} s", flush=True)
    with open(out / "metrics.csv", newline="") as f:
        return float(list(csv.DictReader(f))[-1]["val_top1"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/finetune-demo"))
    p.add_argument("--pretrain-per-class", type=int, default=1200, help="A's training images per class")
    p.add_argument("--per-class", type=int, default=200, help="B's training images per class")
    p.add_argument("--val-per-class", type=int, default=400, help="validation images per class (A and B)")
    p.add_argument("--pretrain-epochs", type=int, default=4)
    p.add_argument("--epochs", type=int, default=8, help="epochs on B (same for both arms)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    t0 = time.perf_counter()
    a = write_folder(
        args.out / "data-a", A_CLASSES, {"train": args.pretrain_per_class, "val": args.val_per_class}
    )
    b = write_folder(args.out / "data-b", B_CLASSES, {"train": args.per_class, "val": args.val_per_class})
    # Same recipe for every run: the fmnist preset at 28x28 (ImageFolder: random resized crop + flip), with
    # the model it had when docs/using.md's results were measured.
    common = [
        "--preset",
        "fmnist",
        "--model",
        "repmlp_fmnist",
        "--img-size",
        "28",
        "--no-export",
        "--no-bench",
        "--threads",
        args.threads,
    ]
    pre = args.out / "pretrain"
    top_a = train(pre, a, [*common, "--batch-size", 128], "--epochs", args.pretrain_epochs)
    rows = []
    for seed in args.seeds:
        opts = [*common, "--batch-size", args.batch_size, "--epochs", args.epochs, "--seed", seed]
        scratch = train(args.out / f"scratch-s{seed}", b, opts)
        tuned = train(args.out / f"finetune-s{seed}", b, opts, "--init", pre / "model.safetensors")
        rows.append((seed, scratch, tuned))
    steps = args.epochs * ((5 * args.per_class) // args.batch_size)
    res = repmlp(
        "eval", "--checkpoint", args.out / f"finetune-s{args.seeds[0]}" / "deploy.safetensors", "--json"
    )
    check = json.loads(res.stdout)["top1"]
    print()
    torch.set_num_threads(args.threads)
    print(f"Hardware: {hardware(torch.device('cpu'))}")
    print(
        f"Pre-training on A (5 classes, {5 * args.pretrain_per_class} images): top-1 {top_a:.2f}% on A's val"
    )
    print(
        f"B: {5 * args.per_class} training images, {5 * args.val_per_class} validation images, {steps} steps"
    )
    print()
    print("| seed | from scratch top-1 (%) | fine-tuned (`--init`) top-1 (%) | difference |")
    print("|---|---|---|---|")
    for seed, scratch, tuned in rows:
        print(f"| {seed} | {scratch:.2f} | {tuned:.2f} | {tuned - scratch:+.2f} |")
    ms, mt = statistics.mean(r[1] for r in rows), statistics.mean(r[2] for r in rows)
    print(f"| mean | {ms:.2f} | {mt:.2f} | {mt - ms:+.2f} |")
    print()
    print(f"(repmlp eval of finetune-s{args.seeds[0]}/deploy.safetensors: top-1 {check:.2f}%)")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
