"""The model's forms, each a new module tree on the model's own parameters that leaves the model as it is:
the training form (:func:`repmlp.engine.forms.training_form`: on a CPU, narrow Local Perceptrons as one dense
FC), the ONNX export's form (:func:`repmlp.deploy.export.per_group_fc3`) and the predictor's serving copy
(:class:`repmlp.deploy.predict.Predictor`). Each computes the plain model's function (float64: outputs,
gradients, BatchNorm statistics), and the form and the plain model alike copy, pickle, trace and export.

The blocks' memory formats are tested with the blocks (tests/nn/test_block.py)."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.utils import prune

import repmlp
from equivalence import randomize
from repmlp.deploy.export import PerGroupLinear, per_group_fc3
from repmlp.deploy.predict import Predictor
from repmlp.engine.forms import DenseLocalPerceptron, dense_conv_index, training_form
from repmlp.nn.block import LocalPerceptron, RepMLPBlock, is_channels_last
from repmlp.nn.layers import GroupwiseLinear
from repmlp.nn.reparam import conv_to_fc

pytestmark = pytest.mark.usefixtures("one_thread")

CL = torch.channels_last
# repmlp_cifar at a quarter width: its first four RepMLP blocks have 2 and 4 channels a group (the dense
# form on a CPU), the last two 8 (the convs); those are the blocks' Local Perceptrons.
DENSE = [f"stages.{s}.{b}.0.local_perceptron" for s, b in ((0, 0), (0, 2), (1, 1), (1, 3))]
CONVS = [f"stages.2.{b}.0.local_perceptron" for b in (1, 3)]


def _narrow() -> nn.Module:
    """``repmlp_cifar`` at a quarter width in float64, with random BatchNorm statistics and affine parameters."""
    torch.manual_seed(0)
    return randomize(repmlp.create_model("repmlp_cifar", width_multiplier=0.25), 0).double()


def _input(batch: int = 2) -> Tensor:
    return torch.randn(batch, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _step(model: nn.Module, x: Tensor) -> tuple[Tensor, dict[str, Tensor | None]]:
    """``model``'s output on ``x`` and the gradients of a weighted sum of it: the input's (``"input"``) and every
    parameter's, by name."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    return out.detach(), {"input": x.grad, **{k: p.grad for k, p in model.named_parameters()}}


def _close(a: Tensor, b: Tensor, what: str, scale: float = 0.0, rel: float = 1e-10) -> None:
    """``a`` equals ``b`` to ``rel`` of ``b``'s largest entry (or of ``scale``, where larger: a gradient that is
    zero in exact arithmetic next to others that are not)."""
    scale = max(b.abs().max().item(), scale, 1e-300)
    assert (a - b).abs().max().item() < rel * scale, what


def _assert_same_steps(net: nn.Module, reference: nn.Module, x: Tensor) -> None:
    """``net`` and ``reference`` give the same output and gradients (input and every parameter) on ``x``."""
    out, grads = _step(net, x)
    ref, ref_grads = _step(reference, x)
    _close(out, ref, "output")
    assert grads.keys() == ref_grads.keys()
    assert all(g is not None for g in ref_grads.values()), [k for k, g in ref_grads.items() if g is None]
    scale = max(g.abs().max().item() for g in ref_grads.values() if g is not None)
    for k, g in ref_grads.items():
        assert g is not None and grads[k] is not None, k
        _close(grads[k], g, k, scale)


def _assert_same_state(model: nn.Module, reference: nn.Module) -> None:
    """The same state-dict keys, floating-point tensors to 1e-9 (SGD steps scale the gradients' round-off by the
    learning rate and momentum), counters equal."""
    state, ref = model.state_dict(), reference.state_dict()
    assert list(state) == list(ref)
    for k, v in ref.items():
        if v.is_floating_point():
            _close(state[k], v, k, rel=1e-9)
        else:
            assert torch.equal(state[k], v), k


