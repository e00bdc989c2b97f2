"""Training images/s of ``repmlp train``'s step: the code of a baseline commit vs this checkout.

Each candidate runs in its own worker process (the allocator setting of ``repmlp.engine.train_loop`` is
process-wide), on real Fashion-MNIST batches, with the preset's batch size, layout, optimizer
(``repmlp.tasks.classification.make_optimizer``) and label-smoothed cross-entropy: forward, backward and
optimizer step, as ``repmlp train`` runs them on a CPU. Rounds are interleaved over the workers (median).

- ``before``: the checkout of ``--baseline`` (default: the commit before the training-speed work), eager;
- ``now``: this checkout, what ``repmlp train`` does by default on a CPU (eager, ``--compile auto``);
- ``now, compiled``: this checkout with ``--compile on`` (``torch.compile`` of the model; its compilation
  is done in the warm-up, not timed).

Cases: ``repmlp_fmnist`` (the main job's model until issue 19: preset ``fmnist``, batch 256, 28x28,
channels_last), the paper's ``repmlp_cifar`` (preset ``cifar``, batch 128, the study's Fashion-MNIST
padded to 32x32, one channel; the preset trains NCHW on a CPU), ``main job``: what ``repmlp train``'s
step was at the baseline (``repmlp_fmnist``) against what it is now (``repmlp_fmnist_patch2``, another
model, so not the same maths), and two rows of ``repmlp study ablation --preset fmnist --width-multiplier
0.25`` (the same maths).

The MAC rate is the training step's multiply-accumulates (3x the forward's, ``repmlp.profile``) per
second, beside this machine's float32 matmul rate (a 2048x2048 matmul, the same threads).

    python3 benchmarks/bench_train.py [--baseline REF] [--rounds 5] [--steps N] [--cases M,...] [--profile]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from types import ModuleType

BASELINE = "99b1fcb"  # main before the training-speed work (issue 19)
REPO = Path(__file__).resolve().parents[1]
CASES = {
    # case: (preset, batch, image size, channels_last, steps per round, model before, model now[, model args])
    "repmlp_fmnist": ("fmnist", 256, 28, True, 10, "repmlp_fmnist", "repmlp_fmnist"),
    "repmlp_cifar": ("cifar", 128, 32, False, 3, "repmlp_cifar", "repmlp_cifar"),
    "main job": ("fmnist", 256, 28, True, 10, "repmlp_fmnist", "repmlp_fmnist_patch2"),
    # The study's narrow networks (repmlp study ablation --preset fmnist --width-multiplier 0.25): rows D and
    # Pure MLP, 2 and 4 channels a group in their RepMLP blocks.
    "study D x0.25": (
        "fmnist",
        256,
        32,
        True,
        3,
        *["repmlp_cifar_fc3_conv9"] * 2,
        {"width_multiplier": 0.25},
    ),
    "study Pure MLP x0.25": ("fmnist", 256, 32, True, 3, *["repmlp_cifar"] * 2, {"width_multiplier": 0.25}),
}


def load_timing() -> ModuleType:
    """This checkout's ``repmlp/bench/timing.py`` as a module of its own: a worker runs a baseline commit's
    ``repmlp``, which may have no timing module, and importing this checkout's package would replace it."""
    spec = importlib.util.spec_from_file_location("bench_train_timing", REPO / "src/repmlp/bench/timing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(src: str, case: str, model_name: str, compiled: bool, keep_memory: bool) -> None:
    """Serve timing requests on stdin: ``N`` -> run N training steps, print their seconds."""
    timing = load_timing()
    sys.path.insert(0, src)
    import numpy as np
    import torch
    import torch.nn.functional as F

    import repmlp
    from repmlp.data.fashion_mnist import DEBIAN_DIR, load_fashion_mnist
    from repmlp.tasks.classification import TrainConfig, make_optimizer

    try:
        from repmlp.tasks.recipes import PRESETS
    except ImportError:  # a baseline from before the package's folders
        from repmlp.recipes import PRESETS

    preset_name, batch, size, channels_last = CASES[case][:4]
    preset = PRESETS[preset_name]
    if keep_memory:  # what train_loop does on a CPU in this checkout
        from repmlp.engine import keep_freed_memory

        keep_freed_memory()
    torch.manual_seed(0)
    images, labels = load_fashion_mnist(DEBIAN_DIR, train=True)
    x_all = (torch.from_numpy(images).float() / 255 - 0.2860) / 0.3530
    if size != 28:
        x_all = F.pad(x_all, [(size - 28) // 2] * 4)
    y_all = torch.from_numpy(labels)
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(y_all)))
    model_args = CASES[case][7] if len(CASES[case]) > 7 else {}
    model = repmlp.create_model(model_name, num_classes=10, in_chans=1, **model_args).train()
    fields = TrainConfig.__dataclass_fields__
    cfg = TrainConfig(**{k: v for k, v in preset.to_dict().items() if k in fields})
    optimizer = make_optimizer(model, cfg)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model.to(memory_format=layout)
    if compiled and os.environ.get("BENCH_TRAIN_PROFILE"):
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # name each generated kernel in the profile
    try:  # the training form, as repmlp train builds it
        from repmlp.engine.forms import training_form

        net = training_form(model)
    except ImportError:  # a baseline with the training speed pass (or from before it: none)
        try:
            from repmlp.speed import fast_training

            net = fast_training(model)
        except ImportError:
            net = model
    net = torch.compile(net) if compiled else net
    position = 0

    def step() -> None:
        nonlocal position
        idx = order[position : position + batch]
        position = (position + batch) % (len(order) - batch)
        x, y = x_all[idx].contiguous(memory_format=layout), y_all[idx]
        loss = F.cross_entropy(net(x).float(), y, label_smoothing=preset.label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for line in sys.stdin:
        if line.strip() == "profile":
            print(json.dumps({"table": profile_table(step)}), flush=True)
            continue
        steps = int(line)
        print(json.dumps({"seconds": steps * timing.time_calls(step, steps)}), flush=True)


def profile_table(step, steps: int = 5, rows: int = 15) -> str:
    """torch.profiler's operators of ``steps`` training steps, by self CPU time (the top ``rows``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def baseline_source(ref: str, into: Path) -> str:
    """``src/`` of commit ``ref`` of this repository, extracted under ``into``."""
    data = subprocess.run(["git", "-C", str(REPO), "archive", ref, "src"], capture_output=True, check=True)
    with tarfile.open(fileobj=BytesIO(data.stdout)) as tar:
        tar.extractall(into, filter="data")
    return str(into / "src")


class Worker:
    def __init__(self, src: str, case: str, model: str, compiled: bool, keep_memory: bool) -> None:
        flags = [str(int(compiled)), str(int(keep_memory))]
        cmd = [sys.executable, __file__, "--worker", src, case, model, *flags]
        self.model = model
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, request: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{request}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a benchmark worker died (exit {self.proc.wait()})")
        return json.loads(line)

    def run(self, steps: int) -> float:
        return self.ask(str(steps))["seconds"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


def matmul_gmacs() -> float:
    import torch

    from repmlp.bench.timing import time_calls

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2048**3 / time_calls(lambda: a @ b, 10, warmup=3) / 1e9


def training_macs(model_name: str, size: int, model_args: dict) -> float:
    """Multiply-accumulates of one training image: forward x 3 (forward, input and weight gradients). The
    convs' count: the dense FC form of narrow branches (repmlp.engine.forms) adds zeros, not maths."""
    from repmlp.bench.counts import profile_model

    kwargs = dict(num_classes=10, in_chans=1, **model_args)
    _, macs = profile_model(model_name, (1, size, size), deploy=False, **kwargs)
    return 3 * macs


def main() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import torch

    from common import hardware, table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--baseline", default=BASELINE, help=f"git ref of the 'before' code (default {BASELINE})"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps a round (default: 10, cifar 3)"
    )
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--profile", action="store_true", help="also print the 'now' step's top operators")
    parser.add_argument(
        "--same-model",
        action="store_true",
        help="run the 'now' model, as 'repmlp train' runs it, in the baseline too (a refactor's before/after)",
    )
    args = parser.parse_args()
    if args.profile:
        os.environ["BENCH_TRAIN_PROFILE"] = "1"  # inherited by the workers
    print(hardware(torch.device("cpu")))
    print(f"float32 matmul 2048^3: {matmul_gmacs():.1f} GMAC/s")
    rows, profiles = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        before_src = baseline_source(args.baseline, Path(tmp))
        now_src = str(REPO / "src")
        for case in args.cases.split(","):
            if case not in CASES:
                parser.error(f"unknown case {case!r}: one of {', '.join(CASES)}")
            _, batch, size, _, default_steps, old, new = CASES[case][:7]
            old = new if args.same_model else old
            steps = args.steps or default_steps
            named = "" if old == new else f": {old} -> {new}"
            workers = {
                # --same-model: the baseline also keeps freed memory, as its own train_loop does.
                f"before ({args.baseline}){named}": Worker(before_src, case, old, False, args.same_model),
                "now": Worker(now_src, case, new, False, True),
                "now, compiled": Worker(now_src, case, new, True, True),
            }
            for w in workers.values():  # warm-up (and compilation), one worker at a time
                w.run(3)
            times: dict[str, list[float]] = {name: [] for name in workers}
            for _ in range(args.rounds):
                for name, w in workers.items():
                    times[name].append(w.run(steps) / steps)
            if args.profile:
                for name in ("now", "now, compiled"):
                    profiles[f"{case}, training step '{name}'"] = workers[name].ask("profile")["table"]
            for w in workers.values():
                w.close()
            before = times[next(iter(workers))]
            base = sorted(before)[args.rounds // 2]
            for name, ts in times.items():
                model_args = CASES[case][7] if len(CASES[case]) > 7 else {}
                t, macs = sorted(ts)[args.rounds // 2], training_macs(workers[name].model, size, model_args)
                ratios = sorted(b / x for b, x in zip(before, ts, strict=True))  # the same round's pair
                spread = f"{ratios[len(ratios) // 4]:.2f}-{ratios[(3 * len(ratios)) // 4]:.2f}x"
                rows.append([case, name, f"{batch / t:.0f}", f"{base / t:.2f}x", spread,
                             f"{batch * macs / t / 1e9:.1f}"])  # fmt: skip
    print(table(["case", "training step", "images/s", "vs before", "round ratios (IQR)", "GMAC/s"], rows))
    for what, text in profiles.items():
        print(f"\n{what}: operators (compiled: generated kernels too) by self CPU time, 5 steps\n")
        print(f"```\n{text}```")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1", sys.argv[6] == "1")
    else:
        main()
