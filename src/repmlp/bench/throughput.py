"""Throughput of training-time and deployed forms side by side, as a Markdown table like the paper's:
examples/s at a fixed batch in inference, with each form's parameters and multiply-accumulates. Every model
and form of one call runs the same way, as timm's ``benchmark.py`` runs its models, and all are timed in one
series of interleaved rounds (:func:`repmlp.bench.timing.time_rounds`): a drift in the machine's load hits
them alike, and each row's speed ratio to the first model's is taken round by round.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from timm.data import resolve_model_data_config
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from repmlp.bench.counts import profile, profile_model
from repmlp.bench.timing import time_rounds
from repmlp.deploy.precision import precision_of, to_precision
from repmlp.deploy.runtimes import RuntimeModel, to_runtime
from repmlp.errors import UserError, first_line
from repmlp.io.model_file import ModelMetadata, load_model
from repmlp.models import build_model, check_forward
from repmlp.nn.convert import reparameterize_model

__all__ = ["BenchRow", "benchmark", "render_markdown", "models_to_bench", "in_precision", "timing_caveat",
           "run_path"]  # fmt: skip

log = logging.getLogger(__name__)


@dataclass
class BenchRow:
    """One measured model form. ``throughput`` is examples/second (median over the repeats)."""

    model: str
    form: str  # "train" (training-time structure, eval mode) or "deploy"
    input_size: tuple[int, ...]  # (C, H, W)
    batch_size: int
    device: str
    params: int
    macs: int
    throughput: float
    latency_ms: float  # median time of one batch
    spread: float = 0.0  # interquartile range of the batch times / their median
    path: str = ""  # how it ran (run_path): "eager, NCHW, fp32, BN fused"
    # Its speed over the first model's in the same form: the median of the per-round ratios, and their
    # quartiles (None: one model timed, or the first model has no row of this form).
    vs_first: float | None = None
    vs_first_quartiles: tuple[float, float] | None = None


@dataclass
class _Form:
    """One form to time: its model's name, ``"train"`` or ``"deploy"``, the module (a copy), its counts."""

    name: str
    form: str
    module: nn.Module
    params: int
    macs: int


def benchmark(models: Mapping[str, nn.Module], input_size: Sequence[int], batch_size: int, *,
              device: str | torch.device = "cpu", warmup: int = 3, repeats: int = 10,
              forms: Sequence[str] = ("train", "deploy"), runtime: str = "torch", channels_last: bool = False,
              compile_backend: str | None = None) -> list[BenchRow]:  # fmt: skip
    """One :class:`BenchRow` per model and form of ``forms``, in input order, timed in interleaved rounds.

    ``models``: name -> model (training-time; one already deployed is measured as ``deploy`` only), copied.
    The input ``(batch_size, *input_size)`` is cast to each form's parameter dtype; ``warmup`` untimed passes,
    then ``repeats`` timed ones (the row reports the median). ``channels_last``: weights and input in that
    layout; ``compile_backend``: each form through ``torch.compile``, compiled before the warm-up, untimed;
    ``runtime``: ``"torch"``, or an ONNX runtime (:func:`repmlp.deploy.runtimes.to_runtime`, CPU only).
    """
    if batch_size < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"need batch_size >= 1, repeats >= 1 and warmup >= 0, got batch_size={batch_size}, "
                         f"repeats={repeats}, warmup={warmup}")  # fmt: skip
    device = torch.device(device)
    if runtime != "torch" and (device.type != "cpu" or channels_last or compile_backend):
        raise ValueError(f"runtime {runtime!r} runs NCHW graphs on the CPU; device {device}, channels_last and "
                         "compile_backend are for runtime 'torch'")  # fmt: skip
    input_size = tuple(int(s) for s in input_size)
    x = torch.randn(batch_size, *input_size, generator=torch.Generator().manual_seed(0))
    variants = _forms(models, forms, input_size)
    with torch.inference_mode(), cudnn_benchmark(device):
        runs = [_prepare(v, x, device, runtime, channels_last, compile_backend) for v in variants]
        # One pass of every form a round: a drift in the machine's load hits every form alike.
        passes = {i: functools.partial(fn, inp) for i, (fn, inp, _) in enumerate(runs)}
        times = list(time_rounds(passes, device, rounds=repeats, warmup=warmup).values())
    rows = [_row(v, t, batch_size, input_size, device, path) for v, t, (_, _, path) in zip(variants, times, runs,
                                                                                         strict=True)]  # fmt: skip
    if len(models) > 1:
        _ratios_to_first(rows, times, next(iter(models)))
    for r in rows:
        log.info("%s (%s, %s): %.1f examples/s (spread %.0f%%)", r.model, r.form, r.path, r.throughput,
                 100 * r.spread)  # fmt: skip
    caveat = timing_caveat(rows)
    if caveat:
        log.warning("%s", caveat)
    return rows


