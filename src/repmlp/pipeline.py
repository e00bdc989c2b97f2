"""The end of ``repmlp train``: evaluate, convert, verify the conversion, benchmark, export, plot, report.

:func:`finish_run` takes a finished :class:`repmlp.train.TrainResult` and writes into the run folder:
``model.safetensors`` (training-time form), ``deploy.safetensors`` (converted; reloaded with
``deploy=True`` for the checks), ``deploy.onnx``, ``curves.png``, ``fc3.png`` and ``report.md``.
"""

from __future__ import annotations

import copy
import io
import logging
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .checkpoint import atomic_write_bytes, atomic_write_text, load_model, save_model
from .train import METRICS_FILE, STATE_FILE, TrainResult, _amp_dtype, topk_correct

__all__ = ["finish_run", "predict", "compare_logits", "plot_curves", "hardware_summary"]

log = logging.getLogger(__name__)

# Converted logits must match the training-time ones to float rounding: max |diff| relative to max |logit|.
EQUIVALENCE_RTOL = 1e-4


@torch.no_grad()
def predict(model: nn.Module, loader, device: torch.device, *, amp: bool = False) -> tuple[Tensor, Tensor]:
    """Logits ``(N, K)`` (float32, CPU) and labels ``(N,)`` of every example of ``loader`` on this process."""
    from tqdm import tqdm

    model.eval().to(device)
    logits, labels = [], []
    for x, y in tqdm(loader.batches(0), total=len(loader), desc="predict", leave=False, disable=None):
        with torch.autocast(device.type, dtype=_amp_dtype(device), enabled=amp):
            out = model(x)
        logits.append(out.float().cpu())
        labels.append(y.cpu())
    return torch.cat(logits), torch.cat(labels)


def accuracy(logits: Tensor, labels: Tensor) -> dict[str, float]:
    c1, c5 = topk_correct(logits, labels)
    n = max(1, len(labels))
    return {"top1": 100 * c1 / n, "top5": 100 * c5 / n, "n": len(labels)}


def compare_logits(ref: Tensor, out: Tensor) -> dict[str, float]:
    """Max abs and relative difference, and how many predictions (argmax) differ."""
    diff = (ref - out).abs().max().item()
    scale = max(ref.abs().max().item(), 1e-12)
    return {
        "max_abs_diff": diff,
        "max_rel_diff": diff / scale,
        "changed_predictions": int((ref.argmax(1) != out.argmax(1)).sum()),
    }


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
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def hardware_summary(device: torch.device) -> str:
    """One line naming the processor (or GPU), core count, threads and library versions."""
    if device.type == "cuda":
        hw = torch.cuda.get_device_name(device)
    else:
        from .engine import cpu_name

        hw = cpu_name() + f", {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return f"{hw}; torch {torch.__version__}, Python {platform.python_version()}"


def _missing_export_packages() -> list[str]:
    from .export import missing_onnx_packages

    return missing_onnx_packages()


