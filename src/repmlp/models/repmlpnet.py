"""RepMLPNet (Ding et al., "RepMLPNet: Hierarchical Vision MLP with Re-parameterized Locality", CVPR 2022).

Structure (the authors' ``repmlpnet.py``)::

    stem: 4x4/4 conv-BN-ReLU  ->  4 stages  ->  BN  ->  global average pool  ->  FC
    stage i: (i > 0: 2x2/2 conv-BN-ReLU)  ->  depths[i] units
    unit:    x + RepMLP(BN(x));  then  y + FFN(BN(y))          FFN: 1x1 conv-BN, GELU, 1x1 conv-BN (x4)

Its RepMLP block (:class:`RepMLPNetBlock`) differs from RepMLP-Res50's (:class:`repmlp.RepMLPBlock`): the
Global Perceptron is a channel gate multiplied onto the output; FC3 is shared by channel sets (channel
``c`` uses set ``c mod S``, ``S`` "sharesets": a :class:`repmlp.GroupwiseLinear` of ``S`` groups, then
``BatchNorm2d(S)`` in training); the Local Perceptron's depthwise conv-BN branches on the ``S`` sets merge
into FC3 by Locality Injection. The released models partition the whole map (``h = H``); ``partitions=``
gives smaller ones. Key names are our own; ``repmlp import`` maps the authors' and mmpretrain's onto them.
"""

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from timm.models import generate_default_cfgs, register_model
from torch import Tensor, nn

from repmlp.models.layers import ConvBNReLU, PooledClassifierMixin, build, cfg, check_input_size
from repmlp.nn import block as rep
from repmlp.nn.block import LocalPerceptron
from repmlp.nn.layers import ConvBN, GroupwiseLinear
from repmlp.nn.reparam import merge_fc3, ntuple

__all__ = ["RepMLPNet", "RepMLPNetBlock", "RepMLPNetUnit", "ChannelGate", "ConvFFN", "REPMLPNET_ARCHS",
           "repmlpnet_t224", "repmlpnet_t256", "repmlpnet_b224", "repmlpnet_b256", "repmlpnet_d256",
           "repmlpnet_l256"]  # fmt: skip

# (channels, depths, sharesets) of the authors' six models; the suffix is the input resolution.
REPMLPNET_ARCHS: dict[str, dict[str, Any]] = {
    "t": dict(channels=(64, 128, 256, 512), depths=(2, 2, 6, 2), sharesets=(1, 4, 16, 128)),
    "b": dict(channels=(96, 192, 384, 768), depths=(2, 2, 12, 2), sharesets=(1, 4, 32, 128)),
    "d": dict(channels=(80, 160, 320, 640), depths=(2, 2, 18, 2), sharesets=(1, 4, 16, 128)),
    "l": dict(channels=(96, 192, 384, 768), depths=(2, 2, 18, 2), sharesets=(1, 4, 32, 256)),
}


