"""timm's model contract on every registered model, generated over the registries (new models are covered).

Modelled on timm's own ``tests/models/test_models.py``: forward/backward, default cfg, forward_features /
forward_head(pre_logits) / reset_classifier, features_only + feature_info, torch.fx symbolic tracing
forward and backward; test_timms_model_tests runs timm's own checks, at its input sizes, on real values.
Every model is also traced and its feature maps extracted as timm and torchvision do it for detection and
segmentation (torchvision's ``create_feature_extractor``, timm's fx features):
in eval mode without autograd and in train mode with autograd, the two ways a backbone runs. Full-size
models run on the meta device (shapes only, nothing computed, so every check is cheap at the paper's
resolutions); numerical checks use small configurations.
"""

from __future__ import annotations

import math
import warnings

import pytest
import timm
import torch
import torch.fx
from timm.layers import get_notrace_functions, get_notrace_modules
from torch import Tensor, nn
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

from repmlp import create_model, list_models
from zoo import SMALL_BUILDS, shallow

pytestmark = pytest.mark.slow  # timm's contract, about 300 cases (a minute and a half on 2 cores)

# Outside timm's classifier contract, so not registered with timm (docs/models.md): the PSPNets (dense
# predictors) and the sequence models (1-D feature maps); repmlp.create_model builds them.
OUTSIDE = {"pspnet_res50", "pspnet_repmlp_res50", "repmlp1d_fmnist", "conv1d_fmnist"}


def _timm_models() -> list[str]:
    """Models registered with timm by repmlp's modules (whichever registry helper they used): all of them
    must keep timm's classifier contract (timm's own tests and users take every timm model for one)."""
    return sorted(
        n for n in timm.list_models() if timm.models.model_entrypoint(n).__module__.startswith("repmlp.")
    )


TIMM = _timm_models()
ALL = sorted(set(list_models()) | set(TIMM))


def _first(out: object) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out  # type: ignore[return-value]


def _meta_model(name: str, **kwargs: object) -> nn.Module:
    with torch.device("meta"):
        return timm.create_model(name, **kwargs) if name in TIMM else create_model(name, **kwargs)


def _meta_input(model: nn.Module, batch: int = 2) -> Tensor:
    c, h, w = model.pretrained_cfg["input_size"]
    return torch.randn(batch, c, h, w, device="meta")


def _levels(model: nn.Module) -> list[str]:
    """Module names of the feature maps a backbone user extracts: the model's ``feature_info``, or for the
    PSPNets (no classifier contract) their backbone's levels, c2..c5."""
    info = getattr(model, "feature_info", None)
    if info is None:
        return [f"backbone.{n}" for n in model.backbone.feature_info.module_name()]
    return [f["module"] for f in info]


def _eager_maps(model: nn.Module, names: list[str], x: Tensor) -> tuple[list[tuple[int, ...]], Tensor]:
    """Shapes of the outputs of ``model``'s submodules ``names`` in an eager forward of ``x``, and its output."""
    shapes: dict[str, tuple[int, ...]] = {}

    def keep(name: str) -> object:
        def hook(module: nn.Module, args: object, out: Tensor) -> None:  # None: the output stays
            shapes[name] = tuple(out.shape)

        return hook

    hooks = [model.get_submodule(n).register_forward_hook(keep(n)) for n in names]
    try:
        out = model(x)
    finally:
        for h in hooks:
            h.remove()
    return [shapes[n] for n in names], out


