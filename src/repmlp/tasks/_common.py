"""Pieces shared by the face and segmentation pipelines: processes, models, seeded data, logs."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from repmlp.deploy.conversion import CONVERSION_RTOL
from repmlp.engine import DistInfo
from repmlp.errors import UserError

if TYPE_CHECKING:
    from repmlp.io.model_file import ModelMetadata

log = logging.getLogger(__name__)


def per_process_batch(global_batch: int, procs: DistInfo, flag: str = "--batch-size") -> int:
    """Split the global batch size (the paper's numbers are global) evenly over the processes."""
    if global_batch % procs.world:
        raise UserError(f"{flag} {global_batch} is not divisible by the {procs.world} processes")
    return global_batch // procs.world


_T = TypeVar("_T", bound="TrainOptions")
_E = TypeVar("_E", bound="EvalOptions")


@dataclass
class TrainOptions:
    """The training options every task shares, typed (built from the parsed command line by
    :meth:`from_args`); a task's config adds its own fields. The options of :data:`RUNTIME` do not
    change the maths, so a resumed run may change them; a resume must repeat every other field."""

    data_dir: str
    output: str
    model: str
    model_arg: list[tuple[str, Any]]
    init: str | None
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    seed: int
    train_limit: int | None
    workers: int
    log_interval: int
    resume: bool
    ckpt_every: int
    device: str
    amp: bool | None
    threads: int | None
    stop_after_steps: int | None
    compile: str
    cuda_graphs: str

    # compile and CUDA graphs are runtime options: a resumed run may change them (they change rounding, not
    # the maths).
    RUNTIME: ClassVar[frozenset[str]] = frozenset(
        {"data_dir", "output", "resume", "device", "workers", "threads", "log_interval", "ckpt_every",
         "stop_after_steps", "compile", "cuda_graphs"}
    )  # fmt: skip

    @classmethod
    def from_args(cls: type[_T], args: argparse.Namespace) -> _T:
        """The config of a parsed command line (every field must be an option there)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def maths(self) -> dict[str, Any]:
        """The fields a resume must repeat: every declared one but :data:`RUNTIME`'s."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self.RUNTIME}


@dataclass
class EvalOptions:
    """The evaluation options every task shares, typed (see :class:`TrainOptions`)."""

    checkpoint: str
    check_conversion: bool
    json: bool
    output_json: str | None
    workers: int
    device: str

    @classmethod
    def from_args(cls: type[_E], args: argparse.Namespace) -> _E:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def resolve_img_size(kwargs: dict[str, Any], flag: str, value: int | None, default: int) -> int:
    """The one square input size of a run: ``--model-arg img_size`` or ``flag`` (``value``).

    The data are sized with it and the model built for it (written into ``kwargs``), so the two cannot
    disagree; giving both with different values is a :class:`UserError`. ``default`` when neither is given.
    """
    given = kwargs.get("img_size")
    if isinstance(given, (list, tuple)) and len(given) == 2 and given[0] == given[1]:
        given = given[0]
    if given is not None and (not isinstance(given, int) or isinstance(given, bool)):
        raise UserError(f"--model-arg img_size must be one integer (square inputs), got {given!r}")
    if given is not None and value is not None and given != value:
        raise UserError(
            f"--model-arg img_size {given} differs from {flag} {value}: the model is built for the "
            f"size of its inputs; give one of them"
        )
    size = given if given is not None else value if value is not None else default
    kwargs["img_size"] = size
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
    if task == "face":
        # The loss and the metrics need the embedding width; face models return (N, embedding_dim).
        return getattr(model, "embedding_dim", None) is not None
    if task == "seg":
        from repmlp.models.pspnet import PSPNet

        return isinstance(model, PSPNet)
    if task == "cls":  # the others' models return embeddings or score maps (with auxiliary outputs)
        return not (is_task_model(model, "face") or is_task_model(model, "seg"))
    raise ValueError(f"unknown task {task!r}")


def require_task_model(model: nn.Module, task: str, name: str) -> None:
    """:class:`UserError` unless model ``name`` is of ``task``'s kind; it names the task the model is for."""
    if not is_task_model(model, task):
        other = next((t for t in ("face", "seg") if t != task and is_task_model(model, t)), None)
        hint = f" ({name} is {_FOUND[other]}: train it with --task {other})" if other else ""
        raise UserError(f"model {name!r} is not {TASK_MODELS[task]}{hint}")


def check_batchnorm_batch(model: nn.Module, batch_size: int, examples: int, procs: DistInfo) -> None:
    """Refuse to train a model with BatchNorm on batches of one example, before the first step.

    BatchNorm in training mode normalises each channel over the batch: one example on a 1x1 feature map
    makes torch raise mid-step, and elsewhere gives statistics of a single image. A step's batch is
    ``batch_size`` split over the processes, or all of ``examples`` (the training examples) when there
    are fewer (the loaders pad each process's share to the same length); with SyncBatchNorm (several
    GPUs, :func:`repmlp.engine.prepare_module`) the statistics are over every process's share."""
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
    raise UserError(
        f"BatchNorm needs at least 2 examples per batch, but {cause} leaves 1"
        f"{' per process' if procs.world > 1 and not synced else ''}: give a --batch-size of 2 or more"
        f"{' per process' if procs.world > 1 and not synced else ''} and at least as many training examples"
    )


class NonFiniteOutput(UserError):
    """A model's outputs hold NaN/inf (see :func:`check_finite`)."""


def check_finite(output: Tensor, what: str = "the model") -> None:
    """:class:`NonFiniteOutput` when ``output`` holds NaN/inf: metrics of such outputs would mean nothing."""
    if not bool(torch.isfinite(output).all()):
        raise non_finite(what)


def non_finite(what: str) -> NonFiniteOutput:
    """The error for ``what``'s outputs holding NaN/inf."""
    return NonFiniteOutput(f"{what}'s outputs are NaN/inf (diverged weights?); retrain it with a lower --lr")


def conversion_broke(what: str) -> UserError:
    """The error for a converted model whose outputs are NaN/inf where its training form's are finite."""
    return UserError(
        f"{what}'s outputs are NaN/inf while its training form's are finite: the conversion failed"
    )


class EpochSeeded(Dataset):
    """Adapts a dataset to TRAIN's loaders: items are ``(index, epoch)`` and augmentation is seeded.

    The torch RNG is seeded from ``(seed, epoch, index)`` around each item, so a sample's random
    augmentation does not depend on worker count or on which process loads it.
    """

    def __init__(self, dataset: Dataset, seed: int, train: bool) -> None:
        self.dataset, self.seed, self.train = dataset, seed, train

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, item: tuple[int, int]):
        index, epoch = item
        seed = int(np.random.SeedSequence([self.seed, epoch, index, int(self.train)]).generate_state(1)[0])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.dataset[index]


