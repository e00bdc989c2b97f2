"""The ResNet-50 family (paper Sec. 3.5, 4.2, Appendix A): its blocks, its stages and the network.

- blocks: torchvision's :class:`Bottleneck`, the paper's :class:`RepMLPBottleneck` and
  :class:`RepMLPLightBlock`, the baselines' :class:`NonLocalBlock` and :func:`gc_block`;
- :class:`StageSpec` (with :class:`RepMLPSpec`) says what a stage holds, :func:`make_stage` builds it and
  :class:`ResNet` stacks a stem, four stages (c2..c5) and a pooled classifier;
- :func:`repmlp_res50_stages`: torchvision's ResNet-50 stages with RepMLP, Non-local or GC blocks where a
  model has them; the registered RepMLP-Res50, NL-Res50 and GC-Res50 (PSPNet and the face ResNets build on
  the same parts).

Every conv-BN pair is a :class:`repmlp.ConvBN` and every RepMLP a :class:`repmlp.RepMLPBlock`, so a model
built with ``deploy=True`` has the structure of ``reparameterize_model(model)``. Stages are named as in the
paper: ``c2..c5`` (ints 2..5 or strings ``"c2"``..``"c5"``); per-stage options are sequences ordered c2..c5
or one value for all stages.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from timm.layers import GlobalContext
from timm.models import generate_default_cfgs, register_model
from timm.models._features import feature_take_indices
from torch import Tensor, nn

from repmlp.models.layers import ConvBNReLU, PooledClassifierMixin, build, cfg, check_input_size
from repmlp.nn.block import RepMLPBlock
from repmlp.nn.layers import ConvBN

__all__ = ["Bottleneck", "RepMLPBottleneck", "RepMLPLightBlock", "NonLocalBlock", "gc_block",
           "RepMLPSpec", "StageSpec", "make_stage", "ResNet", "parse_stages", "per_stage", "conv_out_size",
           "repmlp_res50_stages", "split_resnet_kwargs", "repmlp_res50", "repmlp_res50_g8_16",
           "repmlp_res50_g8_8", "repmlp_res50_g4_8", "repmlp_res50_light", "nl_res50", "gc_res50"]  # fmt: skip

T = TypeVar("T")

STAGE_NAMES = ("c2", "c3", "c4", "c5")


def conv_out_size(size: int, kernel: int, stride: int, padding: int, dilation: int = 1) -> int:
    """Output length of a conv/pool along one axis (floor mode), as ``nn.Conv2d`` computes it."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def per_stage(value: T | Sequence[T], n: int, name: str) -> tuple[T, ...]:
    """``value`` repeated for ``n`` stages, or a length-``n`` sequence as a tuple."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} needs one value per stage ({n}), got {value!r}")
        return tuple(value)
    return (value,) * n  # type: ignore[return-value]


def parse_stages(stages: Sequence[int | str] | int | str | None) -> tuple[int, ...]:
    """Stage names (``"c3"``, ``3``, ``"c3+c4"``) as sorted 0-based indices (c2 -> 0)."""
    if stages is None:
        return ()
    if isinstance(stages, str):
        stages = [s for s in stages.replace(",", "+").split("+") if s]
    elif isinstance(stages, int):
        stages = [stages]
    out = set()
    for s in stages:
        label = s if isinstance(s, str) else f"c{s}"
        if label not in STAGE_NAMES:
            raise ValueError(f"unknown stage {s!r}: stages are named c2, c3, c4, c5 (or 2..5)")
        out.add(STAGE_NAMES.index(label))
    return tuple(sorted(out))


# ------------------------------------------------------------------------------------------ blocks
def _add_relu(out: Tensor, identity: Tensor) -> Tensor:
    """``relu(out + identity)`` in ``out``'s memory (torchvision's ``out += identity``): ``out`` is a fresh
    tensor of the residual branch."""
    out += identity
    return F.relu(out, inplace=True)


def _shortcut(in_channels: int, out_channels: int, stride: int, deploy: bool) -> ConvBN | None:
    """The 1x1 conv-BN projection when a residual block changes the shape, else ``None`` (identity)."""
    if stride == 1 and in_channels == out_channels:
        return None
    return ConvBN(in_channels, out_channels, 1, stride, deploy=deploy)


class Bottleneck(nn.Module):
    """torchvision's ResNet bottleneck (v1.5: stride on the 3x3) built from :class:`ConvBN`.

    ``conv1`` 1x1 ``C_in -> mid``, ``conv2`` 3x3 (stride, dilation), ``conv3`` 1x1 ``mid -> C_out``, an
    optional ``context`` module (a GC block) on the residual branch, a projection ``downsample`` when the
    shape changes; ReLU after conv1, conv2 and the addition.

    Shapes: ``(N, C_in, H, W)`` -> ``(N, C_out, H/stride, W/stride)``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        *,
        mid_channels: int | None = None,
        stride: int = 1,
        dilation: int = 1,
        context: nn.Module | None = None,
        deploy: bool = False,
    ) -> None:
        super().__init__()
        mid = mid_channels or out_channels // 4
        self.conv1 = ConvBN(in_channels, mid, 1, deploy=deploy)
        self.conv2 = ConvBN(mid, mid, 3, stride, dilation=dilation, deploy=deploy)
        self.conv3 = ConvBN(mid, out_channels, 1, deploy=deploy)
        self.context = context
        self.downsample = _shortcut(in_channels, out_channels, stride, deploy)

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.conv3(F.relu(self.conv2(F.relu(self.conv1(x), inplace=True)), inplace=True))
        if self.context is not None:
            out = self.context(out)
        return _add_relu(out, identity)


