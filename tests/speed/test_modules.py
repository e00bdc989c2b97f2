"""The fast modules one by one (:mod:`repmlp.speed`): each computes its plain module's function, in the layouts
the passes promise, and FC3's kernel is chosen at the pass, never inside a forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from repmlp import GroupwiseLinear, RepMLPBlock, create_model, list_models, reparameterize_model
from repmlp.nn.layers import ConvBN
from repmlp.nn.reparam import conv_to_fc
from repmlp.speed import fast_inference, fast_training
from repmlp.speed import fc3 as fc3_kernels
from repmlp.speed.copies import is_channels_last
from repmlp.speed.dense import dense_conv_index
from repmlp.speed.modules import MaxPool2x2, PatchwiseConv2d
from zoo import shallow

pytestmark = pytest.mark.usefixtures("one_thread")


@settings(max_examples=30, deadline=None)
@given(
    g=st.integers(1, 3), og=st.integers(1, 3), cg=st.integers(1, 3), h=st.integers(1, 6), w=st.integers(1, 6),
    kh=st.sampled_from([1, 3, 5, 7, 9, 11]), kw=st.sampled_from([1, 3, 5, 7, 9, 11]),
)  # fmt: skip
def test_dense_index_places_every_kernel_tap_as_the_conv_does(g, og, cg, h, w, kh, kw) -> None:
    """The gathered FC computes the same-padded conv on the map, kernels larger than the map included; where
    the kernel fits, it is :func:`conv_to_fc`'s kernel exactly."""
    torch.manual_seed(0)
    out_ch, s = g * og, h * w
    kernel = torch.randn(out_ch, cg, kh, kw, dtype=torch.float64)
    dense = torch.cat([kernel.new_zeros(1), kernel.flatten()])[dense_conv_index(out_ch, cg, kh, kw, h, w)]
    x = torch.randn(3, g * cg, h, w, dtype=torch.float64)
    rows = x.reshape(3, g, cg * s).transpose(0, 1)
    got = (
        torch.bmm(rows, dense.view(g, og * s, cg * s).transpose(1, 2))
        .transpose(0, 1)
        .reshape(3, out_ch, h, w)
    )
    want = F.conv2d(x, kernel, padding=(kh // 2, kw // 2), groups=g)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if kh <= h and kw <= w:
        assert torch.equal(dense, conv_to_fc(kernel, None, (h, w), g)[0])


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 3), c=st.integers(1, 5), h=st.integers(2, 9), w=st.integers(2, 9), cl=st.booleans())
def test_maxpool2x2_matches_max_pool2d(n: int, c: int, h: int, w: int, cl: bool) -> None:
    x = torch.randn(n, c, h, w, dtype=torch.float64)
    x = x.contiguous(memory_format=torch.channels_last) if cl else x
    assert torch.equal(MaxPool2x2(2)(x), F.max_pool2d(x, 2))


