"""reparameterize_model: RepMLP blocks, BN folding in foreign models (torch.fx), reporting, timm."""

from __future__ import annotations

import logging

import pytest
import timm.utils
import torch
import torchvision
from torch import nn

from repmlp import ConvBN, RepMLPBlock, reparameterize_model

pytestmark = pytest.mark.usefixtures("one_thread")

BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@torch.no_grad()
def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, BN_TYPES):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
            m.weight.copy_(torch.rand(n, generator=gen) + 0.5)
            m.bias.copy_(torch.randn(n, generator=gen) * 0.1)
    return model


def count_bn(model: nn.Module) -> int:
    return sum(isinstance(m, BN_TYPES) for m in model.modules())


class RepMLPNet(nn.Module):
    """A small model mixing this package's blocks with plain conv/linear + BN pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block1 = RepMLPBlock(8, 8, 12, 6, groups=2, kernel_sizes=(1, 3))
        self.conv = ConvBN(8, 8, 3)
        self.block2 = RepMLPBlock(8, 8, 12, (4, 6), groups=4, kernel_sizes=((1, 3), 3))
        self.head_fc = nn.Linear(8, 5)
        self.head_bn = nn.BatchNorm1d(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = x + self.block1(x)
        x = torch.relu(self.conv(x))
        x = self.block2(x)
        return self.head_bn(self.head_fc(x.mean((2, 3))))


def test_raises_in_training_mode():
    with pytest.raises(RuntimeError, match="eval"):
        reparameterize_model(RepMLPNet().train())


def test_converts_whole_model_without_batchnorm_left():
    torch.manual_seed(0)
    model = randomize_bn(RepMLPNet().double()).eval()
    x = torch.randn(3, 3, 12, 12, dtype=torch.float64)
    with torch.no_grad():
        ref = model(x)
        deployed = reparameterize_model(model)
        out = deployed(x)
    assert rel_err(out, ref) < 1e-10
    # The head's BatchNorm1d stays: a fold into the Linear is exact only on 2-D input (see below).
    assert count_bn(deployed) == 1 and list(deployed.unfused_batchnorms) == ["head_bn"]
    assert not any(isinstance(m, nn.Conv2d) for m in deployed.block1.modules())
    assert not deployed.training
    # inplace=False left the original alone; inplace=True converts it.
    assert count_bn(model) > 0 and not model.block1.deploy
    same = reparameterize_model(model, inplace=True)
    assert model.block1.deploy and model.conv.deploy
    with torch.no_grad():
        assert rel_err(same(x), ref) < 1e-10


def test_fuse_bn_false_keeps_plain_batchnorms():
    model = randomize_bn(RepMLPNet()).eval()
    deployed = reparameterize_model(model, fuse_bn=False)
    assert deployed.block1.deploy and deployed.conv.deploy
    assert isinstance(deployed.stem[1], nn.BatchNorm2d) and isinstance(deployed.head_bn, nn.BatchNorm1d)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_folds_batchnorm_in_torchvision_resnet50(dtype):
    torch.manual_seed(0)
    model = randomize_bn(torchvision.models.resnet50(weights=None)).to(dtype).eval()
    assert count_bn(model) == 53
    x = torch.randn(2, 3, 64, 64, dtype=dtype)
    with torch.no_grad():
        ref = model(x)
        fused = reparameterize_model(model)
        out = fused(x)
    assert count_bn(fused) == 0 and list(fused.unfused_batchnorms) == []
    assert rel_err(out, ref) < (1e-10 if dtype == torch.float64 else 1e-4)
    # The model keeps its class and so torchvision's own forward (its in-place residual adds), as torch.ao's
    # fuse_modules leaves it: a baseline timmed after the fold runs as torchvision runs it.
    assert type(fused) is torchvision.models.ResNet and isinstance(fused.layer1[0].bn1, torch.nn.Identity)


def test_a_conv_called_twice_keeps_its_batchnorm():
    """The fold swaps modules in place, so a conv (or BN) that the forward calls twice is not folded: its
    other call would see the fused weights."""

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = torch.nn.Conv2d(3, 3, 1), torch.nn.BatchNorm2d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.conv(x)) + self.conv(x)

    torch.manual_seed(0)
    model = randomize_bn(Twice()).eval()
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        ref, fused = model(x), reparameterize_model(model)
        assert list(fused.unfused_batchnorms) == ["bn"] and torch.equal(fused(x), ref)


def test_folds_timm_batchnorm_act_keeping_its_activation():
    # timm's EfficientNets normalise with BatchNormAct2d (BN + drop + act in one BatchNorm2d subclass).
    torch.manual_seed(0)
    model = randomize_bn(timm.create_model("efficientnet_b0", num_classes=10)).double().eval()
    assert any(type(m).__name__ == "BatchNormAct2d" for m in model.modules())
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        ref = model(x)
        fused = reparameterize_model(model)
        out = fused(x)
    assert count_bn(fused) == 0 and list(fused.unfused_batchnorms) == []
    assert rel_err(out, ref) < 1e-10


@pytest.mark.parametrize("shape", [(3, 8), (3, 8, 8)])
def test_linear_batchnorm1d_stays_whatever_the_input_rank(shape):
    # BatchNorm1d normalises dim 1: the Linear's features on (N, F), but the length on (N, L, F), where a
    # fold into the Linear would compute another function. The walk cannot see the rank, so it folds neither.
    torch.manual_seed(0)
    for model in (nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), _LinearBN()):
        model = randomize_bn(model.double()).eval()
        x = torch.randn(*shape, dtype=torch.float64)
        with torch.no_grad():
            ref = model(x)
            converted = reparameterize_model(model)
            out = converted(x)
        assert list(converted.unfused_batchnorms) == [
            n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm1d)
        ]
        assert rel_err(out, ref) < 1e-12


@pytest.mark.parametrize("container", [True, False])
def test_conv1d_batchnorm1d_folds_as_its_output_keeps_channels_in_dim_1(container):
    """A Conv1d's batched output is (N, C, L): the BatchNorm1d after it folds, in a Sequential and through fx."""
    torch.manual_seed(0)
    model = _ConvBN1d() if not container else nn.Sequential(nn.Conv1d(4, 6, 3), nn.BatchNorm1d(6), nn.ReLU())
    model = randomize_bn(model.double()).eval()
    x = torch.randn(3, 4, 9, dtype=torch.float64)
    with torch.no_grad():
        ref = model(x)
        converted = reparameterize_model(model)
        out = converted(x)
    assert count_bn(converted) == 0 and list(converted.unfused_batchnorms) == []
    assert rel_err(out, ref) < 1e-12