def model_options(cfg: TrainOptions) -> dict[str, Any]:
    """The model's options (``--model-arg KEY=VALUE``, the last of a key wins)."""
    return dict(cfg.model_arg)


def check_train_options(args: TrainOptions) -> None:
    """Range checks argparse cannot do alone; each bad option is one :class:`UserError`."""
    if not 0 <= args.momentum < 1:
        raise UserError(f"--momentum must be in [0, 1), got {args.momentum}")


def start_run(args: TrainOptions, procs: DistInfo, iterations: int, lr_at, model_kwargs: dict[str, Any]):
    """The engine's options for this run; checks ``--output`` (refusing to overwrite a run) and loads
    the state to resume. Returns ``(options, state or None)``."""
    from repmlp.engine import LoopOptions, amp_dtype, check_output, resolve_compile, resolve_cuda_graphs

    amp = args.amp if args.amp is not None else procs.device.type == "cuda"
    scaler = amp and amp_dtype(procs.device) == torch.float16
    # CUDA graphs only when asked for (auto=False): this task's steps have not been measured with them.
    graphs = resolve_cuda_graphs(
        args.cuda_graphs,
        procs.device,
        world=procs.world,
        compile_choice=args.compile,
        scaler=scaler,
        auto=False,
    )
    # Every declared option but the runtime ones changes the maths: a resume must repeat them.
    config = {**args.maths(), "model_kwargs": model_kwargs, "amp": amp}
    opts = LoopOptions(
        output=Path(args.output),
        config=json.loads(json.dumps(config, default=str)),
        lr_at=lr_at,
        iterations=iterations,
        ckpt_every=args.ckpt_every,
        log_interval=args.log_interval,
        amp=amp,
        stop_after_steps=args.stop_after_steps,
        extra_state={"model_kwargs": model_kwargs},
        cuda_graphs=graphs,
        compile=resolve_compile(args.compile, procs.device, graphs),
    )
    return opts, check_output(opts.output, args.resume, procs)


def training_loader(dataset: Dataset, args: TrainOptions, procs: DistInfo, batch_size: int):
    """This process's shuffled, epoch-seeded training batches of ``dataset`` (``--seed``, ``--workers``,
    ``--train-limit``: of a dataset with ``labels``, a seeded stratified subset)."""
    from repmlp.data.loader import FolderLoader

    if args.train_limit is not None and args.train_limit < len(dataset):  # type: ignore[arg-type]
        labels = getattr(dataset, "labels", None)
        if labels is not None:  # an identity folder: a seeded subset that keeps every identity's share
            from repmlp.data.folder import stratified_subset

            keep = stratified_subset(labels, args.train_limit, args.seed)
        else:
            keep = list(range(args.train_limit))
        dataset = torch.utils.data.Subset(dataset, keep)
    return FolderLoader(
        EpochSeeded(dataset, args.seed, train=True),
        batch_size=batch_size,
        train=True,
        seed=args.seed,
        rank=procs.rank,
        world=procs.world,
        workers=args.workers,
        device=procs.device,
    )


