"""The paper's speed tables (Tables 2-6 and Appendix A) measured on this machine: ``repmlp tables --speed``.

For each row of :data:`repmlp.bench.tables.PAPER_ROWS` with a paper speed (one 1080Ti, batch 128; face 512,
PSPNet 16), :func:`measure_speed_rows` builds the training-time model with random weights and BatchNorm
statistics, converts and checks it in full float32 (:func:`repmlp.deploy.conversion.convert_and_check`) and
times it at the paper's batch and input: float32 without TF32 by default (the 1080Ti has none), fp16/bf16
with model and input cast, channels_last, ``cudnn.benchmark`` on CUDA; ratios to :func:`speed_reference`.
A converted model runs by a *path* of :data:`SPEED_PATHS`, ``prepare(model, example) -> callable``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from repmlp.bench.tables import PAPER_ROWS, TABLE_TITLES, PaperRow
from repmlp.bench.throughput import cudnn_benchmark
from repmlp.bench.timing import time_rounds
from repmlp.deploy.conversion import CONVERSION_RTOL, convert_and_check
from repmlp.deploy.gpu import prepare_fast
from repmlp.deploy.precision import DTYPES
from repmlp.engine import hardware_summary
from repmlp.errors import first_line
from repmlp.models import create_model
from repmlp.numerics import full_float32

__all__ = ["SPEED_TABLES", "SPEED_PATHS", "SpeedOptions", "SpeedResult", "speed_rows", "speed_reference",
           "paper_batch", "measure_speed_rows", "render_speed_tables", "time_path"]  # fmt: skip

log = logging.getLogger(__name__)

SPEED_TABLES = ("c4_rg", "stages", "comparisons", "light", "face", "seg")
_BATCH = {"face": 512, "seg": 16}  # the paper's batch per table; 128 elsewhere
_REFERENCE = {"c4_rg": "Original Res50", "stages": "Original Res50", "comparisons": "ResNet-50",
              "light": "Original", "face": "MobileFaceNet", "seg": "ResNet-50"}  # fmt: skip

Prepare = Callable[[nn.Module, Tensor], Callable[[Tensor], Tensor]]


#: Inference paths by name. ``eager``: the module called as it is; ``fast``: the path measured fastest for the
#: device and precision (:func:`repmlp.deploy.gpu.fastest_path`).
SPEED_PATHS: dict[str, Prepare] = {"eager": lambda model, example: model, "fast": prepare_fast}


@dataclass(frozen=True)
class SpeedOptions:
    """How :func:`measure_speed_rows` measures. ``quick``: batch 1, one short round (every row on a CPU in
    minutes; the figures then only show that each row runs)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    precisions: tuple[str, ...] = ("fp32",)
    quick: bool = False
    path: str = "eager"
    tf32: bool = False  # let float32 timings use TF32 (the check never does)
    warmup: int = 3
    rounds: int = 3
    round_seconds: float = 0.33  # each round repeats the batch for at least this long

    def batch(self, row: PaperRow) -> int:
        return 1 if self.quick else paper_batch(row)


@dataclass
class SpeedResult:
    """One measured model (shared by the rows of the same structure, input and batch): ``speed`` maps
    precision -> examples/s; ``error`` says why a row has no figures (out of memory, say)."""

    batch: int
    check_rel_diff: float = float("nan")
    speed: dict[str, float] = field(default_factory=dict)
    error: str = ""

    @property
    def check_ok(self) -> bool:
        return self.check_rel_diff <= CONVERSION_RTOL


def paper_batch(row: PaperRow) -> int:
    """The batch size the paper timed ``row`` at."""
    return _BATCH.get(row.table, 128)


def speed_rows(patterns: Sequence[str] | None = None) -> list[PaperRow]:
    """The rows with a paper speed, in table order; with ``patterns``, those whose label, model or table
    contains one of them (case-insensitive), plus the references their ratios need."""
    rows = [r for t in SPEED_TABLES for r in PAPER_ROWS if r.table == t and r.speed is not None]
    if not patterns:
        return rows
    wanted = [p.lower() for p in patterns]
    chosen = [r for r in rows if any(p in f"{r.table} {r.label} {r.call}".lower() for p in wanted)]
    return [r for r in rows if any(r is c or speed_reference(c) is r for c in chosen)]


