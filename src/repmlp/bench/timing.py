"""The one place this project times code: seconds per call of a callable, on a CPU or a GPU.

``repmlp bench``, ``repmlp tables --speed`` and the scripts under ``benchmarks/`` all time through here, so
their figures mean the same thing. Every figure comes from *blocks*: ``k`` back-to-back calls between two
readings of a clock that first waits for the device's queued work (:func:`sync_device`), run by
:class:`timeit.Timer` (garbage collection off). ``torch.utils.benchmark.Timer`` is not used: it cannot time
exactly ``k`` calls (it adds untimed ones) and its device check lands inside the timed block
(docs/benchmarks.md). Alternatives are timed in *interleaved rounds*
(:func:`time_rounds`), so a drift in the machine's load hits them all alike.

This module imports nothing from ``repmlp``: ``benchmarks/bench_train.py`` loads the file alone into worker
processes that run a baseline commit's code.
"""

from __future__ import annotations

import math
import statistics
import time
import timeit
from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

import torch

__all__ = ["sync_device", "time_calls", "time_rounds", "time_interleaved"]

K = TypeVar("K", bound=Hashable)


def sync_device(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA, MPS), so that a host clock counts it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":  # pragma: no cover - Apple only
        torch.mps.synchronize()


def _clock(device: torch.device | str) -> Callable[[], float]:
    """``time.perf_counter`` that first waits for ``device`` (just the counter on a CPU: nothing queues)."""
    device = torch.device(device)
    if device.type not in ("cuda", "mps"):
        return time.perf_counter

    def clock() -> float:
        sync_device(device)
        return time.perf_counter()

    return clock


def _timer(fn: Callable[[], object], device: torch.device | str) -> timeit.Timer:
    return timeit.Timer(fn, timer=_clock(device))  # compiles its loop once: reused for every round


def time_calls(
    fn: Callable[[], object], number: int, device: torch.device | str = "cpu", *, warmup: int = 0
) -> float:
    """Seconds per call of ``number`` back-to-back calls of ``fn()`` after ``warmup`` untimed ones; ``device``
    (where ``fn`` queues work) is synchronised before and after the block."""
    if number < 1 or warmup < 0:
        raise ValueError(f"need number >= 1 and warmup >= 0, got number={number}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    return _timer(fn, device).timeit(number) / number


def _round(timer: timeit.Timer, calls: int, min_round_s: float) -> tuple[float, int]:
    """Seconds and calls of one round: a block of ``calls`` calls, then more while under ``min_round_s``."""
    seconds, n = timer.timeit(calls), calls
    while seconds < min_round_s:
        # The calls still missing at this round's rate (a cold first block, or a machine grown faster).
        more = max(1, math.ceil(n * (min_round_s - seconds) / max(seconds, 1e-9)))
        seconds, n = seconds + timer.timeit(more), n + more
    return seconds, n


def time_rounds(fns: Mapping[K, Callable[[], object]], device: torch.device | str = "cpu", *, rounds: int,
                warmup: int = 2, min_round_s: float = 0.0) -> dict[K, list[float]]:  # fmt: skip
    """Seconds per call of every callable of ``fns`` (name -> callable, results under the same names) in
    each of ``rounds`` interleaved rounds, after ``warmup`` untimed calls of each.

    A round runs the callables in order, each for at least ``min_round_s`` and one call, and records its time
    over its calls (``min_round_s=0``: single passes). A round's calls come from the callable's previous
    round (the first: from its last warm-up call, timed alone); a round that falls short is extended.
    ``device``, where the callables queue work, is synchronised around every block.
    """
    if rounds < 1 or warmup < 0 or not 0 <= min_round_s < math.inf:
        raise ValueError(f"need rounds >= 1, warmup >= 0 and a finite min_round_s >= 0, got rounds={rounds}, "
                         f"warmup={warmup}, min_round_s={min_round_s}")  # fmt: skip
    if not fns:
        raise ValueError("nothing to time: no callables given")
    timers = {name: _timer(fn, device) for name, fn in fns.items()}
    sizing = min_round_s > 0 and warmup > 0  # the last warm-up call, timed, sizes the first round
    calls: dict[K, int] = {}
    for name, fn in fns.items():
        for _ in range(warmup - sizing):
            fn()
        calls[name] = max(1, math.ceil(min_round_s / max(timers[name].timeit(1), 1e-9))) if sizing else 1
    times: dict[K, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, timer in timers.items():
            seconds, n = _round(timer, calls[name], min_round_s)
            times[name].append(seconds / n)
            # As many calls as this round's rate says fill min_round_s: one block next round.
            calls[name] = max(1, math.ceil(n * min_round_s / max(seconds, 1e-9)))
    return times


def time_interleaved(fns: Mapping[K, Callable[[], object]], device: torch.device | str = "cpu", *,
                     rounds: int = 7, min_round_s: float = 0.2, warmup: int = 2) -> dict[K, float]:  # fmt: skip
    """Median seconds per call of every callable over ``rounds`` interleaved rounds of at least
    ``min_round_s`` each (:func:`time_rounds`); the benchmark scripts' comparison of alternatives."""
    times = time_rounds(fns, device, rounds=rounds, warmup=warmup, min_round_s=min_round_s)
    return {name: statistics.median(t) for name, t in times.items()}
