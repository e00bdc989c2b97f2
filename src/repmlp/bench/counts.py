"""Parameter and multiply-accumulate counts, as the paper reports them.

The paper's "FLOPs" are multiply-accumulates (MACs) of one image; its parameter counts are taken on
the converted model (RepMLPs merged, every conv-BN fused into a conv with bias), except the
"before conversion" row. MACs are counted with torch's own ``torch.utils.flop_counter.FlopCounterMode``
(which reports 2 FLOPs per MAC for matmuls and convolutions and ignores element-wise ops, pooling and
bias additions). The forward pass runs on ``meta`` tensors, so no memory is allocated and no
arithmetic is done: counting a 713x713 PSPNet takes well under a second.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["profile", "profile_model", "count_params", "count_macs"]


def _input_shape(input_size: int | Sequence[int], in_chans: int) -> tuple[int, ...]:
    """``224`` -> ``(1, in_chans, 224, 224)``; ``(C, H, W)`` -> ``(1, C, H, W)``; 4-D kept as given."""
    if isinstance(input_size, int):
        return (1, in_chans, input_size, input_size)
    size = tuple(int(s) for s in input_size)
    if len(size) == 2:
        return (1, in_chans, *size)
    if len(size) == 3:
        return (1, *size)
    if len(size) == 4:
        return size
    raise ValueError(f"input_size must be an int, (H, W), (C, H, W) or (N, C, H, W); got {input_size!r}")


def count_params(model: nn.Module) -> int:
    """Number of parameters (BatchNorm running statistics are buffers, not counted)."""
    return sum(p.numel() for p in model.parameters())


def count_macs(model: nn.Module, input_size: int | Sequence[int], *, in_chans: int | None = None) -> int:
    """Multiply-accumulates of one forward pass on an input of ``input_size`` (batch 1 unless 4-D given).

    Runs in eval mode on ``meta`` copies of the parameters and buffers (the module's tensors and its
    training flag are left as they were).
    """
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
    """``(params, MACs)`` of ``model`` as it is (train-time or converted) for one input of ``input_size``.

    For the paper's deployed counts pass the converted model (``reparameterize_model(model.eval())`` or
    ``create_model(name, deploy=True)``), or use :func:`profile_model`. A model that carries its counts
    in ``profile_counts`` (an int8 ONNX graph, which has no PyTorch parameters: the counts of the deployed
    structure it quantizes) reports those.
    """
    counts = getattr(model, "profile_counts", None)
    if counts is not None:
        return int(counts[0]), int(counts[1])
    return count_params(model), count_macs(model, input_size, in_chans=in_chans)


def profile_model(
    name: str, input_size: int | Sequence[int] | None = None, *, deploy: bool = True, **kwargs: Any
) -> tuple[int, int]:
    """``(params, MACs)`` of the named model built on the ``meta`` device (nothing is allocated).

    ``deploy=True`` counts the inference structure (the paper's convention), ``False`` the
    training-time one. ``input_size`` defaults to the model's default input size; ``kwargs`` go to
    :func:`repmlp.create_model`.
    """
    from repmlp.models import create_model, is_model

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