def speed_reference(row: PaperRow) -> PaperRow:
    """The row ``row``'s speed ratio is taken to: ResNet-50 of its table (torchvision's at the same input
    in the comparisons table, at 320 for the EfficientNets), MobileFaceNet, PSPNet with ResNet-50."""
    size = 224 if row.input_size == 224 else 320
    return next(r for r in PAPER_ROWS if r.table == row.table and r.label == _REFERENCE[row.table]
                and (row.table != "comparisons" or r.input_size == size))  # fmt: skip


def time_path(fn: Callable[[Tensor], Tensor], x: Tensor, opts: SpeedOptions) -> float:
    """Seconds per batch of ``fn(x)``: the median over ``opts.rounds`` rounds of at least
    ``opts.round_seconds`` after ``opts.warmup`` untimed passes (``opts.quick``: one pass after one), by
    :func:`repmlp.bench.timing.time_rounds`."""
    warmup, rounds, seconds = (1, 1, 0.0) if opts.quick else (opts.warmup, opts.rounds, opts.round_seconds)
    with torch.inference_mode():
        per_pass = time_rounds({"path": lambda: fn(x)}, x.device, rounds=rounds, warmup=warmup,
                               min_round_s=seconds)  # fmt: skip
    return statistics.median(per_pass["path"])


def _build(row: PaperRow) -> nn.Module:
    """``row``'s training-time model (eval mode), seeded, with random BatchNorm statistics and affine
    parameters, so that folding them is not a no-op."""
    torch.manual_seed(0)
    model = create_model(row.model, **row.kwargs)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                n = m.num_features
                m.running_mean.copy_(torch.rand(n, generator=gen) * 0.2 - 0.1)
                m.running_var.copy_(torch.rand(n, generator=gen) * 1.5 + 0.5)
                if m.affine:
                    m.weight.copy_(torch.rand(n, generator=gen) * 0.5 + 0.75)
                    m.bias.copy_(torch.rand(n, generator=gen) * 0.2 - 0.1)
    return model.eval()


def _time_precisions(deployed: nn.Module, x: Tensor, opts: SpeedOptions) -> dict[str, float]:
    """examples/s of ``deployed`` on ``x`` in each of ``opts.precisions``."""
    prepare = SPEED_PATHS[opts.path]
    speed = {}
    for precision in opts.precisions:
        if precision == "fp32":
            net, inp = deployed, x
        else:  # the way GPUs serve: weights and activations in the dtype, channels_last
            dtype = DTYPES[precision]
            net = copy.deepcopy(deployed).to(dtype=dtype, memory_format=torch.channels_last)
            inp = x.to(dtype=dtype, memory_format=torch.channels_last)
        with full_float32() if precision == "fp32" and not opts.tf32 else contextlib.nullcontext():
            speed[precision] = len(x) / time_path(prepare(net, inp), inp, opts)
        del net
    return speed


def _measure(row: PaperRow, model: nn.Module, opts: SpeedOptions) -> SpeedResult:
    """Convert, check (on the first two images of the timed batch ``(N, 3, S, S)``) and time ``row``'s
    training-time ``model`` (CPU, eval mode)."""
    batch, size = opts.batch(row), row.input_size
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1)).to(opts.device)
    check = convert_and_check(model.to(opts.device), x[: min(batch, 2)])
    return SpeedResult(batch, check.diff.max_rel_diff, _time_precisions(check.deployed, x, opts))


