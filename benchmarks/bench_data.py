"""What the image-folder pipeline delivers beside what the model's training step takes (issue #43).

Measures, on an ImageNet-like JPEG folder (``scripts/make_image_folder.py``):

- per core (this process, one torch thread): the decoders alone (Pillow, ``torchvision.io.decode_jpeg``)
  and the training and evaluation pipelines item by item: repmlp's (:class:`repmlp.data.folder.TrainCrop`
  on :func:`~repmlp.data.folder.decode_pixels`'s uint8 pixels) and the float PIL pipeline it replaced
  (Pillow decode, ``RandomResizedCrop``, flip, ``ToTensor``, ``Normalize``);
- in total: the training and evaluation loaders (``FolderLoader``, ``--workers``, persistent workers,
  normalised on ``--device``), from the second epoch on (the first starts the workers);
- the model's training step (forward, backward, SGD) on synthetic batches on ``--device``;

and prints which of the two bounds an epoch, and the loader against its goal (>= 90% of workers x the
per-core rate of its transform).

    python3 scripts/make_image_folder.py /tmp/imagenet-like --train 600 --val 200
    python3 benchmarks/bench_data.py /tmp/imagenet-like --model repmlp_res50_light --batch-size 32
"""

from __future__ import annotations

import glob
import io
import os
import time
from pathlib import Path

import torch

import common  # first: puts src/ on sys.path
from repmlp.bench.timing import sync_device, time_calls
from repmlp.data import DataConfig, build_data
from repmlp.data.loader import default_workers


def _rate(fn, items: list, min_s: float) -> float:
    """Items per second of ``fn`` over ``items``, repeated until ``min_s`` seconds (after one warm-up)."""
    fn(items[0])
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_s:
        for item in items:
            fn(item)
        n += len(items)
    return n / (time.perf_counter() - start)


def per_core(root: Path, size: int, min_s: float, limit: int) -> dict[str, float]:
    """Images/s of each decoder and pipeline on one core (this process, one torch thread)."""
    from PIL import Image
    from torchvision import transforms as T
    from torchvision.io import ImageReadMode, decode_jpeg

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    files = sorted(glob.glob(str(root / "train" / "*" / "*")))[:limit]
    blobs = [Path(f).read_bytes() for f in files]
    data = build_data(DataConfig(dataset="imagefolder", data_dir=str(root), img_size=size, flip=True,
                                 train_limit=limit, val_limit=limit, workers=0))  # fmt: skip
    old = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                     T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])  # fmt: skip
    train_items = [(i, 0) for i in range(len(data.train.dataset))]
    val_items = [(i, 0) for i in range(len(data.val.dataset))]
    rates = {
        "Pillow decode": _rate(lambda b: Image.open(io.BytesIO(b)).convert("RGB"), blobs, min_s),
        "decode_jpeg": _rate(
            lambda b: decode_jpeg(torch.frombuffer(bytearray(b), dtype=torch.uint8), mode=ImageReadMode.RGB),
            blobs,
            min_s,
        ),
        "old float PIL training transform": _rate(lambda f: old(Image.open(f).convert("RGB")), files, min_s),
        "training pipeline (uint8)": _rate(data.train.dataset.__getitem__, train_items, min_s),
        "evaluation pipeline (uint8)": _rate(data.val.dataset.__getitem__, val_items, min_s),
    }
    torch.set_num_threads(threads)
    return rates


def loader_rate(loader, epochs: int) -> float:
    """Images/s of ``loader`` over ``epochs`` epochs after a first one (which starts its workers)."""
    for _ in loader.batches(0):
        pass
    n, start = 0, time.perf_counter()
    for epoch in range(1, epochs + 1):
        for x, _ in loader.batches(epoch):
            n += len(x)
    sync_device(loader.device)
    return n / (time.perf_counter() - start)


def train_step_rate(model_name: str, batch: int, size: int, device: torch.device, steps: int) -> float:
    """Examples/s of the model's training step (forward, cross-entropy, backward, SGD) on random batches."""
    from repmlp.models import create_model

    try:
        model = create_model(model_name, img_size=size)
    except TypeError:  # models without an input size of their own (torchvision's and timm's ResNets)
        model = create_model(model_name)
    model = model.to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        with amp:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return batch / time_calls(step, steps, device, warmup=1)


def main() -> None:
    parser = common.device_arg(__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="an image folder (train/ and val/)")
    parser.add_argument("--model", default="repmlp_res50_light")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument(
        "--workers", type=int, default=None, help="default: one per core this process may use"
    )
    parser.add_argument("--epochs", type=int, default=2, help="loader epochs timed (after a first one)")
    parser.add_argument("--steps", type=int, default=5, help="training steps timed")
    parser.add_argument("--limit", type=int, default=200, help="images timed per core")
    parser.add_argument("--gpu-decode", action="store_true", help="CUDA: the nvJPEG training pipeline")
    args = parser.parse_args()
    device = torch.device(args.device)
    workers = default_workers() if args.workers is None else args.workers
    print(common.hardware(device), f"; {len(os.sched_getaffinity(0))} cores usable, {workers} workers")
    core = per_core(args.folder, args.img_size, 1.0 if args.quick else 5.0, args.limit)
    data = build_data(
        DataConfig(dataset="imagefolder", data_dir=str(args.folder), img_size=args.img_size, flip=True,
                   batch_size=args.batch_size, eval_batch_size=args.batch_size, workers=workers,
                   gpu_decode=args.gpu_decode),
        device=device,
    )  # fmt: skip
    total = {"training loader": loader_rate(data.train, args.epochs), "evaluation loader": 0.0}
    total["evaluation loader"] = loader_rate(data.val, args.epochs)
    step = train_step_rate(args.model, args.batch_size, args.img_size, device, args.steps)
    rows = [[k, f"{v:.3g}", ""] for k, v in core.items()]
    goal = 0.9 * workers * core["training pipeline (uint8)"]
    met = "met" if total["training loader"] >= goal else "**not met**"
    rows.append(["training loader", "", f"{total['training loader']:.3g} (goal >= {goal:.3g}: {met})"])
    rows.append(["evaluation loader", "", f"{total['evaluation loader']:.3g}"])
    rows.append([f"{args.model} training step, batch {args.batch_size}", "", f"{step:.3g}"])
    print(common.table(["what", "images/s per core", "images/s in total"], rows))
    bound = "the data loader" if total["training loader"] < step else "the model's training step"
    print(f"An epoch is bound by {bound} ({total['training loader']:.3g} vs {step:.3g} images/s).")


if __name__ == "__main__":
    main()
