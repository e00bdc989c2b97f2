"""A CPU training step at 224x224 under three settings of glibc's malloc: its defaults, a 32 MiB mapping
threshold (``repmlp.engine.keep_freed_memory`` until 2026-11-28), and ``keep_freed_memory`` now (no mapped
blocks at all).

Each setting runs in a process of its own (the setting is process-wide): a registered model in its training
form (``repmlp.engine.forms.training_form``), random 224x224 batches, SGD with momentum, forward,
cross-entropy, backward and step, as ``repmlp train`` runs a step on a CPU. Rounds take the settings in turn;
each process times ``--steps`` steps after one warm-up step. The table gives each setting's median step over
the rounds, its speed against glibc's defaults and the largest peak resident memory of its processes.

    python3 benchmarks/bench_allocator.py [--model repmlp_res50_light] [--batch-size 32] [--rounds 3] [--steps 3]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import resource
import statistics
import subprocess
import sys
import time

SETTINGS = ("glibc defaults", "32 MiB threshold", "keep_freed_memory")


def worker(setting: str, model: str, batch: int, steps: int) -> None:
    """Time ``steps`` training steps in this process under ``setting``; print seconds and peak RSS as JSON."""
    import torch

    from repmlp import create_model
    from repmlp.engine import keep_freed_memory
    from repmlp.engine.forms import training_form

    if setting == SETTINGS[1]:  # mallopt: M_MMAP_THRESHOLD -3, M_TRIM_THRESHOLD -1
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
        assert mallopt(-3, 32 << 20) and mallopt(-1, 1 << 30)
    elif setting == SETTINGS[2]:
        assert keep_freed_memory()
    torch.manual_seed(0)
    net = training_form(create_model(model).train())  # shares the model's parameters
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, 3, 224, 224), torch.randint(0, 1000, (batch,))
    seconds = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        seconds.append(time.perf_counter() - start)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds[1:], "rss_mib": rss_mib}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="repmlp_res50_light")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.batch_size, args.steps)
    steps: dict[str, list[float]] = {s: [] for s in SETTINGS}
    rss: dict[str, float] = dict.fromkeys(SETTINGS, 0.0)
    for _ in range(args.rounds):
        for setting in SETTINGS:
            cmd = [sys.executable, __file__, "--worker", setting, "--model", args.model,
                   "--batch-size", str(args.batch_size), "--steps", str(args.steps)]  # fmt: skip
            out = json.loads(
                subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1]
            )
            steps[setting].append(statistics.median(out["seconds"]))
            rss[setting] = max(rss[setting], out["rss_mib"])
    base = statistics.median(steps[SETTINGS[0]])
    print(f"**{args.model}, a training step at batch {args.batch_size}, 224x224, CPU**\n")
    print("| malloc | step (s), median of rounds (range) | speed vs glibc defaults | peak RSS (MiB) |")
    print("|---|---|---|---|")
    for s in SETTINGS:
        med = statistics.median(steps[s])
        print(
            f"| {s} | {med:.2f} ({min(steps[s]):.2f}-{max(steps[s]):.2f}) | {base / med:.2f}x | {rss[s]:,.0f} |"
        )


if __name__ == "__main__":
    main()
