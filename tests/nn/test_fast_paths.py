"""The deployed models' fast paths compute what the plain PyTorch ops compute, in any memory format."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from repmlp import RepMLPBlock, create_model, list_models, reparameterize_model
from repmlp.models.blocks import ConvBNReLU
from repmlp.nn import ops
from repmlp.nn.layers import ConvBN, MaxPool2x2, prepare_fc3
from zoo import shallow


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 3),
    c=st.integers(1, 5),
    h=st.integers(2, 9),
    w=st.integers(2, 9),
    channels_last=st.booleans(),
)
def test_maxpool2x2_matches_max_pool2d(n: int, c: int, h: int, w: int, channels_last: bool) -> None:
    x = torch.randn(n, c, h, w, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    assert torch.equal(MaxPool2x2()(x), F.max_pool2d(x, 2))


@settings(max_examples=20, deadline=None)
@given(
    g=st.integers(1, 4), b=st.integers(1, 40), k=st.integers(1, 24), n=st.integers(1, 24), bias=st.booleans()
)
def test_fc3_forms_match_bmm(g: int, b: int, k: int, n: int, bias: bool) -> None:
    torch.manual_seed(0)
    rows, weight = torch.randn(g, b, k), torch.randn(g * n, k)
    b_ = torch.randn(g * n) if bias else None
    expected = ops.groupwise_fc_bmm(rows, weight, b_)
    for form in (ops.groupwise_fc_onednn, ops.groupwise_fc_transposed):
        out = form(rows, weight, b_)
        assert out.is_contiguous()
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("faster", ops.FC3_FORMS)
def test_groupwise_fc_dispatch(monkeypatch: pytest.MonkeyPatch, faster: str) -> None:
    """Inference takes the form measured faster for the shape and row class; training and float64 always
    the batched matmul."""
    calls: list[str] = []
    for name, real in list(ops._FORM_FNS.items()):
        monkeypatch.setitem(ops._FORM_FNS, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    monkeypatch.setattr(ops, "groupwise_fc_bmm", ops._FORM_FNS["bmm"])  # what training calls
    picks: list[tuple] = []
    monkeypatch.setattr(ops, "fc3_form", lambda *a: picks.append(a) or faster)
    rows, weight = torch.randn(2, 32, 8), torch.randn(6, 8)
    with torch.no_grad():
        ops.groupwise_fc(rows, weight, None)
    ops.groupwise_fc(rows, weight.requires_grad_(), None, training=False).sum().backward()
    assert calls == [faster] * 2 and picks == [(2, (6, 8), False, 32)] * 2
    calls.clear()
    ops.groupwise_fc(rows, weight, None).sum().backward()  # autograd records it: training
    with torch.no_grad():
        ops.groupwise_fc(rows, weight, None, training=True)
        ops.groupwise_fc(rows.double(), weight.double(), None)
    assert calls == ["bmm"] * 3 and len(picks) == 2


def test_fc3_row_classes() -> None:
    """Row counts are timed as powers of two up to 512; a symbolic count (a dynamic export) is the top class."""
    assert [ops._rows_class(r) for r in (0, 1, 3, 4, 5, 300, 512, 4096)] == [1, 1, 4, 4, 8, 512, 512, 512]
    assert ops._rows_class(torch.tensor(6)) == 8
    shape_env = torch.fx.experimental.symbolic_shapes.ShapeEnv()
    symbolic = shape_env.create_unbacked_symint()
    assert ops._rows_class(symbolic) == 512


@pytest.mark.parametrize("backend", ops.FC3_FORMS)
def test_fc3_backend_can_be_pinned(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """``set_fc3_backend``/``REPMLP_FC3`` pin the form (no timing); a bad name is a ValueError."""
    monkeypatch.setattr(ops, "_fastest_form", lambda *a: pytest.fail("timed a pinned backend"))
    rows, weight = torch.randn(2, 32, 8), torch.randn(6, 8)
    form = getattr(ops, f"groupwise_fc_{backend}")
    before = ops.get_fc3_backend()
    with torch.no_grad(), ops.fc3_backend(backend):
        assert ops.get_fc3_backend() == backend
        assert torch.equal(ops.groupwise_fc(rows, weight, None), form(rows, weight, None))
    assert ops.get_fc3_backend() == before
    with pytest.raises(ValueError, match="expected one of auto, bmm, onednn, transposed"):
        ops.set_fc3_backend("mkl")
    monkeypatch.setenv("REPMLP_FC3", backend.upper())
    assert ops._backend_from_env() == backend
    monkeypatch.setenv("REPMLP_FC3", "fast")
    with pytest.raises(ValueError, match="REPMLP_FC3='fast'"):
        ops._backend_from_env()


def test_compiled_inference_keeps_the_picked_fc3() -> None:
    """Under torch.compile FC3 is one opaque op (the eager choice, made when the graph runs); training
    keeps the standard batched matmul and torch.export the eager choice as standard ops."""
    torch._dynamo.reset()
    block = RepMLPBlock(8, 8, 8, 4, groups=2, kernel_sizes=(1,)).eval()
    block.reparameterize()
    x = torch.randn(8, 8, 8, 8)

    def fc3_ops(fn) -> set[str]:
        graphs = torch._dynamo.explain(fn)(x).graphs
        return {str(n.target) for g in graphs for n in g.graph.nodes if "groupwise_fc" in str(n.target)}

    with torch.no_grad():
        assert fc3_ops(block) == {"repmlp.groupwise_fc_picked"}
        torch.testing.assert_close(torch.compile(block, backend="eager")(x), block(x))
    assert fc3_ops(block) == set()  # autograd recording: plain bmm
    exported = torch.export.export(block, (x,))
    assert "groupwise_fc_picked" not in str(exported.graph)


def test_fc3_choice_is_made_once_per_kernel_shape_and_row_class_outside_the_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Timed once per kernel shape and row class (not per batch), in another thread: a dispatch mode over
    a forward that times sees only that forward's ops, and the caller's random stream is untouched."""
    monkeypatch.setattr(ops, "_FC3_CHOICE", {})
    rows, weight = torch.randn(2, 64, 16), torch.randn(32, 16)
    state = torch.get_rng_state()
    with torch.no_grad(), FlopCounterMode(display=False) as first:
        out = ops.groupwise_fc(rows, weight, None)
    with torch.no_grad(), FlopCounterMode(display=False) as second:
        ops.groupwise_fc(rows[:, :8], weight, None)
    with torch.no_grad():
        ops.groupwise_fc(rows[:, :7], weight, None)  # the same class as 8 rows: no new timing
    assert torch.equal(torch.get_rng_state(), state)
    key = (2, 16, 16, False, torch.get_num_threads())
    assert list(ops._FC3_CHOICE) == [(*key, 64), (*key, 8)]
    assert set(ops._FC3_CHOICE.values()) <= set(ops.FC3_FORMS)
    assert first.get_total_flops() == 2 * 2 * 64 * 16 * 16 == 8 * second.get_total_flops()
    torch.testing.assert_close(out, ops.groupwise_fc_bmm(rows, weight, None))