@contextlib.contextmanager
def cudnn_benchmark(device: torch.device) -> Iterator[None]:
    """cuDNN's autotuner on for CUDA timings (timm's benchmark.py does so too), restored afterwards."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = before or device.type == "cuda"
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def run_path(module: nn.Module, form: str, *, channels_last: bool = False, compile_backend: str | None = None,
             runtime: str = "torch") -> str:  # fmt: skip
    """How ``module`` (a ``form``) runs, as the table's Path column says it: ``"eager, NCHW, fp32, BN fused"``,
    ``"compiled, channels_last, bf16, BN fused"``; ``"onnxruntime, NCHW, int8, BN fused"`` for a graph
    an ONNX runtime runs. "BN unfused" when BatchNorm modules are left, "no BN" for a training-time form
    without any."""
    bn = any(isinstance(m, _BatchNorm) for m in module.modules())
    fused = "BN unfused" if bn else "BN fused" if form == "deploy" else "no BN"
    if runtime != "torch" or isinstance(module, RuntimeModel):
        engine = runtime if runtime != "torch" else getattr(module, "runtime", "onnxruntime")
        return f"{engine}, NCHW, {precision_of(module)}, {fused}"
    how = "eager" if not compile_backend else "compiled" if compile_backend == "inductor" else (
        f"compiled ({compile_backend})")  # fmt: skip
    layout = "channels_last" if channels_last else "NCHW"
    return f"{how}, {layout}, {precision_of(module)}, {fused}"


def _prepare(v: _Form, x: Tensor, device: torch.device, runtime: str, channels_last: bool,
             compile_backend: str | None) -> tuple[Callable[[Tensor], Tensor], Tensor, str]:  # fmt: skip
    """``v``'s module ready to time on ``device``: ``(callable, its input, its path)``. The input ``x``
    ``(N, C, H, W)`` float32 is cast to the module's parameter dtype (the pre-hook of
    :func:`repmlp.deploy.precision.to_precision` that would cast it does not survive a copy of an fx graph),
    and put channels_last with the weights."""
    if runtime != "torch" or isinstance(v.module, RuntimeModel):  # an ONNX graph: float32 NCHW in
        return to_runtime(v.module, runtime, x.shape[1:]), x, run_path(v.module, v.form, runtime=runtime)
    param = next((p for p in v.module.parameters() if p.is_floating_point()), None)
    dtype = param.dtype if param is not None else torch.float32
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    net = v.module.to(device=device, memory_format=fmt)
    inp = x.to(device=device, dtype=dtype).contiguous(memory_format=fmt)
    path = run_path(net, v.form, channels_last=channels_last, compile_backend=compile_backend)
    if not compile_backend:
        return net, inp, path
    fn = torch.compile(net, backend=compile_backend)
    try:
        fn(inp)  # compiles now: the compile time is no part of the warm-up or the timed passes
    except Exception as exc:  # noqa: BLE001 - dynamo's and inductor's errors are many kinds
        raise UserError(f"--compile {compile_backend}: torch.compile of {v.name} ({v.form}) failed: "
                        f"{type(exc).__name__}: {first_line(exc)[:200]}") from None  # fmt: skip
    return fn, inp, path


def _row(v: _Form, t: Sequence[float], batch_size: int, input_size: tuple[int, ...], device: torch.device,
         path: str) -> BenchRow:  # fmt: skip
    """``v``'s row from its per-round pass times ``t`` (seconds)."""
    median, (q1, q3) = _median_quartiles(t)
    return BenchRow(v.name, v.form, input_size, batch_size, str(device), int(v.params), int(v.macs),
                    batch_size / median if median > 0 else math.inf, median * 1e3,
                    (q3 - q1) / median if median > 0 else 0.0, path)  # fmt: skip


