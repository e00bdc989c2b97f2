"""study.md and study.png of ``repmlp study ablation``: accuracies over seeds, sizes, speed, the paper beside."""

from __future__ import annotations

import csv
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from repmlp.bench.throughput import benchmark
from repmlp.engine import hardware_summary, resolve_device
from repmlp.engine.report import save_figure
from repmlp.io.model_file import atomic_write_text
from repmlp.models import create_model
from repmlp.tasks.recipes import PRESETS
from repmlp.tasks.study import CLAIMS, IMG_SIZE, ROWS, Row, StudyOptions, trained_rows

__all__ = ["write_report", "describe_recipe", "summarize", "check_claims"]

log = logging.getLogger(__name__)
_DATE = "%Y-%m-%d %H:%M:%S %Z"


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per trained row: its runs' top-1 (%), their mean and sample standard deviation (0 for one run)."""
    out = {}
    for key, runs in results.items():
        top1 = [float(r["top1"]) for r in runs]
        out[key] = {"top1": top1, "mean": statistics.fmean(top1), "std": statistics.stdev(top1) if len(top1) > 1
                    else 0.0, "equivalent": all(r.get("equivalent", False) for r in runs),
                    "train_seconds": sum(float(r.get("train_seconds", 0.0)) for r in runs)}  # fmt: skip
    return out


def _val_curves(out: Path, seeds: int) -> dict[str, list[list[float]]]:
    """Per trained row: each seed's validation top-1 (%) after every epoch, read from its run's
    ``metrics.csv`` (so finished runs of any version count)."""
    curves: dict[str, list[list[float]]] = {}
    for row in trained_rows():
        curves[row.key] = []
        for seed in range(seeds):
            with open(out / row.key / f"seed{seed}" / "metrics.csv", newline="") as f:
                curves[row.key].append([float(r["val_top1"]) for r in csv.DictReader(f)])
    return curves


def _epoch_means(runs: list[list[float]]) -> list[float]:
    """Mean over the runs at each epoch (runs of one study have the same number of epochs)."""
    return [statistics.fmean(values) for values in zip(*runs, strict=True)]


