"""The end of a classification run (``repmlp train``): evaluate, convert, verify, benchmark, export, report.

:func:`finish_run` writes into the run folder ``model.safetensors`` (training-time form), ``deploy.safetensors``
(converted; loaded back with ``deploy=True`` for the checks), ``deploy.onnx``, ``curves.png``, ``fc3.png`` and
``report.md``."""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from repmlp.bench.throughput import benchmark, render_markdown
from repmlp.bench.viz import find_repmlp_blocks, plot_fc3
from repmlp.deploy import export  # looked up when called: tests replace export.missing_onnx_packages
from repmlp.deploy.conversion import CONVERSION_RTOL
from repmlp.engine import METRICS_FILE, STATE_FILE, amp_dtype, hardware_summary, progress
from repmlp.engine.report import save_figure
from repmlp.errors import first_line
from repmlp.io.model_file import atomic_write_text
from repmlp.numerics import run_precision
from repmlp.tasks._common import results, save_forms
from repmlp.tasks.classification_config import TrainResult
from repmlp.tasks.finetune import report_lines
from repmlp.tasks.metrics import accuracy

__all__ = ["Outcome", "finish_run", "predict", "render_report"]

log = logging.getLogger(__name__)


@torch.no_grad()
def logit_batches(
    model: nn.Module, loader, device: torch.device, *, amp: bool = False, show: bool = True
) -> Iterator[tuple[Tensor, Tensor]]:
    """``(logits (B, K) float32, labels (B,))`` of each of this process's batches of ``loader``, ``model`` in
    eval mode (autocast with ``amp``); ``show``: a progress bar."""
    model.eval()
    with progress(loader.batches(0), len(loader), "eval", show) as bar:
        for x, y in bar:
            with torch.autocast(device.type, dtype=amp_dtype(device), enabled=amp):
                yield model(x).float(), y


def predict(model: nn.Module, loader, device: torch.device, *, amp: bool = False) -> tuple[Tensor, Tensor]:
    """Logits ``(N, K)`` (float32, CPU) and labels ``(N,)`` of every example of ``loader`` on this process."""
    pairs = [
        (logits.cpu(), y.cpu()) for logits, y in logit_batches(model.to(device), loader, device, amp=amp)
    ]
    return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])