class _ConvBN1d(nn.Module):
    """A Conv1d and a BatchNorm1d outside any Sequential: the torch.fx path."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv1d(4, 6, 3), nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)).relu()


class _LinearBN(nn.Module):
    """A Linear and a BatchNorm1d outside any Sequential: the torch.fx path."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


class _Unfusable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn_after_relu = nn.BatchNorm2d(4)  # follows a ReLU, not a conv
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.bn_shared_input = nn.BatchNorm2d(4)  # conv2's output is also used elsewhere
        self.conv3 = nn.Conv2d(4, 4, 1)
        self.bn_fusable = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn_after_relu(torch.relu(self.conv(x)))
        z = self.conv2(y)
        return self.bn_shared_input(z) + z + self.bn_fusable(self.conv3(y))


def test_reports_batchnorms_it_could_not_fuse(caplog):
    torch.manual_seed(0)
    model = randomize_bn(_Unfusable()).eval()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        ref = model(x)
        with caplog.at_level(logging.INFO, logger="repmlp.nn.convert"):
            fused = reparameterize_model(model)
        out = fused(x)
    assert sorted(fused.unfused_batchnorms) == ["bn_after_relu", "bn_shared_input"]
    assert "bn_after_relu" in caplog.text and "bn_shared_input" in caplog.text
    assert rel_err(out, ref) < 1e-5


def test_a_batchnorm_without_running_statistics_stays():
    """In eval mode it normalises with each batch's own statistics: nothing to fold, and no error."""
    pair = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False))
    model = nn.Sequential(pair, nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4, track_running_stats=False)).eval()
    x = torch.randn(2, 3, 6, 6)
    fused = reparameterize_model(model)  # the first pair inside a Sequential, the second through torch.fx
    assert list(fused.unfused_batchnorms) == ["0.1", "2"]
    torch.testing.assert_close(fused(x), model(x))


