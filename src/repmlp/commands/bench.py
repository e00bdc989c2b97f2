"""``repmlp bench``: examples/second of training-time and deployed forms, with params and FLOPs.

Models come from the registry (``--model``, built with random weights: speed does not depend on them)
or from checkpoints (``--checkpoint``). Each is timed as built (training-time structure, eval mode) and
after re-parameterization, at one batch size and input size, after warm-up passes; the table reports
the median pass. FLOPs are multiply-accumulates, as in the paper. Every model and form runs the same way,
set by flags of the run as timm's ``benchmark.py`` sets them (``--channels-last``, ``--compile``,
``--precision``), and all are timed in one series of interleaved rounds; with more than one model each row
carries its speed ratio to the first model's (:mod:`repmlp.bench.throughput`). ``--roofline`` adds each
deployed model's ceilings (:mod:`repmlp.bench.roofline`): on a GPU of its table named by ``--device``,
without timing anything.
"""

from __future__ import annotations

import argparse
import logging
from importlib.metadata import version
from pathlib import Path

import torch
from torch import nn

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

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # torch.compile's: code-generating, and two that check


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
    p.add_argument("--channels-last", action="store_true", help="run every model channels_last (weights and "
                   "input; default: NCHW, as timm's benchmark.py)")  # fmt: skip
    p.add_argument("--compile", "--torchcompile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   choices=COMPILE_BACKENDS, dest="compile", help="run every form through torch.compile with this "
                   "backend (default when given: inductor; compiled before the warm-up, untimed)")  # fmt: skip
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
    if args.roofline and args.checkpoint:
        raise UserError("--roofline takes registered models (--model)")
    if args.runtime != "torch" and (args.channels_last or args.compile):
        raise UserError(f"--channels-last and --compile apply to --runtime torch, not {args.runtime}")
    named = args.roofline and args.device.lower() in GPUS  # ceilings only: that GPU need not be here
    device = torch.device("cpu") if named else resolve_device(args.device)
    check_runtime(args.runtime, device)
    models, input_size, forms = models_to_bench(args.model, args.checkpoint, num_classes=args.num_classes,
                                                in_chans=args.in_chans, img_size=args.img_size)  # fmt: skip
    if args.precision != "fp32" and not named:
        models = {n: in_precision(m, args.precision, input_size) for n, m in models.items()}
        forms = dict.fromkeys(models, "deploy")
    timed = {} if named else _to_time(models, forms, args)
    rows = []
    if timed:
        rows = benchmark(timed, input_size, args.batch_size, device=device, warmup=args.warmup,
                         repeats=args.repeats, forms=args.forms, runtime=args.runtime,
                         channels_last=args.channels_last, compile_backend=args.compile)  # fmt: skip
    table = render_markdown(rows, note=_note(args, input_size, models, device))
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


def _to_time(
    models: dict[str, nn.Module], forms: dict[str, str], args: argparse.Namespace
) -> dict[str, nn.Module]:
    """The models with a form of ``--forms`` to time: a deployed one (a deployed checkpoint, or any model in a
    reduced ``--precision``) has no training-time form left."""
    timed = {}
    for name, model in models.items():
        if forms[name] == "train" or "deploy" in args.forms:
            timed[name] = model
        elif args.precision != "fp32":
            log.warning("%s: --precision %s times the deployed form only: nothing to time for --forms train",
                        name, args.precision)  # fmt: skip
        else:
            log.warning("%s is a deployed checkpoint: nothing to time for --forms train", name)
    return timed


def _note(args: argparse.Namespace, input_size: tuple[int, ...], models: dict[str, nn.Module],
          device: torch.device) -> str:  # fmt: skip
    """The note under the table: batch, input, precision, hardware, how every model ran, how it was timed."""
    size = "x".join(str(s) for s in input_size)
    runtime = "" if args.runtime == "torch" else f", run by {args.runtime} {version(args.runtime)}"
    precisions = "/".join(sorted({precision_of(m) for m in models.values()}))
    how = f"compiled ({args.compile}, compile time untimed)" if args.compile else "eager"
    layout = "channels_last (weights and input)" if args.channels_last else "NCHW"
    flags = [f"--precision {args.precision}"] * (args.precision != "fp32") + [
        "--channels-last"
    ] * args.channels_last
    flags += [f"--compile {args.compile}"] * bool(args.compile)
    ratio = f"; vs. first is the speed over {next(iter(models))}'s in the same form, per round (median, quartiles)"
    return (f"Batch {args.batch_size}, input {size}, {precisions}{runtime}, {hardware_summary(device)}; every model "
            f"and form run alike: {how}, {layout}, the input in each form's precision; flags: "
            f"{' '.join(flags) or 'none'}. Speed: the median of {args.repeats} passes after {args.warmup} warm-up "
            "passes, all forms interleaved round by round; spread: the interquartile range of the pass times over "
            f"their median{ratio * (len(models) > 1)} (`repmlp bench`).")  # fmt: skip
