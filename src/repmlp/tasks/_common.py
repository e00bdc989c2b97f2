"""Pieces the tasks share: processes and batches, the task's kind of model, seeded data, the engine's options of
a run, and (face, segmentation) the training loop, the end of a run and the evaluation of a model file."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from repmlp import engine
from repmlp.data.folder import sample_seed, stratified_subset
from repmlp.data.loader import FolderLoader
from repmlp.deploy.conversion import CONVERSION_RTOL, Conversion, DeployedFile, convert_and_check
from repmlp.errors import UserError
from repmlp.io.model_file import ModelMetadata, atomic_write_text, load_model, save_model
from repmlp.models.pspnet import PSPNet
from repmlp.nn import convert  # looked up when called: tests replace convert.reparameterize_model
from repmlp.numerics import full_float32
from repmlp.tasks.config import EvalOptions, TrainOptions
from repmlp.tasks.finetune import report_lines

log = logging.getLogger(__name__)
# What a run reports as its result (the conversion check, the run folder): on stdout from the CLI (repmlp.cli).
results = logging.getLogger("repmlp.results")


def per_process_batch(global_batch: int, procs: engine.DistInfo, flag: str = "--batch-size") -> int:
    """The global batch size (the paper's numbers are global) split evenly over the processes."""
    if global_batch % procs.world:
        raise UserError(f"{flag} {global_batch} is not divisible by the {procs.world} processes")
    return global_batch // procs.world


def resolve_img_size(kwargs: dict[str, Any], flag: str, value: int | None, default: int) -> int:
    """The one square input size of a run: ``--model-arg img_size`` or ``flag`` (``value``), else ``default``.

    The data are sized with it and the model built for it (written into ``kwargs``), so that the two cannot
    disagree; both given with different values is a :class:`UserError`."""
    given = kwargs.get("img_size")
    if isinstance(given, (list, tuple)) and len(given) == 2 and given[0] == given[1]:
        given = given[0]
    if given is not None and (not isinstance(given, int) or isinstance(given, bool)):
        raise UserError(f"--model-arg img_size must be one integer (square inputs), got {given!r}")
    if given is not None and value is not None and given != value:
        raise UserError(f"--model-arg img_size {given} differs from {flag} {value}: the model is built for the "
                        "size of its inputs; give one of them")  # fmt: skip
    kwargs["img_size"] = size = given if given is not None else value if value is not None else default
    return size


# What each task's pipeline needs of a model, as told to a user who gave another kind.
TASK_MODELS = {
    "cls": "an image classifier (class scores per image: repmlp_fmnist_patch2, repmlp_res50, resnet50, ...)",
    "face": "a face embedding model (one with embedding_dim: repmlp_face_resnet, face_resnet, mobilefacenet)",
    "seg": "a PSPNet segmentation model (pspnet_repmlp_res50, pspnet_res50)",
}
_FOUND = {"cls": "an image classifier", "face": "a face embedding model", "seg": "a segmentation model"}


def is_task_model(model: nn.Module, task: str) -> bool:
    """Whether ``model`` is of the kind ``task`` trains and evaluates (see :data:`TASK_MODELS`)."""
    if task == "face":  # the loss and the metrics need the embedding width: outputs (N, embedding_dim)
        return getattr(model, "embedding_dim", None) is not None
    if task == "seg":
        return isinstance(model, PSPNet)
    return not (is_task_model(model, "face") or is_task_model(model, "seg"))


def require_task_model(model: nn.Module, task: str, name: str) -> None:
    """:class:`UserError` unless model ``name`` is of ``task``'s kind; it names the task the model is for."""
    if not is_task_model(model, task):
        other = next((t for t in ("face", "seg") if t != task and is_task_model(model, t)), None)
        hint = f" ({name} is {_FOUND[other]}: train it with --task {other})" if other else ""
        raise UserError(f"model {name!r} is not {TASK_MODELS[task]}{hint}")


def check_batchnorm_batch(model: nn.Module, batch_size: int, examples: int, procs: engine.DistInfo) -> None:
    """Refuse to train a model with BatchNorm on batches of one example, before the first step.

    BatchNorm in training mode normalises each channel over the batch: one example on a 1x1 feature map makes
    torch raise mid-step, and elsewhere gives statistics of a single image. A step's batch is ``batch_size``
    split over the processes, or all of ``examples`` when there are fewer; with SyncBatchNorm (several GPUs)
    the statistics are over every process's share."""
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return
    per_process = min(batch_size // procs.world, -(-examples // procs.world))
    synced = procs.enabled and procs.device.type == "cuda"
    if (per_process * procs.world if synced else per_process) >= 2:
        return
    if examples < 2:
        cause = f"{examples} training example (--train-limit, or the images of the folder)"
    elif batch_size // procs.world < 2:
        cause = f"--batch-size {batch_size}" + (f" over {procs.world} processes" if procs.world > 1 else "")
    else:
        cause = f"{examples} training examples over {procs.world} processes"
    each = " per process" if procs.world > 1 and not synced else ""
    raise UserError(
        f"BatchNorm needs at least 2 examples per batch, but {cause} leaves 1{each}: give a --batch-size of 2 or "
        f"more{each} and at least as many training examples"
    )


class NonFiniteOutput(UserError):
    """A model's outputs hold NaN/inf (see :func:`check_finite`)."""


def check_finite(output: Tensor, what: str = "the model") -> None:
    """:class:`NonFiniteOutput` when ``output`` holds NaN/inf: metrics of such outputs would mean nothing."""
    if not bool(torch.isfinite(output).all()):
        raise non_finite(what)


def non_finite(what: str) -> NonFiniteOutput:
    return NonFiniteOutput(f"{what}'s outputs are NaN/inf (diverged weights?); retrain it with a lower --lr")


class EpochSeeded(Dataset):
    """A dataset for the training loaders: items are ``(index, epoch)``, and the torch RNG is seeded from
    ``(seed, epoch, index)`` around each, so that a sample's random augmentation does not depend on the worker
    count or on which process loads it."""

    def __init__(self, dataset: Dataset, seed: int, train: bool) -> None:
        self.dataset, self.seed, self.train = dataset, seed, train

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, item: tuple[int, int]):
        index, epoch = item
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, epoch, index, self.train))
            return self.dataset[index]


