"""Outputs and gradients of this checkout's models against a baseline commit's, bitwise.

For a refactor that must change no number: each of a few small models is built with the same seed by the
baseline's code and by this checkout's (each in a process of its own, with its own ``src/``), in NCHW and
channels_last, and run in eval mode without autograd, in training mode with autograd (outputs and every
parameter's gradient of a fixed loss) and converted; every tensor must be equal to the bit. Each side runs
each mode as its ``repmlp`` runs it: this checkout trains the training form
(``repmlp.engine.forms.training_form``) and evaluates and deploys the plain modules (no inference pass); a
baseline with speed passes (``repmlp.speed``) runs its training pass for the training step and its
inference pass for evaluation and the deployed model; one from before the passes, the plain modules. FC3
runs the batched matmul on both sides (``REPMLP_FC3=bmm`` for a baseline that timed its form inside the
forward, no kernel timed for one with the inference pass), since the form timed fastest may differ between
processes. Against a baseline with the passes, tensors may differ where its passes changed layouts or
kernels (trunks run channels_last, patch stems as a matmul, 2x2 max pools as two maxima): their removal, not
a refactor's change.

    python3 benchmarks/bitwise_vs_baseline.py --baseline d34241d
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

# (model, options, input shape): the main job's model, the pure MLP's stem, a small RepMLPNet.
CASES = [
    ("repmlp_fmnist_patch2", dict(num_classes=10, in_chans=1), (4, 1, 28, 28)),
    ("repmlp_fmnist", dict(num_classes=10, in_chans=1, widths=[8, 16]), (4, 1, 28, 28)),
    (
        "repmlpnet_t224",
        dict(
            num_classes=10,
            img_size=128,
            channels=(8, 16, 32, 64),
            depths=(1, 1, 1, 1),
            sharesets=(1, 2, 4, 8),
        ),
        (2, 3, 128, 128),
    ),
]


def run_forms() -> tuple[Callable, Callable, Callable]:
    """``(training, inference, plain)``: model -> the module this side's ``repmlp`` runs in that mode, and back
    to the plain modules. This checkout: the training form (a new tree sharing the model's parameters), the
    plain modules for inference; a baseline with the speed passes: its passes, in place; one from before
    them: the modules as they are (their forms chosen inside the forward). ``--plain``: the plain modules on
    both sides."""
    if os.environ.get("BITWISE_PLAIN"):
        return (lambda model: model,) * 3
    try:
        from repmlp.engine.forms import training_form
    except ImportError:
        pass
    else:
        return training_form, lambda model: model, lambda model: model
    try:
        from repmlp.speed import fast_inference, fast_training, plain
    except ImportError:
        return (lambda model: model,) * 3
    return fast_training, lambda model: fast_inference(model, batch_sizes=()), plain  # no FC3 timed: bmm


def worker(out: str) -> None:
    """Every tensor of every case, by name, saved to ``out`` (runs with the ``src/`` on sys.path)."""
    import copy

    import torch

    import repmlp

    training, inference, plain = run_forms()
    tensors = {}
    for name, options, shape in CASES:
        for channels_last in (False, True):
            key = f"{name}{'/channels_last' if channels_last else ''}"
            torch.manual_seed(0)
            model = repmlp.create_model(name, **options)
            if channels_last:
                model = model.to(memory_format=torch.channels_last)
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                tensors[f"{key}/eval"] = inference(copy.deepcopy(model).eval())(x)
            y = training(model.train())(x)
            y.square().sum().backward()
            tensors[f"{key}/train"] = y.detach()
            tensors.update({f"{key}/grad/{k}": p.grad for k, p in model.named_parameters()})
            with torch.no_grad():
                tensors[f"{key}/deploy"] = inference(repmlp.reparameterize_model(plain(model).eval()))(x)
    torch.save(tensors, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="git ref of the 'before' code")
    parser.add_argument("--plain", action="store_true", help="both sides' plain modules (no form, no pass)")
    args = parser.parse_args()
    import torch

    from bench_train import baseline_source

    with tempfile.TemporaryDirectory() as tmp:
        sides = {"before": baseline_source(args.baseline, Path(tmp)), "now": str(REPO / "src")}
        results = {}
        for side, src in sides.items():
            out = str(Path(tmp) / f"{side}.pt")
            # A baseline that timed FC3's form inside the forward may pick another form in each process:
            # both sides run the batched matmul.
            env = {**os.environ, "PYTHONPATH": src, "REPMLP_FC3": "bmm", "BITWISE_PLAIN": "1" * args.plain}
            subprocess.run([sys.executable, __file__, "--worker", out], env=env, check=True, cwd=tmp)
            results[side] = torch.load(out)
    before, now = results["before"], results["now"]
    if before.keys() != now.keys():
        sys.exit(f"different tensors: {sorted(set(before) ^ set(now))[:5]}")
    differ = [k for k in before if not torch.equal(before[k], now[k])]
    print(f"{len(before)} tensors compared with {args.baseline}: {len(differ)} differ {differ[:5]}")
    if os.environ.get("BITWISE_LIST"):
        print("\n".join(differ))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2])
    else:
        main()