# ------------------------------------------------------------------------------------- the dense FC
@settings(max_examples=30, deadline=None)
@given(
    g=st.integers(1, 3), og=st.integers(1, 3), cg=st.integers(1, 3), h=st.integers(1, 6), w=st.integers(1, 6),
    kh=st.sampled_from([1, 3, 5, 7, 9, 11]), kw=st.sampled_from([1, 3, 5, 7, 9, 11]),
)  # fmt: skip
def test_dense_index_places_every_kernel_tap_as_the_conv_does(
    g: int, og: int, cg: int, h: int, w: int, kh: int, kw: int
) -> None:
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


@st.composite
def narrow_blocks(draw: st.DrawFn) -> tuple[RepMLPBlock, Tensor]:
    """A RepMLPBlock of a few channels a group (random BatchNorm statistics, float64) and an input for it."""
    g, cg, og = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    h, w, hp, wp = (draw(st.integers(1, 4)) for _ in range(4))
    odd = [(kh, kw) for kh in (1, 3) for kw in (1, 3) if kh <= h and kw <= w]
    sizes = draw(st.lists(st.sampled_from(odd), min_size=1, max_size=3, unique=True))
    block = RepMLPBlock(g * cg, g * og, (h * hp, w * wp), (h, w), groups=g, kernel_sizes=sizes,
                        global_perceptron=draw(st.booleans()))  # fmt: skip
    seed = draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    x = torch.randn(draw(st.integers(2, 3)), g * cg, h * hp, w * wp, dtype=torch.float64)
    return randomize(block, seed).double(), x.contiguous(memory_format=CL) if draw(st.booleans()) else x


@settings(max_examples=20, deadline=None)
@given(case=narrow_blocks(), training=st.booleans())
def test_the_dense_local_perceptron_is_the_local_perceptrons_function(
    case: tuple[RepMLPBlock, Tensor], training: bool
) -> None:
    """A RepMLP block whose Local Perceptron is dense (``dense=True``: wherever it fits), NCHW or channels_last
    input, training or evaluation mode: the plain block's output, input and parameter gradients and BatchNorm
    statistics (float64); the dense perceptron holds the plain one's branches."""
    block, x = case
    reference = copy.deepcopy(block)
    form = training_form(block.train(training), dense=True)
    assert isinstance(form.local_perceptron, DenseLocalPerceptron)
    assert form.local_perceptron.branches is block.local_perceptron.branches
    _assert_same_steps(form, reference.train(training), x)
    _assert_same_state(block, reference)


@pytest.mark.parametrize("training", [True, False], ids=["train-mode", "eval-mode"])
def test_the_training_form_of_a_narrow_model_is_the_plain_models_function(training: bool) -> None:
    """On a CPU the narrow blocks' Local Perceptrons are dense, the others stay; outputs and gradients (input,
    every parameter) and BatchNorm statistics are the plain model's in float64, NCHW and channels_last."""
    model = _narrow()
    reference = copy.deepcopy(model)
    form = training_form(model)
    assert [n for n, m in form.named_modules() if isinstance(m, DenseLocalPerceptron)] == DENSE
    assert all(type(form.get_submodule(n)) is LocalPerceptron for n in CONVS)
    for layout in (torch.contiguous_format, CL):
        _assert_same_steps(
            form.train(training), reference.train(training), _input().contiguous(memory_format=layout)
        )
    _assert_same_state(model, reference)


def test_the_training_form_holds_the_models_parameters_and_leaves_the_model_as_it_is() -> None:
    """The form's state dict is the model's: the same keys, the same Parameter and buffer objects; the model's
    modules keep their classes, its state dict its keys and tensors."""
    model = _narrow()
    classes = [(n, type(m)) for n, m in model.named_modules()]
    state = model.state_dict(keep_vars=True)
    form = training_form(model)
    assert form is not model
    assert [(n, type(m)) for n, m in model.named_modules()] == classes
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(state) and all(after[k] is v for k, v in state.items())
    form_state = form.state_dict(keep_vars=True)
    assert list(form_state) == list(state) and all(form_state[k] is v for k, v in state.items())
    assert all(form.get_submodule(n).branches is model.get_submodule(n).branches for n in DENSE)