def _ratios_to_first(rows: list[BenchRow], times: Sequence[Sequence[float]], first: str) -> None:
    """Set each row's ``vs_first``: its speed over ``first``'s row of the same form, round by round (the
    first model's pass time over the row's, in the same round), the median and quartiles of those ratios."""
    reference = {r.form: t for r, t in zip(rows, times, strict=True) if r.model == first}
    for row, t in zip(rows, times, strict=True):
        ref = reference.get(row.form)
        if ref is None:
            continue
        ratios = [a / b if b > 0 else math.inf for a, b in zip(ref, t, strict=True)]
        row.vs_first, row.vs_first_quartiles = _median_quartiles(ratios)


def _median_quartiles(values: Sequence[float]) -> tuple[float, tuple[float, float]]:
    median = statistics.median(values)
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (median, median, median)
    return median, (q1, q3)


def _forms(models: Mapping[str, nn.Module], forms: Sequence[str], input_size: tuple[int, ...]) -> list[_Form]:
    """Each model's ``forms``, on copies (eval mode), with their parameters and MACs."""
    variants = []
    for name, model in models.items():
        base = copy.deepcopy(model).eval()
        # Nothing would change on re-parameterization: no BatchNorm, no training-time branch.
        deployed_already = not any(getattr(m, "deploy", None) is False or isinstance(m, _BatchNorm)
                                   for m in base.modules())  # fmt: skip
        if "train" in forms and not deployed_already:
            variants.append(_Form(name, "train", base, *profile(base, input_size)))
        if "deploy" in forms:
            net = base if deployed_already else reparameterize_model(base)
            variants.append(_Form(name, "deploy", net, *profile(net, input_size)))
    return variants


# Spread (interquartile range / median of a form's pass times) above which the figures carry a caveat.
BUSY_SPREAD = 0.25


def timing_caveat(rows: Sequence[BenchRow]) -> str | None:
    """The caveat that must travel with ``rows``' figures (log, table, report), or ``None``: pass times
    spread by more than :data:`BUSY_SPREAD`, or a deployed form slower than its training-time form (which runs
    the same layers and more), mean the timings measured the machine's load more than the models."""
    worst = max((r.spread for r in rows), default=0.0)
    train_speed = {r.model: r.throughput for r in rows if r.form == "train"}
    slower = [r.model for r in rows if r.form == "deploy" and r.throughput < train_speed.get(r.model, 0.0)]
    signs = []
    if worst > BUSY_SPREAD:
        signs.append(f"timings vary by up to {100 * worst:.0f}% between passes")
    if slower:
        signs.append(f"the deployed form measured slower than the training-time form ({', '.join(slower)})")
    if not signs:
        return None
    return (f"{'; '.join(signs)}: the machine is busy or the batches too short to time; the speeds and their "
            "ratio are not reliable here: rerun `repmlp bench` on an idle machine")  # fmt: skip


def _millions(n: int) -> str:
    m = n / 1e6  # the paper's precision (22.41M), more digits for tiny models (0.218M)
    return f"{m:.2f}" if m >= 1 else f"{m:.3f}"