def test_prepare_fc3_makes_the_choice_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """After ``prepare_fc3`` no forward times anything, at any batch; float64 and training layers are not
    timed; ``rows`` prepares only those row counts."""
    monkeypatch.setattr(ops, "_FC3_CHOICE", {})
    model = reparameterize_model(create_model("repmlp_fmnist").eval())
    assert prepare_fc3(model, rows=[8]) == 6 and len(ops._FC3_CHOICE) == 3  # 2 RepMLPs a stage, 3 shapes
    assert prepare_fc3(model) == 6 and len(ops._FC3_CHOICE) == 3 * len(ops.FC3_ROW_CLASSES)
    monkeypatch.setattr(ops, "_fastest_form", lambda *a: pytest.fail("timed inside a forward"))
    with torch.no_grad():
        model(torch.randn(3, 1, 28, 28))
        model(torch.randn(300, 1, 28, 28))
    monkeypatch.setattr(ops, "_FC3_CHOICE", {})
    assert prepare_fc3(model.double()) == 6 and not ops._FC3_CHOICE


@pytest.mark.parametrize("name", ["repmlp_cifar", "repmlpnet_t224"])
def test_deployed_first_forward_counts_and_traced_forms_are_bitwise(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A fresh deployed model's first forward counts the MACs of its second (FC3 timed, "auto");
    torch.fx, torch.export and torch.jit.trace forms compute bitwise what it computes eagerly, with and
    without autograd (oneDNN FC3 pinned, the form a tracer could otherwise replace)."""
    monkeypatch.setattr(ops, "_FC3_CHOICE", {})
    width = {
        "repmlp_cifar": dict(widths=(8, 16, 32)),
        "repmlpnet_t224": dict(channels=(16, 32, 64, 128), depths=(1, 1, 1, 1), sharesets=(1, 4, 16, 32)),
    }
    model = reparameterize_model(create_model(name, **width[name]).eval())
    x = torch.randn(2, *model.pretrained_cfg["input_size"])
    with torch.no_grad(), FlopCounterMode(display=False) as first:
        model(x)
    with torch.no_grad(), FlopCounterMode(display=False) as second:
        model(x)
    assert first.get_total_flops() == second.get_total_flops() > 0
    assert ops._FC3_CHOICE  # the choice was made, by the first forward, unseen
    with ops.fc3_backend("onednn"):
        with torch.no_grad():
            ref = model(x)
        assert torch.equal(model(x), ref)  # autograd on: same form for an eval-mode model
        traced = torch.fx.symbolic_trace(model)
        exported = torch.export.export(model, (x,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scripted = torch.jit.trace(model, (x,), check_trace=False)
        with torch.no_grad():
            for form in (traced, exported.module(), scripted):
                assert torch.equal(form(x), ref)


@pytest.mark.parametrize("groups", [1, 2])
def test_deployed_block_keeps_channels_last(groups: int) -> None:
    torch.manual_seed(0)
    block = RepMLPBlock(4, 4, 6, 3, groups=groups, kernel_sizes=(1, 3)).double().eval()
    block.reparameterize()
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    ref = block(x)
    out = block(x.contiguous(memory_format=torch.channels_last))
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert block(x).is_contiguous()


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 3), c=st.integers(1, 5), hp=st.integers(1, 3), wp=st.integers(1, 3), h=st.integers(1, 4)
)
def test_unpartition_channels_last_writes_the_same_values(n: int, c: int, hp: int, wp: int, h: int) -> None:
    x = torch.randn(n, c, hp * h, wp * (h + 1), dtype=torch.float64)
    parts = ops.partition(x, h, h + 1)
    out = ops.unpartition(parts, n, hp, wp, channels_last=True)
    assert torch.equal(out, x) and torch.equal(ops.unpartition(parts, n, hp, wp), x)
    assert out.permute(0, 2, 3, 1).is_contiguous()  # channels_last memory, one partition included


@pytest.mark.parametrize("bias", [False, True])
def test_pointwise_conv_as_linear_matches_conv(bias: bool) -> None:
    x = torch.randn(3, 1, 5, 6, dtype=torch.float64)
    weight = torch.randn(7, 1, 1, 1, dtype=torch.float64)
    b = torch.randn(7, dtype=torch.float64) if bias else None
    out = ops.pointwise_conv_as_linear(x, weight, b)
    torch.testing.assert_close(out, F.conv2d(x, weight, b), rtol=1e-13, atol=1e-13)
    assert ops.is_channels_last(out)


@settings(max_examples=12, deadline=None)
@given(patch=st.integers(1, 4), cells=st.integers(1, 3), deploy=st.booleans())
def test_one_channel_patch_stem_is_the_strided_conv(patch: int, cells: int, deploy: bool) -> None:
    """The one-channel stem of ``patch_size`` p (an FC on each p x p patch), run as a matmul over the
    patches' pixels, computes the p x p conv of stride p (+ BN + ReLU), values and gradients, and writes
    channels_last; the deployed (BN-fused) stem too."""
    torch.manual_seed(patch)
    stem = ConvBNReLU(1, 5, patch, patch, 0, deploy=deploy).double().train()
    x = torch.randn(3, 1, patch * cells, patch * (cells + 1), dtype=torch.float64, requires_grad=True)
    out = stem(x)
    ref = F.conv2d(x, stem.conv.weight, stem.conv.bias, stride=patch)
    if stem.bn is not None:
        ref = stem.bn(ref)
    ref = F.relu(ref)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert ops.is_channels_last(out) or out.shape[2] * out.shape[3] == 1
    grad = torch.randn_like(out)
    params = [x, *stem.parameters()]
    for a, e in zip(
        torch.autograd.grad(out, params, grad), torch.autograd.grad(ref, params, grad), strict=True
    ):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("patch", "size", "widths"), [(0, 28, (4, 8)), (2, 28, (4, 8, 8)), (3, 28, (4,))])
def test_pure_mlp_rejects_a_patch_size_that_does_not_fit(patch: int, size: int, widths: tuple) -> None:
    with pytest.raises(ValueError, match="patch_size"):
        create_model("repmlp_fmnist_patch2", patch_size=patch, img_size=size, widths=widths)


def _step_grads(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    return out, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["repmlp_fmnist", "repmlp_cifar_fc3_conv9"])
def test_training_step_stays_channels_last_and_equal(name: str) -> None:
    """A channels_last model trains channels_last from stem to head (no layer hands the next one NCHW),
    with the outputs and gradients of the same model run in NCHW."""
    torch.manual_seed(0)
    kw = dict(widths=(4, 8, 8)) if name != "repmlp_fmnist" else {}
    model = create_model(name, in_chans=1, **kw).double().train()
    size = 28 if name == "repmlp_fmnist" else 32
    x = torch.randn(4, 1, size, size, dtype=torch.float64)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref, ref_grads = _step_grads(model, x)
    model.load_state_dict(state)
    model.to(memory_format=torch.channels_last)
    nchw_outputs: list[str] = []
    for path, module in model.named_modules():
        if path.count(".") <= 2 and path:
            module.register_forward_hook(
                lambda m, i, o, path=path: (
                    nchw_outputs.append(path)
                    if o.dim() == 4
                    and o.shape[1] > 1
                    and o.shape[2] * o.shape[3] > 1
                    and not ops.is_channels_last(o)
                    else None
                )
            )
    out, grads = _step_grads(model, x.contiguous(memory_format=torch.channels_last))
    assert nchw_outputs == []
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-9, msg=k)


@settings(max_examples=15, deadline=None)
@given(g=st.integers(1, 3), b=st.integers(1, 9), k=st.integers(1, 7), n=st.integers(1, 7), bias=st.booleans())
def test_training_fc3_gradients_equal_autograds(g: int, b: int, k: int, n: int, bias: bool) -> None:
    """A training layer's FC3 runs ops._GroupwiseFCTrain (the weight's gradient computed in its own layout,
    no transposition copy), with the outputs and gradients of autograd's batched matmul (float64)."""
    torch.manual_seed(0)
    rows = torch.randn(g, b, k, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(g * n, k, dtype=torch.float64, requires_grad=True)
    b_ = torch.randn(g * n, dtype=torch.float64, requires_grad=True) if bias else None
    inputs = [t for t in (rows, weight, b_) if t is not None]
    out = ops.groupwise_fc(rows, weight, b_, True)
    assert "GroupwiseFCTrain" in out.grad_fn.name()
    ref = ops.groupwise_fc_bmm(rows, weight, b_)
    grad_out = torch.randn_like(out)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    got = torch.autograd.grad(out, inputs, grad_out)
    want = torch.autograd.grad(ref, inputs, grad_out)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *t: ops.groupwise_fc(*t, True), (rows, weight, b_))


