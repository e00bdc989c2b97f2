"""RepMLPBlock: equivalence of the re-parameterized block, the paper's formulation, validation, round trip."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import nn

from equivalence import randomize, rel_err
from repmlp import RepMLPBlock, reparameterize_model

FAST = settings(max_examples=30, deadline=None)


def paper_forward(block: RepMLPBlock, x: torch.Tensor) -> torch.Tensor:
    """The paper's formulation computed from ``block``'s parameters, written independently of it.

    NCHW partition map by one permute, Global Perceptron broadcast-added, FC3 as a grouped 1x1 conv
    (gMMUL) then BN, every Local Perceptron branch a grouped conv + BN; un-partition and crop.
    BN modules are called as they are (train or eval mode).
    """
    n, c = x.shape[:2]
    h, w = block.partition
    hp, wp = block.parts
    g, o = block.groups, block.out_channels
    x = F.pad(x, (0, block.padding[1], 0, block.padding[0]))
    parts = x.reshape(n, c, hp, h, wp, w).permute(0, 2, 4, 1, 3, 5).reshape(-1, c, h, w)
    gp = block.global_perceptron
    if gp is not None:
        v = F.avg_pool2d(x, (h, w))
        if gp.bn is not None:
            v = gp.bn(v)
        v = gp.fc2(F.relu(gp.fc1(v.flatten(1))))
        parts = parts + v.reshape(n, c, hp, wp).permute(0, 2, 3, 1).reshape(-1, c, 1, 1)
    b = parts.shape[0]
    pp = block.partition_perceptron
    weight = pp.fc3.weight
    fc = F.conv2d(parts.reshape(b, -1, 1, 1), weight.reshape(*weight.shape, 1, 1), pp.fc3.bias, groups=g)
    fc = fc.reshape(b, -1)
    if pp.bn is not None:
        fc = pp.bn(fc)
    out = fc.reshape(b, o, h, w)
    if block.local_perceptron is not None:
        for branch in block.local_perceptron.branches:
            kh, kw = branch.conv.kernel_size
            y = F.conv2d(parts, branch.conv.weight, branch.conv.bias, padding=(kh // 2, kw // 2), groups=g)
            out = out + (y if branch.bn is None else branch.bn(y))
    out = out.reshape(n, hp, wp, o, h, w).permute(0, 3, 1, 4, 2, 5).reshape(n, o, hp * h, wp * w)
    return out[:, :, : block.resolution[0], : block.resolution[1]]


@st.composite
def block_configs(draw):
    g = draw(st.integers(1, 3))
    cin, cout = g * draw(st.integers(1, 3)), g * draw(st.integers(1, 3))
    h, w = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    res = (draw(st.integers(1, 3 * h)), draw(st.integers(1, 3 * w)))  # often not divisible: padding
    odd = st.sampled_from([1, 3, 5])
    sizes = []
    for _ in range(draw(st.integers(0, 3))):  # 0: no Local Perceptron
        kh = draw(odd.filter(lambda k: k <= h))
        kw = draw(odd.filter(lambda k: k <= w))
        sizes.append(kh if kh == kw and draw(st.booleans()) else (kh, kw))
    parts = -(-res[0] // h) * -(-res[1] // w)
    reduction = draw(st.integers(1, min(3, cin * parts)))
    kwargs = dict(
        groups=g,
        kernel_sizes=tuple(sizes),
        global_reduction=reduction,
        global_perceptron=draw(st.booleans()),
    )
    return (cin, cout, res, (h, w)), kwargs, draw(st.integers(1, 3)), draw(st.integers(0, 2**31 - 1))


def _assert_inference_form(block: RepMLPBlock) -> None:
    assert block.deploy
    kinds = {type(m) for m in block.modules()}
    assert not any(issubclass(k, (nn.modules.batchnorm._BatchNorm, nn.Conv2d)) for k in kinds), kinds
    assert block.local_perceptron is None and block.partition_perceptron.bn is None
    assert block.partition_perceptron.fc3.bias is not None
    for p in block.parameters():
        assert p.is_contiguous()


@FAST
@given(
    cfg=block_configs(),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    use_function=st.booleans(),
)
def test_reparameterized_block_is_equivalent(cfg, dtype, use_function):
    args, kwargs, batch, seed = cfg
    torch.manual_seed(seed)
    block = randomize(RepMLPBlock(*args, **kwargs), seed).to(dtype).eval()
    x = torch.randn(batch, args[0], *args[2], dtype=dtype)
    with torch.no_grad():
        ref = block(x)
        assert ref.shape == (batch, args[1], *args[2])
        assert rel_err(paper_forward(block, x), ref) < (1e-10 if dtype == torch.float64 else 1e-5)
        if use_function:
            deployed = reparameterize_model(block)
            assert not block.deploy  # not in place by default
        else:
            deployed = copy.deepcopy(block)
            deployed.reparameterize()
        _assert_inference_form(deployed)
        out = deployed(x)
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel_err(out, ref) < (1e-10 if dtype == torch.float64 else 1e-5)

    # A block built with deploy=True has exactly the converted block's state-dict keys and shapes.
    fresh = RepMLPBlock(*args, **kwargs, deploy=True).to(dtype).eval()  # eval: the same FC3 kernel
    fresh.load_state_dict(deployed.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(x), out)


@settings(max_examples=10, deadline=None)
@given(cfg=block_configs())
def test_training_mode_matches_paper_formulation(cfg):
    # Batch statistics in training mode: our layouts (group rows, channels_last) change nothing.
    args, kwargs, batch, seed = cfg
    torch.manual_seed(seed)
    block = randomize(RepMLPBlock(*args, **kwargs), seed).double().train()
    batch = max(batch, 2)  # BN needs more than one value per channel in training mode
    x = torch.randn(batch, args[0], *args[2], dtype=torch.float64)
    ref_block = copy.deepcopy(block)
    out = block(x)
    ref = paper_forward(ref_block, x)
    assert rel_err(out, ref) < 1e-10
    # Running statistics moved identically.
    for (name, a), (_, b) in zip(block.named_buffers(), ref_block.named_buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_gradients_reach_every_parameter():
    torch.manual_seed(0)
    block = RepMLPBlock(4, 6, (9, 10), (4, 5), groups=2, kernel_sizes=(1, (3, 5)))
    x = torch.randn(2, 4, 9, 10, requires_grad=True)
    block(x).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for name, p in block.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_global_perceptron_presence_and_reduction():
    assert RepMLPBlock(4, 4, 8, 8).global_perceptron is None  # one partition
    assert RepMLPBlock(4, 4, 6, 8, kernel_sizes=(1, 3)).global_perceptron is None  # padded to one
    assert RepMLPBlock(4, 4, 16, 8, global_perceptron=False).global_perceptron is None
    gp = RepMLPBlock(4, 4, 16, 8, global_reduction=4).global_perceptron
    assert gp is not None and gp.fc1.in_features == 16 and gp.fc1.out_features == 4
    assert gp.fc2.out_features == 16


def test_empty_kernel_sizes_has_no_local_perceptron():
    block = RepMLPBlock(4, 4, 8, 4, kernel_sizes=())
    assert block.local_perceptron is None
    assert block(torch.randn(1, 4, 8, 8)).shape == (1, 4, 8, 8)


@pytest.mark.parametrize(
    ("args", "kwargs", "name"),
    [
        ((4, 4, 8, 4), {"kernel_sizes": (5,)}, "kernel_sizes"),  # larger than the partition
        ((4, 4, 8, (4, 6)), {"kernel_sizes": ((3, 7),)}, "kernel_sizes"),
        ((4, 4, 8, 4), {"kernel_sizes": (2,)}, "kernel_sizes"),  # even
        ((4, 4, 8, 4), {"kernel_sizes": ((3, 2),)}, "kernel_sizes"),
        ((4, 4, 8, 4), {"kernel_sizes": (0,)}, "kernel_sizes"),
        ((6, 4, 8, 4), {"groups": 4}, "groups"),  # in_channels not divisible
        ((4, 6, 8, 4), {"groups": 4}, "groups"),  # out_channels not divisible
        ((4, 4, 8, 4), {"groups": 0}, "groups"),
        ((0, 4, 8, 4), {}, "in_channels"),
        ((4, 0, 8, 4), {}, "out_channels"),
        ((4, 4, 0, 4), {}, "resolution"),
        ((4, 4, (8, 0), 4), {}, "resolution"),
        ((4, 4, 8, 0), {}, "partition"),
        ((4, 4, 8, (4, 0)), {}, "partition"),
        ((4, 4, 8, (1, 2, 3)), {}, "partition"),
        ((1, 1, 4, 2), {"kernel_sizes": (1,), "global_reduction": 8}, "global_reduction"),
        ((1, 1, 4, 2), {"kernel_sizes": (1,), "global_reduction": 0}, "global_reduction"),
        ((4, 4, 8, 4), {"kernel_sizes": (3,), "global_reduction": 2.5}, "global_reduction"),
        ((4, 4, 8, 4), {"kernel_sizes": 3}, "kernel_sizes"),  # an int, not a sequence
        ((4, 4, 8, 4), {"groups": True}, "groups"),
    ],
)
def test_invalid_configurations_raise_value_error_naming_the_argument(args, kwargs, name):
    with pytest.raises(ValueError, match=name):
        RepMLPBlock(*args, **kwargs)


@pytest.mark.parametrize("deploy", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 8, 9), (2, 3, 8, 8), (4, 8, 8), (2, 4, 8, 8, 1)])
def test_wrong_input_shape_raises_with_expected_and_received(deploy, shape):
    block = RepMLPBlock(4, 4, 8, 4, kernel_sizes=(1, 3), deploy=deploy)
    with pytest.raises(ValueError) as info:
        block(torch.randn(*shape))
    msg = str(info.value)
    assert "(N, 4, 8, 8)" in msg and str(tuple(shape)) in msg


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_conversion(dtype):
    torch.manual_seed(0)
    block = randomize(RepMLPBlock(4, 4, (10, 12), (5, 6), groups=2, kernel_sizes=(1, 3, (5, 3))), 0).eval()
    block = block.to(dtype)
    # The exact merge of the same (already rounded) half-precision parameters, in float64.
    reference = reparameterize_model(copy.deepcopy(block).double())
    half = reparameterize_model(block)
    _assert_inference_form(half)
    for (name, p), (_, r) in zip(half.named_parameters(), reference.named_parameters(), strict=True):
        assert p.dtype == dtype and p.is_contiguous(), name
        # Merged in float32 and rounded once: within half an ulp of the exact value (plus float32
        # round-off), which a merge summed in half precision does not guarantee.
        ulp = torch.finfo(dtype).eps
        torch.testing.assert_close(p.double(), r, rtol=ulp / 2 * 1.01, atol=1e-6, msg=name)
    if dtype == torch.bfloat16:
        x = torch.randn(2, 4, 10, 12)
        with torch.no_grad():
            out = half(x.to(dtype))
            ref = reference(x.double())
        assert out.dtype == dtype and out.is_contiguous() and out.shape == ref.shape
        assert rel_err(out.double(), ref) < 0.05


def test_round_trip_train_convert_save_load(tmp_path):
    torch.manual_seed(0)
    args = (6, 4, (11, 13), (4, 5))
    kwargs = dict(groups=2, kernel_sizes=(1, 3, (3, 5)), global_reduction=2)
    block = RepMLPBlock(*args, **kwargs).train()
    stats_before = block.partition_perceptron.bn.running_mean.clone()
    opt = torch.optim.SGD(block.parameters(), lr=0.05, momentum=0.9)
    for _ in range(4):
        x = torch.randn(4, 6, 11, 13)
        loss = (block(x) - torch.randn(4, 4, 11, 13)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert not torch.equal(block.partition_perceptron.bn.running_mean, stats_before)  # BN stats moved

    block.eval()
    x = torch.randn(3, 6, 11, 13)
    with torch.no_grad():
        ref = block(x)
    deployed = reparameterize_model(block)
    path = tmp_path / "block.safetensors"
    save_file(deployed.state_dict(), str(path))

    loaded = RepMLPBlock(*args, **kwargs, deploy=True)
    loaded.load_state_dict(load_file(str(path)), strict=True)
    loaded.eval()
    with torch.no_grad():
        out = loaded(x)
        assert torch.equal(out, deployed(x))
    assert rel_err(out, ref) < 1e-5


def test_reparameterize_is_idempotent_and_keeps_device_dtype():
    block = RepMLPBlock(4, 4, 8, 4, kernel_sizes=(1, 3)).double().eval()
    block.reparameterize()
    state = {k: v.clone() for k, v in block.state_dict().items()}
    block.reparameterize()
    assert all(torch.equal(state[k], v) for k, v in block.state_dict().items())
    assert all(p.dtype == torch.float64 for p in block.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_reparameterized_block_on_cuda(dtype):
    torch.manual_seed(0)
    block = randomize(RepMLPBlock(8, 8, (14, 15), 7, groups=2, kernel_sizes=(1, 3, (5, 7))), 0).eval()
    x = torch.randn(2, 8, 14, 15)
    with torch.no_grad():
        ref = block.double()(x.double())  # exact reference on the CPU
        deployed = reparameterize_model(block.to("cuda", dtype))
        out = deployed(x.to("cuda", dtype))
    assert out.is_cuda and out.dtype == dtype
    assert all(p.is_cuda and p.dtype == dtype for p in deployed.parameters())
    tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    assert rel_err(out.double().cpu(), ref) < tol
