"""RepMLPBlock1d: the 1-D block's exact conversion, its deploy form, validation, and 1-D ``conv_to_fc``."""

from __future__ import annotations

import copy

import pytest
import timm.utils
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from equivalence import randomize, rel_err
from repmlp import RepMLPBlock1d, conv_to_fc, conv_to_fc_identity, reparameterize_model

FAST = settings(max_examples=25, deadline=None)


def paper_forward_1d(block: RepMLPBlock1d, x: torch.Tensor) -> torch.Tensor:
    """The paper's formulation in 1-D, from ``block``'s parameters, written independently of it.

    Pad, cut into ``(N*Lp, C, l)`` partitions, add the Global Perceptron (avg-pool, BN, FC1, ReLU, FC2),
    FC3 as a grouped 1x1 conv then BN, every Local Perceptron branch a grouped conv1d + BN; un-partition
    and crop. BN modules are called as they are (train or eval mode).
    """
    n, c = x.shape[:2]
    (l,), (lp,) = block.partition, block.parts
    g, o = block.groups, block.out_channels
    x = F.pad(x, (0, block.padding[0]))
    parts = x.reshape(n, c, lp, l).permute(0, 2, 1, 3).reshape(-1, c, l)
    gp = block.global_perceptron
    if gp is not None:
        v = F.avg_pool1d(x, l)
        if gp.bn is not None:
            v = gp.bn(v)
        v = gp.fc2(F.relu(gp.fc1(v.flatten(1))))
        parts = parts + v.reshape(n, c, lp).permute(0, 2, 1).reshape(-1, c, 1)
    b = parts.shape[0]
    pp = block.partition_perceptron
    weight = pp.fc3.weight
    fc = F.conv1d(parts.reshape(b, -1, 1), weight.reshape(*weight.shape, 1), pp.fc3.bias, groups=g)
    fc = fc.reshape(b, -1)
    if pp.bn is not None:
        fc = pp.bn(fc)
    out = fc.reshape(b, o, l)
    if block.local_perceptron is not None:
        for branch in block.local_perceptron.branches:
            (k,) = branch.conv.kernel_size
            y = F.conv1d(parts, branch.conv.weight, branch.conv.bias, padding=k // 2, groups=g)
            out = out + (y if branch.bn is None else branch.bn(y))
    out = out.reshape(n, lp, o, l).permute(0, 2, 1, 3).reshape(n, o, lp * l)
    return out[:, :, : block.length]


@st.composite
def block1d_configs(draw):
    g = draw(st.integers(1, 3))
    cin, cout = g * draw(st.integers(1, 3)), g * draw(st.integers(1, 3))
    part = draw(st.integers(1, 7))
    length = draw(st.integers(1, 4 * part))  # often not a multiple: padding and cropping
    odd = st.sampled_from([1, 3, 5, 7]).filter(lambda k: k <= part)
    sizes = [draw(odd) for _ in range(draw(st.integers(0, 3)))]  # 0: no Local Perceptron
    sizes = [(k,) if draw(st.booleans()) else k for k in sizes]  # an int or a 1-tuple
    parts = -(-length // part)
    kwargs = dict(
        groups=g,
        kernel_sizes=tuple(sizes),
        global_reduction=draw(st.integers(1, min(3, cin * parts))),
        global_perceptron=draw(st.booleans()),
    )
    partition = (part,) if draw(st.booleans()) else part
    return (cin, cout, length, partition), kwargs, draw(st.integers(1, 3)), draw(st.integers(0, 2**31 - 1))


def _assert_inference_form(block: RepMLPBlock1d) -> None:
    assert block.deploy and block.local_perceptron is None and block.partition_perceptron.bn is None
    kinds = {type(m) for m in block.modules()}
    assert not any(issubclass(k, (nn.modules.batchnorm._BatchNorm, nn.Conv1d)) for k in kinds), kinds
    assert block.partition_perceptron.fc3.bias is not None


def _check_equivalent(args, kwargs, batch, seed, convert) -> None:
    """float64, random BN statistics: the converted block computes the training-time block's function,
    and a ``deploy=True`` block loads its state dict strictly and computes the same bits."""
    torch.manual_seed(seed)
    block = randomize(RepMLPBlock1d(*args, **kwargs), seed).double().eval()
    x = torch.randn(batch, args[0], args[2], dtype=torch.float64)
    with torch.no_grad():
        ref = block(x)
        assert ref.shape == (batch, args[1], args[2])
        assert rel_err(paper_forward_1d(block, x), ref) < 1e-10
        deployed = convert(block)
        _assert_inference_form(deployed)
        out = deployed(x)
    assert out.dtype == torch.float64 and out.shape == ref.shape
    assert rel_err(out, ref) < 1e-10
    fresh = RepMLPBlock1d(*args, **kwargs, deploy=True).double().eval()
    fresh.load_state_dict(deployed.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(x), out)


def _in_place(block: nn.Module) -> nn.Module:
    block = copy.deepcopy(block)
    block.reparameterize()
    return block


def _timm(block: nn.Module) -> nn.Module:
    # timm's helper calls reparameterize() on every child (not the root) that has one: in a model.
    return timm.utils.reparameterize_model(nn.Sequential(block))[0]


CONVERTERS = {"method": _in_place, "repmlp": reparameterize_model, "timm": _timm}


@FAST
@given(cfg=block1d_configs(), converter=st.sampled_from(sorted(CONVERTERS)))
def test_reparameterized_block1d_is_equivalent(cfg, converter):
    args, kwargs, batch, seed = cfg
    _check_equivalent(args, kwargs, batch, seed, CONVERTERS[converter])


@pytest.mark.parametrize("converter", sorted(CONVERTERS))
@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((4, 6, 23, 5), dict(groups=2, kernel_sizes=(1, 3, 5), global_reduction=2)),  # padded by 2
        ((3, 3, 24, 6), dict(groups=3, kernel_sizes=((3,), 5))),  # a multiple: no padding
        ((2, 4, 17, 4), dict(kernel_sizes=(1, 3), global_perceptron=False)),
        ((2, 2, 5, 7), dict(kernel_sizes=(7,))),  # a single padded partition: no Global Perceptron
        ((2, 2, 9, 3), dict(kernel_sizes=())),  # no Local Perceptron
    ],
)
def test_fixed_configurations_are_equivalent(args, kwargs, converter):
    # The cases the drawn configurations may miss, every time.
    _check_equivalent(args, kwargs, 2, 0, CONVERTERS[converter])