def loop_options(
    cfg: TrainOptions, procs: engine.DistInfo, lr_at: Callable[[int], list[float]], *, auto_graphs: bool, **more: Any
) -> engine.LoopOptions:  # fmt: skip
    """The engine's options of ``cfg``'s run (``more``: ``epochs`` or ``iterations`` and any other of
    :class:`~repmlp.engine.LoopOptions`). Resolves ``cfg.amp`` first: saved resolved, a resume keeps it.
    ``auto_graphs``: whether ``--cuda-graphs auto`` may capture this task's steps."""
    cfg.amp = cfg.amp if cfg.amp is not None else procs.device.type == "cuda"
    scaler = cfg.amp and engine.amp_dtype(procs.device) == torch.float16
    graphs = engine.resolve_cuda_graphs(cfg.cuda_graphs, procs.device, world=procs.world,
                                        compile_choice=cfg.compile, scaler=scaler, auto=auto_graphs)  # fmt: skip
    return engine.LoopOptions(output=Path(cfg.output), config=cfg.to_dict(), lr_at=lr_at, ckpt_every=cfg.ckpt_every,
                              amp=cfg.amp, runtime_keys=cfg.RUNTIME,
                              cuda_graphs=graphs, compile=engine.resolve_compile(cfg.compile, procs.device, graphs),
                              **more)  # fmt: skip