def test_a_step_on_the_training_form_trains_the_model_as_the_plain_model_trains() -> None:
    """Two SGD steps (momentum, weight decay) on the form's outputs move the model's parameters and BatchNorm
    running statistics as the same steps on the plain model move its own."""
    model = _narrow().train()
    reference = copy.deepcopy(model)
    before = copy.deepcopy(model.state_dict())
    form = training_form(model)
    x, y = _input(4), torch.tensor([0, 3, 5, 9])
    for net, owner in ((form, model), (reference, reference)):
        opt = torch.optim.SGD(owner.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        for _ in range(2):
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    _assert_same_state(model, reference)
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert set(moved) == set(before), set(before) - set(moved)  # every parameter, statistic and counter moved


def test_the_training_form_is_the_model_itself_where_nothing_changes() -> None:
    """A wide model (whole AVX2 vectors of 8 channels a group: the convs train faster), ``dense=False``, a
    model without RepMLP blocks: the model itself. ``dense=True`` swaps wherever the dense form fits."""
    wide = repmlp.create_model("repmlp_fmnist_patch2")
    assert training_form(wide) is wide
    narrow = _narrow()
    assert training_form(narrow, dense=False) is narrow
    user = nn.Sequential(nn.Conv2d(3, 4, 2, stride=2), nn.BatchNorm2d(4), nn.ReLU())
    assert training_form(user) is user and training_form(user, dense=True) is user
    dense = training_form(wide, dense=True)
    assert dense is not wide and sum(isinstance(m, DenseLocalPerceptron) for m in dense.modules()) == 4


# ------------------------------------------------------------------------------------- copies and traces
def _export(net: nn.Module) -> nn.Module:
    return torch.export.export(net, (_input(),)).module()


CONVERSIONS: dict[str, Callable[[nn.Module], Callable[[Tensor], Tensor]]] = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda net: pickle.loads(pickle.dumps(net)),
    "fx": torch.fx.symbolic_trace,
    "jit": torch.jit.script,
    "export": _export,
}


@pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated", "ignore:Dynamo detected a call to a `functools"
)
@pytest.mark.parametrize(
    ("which", "how"),
    [
        *((w, h) for w in ("plain", "form") for h in CONVERSIONS),
    ],
)
def test_the_form_and_the_plain_model_copy_pickle_trace_and_export(which: str, how: str) -> None:
    """``copy.deepcopy``, a pickle round trip, ``torch.fx.symbolic_trace``, ``torch.jit.script`` and
    ``torch.export.export`` of the plain model and of its training form: the plain model's outputs."""
    model = _narrow().eval()
    net = model if which == "plain" else training_form(model)
    x = _input()
    with torch.no_grad():
        want = model(x)
        converted = CONVERSIONS[how](net)
        got = converted(x)
    _close(got, want, f"{which} {how}")
    if how in ("deepcopy", "pickle"):  # a copy of its own: nothing shared with the model
        own = {id(t) for t in model.state_dict(keep_vars=True).values()}
        assert not own & {id(t) for t in converted.state_dict(keep_vars=True).values()}


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools")
@pytest.mark.slow  # torch.compile
def test_the_training_form_compiles_as_one_graph() -> None:
    """No graph break in the form (``repmlp train --compile`` compiles the step on it)."""
    torch._dynamo.reset()
    form = training_form(_narrow().float().train())
    explanation = torch._dynamo.explain(form)(_input().float())
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


# ------------------------------------------------------------------------------------- hooks and pruning
def test_hooks_on_the_models_modules_fire_when_the_form_runs() -> None:
    """Forward hooks registered on the model's modules before or after the form is built, and a full backward
    hook, fire when the form runs: on modules the form shares (the stem, a branch's BatchNorm that the dense
    form calls, a wide block's perceptron and conv) and on those it copies (a block above a dense perceptron)."""
    model = _narrow().train()
    paths = ["stem", "stages.0.0.0", f"{DENSE[0]}.branches.1.bn", CONVS[0], f"{CONVS[0]}.branches.1.conv"]
    fired: list[tuple[str, str]] = []

    def watch(when: str) -> None:
        for p in paths:
            model.get_submodule(p).register_forward_hook(lambda m, i, o, p=p: fired.append((when, p)))

    watch("before")
    model.get_submodule("stages.0.0").register_full_backward_hook(
        lambda m, gi, go: fired.append(("grad", ""))
    )
    form = training_form(model)
    watch("after")
    form(_input()).sum().backward()
    assert sorted(fired) == sorted([("grad", ""), *((w, p) for w in ("before", "after") for p in paths)])


def _two_sgd_steps(runs: list[tuple[nn.Module, nn.Module]], x: torch.Tensor) -> None:
    """Two SGD steps of each ``(net called, model whose parameters it trains)``."""
    for net, owner in runs:
        opt = torch.optim.SGD(owner.parameters(), lr=0.1)
        for _ in range(2):
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()


def test_a_pruned_conv_the_form_shares_trains_as_in_the_plain_model() -> None:
    """``torch.nn.utils.prune`` on the plain model's stem conv and on a wide block's Local Perceptron conv, then
    the training form: two SGD steps equal the pruned plain model's, and the mask takes effect."""
    model = _narrow().train()
    reference = copy.deepcopy(model)
    paths = ["stem.conv", f"{CONVS[0]}.branches.1.conv"]
    for net in (model, reference):
        for p in paths:
            prune.l1_unstructured(net.get_submodule(p), "weight", amount=0.5)
    form = training_form(model)
    x = _input()
    _two_sgd_steps([(form, model), (reference, reference)], x)
    _assert_same_state(model, reference)
    model.get_submodule(
        paths[1]
    ).weight_mask.zero_()  # the form computes what the model (its weights) computes
    _assert_same_steps(form, model, x)
    assert not model.get_submodule(paths[1]).weight_orig.grad.any()  # the mask took effect in the form


@pytest.mark.parametrize("how", ["forward hook on the perceptron", "forward hook on its conv", "prune"])
def test_a_watched_narrow_local_perceptron_trains_as_in_the_plain_model(how: str) -> None:
    """A narrow Local Perceptron that a hook watches, or whose conv pruning masks: its hooks fire under the
    training form, and two SGD steps equal the plain model's."""
    model = _narrow().train()
    reference = copy.deepcopy(model)
    conv = f"{DENSE[0]}.branches.1.conv"
    fired: list[str] = []
    if how == "prune":
        for net in (model, reference):
            prune.l1_unstructured(net.get_submodule(conv), "weight", amount=0.5)
    else:
        watched = model.get_submodule(DENSE[0] if how.endswith("perceptron") else conv)
        watched.register_forward_hook(lambda m, i, o: fired.append(how))
    form = training_form(model)
    x = _input()
    _two_sgd_steps([(form, model), (reference, reference)], x)
    assert fired or how == "prune"
    _assert_same_state(model, reference)


# ------------------------------------------------------------------------------------- the ONNX form
@settings(max_examples=20, deadline=None)
@given(
    g=st.integers(1, 4), b=st.integers(1, 9), k=st.integers(1, 12), n=st.integers(1, 12), bias=st.booleans()
)
def test_a_per_group_fc3_is_the_groupwise_linear(g: int, b: int, k: int, n: int, bias: bool) -> None:
    """FC3 as one 2-D product per group: the batched layer's outputs (float64) on its own tensors."""
    torch.manual_seed(0)
    fc3 = GroupwiseLinear(g * k, g * n, g, bias=bias).double()
    if bias:
        nn.init.normal_(fc3.bias)
    rows = torch.randn(g, b, k, dtype=torch.float64)
    per_group = PerGroupLinear(fc3)
    assert per_group.weight is fc3.weight and per_group.bias is fc3.bias
    with torch.no_grad():
        torch.testing.assert_close(per_group(rows), fc3(rows), rtol=1e-12, atol=1e-12)


def test_the_onnx_form_is_the_deployed_models_function() -> None:
    """:func:`per_group_fc3` of a deployed model: every FC3 per group in a new tree with the same keys and
    tensors, the deployed model's outputs (float64, eager and exported); the deployed model keeps its
    ``GroupwiseLinear`` FC3s. A model without RepMLP blocks is returned itself."""
    deployed = repmlp.reparameterize_model(_narrow().eval())
    fc3s = [b.partition_perceptron.fc3 for b in deployed.modules() if isinstance(b, RepMLPBlock)]
    form = per_group_fc3(deployed)
    assert len(fc3s) == 6 and all(type(f) is GroupwiseLinear for f in fc3s)
    assert [b.partition_perceptron.fc3 for b in deployed.modules() if isinstance(b, RepMLPBlock)] == fc3s
    assert all(
        type(b.partition_perceptron.fc3) is PerGroupLinear
        for b in form.modules()
        if isinstance(b, RepMLPBlock)
    )
    state, form_state = deployed.state_dict(keep_vars=True), form.state_dict(keep_vars=True)
    assert list(form_state) == list(state) and all(form_state[k] is v for k, v in state.items())
    x = _input()
    with torch.no_grad():
        want = deployed(x)
        _close(form(x), want, "eager")
        _close(form(x.contiguous(memory_format=CL)), want, "channels_last")
        _close(_export(form)(x), want, "export")
    user = nn.Sequential(nn.Conv2d(3, 4, 2, stride=2), nn.ReLU())
    assert per_group_fc3(user) is user


# ------------------------------------------------------------------------------------- the serving copy
def test_a_users_own_model_is_left_as_it_is_by_the_forms_and_the_predictor() -> None:
    """A user's own model: the training form is the model itself; the predictor serves a copy of it
    channels_last on a CPU (the copy's conv sees channels_last input), leaves the model's classes and weight
    layout, predicts a 29x29 image as the model computes it, and one unbatched image as a batch of one."""
    user = nn.Sequential(nn.Conv2d(3, 4, 2, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    classes = [type(m) for m in user.modules()]
    layouts: list[bool] = []
    user[0].register_forward_hook(
        lambda m, i, o: layouts.append(is_channels_last(i[0]))
    )  # copied with the model
    assert training_form(user) is user
    predictor = Predictor(user, top_k=4)
    assert [type(m) for m in user.modules()] == classes
    assert all(p.is_contiguous() for p in user.parameters())
    x = torch.randn(3, 3, 29, 29)
    with torch.no_grad():
        probs = torch.softmax(user(x), dim=1)
    layouts.clear()
    top = predictor.predict(x)
    assert layouts == [True]
    assert [[p.index for p in row] for row in top] == probs.argsort(dim=1, descending=True).tolist()
    for row, want in zip(top, probs, strict=True):
        assert [p.probability for p in row] == pytest.approx(
            want.sort(descending=True).values.tolist(), rel=1e-5
        )
    assert predictor.predict(x[0]) == predictor.predict(x[:1])
    with torch.no_grad():  # the user's model still takes an unbatched image, NCHW as before
        torch.testing.assert_close(user(x[0]).flatten(), user(x[:1]).flatten())


def test_the_predictor_serves_a_copy_of_a_deployed_model_in_the_serving_layout() -> None:
    """A deployed RepMLP model: the predictor's top-k are the model's own, and the model keeps its classes and
    NCHW weights."""
    deployed = repmlp.reparameterize_model(_narrow().float().eval())
    classes = [type(m) for m in deployed.modules()]
    predictor = Predictor(deployed, top_k=3)
    x = _input(3).float()
    with torch.no_grad():
        want = deployed(x).topk(3, dim=1).indices.tolist()
    assert [[p.index for p in row] for row in predictor.predict(x)] == want
    assert [type(m) for m in deployed.modules()] == classes
    assert all(p.is_contiguous() for p in deployed.parameters())
