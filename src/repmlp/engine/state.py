"""What makes a run resumable: its folder (locked while it trains), the options a resume must repeat, the RNG
states, and the check of a training state read back before any of it is loaded."""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from repmlp.data.inputs import not_regular
from repmlp.engine.processes import DistInfo, restart_count
from repmlp.errors import RunFinished, UserError
from repmlp.io.model_file import check_field, staging_leftovers
from repmlp.io.state import load_state

try:
    import fcntl
except ImportError:  # not POSIX (Windows): runs are not locked
    fcntl = None

log = logging.getLogger(__name__)

STATE_FILE = "checkpoint.safetensors"
METRICS_FILE = "metrics.csv"
REPORT_FILE = "report.md"  # the last file a run writes: a folder holding it is a finished run
MODEL_FILE = "model.safetensors"  # the trained model a run writes at its end


def check_output(out: Path, resume: bool | str, procs: DistInfo, *,
                 finished_ok: bool = False) -> dict[str, Any] | None:  # fmt: skip
    """The saved state to resume from (``None`` for a new run), after locking ``out`` (:func:`lock_output`):
    ``out`` must be missing or empty, or hold a run, never overwritten without ``resume``; a finished run
    (``report.md`` written) is not resumed unless ``finished_ok`` (``repmlp study`` redoing its end).
    ``resume="auto"`` resumes ``out``'s run if it holds a checkpoint and starts one otherwise (a job that a
    scheduler reruns after a preemption); so do processes that torchrun restarted (:func:`restart_count`); of a
    finished run it raises :class:`RunFinished`. The temporary folders of writes that a kill cut short
    (:func:`staging_leftovers`) are the run's own: cleared once a finished run is ruled out."""
    auto, decided = resume == "auto", resume == "auto" or (resume is False and restart_count() > 0)
    if decided:
        resume = not_regular(out / STATE_FILE) is None
    try:  # undecodable bytes in the name (surrogate escapes): the model files and the report could not hold it
        str(out).encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"--output {ascii(str(out))} is not valid UTF-8: name the run in UTF-8") from None
    kind = not_regular(out)
    if kind not in ("missing", "a folder"):
        raise UserError(f"--output {out} is {kind or 'a file'}, not a run folder")
    if kind == "a folder":
        lock_output(out, procs, create=False)
    finished = (out / REPORT_FILE).exists()
    if auto and finished and not finished_ok:  # said by process 0 only
        raise RunFinished(f"{out} holds a run that has finished already: nothing to do (its results: "
                          f"{out / REPORT_FILE})" if procs.is_main else "")  # fmt: skip
    if resume and finished and not finished_ok:
        raise UserError(f"{out} holds a finished run ({REPORT_FILE} written): nothing to resume, and its files are "
                        "left as they are (train into another --output to run it again)")  # fmt: skip
    for leftover in staging_leftovers(out) if procs.is_main else []:
        shutil.rmtree(leftover, ignore_errors=True)
    if resume:
        if not_regular(out / STATE_FILE) is not None:
            raise UserError(f"nothing to resume: {out / STATE_FILE} does not exist or is not a regular file")
        return load_state(out / STATE_FILE)
    if decided and procs.is_main:
        log.info("%s holds no checkpoint: starting the run", out)
    if procs.is_main and kind == "a folder":
        if (out / STATE_FILE).is_file() or (out / MODEL_FILE).is_file():  # a run's, not merely a report.md
            raise UserError(f"{out} already holds a run, a finished one ({REPORT_FILE} written): its files are "
                            "left as they are; train into another --output" if finished else
                            f"{out} already holds a run; use --resume to continue it or another --output")  # fmt: skip
        if others := _entries(out):
            raise UserError(f"--output {out} is a folder holding other files ({others}), not a run: train into a "
                            "new or empty folder")  # fmt: skip
    return None


def _entries(folder: Path, shown: int = 3) -> str:
    """The first ``shown`` names in ``folder`` (sorted) and how many more: ``""`` for an empty folder."""
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        raise UserError(f"cannot list --output {folder}: {exc.strerror or exc}") from None
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


# This process's run locks: (st_dev, st_ino) -> the open folder whose flock is held until the process exits
# (the kernel drops a flock with its process, also on a crash or a kill).
_LOCKS: dict[tuple[int, int], int] = {}


def _drop_inherited_locks() -> None:
    """In a forked child (a DataLoader worker): close its copies of the lock descriptors. A flock belongs to
    the open file, which a fork shares: a worker outliving its killed trainer for a moment would still hold
    the lock and refuse a ``--resume`` right after the kill. The parent's lock stays."""
    for fd in _LOCKS.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_locks)