def training_loader(
    dataset: Dataset, cfg: TrainOptions, procs: engine.DistInfo, model: nn.Module
) -> FolderLoader:
    """This process's shuffled, epoch-seeded training batches of ``dataset`` for ``model`` (checked by
    :func:`check_batchnorm_batch`), of ``cfg.train_limit`` examples: of a dataset with ``labels``, a seeded
    stratified subset that keeps every identity's share."""
    batch = per_process_batch(cfg.batch_size, procs)
    check_batchnorm_batch(model, cfg.batch_size, min(len(dataset), cfg.train_limit or len(dataset)), procs)
    if cfg.train_limit is not None and cfg.train_limit < len(dataset):  # type: ignore[arg-type]
        labels = getattr(dataset, "labels", None)
        keep = (
            range(cfg.train_limit) if labels is None else stratified_subset(labels, cfg.train_limit, cfg.seed)
        )
        dataset = torch.utils.data.Subset(dataset, list(keep))
    return FolderLoader(EpochSeeded(dataset, cfg.seed, train=True), batch_size=batch, train=True, seed=cfg.seed,
                        rank=procs.rank, world=procs.world, workers=cfg.workers, device=procs.device)  # fmt: skip


@dataclass
class RunResult:
    """What a face or segmentation run's ``train`` returns."""

    history: list[dict[str, Any]]
    ok: bool = True  # the converted model's outputs match the training form's (the main process checks)


@dataclass
class Run:
    """A face or segmentation run, ready to train: ``module`` (the model and its loss: images and labels ->
    loss) whose ``module.model`` is the network saved, ``param_groups(module)`` its SGD groups, their learning
    rates ``lr_at(step)``, and for the report ``meta`` (the files' metadata) and ``lines`` (markdown)."""

    module: nn.Module
    param_groups: Callable[[nn.Module], list[dict[str, Any]]]
    loader: FolderLoader
    lr_at: Callable[[int], list[float]]
    iterations: int
    kwargs: dict[str, Any]  # the model's options
    size: int  # the model's input side
    meta: dict[str, Any]
    lines: list[str]
    init: dict[str, Any] | None = None  # what --init loaded


def train_run(cfg: Any, procs: engine.DistInfo, run: Run) -> RunResult:
    """Train ``run`` for ``run.iterations`` SGD steps (momentum ``cfg.momentum``), resumed from ``cfg.output``'s
    checkpoint with ``cfg.resume``; then (main process) ``model.safetensors`` (training form),
    ``deploy.safetensors`` (converted, checked on two seeded random inputs ``(2, C, size, size)`` within
    :data:`repmlp.deploy.conversion.CONVERSION_RTOL` of the outputs' scale), ``train_log.json`` and ``report.md``."""
    opts = loop_options(cfg, procs, run.lr_at, auto_graphs=False, iterations=run.iterations,
                        log_interval=cfg.log_interval, extra_state={"model_kwargs": run.kwargs})  # fmt: skip
    state = engine.check_output(opts.output, cfg.resume, procs)
    net = engine.prepare_module(run.module, procs, form=cfg.fast_training)
    optimizer = torch.optim.SGD(run.param_groups(engine.unwrap(net)), lr=cfg.lr, momentum=cfg.momentum)
    loop = engine.train_loop(net, optimizer, run.loader, opts, procs, state)
    if not procs.is_main:
        return RunResult(loop.history)
    out, task, trained = Path(cfg.output), run.meta["task"], engine.unwrap(net).model.float().eval()
    x = torch.randn(2, getattr(trained, "in_chans", 3), run.size, run.size,
                    generator=torch.Generator().manual_seed(0)).to(next(trained.parameters()).device)  # fmt: skip
    diff = save_forms(out, trained, cfg.model, run.kwargs, run.meta, x).diff
    write_json(out / "train_log.json", {"task": task, "model": cfg.model, "model_kwargs": run.kwargs,
                                         "history": loop.history})  # fmt: skip
    results.info("saved %s and %s", out / "model.safetensors", out / "deploy.safetensors")
    ok = diff.max_rel_diff <= CONVERSION_RTOL
    check = (
        f"conversion check on {len(x)} random inputs, both forms in full float32 (no autocast, no TF32): max "
        f"|output diff| {diff.max_abs_diff:.2e} (relative {diff.max_rel_diff:.2e}, tolerance {CONVERSION_RTOL:g}) "
        f"-> {'equivalent' if ok else 'NOT EQUIVALENT'}"
    )
    (results.info if ok else results.error)("%s", check)
    lines = [*run.lines, f"- Processes: {procs.world}; {loop.mode} training step",
             "- Files: `model.safetensors` (training form), `deploy.safetensors` (converted), "
             f"`checkpoint.safetensors` (for --resume); evaluate with `repmlp eval --task {task}`",
             f"- Conversion: {check}", *report_lines(run.init)]  # fmt: skip
    title = {"face": "face", "seg": "segmentation"}[task]
    engine.write_run_report(out, f"repmlp {title} run: {cfg.model}", loop.history, lines)
    return RunResult(loop.history, ok)


