"""What a run writes besides checkpoints: ``metrics.csv``, and ``curves.png`` + ``report.md`` for a loss log."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from repmlp.io.model_file import atomic_write_bytes, atomic_write_text

# The columns of metrics.csv for a run that logs a loss (face, segmentation).
LOSS_FIELDS = ("iteration", "epoch", "loss", "lr", "seconds")


def write_metrics_csv(path: Path, history: list[dict[str, Any]], fields: Sequence[str] = LOSS_FIELDS) -> None:
    """The history as CSV (floats to 6 significant digits), written atomically."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(fields), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in history:
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    atomic_write_text(path, buf.getvalue())


def write_run_report(out: Path, title: str, history: list[dict[str, Any]], section: list[str]) -> None:
    """``curves.png`` (loss against iteration) and ``report.md`` of a run with a loss log: the task's own
    ``section`` (markdown lines), then the loss log."""
    fig, ax = pyplot().subplots(figsize=(6, 4))
    ax.plot([r["iteration"] for r in history], [r["loss"] for r in history], "o-")
    ax.set(xlabel="iteration", ylabel="training loss", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out / "curves.png", dpi=100)
    lines = [f"# {title}", "", *section, "", "## Training loss", "", "![curves](curves.png)", ""]
    lines += ["| iteration | epoch | loss | lr |", "|---|---|---|---|"]
    lines += [f"| {r['iteration']} | {r['epoch']} | {r['loss']:.4f} | {r['lr']:.4g} |" for r in history]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend."""
    import matplotlib  # slow to import: only the steps that draw a figure pay for it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120) -> None:
    """Write the matplotlib figure ``fig`` to ``path`` as a PNG, atomically, and close it (also when writing
    fails)."""
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
        atomic_write_bytes(path, buf.getvalue())
    finally:
        pyplot().close(fig)
