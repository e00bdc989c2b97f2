"""RepMLPBlock: equivalence of the re-parameterized block, the paper's formulation, validation, round trip;
the blocks' memory formats (RepMLPBlock, PartitionConvBlock, RepMLPNetBlock) and their traces."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from equivalence import randomize, rel_err
from repmlp import RepMLPBlock, create_model, reparameterize_model
from repmlp.models.pure_mlp import PartitionConvBlock
from repmlp.models.repmlpnet import RepMLPNetBlock
from repmlp.nn.block import is_channels_last

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


# ------------------------------------------------------------------------------------- memory format
CL = torch.channels_last
# Each block kind: deploy -> the block, its input (C, H, W), and whether its training-time / deployed form
# computes a conv.
LAYOUT_BLOCKS: dict[str, tuple[Callable[[bool], nn.Module], tuple[int, int, int], tuple[bool, bool]]] = {
    "repmlp": (
        lambda d: RepMLPBlock(4, 6, (8, 9), (4, 3), groups=2, kernel_sizes=(1, 3), deploy=d), (4, 8, 9), (True, False)
    ),
    "repmlp-no-global": (
        lambda d: RepMLPBlock(4, 6, (8, 9), (4, 3), groups=2, kernel_sizes=(1, 3), global_perceptron=False, deploy=d),
        (4, 8, 9), (True, False),
    ),
    "repmlp-fc3-only": (lambda d: RepMLPBlock(4, 6, 8, 4, kernel_sizes=(), deploy=d), (4, 8, 8), (False, False)),
    "partition-conv": (
        lambda d: PartitionConvBlock(4, 6, 8, 4, kernel_size=3, groups=2, kernel_sizes=(1, 3), deploy=d),
        (4, 8, 8), (True, True),
    ),
    "partition-conv-no-global": (
        lambda d: PartitionConvBlock(4, 6, 8, 4, kernel_size=3, kernel_sizes=(1,), global_perceptron=False, deploy=d),
        (4, 8, 8), (True, True),
    ),
    "repmlpnet": (lambda d: RepMLPNetBlock(8, 8, 4, 2, deploy=d), (8, 8, 8), (True, True)),  # gate: 1x1 convs
}  # fmt: skip


def _same_values(a: torch.Tensor, b: torch.Tensor) -> None:
    """``a`` and ``b`` hold the same values to float64 round-off: a bare ``nn.Conv2d``, and a batched matmul
    over rows strided otherwise, may differ in the last bit between an NCHW and a channels_last input."""
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _assert_layout(out: torch.Tensor, channels_last: bool) -> None:
    """``out`` is dense in the memory format asked (a tensor of one channel or of 1x1 maps is dense in both)."""
    assert out.is_contiguous(memory_format=CL if channels_last else torch.contiguous_format), out.stride()


@pytest.mark.parametrize("training", [False, True], ids=["eval-mode", "train-mode"])
@pytest.mark.parametrize("deploy", [False, True], ids=["training-time", "deployed"])
@pytest.mark.parametrize("kind", list(LAYOUT_BLOCKS))
def test_a_block_writes_its_output_in_its_inputs_memory_format(
    kind: str, deploy: bool, training: bool
) -> None:
    """A RepMLP block, the pure MLP's partition-conv block and RepMLPNet's block, in either form and mode:
    a channels_last input gives a channels_last output, an NCHW one an NCHW output, the same values."""
    make, shape, _ = LAYOUT_BLOCKS[kind]
    torch.manual_seed(0)
    block = randomize(make(deploy), 0).double().train(training)
    x = torch.randn(3, *shape, dtype=torch.float64)
    nchw, cl = block(x), block(x.contiguous(memory_format=CL))
    _assert_layout(nchw, channels_last=False)
    _assert_layout(cl, channels_last=True)
    _same_values(cl, nchw)


@st.composite
def block_configs(draw: st.DrawFn) -> tuple[tuple, dict, int, bool]:
    """A RepMLPBlock's arguments of any geometry: partitions from 1x1 up, a resolution that may need padding
    (cropped back), one channel a group or more; a batch, and whether the block is built deployed."""
    g = draw(st.integers(1, 3))
    cin, cout = g * draw(st.integers(1, 3)), g * draw(st.integers(1, 3))
    h, w = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    res = (draw(st.integers(h, 3 * h)), draw(st.integers(w, 3 * w)))
    sizes = [
        (
            draw(st.sampled_from([k for k in (1, 3) if k <= h])),
            draw(st.sampled_from([k for k in (1, 3) if k <= w])),
        )
        for _ in range(draw(st.integers(0, 2)))
    ]
    kwargs = dict(groups=g, kernel_sizes=tuple(sizes), global_perceptron=draw(st.booleans()))
    return (cin, cout, res, (h, w)), kwargs, draw(st.integers(1, 3)), draw(st.booleans())


@settings(max_examples=25, deadline=None)
@given(cfg=block_configs(), training=st.booleans())
def test_any_repmlp_block_keeps_its_inputs_memory_format(
    cfg: tuple[tuple, dict, int, bool], training: bool
) -> None:
    """Over shapes, groups, kernels, with and without the Global Perceptron, either form and mode: the output in
    the input's memory format, the same values from either."""
    args, kwargs, batch, deploy = cfg
    torch.manual_seed(0)
    block = randomize(RepMLPBlock(*args, **kwargs, deploy=deploy), 0).double().train(training)
    batch = max(batch, 2) if training else batch  # BatchNorm1d trains on two rows or more
    x = torch.randn(batch, args[0], *args[2], dtype=torch.float64)
    x_cl = x.contiguous(memory_format=CL)
    nchw, cl = block(x), block(x_cl)
    _assert_layout(nchw, channels_last=False)
    _assert_layout(cl, channels_last=is_channels_last(x_cl))  # one channel or 1x1 maps: NCHW as well
    _same_values(cl, nchw)