@pytest.mark.filterwarnings("ignore:NOTE. The nodes obtained by tracing:UserWarning")  # PSPNet's aux head
@pytest.mark.parametrize("name", ALL)
def test_fx_traces_and_extracts_in_both_modes(name: str) -> None:
    """Every model (built shallow, every block kind: tests/zoo.py) as a detection or segmentation backbone:
    torchvision's ``create_feature_extractor`` on its feature levels, traced without autograd (as under
    ``torch.no_grad`` / ``torch.inference_mode``, timm's fx forward test): the eval graph, run without
    autograd, gives the eager model's maps; the train graph runs with autograd and backward reaches every
    parameter of the levels.

    Traced with autograd (timm's fx backward test): the timm models through timm's fx features
    (test_features_through_timms_fx_extractor), the others here by ``torch.fx.symbolic_trace`` in train
    mode, run forward and backward.
    """
    model = _meta_model(name, **shallow(name)).eval()
    x = _meta_input(model)
    levels = _levels(model)
    with torch.no_grad():
        refs, out = _eager_maps(model, levels, x)
        extractor = create_feature_extractor(model, return_nodes=levels)
        assert [tuple(o.shape) for o in extractor.eval()(x).values()] == refs
    maps = extractor.train()(x)
    assert [tuple(o.shape) for o in maps.values()] == refs
    sum(o.sum() for o in maps.values()).backward()
    assert all(p.grad is not None for n in levels for p in model.get_submodule(n).parameters())
    if name in TIMM:
        return

    model.zero_grad(set_to_none=True)
    traced = torch.fx.symbolic_trace(model.train())
    outs = traced(x)
    outs = outs if isinstance(outs, tuple) else (outs,)  # PSPNet in training: (main, aux)
    assert outs[0].shape == out.shape
    sum(o.sum() for o in outs).backward()
    grads = [p.grad for p in traced.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)


def test_fx_traced_model_matches_eager_and_keeps_its_input_check(one_thread: None) -> None:
    torch.manual_seed(0)
    model = create_model("repmlp_fmnist").eval()
    traced = torch.fx.symbolic_trace(model)
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(traced(x), model(x))
    with pytest.raises(ValueError, match="built for 28x28 inputs, got 32x32"):
        traced(torch.randn(2, 1, 32, 32))


@pytest.mark.parametrize(
    "name, kwargs, channels_last",
    [
        ("repmlp_fmnist", {}, False),
        ("repmlp_fmnist", {}, True),
        ("repmlp1d_fmnist", dict(widths=(8, 16, 32)), False),
    ],
    ids=["2d", "2d-channels-last", "1d"],
)
def test_graphs_compute_the_models_bits_whatever_mode_they_were_traced_in(
    name: str, kwargs: dict, channels_last: bool, one_thread: None
) -> None:
    """The Local Perceptron's layout and conv choices depend on the autograd mode and are made in torch.fx
    leaves: a graph traced with or without autograd computes, run without autograd (eval; ``torch.no_grad``
    and ``torch.inference_mode``) or with it (train: outputs and gradients), bitwise what the eager model
    computes in that mode (one process: FC3's timed form is the same)."""
    import copy

    torch.manual_seed(0)
    model = create_model(name, **kwargs)
    x = torch.randn(3, *model.pretrained_cfg["input_size"])
    if channels_last:
        model, x = (
            model.to(memory_format=torch.channels_last),
            x.contiguous(memory_format=torch.channels_last),
        )

    def trace(mode: bool, grad: bool) -> nn.Module:
        with torch.set_grad_enabled(grad):
            return torch.fx.symbolic_trace(copy.deepcopy(model).train(mode))

    def train_step(m: nn.Module) -> tuple[Tensor, dict[str, Tensor | None]]:
        out = m(x)
        out.square().sum().backward()
        return out.detach(), {n: p.grad for n, p in m.named_parameters()}

    with torch.no_grad():
        ref = model.eval()(x)
    ref_out, ref_grads = train_step(copy.deepcopy(model).train())
    for grad in (False, True):
        evaluating = trace(False, grad)
        with torch.no_grad():
            assert torch.equal(evaluating(x), ref)
        with torch.inference_mode():  # as timm's fx forward test runs it
            assert torch.equal(evaluating(x), ref)
        out, grads = train_step(trace(True, grad))
        assert torch.equal(out, ref_out)
        assert grads.keys() == ref_grads.keys()
        assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_models_outside_timms_image_contract() -> None:
    """The models outside timm's classifier contract (docs/models.md), the PSPNets (dense predictors) and
    the sequence models, whose feature maps are 1-D, are not timm models: repmlp lists and builds them,
    their feature levels too, with timm's build_model_with_cfg."""
    one_d = {"repmlp1d_fmnist", "conv1d_fmnist"}
    assert set(list_models()) - set(TIMM) == OUTSIDE and not OUTSIDE & set(timm.list_models())
    assert {"repmlp_res50", "repmlp_cifar", "repmlp_fmnist_patch2", "mobilefacenet", "face_resnet"} <= set(
        TIMM
    )
    for name in OUTSIDE:
        with pytest.raises(RuntimeError, match="Unknown model"):
            timm.create_model(name)
    for name in one_d:
        with torch.device("meta"):
            features = create_model(name, features_only=True).eval()
        maps = features(torch.randn(2, 1, 28, 28, device="meta"))
        assert [tuple(m.shape) for m in maps] == [(2, 64, 28), (2, 128, 14), (2, 128, 7)]
        assert features.feature_info.channels() == [64, 128, 128]