_FORMATS = (torch.contiguous_format, torch.channels_last)


class _BatchNormBackwardLayouts(TorchDispatchMode):
    """Records, for every BatchNorm backward, whether its gradient and its input share a memory format."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple[int, ...], bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.native_batch_norm_backward.default and args[0].dim() == 4:
            grad, x = args[0], args[1]
            same = any(
                grad.is_contiguous(memory_format=f) and x.is_contiguous(memory_format=f) for f in _FORMATS
            )
            self.calls.append((tuple(x.shape), same))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["repmlp_fmnist", "repmlp_cifar_fc3_conv9"])
def test_batchnorm_gradients_arrive_in_their_inputs_layout(name: str) -> None:
    """In a channels_last model's training step on a CPU every BatchNorm's gradient has its input's memory format:
    PyTorch's CPU BatchNorm backward is several times slower on mixed layouts. The Local Perceptron's
    convs keep the partition map's NCHW layout, which FC3's side of the block's sum gives the gradient."""
    torch.manual_seed(0)
    kw = dict(widths=(4, 8, 8)) if name != "repmlp_fmnist" else {}
    model = create_model(name, in_chans=1, **kw).train().to(memory_format=torch.channels_last)
    size = 28 if name == "repmlp_fmnist" else 32
    x = torch.randn(4, 1, size, size).contiguous(memory_format=torch.channels_last)
    with _BatchNormBackwardLayouts() as layouts:
        _step_grads(model, x)
    assert len(layouts.calls) >= 6
    assert [shape for shape, same in layouts.calls if not same] == []