@settings(max_examples=20, deadline=None)
@given(
    g=st.integers(1, 4), b=st.integers(1, 40), k=st.integers(1, 24), n=st.integers(1, 24), bias=st.booleans()
)
def test_fc3_kernels_match_the_batched_matmul(g: int, b: int, k: int, n: int, bias: bool) -> None:
    torch.manual_seed(0)
    rows, weight = torch.randn(g, b, k), torch.randn(g * n, k)
    b_ = torch.randn(g * n) if bias else None
    layer = GroupwiseLinear(g * k, g * n, g, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias:
            layer.bias.copy_(b_)
        expected = layer(rows)
    assert torch.equal(fc3_kernels.fc3_bmm(rows, weight, b_), expected)
    for kernel in ("onednn", "transposed"):
        out = fc3_kernels.KERNELS[kernel](rows, weight, b_)
        assert out.is_contiguous()
        torch.testing.assert_close(out, expected)
    layer.double().eval()
    with torch.no_grad():
        want = layer(rows.double())
        layer.__class__ = fc3_kernels.PerGroupLinear  # the ONNX form (repmlp.speed.onnx_form), in float64
        got = layer(rows.double())
    assert (got - want).abs().max() <= 1e-10 * want.abs().max()


def test_fc3_kernels_are_timed_at_the_pass_once_per_shape_and_row_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The inference pass times each kernel shape and row class of the batches it is told once (kept for the
    process); no forward times anything; a class not timed, training and float64 run the batched matmul."""
    monkeypatch.setattr(fc3_kernels, "_CHOICES", {})
    timed: list[tuple] = []
    monkeypatch.setattr(fc3_kernels, "_time_kernels", lambda *a: timed.append(a) or "transposed")
    model = reparameterize_model(create_model("repmlp_fmnist").eval())
    fast_inference(model, batch_sizes=(8,))
    assert len(timed) == 3  # two RepMLPs a stage share a shape: three stages, three shapes
    fast_inference(reparameterize_model(create_model("repmlp_fmnist").eval()), batch_sizes=(8,))
    assert len(timed) == 3
    monkeypatch.setattr(fc3_kernels, "_time_kernels", lambda *a: pytest.fail("timed inside a forward"))
    calls: list[str] = []
    for name, fn in list(fc3_kernels.KERNELS.items()):
        monkeypatch.setitem(fc3_kernels.KERNELS, name, lambda *a, _n=name, _f=fn: calls.append(_n) or _f(*a))
    with torch.no_grad():
        model(torch.randn(8, 1, 28, 28))  # timed class: the transposed kernel in every block
        assert calls == ["transposed"] * 6
        model(torch.randn(300, 1, 28, 28))  # not timed: the batched matmul
        assert calls == ["transposed"] * 6 + ["bmm"] * 6
    model.train()(torch.randn(8, 1, 28, 28))  # training: the plain layer's own matmul
    assert calls == ["transposed"] * 6 + ["bmm"] * 6
    double = fast_inference(reparameterize_model(create_model("repmlp_fmnist").double().eval()))
    assert not any(isinstance(m, fc3_kernels.TunedGroupwiseLinear) for m in double.modules())


def test_compiled_inference_keeps_the_picked_fc3(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile (no autograd) a tuned FC3 is one opaque op running the kernel picked at the pass."""
    torch._dynamo.reset()
    monkeypatch.setattr(fc3_kernels, "_CHOICES", {})
    monkeypatch.setattr(fc3_kernels, "_time_kernels", lambda *a: "transposed")
    block = RepMLPBlock(8, 8, 8, 4, groups=2, kernel_sizes=(1,)).eval()
    block.reparameterize()
    x = torch.randn(8, 8, 8, 8)
    with torch.no_grad():
        ref = block(x)
        fast_inference(block, batch_sizes=(8,))
        graphs = torch._dynamo.explain(block)(x).graphs
        assert "repmlp.fc3_in_kernel" in {str(n.target) for gm in graphs for n in gm.graph.nodes}
        torch.testing.assert_close(torch.compile(block, backend="eager")(x), ref)


@settings(max_examples=12, deadline=None)
@given(patch=st.integers(1, 4), cells=st.integers(1, 3), bias=st.booleans())
def test_a_patch_conv_as_a_matmul_is_the_strided_conv(patch: int, cells: int, bias: bool) -> None:
    """A one-channel conv whose kernel tiles its input, as a matmul over the patches' pixels: the conv's values
    and gradients, written channels_last."""
    torch.manual_seed(patch)
    conv = torch.nn.Conv2d(1, 5, patch, patch, bias=bias).double()
    fast = torch.nn.Conv2d(1, 5, patch, patch, bias=bias).double()
    fast.load_state_dict(conv.state_dict())
    assert PatchwiseConv2d.tiles(fast)
    fast.__class__ = PatchwiseConv2d
    x = torch.randn(3, 1, patch * cells, patch * (cells + 1), dtype=torch.float64, requires_grad=True)
    out, ref = fast(x), conv(x)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert is_channels_last(out) or out.shape[2] * out.shape[3] == 1
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *fast.parameters()], grad)
    want = torch.autograd.grad(ref, [x, *conv.parameters()], grad)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


