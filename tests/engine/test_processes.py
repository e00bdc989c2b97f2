"""The processes of a run: what their set-up says when torchrun's environment is wrong, and DDP's gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from repmlp.engine import DistInfo, prepare_module
from repmlp.engine.processes import setup_distributed
from repmlp.errors import UserError
from repmlp_testdata import lonely_process

TORCHRUN_HINT = "start the processes with torchrun"


@pytest.fixture
def two_processes(monkeypatch) -> None:
    """Process 0 of 2, as torchrun starts it (its run id set), its peer never coming."""
    lonely_process(monkeypatch, TORCHELASTIC_RUN_ID="test")


@pytest.mark.parametrize("value", ["abc", "0", "86401"])
def test_a_bad_dist_timeout_says_what_is_wrong_with_it(two_processes, monkeypatch, value):
    monkeypatch.setenv("REPMLP_DIST_TIMEOUT", value)
    with pytest.raises(UserError) as err:
        setup_distributed("cpu")
    assert str(err.value).startswith(
        f"REPMLP_DIST_TIMEOUT='{value}': expected an integer in 1..86400; the seconds"
    )
    assert TORCHRUN_HINT not in str(err.value)


@pytest.mark.parametrize("torchrun", [True, False])
def test_a_rendezvous_timeout_hints_at_torchrun_only_without_it(two_processes, monkeypatch, torchrun):
    monkeypatch.setenv("REPMLP_DIST_TIMEOUT", "1")
    if not torchrun:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    with pytest.raises(UserError) as err:
        setup_distributed("cpu")
    assert "did not all join" in str(err.value) and "REPMLP_DIST_TIMEOUT sets the wait" in str(err.value)
    assert (TORCHRUN_HINT in str(err.value)) is not torchrun


def test_ddp_gradients_keep_their_parameters_strides():
    """A conv weight of one input channel is NCHW and channels_last at once; its gradient comes labelled as
    the kernel ran (here channels_last, from the input). DDP's bucket views take the parameter's strides and
    warn when a gradient's differ ("Grad strides do not match bucket view strides"): the gradient must come
    with the parameter's."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        conv = nn.Conv2d(1, 4, 2, stride=2, bias=False)
        net = prepare_module(conv, DistInfo(world=2), form=False)  # wrapped in DDP (a group of one here)
        assert isinstance(net, nn.parallel.DistributedDataParallel)
        x = torch.randn(2, 1, 8, 8).as_strided((2, 1, 8, 8), (64, 1, 8, 1))  # labelled channels_last
        net(x).sum().backward()
        assert conv.weight.grad.stride() == conv.weight.stride() == (4, 4, 2, 1)
    finally:
        dist.destroy_process_group()