def evaluate_both_forms(
    evaluate: Callable[[nn.Module, str], dict[str, Any]],
    trained: nn.Module | None,
    deployed: nn.Module,
    check: bool,
) -> dict[str, Any]:
    """``evaluate(deployed)``'s metrics; with ``check``, also the training form's under ``"train_form"``.

    The training form runs first, so that non-finite outputs there are blamed on the weights and
    non-finite outputs of the converted model alone on the conversion.
    """
    from repmlp.nn.numerics import full_float32

    # A check compares the forms in full float32 (TF32 rounding on a GPU would show as a difference);
    # the converted model alone is evaluated in the session's own precision.
    precision = full_float32() if check else contextlib.nullcontext()
    with precision:
        reference = evaluate(trained, "the training-form model") if check else None
        try:
            metrics = evaluate(deployed, "the converted model")
        except NonFiniteOutput:
            if reference is None:
                raise
            raise conversion_broke("the converted model") from None
    if reference is not None:
        metrics["train_form"] = reference
    return metrics


@dataclass
class ConversionCheck:
    """How far the converted model's outputs are from the training form's on ``inputs`` random inputs
    (:func:`repmlp.deploy.conversion.convert_and_check`)."""

    max_abs_diff: float
    max_rel_diff: float  # relative to the largest training-form output
    inputs: int

    @property
    def equivalent(self) -> bool:
        return self.max_rel_diff <= CONVERSION_RTOL

    def summary(self) -> str:
        """One line for logs and reports."""
        verdict = "equivalent" if self.equivalent else "NOT EQUIVALENT"
        return (
            f"conversion check on {self.inputs} random inputs, both forms in full float32 (no autocast, no "
            f"TF32): max |output diff| {self.max_abs_diff:.2e} (relative {self.max_rel_diff:.2e}, tolerance "
            f"{CONVERSION_RTOL:g}) -> {verdict}"
        )


def save_run(
    out: Path,
    trained: nn.Module,
    name: str,
    kwargs: dict[str, Any],
    meta: dict[str, Any],
    history: list,
    input_size: tuple[int, ...],
) -> ConversionCheck:
    """Write a task run: ``model.safetensors`` (training form), ``deploy.safetensors`` (converted, loaded
    back into ``create_model(name, deploy=True, **kwargs)`` for the check) and ``train_log.json``; returns
    the conversion check, logged too: both forms on two seeded random inputs ``(2, *input_size)``
    (``input_size`` ``(C, H, W)``), compared on their (first) outputs, embeddings ``(2, D)`` or score maps
    ``(2, K, H, W)``."""
    from repmlp.deploy.conversion import DeployedFile, convert_and_check
    from repmlp.io.model_file import save_model

    trained = trained.float().eval()
    save_model(out / "model.safetensors", trained, name=name, model_kwargs=kwargs, form="train", extra=meta)
    device = next(trained.parameters()).device
    x = torch.randn(2, *input_size, generator=torch.Generator().manual_seed(0)).to(device)
    conversion = convert_and_check(
        trained, x, file=DeployedFile(out / "deploy.safetensors", name, kwargs, meta)
    )
    write_json(
        out / "train_log.json",
        {"task": meta.get("task"), "model": name, "model_kwargs": kwargs, "history": history},
    )
    log.info("saved %s and %s", out / "model.safetensors", out / "deploy.safetensors")
    check = ConversionCheck(conversion.diff.max_abs_diff, conversion.diff.max_rel_diff, len(x))
    (log.info if check.equivalent else log.error)("%s", check.summary())
    return check


def write_json(path: Path, obj: Any) -> None:
    from repmlp.io.model_file import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def load_for_eval(
    path: str, device: torch.device, task: str
) -> tuple[nn.Module | None, nn.Module, ModelMetadata]:
    """Load a ``task`` checkpoint; returns ``(train_form_or_None, deployed, metadata)`` (the file's
    :class:`~repmlp.io.model_file.ModelMetadata`).

    A training-form checkpoint is converted here with ``reparameterize_model``; a deployed one is used
    as is (and the first element is ``None``). A checkpoint of another task (its ``extra["task"]``,
    ``"cls"`` for a classification run, which records its ``dataset``) or of another kind of model, and
    one whose weights hold NaN/inf (a diverged run), are :class:`UserError`.
    """
    from repmlp.io.model_file import load_model
    from repmlp.nn.convert import reparameterize_model

    model = load_model(path, device=device)
    meta = model.metadata
    found = meta.extra.get("task") or ("cls" if "dataset" in meta.extra else None)
    kind = None
    if found is not None and found != task:
        kind = f"{_FOUND.get(found, f'a {found!r} model')} ({meta.name})"
    elif not is_task_model(model, task):
        kind = f"model {meta.name!r}"
    if kind is not None:
        raise UserError(
            f"{path} holds {kind}, not {TASK_MODELS[task]}: give a checkpoint written by "
            f"`repmlp train --task {task}`"
        )
    model.eval()  # load_model refused NaN/inf weights already
    if meta.form == "deploy":
        return None, model, meta
    return model, reparameterize_model(model), meta


ScalarFn = Callable[[nn.Module], dict[str, Any]]
