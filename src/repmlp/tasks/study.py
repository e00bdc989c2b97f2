"""The paper's pure-MLP ablation study (its Table 1) as one resumable job: ``repmlp study ablation``.

Every row is trained for several seeds with one recipe (the ``cifar`` preset, the paper's, or ``fmnist``, the
main job's short one) scaled by the study's options, each run in its own folder ``OUTPUT/<row>/seed<k>``
through the classification task; :mod:`repmlp.tasks.study_report` then compares the rows. "Pure MLP" and "A)
before conversion" are one trained network in its two forms: they share their runs and accuracy.

A second call reuses finished runs (a folder holding ``result.json``), resumes a killed one from its
checkpoint and trains the missing ones; a run trained with other options is refused, not overwritten.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from repmlp.bench.counts import profile_model
from repmlp.engine import STATE_FILE, check_resumable, resolve_device
from repmlp.io.model_file import atomic_write_text
from repmlp.io.state import load_state
from repmlp.tasks.classification import TrainConfig, train
from repmlp.tasks.config import TaskConfig
from repmlp.tasks.recipes import PRESETS

__all__ = ["Row", "ROWS", "StudyOptions", "train_study", "train_config", "train_one", "start_order"]

log = logging.getLogger(__name__)

RESULT_FILE = "result.json"
DATASETS = ("fashion-mnist", "cifar10")
# The recipes a study may train with: the paper's, and the main job's, whose warm-up and label smoothing let
# the rows learn in a few epochs (docs/reproduction.md).
STUDY_PRESETS = ("cifar", "fmnist")
IMG_SIZE = 32  # the paper's CIFAR resolution; Fashion-MNIST's 28x28 images are zero-padded to it


@dataclass(frozen=True)
class Row:
    """One line of the paper's Table 1 and the network that reproduces it."""

    key: str  # folder name
    label: str  # as in the paper
    model: str  # registered model name (the trained network)
    deployed: bool  # profiled / timed in converted form
    paper_top1: float  # CIFAR-10 top-1 (%), paper Table 1
    paper_macs_m: float  # the paper's "FLOPs (M)" (multiply-accumulates)
    paper_params_m: float


ROWS: tuple[Row, ...] = (
    Row("pure_mlp", "Pure MLP", "repmlp_cifar", True, 91.11, 52.8, 22.41),
    Row("pure_mlp", "A) before conversion", "repmlp_cifar", False, 91.11, 118.9, 22.91),
    Row("no_local", "B) w/o Local", "repmlp_cifar_no_local", True, 82.64, 52.8, 22.41),
    Row("no_global", "C) w/o Global", "repmlp_cifar_no_global", True, 89.61, 52.5, 22.08),
    Row("fc3_conv9", "D) FC3 as conv9", "repmlp_cifar_fc3_conv9", True, 87.64, 66.2, 0.81),
    Row("conv9", "E) RepMLP as conv9", "repmlp_cifar_conv9", True, 87.29, 65.8, 0.48),
    Row("wide_convnet", "Wide ConvNet", "wide_convnet_cifar", True, 91.99, 65.1, 0.50),
)

# The paper's conclusions from Table 1, as (claim, better row key, worse row key).
CLAIMS: tuple[tuple[str, str, str], ...] = (
    ("Local Perceptron helps (Pure MLP > B w/o Local)", "pure_mlp", "no_local"),
    ("Global Perceptron helps (Pure MLP > C w/o Global)", "pure_mlp", "no_global"),
    ("FC3 beats a 9x9 conv (Pure MLP > D FC3 as conv9)", "pure_mlp", "fc3_conv9"),
    ("Global Perceptron helps the conv9 too (D > E RepMLP as conv9)", "fc3_conv9", "conv9"),
    ("Wide ConvNet beats the pure MLP (Wide ConvNet > Pure MLP)", "wide_convnet", "pure_mlp"),
)


