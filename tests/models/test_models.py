"""Model zoo: registry, timm integration, structure, exact conversion, resolution handling."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import timm
import torch
import torchvision
from torch import nn

import repmlp
from repmlp import create_model, list_models, reparameterize_model
from repmlp.models import RepMLPBottleneck, RepMLPLightBlock, ResNet
from repmlp.models.registry import OUTSIDE_TIMM, get_pretrained_cfg
from repmlp.models.resnet import RepMLPSpec, StageSpec, gc_block, make_stage, parse_stages
from zoo import SMALL_BUILDS, shallow

# Models this helper owns, with kwargs that keep a float64 forward pass cheap while exercising the same
# code paths: narrower, shallower ResNets (widths / 4, two blocks a stage: every block kind, see
# tests/zoo.py) at a resolution where c3 and c4 still have several (padded) partitions, the CIFAR
# family with narrower stages.
# Every small build but the face, segmentation and RepMLPNet families (they have test files of their own)
# and the patch-stem variant of repmlp_fmnist.
_ELSEWHERE = ("pspnet_", "mobilefacenet", "face_resnet", "repmlp_face_resnet", "repmlpnet_")
SMALL: dict[str, dict] = {
    n: kw for n, kw in SMALL_BUILDS.items() if not n.startswith(_ELSEWHERE) and n != "repmlp_fmnist_patch2"
}
OWN = tuple(SMALL)


def _randomize_bn(model: nn.Module) -> None:
    """Non-trivial BN statistics and affine parameters, so conversion errors cannot hide."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.rand(m.num_features, generator=g) - 0.5)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.rand(m.num_features, generator=g) - 0.5)


def _input(model: nn.Module, batch: int = 1, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    size = model.img_size if isinstance(model.img_size, tuple) else (model.img_size, model.img_size)
    return torch.randn(batch, model.in_chans, *size, dtype=dtype, generator=torch.Generator().manual_seed(2))


def test_all_own_models_registered() -> None:
    names = list_models()
    assert set(OWN) <= set(names)
    assert list_models("repmlp_res50_g*") == ["repmlp_res50_g4_8", "repmlp_res50_g8_16", "repmlp_res50_g8_8"]


@pytest.mark.parametrize("name", OWN)
def test_forward_and_exact_conversion(name: str) -> None:
    torch.manual_seed(0)
    model = create_model(name, **SMALL[name]).double()
    _randomize_bn(model)
    model.eval()
    x = _input(model)
    deployed = reparameterize_model(model)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in deployed.modules())
    fresh = create_model(name, deploy=True, **SMALL[name]).double().eval()
    fresh.load_state_dict(deployed.state_dict(), strict=True)
    with torch.no_grad():
        ref = model(x)
        assert ref.shape == (1, model.num_classes)
        for out in (deployed(x), fresh(x)):
            torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9 * ref.abs().max().item())


@pytest.mark.parametrize("name", sorted(set(list_models()) - set(OWN)))
def test_other_registered_models_deploy_structure(name: str) -> None:
    """Every other registered model (face, segmentation): deploy=True has the converted structure.

    Checked on the meta device (shapes only, nothing computed), built shallow (tests/zoo.py); numerical
    tests live with the models.
    """
    with torch.device("meta"):
        model = create_model(name, **shallow(name)).eval()
        deployed = reparameterize_model(model)
        fresh = create_model(name, deploy=True, **shallow(name))
    got = {k: tuple(v.shape) for k, v in fresh.state_dict().items()}
    assert got == {k: tuple(v.shape) for k, v in deployed.state_dict().items()}


def test_res50_without_repmlp_is_torchvision_resnet50() -> None:
    ours = create_model("repmlp_res50", stages=()).eval()
    ref = torchvision.models.resnet50(weights=None).eval()
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert [tuple(v.shape) for v in ours_sd.values()] == [tuple(v.shape) for v in ref_sd.values()]
    ours.load_state_dict(dict(zip(ours_sd, ref_sd.values(), strict=True)), strict=True)
    _randomize_bn(ref)
    ours.load_state_dict(dict(zip(ours_sd, ref.state_dict().values(), strict=True)), strict=True)
    # float64: ours runs its trunk in channels_last memory on CPU, whose float32 rounding differs.
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(ours.double()(x), ref.double()(x))