@settings(max_examples=10, deadline=None)
@given(cfg=block1d_configs())
def test_training_mode_matches_paper_formulation(cfg):
    args, kwargs, batch, seed = cfg
    torch.manual_seed(seed)
    block = randomize(RepMLPBlock1d(*args, **kwargs), seed).double().train()
    x = torch.randn(max(batch, 2), args[0], args[2], dtype=torch.float64)  # BN needs two values
    ref_block = copy.deepcopy(block)
    assert rel_err(block(x), paper_forward_1d(ref_block, x)) < 1e-10
    for (name, a), (_, b) in zip(block.named_buffers(), ref_block.named_buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_structure_and_gradients():
    block = RepMLPBlock1d(4, 6, 19, 5, groups=2, kernel_sizes=(1, 3), global_reduction=2)
    assert block.parts == (4,) and block.padding == (1,) and block.partition == (5,)
    gp = block.global_perceptron
    assert gp is not None and isinstance(gp.bn, nn.BatchNorm1d) and gp.fc1.in_features == 16
    assert gp.fc1.out_features == 8
    assert all(isinstance(b.conv, nn.Conv1d) for b in block.local_perceptron.branches)
    assert block.partition_perceptron.fc3.weight.shape == (6 * 5, 4 * 5 // 2)
    x = torch.randn(2, 4, 19, requires_grad=True)
    block(x).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for name, p in block.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    ("args", "kwargs", "name"),
    [
        ((4, 4, 0, 4), {}, "length"),
        ((4, 4, (8, 8), 4), {}, "length"),
        ((4, 4, 8, 0), {}, "partition"),
        ((4, 4, 8, (4, 4)), {}, "partition"),  # a 2-D partition for a sequence
        ((4, 4, 8, 4), {"kernel_sizes": (5,)}, "kernel_sizes"),  # larger than the partition
        ((4, 4, 8, 4), {"kernel_sizes": (2,)}, "kernel_sizes"),  # even
        ((4, 4, 8, 4), {"kernel_sizes": ((3, 3),)}, "kernel_sizes"),  # a 2-D kernel
        ((4, 4, 8, 4), {"kernel_sizes": 3}, "kernel_sizes"),
        ((6, 4, 8, 4), {"groups": 4}, "groups"),
        ((4, 4, 8, 4), {"groups": 0}, "groups"),
        ((0, 4, 8, 4), {}, "in_channels"),
        ((4, 0, 8, 4), {}, "out_channels"),
        ((1, 1, 4, 2), {"kernel_sizes": (1,), "global_reduction": 8}, "global_reduction"),
    ],
)
def test_invalid_configurations_raise_value_error_naming_the_argument(args, kwargs, name):
    with pytest.raises(ValueError, match=name):
        RepMLPBlock1d(*args, **kwargs)


@pytest.mark.parametrize("deploy", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 9), (2, 3, 8), (4, 8), (2, 4, 8, 1)])
def test_wrong_input_shape_names_both_shapes(deploy, shape):
    block = RepMLPBlock1d(4, 4, 8, 4, kernel_sizes=(1, 3), deploy=deploy)
    with pytest.raises(ValueError) as info:
        block(torch.randn(*shape))
    assert "(N, 4, 8)" in str(info.value) and str(tuple(shape)) in str(info.value)


