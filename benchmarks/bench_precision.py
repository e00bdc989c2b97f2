"""Reduced-precision deployment of a trained run, verified on its full validation set.

For a run folder (``model.safetensors`` of ``repmlp train``) this converts the model with
``repmlp convert --precision P`` for every requested precision, then reports per precision: top-1, the
top-1 change and the share of validation predictions that differ from the float32 deployed model, the
file size relative to the float32 file, and the throughput relative to float32 (timed interleaved).

    python3 benchmarks/bench_precision.py --run runs/fmnist [--precisions bf16 fp16 int8]

Goals (issue 9): bf16 within 0.3 and int8 within 1.0 top-1 points of float32; int8 file <= 35% of float32.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from common import device_arg, hardware, parse_cpu_only, table
from repmlp.bench.timing import time_interleaved
from repmlp.data import DataConfig, build_data
from repmlp.io.model_file import load_model

_GOAL_TOP1 = {"bf16": 0.3, "fp16": 0.3, "int8": 1.0}


def predictions(model: torch.nn.Module, batches: list[torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([model(x).float().argmax(1) for x in batches])


def main() -> None:
    parser = device_arg(__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="run folder holding model.safetensors")
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp16", "int8"])
    parser.add_argument("--batch-size", type=int, default=256, help="batch of the throughput timing")
    args = parse_cpu_only(parser, "reduced-precision deployment")
    with tempfile.TemporaryDirectory(prefix="bench-precision-") as tmp:
        files = {"fp32": Path(tmp) / "deploy-fp32.safetensors"}
        files.update({p: Path(tmp) / f"deploy-{p}.safetensors" for p in args.precisions})
        for precision, path in files.items():
            cmd = [
                sys.executable,
                "-m",
                "repmlp",
                "-q",
                "convert",
                "--checkpoint",
                str(args.run / "model.safetensors"),
            ]
            subprocess.run(
                [*cmd, "--output", str(path), "--precision", precision], check=True, stdout=subprocess.DEVNULL
            )
        models = {p: load_model(f) for p, f in files.items()}
        sizes = {p: f.stat().st_size for p, f in files.items()}
    meta = load_model(args.run / "model.safetensors").metadata
    extra = meta.extra
    data = build_data(
        DataConfig(dataset=extra["dataset"], data_dir=extra.get("data_dir"), need_train=False, workers=0)
    )
    batches, labels = zip(*data.val.batches(0), strict=True)
    y = torch.cat(labels)
    preds = {p: predictions(m, list(batches)) for p, m in models.items()}
    top1 = {p: 100 * (pr == y).float().mean().item() for p, pr in preds.items()}
    x = batches[0][: args.batch_size]
    rounds = 3 if args.quick else args.rounds
    with torch.inference_mode():
        secs = time_interleaved(
            {p: (lambda m=m: m(x)) for p, m in models.items()}, torch.device("cpu"), rounds=rounds
        )
    rows = []
    for p in files:
        delta = top1[p] - top1["fp32"]
        changed = 100 * (preds[p] != preds["fp32"]).float().mean().item()
        goal = ""
        if p in _GOAL_TOP1:
            ok = abs(delta) <= _GOAL_TOP1[p] and (p != "int8" or sizes[p] <= 0.35 * sizes["fp32"])
            goal = "met" if ok else "**not met**"
        rows.append(
            [
                p,
                f"{top1[p]:.2f}",
                f"{delta:+.2f}",
                f"{changed:.2f}%",
                f"{sizes[p] / 1e6:.2f} MB ({100 * sizes[p] / sizes['fp32']:.0f}%)",
                f"{secs['fp32'] / secs[p]:.2f}x",
                goal,
            ]
        )
    print(
        f"**bench_precision: {meta.name} run {args.run} on {extra['dataset']} ({len(y)} validation images)**"
    )
    print(hardware(torch.device("cpu")))
    print()
    header = [
        "precision",
        "top-1 (%)",
        "vs fp32 (points)",
        "predictions changed",
        "file",
        "speed vs fp32",
        "goal",
    ]
    print(table(header, rows))
    print(f"\nSpeed: batch {len(x)}, medians of {rounds} interleaved rounds; int8 runs in onnxruntime.")


if __name__ == "__main__":
    main()
