"""``repmlp selfcheck``: build a RepMLP block, convert it, print the conversion error and the speed-up."""

from __future__ import annotations

import argparse
import time

import torch

from repmlp.nn.block import RepMLPBlock
from repmlp.nn.convert import reparameterize_model
from repmlp.numerics import full_float32


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No options."""


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    block = RepMLPBlock(16, 16, 32, 8, groups=2).eval()
    # Non-trivial BN statistics, so the check covers the BN folding too.
    for m in block.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    x = torch.randn(32, 16, 32, 32)
    deployed = reparameterize_model(block)
    # Full float32 (no TF32, no autocast) whatever the caller set: a 1e-5 check cannot absorb TF32 rounding.
    with torch.inference_mode(), full_float32():
        ref, out = block(x), deployed(x)
        err = ((ref - out).abs().max() / ref.abs().max()).item()
        times = []
        for m in (block, deployed):
            m(x)
            t = time.perf_counter()
            for _ in range(10):
                m(x)
            times.append(time.perf_counter() - t)
    print(f"max relative error after conversion: {err:.2e}")
    print(f"deployed block speed-up at batch 32 (CPU): {times[0] / times[1]:.2f}x")
    return 0 if err < 1e-5 else 1