@dataclass(kw_only=True)
class StudyOptions(TaskConfig):
    """The command's options (checked by :meth:`validate`)."""

    output: str
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    seeds: int = 3
    epochs: int = 100
    width_multiplier: float = 1.0
    preset: str = "cifar"
    train_limit: int | None = None
    val_limit: int | None = None
    device: str = "auto"
    bench_batch_size: int = 32
    compile: str = "auto"  # a runtime option of every run (repmlp train --compile)
    jobs: int = 1  # runs trained at once, each in its own process (not a training option)

    CHOICES = {**TaskConfig.CHOICES, "dataset": DATASETS, "preset": STUDY_PRESETS}

    def rules(self) -> Iterator[tuple[str, str]]:
        if self.dataset == "cifar10" and self.data_dir is None:
            yield "data_dir", "--dataset cifar10 needs --data-dir (the folder holding cifar-10-batches-py)"

    def model_args(self) -> dict[str, Any]:
        return {"width_multiplier": self.width_multiplier} if self.width_multiplier != 1.0 else {}

    def model_kwargs(self) -> dict[str, Any]:
        """What every row's network is built with: the data's classes, channels and (padded) size."""
        in_chans = 1 if self.dataset == "fashion-mnist" else 3
        return dict(num_classes=10, in_chans=in_chans, img_size=IMG_SIZE, **self.model_args())


def trained_rows() -> list[Row]:
    """One row per trained network: "A) before conversion" is the Pure MLP's network, in training form."""
    return [row for row in ROWS if row.deployed]


def train_config(model: str, seed: int, opts: StudyOptions, run_dir: Path) -> TrainConfig:
    """The classification config of one run: the study's preset with the row's model and the study's epochs,
    limits and widths; Fashion-MNIST zero-padded to the paper's 32x32. No ONNX export nor benchmark at the end
    of the run: the study times all rows side by side instead."""
    recipe = PRESETS[opts.preset].to_dict()
    recipe.update(model=model, model_args=opts.model_args(), epochs=opts.epochs,
                  img_size=IMG_SIZE if opts.dataset == "fashion-mnist" else None)  # fmt: skip
    return TrainConfig(
        **recipe, dataset=opts.dataset, data_dir=str(Path(opts.data_dir).resolve()) if opts.data_dir else None,
        preset=opts.preset, seed=seed, train_limit=opts.train_limit, val_limit=opts.val_limit, device=opts.device,
        # Resolved as train saves it (AMP on CUDA), so that a run killed under `repmlp train` compares equal.
        amp=resolve_device(opts.device).type == "cuda", compile=opts.compile, output=str(run_dir),
        no_export=True, no_bench=True, run_command=["repmlp", "study", "ablation"],
    )  # fmt: skip


def train_one(model: str, seed: int, opts: StudyOptions, run_dir: Path) -> dict[str, Any]:
    """Train (or resume, or reuse) one run into ``run_dir`` (resumed when the folder holds a checkpoint: a
    killed run, or a finished one whose end did not complete): its ``result.json`` content."""
    cfg = train_config(model, seed, opts, run_dir)
    result_path = run_dir / RESULT_FILE
    if result_path.is_file():  # reused only if trained with these very options
        saved = load_state(run_dir / STATE_FILE)["config"]
        check_resumable(saved, cfg.to_dict(), run_dir, runtime=cfg.RUNTIME)
        return json.loads(result_path.read_text())
    cfg.resume = (run_dir / STATE_FILE).is_file()
    result = train(cfg, finished_ok=True)
    last = result.history[-1]
    out = {"model": model, "seed": seed, "top1": last["val_top1"], "top5": last["val_top5"],
           "train_seconds": sum(r["epoch_s"] for r in result.history), "equivalent": result.ok,
           "val_examples": result.data.val.num_samples, "train_examples": result.data.train.num_samples}  # fmt: skip
    atomic_write_text(result_path, json.dumps(out, indent=2) + "\n")
    return out


