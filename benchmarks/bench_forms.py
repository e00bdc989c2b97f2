"""Does the training form earn its place? A training step of a model through
:func:`repmlp.engine.forms.training_form` against the same step of the plain model, interleaved.

Each model trains channels_last on random 1-channel batches (as the study's Fashion-MNIST rows do), SGD with
Nesterov momentum, cross-entropy: forward, backward, optimizer step. The form is kept only if it makes the
whole step at least 3% faster (issue 62); docs/benchmarks.md records the result.

    python3 benchmarks/bench_forms.py [--models repmlp_cifar:0.25 ...] [--batch-size 256] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from common import hardware
from repmlp import create_model
from repmlp.bench.timing import time_rounds
from repmlp.engine import keep_freed_memory
from repmlp.engine.forms import training_form


def step_of(net: torch.nn.Module, params, x: torch.Tensor, y: torch.Tensor):  # noqa: ANN001, ANN201
    """One training step of ``net`` (a callable), SGD over ``params``."""
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, nesterov=True)

    def step() -> None:
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["repmlp_cifar:0.25", "repmlp_fmnist_patch2:1"],
                        help="NAME:WIDTH_MULTIPLIER (1: the model's own widths)")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    keep_freed_memory()
    print(hardware(torch.device("cpu")))
    print("| model | form | images/s | form / plain (range over rounds) |\n|---|---|---:|---|")
    for spec in args.models:
        name, width = spec.split(":")
        kwargs = {"width_multiplier": float(width)} if float(width) != 1 else {}
        model = create_model(name, in_chans=1, **kwargs).train().to(memory_format=torch.channels_last)
        size = model.pretrained_cfg["input_size"][1:]
        torch.manual_seed(0)
        x = torch.randn(args.batch_size, 1, *size).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (args.batch_size,))
        form = training_form(model)
        if form is model:
            print(f"| {spec} | the plain model itself (no module fits a form) | | |")
            continue
        steps = {
            "plain": step_of(model, model.parameters(), x, y),
            "form": step_of(form, model.parameters(), x, y),
        }
        times = time_rounds(steps, rounds=args.rounds, warmup=2, min_round_s=0.5)
        ratios = [p / f for p, f in zip(times["plain"], times["form"], strict=True)]
        for k in ("plain", "form"):
            ratio = (
                f"**{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f})"
                if k == "form"
                else ""
            )
            print(f"| {spec} | {k} | {args.batch_size / statistics.median(times[k]):.0f} | {ratio} |")


if __name__ == "__main__":
    main()