class _Layouts(TorchDispatchMode):
    """Records, per BatchNorm backward, whether gradient and input share a layout; per conv (and its backward),
    whether its input is channels_last."""

    def __init__(self) -> None:
        super().__init__()
        self.bn: list[bool] = []
        self.conv: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.native_batch_norm_backward.default and args[0].dim() == 4:
            formats = (torch.contiguous_format, torch.channels_last)
            self.bn.append(any(args[0].is_contiguous(memory_format=f) and args[1].is_contiguous(memory_format=f)
                               for f in formats))  # fmt: skip
        if func in (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default):
            x = args[1] if func is torch.ops.aten.convolution_backward.default else args[0]
            self.conv.append((func.overloadpacket.__name__, is_channels_last(x)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["repmlp_fmnist", "repmlp_cifar_fc3_conv9"])
def test_a_channels_last_training_step_stays_channels_last(name: str) -> None:
    """With the training pass, a channels_last model trains channels_last from stem to head (no layer hands the
    next one NCHW), and every BatchNorm's gradient arrives in its input's layout (PyTorch's CPU BatchNorm
    backward is several times slower on mixed layouts)."""
    torch.manual_seed(0)
    kw = dict(widths=(4, 8, 8)) if name != "repmlp_fmnist" else {}
    model = fast_training(create_model(name, in_chans=1, **kw).train().to(memory_format=torch.channels_last))
    size = 28 if name == "repmlp_fmnist" else 32
    x = torch.randn(4, 1, size, size).contiguous(memory_format=torch.channels_last)
    nchw: list[str] = []
    for path, module in model.named_modules():
        if path.count(".") <= 2 and path:
            module.register_forward_hook(
                lambda m, i, o, path=path: (
                    nchw.append(path)
                    if o.dim() == 4
                    and o.shape[1] > 1
                    and o.shape[2] * o.shape[3] > 1
                    and not is_channels_last(o)
                    else None
                )
            )
    with _Layouts() as layouts:
        model(x).sum().backward()
    assert nchw == []
    assert len(layouts.bn) >= 6 and all(layouts.bn)


@pytest.mark.parametrize(
    ("per_group", "kernel", "channels_last"),
    [(4, 3, True), (6, 5, True), (2, 7, True), (8, 3, False), (16, 3, False), (4, 1, False)],
)
@pytest.mark.parametrize("weights_channels_last", [False, True])
def test_partition_map_convs_run_channels_last_only_without_a_direct_nchw_kernel(
    per_group: int, kernel: int, channels_last: bool, weights_channels_last: bool
) -> None:
    """A Local Perceptron conv under the training pass, on its plain partition map, runs channels_last forward
    and backward exactly where oneDNN has no direct NCHW kernel (a group's channels not a multiple of 8,
    kernel above 1x1), and hands back a plain output and input gradient with the plain conv's values."""
    torch.manual_seed(0)
    c = 2 * per_group
    block = (
        RepMLPBlock(c, c, 7, 7, groups=2, kernel_sizes=(kernel,), global_perceptron=False).double().train()
    )
    fast_training(block)
    layer = block.local_perceptron.branches[0]
    if weights_channels_last:
        layer.to(memory_format=torch.channels_last)
    x = torch.randn(6, c, 7, 7, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(6, c, 7, 7, dtype=torch.float64)
    with _Layouts() as layouts:
        out = layer(x)
        got = torch.autograd.grad(out, [x, *layer.parameters()], grad_out)
    assert out.is_contiguous() and got[0].is_contiguous()
    assert {name for name, _ in layouts.conv} == {"convolution", "convolution_backward"}
    assert all(cl == channels_last for _, cl in layouts.conv), layouts.conv
    plain = ConvBN(c, c, kernel, groups=2).double().train()
    plain.load_state_dict(layer.state_dict())
    ref = plain(x)
    want = torch.autograd.grad(ref, [x, *plain.parameters()], grad_out)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", list_models())
@pytest.mark.parametrize("deploy", [False, True], ids=["train", "deploy"])
def test_every_registered_model_compiles_as_one_graph(name: str, deploy: bool) -> None:
    """No graph break anywhere in the zoo, plain or under the training pass: dynamo traces each model whole on
    the meta device (shapes only), built shallow (every block kind, fewer blocks)."""
    torch._dynamo.reset()
    with torch.device("meta"):
        model = create_model(name, deploy=deploy, **shallow(name)).eval()
    x = torch.randn(2, *model.pretrained_cfg["input_size"], device="meta")
    for prepare in (lambda m: m, lambda m: fast_training(m, dense=True)):
        with torch.no_grad():
            explanation = torch._dynamo.explain(prepare(model))(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1