@pytest.mark.parametrize("deploy", [False, True], ids=["training-time", "deployed"])
@pytest.mark.parametrize(
    ("resolution", "partition", "channels_last"),
    [
        ((7, 9), (4, 3), False),
        ((7, 9), (4, 3), True),
        ((4, 4), (4, 4), True),
        ((2, 4), (2, 1), False),
        ((2, 4), (2, 1), True),
        ((2, 2), (1, 1), False),
    ],
    ids=["padded-nchw", "padded-channels_last", "one-partition-channels_last", "partition-2x1-nchw",
         "partition-2x1-channels_last", "partition-1x1-nchw"],
)  # fmt: skip
def test_a_block_of_odd_geometry_writes_its_output_in_its_inputs_memory_format(
    resolution: tuple[int, int], partition: tuple[int, int], channels_last: bool, deploy: bool
) -> None:
    """A resolution padded to whole partitions (7x9 on 4x3, cropped back); one partition (as the last stage
    of ``repmlp_cifar``); partitions one position wide."""
    block = RepMLPBlock(4, 6, resolution, partition, kernel_sizes=(1,), deploy=deploy).double().eval()
    x = torch.randn(2, 4, *resolution, dtype=torch.float64)
    _assert_layout(block(x.contiguous(memory_format=CL) if channels_last else x), channels_last)


@pytest.mark.parametrize("deploy", [False, True], ids=["training-time", "deployed"])
def test_traces_of_a_channels_last_block_compute_the_block(deploy: bool) -> None:
    """``torch.fx.symbolic_trace`` and ``make_fx`` of a block on channels_last input, in training and evaluation
    mode, with and without autograd: the block's outputs (and input gradients) in its layout. The fx graph
    keeps the layout choice a run-time call (a leaf), so it serves NCHW inputs as the block does."""
    torch.manual_seed(0)
    block = randomize(RepMLPBlock(4, 6, (8, 9), (4, 3), groups=2, kernel_sizes=(1, 3)), 0).double()
    if deploy:
        block.eval().reparameterize()
    x = torch.randn(2, 4, 8, 9, dtype=torch.float64).contiguous(memory_format=CL)
    for training in (True, False):
        block.train(training)
        graph = torch.fx.symbolic_trace(block)
        _assert_layout(graph(x.contiguous()), channels_last=False)
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                runs = {"fx": graph, "make_fx": make_fx(block)(x)}
                for how, run in runs.items():
                    xs = [x.clone().requires_grad_(grad) for _ in range(2)]
                    got, want = run(xs[0]), block(xs[1])
                    _assert_layout(got, channels_last=True)
                    assert torch.equal(got, want), (how, training, grad)
                    if grad:
                        got.square().sum().backward()
                        want.square().sum().backward()
                        assert torch.equal(xs[0].grad, xs[1].grad), (how, training)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_a_scripted_channels_last_deployed_model_computes_the_model() -> None:
    """``torch.jit.script`` of a deployed model stored channels_last, on channels_last input: the model's
    outputs; a scripted deployed block keeps the layout."""
    torch.manual_seed(0)
    model = randomize(create_model("repmlp_cifar", width_multiplier=0.25), 0).double().eval()
    deployed = reparameterize_model(model).to(memory_format=CL)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64).contiguous(memory_format=CL)
    with torch.no_grad():
        torch.testing.assert_close(torch.jit.script(deployed)(x), deployed(x), rtol=1e-12, atol=1e-12)
        block = randomize(RepMLPBlock(4, 6, (8, 9), (4, 3), groups=2, kernel_sizes=(1, 3)), 0).double().eval()
        block.reparameterize()
        xb = torch.randn(2, 4, 8, 9, dtype=torch.float64).contiguous(memory_format=CL)
        out = torch.jit.script(block)(xb)
    _assert_layout(out, channels_last=True)
    assert torch.equal(out, block(xb))
