"""repmlp.bench.timing, the one place that times code: how many figures, in which order the callables run,
that warm-up calls stay out of the figures, rounds of at least a duration, device synchronisation, bad
arguments. Tiny callables, a few milliseconds each."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from repmlp.bench import timing
from repmlp.bench.speed_tables import SpeedOptions, time_path
from repmlp.bench.timing import time_calls, time_interleaved, time_rounds


class Counting(nn.Module):
    """A tiny module that writes its name into a shared log at every call."""

    def __init__(self, name: str, log: list[str]) -> None:
        super().__init__()
        self.name, self.log = name, log
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(self.name)
        return self.linear(x)


class FakeClock:
    """A clock that moves only when the timed callables move it: exact figures, whatever the load."""

    def __init__(self) -> None:
        self.now, self.reads = 0.0, 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now

    def callable(self, *costs: float) -> tuple[list[int], Callable[[], None]]:
        """A callable whose calls take ``costs`` seconds in turn (the last one from then on); its count."""
        count = [0]

        def fn() -> None:
            self.now += costs[min(count[0], len(costs) - 1)]
            count[0] += 1

        return count, fn


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(timing, "_clock", lambda device: fake)
    return fake


STEP = 2.0**-10  # about 1 ms, exact in binary: the figures below are exact


def test_rounds_give_one_positive_figure_a_round_for_every_callable_in_order():
    log: list[str] = []
    x = torch.randn(2, 4)
    nets = {name: Counting(name, log) for name in ("a", "b", "c")}
    times = time_rounds({n: (lambda m=m: m(x)) for n, m in nets.items()}, rounds=4, warmup=2)
    assert list(times) == ["a", "b", "c"]
    assert all(len(t) == 4 and all(s > 0 for s in t) for t in times.values())
    # Warm-up one callable after another, then every callable once a round, in the order given.
    assert log == ["a", "a", "b", "b", "c", "c"] + ["a", "b", "c"] * 4


def test_warmup_calls_are_not_timed(clock):
    count, fn = clock.callable(1.0, 1.0, STEP)
    assert time_rounds({"f": fn}, rounds=3, warmup=2) == {"f": [STEP] * 3} and count[0] == 5
    count, fn = clock.callable(1.0, 1.0, 1.0, STEP)
    assert time_calls(fn, 4, warmup=3) == STEP and count[0] == 7


def test_rounds_last_at_least_their_duration_sized_by_the_last_warmup_call(clock):
    count, fn = clock.callable(1.0, 4 * STEP, STEP)  # warm-up calls: 1 s, then 4 ms; later calls 1 ms
    times = time_rounds({"f": fn}, rounds=2, warmup=2, min_round_s=8 * STEP)
    assert times == {"f": [STEP, STEP]}
    # The last warm-up call sizes the first round at 2 calls; at 1 ms they fall short, so the round goes on
    # for 6 more; the next round is one block of 8. A block reads the clock twice.
    assert count[0] == 2 + (2 + 6) + 8 and clock.reads == 2 * (1 + 2 + 1)


def test_without_warmup_a_round_is_extended_to_its_duration(clock):
    count, fn = clock.callable(STEP)
    assert time_rounds({"f": fn}, rounds=1, warmup=0, min_round_s=8 * STEP) == {"f": [STEP]}
    assert count[0] == 8 and clock.reads == 2 * 2


def test_time_path_times_rounds_of_its_least_duration(clock):
    log: list[str] = []
    net, x = Counting("n", log), torch.randn(1, 4)

    def fn(inp: torch.Tensor) -> torch.Tensor:
        clock.now += STEP
        return net(inp)

    assert time_path(fn, x, SpeedOptions(warmup=2, rounds=3, round_seconds=8 * STEP)) == STEP
    assert len(log) == 2 + 3 * 8
    log.clear()
    assert time_path(fn, x, SpeedOptions(quick=True)) == STEP and log == ["n", "n"]  # warm-up, one pass


def test_time_calls_and_interleaved_medians():
    log: list[str] = []
    net, x = Counting("n", log), torch.randn(1, 4)
    assert time_calls(lambda: net(x), 3) > 0 and log == ["n"] * 3
    medians = time_interleaved({"a": lambda: net(x), "b": lambda: net(x)}, rounds=3, min_round_s=0.001)
    assert list(medians) == ["a", "b"] and all(isinstance(v, float) and v > 0 for v in medians.values())


def test_the_device_is_synchronised_around_every_block_on_cuda(monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(f"sync {device}"))

    def fn() -> None:
        events.append("call")

    time_calls(fn, 2, "cuda")
    assert events == ["sync cuda", "call", "call", "sync cuda"]
    events.clear()
    time_rounds({"a": fn, "b": fn}, torch.device("cuda:0"), rounds=2, warmup=1)
    block = ["sync cuda:0", "call", "sync cuda:0"]
    assert events == ["call", "call"] + block * 4
    events.clear()
    time_rounds({"a": fn}, "cpu", rounds=2, warmup=1)
    timing.sync_device("cpu")
    assert events == ["call"] * 3  # nothing to wait for on a CPU


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rounds": 0},
        {"rounds": 1, "warmup": -1},
        {"rounds": 1, "min_round_s": -0.1},
        {"rounds": 1, "min_round_s": math.inf},
        {"rounds": 1, "min_round_s": math.nan},
    ],
)
def test_bad_round_arguments_raise(kwargs):
    with pytest.raises(ValueError, match="need rounds >= 1"):
        time_rounds({"f": lambda: None}, **kwargs)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="nothing to time"):
        time_rounds({}, rounds=1)
    with pytest.raises(ValueError, match="need number >= 1"):
        time_calls(lambda: None, 0)
    with pytest.raises(ValueError, match="warmup >= 0"):
        time_calls(lambda: None, 1, warmup=-1)