def plot_curves(history: list[dict[str, Any]], path: Path, title: str) -> None:
    """Loss and top-1 accuracy per epoch (train and validation) as a PNG, written atomically."""
    from matplotlib.figure import Figure  # slow to import (half a second): `repmlp train --help` needs none

    epochs = [r["epoch"] for r in history]
    fig = Figure(figsize=(10, 4))
    # The training loss includes label smoothing (and mixup), so it can sit above the validation loss.
    for ax, (train, val, ylabel, name) in zip(fig.subplots(1, 2), [
        (("train_loss", "train (as optimised)"), ("val_loss", "validation"), "cross-entropy loss", "loss"),
        (("train_acc", "train"), ("val_top1", "validation top-1"), "accuracy (%)", "accuracy"),
    ], strict=True):  # fmt: skip
        for (key, label), marker in ((train, "o-"), (val, "s-")):
            ax.plot(epochs, [r[key] for r in history], marker, label=label)
        ax.set(xlabel="epoch", ylabel=ylabel, title=name)
        ax.locator_params(axis="x", integer=True)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def _optional(name: str, fn, outcome: Outcome):
    """Run an optional final step; a failure is logged and noted in the report instead of aborting."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the run's weights are saved; report what failed
        msg = first_line(exc)
        log.error("%s failed: %s", name, msg)
        outcome.notes.append(f"{name} failed: {msg}")
        outcome.failed.append(name)
        return None


@dataclass
class Outcome:
    """What the end of a run measured: both forms' accuracies, the conversion check and the optional steps'
    results (``notes``: what was skipped or failed)."""

    train_acc: dict[str, float]
    dep_acc: dict[str, float]
    cmp: dict[str, float]
    convert_s: float
    bench: tuple[list[Any], str] | None = None  # benchmark rows and their markdown table
    onnx_diff: float | None = None
    fc3_sample: Any = None
    notes: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # the optional steps that raised
    total_s: float = 0.0

    @property
    def equivalent(self) -> bool:
        # No separate test on changed predictions: a flip moves two logits' difference by at least their
        # margin, so with every logit within max_abs_diff only pairs tied within 2 * max_abs_diff can flip.
        return self.cmp["max_rel_diff"] <= CONVERSION_RTOL


def finish_run(result: TrainResult, started: float) -> bool:
    """Evaluate, convert, verify, benchmark, export and report (the main process; ``started``: the run's
    ``time.perf_counter()``). Returns whether every check passed."""
    cfg = result.config
    out, size = Path(cfg.output), _input_size(result)
    model, deployed, outcome = _convert_and_check(result)
    if not cfg.no_bench:
        outcome.bench = _optional("benchmark", lambda: _benchmark(result, model), outcome)
    if not cfg.no_export:
        outcome.onnx_diff = _export(out, deployed, size, outcome)
    outcome.fc3_sample = _optional("FC3 figure", lambda: _fc3(result, model, outcome.notes), outcome)
    curves = f"{cfg.model} on {cfg.dataset}"
    _optional("training curves", lambda: plot_curves(result.history, out / "curves.png", curves), outcome)
    outcome.total_s = time.perf_counter() - started
    atomic_write_text(
        out / "report.md", render_report(result, outcome, cfg.run_command or ["repmlp", "train"])
    )
    results.info("run folder: %s (report.md); total %.0f s", out, outcome.total_s)
    return outcome.equivalent and len(set(result.replica_hashes)) == 1 and not outcome.failed


def _benchmark(result: TrainResult, model: nn.Module) -> tuple[list[Any], str]:
    rows = benchmark({result.config.model: model}, _input_size(result), result.config.bench_batch_size,
                     device=result.dist_info.device, warmup=3, repeats=10)  # fmt: skip
    return rows, render_markdown(rows)


def _input_size(result: TrainResult) -> tuple[int, int, int]:
    return (result.data.in_chans, result.data.img_size, result.data.img_size)


def _convert_and_check(result: TrainResult) -> tuple[nn.Module, nn.Module, Outcome]:
    """Save both forms and evaluate both on the whole validation set in full float32 (no AMP, no TF32, whatever
    the run trained with: their rounding would hide or fake conversion errors): ``(model, deployed, outcome)``,
    ``deployed`` as loaded back from ``deploy.safetensors`` (:func:`repmlp.deploy.conversion.convert_and_check`)."""
    cfg, data = result.config, result.data
    out, device = Path(cfg.output), result.dist_info.device
    val = copy.copy(data.val)  # the main process alone ends the run: the whole validation set, not its shard
    val.rank, val.world = 0, 1
    # Recorded so that eval / convert of these files find the data without --data-dir, and every command
    # reads images for them as the run evaluated its own.
    extra = {"dataset": cfg.dataset, "data_dir": str(Path(cfg.data_dir).resolve()) if cfg.data_dir else None,
             "classes": data.classes, "input_size": list(_input_size(result)),
             "eval_preprocessing": data.eval_preprocessing}  # fmt: skip
    model = result.model.float().to(memory_format=torch.contiguous_format).eval()
    labels: list[Tensor] = []

    def logits(form: nn.Module) -> Tensor:
        """``(N, K)`` logits of the whole validation set (its labels ``(N,)`` kept from the first run)."""
        out_logits, y = predict(form, val, device)
        if not labels:
            labels.append(y)
        return out_logits

    log.info("evaluating the training-time and the converted model ...")
    check = save_forms(out, model, cfg.model, result.model_kwargs, extra, logits, device)
    outcome = Outcome(accuracy(check.reference, labels[0]), accuracy(check.outputs, labels[0]),
                      check.diff.as_dict(), check.seconds)  # fmt: skip
    cmp, verdict = outcome.cmp, "equivalent" if outcome.equivalent else "NOT EQUIVALENT"
    results.info("top-1 %.2f%% (training-time) vs %.2f%% (converted); max |logit diff| %.2e (relative %.2e), "
                 "%d predictions changed -> %s", outcome.train_acc["top1"], outcome.dep_acc["top1"],
                 cmp["max_abs_diff"], cmp["max_rel_diff"], cmp["changed_predictions"], verdict)  # fmt: skip
    return model, check.deployed, outcome


def _export(out: Path, deployed: nn.Module, size: tuple[int, int, int], outcome: Outcome) -> float | None:
    """``deploy.onnx`` (its onnxruntime difference relative to the output scale); skipped with a note without
    the optional packages (the run itself succeeded)."""
    missing = export.missing_onnx_packages()
    if missing:
        msg = f"ONNX export skipped: {', '.join(missing)} not installed (pip install 'repmlp[export]')"
        log.warning("%s", msg)
        outcome.notes.append(msg)
        return None
    # force: the run folder is the run's own (an end redone after a kill finds its earlier external data)
    return _optional(
        "ONNX export", lambda: export.export_onnx(deployed, out / "deploy.onnx", size, force=True), outcome
    )


def _fc3(result: TrainResult, model: nn.Module, notes: list[str]):
    if not find_repmlp_blocks(model):
        notes.append("FC3 figure skipped: the model has no RepMLP block")
        return None
    title = f"{result.config.model}: FC3 before / after merging the Local Perceptron"
    return plot_fc3(model, Path(result.config.output) / "fc3.png", title=title)


def render_report(result: TrainResult, outcome: Outcome, command: list[str]) -> str:
    """``report.md`` of a finished run (markdown)."""
    lines = [*_summary_lines(result, outcome, command), *_accuracy_lines(outcome), *_curve_lines(result)]
    lines += _speed_lines(outcome.bench) + _file_lines(result, outcome)
    if outcome.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in outcome.notes]
    return "\n".join(lines) + "\n"


def _summary_lines(result: TrainResult, outcome: Outcome, command: list[str]) -> list[str]:
    cfg, hashes, procs, data = result.config, result.replica_hashes, result.dist_info, result.data
    return [
        f"# repmlp run: {cfg.model} on {cfg.dataset}",
        "",
        f"- Command: `{' '.join(command)}`",
        *[f"- Resumed with: `{' '.join(again)}`" for again in cfg.resumed_with],
        f"- Hardware: {hardware_summary(procs.device)}"
        + (f"; {procs.world} processes (DDP)" if procs.enabled else ""),
        f"- Finished: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"- Data: {data.train.num_samples} training / {data.val.num_samples} validation examples"
        + (f" ({'; '.join(data.notes)})" if data.notes else ""),
        f"- Recipe (preset `{cfg.preset}`): {cfg.epochs} epochs, batch {cfg.batch_size}, {cfg.optimizer} "
        f"lr {cfg.lr:g} ({cfg.schedule}, warm-up {cfg.warmup_epochs:g} epochs, to {cfg.min_lr:g}), momentum "
        f"{cfg.momentum:g}, weight decay {cfg.weight_decay:g}, label smoothing {cfg.label_smoothing:g}, mixup "
        f"{cfg.mixup:g}, crop padding {cfg.pad}, flip {cfg.flip}, autoaugment {cfg.autoaugment}, seed {cfg.seed}",
        f"- Model options: `{result.model_kwargs}`",
        f"- Precision: training and the per-epoch validation of the training curve in "
        f"{run_precision(procs.device, bool(cfg.amp), amp_dtype(procs.device))}; "
        "the accuracies of both forms and the conversion check in full float32 (no autocast, no TF32)",
        *report_lines(result.init),
        f"- Replicas: {len(hashes)} process(es), final weights sha256 "
        + ", ".join(f"rank {r}: `{h[:16]}`" for r, h in enumerate(hashes))
        + (" (identical)" if len(set(hashes)) == 1 else " (DIFFERENT)"),
        f"- Time: training {sum(r['epoch_s'] for r in result.history):.0f} s (this process: "
        f"{result.train_seconds:.0f} s; {result.mode} training step), whole command {outcome.total_s:.0f} s",
    ]


def _accuracy_lines(outcome: Outcome) -> list[str]:
    train, dep, cmp = outcome.train_acc, outcome.dep_acc, outcome.cmp
    return ["", "## Accuracy", "", "Both forms on the whole validation set in full float32 (no autocast, no TF32):",
            "", "| form | top-1 (%) | top-5 (%) |", "|---|---|---|",
            f"| training-time (`model.safetensors`) | {train['top1']:.2f} | {train['top5']:.2f} |",
            f"| converted (`deploy.safetensors`) | {dep['top1']:.2f} | {dep['top5']:.2f} |", "",
            f"Conversion ({outcome.convert_s:.2f} s): max |logit difference| {cmp['max_abs_diff']:.2e} (relative "
            f"{cmp['max_rel_diff']:.2e}), {cmp['changed_predictions']} of {train['n']} predictions changed: "
            f"**{'equivalent' if outcome.equivalent else 'NOT equivalent'}** (tolerance {CONVERSION_RTOL:g} "
            "relative)."]  # fmt: skip


def _curve_lines(result: TrainResult) -> list[str]:
    return ["", "## Training curve", "", "![curves](curves.png)", "",
            "| epoch | lr | train loss | train acc (%) | val loss | val top-1 (%) | val top-5 (%) | time (s) |",
            "|---|---|---|---|---|---|---|---|"] + [
        f"| {r['epoch']} | {r['lr']:.4g} | {r['train_loss']:.4f} | {r['train_acc']:.2f} | {r['val_loss']:.4f} | "
        f"{r['val_top1']:.2f} | {r['val_top5']:.2f} | {r['epoch_s']:.0f} |" for r in result.history]  # fmt: skip


def _speed_lines(bench: tuple[list[Any], str] | None) -> list[str]:
    """The report's speed section: the table of both forms, with its caveat when the timings call for one
    (:func:`repmlp.bench.throughput.render_markdown`: the same words the run logged)."""
    if not bench:
        return ["", "## Speed", "", "not measured"]
    rows, table = bench
    r = rows[0]
    return ["", "## Speed", "", f"Batch {r.batch_size}, input {tuple(r.input_size)}, {r.device}; both forms timed "
            "in interleaved rounds (one pass of each a round, the median pass reported):", "", table]  # fmt: skip


def _file_lines(result: TrainResult, outcome: Outcome) -> list[str]:
    out, diff = Path(result.config.output), outcome.onnx_diff
    block = getattr(outcome.fc3_sample, "block_name", None)
    checked = isinstance(diff, float) and math.isfinite(diff)
    files = {
        "model.safetensors": "training-time weights (`repmlp eval --checkpoint`)",
        "deploy.safetensors": "converted weights, loads into `create_model(..., deploy=True)`",
        "deploy.onnx": "ONNX of the converted model"
        + (f" (onnxruntime max diff {diff:.2e} of the output scale)" if checked else ""),
        STATE_FILE: "training state for `--resume`",
        METRICS_FILE: "per-epoch metrics",
        "curves.png": "training curves",
        "fc3.png": "FC3 before / after merging the Local Perceptron"
        + (f" (block `{block}`)" if block else ""),
    }
    lines = ["", "## Files", ""] + [f"- `{f}`: {what}" for f, what in files.items() if (out / f).exists()]
    return lines + (["", "![FC3](fc3.png)"] if (out / "fc3.png").exists() else [])
