"""Every module that computes runs through its own call: forward hooks fire and ``torch.nn.utils.prune`` takes
effect on every weighted layer of every registered model, in evaluation and training, with and without
autograd (the training form's hooks and pruning: tests/engine/test_forms.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import prune

import repmlp
from repmlp.models.pure_mlp import PartitionConvBlock
from repmlp.nn.block import RepMLPBlock
from repmlp.nn.layers import ConvBN
from zoo import SMALL_BUILDS, shallow

pytestmark = pytest.mark.usefixtures("one_thread")

CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)

# Submodules that compute in training mode only: PSPNet's auxiliary head (its loss is a training term).
_TRAINING_ONLY = ("aux_head.",)


def weighted_leaves(model: nn.Module) -> dict[str, nn.Module]:
    """Every module with parameters of its own (conv, BatchNorm, linear, GroupwiseLinear, ...), by name."""
    return {
        name: m
        for name, m in model.named_modules()
        if next(m.parameters(recurse=False), None) is not None
        or isinstance(m, nn.modules.batchnorm._BatchNorm)
    }


def test_small_builds_cover_every_registered_model() -> None:
    """A model registered later gets a small build in tests/zoo.py too (or falls back to tests/zoo.py's depths)."""
    assert set(SMALL_BUILDS) == set(repmlp.list_models())


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("name", repmlp.list_models())
def test_every_weighted_leaf_runs_its_own_call(name: str, device: str) -> None:
    """A forward hook on every weighted leaf fires, in eval and train, with and without autograd: the same
    modules run in every mode, but for training-only heads."""
    torch.manual_seed(0)
    model = repmlp.create_model(name, **SMALL_BUILDS.get(name, shallow(name))).to(device)
    x = torch.randn(2, *model.pretrained_cfg["input_size"], device=device)
    leaves = weighted_leaves(model)
    fired: set[str] = set()
    for key, m in leaves.items():
        m.register_forward_hook(lambda module, args, out, key=key: fired.add(key))
    for training in (False, True):
        model.train(training)
        for grad in (False, True):
            fired.clear()
            with torch.set_grad_enabled(grad):
                model(x)
            silent = {k for k in set(leaves) - fired if training or not k.startswith(_TRAINING_ONLY)}
            assert not silent, (
                f"train={training}, grad={grad}: {len(silent)} of {len(leaves)} never ran: {sorted(silent)[:4]}"
            )


def _narrow_block() -> RepMLPBlock:
    """A training-time block with 4 channels a group, ``8 x 8`` partitions, kernels 1 to 7 (float64)."""
    return RepMLPBlock(8, 8, 16, 8, groups=2, kernel_sizes=(1, 3, 5, 7)).double()


def _narrow_partition_conv_block() -> PartitionConvBlock:
    """Row D's block (FC3 as a 9x9 conv), narrow as :func:`_narrow_block`."""
    return PartitionConvBlock(8, 8, 16, 8, kernel_size=9, groups=2, kernel_sizes=(1, 3, 5, 7)).double()


def _local_convs(block: nn.Module) -> list[ConvBN]:
    return (
        list(block.local) if isinstance(block, PartitionConvBlock) else list(block.local_perceptron.branches)
    )


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("make", [_narrow_block, _narrow_partition_conv_block], ids=["RepMLPBlock", "row D"])
def test_pruning_a_local_perceptron_conv_takes_effect(make: Callable[[], nn.Module], training: bool) -> None:
    """``prune.l1_unstructured`` on a Local Perceptron conv, then a new mask: the next forward computes with the
    masked weight, in a training step on a CPU (where the block would otherwise run its branches as one FC)
    and in evaluation, as a block whose weight is the masked one does."""
    torch.manual_seed(0)
    block = make().train(training)
    x = torch.randn(2, 8, 16, 16, dtype=torch.float64)
    reference = copy.deepcopy(block)
    conv = _local_convs(block)[2].conv
    prune.l1_unstructured(conv, "weight", amount=0.5)

    def masked_reference(mask: Tensor) -> Tensor:
        ref = copy.deepcopy(reference)
        with torch.no_grad():
            _local_convs(ref)[2].conv.weight.mul_(mask)
        return ref(x)

    with torch.set_grad_enabled(training):
        pruned = block(x)
        torch.testing.assert_close(pruned, masked_reference(conv.weight_mask), rtol=1e-10, atol=1e-12)
        conv.weight_mask.zero_()  # a new mask, set without a forward: the pre-hook applies it at the next
        zeroed = block(x)
        assert not torch.allclose(zeroed, pruned)
        torch.testing.assert_close(zeroed, masked_reference(conv.weight_mask), rtol=1e-10, atol=1e-12)