class _Untraceable(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it, so only Sequential pairs are folded."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4))
        self.conv = nn.Conv2d(4, 4, 1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.seq(x)
        if x.sum() > 0:
            return self.bn(self.conv(x))
        return x


def test_untraceable_model_keeps_and_reports_remaining_batchnorm(caplog):
    model = randomize_bn(_Untraceable()).eval()
    with caplog.at_level(logging.WARNING, logger="repmlp.nn.convert"):
        fused = reparameterize_model(model)
    assert list(fused.unfused_batchnorms) == ["bn"]
    assert isinstance(fused.seq[1], nn.Identity)
    assert "could not trace" in caplog.text


def test_timm_reparameterize_model_converts_repmlp_blocks():
    torch.manual_seed(0)
    model = randomize_bn(RepMLPNet().double()).eval()
    x = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    with torch.no_grad():
        ref = model(x)
        converted = timm.utils.reparameterize_model(model)
        out = converted(x)
    assert converted.block1.deploy and converted.block2.deploy and converted.conv.deploy
    assert converted.block1.local_perceptron is None and converted.block1.partition_perceptron.bn is None
    assert rel_err(out, ref) < 1e-10
    # timm's conversion gives exactly the state dict a deploy=True block expects.
    fresh = RepMLPBlock(8, 8, 12, 6, groups=2, kernel_sizes=(1, 3), deploy=True)
    fresh.load_state_dict(converted.block1.float().state_dict(), strict=True)


def test_reparameterize_model_accepts_syncbatchnorm():
    """A model trained multi-GPU holds SyncBatchNorm; in eval mode it is a plain BN and must convert."""
    from repmlp import create_model, reparameterize_model

    torch.manual_seed(0)
    model = create_model("repmlp_fmnist", num_classes=10).double()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    syncs = [m for m in model.modules() if isinstance(m, nn.SyncBatchNorm)]
    assert syncs
    for bn in syncs:  # randomised statistics, so a wrong fold shows
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.data.uniform_(0.5, 2)
        bn.bias.data.uniform_(-1, 1)
    model.eval()
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    ref = model(x)
    deployed = reparameterize_model(model)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in deployed.modules())
    torch.testing.assert_close(deployed(x), ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    ("name", "dtype", "tol"),
    [
        # RepViT's conv-BN, BN-linear and RepVGG-dw blocks convert through fuse(), whose result must
        # replace them in their parent. Float32: timm's ConvNorm.fuse() builds its conv in float32
        # whatever the model's dtype.
        ("repvit_m0_9", torch.float32, 1e-5),
        ("mobileone_s0", torch.float64, 1e-10),  # MobileOne blocks: reparameterize() in place
    ],
)
def test_converts_timm_reparameterizable_models_as_timm_does(name, dtype, tol):
    torch.manual_seed(0)
    model = randomize_bn(timm.create_model(name, pretrained=False, num_classes=10)).to(dtype).eval()
    assert count_bn(model) > 0
    x = torch.randn(2, 3, 64, 64, dtype=dtype)
    with torch.no_grad():
        ref = model(x)
        converted = reparameterize_model(model)
        out = converted(x)
        timm_out = timm.utils.reparameterize_model(model)(x)
    assert count_bn(converted) == 0 and list(converted.unfused_batchnorms) == []
    assert not {type(m).__name__ for m in converted.modules()} & {"ConvNorm", "NormLinear", "RepVggDw"}
    assert rel_err(out, ref) < tol
    # The same hooks in timm's order and nothing left for BN folding: exactly timm's own result.
    assert torch.equal(out, timm_out)


class _Recorder(nn.Module):
    """``switch_to_deploy()`` appends its tag to a shared log."""

    def __init__(self, tag: str, log: list[str]) -> None:
        super().__init__()
        self.tag, self.log = tag, log

    def switch_to_deploy(self) -> None:
        self.log.append(f"switch {self.tag}")


class _Fusable(nn.Module):
    """``fuse()`` returns a replacement that still holds convertible modules; ``reparameterize()`` must lose
    to ``fuse()`` (timm's order of preference), and the replaced child is never visited."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log
        self.old_child = _Recorder("replaced", log)

    def fuse(self) -> nn.Module:
        self.log.append("fuse")
        return nn.Sequential(ConvBN(2, 2, 3), _Recorder("in-fused", self.log))

    def reparameterize(self) -> None:
        self.log.append("reparameterize fusable")


class _Parent(nn.Module):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log
        self.a = _Fusable(log)
        self.b = nn.ModuleList([_Recorder("b0", log)])

    def reparameterize(self) -> None:
        self.log.append("reparameterize parent")


def test_conversion_hooks_run_parents_first_and_fuse_results_replace_modules():
    log: list[str] = []
    # In place: a copy would log into a copy of ``log``.
    converted = reparameterize_model(_Parent(log).eval(), inplace=True, fuse_bn=False)
    assert log == ["reparameterize parent", "fuse", "switch in-fused", "switch b0"]
    assert isinstance(converted.a, nn.Sequential)
    assert converted.a[0].deploy  # the walk went on into what fuse() returned


@pytest.mark.parametrize("inplace", [False, True])
def test_hooks_of_the_training_model_stay_off_the_converted_copy(inplace: bool):
    """A copy carries no hooks of the training model (the block itself stays a module of the copy, the fused
    conv is a copy of the training conv); in place they stay, and the training model keeps its own."""
    model = RepMLPNet().eval()
    fired: list[str] = []
    for name in ("block1", "stem.0", "conv"):
        m = model.get_submodule(name)
        m.register_forward_hook(lambda *_, name=name: fired.append(name))
        m.register_forward_pre_hook(lambda *_, name=name: fired.append(f"pre {name}"))
    x = torch.randn(2, 3, 12, 12)
    model(x)
    seen = list(fired)
    assert len(seen) == 6
    fired.clear()
    deployed = reparameterize_model(model, inplace=inplace)
    deployed(x)
    assert fired == ([] if not inplace else seen)
    fired.clear()
    if not inplace:
        model(x)
        assert fired == seen
