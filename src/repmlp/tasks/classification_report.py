"""The end of a classification run (``repmlp train``): evaluate, convert, verify, benchmark, export, report.

:func:`finish_run` takes the finished :class:`~repmlp.tasks.classification.TrainResult` and writes into the
run folder ``model.safetensors`` (training-time form), ``deploy.safetensors`` (converted; reloaded with
``deploy=True`` for the checks), ``deploy.onnx``, ``curves.png``, ``fc3.png`` and ``report.md``.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from repmlp.deploy.conversion import CONVERSION_RTOL
from repmlp.engine import METRICS_FILE, STATE_FILE, amp_dtype, hardware_summary
from repmlp.engine.report import save_figure
from repmlp.errors import first_line
from repmlp.io.model_file import atomic_write_text, save_model
from repmlp.nn.numerics import run_precision
from repmlp.tasks.finetune import report_lines
from repmlp.tasks.metrics import accuracy

if TYPE_CHECKING:
    from repmlp.tasks.classification import TrainResult

__all__ = [
    "EQUIVALENCE_RTOL",
    "Outcome",
    "finish_run",
    "plot_curves",
    "predict",
    "render_report",
]

log = logging.getLogger(__name__)

# Converted logits must match the training-time ones to float rounding: max |diff| relative to max |logit|.
EQUIVALENCE_RTOL = CONVERSION_RTOL


@torch.no_grad()
def predict(model: nn.Module, loader, device: torch.device, *, amp: bool = False) -> tuple[Tensor, Tensor]:
    """Logits ``(N, K)`` (float32, CPU) and labels ``(N,)`` of every example of ``loader`` on this process."""
    from tqdm import tqdm

    model.eval().to(device)
    logits, labels = [], []
    for x, y in tqdm(loader.batches(0), total=len(loader), desc="predict", leave=False, disable=None):
        with torch.autocast(device.type, dtype=amp_dtype(device), enabled=amp):
            out = model(x)
        logits.append(out.float().cpu())
        labels.append(y.cpu())
    return torch.cat(logits), torch.cat(labels)


def plot_curves(history: list[dict[str, Any]], path: Path, title: str) -> None:
    """Loss and top-1 accuracy per epoch (train and validation) as a PNG, written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    # The training loss includes label smoothing (and mixup), so it can sit above the validation loss.
    ax1.plot(epochs, [r["train_loss"] for r in history], "o-", label="train (as optimised)")
    ax1.plot(epochs, [r["val_loss"] for r in history], "s-", label="validation")
    ax1.set(xlabel="epoch", ylabel="cross-entropy loss", title="loss")
    ax2.plot(epochs, [r["train_acc"] for r in history], "o-", label="train")
    ax2.plot(epochs, [r["val_top1"] for r in history], "s-", label="validation top-1")
    ax2.set(xlabel="epoch", ylabel="accuracy (%)", title="accuracy")
    from matplotlib.ticker import MaxNLocator

    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def _missing_export_packages() -> list[str]:
    from repmlp.deploy.export import missing_onnx_packages

    return missing_onnx_packages()


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
    """What the end of a run measured: accuracies of both forms, the conversion check and the optional
    steps' results (``notes`` says what was skipped or failed)."""

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
        return self.cmp["max_rel_diff"] <= EQUIVALENCE_RTOL


def finish_run(
    result: TrainResult,
    *,
    command: list[str],
    started: float,
    bench_batch_size: int = 128,
    export: bool = True,
    bench: bool = True,
) -> bool:
    """Evaluate, convert, verify, benchmark, export and report (rank 0). Returns whether all checks passed."""
    cfg = result.config
    out = Path(cfg.output)
    model, deployed, outcome = _convert_and_check(result)
    if bench:
        outcome.bench = _optional("benchmark", lambda: _benchmark(result, model, bench_batch_size), outcome)
    if export:
        outcome.onnx_diff = _export(result, deployed, outcome)
    outcome.fc3_sample = _optional("FC3 figure", lambda: _fc3(result, model, outcome.notes), outcome)
    _optional(
        "training curves",
        lambda: plot_curves(result.history, out / "curves.png", f"{cfg.model} on {cfg.dataset}"),
        outcome,
    )
    outcome.total_s = time.perf_counter() - started
    atomic_write_text(out / "report.md", render_report(result, outcome, command))
    log.info("run folder: %s (report.md); total %.0f s", out, outcome.total_s)
    replicas_ok = len(set(result.replica_hashes)) == 1
    return outcome.equivalent and replicas_ok and not outcome.failed


def _input_size(result: TrainResult) -> tuple[int, int, int]:
    return (result.data.in_chans, result.data.img_size, result.data.img_size)