@pytest.mark.parametrize("name", TIMM)
def test_default_cfg(name: str) -> None:
    """timm's test_model_default_cfgs: cfg fields, names of first conv / classifier, pool_size."""
    model = _meta_model(name).eval()
    cfg = model.pretrained_cfg
    assert model.default_cfg is cfg and cfg["architecture"] == name
    assert cfg == timm.get_pretrained_cfg(name).to_dict() | {"num_classes": model.num_classes}
    c, h, w = cfg["input_size"]
    assert len(cfg["mean"]) == len(cfg["std"]) == c == model.pretrained_cfg["input_size"][0]
    assert 0 < cfg["crop_pct"] <= 1 and cfg["interpolation"] in ("bilinear", "bicubic")
    keys = model.state_dict().keys()
    assert cfg["first_conv"] + ".weight" in keys and cfg["classifier"] + ".weight" in keys
    feats = model.forward_features(_meta_input(model))
    assert feats.dim() == 4, "timm's image models give (N, C, H, W) feature maps"
    assert feats.shape[1] == model.num_features and tuple(feats.shape[2:]) == cfg["pool_size"]
    if cfg["fixed_input_size"]:  # generic code must not feed other sizes: the model refuses them
        with pytest.raises(ValueError):
            model(torch.randn(2, c, h + 32, w + 32, device="meta"))
    else:
        assert model(torch.randn(2, c, h + 32, w + 32, device="meta")).shape == (2, model.num_classes)


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("repmlp_fmnist", {}),
        ("repmlp1d_fmnist", {}),
        ("repmlpnet_t224", dict(channels=(16, 32, 64, 128), depths=(1, 1, 1, 1), sharesets=(1, 4, 16, 32))),
        ("repmlp_face_resnet", dict(widths=(16, 32, 64, 128), stem_channels=8, groups=1)),
    ],
)
def test_fx_graph_scripts(name: str, kwargs: dict) -> None:
    """timm's fx + TorchScript test: the torch.fx graph (FC3 a leaf) compiles with ``torch.jit.script``
    and computes the model's outputs (the annotations are real types, the leaf is called as Python)."""
    model = create_model(name, **kwargs).eval()
    x = torch.randn(1, *model.pretrained_cfg["input_size"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated upstream
        scripted = torch.jit.script(torch.fx.symbolic_trace(model))
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x))


