"""Checks of what a training state holds besides the weights, before a resumed run loads it.

``Optimizer.load_state_dict`` takes whatever a state holds: a momentum buffer of another shape fails only
at the first step (a traceback), one of another dtype is silently cast, ``momentum: "x"`` or
``weight_decay: 1e300`` fail inside the update, ``maximize: true`` trains uphill without a word, and a
parameter listed twice gets another's buffer. The run's optimizer, built from the run's (checked)
options, is what a resumed state must fit: :func:`check_resumed_state` compares the two and checks the
history the report reads, raising ``ValueError`` (the loop makes it one line naming the state file).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["check_resumed_state", "check_optimizer_state", "check_history"]

# Settings torch fills in itself when a state saved by another version lacks them (implementation
# choices, not the maths): a state may miss these, never the others.
_FILLED_ON_LOAD = frozenset({"foreach", "fused", "differentiable", "capturable", "decoupled_weight_decay"})
# Set by the loop before every step (the schedule), so any finite rate >= 0 is as good as another.
_SCHEDULED = "lr"
_MAX_RATE = 1e6  # repmlp.tasks.limits.MAX_REAL: the largest --lr the command line takes
_MAX_STEPS = 2**53  # an optimizer's step count (a float32 or float64 tensor in torch's Adam)
# Optimizer class -> the per-parameter state it keeps (other optimizers: any names, each checked alike).
_ENTRY_KEYS: dict[type, frozenset[str]] = {
    torch.optim.SGD: frozenset({"momentum_buffer"}),
    torch.optim.Adam: frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    torch.optim.AdamW: frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
}
_NON_NEGATIVE = frozenset({"exp_avg_sq", "max_exp_avg_sq"})  # their square roots are taken


def check_resumed_state(
    optimizer: torch.optim.Optimizer, state: dict[str, Any], history_fields: Sequence[str]
) -> None:
    """``state["optimizer"]`` fits ``optimizer`` (:func:`check_optimizer_state`) and every record of
    ``state["history"]`` has ``history_fields`` (:func:`check_history`); ``ValueError`` otherwise."""
    check_optimizer_state(optimizer, state["optimizer"])
    check_history(state["history"], history_fields)


def check_optimizer_state(optimizer: torch.optim.Optimizer, saved: Any) -> None:
    """``ValueError`` unless ``saved`` (an ``Optimizer.state_dict()`` read back from a file) is one
    ``optimizer`` could have written in this run: as many groups with as many parameters, the same
    settings (``optimizer`` was built from the run's options; the scheduled ``lr`` excepted: a finite rate
    >= 0), parameter ids listed once each, and per-parameter state of the parameter's shape and dtype."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        raise ValueError("its optimizer state is not a mapping with a list of 'param_groups'")
    groups, entries = saved["param_groups"], saved.get("state")
    live = optimizer.param_groups
    if len(groups) != len(live):
        raise ValueError(f"its optimizer has {len(groups)} parameter groups, this run's {len(live)}")
    # Compared with the settings this run's optimizer saves (tuples as lists: a state file holds lists).
    mine = optimizer.state_dict()["param_groups"]
    params: dict[int, torch.Tensor] = {}  # a saved id -> the parameter its state is loaded into
    for i, (group, ours, current) in enumerate(zip(groups, mine, live, strict=True)):
        _check_group(i, group, ours)
        ids = group["params"]
        if not isinstance(ids, list) or len(ids) != len(current["params"]):
            count = len(ids) if isinstance(ids, list) else repr(ids)
            raise ValueError(
                f"its optimizer group {i} holds {count} parameters, this run's {len(current['params'])}"
            )
        for pid, param in zip(ids, current["params"], strict=True):
            if isinstance(pid, bool) or not isinstance(pid, int):
                raise ValueError(f"its optimizer group {i} lists a parameter id {pid!r} (not an integer)")
            if pid in params:
                raise ValueError(f"its optimizer lists parameter id {pid} twice")
            params[pid] = param
    if not isinstance(entries, dict):
        raise ValueError("its optimizer state has no mapping of per-parameter 'state'")
    keys = _ENTRY_KEYS.get(type(optimizer))
    for pid, entry in entries.items():
        if pid not in params:
            raise ValueError(
                f"its optimizer state has an entry for parameter id {pid!r}, which no group lists"
            )
        _check_entry(pid, entry, params[pid], type(optimizer).__name__, keys)


def _plain(value: Any) -> Any:
    """``value`` as a state file gives it back: tuples as lists."""
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _check_group(i: int, group: Any, ours: dict[str, Any]) -> None:
    """A saved parameter group's settings: this run's keys, this run's values (the rate: any finite >= 0)."""
    if not isinstance(group, dict):
        raise ValueError(f"its optimizer group {i} is not a mapping")
    unknown = sorted(map(str, set(group) - set(ours)))
    missing = sorted(set(ours) - set(group) - _FILLED_ON_LOAD)
    if unknown or missing:
        what = f"unknown setting(s) {', '.join(unknown)}" if unknown else f"no {', '.join(missing)}"
        raise ValueError(f"its optimizer group {i} has {what}")
    rate = group[_SCHEDULED]
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= _MAX_RATE:
        raise ValueError(f"its optimizer group {i}'s lr is {rate!r}, not a rate in [0, {_MAX_RATE:g}]")
    for key in sorted(set(ours) & set(group) - {"params", _SCHEDULED}):
        value, expected = _plain(group[key]), _plain(ours[key])
        # type() too: True == 1 and 1 == 1.0, but momentum True is an edit, not this run's 0.9
        if value != expected or type(value) is not type(expected):
            raise ValueError(
                f"its optimizer group {i}'s {key} is {group[key]!r}, this run's is {ours[key]!r} "
                "(set by the run's options)"
            )


def _check_entry(pid: int, entry: Any, param: torch.Tensor, kind: str, keys: frozenset[str] | None) -> None:
    """A parameter's saved state: known names; buffers of the parameter's shape and dtype, finite (the
    second moments >= 0); a step count a whole number >= 0."""
    if not isinstance(entry, dict):
        raise ValueError(f"its optimizer state of parameter id {pid} is not a mapping")
    for name, value in entry.items():
        where = f"its optimizer state {name!r} of parameter id {pid}"
        if keys is not None and name not in keys:
            raise ValueError(f"{where} is not one of {kind}'s ({', '.join(sorted(keys))})")
        if name == "step":
            count = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            if (
                isinstance(count, bool)
                or not isinstance(count, (int, float))
                or not (math.isfinite(count) and count == int(count) and 0 <= count <= _MAX_STEPS)
            ):
                raise ValueError(f"{where} is {_short(value)}, not a step count")
        elif value is None and name == "momentum_buffer":
            continue  # SGD without momentum keeps None
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


def check_history(history: Any, fields: Sequence[str]) -> None:
    """``ValueError`` unless ``history`` is a list of records, each with a number for every one of
    ``fields`` (the columns of ``metrics.csv``, which the run's report reads)."""
    if not isinstance(history, list):
        raise ValueError("its history is not a list of records")
    for n, record in enumerate(history):
        if not isinstance(record, dict):
            raise ValueError(f"its history record {n} is not a mapping")
        bad = [
            f
            for f in fields
            if isinstance(record.get(f), bool) or not isinstance(record.get(f), (int, float))
        ]
        if bad:
            raise ValueError(f"its history record {n} has no number for {', '.join(bad)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