def _convert_and_check(result: TrainResult) -> tuple[nn.Module, nn.Module, Outcome]:
    """Save both forms and evaluate both on the whole validation set: ``(model, deployed, outcome)``,
    ``deployed`` as loaded back from ``deploy.safetensors``
    (:func:`repmlp.deploy.conversion.convert_and_check`)."""
    from repmlp.deploy.conversion import DeployedFile, convert_and_check

    cfg, data = result.config, result.data
    out, device = Path(cfg.output), result.dist_info.device
    # Rank 0 alone finishes the run: it needs the whole validation set, not its shard.
    val = copy.copy(data.val)
    val.rank, val.world = 0, 1
    # Recorded so that eval / convert of these files find the data without --data-dir.
    extra = {
        "dataset": cfg.dataset,
        "data_dir": str(Path(cfg.data_dir).resolve()) if cfg.data_dir else None,
        "classes": data.classes,
        "input_size": list(_input_size(result)),
    }
    if data.eval_preprocessing:  # an image folder's own normalisation (e.g. a fine-tuned greyscale model)
        extra["eval_preprocessing"] = data.eval_preprocessing
    # Full float32 for the equivalence check (no AMP, no TF32, whatever the run trained with): their
    # rounding (TF32 keeps 10 mantissa bits, ~5e-4) would hide or fake conversion errors.
    model = result.model.float().to(memory_format=torch.contiguous_format).eval()
    save_model(out / "model.safetensors", model, name=cfg.model, model_kwargs=result.model_kwargs, form="train",
               extra=extra)  # fmt: skip
    labels: list[Tensor] = []

    def logits(form: nn.Module) -> Tensor:
        """``(N, K)`` logits of the whole validation set (its labels ``(N,)`` kept from the first run)."""
        out_logits, y = predict(form, val, device)
        if not labels:
            labels.append(y)
        return out_logits

    log.info("evaluating the training-time and the converted model ...")
    # The check covers the file, not the in-memory object: a deploy=True model must load it strictly.
    deployed_file = DeployedFile(out / "deploy.safetensors", cfg.model, result.model_kwargs, extra)
    check = convert_and_check(model, logits, file=deployed_file, device=device)
    outcome = Outcome(accuracy(check.reference, labels[0]), accuracy(check.outputs, labels[0]),
                      check.diff.as_dict(), check.seconds)  # fmt: skip
    log.info(
        "top-1 %.2f%% (training-time) vs %.2f%% (converted); max |logit diff| %.2e (relative %.2e), "
        "%d predictions changed -> %s",
        outcome.train_acc["top1"],
        outcome.dep_acc["top1"],
        outcome.cmp["max_abs_diff"],
        outcome.cmp["max_rel_diff"],
        outcome.cmp["changed_predictions"],
        "equivalent" if outcome.equivalent else "NOT EQUIVALENT",
    )
    return model, check.deployed, outcome


def _benchmark(result: TrainResult, model: nn.Module, batch_size: int) -> tuple[list[Any], str]:
    from repmlp.bench.throughput import benchmark, render_markdown

    device = result.dist_info.device
    rows = benchmark({result.config.model: model}, _input_size(result), batch_size, device=device, warmup=3,
                     repeats=10)  # fmt: skip
    return rows, render_markdown(rows)


def _export(result: TrainResult, deployed: nn.Module, outcome: Outcome) -> float | None:
    """``deploy.onnx`` (its onnxruntime difference relative to the output scale); skipped with a note
    without the optional packages."""
    missing = _missing_export_packages()
    if missing:
        # Optional packages: the run itself succeeded, so a missing one skips the export, not the job.
        msg = f"ONNX export skipped: {', '.join(missing)} not installed (pip install 'repmlp[export]')"
        log.warning("%s", msg)
        outcome.notes.append(msg)
        return None
    from repmlp.deploy.export import export_onnx

    path = Path(result.config.output) / "deploy.onnx"
    return _optional("ONNX export", lambda: export_onnx(deployed, path, _input_size(result)), outcome)


