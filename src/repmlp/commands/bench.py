"""``repmlp bench``: examples/second of training-time and deployed forms, with params and FLOPs.

Models come from the registry (``--model``, built with random weights: speed does not depend on them)
or from checkpoints (``--checkpoint``). Each is timed as built (training-time structure, eval mode) and
after re-parameterization, at one batch size and input size, after warm-up passes; the table reports
the median pass. FLOPs are multiply-accumulates, as in the paper. ``--roofline`` adds each deployed model's
ceilings (:mod:`repmlp.bench.roofline`): on a GPU of its table named by ``--device``, without timing anything.
"""

from __future__ import annotations

import argparse
import logging
from importlib.metadata import version
from pathlib import Path

import torch

from repmlp.bench.roofline import GPUS, find_device, render, roofline
from repmlp.bench.throughput import benchmark, in_precision, models_to_bench, render_markdown
from repmlp.commands._common import (
    add_device_argument,
    add_force_argument,
    add_runtime_argument,
    check_output_file,
    check_runtime,
    model_name,
    number_in,
)
from repmlp.deploy.precision import PRECISIONS, precision_of
from repmlp.engine import hardware_summary, resolve_device
from repmlp.errors import UserError
from repmlp.io.model_file import atomic_write_text
from repmlp.tasks.limits import MAX_CHANNELS, MAX_SIDE, POSITIVE, ints

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", nargs="+", type=model_name, metavar="NAME",
                     help="registered model name(s) (see repmlp tables)")  # fmt: skip
    src.add_argument("--checkpoint", nargs="+", type=Path, metavar="PATH", help="model checkpoint(s)")
    p.add_argument("--batch-size", type=number_in("batch_size"), default=32, help="examples per forward pass")
    p.add_argument("--img-size", type=number_in(ints(1, MAX_SIDE)), default=None,
                   help="input height = width (default: the model's)")  # fmt: skip
    p.add_argument(
        "--in-chans",
        type=number_in(ints(1, MAX_CHANNELS)),
        default=None,
        help="input channels (--model only)",
    )
    p.add_argument(
        "--num-classes", type=number_in(ints(1, 10**6)), default=None, help="classes (--model only)"
    )
    add_device_argument(p)
    p.add_argument("--warmup", type=number_in(ints(0, 10**6)), default=3, help="untimed passes first")
    p.add_argument(
        "--repeats", type=number_in(ints(1, 10**6)), default=10, help="timed passes (median reported)"
    )
    p.add_argument(
        "--forms", nargs="+", choices=("train", "deploy"), default=["train", "deploy"], help="forms to time"
    )
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="time the deployed form in this precision "
                   "(int8: onnxruntime, calibrated on random inputs, which is enough for speed); reduced-precision "
                   "checkpoints are timed as stored")  # fmt: skip
    add_runtime_argument(p, "the forms")
    p.add_argument("--path", choices=("auto", "eager", "graph", "fused", "fused+graph", "compile", "compile+graph"),
                   default="auto", help="how PyTorch runs the forms on a GPU (auto: the fastest measured for the "
                   "precision, docs/gpu.md: compile+graph in fp16/bf16, fused+graph in fp32); CPUs run the models "
                   "as they are")  # fmt: skip
    p.add_argument(
        "--roofline",
        action="store_true",
        help="also each deployed model's ceilings by operator kind and "
        f"stage (docs/benchmarks.md); --device may name a GPU of the table: {', '.join(GPUS)}",
    )
    p.add_argument(
        "--peak",
        type=number_in(POSITIVE),
        help="the roofline's peak in TFLOP/s (default: the GPU's datasheet; a CPU's measured)",
    )
    p.add_argument("--bandwidth", type=number_in(POSITIVE), help="the roofline's memory bandwidth in GB/s")
    p.add_argument("--output", type=Path, default=None, help="also write the Markdown table to this file")
    add_force_argument(p)


def run(args: argparse.Namespace) -> int:
    check_output_file(args.output, args.checkpoint or [], force=args.force)
    if args.roofline and (args.checkpoint or args.precision == "int8"):
        raise UserError("--roofline takes registered models (--model) in fp32, bf16 or fp16")
    named = args.roofline and args.device.lower() in GPUS  # ceilings only: that GPU need not be here
    device = torch.device("cpu") if named else resolve_device(args.device)
    check_runtime(args.runtime, device)
    models, input_size, forms = models_to_bench(args.model, args.checkpoint, num_classes=args.num_classes,
                                                in_chans=args.in_chans, img_size=args.img_size)  # fmt: skip
    if args.precision != "fp32" and not named:
        models = {n: in_precision(m, args.precision, input_size) for n, m in models.items()}
        forms = dict.fromkeys(models, "deploy")
    rows = []
    for name, model in () if named else models.items():
        # A deployed checkpoint has no training-time form left to time.
        wanted = [f for f in args.forms if forms[name] == "train" or f == "deploy"]
        if not wanted:
            log.warning("%s is a deployed checkpoint: nothing to time for --forms train", name)
            continue
        rows += benchmark({name: model}, input_size, args.batch_size, device=device, warmup=args.warmup,
                          repeats=args.repeats, forms=wanted, runtime=args.runtime, path=args.path)  # fmt: skip
    size = "x".join(str(s) for s in input_size)
    runtime = "" if args.runtime == "torch" else f", run by {args.runtime} {version(args.runtime)}"
    precisions = "/".join(sorted({precision_of(m) for m in models.values()}))
    note = (
        f"Batch {args.batch_size}, input {size}, {precisions}{runtime}, {hardware_summary(device)}; speed is "
        f"the median of {args.repeats} timed passes after {args.warmup} warm-up passes, the forms interleaved; "
        "spread is the interquartile range of the pass times relative to their median (`repmlp bench`)."
    )
    table = render_markdown(rows, note=note)
    if args.roofline:
        peak, bandwidth = args.peak and args.peak * 1e12, args.bandwidth and args.bandwidth * 1e9
        on = find_device(args.device if named else device, args.precision, peak, bandwidth)
        measured = {r.model: r.throughput for r in rows if r.form == "deploy"}
        tables = [render(roofline(name, args.batch_size, args.precision, on, input_size, args.num_classes),
                          measured.get(name)) for name in models]  # fmt: skip
        table = "\n\n".join([table] * (not named) + tables)
    print(table)
    if args.output is not None:
        atomic_write_text(args.output, table + "\n")
    return 0
