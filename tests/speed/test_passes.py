"""The speed passes (:mod:`repmlp.speed`): every registered model computes the plain model's function under
them (float64: outputs and gradients in training, outputs in evaluation, deployed too), keeps its state-dict
keys, comes back plain with :func:`plain`, leaves watched modules alone, and traces."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

import repmlp
from equivalence import randomize
from repmlp.models.registry import default_input_size
from repmlp.speed import fast_inference, fast_training, onnx_form, plain
from zoo import SMALL_BUILDS

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = repmlp.list_models()


def _model(name: str, deploy: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = randomize(repmlp.create_model(name, **SMALL_BUILDS[name]), 0).double()
    return repmlp.reparameterize_model(model.eval()) if deploy else model


def _fast_classes(model: nn.Module) -> set[str]:
    return {type(m).__name__ for m in model.modules() if type(m).__module__.startswith("repmlp.speed")}


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout masks (PSPNet's head) for both models
    out = model(x)
    out = out[0] if isinstance(out, tuple) else out
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    return out.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def _close(a: torch.Tensor, b: torch.Tensor, what: str, scale: float = 0.0) -> None:
    """``a`` equals ``b`` to 1e-10 of ``b``'s largest entry (or of ``scale``, where larger: a gradient that
    is zero in exact arithmetic, next to others that are not)."""
    scale = max(b.abs().max().item(), scale, 1e-300)
    assert (a - b).abs().max().item() < 1e-10 * scale, what


@pytest.mark.parametrize("dense", [None, True], ids=["cpu", "dense"])
@pytest.mark.parametrize("name", NAMES)
def test_fast_training_is_the_plain_models_function(name: str, dense: bool | None) -> None:
    """A training step (outputs, every gradient, BatchNorm statistics) under :func:`fast_training` equals the
    plain model's in float64, in NCHW and channels_last; the state dict's keys and tensors are the same
    objects; :func:`plain` gives every module its own class back."""
    model = _model(name)
    x = torch.randn(2, *default_input_size(model), dtype=torch.float64)
    reference = copy.deepcopy(model).train()
    classes = [type(m) for m in model.modules()]
    state = model.state_dict(keep_vars=True)
    fast_training(model.train(), dense=dense)
    assert model.state_dict(keep_vars=True).keys() == state.keys()
    assert all(a is b for a, b in zip(model.state_dict(keep_vars=True).values(), state.values(), strict=True))
    for layout in (torch.contiguous_format, torch.channels_last):
        if layout == torch.channels_last and x.dim() != 4:
            continue
        model.to(memory_format=layout)
        reference.to(memory_format=layout)
        out, grads = _step(model, x.contiguous(memory_format=layout))
        ref, ref_grads = _step(reference, x.contiguous(memory_format=layout))
        _close(out, ref, "output")
        assert grads.keys() == ref_grads.keys()
        scale = max(g.abs().max().item() for g in ref_grads.values())
        for k, g in ref_grads.items():
            _close(grads[k], g, k, scale)
    for (k, a), b in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        if a.is_floating_point():
            _close(a, b, k)
    plain(model)
    assert [type(m) for m in model.modules()] == classes


@pytest.mark.parametrize("deploy", [False, True], ids=["train", "deploy"])
@pytest.mark.parametrize("name", NAMES)
def test_fast_inference_is_the_plain_models_function(name: str, deploy: bool) -> None:
    """Evaluation under :func:`fast_inference` (any batch) equals the plain model in float64, NCHW or
    channels_last input; keys stay; :func:`plain` undoes it."""
    model = _model(name, deploy).eval()
    x = torch.randn(3, *default_input_size(model), dtype=torch.float64)
    with torch.no_grad():
        ref = model(x)
        fast_inference(model, batch_sizes=(3,))
        assert model.state_dict().keys() == _model(name, deploy).state_dict().keys()
        outs = [model(x)]
        if x.dim() == 4:
            outs.append(model(x.contiguous(memory_format=torch.channels_last)))
        for out in outs:
            for a, b in zip(
                out if isinstance(out, tuple) else (out,),
                ref if isinstance(ref, tuple) else (ref,),
                strict=True,
            ):
                _close(a, b, "output")
    plain(model)
    assert not _fast_classes(model) and not model._forward_pre_hooks


@pytest.mark.parametrize("name", NAMES)
def test_onnx_form_is_the_plain_models_function(name: str) -> None:
    """Under :func:`onnx_form` every deployed RepMLP block's FC3 is a per-group product and the model computes
    the plain model's function in float64 (to 1e-10), eager, traced by torch.fx and by torch.export; keys
    stay; :func:`plain` undoes it."""
    model = _model(name, deploy=True).eval()
    x = torch.randn(3, *default_input_size(model), dtype=torch.float64)
    blocks = [m for m in model.modules() if isinstance(m, repmlp.RepMLPBlock)]
    keys = model.state_dict().keys()
    with torch.no_grad():
        ref = model(x)
        onnx_form(model)
        assert model.state_dict().keys() == keys
        assert all(type(b.partition_perceptron.fc3).__name__ == "PerGroupLinear" for b in blocks)
        runs = {"eager": model, "fx": torch.fx.symbolic_trace(model)}
        if blocks:
            runs["export"] = torch.export.export(model, (x,)).module()
        for how, run in runs.items():
            out = run(x)
            for a, b in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,),
                            strict=True):  # fmt: skip
                _close(a, b, how)
    plain(model)
    assert not _fast_classes(model)


def test_what_each_pass_changes_on_a_cpu() -> None:
    """The main job's model trains with custom-op partition copies, a matmul patch stem, layout-keeping
    convs on the partition maps and two-maxima pooling; a deployed ResNet trunk runs channels_last with its
    FC3 kernels timed and its weights stored channels_last."""
    model = fast_training(repmlp.create_model("repmlp_fmnist_patch2"))
    assert _fast_classes(model) == {"FastRepMLPBlock", "PatchwiseConv2d", "LayoutConv2d", "MaxPool2x2"}
    narrow = fast_training(repmlp.create_model("repmlp_cifar", widths=(4, 8, 16)))
    assert "DenseLocalPerceptron" in _fast_classes(narrow)
    res50 = repmlp.create_model("repmlp_res50", **SMALL_BUILDS["repmlp_res50"], deploy=True).eval()
    fast_inference(res50, batch_sizes=(1, 8))
    assert {"FastRepMLPBlock", "TunedGroupwiseLinear"} <= _fast_classes(res50)
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in res50.parameters() if p.dim() == 4)
    kernels = [m.kernels for m in res50.modules() if isinstance(m, repmlp.GroupwiseLinear)]
    assert kernels and all(set(k) and set(k.values()) <= {"bmm", "onednn", "transposed"} for k in kernels)


@pytest.mark.parametrize("how", ["forward hook", "forward pre-hook", "backward hook", "prune"])
def test_a_watched_module_stays_plain_and_its_hooks_fire(how: str) -> None:
    """A module that a hook watches when the pass runs (or that pruning masks) keeps its plain class, with
    everything around it: its hooks fire in every training step and a pruning mask takes effect."""
    torch.manual_seed(0)
    model = repmlp.create_model("repmlp_cifar", widths=(4, 8, 16)).double().train()
    reference = copy.deepcopy(model)
    lp = model.stages[0][0][0].local_perceptron
    conv = lp.branches[1].conv
    calls: list[int] = []
    if how == "forward hook":
        conv.register_forward_hook(lambda *a: calls.append(1))
    elif how == "forward pre-hook":
        conv.register_forward_pre_hook(lambda *a: calls.append(1))
    elif how == "backward hook":
        conv.register_full_backward_hook(lambda *a: calls.append(1))
    else:
        prune.l1_unstructured(conv, "weight", amount=0.5)
        prune.l1_unstructured(
            reference.stages[0][0][0].local_perceptron.branches[1].conv, "weight", amount=0.5
        )
    fast_training(model)
    assert type(lp) is repmlp.LocalPerceptron and type(conv) is nn.Conv2d
    assert "DenseLocalPerceptron" in _fast_classes(model)  # the other blocks' perceptrons
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    out, _ = _step(model, x)
    ref, _ = _step(reference, x)
    _close(out, ref, "output")
    assert calls or how == "prune"
    if how == "prune":
        conv.weight_mask.zero_()
        reference.stages[0][0][0].local_perceptron.branches[1].conv.weight_mask.zero_()
        _close(_step(model, x)[0], _step(reference, x)[0], "pruned output")


@pytest.mark.parametrize("name", ["repmlp_fmnist_patch2", "repmlp_cifar_fc3_conv9", "repmlp_res50_light"])
def test_fast_modules_trace(name: str) -> None:
    """A model under either pass traces with torch.fx (training and evaluation, with and without autograd)
    into a graph that computes what the module computes; deployed and fast, torch.export too."""
    model = _model(name)
    x = torch.randn(2, *default_input_size(model), dtype=torch.float64)
    fast_training(model)
    for training in (True, False):
        model.train(training)
        graph = torch.fx.symbolic_trace(model)
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                if training:
                    torch.manual_seed(0)
                _close(graph(x), model(x), f"train={training} grad={grad}")
    for dtype in (
        torch.float64,
        torch.float32,
    ):  # float32: FC3's kernel timed by the pass (a leaf of the graph)
        deployed = repmlp.reparameterize_model(copy.deepcopy(plain(model)).eval()).to(dtype)
        deployed, xd = fast_inference(deployed, batch_sizes=(2,)), x.to(dtype)
        with torch.no_grad():
            _close(torch.fx.symbolic_trace(deployed)(xd), deployed(xd), f"fx {dtype}")
            _close(torch.export.export(deployed, (xd,)).module()(xd), deployed(xd), f"export {dtype}")