def test_repmlp_bottleneck_layout() -> None:
    """Paper Sec. 3.5: 1x1 (4x), 3x3 (r x), RepMLP, 3x3 (r x back), 1x1; residual."""
    block = RepMLPBottleneck(512, 512, 28, 7, reduction=2, groups=8, kernel_sizes=(1, 3, 5))
    assert (block.conv1.conv.in_channels, block.conv1.conv.out_channels) == (512, 128)
    assert block.conv2.conv.kernel_size == (3, 3) and block.conv2.conv.out_channels == 64
    assert (block.repmlp.in_channels, block.repmlp.out_channels, block.repmlp.groups) == (64, 64, 8)
    assert block.conv3.conv.kernel_size == (3, 3) and block.conv3.conv.out_channels == 128
    assert block.conv4.conv.out_channels == 512 and block.downsample is None
    light = RepMLPLightBlock(1024, 1024, 14, 7)
    assert light.conv1.conv.out_channels == 128 and light.conv1.conv.kernel_size == (1, 1)
    assert light.conv2.conv.kernel_size == (1, 1) and light.conv2.conv.out_channels == 1024
    outside_repmlp = [m for n, m in light.named_modules() if isinstance(m, nn.Conv2d) and "repmlp" not in n]
    assert all(m.kernel_size == (1, 1) for m in outside_repmlp)  # no 3x3 conv (only the RepMLP's)


def test_stage_selection_replaces_only_stride1_blocks() -> None:
    with torch.device("meta"):
        model = create_model("repmlp_res50", stages="c2+c4")
    kinds = [[type(b).__name__ for b in stage] for stage in model.stages]
    assert kinds[0] == ["RepMLPBottleneck"] * 3  # c2's first block has stride 1: replaced too
    assert kinds[1] == ["Bottleneck"] * 4
    assert kinds[2] == ["Bottleneck"] + ["RepMLPBottleneck"] * 5
    assert kinds[3] == ["Bottleneck"] * 3
    assert parse_stages("c3+c4") == parse_stages((3, 4)) == parse_stages(["c3", 4]) == (1, 2)
    with pytest.raises(ValueError, match="unknown stage"):
        parse_stages("c6")
    with pytest.raises(ValueError, match="^block must be 'bottleneck' or 'light'"):  # the option's name
        create_model("repmlp_res50", block="basic")


def test_stage_spec_composes_its_blocks() -> None:
    """A stage is what its spec says: the strided first block a plain bottleneck at the first dilation,
    the stride-1 ones RepMLP Bottlenecks, a Non-local block where asked; ``keep_first`` keeps a stride-1
    first block plain (the face ResNets, PSPNet's un-strided c4)."""
    rep = RepMLPSpec(partition=4, groups=2, kernel_sizes=(1, 3))
    spec = StageSpec(depth=3, width=64, stride=2, dilation=2, repmlp=rep, nonlocal_before=(2,))
    stage, res = make_stage(spec, 32, (16, 16))
    assert res == (8, 8)
    kinds = [type(b).__name__ for b in stage]
    assert kinds == ["Bottleneck", "RepMLPBottleneck", "NonLocalBlock", "RepMLPBottleneck"]
    assert stage[0].conv2.conv.stride == (2, 2) and stage[0].conv2.conv.dilation == (1, 1)
    assert stage[1].repmlp.resolution == (8, 8)  # built for the strided map
    unstrided = StageSpec(depth=2, width=64, dilation=2, first_dilation=2, repmlp=rep)
    assert type(make_stage(unstrided, 32, (8, 8))[0][0]).__name__ == "RepMLPBottleneck"
    kept, res = make_stage(replace(unstrided, keep_first=True), 32, (8, 8))
    assert res == (8, 8) and [type(b).__name__ for b in kept] == ["Bottleneck", "RepMLPBottleneck"]
    assert kept[0].conv2.conv.dilation == (2, 2) and kept[0].conv2.conv.stride == (1, 1)


def test_nl_and_gc_placement() -> None:
    with torch.device("meta"):
        nl = create_model("nl_res50")
        gc = create_model("gc_res50")
    kinds = [type(b).__name__ for b in nl.layer3]
    assert kinds == ["Bottleneck"] * 5 + ["NonLocalBlock", "Bottleneck"]
    with_gc = [[b.context is not None for b in stage] for stage in gc.stages]
    assert with_gc == [[False] * 3, [True] * 4, [True] * 6, [True] * 3]


