"""Throughput of training-time and deployed forms side by side, as a Markdown table like the paper's:
examples/s at a fixed batch in inference, for each model as built (eval mode) and after
:func:`repmlp.reparameterize_model`, with each form's parameters and multiply-accumulates.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from repmlp.bench.counts import profile, profile_model
from repmlp.bench.timing import time_rounds
from repmlp.deploy.gpu import prepare_for_device
from repmlp.deploy.precision import precision_of, to_precision
from repmlp.deploy.runtimes import to_runtime
from repmlp.errors import UserError, first_line
from repmlp.io.model_file import ModelMetadata, load_model
from repmlp.models.registry import build_model, check_forward, default_input_size
from repmlp.nn.convert import reparameterize_model
from repmlp.speed import fast_inference

__all__ = ["BenchRow", "benchmark", "render_markdown", "models_to_bench", "in_precision", "timing_caveat"]

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


def benchmark(models: Mapping[str, nn.Module], input_size: Sequence[int], batch_size: int, *,
              device: str | torch.device = "cpu", warmup: int = 3, repeats: int = 10,
              forms: Sequence[str] = ("train", "deploy"), runtime: str = "torch", path: str = "auto",
              ) -> list[BenchRow]:  # fmt: skip
    """One :class:`BenchRow` per model and form of ``forms``, in input order.

    ``models``: name -> model (training-time; one already deployed is measured as ``deploy`` only), copied,
    never modified. ``input_size``: ``(C, H, W)``. ``warmup`` untimed passes, then ``repeats`` timed ones
    (the row reports the median). ``runtime``: ``"torch"`` (with the inference speed pass), or an ONNX
    runtime running each form's exported graph (:func:`repmlp.deploy.runtimes.to_runtime`, CPU only;
    parameters and MACs are the PyTorch model's). ``path``: how PyTorch runs on a GPU
    (:data:`repmlp.deploy.gpu.PATHS`; ``"auto"``: :func:`repmlp.deploy.gpu.fastest_path`).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    device = torch.device(device)
    if runtime != "torch" and device.type != "cpu":
        raise ValueError(f"runtime {runtime!r} runs on the CPU, not on {device}")
    input_size = tuple(int(s) for s in input_size)
    x = torch.randn(batch_size, *input_size, generator=torch.Generator().manual_seed(0)).to(device)
    variants = _forms(models, forms, input_size)
    nets = [to_runtime(v[2], runtime, input_size).to(device) for v in variants]
    if runtime == "torch":  # the inference speed pass, as repmlp predict runs the models
        nets = [fast_inference(net, batch_sizes=(batch_size,)) for net in nets]
    inputs = [x] * len(nets)
    if device.type == "cuda" and runtime == "torch":
        nets, inputs = map(list, zip(*[prepare_for_device(net, x, path) for net in nets], strict=True))
    # One pass of every form a round: a drift in the machine's load hits every form alike.
    passes = {i: functools.partial(net, inp) for i, (net, inp) in enumerate(zip(nets, inputs, strict=True))}
    with torch.inference_mode():
        times = time_rounds(passes, device, rounds=repeats, warmup=warmup).values()
    rows: list[BenchRow] = []
    for (name, form, _, params, macs), t in zip(variants, times, strict=True):
        median = statistics.median(t)
        q = statistics.quantiles(t, n=4) if len(t) > 1 else [median, median, median]
        rows.append(BenchRow(name, form, input_size, batch_size, str(device), int(params), int(macs),
                             batch_size / median if median > 0 else math.inf, median * 1e3,
                             (q[2] - q[0]) / median if median > 0 else 0.0))  # fmt: skip
        log.info(
            "%s (%s): %.1f examples/s (spread %.0f%%)", name, form, rows[-1].throughput, 100 * rows[-1].spread
        )
    caveat = timing_caveat(rows)
    if caveat:
        log.warning("%s", caveat)
    for net in nets:
        if isinstance(net, nn.Module):
            net.to("cpu")
    return rows


def _forms(models: Mapping[str, nn.Module], forms: Sequence[str], input_size: tuple[int, ...]) -> list[tuple]:
    """``(name, form, module, params, MACs)`` of each model's ``forms``, on copies (eval mode)."""
    variants = []
    for name, model in models.items():
        base = copy.deepcopy(model).eval()
        deployed_already = _is_deployed(base)
        if "train" in forms and not deployed_already:
            variants.append((name, "train", base, *profile(base, input_size)))
        if "deploy" in forms:
            net = base if deployed_already else reparameterize_model(base)
            variants.append((name, "deploy", net, *profile(net, input_size)))
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


def _is_deployed(model: nn.Module) -> bool:
    """True when nothing in ``model`` would change on re-parameterization (no BN, no training-time branch)."""
    bn = nn.modules.batchnorm._BatchNorm
    return not any(getattr(m, "deploy", None) is False or isinstance(m, bn) for m in model.modules())


def _millions(n: int) -> str:
    m = n / 1e6  # the paper's precision (22.41M), more digits for tiny models (0.218M)
    return f"{m:.2f}" if m >= 1 else f"{m:.3f}"


def render_markdown(rows: Sequence[BenchRow], *, note: str | None = None) -> str:
    """A Markdown table like the paper's: params (M), MACs (M, the paper's "FLOPs"), examples/s, the spread
    (interquartile range of the batch times over their median) and each deployed row's speed over its
    training-time row's; :func:`timing_caveat` and ``note`` (the hardware, say) below."""
    train_speed = {r.model: r.throughput for r in rows if r.form == "train"}
    lines = [
        "| Model | Form | Input | Params (M) | MACs (M) | Batch | Speed (examples/s) | spread | vs. train |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rel = train_speed.get(r.model)
        ratio = f"{r.throughput / rel:.2f}x" if r.form == "deploy" and rel else ""
        size = "x".join(str(s) for s in r.input_size)
        lines.append(
            f"| {r.model} | {r.form} | {size} | {_millions(r.params)} | {_millions(r.macs)} | {r.batch_size} "
            f"| {r.throughput:.1f} | {100 * r.spread:.0f}% | {ratio} |"
        )
    caveat = timing_caveat(rows)
    lines += ["", f"**Caveat:** {caveat}."] if caveat else []
    return "\n".join(lines + (["", note] if note else []))


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
            c, h, w = default_input_size(model)
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