def train_study(opts: StudyOptions, *, progress: bool = True) -> dict[str, list[dict[str, Any]]]:
    """Train every row for every seed (reusing finished runs): row key -> one result per seed.

    With ``opts.jobs > 1`` that many runs train at once, each in a worker process with an equal share of this
    process's CPU threads: on a small CPU, single-threaded runs side by side waste less time in OpenMP
    barriers than one run on every core."""
    opts.validate()
    out = Path(opts.output)
    out.mkdir(parents=True, exist_ok=True)
    rows = trained_rows()
    jobs = [(row, seed) for seed in range(opts.seeds) for row in rows]
    results: dict[str, list[dict[str, Any]]] = {row.key: [] for row in rows}
    started = time.perf_counter()
    bar = tqdm(total=len(jobs), desc="study", unit="run", disable=None if progress else True)
    args = [(row.model, seed, opts, out / row.key / f"seed{seed}") for row, seed in jobs]
    order = start_order(jobs, opts)
    for (row, _), result in zip(jobs, _run_all(args, opts.jobs, bar, order), strict=True):
        results[row.key].append(result)
    bar.close()
    log.info("all %d runs done in %.0f s; measuring the rows' sizes and speed ...", len(jobs),
             time.perf_counter() - started)  # fmt: skip
    return results


def start_order(jobs: list[tuple[Row, int]], opts: StudyOptions) -> list[int]:
    """Indices of the ``(row, seed)`` runs in the order they start. One at a time: as given (seed by seed, so
    a stopped study has whole seeds). With ``--jobs`` above 1: the costliest rows first (training MACs), so
    that no long run starts last and trains alone while the other workers idle."""
    if opts.jobs == 1:
        return list(range(len(jobs)))
    cost = {row.key: _training_macs(row.model, opts) for row, _ in jobs}
    return sorted(range(len(jobs)), key=lambda i: -cost[jobs[i][0].key])


def _training_macs(model: str, opts: StudyOptions) -> int:
    """Multiply-accumulates of one image through the training-time network: a run's cost, the same on every
    machine (so is the order of the runs)."""
    kwargs = opts.model_kwargs()
    return profile_model(model, (kwargs["in_chans"], IMG_SIZE, IMG_SIZE), deploy=False, **kwargs)[1]


def _run_all(args: list[tuple], jobs: int, bar, order: list[int]) -> list[dict[str, Any]]:
    """:func:`train_one` of every argument tuple, results in the tuples' order; ``jobs`` at a time in worker
    processes, started in ``order`` (indices)."""
    out: list[dict[str, Any] | None] = [None] * len(args)
    if jobs == 1:
        for i in order:
            bar.set_postfix_str(f"{args[i][3].parent.name} seed {args[i][1]}")
            out[i] = train_one(*args[i])
            bar.update(1)
        return out  # type: ignore[return-value]
    threads = max(1, torch.get_num_threads() // jobs)
    level = logging.getLogger("repmlp").getEffectiveLevel()
    # spawn: a forked child would inherit this process's OpenMP pool and locks.
    ctx, init_args = multiprocessing.get_context("spawn"), (threads, level, os.getpid())
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init, initargs=init_args) as pool:
        futures = {pool.submit(train_one, *args[i]): i for i in order}
        try:
            for future in as_completed(futures):
                out[futures[future]] = future.result()
                bar.update(1)
        except BaseException:
            # A run's error ends the study as in one process: runs not started are cancelled, the running
            # ones finish (their folders stay resumable), then the error propagates.
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return out  # type: ignore[return-value]


def _worker_init(threads: int, level: int, parent: int) -> None:
    """A study worker: its share of the CPU threads, the parent's log level to stderr, and its end with the
    study process ``parent``."""
    torch.set_num_threads(threads)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("repmlp")
    root.addHandler(handler)
    root.setLevel(level)
    _exit_with_parent(parent)


def _exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """End this worker process soon after the study process ``parent`` is gone (killed, crashed, out of memory).

    Nothing else stops it: a worker would train its run to the end while the next study call resumes that
    same run folder beside it. (Checkpoints are written atomically: the run resumes from its last one.) A
    worker that starts after the study was killed already has another parent, and ends at once."""

    def watch() -> None:
        while os.getppid() == parent:  # a reparented orphan sees another parent (init or a subreaper)
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="repmlp-study-parent", daemon=True).start()