@pytest.mark.parametrize(
    ("shape", "partition", "groups"),
    [((4, 2, 3), 7, 2), ((6, 3, 5), (5,), 1), ((3, 1, 1), 4, 3), ((2, 2, 3, 1, 3), (3, 2, 4), 1)],
)
def test_conv_to_fc_matches_identity_construction_and_the_conv(shape, partition, groups):
    # 1-D (and one 3-D case): the direct construction against the paper's and against the conv itself.
    gen = torch.Generator().manual_seed(0)
    kernel = torch.randn(shape, generator=gen, dtype=torch.float64)
    bias = torch.randn(shape[0], generator=gen, dtype=torch.float64)
    fc_w, fc_b = conv_to_fc(kernel, bias, partition, groups)
    ref_w, ref_b = conv_to_fc_identity(kernel, bias, partition, groups)
    torch.testing.assert_close(fc_w, ref_w, rtol=0, atol=0)
    torch.testing.assert_close(fc_b, ref_b, rtol=0, atol=0)

    size = (partition,) if isinstance(partition, int) else partition
    cin = shape[1] * groups
    x = torch.randn(3, cin, *size, generator=gen, dtype=torch.float64)
    conv = {1: F.conv1d, 3: F.conv3d}[len(size)]
    ref = conv(x, kernel, bias, padding=tuple(k // 2 for k in shape[2:]), groups=groups).flatten(1)
    rows = x.reshape(3, groups, -1)  # (B, g, C/g*S): each group's inputs, flattened as FC3 takes them
    w = fc_w.reshape(groups, -1, fc_w.shape[1])
    out = torch.einsum("bgp,gqp->bgq", rows, w).reshape(3, -1) + fc_b
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("shape", "partition", "match"),
    [((4, 2, 2), 5, "odd"), ((4, 2, 5), 3, "larger than the partition"), ((4, 2, 3), (5, 5), "kernel")],
)
def test_conv_to_fc_1d_rejects_invalid_arguments(shape, partition, match):
    for fn in (conv_to_fc, conv_to_fc_identity):
        with pytest.raises(ValueError, match=match):
            fn(torch.zeros(shape), None, partition, 2)
