"""The one shape of every task's configs: a dataclass built from the parsed command line (:meth:`from_args`)
or in Python, checked by :meth:`TaskConfig.validate` (its fields' types, the ranges of
:data:`repmlp.tasks.limits.OPTIONS`, :data:`CHOICES` and the task's own rules) wherever it comes from."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from repmlp.data import DATASETS
from repmlp.engine import option_flag
from repmlp.engine.devices import COMPILE_CHOICES
from repmlp.errors import UserError
from repmlp.io.model_file import CheckpointError
from repmlp.tasks.limits import OPTIONS
from repmlp.tasks.recipes import PRESETS

__all__ = ["CHOICES", "TaskConfig", "TrainOptions", "EvalOptions"]

_C = TypeVar("_C", bound="TaskConfig")

# A config field -> the values it may take (the command line's choices too).
CHOICES: dict[str, tuple[str, ...]] = {
    "dataset": DATASETS,
    "preset": tuple(sorted(PRESETS)),
    "optimizer": ("sgd", "adamw"),
    "schedule": ("cosine", "constant"),
    "compile": COMPILE_CHOICES,
    "cuda_graphs": COMPILE_CHOICES,
    "mode": ("slide", "whole"),
}


@dataclass(kw_only=True)
class TaskConfig:
    """The base of every task's configs (JSON-serialisable: a training run's is saved in its state)."""

    # The fields that do not change the maths: a resumed run may change them (repmlp.engine.check_resumable).
    RUNTIME: ClassVar[frozenset[str]] = frozenset()
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = CHOICES  # a task may narrow them

    @classmethod
    def from_args(cls: type[_C], args: argparse.Namespace) -> _C:
        """The config of a parsed command line: the fields it has an option for, the others' defaults."""
        return cls.from_dict(vars(args))

    @classmethod
    def from_dict(cls: type[_C], d: dict[str, Any]) -> _C:
        """The config of a mapping (a saved state's), its keys that are no field left out."""
        return cls(**{k: v for k, v in d.items() if k in {f.name for f in dataclasses.fields(cls)}})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self, where: object = None) -> None:
        """A :class:`UserError` naming the option of the first value out of place; for a config read back
        from the training state ``where``, a :class:`CheckpointError` naming the file and the field."""
        for name, why in self.problems():
            if where is None:
                raise UserError(why)
            raise CheckpointError(f"{where}: config field {name!r}: {why} (an edited or foreign state: resume a "
                                  "run's own checkpoint, or train into another --output)")  # fmt: skip

    def problems(self) -> Iterator[tuple[str, str]]:
        """``(field, why)`` of each value not of its field's type, then out of its range or choices, then
        breaking one of the task's :meth:`rules` (each step sees values that passed the one before)."""
        hints, fields = typing.get_type_hints(type(self)), dataclasses.fields(self)
        values = {f.name: getattr(self, f.name) for f in fields}
        wrong = [(f.name, f"{option_flag(f.name)} must be {f.type}, got {values[f.name]!r}") for f in fields
                 if not _fits(values[f.name], hints[f.name])]  # fmt: skip
        if wrong:
            yield from wrong
            return
        for name, value in values.items():
            rng, choices = OPTIONS.get(name), self.CHOICES.get(name)
            if value is not None and rng is not None and not rng.contains(value):
                yield name, f"{option_flag(name)} must be in {rng.describe()}, got {value}"
            if value is not None and choices is not None and value not in choices:
                yield name, f"{option_flag(name)} must be one of {', '.join(choices)}, got {value!r}"
        yield from self.rules()

    def rules(self) -> Iterator[tuple[str, str]]:
        """The task's own rules between fields: ``(field, why)`` of each one broken."""
        return iter(())


@dataclass(kw_only=True)
class TrainOptions(TaskConfig):
    """The training options every task shares; a task's ``TrainConfig`` adds its own and its defaults."""

    data_dir: str | None = None
    output: str = "runs/latest"
    model: str
    model_args: dict[str, Any] = field(default_factory=dict)  # --model-arg KEY=VALUE
    init: str | None = None  # a model file whose weights start the run (--init)
    batch_size: int  # global, split over the processes
    lr: float
    momentum: float = 0.9
    weight_decay: float
    seed: int = 0
    train_limit: int | None = None
    # Mixed precision changes the maths: a resumed run keeps it (None: on for CUDA, fixed at the start).
    amp: bool | None = None
    device: str = "auto"
    workers: int = 2
    threads: int | None = None
    ckpt_every: int = 0
    compile: str = "auto"  # --compile: auto, on, off (see repmlp.engine.resolve_compile)
    cuda_graphs: str = "auto"  # --cuda-graphs: auto, on, off (see repmlp.engine.resolve_cuda_graphs)
    fast_training: bool = True  # the training form (repmlp.engine.forms.training_form); off: plain modules
    resume: bool | str = False  # continue the run in output from its checkpoint; "auto": if it holds one

    RUNTIME = frozenset(
        {"data_dir", "output", "device", "workers", "threads", "ckpt_every", "compile", "cuda_graphs",
         "fast_training", "resume", "log_interval"}
    )  # fmt: skip

    def problems(self) -> Iterator[tuple[str, str]]:
        if isinstance(self.resume, str) and self.resume != "auto":
            yield "resume", f"--resume takes no value or auto, got {self.resume!r}"
        yield from super().problems()


@dataclass(kw_only=True)
class EvalOptions(TaskConfig):
    """The evaluation options every task shares."""

    checkpoint: str | None = None
    workers: int = 2
    device: str = "auto"
    json: bool = False  # print the metrics as JSON


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` (as JSON gives it back) fits a field's annotation ``hint``; ``bool`` is no number."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint in (int, float):
        return not isinstance(value, bool) and isinstance(value, (int, float) if hint is float else int)
    if hint in (bool, str):
        return isinstance(value, hint)
    if origin is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    return True  # Any