def lock_output(out: Path, procs: DistInfo, *, create: bool = True) -> None:
    """Hold an exclusive ``flock`` on the run folder ``out`` for the rest of this process (rank 0 only): a
    second process writing the same folder is refused with one line naming its pid. ``create``: make the
    folder first; a folder this process creates must still be empty once locked."""
    if not procs.is_main:
        return
    existed = out.is_dir()
    if create:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create --output {out}: {exc.strerror or exc}") from None
    info = os.stat(out)
    key = (info.st_dev, info.st_ino)
    held = _LOCKS.pop(key, None)
    if held is not None:
        if os.fstat(held).st_nlink > 0:  # this process holds it already (a run resumed in the same process)
            _LOCKS[key] = held
            return
        os.close(held)  # a deleted folder's lock, whose inode number the new folder reuses
    if fcntl is None:
        return
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid = _lock_holder(info)
        raise UserError(
            f"another repmlp process is writing {out}{f' (pid {pid})' if pid else ''}: wait for it to end, or "
            "train into another --output"
        ) from None
    except OSError as exc:  # a file system without flock (some network mounts): run unlocked
        os.close(fd)
        log.debug("cannot lock %s (%s): the run goes on without a lock", out, exc)
        return
    _LOCKS[key] = fd
    if create and not existed and _entries(out):
        raise UserError(f"another process wrote into {out} as this run started: train into another --output")


def _lock_holder(info: os.stat_result) -> int | None:
    """The pid holding a ``flock`` on the file of ``info``, from ``/proc/locks`` (Linux), else ``None``."""
    ident = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        with open("/proc/locks") as f:
            rows = [line.split() for line in f]
        return next((int(r[4]) for r in rows if len(r) > 5 and r[1] == "FLOCK" and r[5] == ident), None)
    except (OSError, ValueError):
        return None


def option_flag(key: str) -> str:
    """A config key's command-line spelling (``model_args`` -> ``--model-arg``, ``lr_steps`` -> ``--lr-steps``)."""
    return "--model-arg" if key in ("model_args", "model_arg") else "--" + key.replace("_", "-")


def check_resumable(saved: dict[str, Any], config: dict[str, Any], where: Path, *, runtime: Collection[str] = (),
                    given: Collection[str] | None = None,
                    hint: str = "repeat the run's options, or train into another --output",
                    ) -> dict[str, Any]:  # fmt: skip
    """The configuration a resumed run continues with: ``saved``, with ``config``'s runtime options. Of the
    keys the user set (``given``; ``None``: all of ``config``), those outside ``runtime`` change the maths and
    must equal the saved values (else a :class:`UserError`); given runtime keys replace the saved values. A
    saved key that is no key of ``config`` (an edited or foreign state) is refused too."""
    if unknown := sorted(set(saved) - set(config)):
        shown = ", ".join(repr(k[:40]) for k in unknown[:4])
        raise UserError(f"{Path(where) / STATE_FILE}: config field(s) {shown}: no option of this run (an edited or "
                        "foreign state: resume a run's own checkpoint, or train into another --output)")  # fmt: skip
    keys = set(config) if given is None else set(given)
    conflicts = [
        f"{option_flag(k)} {saved[k]!r}, not {config[k]!r}"
        for k in sorted(keys)
        if k not in runtime and k in saved and k in config and saved[k] != config[k]
    ]
    if conflicts:
        more = " ..." if len(conflicts) > 4 else ""
        raise UserError(
            f"cannot resume {where}: its checkpoint was trained with {'; '.join(conflicts[:4])}{more} ({hint})"
        )
    return {**saved, **{k: config[k] for k in runtime if k in keys and k in config}}


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states: python, numpy, torch (CPU) and, on a GPU, CUDA."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Inverse of :func:`rng_state` (also after a state file's round trip, which turns tuples into lists)."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ------------------------------------------------------------------------ the checks of a state read back
# Settings torch fills in itself when a state lacks them (implementation choices, not the maths).
_FILLED_ON_LOAD = frozenset({"foreach", "fused", "differentiable", "capturable", "decoupled_weight_decay"})
# Optimizer class -> the per-parameter state it keeps (other optimizers: any names, each checked alike).
_ADAM = frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
_ENTRY_KEYS = {"SGD": frozenset({"momentum_buffer"}), "Adam": _ADAM, "AdamW": _ADAM}
_NON_NEGATIVE = frozenset({"exp_avg_sq", "max_exp_avg_sq"})  # their square roots are taken
_MAX_STEPS = 2**53  # an optimizer's step count (a float32 or float64 tensor in torch's Adam)


