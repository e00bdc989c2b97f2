"""Helpers of the equivalence tests (shared, not tests): relative error, random BatchNorm statistics."""

from __future__ import annotations

import torch
from torch import nn


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@torch.no_grad()
def randomize(block: nn.Module, seed: int) -> nn.Module:
    """Random BN running statistics and affine parameters (and a random FC3 bias where present)."""
    gen = torch.Generator().manual_seed(seed)
    for m in block.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=gen) * 0.5)
            m.running_var.copy_(torch.rand(n, generator=gen) * 2 + 0.2)
            m.weight.copy_(torch.randn(n, generator=gen))
            m.bias.copy_(torch.randn(n, generator=gen) * 0.5)
    return block
