"""What timing a forward pass costs at batch 1 for small models, by the way it is timed (CPU).

``repmlp.bench.timing`` times blocks of calls with the standard library's ``timeit.Timer`` and a clock that
synchronises the device, not with ``torch.utils.benchmark.Timer``; this script measures why. Each method
times single passes (one pass a block, as ``repmlp bench`` does), interleaved with the others in rounds:

- ``old loop``: ``perf_counter`` around each pass, the loop ``repmlp.bench.throughput`` had before;
- ``time_rounds``: ``repmlp.bench.timing.time_rounds`` with one pass a round;
- ``Timer.timeit(1)``: ``torch.utils.benchmark.Timer(...).timeit(1)`` with its default clock (which asks
  ``torch.accelerator`` whether a device is there, and synchronises it, inside the timed block), at this
  process's thread count;
- ``Timer.timeit(1), plain clock``: the same with ``timer=time.perf_counter``.

Reported per model and method: the median pass time, the wall time spent per timed pass, and the calls
made per timed pass (``Timer.timeit(k)`` first makes ``max(k // 100, 2)`` untimed ones).

    python3 benchmarks/bench_timing.py [--rounds 7] [--quick]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.benchmark import Timer

from common import device_arg, hardware, parse_cpu_only, table
from repmlp import create_model, reparameterize_model
from repmlp.bench.timing import time_rounds


def models() -> dict[str, tuple[nn.Module, torch.Tensor, int]]:
    """name -> (model, batch-1 input, passes per method a round)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    fmnist = reparameterize_model(create_model("repmlp_fmnist", num_classes=10, in_chans=1).eval())
    return {
        "Linear 64x64": (nn.Linear(64, 64), torch.randn(1, 64), 200),
        "MLP 512-512-512": (mlp, torch.randn(1, 512), 100),
        "repmlp_fmnist, deployed": (fmnist, torch.randn(1, 1, 28, 28), 10),
    }


def old_loop(fn: Callable[[], object], n: int) -> list[float]:
    """The loop this comparison starts from (no device to synchronise on a CPU)."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def methods(fn: Callable[[], object]) -> dict[str, Callable[[int], list[float]]]:
    """name -> ``run(n)``: the seconds of ``n`` single passes of ``fn``, timed that way."""
    threads = torch.get_num_threads()  # Timer's default is one thread
    timer = Timer("fn()", globals={"fn": fn}, num_threads=threads)
    plain = Timer("fn()", globals={"fn": fn}, num_threads=threads, timer=time.perf_counter)
    return {
        "old loop": lambda n: old_loop(fn, n),
        "time_rounds": lambda n: time_rounds({0: fn}, rounds=n, warmup=0)[0],
        "Timer.timeit(1)": lambda n: [timer.timeit(1).times[0] for _ in range(n)],
        "Timer.timeit(1), plain clock": lambda n: [plain.timeit(1).times[0] for _ in range(n)],
    }


def measure(model: nn.Module, x: torch.Tensor, passes: int, rounds: int) -> list[list[str]]:
    calls = [0]

    def fn() -> None:
        calls[0] += 1
        model(x)

    runs = methods(fn)
    times: dict[str, list[float]] = {name: [] for name in runs}
    wall = dict.fromkeys(runs, 0.0)
    made = dict.fromkeys(runs, 0)
    with torch.inference_mode():
        for _ in range(20):
            fn()
        names = list(runs)
        for r in range(rounds):
            # Each round starts with the next method: none always runs right after another.
            for name in names[r % len(names) :] + names[: r % len(names)]:
                calls[0], start = 0, time.perf_counter()
                times[name] += runs[name](passes)
                wall[name] += time.perf_counter() - start
                made[name] += calls[0]
    timed = passes * rounds
    return [
        [
            name,
            f"{statistics.median(t) * 1e6:.1f}",
            f"{wall[name] / timed * 1e6:.1f}",
            f"{made[name] / timed:.0f}",
        ]
        for name, t in times.items()
    ]


def main() -> None:
    args = parse_cpu_only(device_arg(__doc__.splitlines()[0]), "the cost of timing")
    rounds = 2 if args.quick else args.rounds
    print("**bench_timing: single passes at batch 1, timed four ways, interleaved**")
    print(hardware(torch.device("cpu")))
    print()
    rows = []
    for label, (model, x, passes) in models().items():
        model.eval()
        rows += [[label, *row] for row in measure(model, x, passes // 5 if args.quick else passes, rounds)]
    print(
        table(
            ["model", "method", "median pass (us)", "wall per timed pass (us)", "calls per timed pass"], rows
        )
    )
    print()
    print(f"{rounds} rounds; in each, every method times its passes in turn.")


if __name__ == "__main__":
    main()
