"""Re-parameterization math: fuse_bn, conv_to_fc (direct and identity), absorb_bn_into_fc, merge_fc3."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from repmlp import absorb_bn_into_fc, conv_to_fc, conv_to_fc_identity, fuse_bn
from repmlp.nn.reparam import merge_fc3

FAST = settings(max_examples=25, deadline=None)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the relative error measure used throughout the tests."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def random_bn(bn: nn.Module, gen: torch.Generator) -> nn.Module:
    """Random running statistics and (when affine) random scale and shift."""
    with torch.no_grad():
        n = bn.num_features
        bn.running_mean.copy_(torch.randn(n, generator=gen, dtype=torch.float64))
        bn.running_var.copy_(torch.rand(n, generator=gen, dtype=torch.float64) * 2 + 0.1)
        if bn.affine:
            bn.weight.copy_(torch.randn(n, generator=gen, dtype=torch.float64))
            bn.bias.copy_(torch.randn(n, generator=gen, dtype=torch.float64))
    return bn.eval()


def apply_fc(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, groups: int) -> torch.Tensor:
    """Reference groupwise FC, one plain matmul per group: ``(B, P)`` -> ``(B, Q)``."""
    xs = x.chunk(groups, dim=1)
    ws = weight.chunk(groups, dim=0)
    out = torch.cat([xi @ wi.t() for xi, wi in zip(xs, ws, strict=True)], dim=1)
    return out if bias is None else out + bias


@st.composite
def conv_configs(draw):
    g = draw(st.integers(1, 3))
    cg = draw(st.integers(1, 3))
    og = draw(st.integers(1, 3))
    h = draw(st.integers(1, 7))
    w = draw(st.integers(1, 7))
    kh = draw(st.sampled_from([k for k in (1, 3, 5, 7) if k <= h]))
    kw = draw(st.sampled_from([k for k in (1, 3, 5, 7) if k <= w]))
    with_bias = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return g, cg * g, og * g, h, w, kh, kw, with_bias, seed


@FAST
@given(cfg=conv_configs(), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_conv_to_fc_matches_conv2d(cfg, dtype):
    g, c, o, h, w, kh, kw, with_bias, seed = cfg
    gen = torch.Generator().manual_seed(seed)
    kernel = torch.randn(o, c // g, kh, kw, generator=gen, dtype=dtype)
    bias = torch.randn(o, generator=gen, dtype=dtype) if with_bias else None
    x = torch.randn(3, c, h, w, generator=gen, dtype=dtype)
    fc_w, fc_b = conv_to_fc(kernel, bias, (h, w), groups=g)
    assert fc_w.shape == (o * h * w, c * h * w // g) and fc_w.dtype == dtype and fc_w.is_contiguous()
    assert (fc_b is None) == (bias is None)
    ref = F.conv2d(x, kernel, bias, padding=(kh // 2, kw // 2), groups=g)
    out = apply_fc(x.reshape(3, -1), fc_w, fc_b, g).reshape_as(ref)
    assert rel_err(out, ref) < (1e-12 if dtype == torch.float64 else 1e-6)


@FAST
@given(cfg=conv_configs(), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_direct_construction_equals_identity_construction(cfg, dtype):
    g, c, o, h, w, kh, kw, with_bias, seed = cfg
    gen = torch.Generator().manual_seed(seed)
    kernel = torch.randn(o, c // g, kh, kw, generator=gen, dtype=dtype)
    bias = torch.randn(o, generator=gen, dtype=dtype) if with_bias else None
    direct_w, direct_b = conv_to_fc(kernel, bias, (h, w), g)
    ident_w, ident_b = conv_to_fc_identity(kernel, bias, (h, w), g)
    assert direct_w.shape == ident_w.shape and direct_w.dtype == ident_w.dtype
    # Every entry is one kernel value times 1 plus exact zeros, so the two agree to the last bit
    # unless the conv backend reassociates (allowed: a few ulps).
    torch.testing.assert_close(direct_w, ident_w, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)
    if bias is None:
        assert direct_b is None and ident_b is None
    else:
        torch.testing.assert_close(direct_b, ident_b, rtol=0, atol=0)


def test_conv_to_fc_full_size_non_square_kernel():
    # Kernel as large as the partition in both directions, non-square partition.
    gen = torch.Generator().manual_seed(1)
    kernel = torch.randn(4, 2, 5, 3, generator=gen, dtype=torch.float64)
    x = torch.randn(2, 4, 5, 3, generator=gen, dtype=torch.float64)
    fc_w, _ = conv_to_fc(kernel, None, (5, 3), groups=2)
    ref = F.conv2d(x, kernel, padding=(2, 1), groups=2)
    assert rel_err(apply_fc(x.reshape(2, -1), fc_w, None, 2).reshape_as(ref), ref) < 1e-12


def test_conv_to_fc_gradcheck():
    gen = torch.Generator().manual_seed(2)
    kernel = torch.randn(4, 1, 3, 1, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda k, b: conv_to_fc(k, b, (3, 4), groups=2), (kernel, bias))


def test_conv_to_fc_gradients_match_conv_gradients():
    # A loss computed through the FC form gives the kernel the same gradient as through the conv.
    gen = torch.Generator().manual_seed(3)
    kernel = torch.randn(6, 2, 3, 5, generator=gen, dtype=torch.float64)
    bias = torch.randn(6, generator=gen, dtype=torch.float64)
    x = torch.randn(2, 6, 5, 6, generator=gen, dtype=torch.float64)
    target = torch.randn(2, 6, 5, 6, generator=gen, dtype=torch.float64)

    k1, b1 = kernel.clone().requires_grad_(), bias.clone().requires_grad_()
    ((F.conv2d(x, k1, b1, padding=(1, 2), groups=3) - target) ** 2).sum().backward()

    k2, b2 = kernel.clone().requires_grad_(), bias.clone().requires_grad_()
    fc_w, fc_b = conv_to_fc(k2, b2, (5, 6), groups=3)
    out = apply_fc(x.reshape(2, -1), fc_w, fc_b, 3).reshape_as(target)
    ((out - target) ** 2).sum().backward()

    torch.testing.assert_close(k2.grad, k1.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(b2.grad, b1.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_conv_to_fc_half_precision(dtype):
    gen = torch.Generator().manual_seed(4)
    kernel = torch.randn(4, 2, 3, 3, generator=gen).to(dtype)
    bias = torch.randn(4, generator=gen).to(dtype)
    for fn in (conv_to_fc, conv_to_fc_identity):
        fc_w, fc_b = fn(kernel, bias, (4, 5), 2)
        ref_w, ref_b = conv_to_fc(kernel.double(), bias.double(), (4, 5), 2)
        assert fc_w.dtype == dtype and fc_b.dtype == dtype
        assert fc_w.is_contiguous() and fc_b.is_contiguous()
        # Entries are copies of kernel values, so nothing is lost to rounding.
        torch.testing.assert_close(fc_w.double(), ref_w, rtol=0, atol=0)
        torch.testing.assert_close(fc_b.double(), ref_b, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("shape", "partition", "groups", "match"),
    [
        ((4, 2, 2, 3), (5, 5), 2, "odd"),  # even kernel height
        ((4, 2, 3, 4), (5, 5), 2, "odd"),  # even kernel width
        ((4, 2, 5, 3), (3, 5), 2, "larger than the partition"),
        ((4, 2, 3, 3), (0, 5), 2, "partition"),
        ((5, 2, 3, 3), (5, 5), 2, "groups"),  # 5 output channels, 2 groups
        ((4, 2, 3, 3), (5, 5), 0, "groups"),
        ((4, 2, 3), (5, 5), 1, "kernel"),
    ],
)
def test_conv_to_fc_rejects_invalid_arguments(shape, partition, groups, match):
    kernel = torch.zeros(shape)
    for fn in (conv_to_fc, conv_to_fc_identity):
        with pytest.raises(ValueError, match=match):
            fn(kernel, None, partition, groups)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fuse_bn_conv2d(affine, with_bias):
    gen = torch.Generator().manual_seed(5)
    conv = nn.Conv2d(6, 4, (3, 5), padding=(1, 2), groups=2, bias=with_bias).double()
    bn = random_bn(nn.BatchNorm2d(4, affine=affine).double(), gen)
    x = torch.randn(2, 6, 7, 8, generator=gen, dtype=torch.float64)
    weight, bias = fuse_bn(conv.weight, bn, conv.bias)
    assert weight.shape == conv.weight.shape and bias.shape == (4,)
    with torch.no_grad():
        ref = bn(conv(x))
        out = F.conv2d(x, weight, bias, padding=(1, 2), groups=2)
    assert rel_err(out, ref) < 1e-12


@pytest.mark.parametrize("with_bias", [True, False])
def test_fuse_bn_linear_bn1d(with_bias):
    gen = torch.Generator().manual_seed(6)
    fc = nn.Linear(10, 7, bias=with_bias).double()
    bn = random_bn(nn.BatchNorm1d(7).double(), gen)
    x = torch.randn(5, 10, generator=gen, dtype=torch.float64)
    weight, bias = fuse_bn(fc.weight, bn, fc.bias)
    with torch.no_grad():
        assert rel_err(F.linear(x, weight, bias), bn(fc(x))) < 1e-12


def test_fuse_bn_uses_running_statistics_even_in_training_mode():
    gen = torch.Generator().manual_seed(7)
    bn = random_bn(nn.BatchNorm2d(3).double(), gen).train()
    weight = torch.randn(3, 2, 1, 1, generator=gen, dtype=torch.float64)
    w_train, b_train = fuse_bn(weight, bn)
    w_eval, b_eval = fuse_bn(weight, bn.eval())
    assert torch.equal(w_train, w_eval) and torch.equal(b_train, b_eval)


def test_fuse_bn_half_precision_is_computed_in_float32():
    gen = torch.Generator().manual_seed(8)
    bn = random_bn(nn.BatchNorm2d(4), gen)
    weight = torch.randn(4, 3, 3, 3, generator=gen).to(torch.bfloat16)
    w, b = fuse_bn(weight, bn)
    assert w.dtype == torch.bfloat16 and b.dtype == torch.bfloat16 and w.is_contiguous()
    w32, b32 = fuse_bn(weight.float(), bn)
    torch.testing.assert_close(w, w32.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(b, b32.to(torch.bfloat16), rtol=0, atol=0)


def test_fuse_bn_rejects_mismatch_and_missing_statistics():
    with pytest.raises(ValueError, match="channels"):
        fuse_bn(torch.zeros(5, 3), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="running statistics"):
        fuse_bn(torch.zeros(4, 3), nn.BatchNorm1d(4, track_running_stats=False))
    with pytest.raises(TypeError):
        fuse_bn(torch.zeros(4, 3), nn.LayerNorm(4))


@pytest.mark.parametrize("with_bias", [True, False])
def test_absorb_bn_into_fc_appendix_c(with_bias):
    # The Global Perceptron: BN2d over (N, C, Hp, Wp) pooled values, flattened channel-major, then FC1.
    gen = torch.Generator().manual_seed(9)
    c, hp, wp = 3, 2, 4
    bn = random_bn(nn.BatchNorm2d(c).double(), gen)
    fc1 = nn.Linear(c * hp * wp, 5, bias=with_bias).double()
    v = torch.randn(6, c, hp, wp, generator=gen, dtype=torch.float64)
    weight, bias = absorb_bn_into_fc(fc1.weight, fc1.bias, bn)
    assert weight.shape == fc1.weight.shape and bias.shape == (5,)
    with torch.no_grad():
        ref = fc1(bn(v).flatten(1))
    assert rel_err(F.linear(v.flatten(1), weight, bias), ref) < 1e-12


def test_absorb_bn_into_fc_rejects_incompatible_width():
    with pytest.raises(ValueError, match="multiple"):
        absorb_bn_into_fc(torch.zeros(5, 10), None, nn.BatchNorm2d(3))


def _fc3_problem(bn_channels: int, with_bias: bool, dtype: torch.dtype = torch.float64) -> dict:
    """A groupwise FC3 (g=2, C=O=4, 3x5 partition), its BN over ``bn_channels`` channels, two branches.

    One branch is conv + BN; the other a conv with bias and no BN (a branch already fused).
    """
    gen = torch.Generator().manual_seed(11)
    g, c, o, (h, w) = 2, 4, 4, (3, 5)
    q = o * h * w
    bn = nn.BatchNorm1d(q) if bn_channels == q else nn.BatchNorm2d(bn_channels)
    branch_bn = random_bn(nn.BatchNorm2d(o).double(), gen).to(dtype)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return dict(
        weight=rand(q, c * h * w // g),
        bias=rand(q) if with_bias else None,
        bn=random_bn(bn.double(), gen).to(dtype),
        branches=[(rand(o, c // g, 3, 3), None, branch_bn), (rand(o, c // g, 1, 5), rand(o), None)],
        partition=(h, w),
        groups=g,
    )


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("bn_channels", [60, 4, 1], ids=["bn1d-per-row", "bn2d-per-set", "bn2d-one-set"])
def test_merge_fc3_equals_fc3_bn_plus_conv_branches(bn_channels, with_bias):
    # bn_channels = O*h*w is RepMLP-Res50's BatchNorm1d; fewer is RepMLPNet's BatchNorm2d(S), each channel
    # normalising a set of consecutive rows (rows per set here: 15 and 60).
    p = _fc3_problem(bn_channels, with_bias)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(7, 4, 3, 5, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        y = apply_fc(x.reshape(7, -1), p["weight"], p["bias"], p["groups"])
        bn_in = y if bn_channels == y.shape[1] else y.reshape(7, bn_channels, -1, 1)
        ref = p["bn"](bn_in).reshape(7, -1)
        for kernel, kbias, kbn in p["branches"]:
            kh, kw = kernel.shape[2:]
            z = F.conv2d(x, kernel, kbias, padding=(kh // 2, kw // 2), groups=p["groups"])
            ref = ref + (z if kbn is None else kbn(z)).reshape(7, -1)
    weight, bias = merge_fc3(**p)
    assert weight.shape == p["weight"].shape and bias.shape == (60,)
    assert rel_err(apply_fc(x.reshape(7, -1), weight, bias, p["groups"]), ref) < 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merge_fc3_half_precision_merges_in_float32_and_rounds_once(dtype):
    half = _fc3_problem(4, True, dtype)
    single = _fc3_problem(4, True, torch.float32)
    single["weight"], single["bias"] = half["weight"].float(), half["bias"].float()
    single["branches"] = [
        (k.float(), None if b is None else b.float(), None if bn is None else bn.float())
        for k, b, bn in half["branches"]
    ]
    single["bn"] = half["bn"].float()
    weight, bias = merge_fc3(**half)
    ref_w, ref_b = merge_fc3(**single)
    assert weight.dtype == dtype and bias.dtype == dtype
    assert torch.equal(weight, ref_w.to(dtype)) and torch.equal(bias, ref_b.to(dtype))


def test_merge_fc3_without_bn_or_branches_returns_new_tensors():
    weight = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    merged_w, merged_b = merge_fc3(weight, None, None, [], 1, 2)
    # Equal values, but a copy: the caller swaps the module's parameters for the result.
    assert torch.equal(merged_w, weight) and merged_w.data_ptr() != weight.data_ptr()
    assert torch.equal(merged_b, torch.zeros(6, dtype=torch.float64))
    merged_w.sum().backward()  # pure tensor maths: usable inside a loss
    assert torch.equal(weight.grad, torch.ones_like(weight))


def test_merge_fc3_rejects_bn_that_does_not_tile_the_rows():
    with pytest.raises(ValueError, match="multiple"):
        merge_fc3(torch.zeros(10, 3), None, nn.BatchNorm2d(4), [], 1, 1)
    with pytest.raises(TypeError):
        merge_fc3(torch.zeros(4, 3), None, nn.LayerNorm(4), [], 1, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_conv_to_fc_on_cuda_matches_cpu_and_identity():
    gen = torch.Generator().manual_seed(10)
    kernel = torch.randn(8, 4, 5, 3, generator=gen)
    bias = torch.randn(8, generator=gen)
    cpu_w, cpu_b = conv_to_fc(kernel, bias, (6, 7), 2)
    cuda_w, cuda_b = conv_to_fc(kernel.cuda(), bias.cuda(), (6, 7), 2)
    ident_w, _ = conv_to_fc_identity(kernel.cuda(), bias.cuda(), (6, 7), 2)  # TF32 must not leak in
    assert cuda_w.is_cuda and cuda_w.is_contiguous()
    assert torch.equal(cuda_w.cpu(), cpu_w) and torch.equal(cuda_b.cpu(), cpu_b)
    torch.testing.assert_close(ident_w.cpu(), cpu_w, rtol=1e-6, atol=0)