class RepMLPBottleneck(nn.Module):
    """RepMLP Bottleneck (paper Sec. 3.5): a ResNet bottleneck whose 3x3 conv becomes a RepMLP.

    ``conv1`` 1x1 ``C_in -> mid`` (``mid = C_out/4``), ``conv2`` 3x3 ``mid -> mid/r``, ``repmlp``
    ``mid/r -> mid/r`` at ``resolution``, ``conv3`` 3x3 ``mid/r -> mid``, ``conv4`` 1x1 ``mid -> C_out``;
    ReLU after every conv-BN but the last and after the RepMLP; residual addition then ReLU. Stride 1
    only (the paper keeps the stride-2 bottlenecks). ``groups``, ``kernel_sizes``, ``global_reduction``:
    the RepMLP's.

    Shapes: ``(N, C_in, H, W)`` -> ``(N, C_out, H, W)`` with ``(H, W) == resolution``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        resolution: int | Sequence[int],
        partition: int | Sequence[int],
        *,
        mid_channels: int | None = None,
        reduction: int = 2,
        groups: int = 8,
        kernel_sizes: Sequence[int] = (1, 3, 5),
        global_reduction: int = 1,
        deploy: bool = False,
    ) -> None:
        super().__init__()
        mid = mid_channels or out_channels // 4
        if mid % reduction:
            raise ValueError(f"reduction r={reduction} must divide the bottleneck width {mid}")
        inner = mid // reduction
        self.conv1 = ConvBNReLU(in_channels, mid, 1, deploy=deploy)
        self.conv2 = ConvBNReLU(mid, inner, 3, deploy=deploy)
        self.repmlp = RepMLPBlock(inner, inner, resolution, partition, groups=groups, kernel_sizes=kernel_sizes,
                                  global_reduction=global_reduction, deploy=deploy)  # fmt: skip
        self.conv3 = ConvBNReLU(inner, mid, 3, deploy=deploy)
        self.conv4 = ConvBN(mid, out_channels, 1, deploy=deploy)
        self.downsample = _shortcut(in_channels, out_channels, 1, deploy)

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.repmlp(self.conv2(self.conv1(x))), inplace=True)
        return _add_relu(self.conv4(self.conv3(out)), identity)


class RepMLPLightBlock(nn.Module):
    """RepMLP Light Block (paper Appendix A): 1x1 conv ``C_in -> C_out/r`` (``r = 8`` in the paper), a RepMLP
    at ``resolution``, 1x1 conv back to ``C_out``; ReLU after conv1 and the RepMLP, residual addition then
    ReLU; no 3x3 conv.

    Shapes: ``(N, C_in, H, W)`` -> ``(N, C_out, H, W)`` with ``(H, W) == resolution``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        resolution: int | Sequence[int],
        partition: int | Sequence[int],
        *,
        reduction: int = 8,
        groups: int = 8,
        kernel_sizes: Sequence[int] = (1, 3, 5),
        global_reduction: int = 1,
        deploy: bool = False,
    ) -> None:
        super().__init__()
        if out_channels % reduction:
            raise ValueError(f"reduction r={reduction} must divide out_channels={out_channels}")
        inner = out_channels // reduction
        self.conv1 = ConvBNReLU(in_channels, inner, 1, deploy=deploy)
        self.repmlp = RepMLPBlock(inner, inner, resolution, partition, groups=groups, kernel_sizes=kernel_sizes,
                                  global_reduction=global_reduction, deploy=deploy)  # fmt: skip
        self.conv2 = ConvBN(inner, out_channels, 1, deploy=deploy)
        self.downsample = _shortcut(in_channels, out_channels, 1, deploy)

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        return _add_relu(self.conv2(F.relu(self.repmlp(self.conv1(x)), inplace=True)), identity)


