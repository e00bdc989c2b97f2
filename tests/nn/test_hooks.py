"""Every module that computes runs through its own call: forward hooks fire and ``torch.nn.utils.prune`` takes
effect on every weighted layer of every registered model, in evaluation and training, with and without
autograd; the fused training forms (the CPU's one-FC branches, ``repmlp.nn.branches_fc``; the dense form,
``repmlp.nn.dense``) step aside when hooks watch the modules they compute, and still run when none do."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import prune

import repmlp
from repmlp.models.cifar import PartitionConvBlock
from repmlp.models.registry import default_input_size
from repmlp.nn import block as block_module
from repmlp.nn import branches_fc
from repmlp.nn.block import RepMLPBlock, set_train_form
from repmlp.nn.layers import ConvBN, LayoutConv2d
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
@pytest.mark.parametrize("form", ["auto", "dense"])  # "dense": CUDA's default training form, also on a CPU
@pytest.mark.parametrize("name", repmlp.list_models())
def test_every_weighted_leaf_runs_its_own_call(name: str, form: str, device: str) -> None:
    """A forward hook on every weighted leaf fires, in eval and train, with and without autograd: the same
    modules run in every mode (the fused forms step aside for the hooks), but for training-only heads."""
    torch.manual_seed(0)
    model = repmlp.create_model(name, **SMALL_BUILDS.get(name, shallow(name))).to(device)
    set_train_form(model, form)
    x = torch.randn(2, *default_input_size(model), device=device)
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


class _Calls:
    """Counts calls of ``owner.attr`` (a function or method), which still runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: object, attr: str) -> None:
        self.count = 0
        real = getattr(owner, attr)

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, attr, counted)


def _narrow_block() -> RepMLPBlock:
    """A training-time block whose Local Perceptron takes the CPU's one-FC form in a training step: 4 channels
    a group, ``8 x 8`` partitions, kernels 1 to 7 (float64, for the comparisons)."""
    return RepMLPBlock(8, 8, 16, 8, groups=2, kernel_sizes=(1, 3, 5, 7)).double()


def _narrow_partition_conv_block() -> PartitionConvBlock:
    """Row D's block (FC3 as a 9x9 conv), narrow as :func:`_narrow_block`: the one-FC form in training too."""
    return PartitionConvBlock(8, 8, 16, 8, kernel_size=9, groups=2, kernel_sizes=(1, 3, 5, 7)).double()


def _local_convs(block: nn.Module) -> list[ConvBN]:
    """The conv-BN branches that the CPU's one-FC form computes at once."""
    return (block if isinstance(block, PartitionConvBlock) else block.local_perceptron)._conv_branches()


# Ways of watching a module, each returning the hook's handle; "global" ones watch every module.
_WATCHERS: dict[str, Callable[[nn.Module], torch.utils.hooks.RemovableHandle]] = {
    "forward hook": lambda m: m.register_forward_hook(lambda *args: None),
    "forward pre-hook": lambda m: m.register_forward_pre_hook(lambda *args: None),
    "backward hook": lambda m: m.register_full_backward_hook(lambda *args: None),
    "global forward hook": lambda m: nn.modules.module.register_module_forward_hook(lambda *args: None),
    "global forward pre-hook": lambda m: nn.modules.module.register_module_forward_pre_hook(
        lambda *args: None
    ),
}


@contextmanager
def _watched(module: nn.Module, how: str) -> Iterator[None]:
    handle = _WATCHERS[how](module)
    try:
        yield
    finally:
        handle.remove()


@pytest.mark.parametrize("how", list(_WATCHERS))
@pytest.mark.parametrize("target", ["conv", "bn", "branch"])
@pytest.mark.parametrize("make", [_narrow_block, _narrow_partition_conv_block], ids=["RepMLPBlock", "row D"])
def test_the_one_fc_form_runs_unless_hooks_watch_a_branch(
    monkeypatch: pytest.MonkeyPatch, make: Callable[[], nn.Module], target: str, how: str
) -> None:
    """A CPU training step takes the one-FC form (the speed path) while nothing watches; with a hook on a
    branch's conv, BatchNorm or the branch itself (or on every module) the convs run and the hooks fire;
    once the hook is gone the FC form is back."""
    torch.manual_seed(0)
    block = make().train()
    x = torch.randn(2, 8, 16, 16, dtype=torch.float64)
    fc = _Calls(monkeypatch, branches_fc, "branch_sum_as_fc")
    block(x)
    assert fc.count == 1
    branch = _local_convs(block)[1]
    module = {"conv": branch.conv, "bn": branch.bn, "branch": branch}[target]
    with _watched(module, how):
        block(x).sum().backward()
        assert fc.count == 1
    block(x)
    assert fc.count == 2


@pytest.mark.parametrize("how", list(_WATCHERS))
@pytest.mark.parametrize(
    "target", ["fc3", "fc3 bn", "partition perceptron", "conv", "bn", "local perceptron"]
)
def test_the_dense_form_runs_unless_hooks_watch_what_it_computes(
    monkeypatch: pytest.MonkeyPatch, target: str, how: str
) -> None:
    """The dense form (pinned here, on a CPU; ``"auto"`` picks it on CUDA) runs while nothing watches FC3, the
    Local Perceptron or anything in them, and steps aside for the conv form, which calls them, while a hook
    does."""
    torch.manual_seed(0)
    block = RepMLPBlock(16, 16, 14, 7, groups=2, kernel_sizes=(1, 3)).double().train()
    assert set_train_form(block, "dense") == 1
    x = torch.randn(2, 16, 14, 14, dtype=torch.float64)
    dense = _Calls(monkeypatch, block_module, "dense_partition_sum")
    block(x)
    assert dense.count == 1
    pp, lp = block.partition_perceptron, block.local_perceptron
    modules = {"fc3": pp.fc3, "fc3 bn": pp.bn, "partition perceptron": pp, "local perceptron": lp}
    modules |= {"conv": lp.branches[0].conv, "bn": lp.branches[1].bn}
    with _watched(modules[target], how):
        block(x).sum().backward()
        assert dense.count == 1
    block(x)
    assert dense.count == 2


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


def test_layout_conv_keeps_the_state_dict_the_class_and_the_traced_leaf() -> None:
    """The Local Perceptron's :class:`LayoutConv2d` has a plain conv's state-dict keys, survives the BN fold as
    its own class, compiles with TorchScript (the plain conv) and traces into the ``conv_by_grad_mode`` leaf
    (not a leaf module itself: the graph makes the layout choice when it runs)."""
    torch.manual_seed(0)
    layer = ConvBN(8, 8, 3, groups=2, layout_choice=True).double().eval()
    assert isinstance(layer.conv, LayoutConv2d)
    assert layer.state_dict().keys() == ConvBN(8, 8, 3, groups=2).state_dict().keys()
    x = torch.randn(2, 8, 7, 7, dtype=torch.float64)
    traced = torch.fx.symbolic_trace(layer)
    assert "conv_by_grad_mode" in traced.code
    scripted = torch.jit.script(layer)
    with torch.no_grad():
        ref = layer(x)
        assert torch.equal(traced(x), ref)
        torch.testing.assert_close(scripted(x), ref, rtol=1e-12, atol=1e-12)
    layer.reparameterize()
    assert type(layer.conv) is LayoutConv2d and layer.bn is None
    with torch.no_grad():
        torch.testing.assert_close(layer(x), ref, rtol=1e-12, atol=1e-12)