class _ConvLayouts(TorchDispatchMode):
    """Records, for every convolution and its backward, whether its input is channels_last."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default):
            x = args[1] if func is torch.ops.aten.convolution_backward.default else args[0]
            self.calls.append((func.overloadpacket.__name__, ops.is_channels_last(x)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("per_group", "kernel", "channels_last"),
    [(4, 3, True), (6, 5, True), (2, 7, True), (8, 3, False), (16, 3, False), (4, 1, False)],
)
@pytest.mark.parametrize("weights_channels_last", [False, True])
def test_training_convs_without_a_direct_nchw_kernel_run_channels_last(
    per_group: int, kernel: int, channels_last: bool, weights_channels_last: bool
) -> None:
    """A training conv on a plain CPU input (the Local Perceptron's, on the partition map) runs channels_last,
    forward and backward, exactly where oneDNN has no direct NCHW kernel (groups' channels not a multiple
    of 8, kernel above 1x1), and hands back a plain output and a plain input gradient, with the values of
    the plain conv (float64) for either layout of the weights."""
    torch.manual_seed(0)
    c = 2 * per_group
    layer = ConvBN(c, c, kernel, groups=2, layout_choice=True).double().train()
    if weights_channels_last:
        layer.to(memory_format=torch.channels_last)
    x = torch.randn(6, c, 7, 7, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(6, c, 7, 7, dtype=torch.float64)
    with _ConvLayouts() as layouts:
        out = layer(x)
        got = torch.autograd.grad(out, [x, *layer.parameters()], grad_out)
    assert out.is_contiguous() and got[0].is_contiguous()
    assert {name for name, _ in layouts.calls} == {"convolution", "convolution_backward"}
    assert all(cl == channels_last for _, cl in layouts.calls), layouts.calls
    ref = F.batch_norm(
        F.conv2d(x, layer.conv.weight.contiguous(), padding=kernel // 2, groups=2),
        None,
        None,
        layer.bn.weight,
        layer.bn.bias,
        training=True,
        eps=layer.bn.eps,
    )
    want = torch.autograd.grad(ref, [x, *layer.parameters()], grad_out)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


# Small configurations of every family, so tracing them stays cheap.
_SMALL = {
    "repmlp_cifar": dict(widths=(8, 16, 32)),
    "repmlp_res50": dict(img_size=64, partition=2, kernel_sizes=(1,), num_classes=4, layers=(2, 2, 2, 2)),
    "repmlp_res50_light": dict(
        img_size=64, partition=2, kernel_sizes=(1,), num_classes=4, layers=(2, 2, 2, 2)
    ),
}


@pytest.mark.parametrize("name", ["repmlp_fmnist", "repmlp_cifar", "repmlp_res50", "repmlp_res50_light"])
@pytest.mark.parametrize("form", ["train", "deploy"])
def test_compiles_as_one_graph(name: str, form: str) -> None:
    """``torch._dynamo.explain`` finds no graph break in either form."""
    torch._dynamo.reset()
    model = create_model(name, **_SMALL.get(name, {})).eval()
    if form == "deploy":
        model = reparameterize_model(model)
    cfg = model.pretrained_cfg["input_size"] if hasattr(model, "pretrained_cfg") else None
    size = (3, 64, 64) if name.startswith("repmlp_res50") else tuple(cfg)
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(torch.randn(2, *size))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("name", list_models())
@pytest.mark.parametrize("deploy", [False, True], ids=["train", "deploy"])
def test_every_registered_model_compiles_as_one_graph(name: str, deploy: bool) -> None:
    """No graph break anywhere in the zoo: dynamo traces each model whole on the meta device (shapes
    only, so the paper's resolutions stay cheap), built shallow (every block kind, fewer blocks); the
    CPU branches are traced by the test above."""
    torch._dynamo.reset()
    with torch.device("meta"):
        model = create_model(name, deploy=deploy, **shallow(name)).eval()
    x = torch.randn(2, *model.pretrained_cfg["input_size"], device="meta")
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_all_registered_models_listed() -> None:
    assert {"repmlp_fmnist", "repmlp_cifar", "repmlp_res50", "repmlp_res50_light"} <= set(list_models())