class ChannelGate(nn.Module):
    """RepMLPNet's Global Perceptron: per-channel weights from the pooled input.

    Average pool -> 1x1 conv ``C -> C/reduction`` (bias) -> ReLU -> 1x1 conv (bias) -> sigmoid.

    Shapes: ``(N, C, H, W)`` -> ``(N, C, 1, 1)``.
    """

    def __init__(self, channels: int, reduction: int = 4) -> None:
        super().__init__()
        hidden = channels // reduction
        if hidden < 1:
            raise ValueError(f"gate reduction {reduction} leaves no hidden channels for {channels} channels")
        self.fc1 = nn.Conv2d(channels, hidden, 1)  # 1x1 convs on a 1x1 map: the checkpoints' layout
        self.fc2 = nn.Conv2d(hidden, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        v = x.mean((2, 3), keepdim=True)
        return torch.sigmoid(self.fc2(F.relu(self.fc1(v))))


class RepMLPNetBlock(nn.Module):
    """RepMLPNet's RepMLP block: channel-gate Global Perceptron, shared-set Partition Perceptron, Local.

    Args:
        channels: ``C`` (input = output channels).
        resolution: ``(H, W)`` of the input.
        partition: ``(h, w)``; must divide ``(H, W)``.
        sharesets: ``S``; FC3 parameter sets, channel ``c`` uses set ``c mod S``; must divide ``C``.
        kernel_sizes: Local Perceptron's odd kernel sizes (``()`` for none).
        gate_reduction: hidden width of the channel gate is ``C // gate_reduction``.
        deploy: build the locality-injected form (FC3 with bias; no BN after FC3, no conv).

    Shapes: ``(N, C, H, W)`` -> ``(N, C, H, W)``.
    """

    def __init__(
        self,
        channels: int,
        resolution: int | Sequence[int],
        partition: int | Sequence[int],
        sharesets: int,
        *,
        kernel_sizes: Sequence[int] = (1, 3),
        gate_reduction: int = 4,
        deploy: bool = False,
    ) -> None:
        super().__init__()
        H, W = ntuple(resolution, 2, "resolution")
        h, w = ntuple(partition, 2, "partition")
        if h < 1 or w < 1 or H % h or W % w:
            raise ValueError(f"partition {h}x{w} must divide the resolution {H}x{W}")
        if sharesets < 1 or channels % sharesets:
            raise ValueError(f"sharesets={sharesets} must divide channels={channels}")
        self.channels, self.sharesets = channels, sharesets
        self.resolution, self.partition = (H, W), (h, w)
        self.parts = (H // h, W // w)
        self.gp = ChannelGate(channels, gate_reduction)
        self.fc3 = GroupwiseLinear(sharesets * h * w, sharesets * h * w, sharesets, bias=deploy)
        self.fc3_bn: nn.BatchNorm2d | None = None if deploy else nn.BatchNorm2d(sharesets)
        kernels = tuple(kernel_sizes)
        for k in kernels:
            if not isinstance(k, int) or k < 1 or k % 2 == 0 or k > min(h, w):
                raise ValueError(f"kernel_sizes entries must be odd ints <= the partition {h}x{w}, got {k!r}")
        self.local: LocalPerceptron | None = (
            LocalPerceptron(sharesets, sharesets, [(k, k) for k in kernels], groups=sharesets)
            if kernels and not deploy
            else None
        )
        self.kernel_sizes = kernels

    @property
    def deploy(self) -> bool:
        return self.fc3_bn is None

    def extra_repr(self) -> str:
        return (
            f"channels={self.channels}, resolution={self.resolution}, partition={self.partition}, "
            f"sharesets={self.sharesets}, kernel_sizes={self.kernel_sizes}, deploy={self.deploy}"
        )

    def forward(self, x: Tensor) -> Tensor:
        S, (h, w), (hp, wp) = self.sharesets, self.partition, self.parts
        C = self.channels
        gate = self.gp(x)
        # (N, C/S, S, hp, h, wp, w) -> (S, N*hp*wp*C/S, h*w): one FC3 input row per (partition, set member).
        rows = x.reshape(-1, C // S, S, hp, h, wp, w).permute(2, 0, 3, 5, 1, 4, 6).reshape(S, -1, h * w)
        y = self.fc3(rows).transpose(0, 1)  # (B, S, h*w)
        if self.fc3_bn is not None:
            y = self.fc3_bn(y.unsqueeze(-1)).squeeze(-1)
        if self.local is not None:
            y = y + self.local(rows.transpose(0, 1).reshape(-1, S, h, w)).reshape(-1, S, h * w)
        t = y.reshape(-1, hp, wp, C // S, S, h, w).permute(0, 3, 4, 1, 5, 2, 6)  # (N, C/S, S, hp, h, wp, w)
        return rep.merge_image(t, rep.is_channels_last(x)) * gate  # in x's memory format

    @torch.no_grad()
    def merged_fc3(self) -> tuple[Tensor, Tensor]:
        """FC3 kernel ``(S*h*w, h*w)`` and bias ``(S*h*w,)`` with ``fc3_bn`` and every Local branch merged.

        By :func:`repmlp.nn.reparam.merge_fc3`, which spreads the ``BatchNorm2d(S)`` over each set's ``h*w``
        rows. Uses running statistics (equivalent in eval mode); half-precision blocks merge in float32.
        """
        branches = [] if self.local is None else self.local.branches
        return merge_fc3(
            self.fc3.weight,
            self.fc3.bias,
            self.fc3_bn,
            [(b.conv.weight, b.conv.bias, b.bn) for b in branches],
            self.partition,
            self.sharesets,
        )

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Locality Injection in place: FC3 absorbs its BN and the Local Perceptron (eval mode)."""
        if self.deploy:
            return
        weight, bias = self.merged_fc3()
        n = self.fc3.in_features
        fc3 = GroupwiseLinear(n, n, self.sharesets, bias=True).to(device=weight.device, dtype=weight.dtype)
        fc3.train(self.training)
        fc3.weight.copy_(weight)
        fc3.bias.copy_(bias)
        self.fc3, self.fc3_bn, self.local = fc3, None, None


class ConvFFN(nn.Module):
    """1x1 conv-BN ``C -> C*expand``, GELU, 1x1 conv-BN back to ``C``. Shapes: ``(N,C,H,W)`` kept."""

    def __init__(self, channels: int, expand: int = 4, *, deploy: bool = False) -> None:
        super().__init__()
        self.fc1 = ConvBN(channels, channels * expand, 1, deploy=deploy)
        self.fc2 = ConvBN(channels * expand, channels, 1, deploy=deploy)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class RepMLPNetUnit(nn.Module):
    """``y = x + RepMLP(BN(x)); z = y + FFN(BN(y))``. Shapes: ``(N, C, H, W)`` kept."""

    def __init__(
        self,
        channels: int,
        resolution: tuple[int, int],
        partition: tuple[int, int],
        sharesets: int,
        *,
        kernel_sizes: Sequence[int],
        gate_reduction: int,
        ffn_expand: int,
        deploy: bool,
    ) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(channels)
        options = dict(kernel_sizes=kernel_sizes, gate_reduction=gate_reduction, deploy=deploy)
        self.repmlp = RepMLPNetBlock(channels, resolution, partition, sharesets, **options)
        self.norm2 = nn.BatchNorm2d(channels)
        self.ffn = ConvFFN(channels, ffn_expand, deploy=deploy)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.repmlp(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class RepMLPNetStage(nn.Module):
    """Optional 2x2/2 conv-BN-ReLU downsampling, then the stage's units."""

    def __init__(self, downsample: nn.Module | None, units: Sequence[nn.Module]) -> None:
        super().__init__()
        self.downsample = downsample if downsample is not None else nn.Identity()
        self.blocks = nn.Sequential(*units)

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(self.downsample(x))


class RepMLPNet(PooledClassifierMixin, nn.Module):
    """Hierarchical vision MLP built of RepMLP blocks (timm model contract).

    Args:
        img_size: input resolution (int or ``(H, W)``); fixes every FC's size.
        in_chans: input channels.
        num_classes: classifier outputs (0: ``forward`` returns pooled features).
        channels, depths, sharesets: per stage (see :data:`REPMLPNET_ARCHS`).
        patch_size: stem conv kernel and stride.
        partitions: per-stage ``(h, w)`` (or ints); default: the whole feature map, as released.
        kernel_sizes: Local Perceptron kernels (the released models: ``(1, 3)``).
        gate_reduction: channel gate reduction (4).
        ffn_expand: FFN hidden width factor (4).
        drop_rate: dropout before the classifier.
        global_pool: ``"avg"`` or ``""`` (no pooling in :meth:`forward_head`).
        deploy: build the locality-injected, conv-BN-fused inference form.

    Shapes: ``(N, in_chans, H, W)`` -> ``(N, num_classes)``.
    """

    def __init__(
        self,
        img_size: int | Sequence[int] = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        *,
        channels: Sequence[int] = (96, 192, 384, 768),
        depths: Sequence[int] = (2, 2, 12, 2),
        sharesets: Sequence[int] = (1, 4, 32, 128),
        patch_size: int = 4,
        partitions: Sequence[int | Sequence[int]] | None = None,
        kernel_sizes: Sequence[int] = (1, 3),
        gate_reduction: int = 4,
        ffn_expand: int = 4,
        drop_rate: float = 0.0,
        global_pool: str = "avg",
        deploy: bool = False,
    ) -> None:
        super().__init__()
        n = len(channels)
        if not (len(depths) == len(sharesets) == n) or (partitions is not None and len(partitions) != n):
            raise ValueError("channels, depths, sharesets (and partitions) need one value per stage")
        self.img_size = ntuple(img_size, 2, "img_size")
        self.in_chans = in_chans
        res = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        if res[0] * patch_size != self.img_size[0] or res[1] * patch_size != self.img_size[1]:
            raise ValueError(f"img_size {self.img_size} must be a multiple of patch_size={patch_size}")
        self.stem = ConvBNReLU(in_chans, channels[0], patch_size, patch_size, 0, deploy=deploy)
        self.feature_info: list[dict[str, Any]] = []
        stages = []
        unit = dict(
            kernel_sizes=kernel_sizes, gate_reduction=gate_reduction, ffn_expand=ffn_expand, deploy=deploy
        )
        for i in range(n):
            down = None
            if i > 0:
                if res[0] % 2 or res[1] % 2:
                    raise ValueError(f"img_size {self.img_size} leaves an odd map before stage {i + 1}")
                down = ConvBNReLU(channels[i - 1], channels[i], 2, 2, 0, deploy=deploy)
                res = (res[0] // 2, res[1] // 2)
            part = res if partitions is None else ntuple(partitions[i], 2, "partitions")
            units = [RepMLPNetUnit(channels[i], res, part, sharesets[i], **unit) for _ in range(depths[i])]
            stages.append(RepMLPNetStage(down, units))
            self.feature_info.append(
                dict(num_chs=channels[i], reduction=patch_size * 2**i, module=f"stages.{i}")
            )
        self.stages = nn.Sequential(*stages)
        self.norm = nn.BatchNorm2d(channels[-1])
        self.num_features = self.head_hidden_size = channels[-1]
        self.drop_rate = drop_rate
        self.head_drop = nn.Dropout(drop_rate)
        self.reset_classifier(num_classes, global_pool)

    def forward_features(self, x: Tensor) -> Tensor:
        """``(N, in_chans, H, W)`` -> normalised last-stage map ``(N, num_features, H/32, W/32)``."""
        check_input_size(x, "RepMLPNet is", self.in_chans, self.img_size, True)
        x = self.stem(x)
        return self.norm(self.stages(x))

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Pool (``global_pool``), dropout, classifier; ``pre_logits`` stops before the classifier."""
        if self.global_pool == "avg":
            x = x.mean((2, 3))
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)


# ------------------------------------------------------------------------------- registered models
def _cfg(size: int) -> dict[str, Any]:
    """timm's cfg at ``size``; the rest is the family default (ImageNet, bilinear, crop_pct 0.875).

    Evaluation as in the authors' test.py: at 224 resize to 256x256 (a square "squash") then centre-crop
    224; above 224 resize the short side to 256 * size // 224, centre-crop ``size``.
    """
    return cfg(input_size=(3, size, size), fixed_input_size=True, pool_size=(size // 32, size // 32),
               crop_mode="squash" if size <= 224 else "center", first_conv="stem.conv", classifier="head",
               paper_ids="arXiv:2112.11081")  # fmt: skip


_ARCHS = {"t224": ("t", 224), "t256": ("t", 256), "b224": ("b", 224), "b256": ("b", 256), "d256": ("d", 256),
          "l256": ("l", 256)}  # fmt: skip
default_cfgs = generate_default_cfgs({f"repmlpnet_{name}": _cfg(size) for name, (_, size) in _ARCHS.items()})


def _create_repmlpnet(variant: str, pretrained: bool = False, **kwargs: Any) -> RepMLPNet:
    """``features_only``: timm's FeatureListNet over the four stages (``feature_info``), strides 4..32."""
    arch, size = _ARCHS[variant.removeprefix("repmlpnet_")]
    feature_cfg = dict(out_indices=(0, 1, 2, 3), flatten_sequential=True)
    cls = partial(RepMLPNet, **REPMLPNET_ARCHS[arch], img_size=size)
    return build(cls, variant, pretrained, feature_cfg=feature_cfg, **kwargs)


@register_model
def repmlpnet_t224(pretrained: bool = False, **kwargs: Any) -> RepMLPNet:
    """RepMLPNet-T at 224x224: channels 64-512, depths 2,2,6,2, sharesets 1,4,16,128."""
    return _create_repmlpnet("repmlpnet_t224", pretrained, **kwargs)


@register_model
def repmlpnet_t256(pretrained: bool = False, **kwargs: Any) -> RepMLPNet:
    """RepMLPNet-T at 256x256."""
    return _create_repmlpnet("repmlpnet_t256", pretrained, **kwargs)


@register_model
def repmlpnet_b224(pretrained: bool = False, **kwargs: Any) -> RepMLPNet:
    """RepMLPNet-B at 224x224: channels 96-768, depths 2,2,12,2, sharesets 1,4,32,128."""
    return _create_repmlpnet("repmlpnet_b224", pretrained, **kwargs)


@register_model
def repmlpnet_b256(pretrained: bool = False, **kwargs: Any) -> RepMLPNet:
    """RepMLPNet-B at 256x256."""
    return _create_repmlpnet("repmlpnet_b256", pretrained, **kwargs)


@register_model
def repmlpnet_d256(pretrained: bool = False, **kwargs: Any) -> RepMLPNet:
    """RepMLPNet-D at 256x256: channels 80-640, depths 2,2,18,2, sharesets 1,4,16,128."""
    return _create_repmlpnet("repmlpnet_d256", pretrained, **kwargs)


@register_model
def repmlpnet_l256(pretrained: bool = False, **kwargs: Any) -> RepMLPNet:
    """RepMLPNet-L at 256x256: channels 96-768, depths 2,2,18,2, sharesets 1,4,32,256."""
    return _create_repmlpnet("repmlpnet_l256", pretrained, **kwargs)
