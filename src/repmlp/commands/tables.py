"""``repmlp tables``: the paper's model tables (structures, params, FLOPs) as computed by this package.

With ``--speed``, the paper's speed tables instead: every row the paper timed (RepMLP-Res50's r/g and
stage variants, the 320x320 comparisons with ResNet-101, NL- and GC-Res50 and the EfficientNets, the Light
Block, the face models at batch 512 and 96x96, the PSPNets at batch 16 and 713x713) is built, converted,
checked against its training-time form in full float32 and timed at the paper's batch and input, beside
the paper's examples/s and ratios (see ``repmlp.bench.speed_tables``). Exit status 1 when a conversion check fails or
a row could not be measured.
"""

from __future__ import annotations

import argparse
import logging
import shlex
from pathlib import Path

from repmlp.bench.speed_tables import (
    SPEED_PATHS,
    SpeedOptions,
    describe,
    measure_speed_rows,
    render_speed_tables,
    speed_rows,
)
from repmlp.bench.tables import render_tables
from repmlp.commands._common import add_force_argument, check_output_file
from repmlp.engine import resolve_device
from repmlp.errors import UserError
from repmlp.io.model_file import atomic_write_text

log = logging.getLogger(__name__)

_SPEED_ONLY = ("device", "precision", "quick", "rows", "path", "tf32")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", type=Path, default=None, help="also write the Markdown to this file")
    add_force_argument(p)
    p.add_argument("--speed", action="store_true", help="measure the paper's speed tables on this machine")
    speed = p.add_argument_group("--speed options")
    speed.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:N or auto (default: auto, CUDA when available)"
    )
    speed.add_argument("--precision", nargs="+", choices=("fp32", "fp16", "bf16"), default=None, help="time the "
                       "converted models in these precisions (fp16/bf16: weights and input cast, channels_last; "
                       "default: fp32)")  # fmt: skip
    speed.add_argument("--quick", action="store_true", help="batch 1 and one timed pass per row: every row in "
                       "minutes on a CPU")  # fmt: skip
    speed.add_argument("--rows", nargs="+", metavar="TEXT", default=None, help="only the rows whose label, model or "
                       "table contains one of these (e.g. c4 face), with the references of their ratios")  # fmt: skip
    speed.add_argument("--path", choices=sorted(SPEED_PATHS), default=None, help="how the converted models run "
                       "(repmlp.bench.speed_tables.SPEED_PATHS; default: eager)")  # fmt: skip
    speed.add_argument("--tf32", action="store_true", help="let fp32 timings use TF32 (off by default, as on the "
                       "paper's GPU)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    check_output_file(args.output, force=args.force)
    if not args.speed:
        given = [f"--{name}" for name in _SPEED_ONLY if getattr(args, name) not in (None, False)]
        if given:
            raise UserError(f"{', '.join(given)} apply to the speed tables: add --speed")
        text = render_tables()
    else:
        text, ok = _speed(args)
    text = text if text.endswith("\n") else text + "\n"
    print(text, end="")
    if args.output is not None:
        atomic_write_text(args.output, text)
    return 0 if not args.speed or ok else 1


def _speed(args: argparse.Namespace) -> tuple[str, bool]:
    """The speed tables' Markdown, and whether every row was measured and passed its check."""
    rows = speed_rows(args.rows)
    if not rows:
        raise UserError(f"--rows {' '.join(args.rows)}: no speed row matches (see `repmlp tables --speed`)")
    opts = SpeedOptions(device=resolve_device(args.device or "auto"), precisions=tuple(dict.fromkeys(
        args.precision or ["fp32"])), quick=args.quick, path=args.path or "eager", tf32=args.tf32)  # fmt: skip
    results = measure_speed_rows(rows, opts)
    command = "repmlp " + " ".join(shlex.quote(a) for a in args.argv)
    text = render_speed_tables(results, opts, note=f"{describe(opts)} Command: `{command}`.")
    bad = [r.label for r, res in results if res.error or not res.check_ok]
    if bad:
        log.error(
            "%d row(s) failed their conversion check or could not be measured: %s", len(bad), ", ".join(bad)
        )
    return text, not bad