def test_gc_block_is_gcnets_setting() -> None:
    """timm's GlobalContext as GCNet's ImageNet block: add fusion only, a C/16 bottleneck with LayerNorm (eps
    1e-5, GCNet's), and the identity at the start (its last conv all zeros, the bias too)."""
    gc = gc_block(256).eval()
    assert gc.mlp_scale is None and gc.mlp_add.fc1.out_channels == 16 and gc.mlp_add.norm.eps == 1e-5
    x = torch.randn(2, 256, 5, 5)
    assert torch.equal(gc(x), x)


def test_num_classes_in_chans_img_size_honoured() -> None:
    model = create_model("repmlp_res50", num_classes=7, in_chans=1, img_size=128, widths=(64, 128, 256, 512))
    assert model.stage_resolutions == [(32, 32), (16, 16), (8, 8), (4, 4)]
    assert model.pretrained_cfg["input_size"] == (1, 128, 128)
    assert model.eval()(torch.randn(1, 1, 128, 128)).shape == (1, 7)
    fm = create_model("repmlp_fmnist", num_classes=5)
    assert fm(torch.randn(3, 1, 28, 28)).shape == (3, 5)
    cifar = create_model("repmlp_cifar", img_size=64, widths=(4, 8, 16), in_chans=2)
    assert cifar(torch.randn(1, 2, 64, 64)).shape == (1, 10)


def test_wrong_resolution_is_a_clear_error() -> None:
    model = create_model("repmlp_res50", widths=(64, 128, 256, 512)).eval()
    with pytest.raises(ValueError, match="built for 224x224 inputs, got 192x192.*img_size=192"):
        model(torch.randn(1, 3, 192, 192))
    with pytest.raises(ValueError, match="in_chans|expected input"):
        model(torch.randn(1, 1, 224, 224))
    cifar = create_model("repmlp_cifar", widths=(4, 8, 16))
    with pytest.raises(ValueError, match="img_size"):
        cifar(torch.randn(1, 3, 28, 28))
    with pytest.raises(ValueError, match="divisible"):
        create_model("repmlp_cifar", img_size=30)


def test_timm_create_model() -> None:
    model = timm.create_model("repmlp_fmnist", pretrained=False, num_classes=3)
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 3)
    assert model.pretrained_cfg["input_size"] == (1, 28, 28) and model.pretrained_cfg["num_classes"] == 3
    assert "repmlp_res50_light" in timm.list_models("repmlp_*")
    cfg = timm.get_pretrained_cfg("repmlp_res50_g4_8")
    assert cfg is not None and cfg.input_size == (3, 320, 320)
    with torch.device("meta"):
        big = timm.create_model("repmlp_res50", in_chans=4, pretrained_cfg_overlay={"crop_pct": 1.0})
    assert big.stem.conv.conv.in_channels == 4
    with pytest.raises(ValueError, match="no pretrained weights"):
        timm.create_model("repmlp_cifar", pretrained=True)


def test_every_family_registers_its_models_as_timms_do() -> None:
    """Each model's cfg is its family module's ``default_cfgs`` entry (where timm's ``register_model`` reads
    it), also for the models outside timm, and the entrypoint timm (or repmlp) holds is the module's own."""
    for name in list_models():
        entry = OUTSIDE_TIMM.get(name) or timm.models.model_entrypoint(name)
        module = sys.modules[entry.__module__]
        assert getattr(module, name) is entry and name in module.default_cfgs, name
        assert get_pretrained_cfg(name) == replace(module.default_cfgs[name].default, architecture=name), name


def test_create_model_fallbacks_and_unknown_names() -> None:
    tm = create_model("resnet18", num_classes=4)  # timm's
    assert tm.get_classifier().out_features == 4
    tv = create_model("torchvision:resnet18", num_classes=4, deploy=True)
    assert isinstance(tv, nn.Module)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in tv.modules())
    with pytest.raises(ValueError, match="unknown model 'repmlp_res5O'"):  # close names: at the command line
        create_model("repmlp_res5O")
    with pytest.raises(ValueError, match="unknown model"):
        create_model("definitely_not_a_model_xyz")
    with pytest.raises(ValueError, match="unknown model source"):
        create_model("keras:resnet50")


def test_package_exports() -> None:
    assert repmlp.create_model is create_model and repmlp.list_models is list_models
    assert callable(repmlp.profile)
    assert timm.models.model_entrypoint("repmlp_res50").__module__ == "repmlp.models.resnet"
    assert isinstance(create_model("repmlp_res50", stages=(), widths=(64, 128, 256, 512)), ResNet)