def render_markdown(rows: Sequence[BenchRow], *, note: str | None = None) -> str:
    """A Markdown table like the paper's: params (M), MACs (M, the paper's "FLOPs"), examples/s, the spread
    (interquartile range of the batch times over their median), each deployed row's speed over its
    training-time row's, with more than one model each row's speed over the first model's in the same form
    (the median of the per-round ratios and their quartiles), and the path each row ran (:func:`run_path`);
    :func:`timing_caveat` and ``note`` (the hardware and flags, say) below."""
    train_speed = {r.model: r.throughput for r in rows if r.form == "train"}
    first = any(r.vs_first is not None for r in rows)
    head = (
        "| Model | Form | Input | Params (M) | MACs (M) | Batch | Speed (examples/s) | spread | vs. train |"
    )
    lines = [head + (" vs. first |" if first else "") + " Path |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if first else "") + "---|"]  # fmt: skip
    for r in rows:
        rel = train_speed.get(r.model)
        ratio = f"{r.throughput / rel:.2f}x" if r.form == "deploy" and rel else ""
        size = "x".join(str(s) for s in r.input_size)
        cells = [r.model, r.form, size, _millions(r.params), _millions(r.macs), str(r.batch_size),
                 f"{r.throughput:.1f}", f"{100 * r.spread:.0f}%", ratio]  # fmt: skip
        cells += [_ratio_cell(r)] if first else []
        lines.append("| " + " | ".join([*cells, r.path]) + " |")
    caveat = timing_caveat(rows)
    lines += ["", f"**Caveat:** {caveat}."] if caveat else []
    return "\n".join(lines + (["", note] if note else []))


def _ratio_cell(row: BenchRow) -> str:
    """``"1.23x (1.18-1.27)"``: the median per-round ratio and its quartiles (the median alone where they
    round alike); ``""`` without a ratio."""
    if row.vs_first is None:
        return ""
    q1, q3 = row.vs_first_quartiles or (row.vs_first, row.vs_first)
    spread = f" ({q1:.2f}-{q3:.2f})" if f"{q1:.2f}" != f"{q3:.2f}" else ""  # none: the reference itself, say
    return f"{row.vs_first:.2f}x{spread}"


def models_to_bench(
    names: Sequence[str] | None,
    checkpoints: Sequence[Path] | None,
    *,
    num_classes: int | None = None,
    in_chans: int | None = None,
    img_size: int | None = None,
) -> tuple[dict[str, nn.Module], tuple[int, ...], dict[str, str]]:
    """What ``repmlp bench`` times, registered ``names`` (random weights) or model files ``checkpoints``:
    name -> model (CPU, eval), the common input size ``(C, H, W)``, name -> form; models that take different
    input sizes, or not the given one, are a :class:`UserError`."""
    models: dict[str, nn.Module] = {}
    sizes: dict[str, tuple[int, ...]] = {}
    forms: dict[str, str] = {}
    if names:
        for name in dict.fromkeys(names):
            model, _ = build_model(name, num_classes=num_classes, in_chans=in_chans, img_size=img_size)
            model.eval()  # measured and exported as an inference model
            c, h, w = resolve_model_data_config(model)["input_size"]  # its timm cfg's, else 3x224x224
            size = (in_chans or c, img_size or h, img_size or w)
            models[name], sizes[name], forms[name] = model, size, "train"
    else:
        paths = list(dict.fromkeys(checkpoints or []))
        for path in paths:
            model = load_model(path, device="cpu")
            meta = model.metadata
            label = f"{meta.name} ({Path(path).name})" if len(paths) > 1 else meta.name
            models[label], sizes[label], forms[label] = model, meta.input_size_at(img_size), meta.form
            if meta.precision == "int8":
                model.profile_counts = _int8_counts(meta, sizes[label])
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{n}: {'x'.join(map(str, s))}" for n, s in sizes.items())
        raise UserError(f"the models take different input sizes ({listed}); pass --img-size or bench them "
                        "apart")  # fmt: skip
    input_size = next(iter(sizes.values()))
    for name, model in models.items():
        check_forward(model, input_size, name)
    return models, input_size, forms


def _int8_counts(meta: ModelMetadata, input_size: tuple[int, ...]) -> tuple[int, int]:
    """``(params, MACs)`` of an int8 file's model: its deployed float structure's (the ONNX graph holds the
    same weights in int8 but no PyTorch parameters), counted on the ``meta`` device."""
    kwargs = dict(meta.model_kwargs)
    kwargs.setdefault("in_chans", input_size[0])
    try:
        return profile_model(meta.name, tuple(input_size[1:]), deploy=True, **kwargs)
    except (TypeError, ValueError, RuntimeError) as exc:
        log.warning("%s: cannot count the int8 model's parameters (%s)", meta.name, exc)
        return 0, 0


def in_precision(model: nn.Module, precision: str, input_size: tuple[int, ...]) -> nn.Module:
    """The deployed ``model`` in ``precision``; a file already in a reduced precision stays as it is."""
    if precision_of(model) != "fp32":
        return model
    gen = torch.Generator().manual_seed(0)
    calibration = [torch.randn(8, *input_size, generator=gen)] if precision == "int8" else None
    try:
        deployed = reparameterize_model(model)
        counts = profile(deployed, input_size) if precision == "int8" else None
        reduced = to_precision(deployed, precision, calibration, input_size=input_size)
        if counts is not None:  # an ONNX graph: the deployed structure's parameters and MACs, in int8
            reduced.profile_counts = counts
        return reduced
    except (RuntimeError, ValueError) as exc:
        reason = first_line(exc)
        raise UserError(
            f"--precision {precision}: cannot build the model in {precision} ({reason})"
        ) from None