def save_forms(
    out: Path, model: nn.Module, name: str, kwargs: dict[str, Any], extra: dict[str, Any], inputs: Any,
    device: torch.device | None = None,
) -> Conversion:  # fmt: skip
    """``out/model.safetensors`` (the training form ``model``, float32, eval mode) and ``out/deploy.safetensors``
    (converted, loaded back into ``create_model(name, deploy=True, **kwargs)``), both forms compared on
    ``inputs`` (:func:`repmlp.deploy.conversion.convert_and_check`: the check covers the file)."""
    save_model(out / "model.safetensors", model, name=name, model_kwargs=kwargs, form="train", extra=extra)
    file = DeployedFile(out / "deploy.safetensors", name, kwargs, extra)
    return convert_and_check(model, inputs, file=file, device=device)


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def load_for_eval(
    path: str, device: torch.device, task: str
) -> tuple[nn.Module | None, nn.Module, ModelMetadata]:
    """A ``task`` model file: ``(training form or None, converted, metadata)``; a training-form file is
    converted here, a deployed one used as is. A file of another task (its ``extra["task"]``; ``"cls"`` for one
    that records its ``dataset``) or of another kind of model is a :class:`UserError`."""
    model = load_model(path, device=device)  # it refuses weights holding NaN/inf
    meta = model.metadata
    found = meta.extra.get("task") or ("cls" if "dataset" in meta.extra else None)
    kind = None
    if found is not None and found != task:
        kind = f"{_FOUND.get(found, f'a {found!r} model')} ({meta.name})"
    elif not is_task_model(model, task):
        kind = f"model {meta.name!r}"
    if kind is not None:
        raise UserError(
            f"{path} holds {kind}, not {TASK_MODELS[task]}: give a checkpoint written by `repmlp train --task {task}`"
        )
    model.eval()
    return (
        (None, model, meta) if meta.form == "deploy" else (model, convert.reparameterize_model(model), meta)
    )


def evaluate_both_forms(
    evaluate: Callable[[nn.Module, str], dict[str, Any]],
    trained: nn.Module | None,
    deployed: nn.Module,
    check: bool,
) -> dict[str, Any]:
    """``evaluate(deployed, what)``'s metrics; with ``check``, the training form's too, under ``"training_time"``.

    The training form runs first, so that non-finite outputs there are blamed on the weights and those of the
    converted model alone on the conversion. A check compares the forms in full float32 (TF32 rounding on a GPU
    would show as a difference); the converted model alone runs in the session's own precision."""
    if check and trained is None:
        raise UserError("--check-conversion needs a training-form checkpoint (this one is already converted)")
    with full_float32() if check else contextlib.nullcontext():
        reference = evaluate(trained, "the training-form model") if check else None
        try:
            metrics = evaluate(deployed, "the converted model")
        except NonFiniteOutput:
            if reference is None:
                raise
            raise UserError("the converted model's outputs are NaN/inf while its training form's are finite: the "
                            "conversion failed") from None  # fmt: skip
    return metrics if reference is None else {**metrics, "training_time": reference}


def report_metrics(cfg: EvalOptions, metrics: dict[str, Any], lines: list[str]) -> None:
    """An evaluation's metrics printed (as JSON with ``--json``, else ``lines``), and written to
    ``cfg.output_json`` if given."""
    print(json.dumps(metrics, sort_keys=True) if cfg.json else "\n".join(lines))
    if cfg.output_json:
        write_json(Path(cfg.output_json), metrics)