def _fc3(result: TrainResult, model: nn.Module, notes: list[str]):
    from repmlp.bench.viz import find_repmlp_blocks, plot_fc3

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
    cfg, hashes = result.config, result.replica_hashes
    return [
        f"# repmlp run: {cfg.model} on {cfg.dataset}",
        "",
        f"- Command: `{' '.join(command)}`",
        *[f"- Resumed with: `{' '.join(again)}`" for again in cfg.resumed_with],
        f"- Hardware: {hardware_summary(result.dist_info.device)}"
        + (f"; {result.dist_info.world} processes (DDP)" if result.dist_info.enabled else ""),
        f"- Date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"- Data: {result.data.train.num_samples} training / {result.data.val.num_samples} validation examples"
        + (f" ({'; '.join(result.data.notes)})" if result.data.notes else ""),
        f"- Recipe (preset `{cfg.preset}`): {cfg.epochs} epochs, batch {cfg.batch_size}, {cfg.optimizer} "
        f"lr {cfg.lr:g} ({cfg.schedule}, warm-up {cfg.warmup_epochs:g} epochs, to {cfg.min_lr:g}), momentum "
        f"{cfg.momentum:g}, weight decay {cfg.weight_decay:g}, label smoothing {cfg.label_smoothing:g}, mixup "
        f"{cfg.mixup:g}, crop padding {cfg.pad}, flip {cfg.flip}, autoaugment {cfg.autoaugment}, seed {cfg.seed}",
        f"- Model options: `{result.model_kwargs}`",
        f"- Precision: training and the per-epoch validation of the training curve in "
        f"{run_precision(result.dist_info.device, bool(cfg.amp), amp_dtype(result.dist_info.device))}; "
        "the accuracies of both forms and the conversion check in full float32 (no autocast, no TF32)",
        *report_lines(result.init),
        f"- Replicas: {len(hashes)} process(es), final weights sha256 "
        + ", ".join(f"rank {r}: `{h[:16]}`" for r, h in enumerate(hashes))
        + (" (identical)" if len(set(hashes)) == 1 else " (DIFFERENT)"),
        f"- Time: training {sum(r['epoch_s'] for r in result.history):.0f} s (this process: "
        f"{result.train_seconds:.0f} s; {result.mode} training step), whole command {outcome.total_s:.0f} s",
    ]


def _accuracy_lines(outcome: Outcome) -> list[str]:
    train_acc, dep_acc, cmp = outcome.train_acc, outcome.dep_acc, outcome.cmp
    return [
        "",
        "## Accuracy",
        "",
        "Both forms on the whole validation set in full float32 (no autocast, no TF32):",
        "",
        "| form | top-1 (%) | top-5 (%) |",
        "|---|---|---|",
        f"| training-time (`model.safetensors`) | {train_acc['top1']:.2f} | {train_acc['top5']:.2f} |",
        f"| converted (`deploy.safetensors`) | {dep_acc['top1']:.2f} | {dep_acc['top5']:.2f} |",
        "",
        f"Conversion ({outcome.convert_s:.2f} s): max |logit difference| {cmp['max_abs_diff']:.2e} "
        f"(relative {cmp['max_rel_diff']:.2e}), {cmp['changed_predictions']} of {train_acc['n']} predictions "
        f"changed: **{'equivalent' if outcome.equivalent else 'NOT equivalent'}** (tolerance "
        f"{EQUIVALENCE_RTOL:g} relative).",
    ]


def _curve_lines(result: TrainResult) -> list[str]:
    lines = [
        "",
        "## Training curve",
        "",
        "![curves](curves.png)",
        "",
        "| epoch | lr | train loss | train acc (%) | val loss | val top-1 (%) | val top-5 (%) | time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result.history:
        lines.append(
            f"| {r['epoch']} | {r['lr']:.4g} | {r['train_loss']:.4f} | {r['train_acc']:.2f} | {r['val_loss']:.4f} | "
            f"{r['val_top1']:.2f} | {r['val_top5']:.2f} | {r['epoch_s']:.0f} |"
        )
    return lines


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
    out, onnx_diff, fc3_sample = Path(result.config.output), outcome.onnx_diff, outcome.fc3_sample
    onnx_note = (
        f" (onnxruntime max diff {onnx_diff:.2e} of the output scale)"
        if isinstance(onnx_diff, float) and math.isfinite(onnx_diff)
        else ""
    )
    block = getattr(fc3_sample, "block_name", None)
    files = {
        "model.safetensors": "training-time weights (`repmlp eval --checkpoint`)",
        "deploy.safetensors": "converted weights, loads into `create_model(..., deploy=True)`",
        "deploy.onnx": "ONNX of the converted model" + onnx_note,
        STATE_FILE: "training state for `--resume`",
        METRICS_FILE: "per-epoch metrics",
        "curves.png": "training curves",
        "fc3.png": "FC3 before / after merging the Local Perceptron"
        + (f" (block `{block}`)" if block else ""),
    }
    lines = ["", "## Files", ""] + [f"- `{f}`: {what}" for f, what in files.items() if (out / f).exists()]
    if (out / "fc3.png").exists():
        lines += ["", "![FC3](fc3.png)"]
    return lines