@pytest.mark.parametrize("name", TIMM)
def test_scripts_with_torchscript(name: str) -> None:
    """timm's test_model_forward_torchscript: ``torch.jit.script`` compiles every model (built shallow:
    tests/zoo.py) and the scripted module runs (meta tensors: shapes only)."""
    model = _meta_model(name, **shallow(name)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated upstream
        scripted = torch.jit.script(model)
    x = _meta_input(model, batch=1)
    assert scripted(x).shape == model(x).shape


@pytest.mark.parametrize("name", TIMM)
def test_reset_classifier_matches_the_model(name: str) -> None:
    """A classifier put in by ``reset_classifier`` takes the model's device, dtype and mode (timm), and gives
    the new number of classes (forward, backward, pre-logits and no-pooling: test_timms_model_tests)."""
    model = _meta_model(name).to(torch.float64).eval()
    model.reset_classifier(0)
    model.reset_classifier(2)
    assert model(_meta_input(model).double()).shape == (2, 2) and model.num_classes == 2
    classifier = model.get_classifier()
    params = list(classifier.parameters())
    assert params and all(p.device.type == "meta" and p.dtype == torch.float64 for p in params)
    assert not any(m.training for m in model.modules())


@pytest.mark.parametrize("name", ["mobilefacenet", "face_resnet"])
def test_face_models_global_pool(name: str) -> None:
    """The face models' "pooling" (MobileFaceNet's GDConv, FaceResNet's flattening) can be switched off
    (the unreduced map without an embedding layer; an embedding layer always reduces) and back on;
    any other pooling is a ValueError."""
    own = {"mobilefacenet": "gdconv", "face_resnet": "flatten"}[name]
    model = _meta_model(name, num_classes=0, global_pool="").eval()
    x = _meta_input(model)
    with torch.device("meta"):  # new layers are created on the default device
        model.reset_classifier(0, own)
        assert model(x).shape == (2, model.head_hidden_size)
        for bad in ("avg", "max"):
            with pytest.raises(ValueError, match=f"global_pool={own!r}"):
                model.reset_classifier(0, bad)
        model.reset_classifier(8, "")
        assert model(x).shape == (2, 8) and model.global_pool == ""
        model.reset_classifier(0)  # keeps the pooling: the map again
        assert model(x).shape == model.forward_features(x).shape
        model.reset_classifier(8, own)
        assert model(x).shape == (2, 8) and model.global_pool == own
    assert _meta_model(name, num_classes=8, global_pool="")(x).shape == (2, 8)


@pytest.mark.parametrize("name", TIMM)
def test_features_only(name: str) -> None:
    """timm's test_model_forward_features: features_only=True gives at least 3 levels (timm's backbones'
    minimum), 2-D maps of feature_info's channels and reductions (built shallow, every block kind:
    tests/zoo.py)."""
    full = _meta_model(name, **shallow(name))
    n = len(full.feature_info)
    model = _meta_model(name, features_only=True, **shallow(name)).eval()
    x = _meta_input(full)
    outs = model(x)
    info = model.feature_info
    assert len(outs) == len(info.channels()) == n >= 3
    for out, chans, red in zip(outs, info.channels(), info.reduction(), strict=True):
        assert out.dim() == 4 and out.shape[1] == chans
        assert tuple(out.shape[2:]) == tuple(s // red for s in x.shape[2:])
    last = _meta_model(name, features_only=True, out_indices=(n - 2, n - 1), **shallow(name)).eval()
    assert [o.shape for o in last(x)] == [o.shape for o in outs[-2:]]
    assert last.feature_info.channels() == info.channels()[-2:]


@pytest.mark.parametrize("name", TIMM)
def test_features_through_timms_fx_extractor(name: str) -> None:
    """``feature_cls="fx"`` (timm's FeatureGraphNet, torch.fx based), traced with autograd (timm's fx
    backward test; test_fx_traces_and_extracts_in_both_modes traces without): run without autograd in eval
    mode it gives feature_info's maps (as features_only, test_features_only); in train mode with autograd
    it runs backward (built shallow, every block kind: tests/zoo.py)."""
    model = _meta_model(name, features_only=True, feature_cls="fx", **shallow(name)).eval()
    x = _meta_input(model)
    with torch.no_grad():
        maps = model(x)
    info = model.feature_info
    sizes = zip(info.channels(), info.reduction(), strict=True)
    expected = [(2, c, *(s // r for s in x.shape[2:])) for c, r in sizes]
    assert [tuple(o.shape) for o in maps] == expected
    maps = model.train()(x)
    assert [tuple(o.shape) for o in maps] == expected
    sum(o.sum() for o in maps).backward()
    assert all(p.grad is not None for p in model.parameters())  # the graph holds the levels' layers only


@pytest.mark.parametrize("name", TIMM)
def test_forward_intermediates(name: str) -> None:
    """timm's test_model_forward_intermediates: the final map is forward_features', the rest feature_info's."""
    model = _meta_model(name).eval()
    if not hasattr(model, "forward_intermediates"):
        pytest.skip("optional in timm's contract: features_only uses FeatureListNet on feature_info")
    x = _meta_input(model)
    final, inter = model.forward_intermediates(x)
    assert final.shape == model.forward_features(x).shape
    assert [o.shape[1] for o in inter] == [f["num_chs"] for f in model.feature_info]
    last_two = model.forward_intermediates(x, indices=2, intermediates_only=True)
    assert [o.shape for o in last_two] == [o.shape for o in inter[-2:]]


def test_forward_intermediates_and_pruning_keep_the_models_maps(one_thread: None) -> None:
    """timm's intermediates/prune contract on real values (a small RepMLP-Res50): the final map is
    forward_features' bitwise; a model pruned after tap i gives tap i, as forward_features too, and
    trains every parameter it keeps."""
    import copy

    kw = dict(widths=(64, 128, 256, 512), layers=(2, 2, 2, 2), img_size=64, partition=2, kernel_sizes=(1,))
    model = create_model("repmlp_res50", **kw).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        final, taps = model.forward_intermediates(x)
        assert torch.equal(final, model.forward_features(x))
    for i in range(len(taps)):
        pruned = copy.deepcopy(model)
        take = pruned.prune_intermediate_layers([i])
        with torch.no_grad():
            assert torch.equal(
                pruned.forward_intermediates(x, indices=take, intermediates_only=True)[0], taps[i]
            )
            assert torch.equal(pruned.forward_features(x), taps[i])
    pruned.train()
    pruned.forward_features(x).sum().backward()
    assert all(p.grad is not None for p in pruned.parameters())


def test_res50_backbone_example() -> None:
    """The README's backbone example: c2..c5 of RepMLP-Res50 like timm's resnet50 (same channels)."""
    with torch.device("meta"):
        ours = timm.create_model("repmlp_res50", features_only=True, out_indices=(1, 2, 3, 4))
        ref = timm.create_model("resnet50", features_only=True, out_indices=(1, 2, 3, 4))
    assert ours.feature_info.channels() == ref.feature_info.channels() == [256, 512, 1024, 2048]
    assert ours.feature_info.reduction() == ref.feature_info.reduction() == [4, 8, 16, 32]
    outs = ours(torch.randn(2, 3, 224, 224, device="meta"))
    assert [tuple(o.shape) for o in outs] == [
        (2, 256, 56, 56),
        (2, 512, 28, 28),
        (2, 1024, 14, 14),
        (2, 2048, 7, 7),
    ]


def test_features_only_matches_the_models_own_stages(one_thread: None) -> None:
    """The features are the model's own maps (same weights), not a copy's: values, not only shapes."""
    torch.manual_seed(0)
    model = timm.create_model("repmlp_fmnist").eval()
    feats = timm.create_model("repmlp_fmnist", features_only=True).eval()
    # FeatureListNet with flatten_sequential names the stages "stages_<i>" (timm's convention).
    state = {k.replace("stages.", "stages_", 1): v for k, v in model.state_dict().items()}
    feats.load_state_dict({k: v for k, v in state.items() if not k.startswith("head.")})
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(feats(x)[-1], model.forward_features(x))


@pytest.mark.parametrize("name", ALL)
def test_torch_export_deployed(name: str) -> None:
    """``torch.export.export`` of every deployed model with a dynamic batch (meta tensors: shapes only;
    built shallow, every block kind: tests/zoo.py)."""
    model = _meta_model(name, deploy=True, **shallow(name)).eval()
    x = _meta_input(model)
    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
    assert program.module()(_meta_input(model, batch=3)).shape == model(_meta_input(model, batch=3)).shape


# timm's tests/test_models.py: the input size each test targets (a size a model not built for one
# size must take) and the largest it runs (a fixed-size model above it is skipped there).
_TIMM_SIZES = {"forward": (384, 384), "backward": (128, 320), "default_cfgs": (448, 448),
               "forward_features": (96, 256), "forward_fx": (128, 256), "backward_fx": (128, 224)}  # fmt: skip


def _timm_input_size(model: nn.Module, check: str) -> tuple[int, ...]:
    """timm's ``_get_input_size``: a fixed-size model's own input size, else its size capped at the target."""
    cfg, (target, limit) = model.default_cfg, _TIMM_SIZES[check]
    size = tuple(cfg["input_size"])
    if not cfg.get("fixed_input_size") and max(size) > target:
        size = tuple(cfg.get("min_input_size") or (min(s, target) for s in size))
    if max(size) > limit:
        pytest.skip(f"timm skips a fixed-size model above {limit}")
    return size


def _small(name: str, **kwargs: object) -> nn.Module:
    """``timm.create_model`` of ``name``'s small build (tests/zoo.py); a face model's ``num_classes`` is its
    embedding width."""
    build = {
        k: v for k, v in SMALL_BUILDS[name].items() if not (k == "embedding_dim" and "num_classes" in kwargs)
    }
    return timm.create_model(name, **build, **kwargs)


def _timm_fx_model(model: nn.Module) -> nn.Module:
    """timm's ``_create_fx_model`` (one output): the graph's last node through torchvision's extractor,
    traced with timm's leaf modules and functions."""
    kwargs = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(),
                  param_shapes_constant=True)  # fmt: skip
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=kwargs)
    return create_feature_extractor(model, train_return_nodes=train_nodes[-1:], eval_return_nodes=eval_nodes[-1:],
                                    tracer_kwargs=kwargs)  # fmt: skip


def _timm_default_cfgs(name: str, model: nn.Module) -> None:
    """timm's test_model_default_cfgs."""
    assert model.num_classes >= 0 and model.num_features > 0 and model.head_hidden_size > 0
    cfg, keys = model.default_cfg, model.state_dict().keys()
    assert model.in_chans == cfg["input_size"][0]
    pool = tuple(cfg["pool_size"])
    x = torch.randn(1, *_timm_input_size(model, "default_cfgs"))
    feats = model.forward_features(x)
    pre = model.forward_head(feats, pre_logits=True)
    assert tuple(feats.shape[2:]) == pool and feats.shape[1] == model.num_features
    assert pre.shape[1] == model.head_hidden_size
    model.reset_classifier(0)
    assert model.num_classes == 0
    assert model(x).shape == pre.shape == _small(name, num_classes=0).eval()(x).shape
    assert pre.shape[1] == model.head_hidden_size
    model.reset_classifier(0, "")
    unpooled = _small(name, num_classes=0, global_pool="").eval()
    for out in (model(x), unpooled(x)):
        assert out.dim() == 4 and tuple(out.shape[2:]) == pool
    assert all(c + ".weight" in keys for c in _names(cfg["classifier"]) if cfg["num_classes"])
    assert all(c + ".weight" in keys for c in _names(cfg["first_conv"]))
    placed = _small(name, device="meta", dtype=torch.float64)  # timm's factory options
    assert all(t.device.type == "meta" for t in placed.state_dict().values())
    assert all(p.dtype == torch.float64 for p in placed.parameters())
    with pytest.raises(TypeError):  # an unknown option is an error, not ignored
        _small(name, device="meta", not_a_model_arg=1)


def _names(value: str | tuple[str, ...]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _timm_backward(model: nn.Module, check: str) -> None:
    """timm's test_model_backward and test_model_backward_fx (a 42-class model in training)."""
    x = torch.randn(2, *_timm_input_size(model, check))
    if check == "backward_fx":
        model = _timm_fx_model(model)
    out = model(x)
    out = torch.cat(tuple(out.values())) if isinstance(out, dict) else out
    out.mean().backward()
    assert all(p.grad is not None for p in model.parameters()), "a parameter without a gradient"
    assert out.shape[-1] == 42 and not out.isnan().any()


def _timm_forward_features(name: str) -> None:
    """timm's test_model_forward_features: at least 3 levels, of feature_info's channels and reductions."""
    model = _small(name, features_only=True).eval()
    channels, reductions = model.feature_info.channels(), model.feature_info.reduction()
    assert len(channels) >= 3
    size = _timm_input_size(model, "forward_features")
    outs = model(torch.randn(1, *size))
    assert len(outs) == len(channels)
    for out, c, r in zip(outs, channels, reductions, strict=True):
        assert out.shape[:2] == (1, c) and not out.isnan().any()
        assert all(
            s / (2 * r) < o <= math.ceil(s / r) + 1 for o, s in zip(out.shape[2:], size[1:], strict=True)
        )


@pytest.mark.parametrize("check", list(_TIMM_SIZES))
@pytest.mark.parametrize("name", TIMM)
def test_timms_model_tests(name: str, check: str, one_thread: None) -> None:
    """timm's own model tests (its tests/test_models.py: forward, backward, default_cfgs, forward_features,
    forward_fx, backward_fx) on every model timm.create_model builds of ours, small (tests/zoo.py) and on real
    values, at the input sizes timm's tests feed: a model not built for one size must take theirs."""
    torch.manual_seed(0)
    if check == "forward_features":
        return _timm_forward_features(name)
    backward = check.startswith("backward")
    model = _small(name, **({"num_classes": 42} if backward else {}))
    if backward:
        return _timm_backward(model.train(), check)
    model.eval()
    if check == "default_cfgs":
        return _timm_default_cfgs(name, model)
    with torch.inference_mode():
        x = torch.randn(1, *_timm_input_size(model, check))
        out = model(x)
        assert out.shape[0] == 1 and not out.isnan().any()
        if check == "forward_fx":
            assert torch.equal(torch.cat(tuple(_timm_fx_model(model)(x).values())), out)