def check_claims(stats: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each of the paper's orderings: does our mean agree, and is the gap larger than the spread?

    "clear" when both rows have at least two runs and the gap exceeds the sum of their standard
    deviations (``None`` with a single run: no spread to compare with); with few seeds a rough guide, not
    a significance test.
    """
    paper = {row.key: row.paper_top1 for row in ROWS}
    checks = []
    for claim, better, worse in CLAIMS:
        a, b = stats[better], stats[worse]
        gap = a["mean"] - b["mean"]
        clear = abs(gap) > a["std"] + b["std"] if min(len(a["top1"]), len(b["top1"])) > 1 else None
        checks.append({"claim": claim, "gap": gap, "paper_gap": paper[better] - paper[worse], "holds": gap > 0,
                       "clear": clear})  # fmt: skip
    return checks


def _measure_rows(opts: StudyOptions, device: torch.device) -> dict[tuple[str, bool], Any]:
    """Params, MACs and speed of every row's network, training-time and deployed, timed side by side
    (freshly built: speed does not depend on the weights); keys are ``(model name, deployed)``."""
    kwargs = opts.model_kwargs()
    torch.manual_seed(0)
    models = {row.model: create_model(row.model, **kwargs) for row in trained_rows()}
    size = (kwargs["in_chans"], IMG_SIZE, IMG_SIZE)
    rows = benchmark(models, size, opts.bench_batch_size, device=device, warmup=1, repeats=5)
    return {(r.model, r.form == "deploy"): r for r in rows}


def _label(row: Row) -> str:
    return "Pure MLP (=A)" if row.key == "pure_mlp" else row.label


def _plot(
    stats: dict[str, dict[str, Any]], curves: dict[str, list[list[float]]], path: Path, title: str
) -> None:
    """Left: every run's top-1 per row (dots), the mean and one standard deviation (bar), the paper's CIFAR-10
    (x). Right: each row's validation top-1 after every epoch, mean over seeds (line) and range (band)."""
    rows = trained_rows()
    fig = Figure(figsize=(15, 4.8))
    ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": (3, 2)})
    for i, row in enumerate(rows):
        s, first = stats[row.key], i == 0
        n = len(s["top1"])
        xs = [i - 0.12 + 0.24 * k / max(1, n - 1) for k in range(n)] if n > 1 else [i]
        ax.scatter(xs, s["top1"], color="tab:blue", alpha=0.6, s=18, label="one run" if first else None)
        ax.errorbar(i + 0.25, s["mean"], yerr=s["std"], fmt="o", color="tab:red", capsize=4,
                    label="mean ± std" if first else None)  # fmt: skip
        ax.scatter(i, row.paper_top1, marker="x", color="black", label="paper, CIFAR-10" if first else None)
        runs = curves[row.key]
        epochs = range(1, len(runs[0]) + 1)
        (line,) = ax2.plot(epochs, _epoch_means(runs), marker="o", markersize=3, label=_label(row))
        per_epoch = list(zip(*runs, strict=True))
        ax2.fill_between(epochs, [min(v) for v in per_epoch], [max(v) for v in per_epoch], color=line.get_color(),
                         alpha=0.15)  # fmt: skip
    ax.set_xticks(range(len(rows)), [_label(r) for r in rows], rotation=15, ha="right")
    ax.set(ylabel="top-1 accuracy (%)", title=title)
    ax.grid(alpha=0.3, axis="y")
    # Below the axes, under the row names: inside it could hide a run.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8)
    ax2.set(xlabel="epoch", ylabel="validation top-1 (%)", title="learning curves (mean, range over seeds)")
    ax2.locator_params(axis="x", integer=True)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def describe_recipe(preset: str) -> str:
    """One line naming a preset and the values a study run takes from it (epochs and model are the study's)."""
    r = PRESETS[preset]
    whose = "the paper's CIFAR recipe" if preset == "cifar" else "the main job's recipe"
    warmup = f" after {r.warmup_epochs:g} epochs of linear warm-up" if r.warmup_epochs else ""
    parts = [f"{r.optimizer.upper()} momentum {r.momentum:g}" + (" (Nesterov)" if r.nesterov else ""),
             f"batch {r.batch_size}", f"{r.schedule} lr {r.lr:g} -> {r.min_lr:g}{warmup}",
             f"weight decay {r.weight_decay:g}"] + ([f"label smoothing {r.label_smoothing:g}"] if r.label_smoothing
                                                    else [])  # fmt: skip
    augment = ([f"{r.pad}-pixel pad + random crop"] if r.pad else []) + (["flip"] if r.flip else [])
    parts.append(" + ".join(augment) if augment else "no augmentation")
    return f"{whose} (preset `{preset}`: {', '.join(parts)})"


def _tables(
    stats: dict[str, dict[str, Any]], measured: dict, curves: dict[str, list[list[float]]]
) -> list[str]:
    """The report's three tables: the rows against the paper's, its orderings, the learning curves (at most
    10 epochs, evenly spaced and always the last, so that 100 epochs stay one table)."""
    lines = ["| row | top-1 (%) mean ± std | runs' top-1 (%) | params (M) | MACs (M) | speed (examples/s) "
             "| paper top-1 (%) | paper MACs (M) | paper params (M) |", "|---" * 9 + "|"]  # fmt: skip
    for row in ROWS:
        s, m = stats[row.key], measured[(row.model, row.deployed)]
        runs = ", ".join(f"{a:.2f}" for a in s["top1"])
        lines.append(f"| {row.label} | {s['mean']:.2f} ± {s['std']:.2f} | {runs} | {m.params / 1e6:.3f} | "
                     f"{m.macs / 1e6:.2f} | {m.throughput:.0f} | {row.paper_top1:.2f} | {row.paper_macs_m:g} | "
                     f"{row.paper_params_m:g} |")  # fmt: skip
    lines += ["", "## The paper's orderings", "", "'gap > spread': the difference of the means exceeds the sum of "
              "the two standard deviations.", "", "| the paper's finding | our gap (points) | paper's gap (points) "
              "| holds here? |", "|---|---|---|---|"]  # fmt: skip
    spread = {True: " (gap > spread)", False: " (within spread)", None: " (one run: no spread)"}
    for c in check_claims(stats):
        verdict = ("yes" if c["holds"] else "no") + spread[c["clear"]]
        lines.append(f"| {c['claim']} | {c['gap']:+.2f} | {c['paper_gap']:+.2f} | {verdict} |")
    epochs = len(next(iter(curves.values()))[0])
    shown = sorted({round(epochs * (k + 1) / 10) for k in range(10)} - {0} | {epochs})
    lines += ["", "## Validation top-1 (%) by epoch, mean over seeds", "",
              "| row | " + " | ".join(f"epoch {e}" for e in shown) + " |", "|---" * (len(shown) + 1) + "|"]  # fmt: skip
    for row in trained_rows():
        means = _epoch_means(curves[row.key])
        lines.append(f"| {_label(row)} | " + " | ".join(f"{means[e - 1]:.2f}" for e in shown) + " |")
    return lines


def write_report(opts: StudyOptions, results: dict[str, list[dict[str, Any]]], out: Path) -> Path:
    """Measure the rows, then write ``out/study.md`` and ``out/study.png``; returns the former's path."""
    stats, device = summarize(results), resolve_device(opts.device)
    measured, curves = _measure_rows(opts, device), _val_curves(out, opts.seeds)
    _plot(stats, curves, out / "study.png", f"Pure-MLP ablation on {opts.dataset} ({opts.seeds} seeds a row)")
    first = next(iter(results.values()))[0]
    options = [("--data-dir", opts.data_dir), ("--seeds", opts.seeds), ("--epochs", opts.epochs),
               ("--width-multiplier", f"{opts.width_multiplier:g}"),
               ("--preset", opts.preset if opts.preset != "cifar" else None), ("--train-limit", opts.train_limit),
               ("--val-limit", opts.val_limit)]  # fmt: skip
    command = f"repmlp study ablation --output {opts.output} --dataset {opts.dataset}"
    command += "".join(f" {flag} {value}" for flag, value in options if value)
    padded = (
        "; 28x28 images zero-padded to 32x32, one input channel" if opts.dataset == "fashion-mnist" else ""
    )
    equivalent = all(s["equivalent"] for s in stats.values())
    lines = [
        f"# Pure-MLP ablation (paper Table 1) on {opts.dataset}",
        "",
        f"- Command: `{command}`",
        f"- Recipe: {describe_recipe(opts.preset)} for {opts.epochs} epochs; {first['train_examples']} training / "
        f"{first['val_examples']} validation examples{padded}",
        f"- Channel widths x{opts.width_multiplier:g} of the paper's (16/32/64, Wide ConvNet 32/64/128)",
        f"- Hardware: {hardware_summary(device)}",
        f"- Training time, all {sum(len(s['top1']) for s in stats.values())} runs: "
        f"{sum(s['train_seconds'] for s in stats.values()):.0f} s (report written {time.strftime(_DATE)})",
        "- Converted models equal the training-time ones (logits within 1e-4 relative) in every run: "
        + ("yes" if equivalent else "**NO** (see the runs' report.md)"),
        "",
        "Top-1 is on the validation split after the last epoch; params and MACs (one image) of the deployed "
        f"network (A: before conversion), speed of a forward pass at batch {opts.bench_batch_size} on {device}, all "
        "rows timed side by side in interleaved rounds (compare ratios). Paper figures: CIFAR-10, full widths, 100 "
        "epochs.",
        "",
        *_tables(stats, measured, curves),
        "",
        "![accuracies and learning curves](study.png)",
        "",
    ]
    atomic_write_text(out / "study.md", "\n".join(lines))
    log.info("wrote %s and %s", out / "study.md", out / "study.png")
    return out / "study.md"
