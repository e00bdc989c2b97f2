"""The one place this project times code: seconds per call of a callable, on a CPU or a GPU.

``repmlp bench``'s table (:mod:`repmlp.bench.throughput`), the speed tables of ``repmlp tables --speed``
(:mod:`repmlp.bench.speed_tables`) and the scripts under ``benchmarks/`` all time through this module, so
that their figures mean the same thing.

Every figure comes from *blocks*: ``k`` back-to-back calls between two readings of a clock that first
waits for the device's queued work (:func:`sync_device`), so that a GPU's kernels are counted in full and
work queued before the block is not. A block runs in the standard library's :class:`timeit.Timer`
(garbage collection off while it runs), the engine under ``torch.utils.benchmark.Timer``. That Timer
itself is not used because it cannot time exactly ``k`` calls: its ``timeit(k)`` first makes
``max(k // 100, 2)`` untimed calls (two extra passes for every pass of a one-pass round), and its default
clock's device check lands inside the timed block, which shows at batch 1 (measured by
``benchmarks/bench_timing.py``, figures in docs/benchmarks.md).

Alternatives are timed in *interleaved rounds* (:func:`time_rounds`): each round runs every callable in
turn, so a drift in the machine's load hits them all alike and the ratios between them stay meaningful.

This module imports nothing from ``repmlp``: ``benchmarks/bench_train.py`` loads the file alone into
worker processes that run a baseline commit's code.
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
    # A Timer compiles its loop once; reusing it keeps that work out of every round.
    return timeit.Timer(fn, timer=_clock(device))


def time_calls(
    fn: Callable[[], object], number: int, device: torch.device | str = "cpu", *, warmup: int = 0
) -> float:
    """Seconds per call of ``number`` back-to-back calls of ``fn()``, after ``warmup`` untimed ones.

    ``device`` is the device ``fn`` queues work on; it is synchronised before and after the block.
    """
    if number < 1 or warmup < 0:
        raise ValueError(f"need number >= 1 and warmup >= 0, got number={number}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    return _timer(fn, device).timeit(number) / number


def _round(timer: timeit.Timer, calls: int, min_round_s: float) -> tuple[float, int]:
    """Seconds and calls of one round: a block of ``calls`` calls, then more while under ``min_round_s``."""
    seconds, n = timer.timeit(calls), calls
    while seconds < min_round_s:
        # The calls still missing at this round's rate so far: usually none, since ``calls`` came from the
        # previous round; a faster machine (or a cold first block) needs a second block.
        more = max(1, math.ceil(n * (min_round_s - seconds) / max(seconds, 1e-9)))
        seconds, n = seconds + timer.timeit(more), n + more
    return seconds, n


def time_rounds(
    fns: Mapping[K, Callable[[], object]],
    device: torch.device | str = "cpu",
    *,
    rounds: int,
    warmup: int = 2,
    min_round_s: float = 0.0,
) -> dict[K, list[float]]:
    """Seconds per call of every callable in each of ``rounds`` interleaved rounds.

    Each callable first makes ``warmup`` untimed calls (one callable's, then the next's). Every round then
    runs the callables in the order given, each for at least ``min_round_s`` and at least one call, and
    records its time over its calls. With ``min_round_s=0`` a round is one call of each, so the figures are
    single passes and their spread is the passes' spread. Otherwise the calls of a round are chosen from
    the callable's previous round (the first round: from its last warm-up call, timed for that alone),
    and a round that falls short is extended.

    Args:
        fns: name -> callable of no arguments; results are returned under the same names, in this order.
        device: the device the callables queue work on, synchronised around every block.
        rounds: rounds to run (>= 1).
        warmup: untimed calls of each callable before the rounds (>= 0).
        min_round_s: the least seconds of one callable's round (>= 0).
    """
    if rounds < 1 or warmup < 0 or not 0 <= min_round_s < math.inf:
        raise ValueError(
            f"need rounds >= 1, warmup >= 0 and a finite min_round_s >= 0, got rounds={rounds}, "
            f"warmup={warmup}, min_round_s={min_round_s}"
        )
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


def time_interleaved(
    fns: Mapping[K, Callable[[], object]],
    device: torch.device | str = "cpu",
    *,
    rounds: int = 7,
    min_round_s: float = 0.2,
    warmup: int = 2,
) -> dict[K, float]:
    """Median seconds per call of every callable over ``rounds`` interleaved rounds of at least
    ``min_round_s`` each (:func:`time_rounds`); the benchmark scripts' comparison of alternatives."""
    times = time_rounds(fns, device, rounds=rounds, warmup=warmup, min_round_s=min_round_s)
    return {name: statistics.median(t) for name, t in times.items()}
