"""timm's model contract on every registered model, generated over the registry (new models are covered).

Modelled on timm's own ``tests/test_models.py``: forward/backward, torch.fx symbolic tracing forward and
backward, ... Full-size models run on the meta device (shapes only, nothing computed, so every check
is cheap at the paper's resolutions); numerical checks use small configurations.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import Tensor, nn

from repmlp import create_model, list_models

ALL = list_models()


def _first(out: object) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out  # type: ignore[return-value]


def _meta_model(name: str, **kwargs: object) -> nn.Module:
    with torch.device("meta"):
        return create_model(name, **kwargs)


def _meta_input(model: nn.Module, batch: int = 2) -> Tensor:
    c, h, w = model.pretrained_cfg["input_size"]
    return torch.randn(batch, c, h, w, device="meta")


@pytest.mark.parametrize("name", ALL)
def test_fx_trace_forward_backward(name: str) -> None:
    """``torch.fx.symbolic_trace`` of every model; the traced module runs forward and backward."""
    model = _meta_model(name).train()
    traced = torch.fx.symbolic_trace(model)
    x = _meta_input(model)
    outs, refs = traced(x), model(x)
    outs, refs = (outs, refs) if isinstance(outs, tuple) else ((outs,), (refs,))  # PSPNet: (main, aux)
    assert [o.shape for o in outs] == [r.shape for r in refs]
    sum(o.sum() for o in outs).backward()
    grads = [p.grad for p in traced.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)


def test_fx_traced_model_matches_eager_and_keeps_its_input_check(one_thread: None) -> None:
    torch.manual_seed(0)
    model = create_model("repmlp_fmnist").eval()
    traced = torch.fx.symbolic_trace(model)
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(traced(x), model(x))
    with pytest.raises(ValueError, match=r"\(N, 1, 28, 28\), got \(2, 1, 32, 32\)"):
        traced(torch.randn(2, 1, 32, 32))
