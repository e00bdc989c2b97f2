"""Parameter and multiply-accumulate counts, as the paper reports them.

The paper's "FLOPs" are multiply-accumulates (MACs) of one image; its parameter counts are the converted
model's (except the "before conversion" row). MACs come from torch's ``FlopCounterMode`` (2 FLOPs per MAC of
matmuls and convolutions; element-wise ops, pooling and biases not counted), run on ``meta`` tensors: no
memory allocated, no arithmetic done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from repmlp.models import create_model, is_model

__all__ = ["profile", "profile_model", "count_params", "count_macs"]


def _input_shape(input_size: int | Sequence[int], in_chans: int) -> tuple[int, ...]:
    """``224`` -> ``(1, in_chans, 224, 224)``; ``(C, H, W)`` -> ``(1, C, H, W)``; 4-D kept as given."""
    size = (input_size, input_size) if isinstance(input_size, int) else tuple(int(s) for s in input_size)
    if 2 <= len(size) <= 4:  # put the batch of 1 (and for (H, W) the channels) in front
        return ((1, in_chans), (1,), ())[len(size) - 2] + size
    raise ValueError(f"input_size must be an int, (H, W), (C, H, W) or (N, C, H, W); got {input_size!r}")


def count_params(model: nn.Module) -> int:
    """Number of parameters (BatchNorm running statistics are buffers, not counted)."""
    return sum(p.numel() for p in model.parameters())


def count_macs(model: nn.Module, input_size: int | Sequence[int], *, in_chans: int | None = None) -> int:
    """Multiply-accumulates of one forward pass on ``input_size`` (batch 1 unless 4-D), in eval mode on
    ``meta`` copies of the parameters and buffers (the module is left as it was)."""
    if in_chans is None:
        in_chans = int(getattr(model, "in_chans", 3))
    shape = _input_shape(input_size, in_chans)
    state = {
        name: torch.empty_like(t, device="meta")
        for name, t in (*model.named_parameters(), *model.named_buffers())
    }
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    x = torch.empty(shape, device="meta", dtype=dtype)
    counter = FlopCounterMode(display=False)
    was_training = model.training
    model.eval()  # batch-1 BatchNorm1d cannot run in training mode; the count does not depend on it
    try:
        with counter, torch.no_grad():
            functional_call(model, state, (x,), strict=False)
    finally:
        model.train(was_training)
    return counter.get_total_flops() // 2


def profile(
    model: nn.Module, input_size: int | Sequence[int], *, in_chans: int | None = None
) -> tuple[int, int]:
    """``(params, MACs)`` of ``model`` as it is (training-time or converted; the paper's counts are of the
    converted one) for one input of ``input_size``. A model carrying ``profile_counts`` (an int8 ONNX graph,
    without PyTorch parameters: its deployed structure's counts) reports those."""
    counts = getattr(model, "profile_counts", None)
    if counts is not None:
        return int(counts[0]), int(counts[1])
    return count_params(model), count_macs(model, input_size, in_chans=in_chans)


def profile_model(
    name: str, input_size: int | Sequence[int] | None = None, *, deploy: bool = True, **kwargs: Any
) -> tuple[int, int]:
    """``(params, MACs)`` of the named model built on the ``meta`` device: ``deploy=True`` the inference
    structure (the paper's convention), else the training-time one; ``input_size`` defaults to the model's;
    ``kwargs`` go to :func:`repmlp.create_model`."""
    with torch.device("meta"):
        model = create_model(name, deploy=deploy, **kwargs)
    if input_size is None:
        img = getattr(model, "img_size", None)
        if img is not None:
            input_size = img if isinstance(img, int) else tuple(img)
        elif is_model(name):
            input_size = tuple(model.pretrained_cfg["input_size"][1:])
        else:
            input_size = 224
    return profile(model.eval(), input_size, in_chans=kwargs.get("in_chans"))
