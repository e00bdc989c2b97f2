"""``repmlp predict``'s images/s on a folder of image files vs the deployed model's own throughput.

Two cases (issue 18): the Light Block model ``repmlp_res50_light`` on 224x224 JPEGs (ImageNet-style
preprocessing: resize 256, centre crop 224, mean/std) and ``repmlp_fmnist`` on 28x28 greyscale PNGs.
Each model is built with random weights (speed does not depend on them), converted and saved as a
``deploy.safetensors`` like a run's. Per case, interleaved over ``--rounds`` rounds (median):

- model: ``repmlp.bench.throughput.benchmark`` of the deployed model at ``--batch-size`` (what ``repmlp bench``
  measures: forward passes on a ready batch);
- predict: :meth:`repmlp.Predictor.predict_files` over the folder (what ``repmlp predict`` runs after
  loading the model): DataLoader worker processes decode batch i+1 while the model runs on batch i,
  softmax, top-5, result records. Worker start-up is included.

The ratio predict / model is the share of the model's throughput that ``repmlp predict`` delivers. The
whole command (``python -m repmlp predict ... --output x.csv``, Python start-up and model loading
included) is timed once per case for reference.

    python3 benchmarks/bench_predict.py [--images 512] [--batch-size 32] [--workers auto|N]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import device_arg, hardware, table

CASES = {
    # name: (model, kwargs, image size, file suffix, recorded data set, input size)
    "repmlp_res50_light, 224x224 JPEG": ("repmlp_res50_light", {}, 224, ".jpg", "imagefolder", (3, 224, 224)),
    "repmlp_fmnist, 28x28 PNG": ("repmlp_fmnist", {}, 28, ".png", "fashion-mnist", (1, 28, 28)),
}


def write_images(folder: Path, n: int, size: int, suffix: str, channels: int) -> list[str]:
    """``n`` photo-like images (smooth gradients plus noise, so JPEG/PNG sizes are realistic)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size] / size
    paths = []
    for i in range(n):
        base = 255 * (0.5 + 0.25 * np.sin(6 * xx + i) * np.cos(4 * yy - i))
        img = np.clip(base[..., None] + rng.normal(0, 20, (size, size, channels)), 0, 255).astype(np.uint8)
        path = folder / f"{i:05d}{suffix}"
        Image.fromarray(img[..., 0] if channels == 1 else img).save(path, quality=90)
        paths.append(str(path))
    return paths


def save_deployed(
    path: Path, name: str, kwargs: dict, dataset: str, input_size: tuple[int, int, int]
) -> None:
    import repmlp
    from repmlp.io.model_file import save_model

    model = repmlp.create_model(name, **kwargs).eval()
    extra = {"dataset": dataset, "input_size": list(input_size)}
    save_model(
        path, repmlp.reparameterize_model(model), name=name, model_kwargs=kwargs, form="deploy", extra=extra
    )


def measure(case: str, root: Path, args) -> list[str]:
    import repmlp
    from repmlp.bench.throughput import benchmark

    name, kwargs, size, suffix, dataset, input_size = CASES[case]
    ckpt = root / f"{name}.safetensors"
    save_deployed(ckpt, name, kwargs, dataset, input_size)
    paths = write_images(root / name, args.images, size, suffix, input_size[0])
    predictor = repmlp.Predictor(ckpt)
    model = predictor.model

    # As many forward passes as predict makes over the folder: both timings span the same stretch of time,
    # so a passing change in the machine's speed (a shared host) weighs on both alike.
    passes = max(5, -(-args.images // args.batch_size))

    def model_rate() -> float:
        rows = benchmark(
            {name: model}, input_size, args.batch_size, forms=("deploy",), warmup=2, repeats=passes
        )
        return rows[0].throughput

    def predict_rate() -> float:
        threads = torch.get_num_threads()
        torch.set_num_threads(args.predict_threads or threads)  # repmlp predict --threads
        try:
            t0 = time.perf_counter()
            n = sum(
                1 for _ in predictor.predict_files(paths, batch_size=args.batch_size, workers=args.workers)
            )
            return n / (time.perf_counter() - t0)
        finally:
            torch.set_num_threads(threads)

    predict_rate()  # warm-up: page cache, allocator
    rates: dict[str, list[float]] = {"model": [], "predict": []}
    for _ in range(args.rounds):
        rates["model"].append(model_rate())
        rates["predict"].append(predict_rate())
    m, p = statistics.median(rates["model"]), statistics.median(rates["predict"])
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "repmlp", "-q", "predict", "--checkpoint", str(ckpt), str(root / name),
           "--batch-size", str(args.batch_size), "--workers", "auto" if args.workers is None else str(args.workers),
           *(["--threads", str(args.predict_threads)] if args.predict_threads else []),
           "--output", str(root / "p.csv")]  # fmt: skip
    src = str(Path(__file__).resolve().parents[1] / "src")  # this checkout's repmlp, not an installed one
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    whole = time.perf_counter() - t0
    return [case, str(args.batch_size), f"{m:.0f}", f"{p:.0f}", f"{p / m:.2f}", f"{whole:.1f} s"]


def describe_workers(args) -> str:
    """``--workers`` as predict ran it: ``auto`` also says how many processes that meant here."""
    if args.workers is not None:
        return str(args.workers)
    from repmlp.deploy.predict import auto_workers

    threads = torch.get_num_threads()
    torch.set_num_threads(args.predict_threads or threads)
    try:
        return f"auto ({auto_workers()} here)"
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    parser = device_arg(__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=512, help="files per folder")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--workers",
        type=lambda t: None if t == "auto" else int(t),
        default=None,
        help="decoding processes of repmlp predict (default auto, as repmlp predict)",
    )
    parser.add_argument(
        "--predict-threads",
        type=int,
        default=None,
        help="torch threads of predict (default: torch's, as bench)",
    )
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    rows = []
    load = os.getloadavg()[0]  # other processes on the machine: they skew every timing
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            rows.append(measure(case, Path(tmp), args))
            print(" | ".join(rows[-1]), flush=True)
    print()
    print(hardware(torch.device(args.device)))
    print(
        f"{args.images} files per folder, --workers {describe_workers(args)}, predict threads "
        f"{args.predict_threads or torch.get_num_threads()}, median of {args.rounds} interleaved rounds; "
        f"load average before: {load:.1f}"
    )
    print()
    header = ["case", "batch", "model images/s", "predict images/s", "predict / model", "whole command"]
    print(table(header, rows))


if __name__ == "__main__":
    main()