def _step(name: str, fn, notes: list[str]):
    """Run an optional final step; a failure is logged and noted in the report instead of aborting."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the run's weights are saved; report what failed
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.error("%s failed: %s", name, msg)
        notes.append(f"{name} failed: {msg}")
        return None


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
    from . import reparameterize_model

    cfg, data, model = result.config, result.data, result.model
    out = Path(cfg.output)
    device = result.dist_info.device
    notes: list[str] = []
    name = cfg.model
    input_size = (data.in_chans, data.img_size, data.img_size)
    # Rank 0 alone finishes the run: it needs the whole validation set, not its shard.
    val = copy.copy(data.val)
    val.rank, val.world = 0, 1
    # Recorded so that eval / convert of these files find the data without --data-dir.
    extra = {
        "dataset": cfg.dataset,
        "data_dir": str(Path(cfg.data_dir).resolve()) if cfg.data_dir else None,
        "classes": data.classes,
        "input_size": list(input_size),
    }

    # Float32 for the equivalence check: AMP rounding would hide (or fake) conversion errors.
    model = model.float().to(memory_format=torch.contiguous_format).eval()
    save_model(
        out / "model.safetensors",
        model,
        name=name,
        model_kwargs=result.model_kwargs,
        form="train",
        extra=extra,
    )
    log.info("evaluating the training-time model ...")
    ref_logits, labels = predict(model, val, device)
    train_acc = accuracy(ref_logits, labels)

    t = time.perf_counter()
    deployed = reparameterize_model(model.eval())
    convert_s = time.perf_counter() - t
    save_model(
        out / "deploy.safetensors",
        deployed,
        name=name,
        model_kwargs=result.model_kwargs,
        form="deploy",
        extra=extra,
    )
    # Check the file, not the in-memory object: a deploy=True model must load it strictly.
    deployed, _ = load_model(out / "deploy.safetensors", device=device, form="deploy")
    dep_logits, _ = predict(deployed, val, device)
    dep_acc = accuracy(dep_logits, labels)
    cmp = compare_logits(ref_logits, dep_logits)
    # No separate test on changed predictions: a flip moves two logits' difference by at least their
    # margin, so with every logit within max_abs_diff only pairs tied within 2 * max_abs_diff can flip.
    equivalent = cmp["max_rel_diff"] <= EQUIVALENCE_RTOL
    log.info(
        "top-1 %.2f%% (training-time) vs %.2f%% (converted); max |logit diff| %.2e (relative %.2e), "
        "%d predictions changed -> %s",
        train_acc["top1"],
        dep_acc["top1"],
        cmp["max_abs_diff"],
        cmp["max_rel_diff"],
        cmp["changed_predictions"],
        "equivalent" if equivalent else "NOT EQUIVALENT",
    )

    def run_bench():
        from .bench import benchmark, render_markdown

        rows = benchmark({name: model}, input_size, bench_batch_size, device=device, warmup=3, repeats=10)
        return rows, render_markdown(rows)

    bench_out = _step("benchmark", run_bench, notes) if bench else None
    onnx_diff = None
    missing = _missing_export_packages() if export else []
    if missing:
        # Optional packages: the run itself succeeded, so a missing one skips the export, not the job.
        log.warning(
            "ONNX export skipped: %s not installed (pip install 'repmlp[export]')", ", ".join(missing)
        )
        notes.append(
            f"ONNX export skipped: {', '.join(missing)} not installed (pip install 'repmlp[export]')"
        )
    elif export:
        from .export import export_onnx

        onnx_diff = _step(
            "ONNX export", lambda: export_onnx(deployed, out / "deploy.onnx", input_size), notes
        )

    def fc3():
        from .viz import find_repmlp_blocks, plot_fc3

        if not find_repmlp_blocks(model):
            notes.append("FC3 figure skipped: the model has no RepMLP block")
            return None
        return plot_fc3(
            model, out / "fc3.png", title=f"{name}: FC3 before / after merging the Local Perceptron"
        )

    fc3_sample = _step("FC3 figure", fc3, notes)
    _step(
        "training curves",
        lambda: plot_curves(result.history, out / "curves.png", f"{name} on {cfg.dataset}"),
        notes,
    )
    total_s = time.perf_counter() - started
    report = _report(
        result,
        command,
        train_acc,
        dep_acc,
        cmp,
        equivalent,
        convert_s,
        bench_out,
        onnx_diff,
        fc3_sample,
        notes,
        total_s,
        device,
    )
    atomic_write_text(out / "report.md", report)
    log.info("run folder: %s (report.md); total %.0f s", out, total_s)
    replicas_ok = len(set(result.replica_hashes)) == 1
    return equivalent and replicas_ok and not any("failed" in n for n in notes)


def _report(
    result,
    command,
    train_acc,
    dep_acc,
    cmp,
    equivalent,
    convert_s,
    bench_out,
    onnx_diff,
    fc3_sample,
    notes,
    total_s,
    device,
) -> str:
    cfg = result.config
    h = result.history
    out = Path(cfg.output)
    lines = [
        f"# repmlp run: {cfg.model} on {cfg.dataset}",
        "",
        f"- Command: `{' '.join(command)}`",
        f"- Hardware: {hardware_summary(device)}"
        + (f"; {result.dist_info.world} processes (DDP)" if result.dist_info.enabled else ""),
        f"- Date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"- Data: {result.data.train.num_samples} training / {result.data.val.num_samples} validation examples",
        f"- Recipe (preset `{cfg.preset}`): {cfg.epochs} epochs, batch {cfg.batch_size}, {cfg.optimizer} "
        f"lr {cfg.lr:g} ({cfg.schedule}, warm-up {cfg.warmup_epochs:g} epochs, to {cfg.min_lr:g}), momentum "
        f"{cfg.momentum:g}, weight decay {cfg.weight_decay:g}, label smoothing {cfg.label_smoothing:g}, mixup "
        f"{cfg.mixup:g}, crop padding {cfg.pad}, flip {cfg.flip}, autoaugment {cfg.autoaugment}, seed {cfg.seed}",
        f"- Model options: `{result.model_kwargs}`",
        f"- Replicas: {len(result.replica_hashes)} process(es), final weights sha256 "
        + ", ".join(f"rank {r}: `{h[:16]}`" for r, h in enumerate(result.replica_hashes))
        + (" (identical)" if len(set(result.replica_hashes)) == 1 else " (DIFFERENT)"),
        f"- Time: training {sum(r['epoch_s'] for r in h):.0f} s (this process: {result.train_seconds:.0f} s), "
        f"whole command {total_s:.0f} s",
        "",
        "## Accuracy",
        "",
        "| form | top-1 (%) | top-5 (%) |",
        "|---|---|---|",
        f"| training-time (`model.safetensors`) | {train_acc['top1']:.2f} | {train_acc['top5']:.2f} |",
        f"| converted (`deploy.safetensors`) | {dep_acc['top1']:.2f} | {dep_acc['top5']:.2f} |",
        "",
        f"Conversion ({convert_s:.2f} s): max |logit difference| {cmp['max_abs_diff']:.2e} "
        f"(relative {cmp['max_rel_diff']:.2e}), {cmp['changed_predictions']} of {train_acc['n']} predictions "
        f"changed: **{'equivalent' if equivalent else 'NOT equivalent'}** (tolerance {EQUIVALENCE_RTOL:g} relative).",
        "",
        "## Training curve",
        "",
        "![curves](curves.png)",
        "",
        "| epoch | lr | train loss | train acc (%) | val loss | val top-1 (%) | val top-5 (%) | time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in h:
        lines.append(
            f"| {r['epoch']} | {r['lr']:.4g} | {r['train_loss']:.4f} | {r['train_acc']:.2f} | {r['val_loss']:.4f} | "
            f"{r['val_top1']:.2f} | {r['val_top5']:.2f} | {r['epoch_s']:.0f} |"
        )
    lines += ["", "## Speed", ""]
    if bench_out:
        rows, table = bench_out
        lines += [
            f"Batch {rows[0].batch_size}, input {tuple(rows[0].input_size)}, {rows[0].device}:",
            "",
            table,
        ]
    else:
        lines.append("not measured")
    lines += ["", "## Files", ""]
    files = {
        "model.safetensors": "training-time weights (`repmlp eval --checkpoint`)",
        "deploy.safetensors": "converted weights, loads into `create_model(..., deploy=True)`",
        "deploy.onnx": "ONNX of the converted model"
        + (
            f" (onnxruntime max abs diff {onnx_diff:.2e})"
            if isinstance(onnx_diff, float) and math.isfinite(onnx_diff)
            else ""
        ),
        STATE_FILE: "training state for `--resume`",
        METRICS_FILE: "per-epoch metrics",
        "curves.png": "training curves",
        "fc3.png": "FC3 before / after merging the Local Perceptron"
        + (f" (block `{fc3_sample.block_name}`)" if getattr(fc3_sample, "block_name", None) else ""),
    }
    for f, what in files.items():
        if (out / f).exists():
            lines.append(f"- `{f}`: {what}")
    if (out / "fc3.png").exists():
        lines += ["", "![FC3](fc3.png)"]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
