"""Deployed models' speed: a baseline commit's code against this checkout's, interleaved, on this CPU.

For a refactor that must leave every deployed model as fast as before: each (code, treatment) pair runs in
a worker process of its own, with its own ``src/`` (the baseline extracted from git), and builds the same
models with the same seeds, deployed by ``repmlp.reparameterize_model`` and run as each side's code runs
them: this checkout has no inference pass (the plain modules); a baseline with ``repmlp.speed`` gets its
inference pass (``fast_inference``); one from before the passes chose its forms inside the forward. On both
sides every model (torchvision's ResNet-50 included) runs in the treatment's memory format, weights and
input alike, a flag of the run rather than a choice of the code. Treatments: ``eager`` (float32,
channels_last), ``compiled`` (``torch.compile``, float32, channels_last), ``bf16_compiled`` (bfloat16,
channels_last, compiled) and ``onnxruntime`` (the exported graph, float32, NCHW). Every round asks every
worker in turn for a block of passes of each model and batch; reported: images/s of the median round, "now"
over "before" with the spread of the per-round ratios.

    python3 benchmarks/bench_vs_baseline.py --baseline 0b1ba13 [--treatments eager onnxruntime] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = ("repmlp_res50_light", "repmlp_res50", "resnet50", "repmlp_fmnist_patch2")
TREATMENTS = ("eager", "compiled", "bf16_compiled", "onnxruntime")


def _build(name: str):  # noqa: ANN202 - torch objects, imported in the worker
    import torch
    import torchvision

    import repmlp

    torch.manual_seed(0)
    net = torchvision.models.resnet50() if name == "resnet50" else repmlp.create_model(name)
    return repmlp.reparameterize_model(net.eval())


def inference_form(net, batches: list[int]):  # noqa: ANN001, ANN202 - torch objects, imported in the worker
    """``net`` as this side's code runs it for inference: the plain modules in this checkout (no pass); a
    baseline with ``repmlp.speed`` applies its inference pass (in place: FC3 kernels timed for ``batches``)."""
    try:
        from repmlp.speed import fast_inference
    except ImportError:  # this checkout, or a baseline from before the passes: the modules as they are
        return net
    return fast_inference(net, batch_sizes=batches)


def worker(treatment: str, batches: list[int], min_s: float) -> None:
    """Serve timing requests on stdin (one line: a round) with ``{model/batch: seconds per image}``."""
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_train import load_timing  # this checkout's timing, beside either side's repmlp
    from repmlp.deploy.runtimes import to_runtime

    timing = load_timing()

    torch._dynamo.config.recompile_limit = 64  # every repmlp ResNet shares one forward's code
    fmt = torch.contiguous_format if treatment == "onnxruntime" else torch.channels_last
    calls = {}
    for name in MODELS:
        net = _build(name)
        size = (1, 28, 28) if name == "repmlp_fmnist_patch2" else (3, 224, 224)
        dtype = torch.bfloat16 if treatment == "bf16_compiled" else torch.float32
        if treatment == "onnxruntime":
            run = to_runtime(net, "onnxruntime", size)
        else:
            net = inference_form(net.to(dtype), batches).to(memory_format=fmt)
            run = torch.compile(net) if treatment.endswith("compiled") else net
        for b in batches:
            x = torch.randn(b, *size, generator=torch.Generator().manual_seed(1)).to(dtype)
            calls[f"{name}/{b}"] = (run, x.contiguous(memory_format=fmt))
    with torch.inference_mode():
        for run, x in calls.values():  # warm-up: compiles, oneDNN kernels, FC3 timings
            run(x)
            run(x)
        fns = {key: (lambda run=run, x=x: run(x)) for key, (run, x) in calls.items()}
        for _ in sys.stdin:  # a round: every model and batch in turn, each for at least min_s
            times = timing.time_rounds(fns, rounds=1, warmup=0, min_round_s=min_s)
            print(json.dumps({key: t[0] / calls[key][1].shape[0] for key, t in times.items()}), flush=True)


def main() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_train import baseline_source
    from common import cpu_name, table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="git ref of the 'before' code")
    parser.add_argument("--treatments", nargs="+", default=list(TREATMENTS), choices=TREATMENTS)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--round-s", type=float, default=0.3, help="seconds a model and batch a round")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"before": baseline_source(args.baseline, Path(tmp)), "now": str(REPO / "src")}
        for treatment in args.treatments:
            procs = {
                side: subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--worker",
                        treatment,
                        json.dumps(args.batch_sizes),
                        str(args.round_s),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    # REPMLP_FC3: read by a baseline that chose FC3's kernel inside the forward only
                    env={**os.environ, "PYTHONPATH": src, "REPMLP_FC3": "auto"},
                )  # fmt: skip
                for side, src in sides.items()
            }
            rounds: dict[str, list[dict]] = {side: [] for side in procs}
            for _ in range(args.rounds):
                for side, proc in procs.items():  # interleaved: one round of each side in turn
                    proc.stdin.write("\n")
                    proc.stdin.flush()
                    line = proc.stdout.readline()
                    if not line:
                        sys.exit(f"the {side} worker of {treatment} died (exit {proc.wait()})")
                    rounds[side].append(json.loads(line))
            for proc in procs.values():
                proc.stdin.close()
                proc.wait()
            for key in rounds["now"][0]:
                before = [r[key] for r in rounds["before"]]
                now = [r[key] for r in rounds["now"]]
                ratios = sorted(b / n for b, n in zip(before, now, strict=True))
                rows.append([treatment, *key.split("/"), f"{1 / statistics.median(before):.1f}",
                             f"{1 / statistics.median(now):.1f}", f"**{statistics.median(ratios):.2f}x**",
                             f"{ratios[0]:.2f}-{ratios[-1]:.2f}"])  # fmt: skip
                print(f"  {treatment} {key}: {statistics.median(ratios):.2f}x", file=sys.stderr, flush=True)
    print(
        f"CPU: {cpu_name()}; baseline {args.baseline}; {args.rounds} interleaved rounds of {args.round_s} s; "
        "each side's own inference form (this checkout: the plain modules; a baseline with repmlp.speed: its "
        "inference pass); every model, ResNet-50 included, channels_last (weights and input) on both sides, "
        "onnxruntime NCHW"
    )
    header = [
        "treatment",
        "model",
        "batch",
        "before (img/s)",
        "now (img/s)",
        "now / before",
        "per-round range",
    ]
    print(table(header, rows))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4]))
    else:
        main()
