"""RepMLPNet: published counts, Locality Injection equivalence, deploy form, timm contract."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.fx
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import nn

import repmlp
from repmlp import create_model, reparameterize_model
from repmlp.bench.counts import profile_model
from repmlp.models.repmlpnet import RepMLPNetBlock

pytestmark = pytest.mark.usefixtures("one_thread")

# The authors' README/paper: training-time params (M) and FLOPs (G, = MACs).
PUBLISHED = {
    "repmlpnet_t224": (38.3, 2.8),
    "repmlpnet_t256": (58.7, 4.2),
    "repmlpnet_b224": (68.2, 6.7),
    "repmlpnet_b256": (96.5, 9.6),
    "repmlpnet_d256": (86.9, 8.6),
    "repmlpnet_l256": (117.7, 11.5),
}

# Small configurations: two partitions per side in most stages, several share sets per stage.
SMALL = dict(
    img_size=32,
    patch_size=2,
    channels=(8, 16, 16, 32),
    depths=(1, 1, 2, 1),
    sharesets=(2, 4, 4, 8),
    partitions=(8, 4, 4, 2),
    kernel_sizes=(1,),
    num_classes=5,
)
SMALL_K3 = dict(SMALL, img_size=48, partitions=(12, 6, 3, 3), kernel_sizes=(1, 3))
WHOLE_MAP = dict(SMALL, img_size=48, partitions=None, kernel_sizes=(1, 3))


@torch.no_grad()
def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=gen, dtype=torch.float64) * 0.3)
            m.running_var.copy_(torch.rand(n, generator=gen, dtype=torch.float64) * 1.5 + 0.3)
            m.weight.copy_(torch.rand(n, generator=gen, dtype=torch.float64) + 0.5)
            m.bias.copy_(torch.randn(n, generator=gen, dtype=torch.float64) * 0.3)
    return model


def small(name: str = "repmlpnet_b224", cfg: dict | None = None, **kw) -> nn.Module:
    torch.manual_seed(0)
    model = create_model(name, **{**(cfg or SMALL), **kw}).double()
    return randomize(model).eval()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_training_time_params_match_published(name):
    """Training-form params within 1% (the deployed form's params and MACs: tests/bench/test_profile.py)."""
    params, _ = profile_model(name, deploy=False)
    assert abs(params / 1e6 - PUBLISHED[name][0]) / PUBLISHED[name][0] < 0.01


@pytest.mark.parametrize("cfg", [SMALL, SMALL_K3, WHOLE_MAP], ids=["k1", "k13", "whole-map"])
def test_locality_injection_is_equivalent_in_float64(cfg):
    model = small(cfg=cfg)
    x = torch.randn(3, 3, cfg["img_size"], cfg["img_size"], dtype=torch.float64)
    with torch.no_grad():
        ref = model(x)
        deployed = reparameterize_model(model)
        out = deployed(x)
    assert not any(isinstance(m, repmlp.LocalPerceptron) for m in deployed.modules())
    assert all(m.deploy for m in deployed.modules() if isinstance(m, RepMLPNetBlock))
    assert torch.allclose(out, ref, rtol=1e-10, atol=1e-12)
    # deploy=True builds exactly the converted structure.
    built = create_model("repmlpnet_b224", deploy=True, **cfg).double().eval()
    built.load_state_dict(deployed.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.allclose(built(x), ref, rtol=1e-10, atol=1e-12)


def _authors_block(block: RepMLPNetBlock, x: torch.Tensor) -> torch.Tensor:
    """The authors' formulation of one block (released case: one partition per map), written from
    their description: FC3 a grouped 1x1 conv on ``(-1, S*h*w, 1, 1)`` rows, BN2d(S), depthwise
    Local branches on ``(-1, S, h, w)``, channel gate multiplied on the output."""
    n, c, hh, ww = x.shape
    s = block.sharesets
    gate = torch.sigmoid(block.gp.fc2(F.relu(block.gp.fc1(F.adaptive_avg_pool2d(x, 1)))))
    parts = x.reshape(n, c, 1, hh, 1, ww).permute(0, 2, 4, 1, 3, 5)
    fc = F.conv2d(
        parts.reshape(-1, s * hh * ww, 1, 1), block.fc3.weight.reshape(s * hh * ww, hh * ww, 1, 1), groups=s
    )
    out = block.fc3_bn(fc.reshape(-1, s, hh, ww))
    conv_in = parts.reshape(-1, s, hh, ww)
    for branch in block.local.branches:
        out = out + branch(conv_in)
    out = out.reshape(-1, 1, 1, s, hh, ww).permute(0, 3, 1, 4, 2, 5).reshape(n, c, hh, ww)
    return out * gate


def test_block_matches_the_authors_formulation():
    torch.manual_seed(1)
    block = randomize(RepMLPNetBlock(16, 6, 6, 4, kernel_sizes=(1, 3)).double()).eval()
    x = torch.randn(2, 16, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(block(x), _authors_block(block, x), rtol=1e-12, atol=1e-12)


def test_timm_contract_and_features():
    model = timm.create_model("repmlpnet_t224", **SMALL).eval()
    x = torch.randn(2, 3, 32, 32)
    feats = model.forward_features(x)
    assert feats.shape == (2, model.num_features, 2, 2)
    assert model.forward_head(feats, pre_logits=True).shape == (2, model.head_hidden_size)
    model.reset_classifier(7)
    assert model(x).shape == (2, 7) and model.get_classifier().out_features == 7
    cfg = model.pretrained_cfg
    assert (cfg["interpolation"], cfg["crop_mode"], cfg["crop_pct"]) == ("bilinear", "squash", 0.875)
    assert cfg["fixed_input_size"] and cfg["classifier"] == "head"
    # The authors' evaluation normalises with ImageNet's statistics, timm's defaults.
    assert tuple(cfg["mean"]) == IMAGENET_DEFAULT_MEAN and tuple(cfg["std"]) == IMAGENET_DEFAULT_STD
    extractor = timm.create_model("repmlpnet_t224", features_only=True, **SMALL).eval()
    shapes = [tuple(t.shape) for t in extractor(x)]
    assert shapes == [(2, 8, 16, 16), (2, 16, 8, 8), (2, 16, 4, 4), (2, 32, 2, 2)]
    assert extractor.feature_info.reduction() == [2, 4, 8, 16]


def test_fx_traceable_and_rejects_wrong_size():
    model = small()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    traced = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        assert torch.equal(traced(x), model(x))
    with pytest.raises(ValueError, match="built for"):
        traced(torch.randn(1, 3, 40, 40, dtype=torch.float64))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sharesets=(3, 4, 4, 8)), "sharesets=3 must divide"),
        (dict(partitions=(5, 4, 4, 2)), "must divide the resolution"),
        (dict(kernel_sizes=(5,), partitions=(8, 4, 4, 2)), "kernel_sizes entries"),
        (dict(img_size=31), "multiple of patch_size"),
    ],
)
def test_bad_options_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        create_model("repmlpnet_b224", **{**SMALL, **kwargs})