def check_state(state: dict[str, Any], optimizer: torch.optim.Optimizer, steps_per_epoch: int, total: int,
                fields: Sequence[str], where: object) -> dict[str, Any]:  # fmt: skip
    """The one check of what a training state (the file ``where``) holds besides its weights, before any of it
    is loaded: a ``config`` mapping; the position on one of this run's ``steps_per_epoch`` batches (``total``
    steps); a ``history`` with a number for each of ``fields``; sums of numbers; an optimizer state that
    ``optimizer`` could have written. Returns the position's fields; raises ``ValueError``."""
    if not isinstance(state.get("config"), dict):
        raise ValueError("its config is not a mapping")
    bounds = {"step": total, "batch": steps_per_epoch, "epoch": total // max(1, steps_per_epoch) + 1}
    for key, hi in bounds.items():
        check_field(where, key, state[key], rule=range(hi + 1))
    step, epoch, batch = (int(state[k]) for k in ("step", "epoch", "batch"))
    if step != epoch * steps_per_epoch + batch:
        raise ValueError(
            f"its position (epoch {epoch}, batch {batch}, step {step}) is not one of this run's "
            f"{steps_per_epoch} batches an epoch"
        )
    history = state["history"]
    if not isinstance(history, list) or not all(isinstance(r, dict) for r in history):
        raise ValueError("its history is not a list of records")
    for n, record in enumerate(history):
        if bad := [f for f in fields if not _is_number(record.get(f))]:
            raise ValueError(f"its history record {n} has no number for {', '.join(bad)}")
    sums = {"epoch_acc": state["epoch_acc"], "window": state.get("window", {})}
    for name, value in sums.items():
        if not isinstance(value, dict) or not all(_is_number(v) for v in value.values()):
            raise ValueError(f"its {name} is not a mapping of numbers")
    _check_optimizer(optimizer, state["optimizer"])
    return {"step": step, "epoch": epoch, "batch": batch, "history": history, **sums}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_optimizer(optimizer: torch.optim.Optimizer, saved: Any) -> None:
    """``saved`` (an ``Optimizer.state_dict()`` read back) is one ``optimizer`` could have written in this run:
    ``load_state_dict`` takes anything (a buffer of another shape fails later, one of another dtype is cast,
    ``maximize: true`` trains uphill), so every group's settings (but the scheduled ``lr``), parameter ids and
    per-parameter state (known names, the parameter's shape and dtype, finite) must be this run's."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        raise ValueError("its optimizer state is not a mapping with a list of 'param_groups'")
    groups, ours = saved["param_groups"], optimizer.state_dict()["param_groups"]
    if len(groups) != len(ours):
        raise ValueError(f"its optimizer has {len(groups)} parameter groups, this run's {len(ours)}")
    for i, (group, mine) in enumerate(zip(groups, ours, strict=True)):
        where = f"its optimizer group {i}"
        if not isinstance(group, dict):
            raise ValueError(f"{where} is not a mapping")
        if unknown := set(group) - set(mine):
            raise ValueError(f"{where} has unknown setting(s) {', '.join(sorted(map(str, unknown)))}")
        if missing := set(mine) - set(group) - _FILLED_ON_LOAD:
            raise ValueError(f"{where} has no {', '.join(sorted(missing))}")
        for key in sorted(set(mine) & set(group)):
            value, expected = _plain(group[key]), _plain(mine[key])
            if key == "lr":  # set by the schedule before every step
                if not (_is_number(value) and 0 <= value < math.inf):
                    raise ValueError(f"{where}'s lr is {value!r}, not a rate >= 0")
            # type() too: True == 1 == 1.0, but momentum True is an edit, not this run's 0.9
            elif value != expected or type(value) is not type(expected):
                raise ValueError(f"{where}'s {key} is {_short(value)}, this run's is {_short(expected)}")
    entries = saved.get("state")
    if not isinstance(entries, dict):
        raise ValueError("its optimizer state has no mapping of per-parameter 'state'")
    ids = [pid for g in ours for pid in g["params"]]  # torch numbers the parameters 0..n-1 in group order
    params = dict(zip(ids, [p for g in optimizer.param_groups for p in g["params"]], strict=True))
    keys = _ENTRY_KEYS.get(type(optimizer).__name__)
    for pid, entry in entries.items():
        if pid not in params or not isinstance(entry, dict):
            raise ValueError(f"its optimizer state of parameter id {pid!r} is not a mapping for a parameter")
        for name, value in entry.items():
            _check_entry(
                f"its optimizer state {name!r} of parameter id {pid}", name, value, params[pid], keys
            )


def _check_entry(where: str, name: str, value: Any, param: torch.Tensor, keys: frozenset[str] | None) -> None:
    """A parameter's saved state ``name``: a step count (a whole number >= 0), else a tensor of the
    parameter's shape and dtype, finite (second moments >= 0)."""
    if keys is not None and name not in keys:
        raise ValueError(f"{where} is not one of this optimizer's ({', '.join(sorted(keys))})")
    if name == "step":
        count = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        if not (
            _is_number(count) and math.isfinite(count) and count == int(count) and 0 <= count <= _MAX_STEPS
        ):
            raise ValueError(f"{where} is {_short(value)}, not a step count")
    elif value is None and name == "momentum_buffer":  # SGD without momentum keeps None
        return
    elif not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} is {_short(value)}, not a tensor")
    elif value.shape != param.shape or value.dtype != param.dtype:
        raise ValueError(
            f"{where} is a {value.dtype} tensor of shape {tuple(value.shape)}, the parameter a "
            f"{param.dtype} one of shape {tuple(param.shape)}"
        )
    elif value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise ValueError(f"{where} holds NaN/inf")
    elif name in _NON_NEGATIVE and bool((value < 0).any()):
        raise ValueError(f"{where} holds negative values (second moments are >= 0)")


def _plain(value: Any) -> Any:
    """``value`` as a state file gives it back: tuples as lists."""
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