class NonLocalBlock(nn.Module):
    """Non-local block, embedded-Gaussian version (Wang et al., CVPR 2018, Sec. 3.3).

    ``theta``, ``phi``, ``g``: 1x1 convs ``C -> C/2``; the softmax over position pairs weighs ``g``; ``W``
    (1x1 conv-BN ``C/2 -> C``, BN scale zero-initialised so the block starts as the identity) and a residual
    addition. With ``subsample`` (the paper's trick) ``phi`` and ``g`` are 2x2 max-pooled.
    Not timm's ``NonLocalAttn``: it cannot subsample ``phi``/``g`` (4x the attention's MACs) and its ``W`` conv
    has a bias before the BN (``C`` more parameters than the table's count).

    Shapes: ``(N, C, H, W)`` -> ``(N, C, H, W)``.
    """

    def __init__(
        self,
        channels: int,
        *,
        inner_channels: int | None = None,
        subsample: bool = True,
        deploy: bool = False,
    ) -> None:
        super().__init__()
        inner = inner_channels or channels // 2
        self.theta = nn.Conv2d(channels, inner, 1)
        self.phi = nn.Conv2d(channels, inner, 1)
        self.g = nn.Conv2d(channels, inner, 1)
        self.W = ConvBN(inner, channels, 1, deploy=deploy)
        if self.W.bn is not None:
            nn.init.zeros_(self.W.bn.weight)
        self.subsample = subsample

    def forward(self, x: Tensor) -> Tensor:
        n, _, h, w = x.shape
        q = self.theta(x).flatten(2)  # (N, C', HW)
        k, v = self.phi(x), self.g(x)
        if self.subsample:
            k, v = _subsample(k), _subsample(v)
        attn = torch.softmax(q.transpose(1, 2) @ k.flatten(2), dim=-1)  # (N, HW, HW')
        y = (attn @ v.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(n, -1, h, w)
        return x + self.W(y)


@torch.fx.wrap  # a leaf: the branch depends on the input's size, which fx cannot evaluate on proxies
def _subsample(x: Tensor) -> Tensor:
    """2x2 max pool (ceil mode) of ``(N, C, H, W)`` unless ``H`` or ``W`` is 1 (then ``x`` unchanged)."""
    if x.shape[-2] > 1 and x.shape[-1] > 1:
        return F.max_pool2d(x, 2, ceil_mode=True)
    return x


def gc_block(channels: int, ratio: int = 16) -> GlobalContext:
    """Global context (GC) block (Cao et al., GCNet 2019), GCNet's ImageNet setting in timm's module: a 1x1 conv
    ``C -> 1`` and a softmax over positions pool ``x`` into ``(N, C, 1, 1)``; 1x1 ``C -> C/ratio``, LayerNorm,
    ReLU, 1x1 ``C/ratio -> C`` transform it; it is added to every position (add fusion, no scaling). As
    GCNet's code: LayerNorm's eps 1e-5 (timm's: 1e-6) and the last conv all zeros (the block starts as the
    identity; timm zeroes its weight only)."""
    gc = GlobalContext(channels, fuse_add=True, fuse_scale=False, rd_channels=max(channels // ratio, 1))
    gc.mlp_add.norm.eps = 1e-5
    nn.init.zeros_(gc.mlp_add.fc2.bias)
    return gc


# ------------------------------------------------------------------------------------------ stages
@dataclass(frozen=True)
class RepMLPSpec:
    """A stage's RepMLP blocks: ``block`` ``"bottleneck"`` (Sec. 3.5) or ``"light"`` (Appendix A); ``partition``
    ``h = w`` (or ``(h, w)``); ``reduction`` ``r``; ``groups`` ``g``; the Local Perceptron's ``kernel_sizes``;
    FC1's ``global_reduction``; a RepMLP Bottleneck's ``mid_channels`` (default ``C_out/4``)."""

    block: str = "bottleneck"
    partition: int | tuple[int, int] = 7
    reduction: int = 2
    groups: int = 8
    kernel_sizes: tuple[int, ...] = (1, 3, 5)
    global_reduction: int = 1
    mid_channels: int | None = None

    def __post_init__(self) -> None:
        if self.block not in ("bottleneck", "light"):
            raise ValueError(f"block must be 'bottleneck' or 'light', got {self.block!r}")


@dataclass(frozen=True)
class StageSpec:
    """One ResNet stage: ``depth`` blocks of output width ``width``, the first strided by ``stride``.

    ``dilation`` is the 3x3 convs'; the first block takes ``first_dilation`` (the previous stage's, as
    torchvision's ``replace_stride_with_dilation``). ``mid_channels``: the bottleneck width (default
    ``width/4``). With ``repmlp`` every stride-1 block becomes a RepMLP block (the paper keeps the stride-2
    bottlenecks), but the first when ``keep_first``. ``gc_ratio``: the bottlenecks get a GC block of that
    ratio; ``nonlocal_before``: a Non-local block before each of these block indices.
    """

    depth: int
    width: int
    stride: int = 1
    dilation: int = 1
    first_dilation: int = 1
    mid_channels: int | None = None
    repmlp: RepMLPSpec | None = None
    keep_first: bool = False
    gc_ratio: int | None = None
    nonlocal_before: tuple[int, ...] = ()


def make_stage(
    spec: StageSpec, in_channels: int, resolution: tuple[int, int], *, deploy: bool = False
) -> tuple[nn.Sequential, tuple[int, int]]:
    """The stage ``(N, in_channels, H, W) -> (N, width, H', W')`` after an input at ``resolution`` ``(H, W)``,
    and its output ``(H', W')``, the resolution its RepMLPs are built for."""
    res = resolution
    if spec.stride != 1:
        d = spec.first_dilation
        res = (conv_out_size(res[0], 3, spec.stride, d, d), conv_out_size(res[1], 3, spec.stride, d, d))
    blocks: list[nn.Module] = []
    c_in = in_channels
    for j in range(spec.depth):
        stride, dilation = (spec.stride, spec.first_dilation) if j == 0 else (1, spec.dilation)
        if j in spec.nonlocal_before:
            blocks.append(NonLocalBlock(c_in, deploy=deploy))
        rep = spec.repmlp
        if rep is not None and stride == 1 and (j > 0 or not spec.keep_first):
            options = dict(groups=rep.groups, kernel_sizes=rep.kernel_sizes, global_reduction=rep.global_reduction,
                           reduction=rep.reduction, deploy=deploy)  # fmt: skip
            if rep.block == "light":
                blocks.append(RepMLPLightBlock(c_in, spec.width, res, rep.partition, **options))
            else:
                blocks.append(RepMLPBottleneck(c_in, spec.width, res, rep.partition, mid_channels=rep.mid_channels,
                                               **options))  # fmt: skip
        else:
            # Built before its bottleneck: the parameters are created (and drawn) in module order.
            gc = gc_block(spec.width, spec.gc_ratio) if spec.gc_ratio else None
            blocks.append(Bottleneck(c_in, spec.width, mid_channels=spec.mid_channels, stride=stride,
                                     dilation=dilation, context=gc, deploy=deploy))  # fmt: skip
        c_in = spec.width
    return nn.Sequential(*blocks), res


class _TorchvisionStem(nn.Module):
    """7x7/2 conv-BN-ReLU + 3x3/2 max pool (torchvision's ``conv1, bn1, relu, maxpool``)."""

    def __init__(self, in_chans: int, channels: int, *, deploy: bool = False) -> None:
        super().__init__()
        self.conv = ConvBN(in_chans, channels, 7, 2, 3, deploy=deploy)

    @staticmethod
    def out_size(size: tuple[int, int]) -> tuple[int, int]:
        return tuple(conv_out_size(conv_out_size(s, 7, 2, 3), 3, 2, 1) for s in size)  # type: ignore[return-value]

    def forward(self, x: Tensor) -> Tensor:
        return F.max_pool2d(F.relu(self.conv(x), inplace=True), 3, 2, 1)


class ResNet(PooledClassifierMixin, nn.Module):
    """A stem, four stages (c2..c5, ``layer1``..``layer4``) of :class:`StageSpec` s and a pooled classifier.

    Args:
        specs: the four stages c2..c5, in order.
        num_classes: classifier outputs; 0 for none (``forward`` returns pooled features).
        global_pool: ``"avg"`` or ``""`` (none: with ``num_classes=0`` ``forward`` returns the c5 map).
        in_chans: input channels.
        img_size: the input resolution the RepMLPs are built for (int or ``(H, W)``).
        stem: replacement stem (default: torchvision's 7x7/2 conv-BN-ReLU + 3x3/2 max pool) with
            ``stem_channels`` output channels; ``stem_size`` maps its input ``(H, W)`` to its output's.
        deploy: build the inference structure.

    Shapes: ``(N, in_chans, H, W)`` -> ``(N, num_classes)``.
    """

    classifier_attr = "fc"
    __jit_unused_properties__ = ["stages"]  # a Python list of modules: TorchScript compiles the rest

    def __init__(
        self,
        specs: Sequence[StageSpec],
        *,
        num_classes: int = 1000,
        global_pool: str = "avg",
        in_chans: int = 3,
        img_size: int | Sequence[int] = 224,
        stem: nn.Module | None = None,
        stem_channels: int = 64,
        stem_size: Callable[[tuple[int, int]], tuple[int, int]] | None = None,
        deploy: bool = False,
    ) -> None:
        super().__init__()
        if len(specs) != 4:
            raise ValueError(f"a ResNet has 4 stages (c2..c5), got {len(specs)}")
        self.num_classes, self.in_chans = num_classes, in_chans
        size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        self.img_size: tuple[int, int] = (int(size[0]), int(size[1]))
        self.stage_specs = tuple(specs)
        self.repmlp_stages = tuple(i for i, spec in enumerate(self.stage_specs) if spec.repmlp is not None)
        if stem is None:
            self.stem: nn.Module = _TorchvisionStem(in_chans, stem_channels, deploy=deploy)
            res = _TorchvisionStem.out_size(self.img_size)
        elif stem_size is None:
            raise ValueError("a custom stem needs stem_size (input (H, W) -> stem output (H, W))")
        else:
            self.stem, res = stem, stem_size(self.img_size)
        if self.repmlp_stages and min(res) < 1:
            raise ValueError(f"img_size={img_size} is too small for this network")
        # timm's feature_info: module, channels and reduction (input size / map size) of each feature.
        scale = max(1, round(self.img_size[0] / max(res[0], 1)))
        self.feature_info = [dict(num_chs=stem_channels, reduction=scale, module="stem")]
        self.stage_resolutions: list[tuple[int, int]] = []
        stages: list[nn.Module] = []
        c_in = stem_channels
        for i, spec in enumerate(self.stage_specs):
            stage, res = make_stage(spec, c_in, res, deploy=deploy)
            stages.append(stage)
            self.stage_resolutions.append(res)
            c_in, scale = spec.width, scale * spec.stride
            self.feature_info.append(dict(num_chs=c_in, reduction=scale, module=f"layer{i + 1}"))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.num_features = self.head_hidden_size = c_in
        self.reset_classifier(num_classes, global_pool)

    @property
    def stages(self) -> list[nn.Module]:
        return [self.layer1, self.layer2, self.layer3, self.layer4]

    def _check(self, x: Tensor) -> None:
        # Only the RepMLPs fix the input size: a plain ResNet pools whatever its stages see.
        fixed = len(self.repmlp_stages) > 0
        check_input_size(x, "this model's RepMLP layers are", self.in_chans, self.img_size, fixed)

    def forward_features(self, x: Tensor) -> Tensor:
        """``(N, in_chans, H, W)`` -> c5 feature map ``(N, num_features, H/32, W/32)``."""
        self._check(x)
        # Written out: TorchScript iterates no list of unlike modules.
        return self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | Sequence[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]]:
        """timm's intermediate-feature API: the ``feature_info`` maps (stem, c2..c5) that ``indices`` picks
        (an int: the last n; a sequence: those, negative from the end); the list, or
        ``(forward_features(x), list)`` unless ``intermediates_only``."""
        if output_fmt != "NCHW":
            raise ValueError(f"output_fmt must be 'NCHW', got {output_fmt!r}")
        take, last = feature_take_indices(len(self.feature_info), indices)
        self._check(x)
        x = self.stem(x)
        outs = [x] if 0 in take else []
        for i, stage in enumerate(self.stages[: last if stop_early or intermediates_only else 4], 1):
            x = stage(x)
            if i in take:
                outs.append(x)
        return outs if intermediates_only else (x, outs)

    def prune_intermediate_layers(
        self, indices: int | Sequence[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """timm's API: drop the stages after the last ``feature_info`` map in ``indices`` (0 the stem, 1..4
        c2..c5) and, with ``prune_head``, the classifier and pooling; returns the kept indices.
        ``prune_norm``: timm's signature (a ResNet has no final norm)."""
        take, last = feature_take_indices(len(self.feature_info), indices)
        for i in range(last + 1, len(self.feature_info)):
            setattr(self, f"layer{i}", nn.Identity())
        if prune_head:
            self.reset_classifier(0, "")
        return take

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """``(N, num_features, h, w)`` -> logits ``(N, num_classes)``; pooled features if ``pre_logits``."""
        if self.global_pool == "avg":
            x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return x if pre_logits else self.fc(x)


# ------------------------------------------------------------------------------ the ResNet-50 family
_LAYERS_50 = (3, 4, 6, 3)
_WIDTHS_50 = (256, 512, 1024, 2048)
# The ResNet's own options (stem, head, input); the others specify its stages.
_MODEL_OPTIONS = ("num_classes", "global_pool", "in_chans", "img_size", "stem", "stem_channels", "stem_size")


def repmlp_res50_stages(
    *,
    stages: Sequence[int | str] | str | None = ("c3", "c4"),
    block: str = "bottleneck",
    reduction: int | Sequence[int] = (2, 2, 4, 4),
    groups: int | Sequence[int] = 8,
    partition: int | Sequence[Any] = 7,
    kernel_sizes: Sequence[int] | Sequence[Sequence[int]] = (1, 3, 5),
    global_reduction: int | Sequence[int] = 1,
    layers: Sequence[int] = _LAYERS_50,
    widths: Sequence[int] = _WIDTHS_50,
    mid_channels: Sequence[int] | None = None,
    strides: Sequence[int] = (1, 2, 2, 2),
    dilations: Sequence[int] = (1, 1, 1, 1),
    gc_stages: Sequence[int | str] | str | None = (),
    gc_ratio: int = 16,
    nonlocal_blocks: dict[int | str, Sequence[int]] | None = None,
) -> tuple[StageSpec, ...]:
    """The four stages (c2..c5) of a ResNet-50 with RepMLP blocks in ``stages`` (``"c3+c4"``, ``(3, 4)``).

    Per-stage options take one value or one per stage (c2..c5): ``reduction`` (``r``), ``groups`` (``g``),
    ``partition`` (``h = w`` or ``(h, w)``), ``kernel_sizes`` (Local Perceptron kernels), ``global_reduction``
    (FC1), ``widths``, ``mid_channels`` (bottleneck width, default ``widths/4``), ``strides``, ``dilations``.
    ``block``: ``"bottleneck"`` (RepMLP Bottleneck) or ``"light"`` (RepMLP Light Block); ``gc_stages``:
    stages whose bottlenecks get a GC block (``gc_ratio``); ``nonlocal_blocks``: ``{stage: (block
    indices, ...)}``, a Non-local block before each. ``stages=()`` is torchvision's ``resnet50``.
    """
    n = len(layers)
    if n != 4:
        raise ValueError(f"layers must give 4 stages (c2..c5), got {layers!r}")
    widths = per_stage(widths, n, "widths")
    mids = per_stage(mid_channels, n, "mid_channels") if mid_channels is not None else (None,) * n
    strides, dilations = per_stage(strides, n, "strides"), per_stage(dilations, n, "dilations")
    reduction, groups = per_stage(reduction, n, "reduction"), per_stage(groups, n, "groups")
    # A per-stage partition is a length-4 sequence of ints or pairs (a pair alone is one (h, w) partition).
    per_stage_partition = isinstance(partition, (list, tuple)) and len(partition) == n
    partitions = per_stage(partition, n, "partition") if per_stage_partition else (partition,) * n
    nested = len(kernel_sizes) > 0 and isinstance(kernel_sizes[0], (list, tuple))
    kernels = tuple(tuple(k) for k in (kernel_sizes if nested else [kernel_sizes] * n))
    kernels = per_stage(kernels, n, "kernel_sizes")
    global_reduction = per_stage(global_reduction, n, "global_reduction")
    repmlp, gc = parse_stages(stages), parse_stages(gc_stages)
    nl = {parse_stages([k])[0]: tuple(v) for k, v in (nonlocal_blocks or {}).items()}

    def spec(i: int) -> RepMLPSpec:
        part = tuple(partitions[i]) if isinstance(partitions[i], list) else partitions[i]  # frozen: no lists
        return RepMLPSpec(block=block, partition=part, reduction=reduction[i], groups=groups[i],
                          kernel_sizes=kernels[i], global_reduction=global_reduction[i],
                          mid_channels=mids[i])  # fmt: skip

    return tuple(
        StageSpec(
            depth=layers[i],
            width=widths[i],
            stride=strides[i],
            dilation=dilations[i],
            first_dilation=dilations[i - 1] if i > 0 else 1,
            mid_channels=mids[i],
            repmlp=spec(i) if i in repmlp else None,
            gc_ratio=gc_ratio if i in gc else None,
            nonlocal_before=nl.get(i, ()),
        )  # fmt: skip
        for i in range(n)
    )


def split_resnet_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword arguments split into :class:`ResNet`'s own and :func:`repmlp_res50_stages`'s."""
    own = {k: v for k, v in kwargs.items() if k in _MODEL_OPTIONS}
    return own, {k: v for k, v in kwargs.items() if k not in _MODEL_OPTIONS}


def _resnet(*, deploy: bool = False, **kwargs: Any) -> ResNet:
    """A ResNet of the stages and model options in ``kwargs`` (the registered models' arguments)."""
    own, stage_options = split_resnet_kwargs(kwargs)
    return ResNet(repmlp_res50_stages(**stage_options), deploy=deploy, **own)


def _cfg(size: int, fixed: bool = True) -> dict[str, Any]:
    """timm pretrained cfg at ``size`` x ``size``; ``fixed``: the RepMLP layers fix the input size."""
    return cfg(input_size=(3, size, size), pool_size=(size // 32, size // 32), fixed_input_size=fixed,
               classifier="fc", first_conv="stem.conv.conv")  # fmt: skip


default_cfgs = generate_default_cfgs({
    "repmlp_res50": _cfg(224),
    "repmlp_res50_g8_16": _cfg(320),
    "repmlp_res50_g8_8": _cfg(320),
    "repmlp_res50_g4_8": _cfg(320),
    "repmlp_res50_light": _cfg(224),
    "nl_res50": _cfg(320, fixed=False),
    "gc_res50": _cfg(320, fixed=False),
})  # fmt: skip


def _create_resnet(variant: str, pretrained: bool, defaults: dict[str, Any], **kwargs: Any) -> ResNet:
    """The ResNet of the variant's ``defaults`` under ``kwargs`` (so that a model file's options, with
    ``pretrained``, come before them); ``features_only``: timm's FeatureListNet over the stem and c2..c5."""
    make = partial(_resnet, **defaults)
    return build(make, variant, pretrained, feature_cfg=dict(out_indices=(0, 1, 2, 3, 4)), **kwargs)


@register_model
def repmlp_res50(pretrained: bool = False, **kwargs: Any) -> ResNet:
    """RepMLP-Res50: torchvision's ResNet-50 with RepMLP Bottlenecks in ``stages`` (paper Sec. 4.2).

    Defaults: the paper's 78.55% model of its Table 4 (c3+c4, ``r = 2,2,4,4`` for c2..c5, ``g = 8``,
    ``h = w = 7``, ``K = 1,3,5``, 224x224). ``stages=()`` is torchvision's ``resnet50``. ``reduction``,
    ``groups``, ``partition``, ``global_reduction`` take one value or one per stage (c2..c5); the keyword
    arguments are :func:`repmlp_res50_stages`'s (``stages``, ``block``, ``kernel_sizes``, ``layers``, ...) and
    :class:`ResNet`'s (``num_classes``, ``in_chans``, ``img_size``, ``global_pool``, ``deploy``, ...).
    """
    return _create_resnet("repmlp_res50", pretrained, {}, **kwargs)


def res50_320_options(c3_groups: int, c4_groups: int) -> dict[str, Any]:
    """Stage options of the paper's 320x320 comparisons: c3+c4, ``h = w = 10``, ``K = 1,3,5,7``,
    ``r = 2,2,4,4``, ``g`` = ``c3_groups`` in c3 and ``c4_groups`` in c4."""
    return dict(
        stages=("c3", "c4"), groups=(8, c3_groups, c4_groups, 8), partition=10, kernel_sizes=(1, 3, 5, 7)
    )


@register_model
def repmlp_res50_g8_16(pretrained: bool = False, **kwargs: Any) -> ResNet:
    """RepMLP-Res50-g8/16 (320x320): ``g = 8`` in c3, 16 in c4."""
    return _create_resnet("repmlp_res50_g8_16", pretrained, res50_320_options(8, 16), **kwargs)


@register_model
def repmlp_res50_g8_8(pretrained: bool = False, **kwargs: Any) -> ResNet:
    """RepMLP-Res50-g8/8 (320x320): ``g = 8`` in c3 and c4."""
    return _create_resnet("repmlp_res50_g8_8", pretrained, res50_320_options(8, 8), **kwargs)


@register_model
def repmlp_res50_g4_8(pretrained: bool = False, **kwargs: Any) -> ResNet:
    """RepMLP-Res50-g4/8 (320x320): ``g = 4`` in c3, 8 in c4 (the PSPNet backbone of Sec. 4.4)."""
    return _create_resnet("repmlp_res50_g4_8", pretrained, res50_320_options(4, 8), **kwargs)


@register_model
def repmlp_res50_light(pretrained: bool = False, **kwargs: Any) -> ResNet:
    """ResNet-50 with RepMLP Light Blocks in c3+c4 (paper Appendix A): 8x channel reduction and expansion by
    1x1 convs around each RepMLP, ``g = 8``, ``h = w = 7``, ``K = 1,3,5``."""
    return _create_resnet("repmlp_res50_light", pretrained, dict(block="light", reduction=8), **kwargs)


@register_model
def nl_res50(pretrained: bool = False, **kwargs: Any) -> ResNet:
    """NL-Res50 (320x320): ResNet-50 + one Non-local block (embedded Gaussian, subsampled ``phi``/``g``) in
    c4, right before its last residual block: the Non-local paper's ImageNet "1 block in res4"."""
    nonlocal_blocks = {4: (kwargs.get("layers", _LAYERS_50)[2] - 1,)}  # c4's last block, whatever its layers
    return _create_resnet(
        "nl_res50", pretrained, dict(stages=(), img_size=320, nonlocal_blocks=nonlocal_blocks), **kwargs
    )


@register_model
def gc_res50(pretrained: bool = False, **kwargs: Any) -> ResNet:
    """GC-Res50 (320x320): ResNet-50 with a GC block (ratio 1/16, ``gc_ratio``) after the last 1x1 conv of
    every bottleneck of c3, c4 and c5 (GCNet's ImageNet setting)."""
    defaults = dict(stages=(), gc_stages=("c3", "c4", "c5"), img_size=320)
    return _create_resnet("gc_res50", pretrained, defaults, **kwargs)