def measure_speed_rows(rows: Sequence[PaperRow], opts: SpeedOptions) -> list[tuple[PaperRow, SpeedResult]]:
    """Every row measured (module docstring), rows of the same module tree, input and batch once; a row
    that fails (out of memory, say) gets its error instead of figures, and the others go on."""
    done: dict[tuple, SpeedResult] = {}
    results: list[tuple[PaperRow, SpeedResult]] = []
    with cudnn_benchmark(opts.device):  # on CUDA: the paper's practice
        for i, row in enumerate(rows, 1):
            try:
                model = _build(row)
                key = (repr(model), row.input_size, opts.batch(row))
                if key not in done:
                    done[key] = _measure(row, model, opts)
                res = done[key]
            except Exception as exc:  # noqa: BLE001 - one row's failure is reported in its row
                log.debug("%s failed", row.label, exc_info=True)
                name = type(exc).__name__
                error = "out of memory" if name == "OutOfMemoryError" else f"{name}: {first_line(exc)[:160]}"
                res = SpeedResult(opts.batch(row), error=error)
            finally:
                model = None
                if opts.device.type == "cuda":
                    torch.cuda.empty_cache()
            results.append((row, res))
            figures = res.error or ", ".join(f"{p} {v:,.1f}/s" for p, v in res.speed.items())
            title = TABLE_TITLES[row.table].split(" (")[0]
            log.info("[%d/%d] %s: %s @%d, batch %d: check %.1e; %s", i, len(rows), title, row.label,
                     row.input_size, res.batch, res.check_rel_diff, figures)  # fmt: skip
    return results


def _ratio(value: float | None, reference: float | None) -> str:
    return f"{value / reference:.2f}x" if value and reference else "-"


def _speed_cell(value: float | None, *, paper: bool = False) -> str:
    """examples/s: the paper's figure as printed (5,002; 10.43), ours to the unit above 100, else 3 digits."""
    if value is None:
        return "-"
    return f"{value:,g}" if paper else f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def render_speed_tables(
    results: Sequence[tuple[PaperRow, SpeedResult]], opts: SpeedOptions, *, note: str = ""
) -> str:
    """The measured rows as Markdown, one table per paper table: examples/s and the ratio to the row's
    reference in each precision, beside the paper's examples/s and ratio."""
    parts = []
    for table in SPEED_TABLES:
        rows = [(r, res) for r, res in results if r.table == table]
        if not rows:
            continue
        head = ["Model", "Built as", "Input", "Batch", "Check (rel. diff)", "Paper examples/s", "Paper ratio"]
        for p in opts.precisions:
            head += [f"{p} examples/s", f"{p} ratio"]
        lines = [f"### {TABLE_TITLES[table]}: speed", "", "| " + " | ".join(head) + " |",
                 "|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|"]  # fmt: skip
        for row, res in rows:
            ref = speed_reference(row)
            ref_res = next((m for r, m in results if r is ref), None)
            measured = res.check_rel_diff == res.check_rel_diff  # not NaN
            check = f"{res.check_rel_diff:.1e}" + ("" if res.check_ok else " FAILED") if measured else "-"
            cells = [row.label, f"`{row.call}`", str(row.input_size), str(res.batch), check,
                     _speed_cell(row.speed, paper=True), _ratio(row.speed, ref.speed)]  # fmt: skip
            for p in opts.precisions:
                ours = res.speed.get(p)
                cells += [_speed_cell(ours) if not res.error else res.error,
                          _ratio(ours, ref_res.speed.get(p) if ref_res else None)]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        ref_names = sorted({f"{speed_reference(r).label} @{speed_reference(r).input_size}" for r, _ in rows})
        lines += ["", f"Ratios to {', '.join(ref_names)}."]
        parts.append("\n".join(lines))
    return (note + "\n\n" if note else "") + "\n\n".join(parts) + "\n"


def describe(opts: SpeedOptions) -> str:
    """How the figures were measured, in one paragraph (above the tables)."""
    how = (f"the paper's batch, median of {opts.rounds} rounds of at least {opts.round_seconds:g} s after "
           f"{opts.warmup} warm-up passes")  # fmt: skip
    if opts.quick:
        how = "batch 1, one timed pass after one warm-up pass (--quick: the figures only show that each row runs)"
    tf32 = "fp32 (TF32 " + ("allowed" if opts.tf32 else "off") + ")"
    precisions = ", ".join(tf32 if p == "fp32" else f"{p} (weights and input cast, channels_last)"
                           for p in opts.precisions)  # fmt: skip
    bench = ", cudnn.benchmark on" if opts.device.type == "cuda" else ""
    return (
        f"Converted models (random weights and BatchNorm statistics), checked against the training-time "
        f"form in full float32 (tolerance {CONVERSION_RTOL:g} of the output scale), timed on "
        f"{hardware_summary(opts.device)}: {precisions}; path `{opts.path}`{bench}; {how}. Paper: one 1080Ti."
    )
