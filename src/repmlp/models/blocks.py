"""Building blocks of the paper's models and a ResNet-50-style network composed of stage specifications.

Every conv-BN pair is a :class:`repmlp.ConvBN` (and every RepMLP a :class:`repmlp.RepMLPBlock`), so a
model built with ``deploy=True`` has exactly the structure of ``reparameterize_model(model)`` and
loads its state dict with ``strict=True``.

Stages are named as in the paper: ``c2, c3, c4, c5`` (ints 2..5 or strings ``"c2"``..``"c5"``); per-stage
options are sequences ordered c2..c5 (or one value for all stages).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from repmlp.models.head import PooledClassifierMixin
from repmlp.nn import checks
from repmlp.nn.block import RepMLPBlock
from repmlp.nn.layers import ConvBN

__all__ = [
    "ConvBNReLU",
    "Bottleneck",
    "RepMLPBottleneck",
    "RepMLPLightBlock",
    "NonLocalBlock",
    "GlobalContextBlock",
    "RepMLPSpec",
    "StageSpec",
    "make_stage",
    "ResNet",
    "check_input_size",
    "parse_stages",
    "per_stage",
    "conv_out_size",
]

T = TypeVar("T")

STAGE_NAMES = ("c2", "c3", "c4", "c5")


class ConvBNReLU(ConvBN):
    """:class:`ConvBN` followed by ReLU; also the paper's "FC" (a 1x1 conv-BN-ReLU) of the pure MLP.

    Shapes: ``(N, C_in, H, W)`` -> ``(N, C_out, H', W')``.
    """

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv(x)  # written out, not super().forward: TorchScript compiles no super() calls
        if self.bn is not None:
            x = self.bn(x)
        # In place: the conv/BN output is a fresh tensor that nothing else holds.
        return F.relu(x, inplace=True)


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
    """Normalise stage names (``"c3"``, ``3``, ``"c3+c4"``) into sorted 0-based indices (c2 -> 0)."""
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


class Bottleneck(nn.Module):
    """torchvision's ResNet bottleneck (v1.5: stride on the 3x3) built from :class:`ConvBN`.

    ``conv1`` 1x1 ``C_in -> mid``, ``conv2`` 3x3 (stride, dilation), ``conv3`` 1x1 ``mid -> C_out``,
    optional ``context`` module on the residual branch before the addition (a GC block), projection
    ``downsample`` when the shape changes; ReLU after conv1, conv2 and the addition.

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
        needs_proj = stride != 1 or in_channels != out_channels
        self.downsample = ConvBN(in_channels, out_channels, 1, stride, deploy=deploy) if needs_proj else None

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.conv3(F.relu(self.conv2(F.relu(self.conv1(x), inplace=True)), inplace=True))
        if self.context is not None:
            out = self.context(out)
        return _add_relu(out, identity)


def _add_relu(out: Tensor, identity: Tensor) -> Tensor:
    """``relu(out + identity)`` computed in ``out``'s memory (torchvision's ``out += identity``).

    ``out`` must be a fresh tensor of the residual branch (a conv/BN output): no extra allocation
    and one pass less than ``F.relu(out + identity)``.
    """
    out += identity
    return F.relu(out, inplace=True)


def repmlp_options(
    groups: int, kernel_sizes: Sequence[int], global_reduction: int, deploy: bool
) -> dict[str, object]:
    """The :class:`RepMLPBlock` keyword options the residual blocks pass through unchanged."""
    return dict(groups=groups, kernel_sizes=kernel_sizes, global_reduction=global_reduction, deploy=deploy)


def projection_shortcut(in_channels: int, out_channels: int, deploy: bool) -> ConvBN | None:
    """1x1 conv-BN shortcut of a stride-1 residual block when the widths differ, else identity (None)."""
    return ConvBN(in_channels, out_channels, 1, deploy=deploy) if in_channels != out_channels else None


class RepMLPBottleneck(nn.Module):
    """RepMLP Bottleneck (paper Sec. 3.5): a ResNet bottleneck whose 3x3 conv becomes a RepMLP.

    ``conv1`` 1x1 ``C_in -> mid`` (``mid = C_out/4``), ``conv2`` 3x3 ``mid -> mid/r``, ``repmlp``
    ``mid/r -> mid/r`` at ``resolution``, ``conv3`` 3x3 ``mid/r -> mid``, ``conv4`` 1x1 ``mid -> C_out``;
    ReLU after every conv-BN but the last and after the RepMLP; residual addition then ReLU. Stride 1
    only (the paper keeps the stride-2 bottlenecks); a 1x1 projection shortcut when ``C_in != C_out``.

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
        self.repmlp = RepMLPBlock(
            inner,
            inner,
            resolution,
            partition,
            **repmlp_options(groups, kernel_sizes, global_reduction, deploy),
        )
        self.conv3 = ConvBNReLU(inner, mid, 3, deploy=deploy)
        self.conv4 = ConvBN(mid, out_channels, 1, deploy=deploy)
        self.downsample = projection_shortcut(in_channels, out_channels, deploy)

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.repmlp(self.conv2(self.conv1(x))), inplace=True)
        return _add_relu(self.conv4(self.conv3(out)), identity)


class RepMLPLightBlock(nn.Module):
    """RepMLP Light Block (paper Appendix A): 1x1 conv ``r``-times reduction, RepMLP, 1x1 expansion.

    ``conv1`` 1x1 ``C_in -> C_out/r`` (``r = 8`` in the paper), ``repmlp`` at ``resolution``, ``conv2``
    1x1 back to ``C_out``; ReLU after conv1 and the RepMLP, residual addition then ReLU; no 3x3 conv.

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
        self.repmlp = RepMLPBlock(
            inner,
            inner,
            resolution,
            partition,
            **repmlp_options(groups, kernel_sizes, global_reduction, deploy),
        )
        self.conv2 = ConvBN(inner, out_channels, 1, deploy=deploy)
        self.downsample = projection_shortcut(in_channels, out_channels, deploy)

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        return _add_relu(self.conv2(F.relu(self.repmlp(self.conv1(x)), inplace=True)), identity)


class NonLocalBlock(nn.Module):
    """Non-local block, embedded-Gaussian version (Wang et al., CVPR 2018, Sec. 3.3).

    ``theta``, ``phi``, ``g``: 1x1 convs ``C -> C/2``; the pairwise softmax over positions weighs ``g``;
    ``W`` (1x1 conv ``C/2 -> C`` + BN, BN scale zero-initialised so the block starts as identity) and a
    residual addition. With ``subsample`` (the paper's trick) ``phi`` and ``g`` are 2x2 max-pooled.

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


@torch.fx.wrap
def _subsample(x: Tensor) -> Tensor:
    """2x2 max pool (ceil mode) of ``(N, C, H, W)`` unless ``H`` or ``W`` is 1 (then ``x`` unchanged).

    A ``torch.fx`` leaf: the branch depends on the input's size, which fx cannot evaluate on proxies.
    """
    if x.shape[-2] > 1 and x.shape[-1] > 1:
        return F.max_pool2d(x, 2, ceil_mode=True)
    return x


class GlobalContextBlock(nn.Module):
    """Global context (GC) block (Cao et al., GCNet 2019): attention pooling + bottleneck transform.

    Context modelling: 1x1 conv ``C -> 1`` and softmax over positions pool ``x`` into ``(N, C, 1, 1)``;
    transform: 1x1 ``C -> C/ratio``, LayerNorm, ReLU, 1x1 ``C/ratio -> C`` (last conv zero-initialised);
    fusion: broadcast addition.

    Shapes: ``(N, C, H, W)`` -> ``(N, C, H, W)``.
    """

    def __init__(self, channels: int, *, ratio: int = 16) -> None:
        super().__init__()
        hidden = max(channels // ratio, 1)
        self.conv_mask = nn.Conv2d(channels, 1, 1)
        self.transform = nn.Sequential(
            nn.Conv2d(channels, hidden, 1),
            nn.LayerNorm([hidden, 1, 1]),
            nn.ReLU(inplace=True),
            nn.Conv2d(hidden, channels, 1),
        )
        nn.init.zeros_(self.transform[-1].weight)
        nn.init.zeros_(self.transform[-1].bias)

    def forward(self, x: Tensor) -> Tensor:
        n, c, h, w = x.shape
        attn = torch.softmax(self.conv_mask(x).reshape(n, 1, h * w), dim=-1)  # (N, 1, HW)
        context = (x.reshape(n, c, h * w) @ attn.transpose(1, 2)).reshape(n, c, 1, 1)
        return x + self.transform(context)


@dataclass(frozen=True)
class RepMLPSpec:
    """How a stage builds its RepMLP blocks (paper Sec. 3.5: RepMLP Bottleneck; Appendix A: Light Block).

    ``block``: ``"bottleneck"`` or ``"light"``; ``partition``: ``h = w`` (or ``(h, w)``); ``reduction``:
    ``r``; ``groups``: ``g``; ``kernel_sizes``: the Local Perceptron's; ``global_reduction``: FC1's;
    ``mid_channels``: a RepMLP Bottleneck's width after its first 1x1 conv (default ``C_out/4``).
    """

    block: str = "bottleneck"
    partition: int | tuple[int, int] = 7
    reduction: int = 2
    groups: int = 8
    kernel_sizes: tuple[int, ...] = (1, 3, 5)
    global_reduction: int = 1
    mid_channels: int | None = None

    def __post_init__(self) -> None:
        if self.block not in ("bottleneck", "light"):
            raise ValueError(f"repmlp_block must be 'bottleneck' or 'light', got {self.block!r}")


@dataclass(frozen=True)
class StageSpec:
    """One ResNet stage: ``depth`` blocks of output width ``width``, the first strided by ``stride``.

    ``dilation`` is the 3x3 convs' dilation; the first block takes ``first_dilation`` (the previous
    stage's, torchvision's ``replace_stride_with_dilation`` convention). ``mid_channels``: bottleneck
    width (default ``width/4``). With ``repmlp`` every stride-1 block becomes a RepMLP block (the paper
    keeps the stride-2 bottlenecks), except the first when ``keep_first`` (then the stage's first block
    stays the plain bottleneck whatever its stride). ``gc_ratio``: the bottlenecks get a GC block of
    that ratio; ``nonlocal_before``: a Non-local block is inserted before each of these block indices.
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
    """The blocks of ``spec`` after an input of ``in_channels`` channels at ``resolution`` ``(H, W)``.

    Returns the stage ``(N, in_channels, H, W) -> (N, width, H', W')`` and its output ``(H', W')``,
    the resolution its RepMLPs are built for.
    """
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
        if spec.repmlp is not None and stride == 1 and (j > 0 or not spec.keep_first):
            blocks.append(_repmlp_block(spec.repmlp, c_in, spec.width, res, deploy))
        else:
            # Built before its bottleneck: the parameters are created (and drawn) in module order.
            gc = GlobalContextBlock(spec.width, ratio=spec.gc_ratio) if spec.gc_ratio else None
            blocks.append(
                Bottleneck(
                    c_in,
                    spec.width,
                    mid_channels=spec.mid_channels,
                    stride=stride,
                    dilation=dilation,
                    context=gc,
                    deploy=deploy,
                )
            )
        c_in = spec.width
    return nn.Sequential(*blocks), res


def _repmlp_block(
    spec: RepMLPSpec, in_channels: int, out_channels: int, resolution: tuple[int, int], deploy: bool
) -> nn.Module:
    """A RepMLP Bottleneck or RepMLP Light Block ``(N, C_in, H, W) -> (N, C_out, H, W)`` at ``resolution``."""
    options = repmlp_options(spec.groups, spec.kernel_sizes, spec.global_reduction, deploy)
    if spec.block == "light":
        return RepMLPLightBlock(
            in_channels, out_channels, resolution, spec.partition, reduction=spec.reduction, **options
        )
    return RepMLPBottleneck(
        in_channels,
        out_channels,
        resolution,
        spec.partition,
        mid_channels=spec.mid_channels,
        reduction=spec.reduction,
        **options,
    )


class ResNet(PooledClassifierMixin, nn.Module):
    """A ResNet-50-style network composed of a stem, four stages (c2..c5) from :class:`StageSpec` s and
    a pooled linear classifier.

    The ResNet-50 family's stages (torchvision's ``resnet50`` with RepMLP, Non-local or GC blocks) come
    from :func:`repmlp.models.resnet.repmlp_res50_stages`; PSPNet dilates them, the face ResNets give
    their own stem and widths.

    Args:
        specs: the four stages c2..c5, in order.
        num_classes: classifier outputs; 0 for no classifier (``forward`` returns pooled features).
        global_pool: ``"avg"`` (global average pooling before the classifier) or ``""`` (none: with
            ``num_classes=0`` ``forward`` returns the c5 map), as timm's models.
        in_chans: input channels.
        img_size: input resolution the RepMLPs are built for (int or ``(H, W)``).
        stem: replacement stem module (default: torchvision's 7x7/2 conv-BN-ReLU + 3x3/2 max pool);
            ``stem_channels`` its output channels and ``stem_size`` a function mapping the input
            ``(H, W)`` to its output ``(H, W)``.
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
        else:
            if stem_size is None:
                raise ValueError("a custom stem needs stem_size (input (H, W) -> stem output (H, W))")
            self.stem = stem
            res = stem_size(self.img_size)
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

    def forward_stages(self, x: Tensor) -> list[Tensor]:
        """Outputs of c2, c3, c4, c5: ``[(N, widths[i], H_i, W_i)]`` (``stage_resolutions``)."""
        # Only the RepMLPs fix the input size: a plain ResNet pools whatever its stages see.
        fixed = len(self.repmlp_stages) > 0
        check_input_size(x, "this model's RepMLP layers are", self.in_chans, self.img_size, fixed)
        c2 = self.layer1(self.stem(x))  # written out: TorchScript iterates no list of unlike modules
        c3 = self.layer2(c2)
        c4 = self.layer3(c3)
        return [c2, c3, c4, self.layer4(c4)]

    def forward_features(self, x: Tensor) -> Tensor:
        """``(N, in_chans, H, W)`` -> c5 feature map ``(N, num_features, H/32, W/32)``."""
        return self.forward_stages(x)[-1]

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | Sequence[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]]:
        """timm's intermediate-feature API: the ``feature_info`` maps (stem, c2..c5) picked by ``indices``.

        ``indices``: an int takes the last n, a sequence the listed ones (negative from the end).
        Returns the list, or ``(forward_features(x), list)`` unless ``intermediates_only``.
        """
        from timm.models._features import feature_take_indices

        if output_fmt != "NCHW":
            raise ValueError(f"output_fmt must be 'NCHW', got {output_fmt!r}")
        take, last = feature_take_indices(len(self.feature_info), indices)
        # Only the RepMLPs fix the input size: a plain ResNet pools whatever its stages see.
        fixed = len(self.repmlp_stages) > 0
        check_input_size(x, "this model's RepMLP layers are", self.in_chans, self.img_size, fixed)
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
        """timm's API: drop the stages after the last ``feature_info`` map in ``indices`` (0 the stem,
        1..4 c2..c5) and, with ``prune_head``, the classifier and pooling; returns the kept indices.

        ``prune_norm`` is accepted for timm's signature: a ResNet has no final norm to drop.
        """
        from timm.models._features import feature_take_indices

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

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


@torch.jit.ignore  # Python-side check: TorchScript calls it as Python
def check_input_size(x: Tensor, subject: str, in_chans: int, img_size: Any, fixed: bool) -> None:
    """The models' one input check: raise ``ValueError`` unless ``x`` is ``(N, in_chans, H, W)``, with
    ``(H, W) == img_size`` when ``fixed`` (see :mod:`repmlp.nn.checks`).

    ``subject`` names what fixes the size in the message (``"MobileFaceNet is"``, ``"this model's RepMLP
    layers are"``): a fixed-size layer fed another size would fail deep inside, or silently change
    meaning (a GDConv no longer reducing to 1x1), so the error says which size to build for.
    """
    h, w = int(img_size[0]), int(img_size[1])
    size = h if h == w else (h, w)
    want = f"(N, {in_chans}, H, W)"
    if fixed:
        want = f"(N, {in_chans}, {h}, {w}) (in_chans={in_chans}, img_size={size})"
    checks.check_input_shape(x, (in_chans, None, None), f"expected input {want}, got {{shape}}")
    if fixed:
        checks.check_input_shape(
            x,
            (in_chans, h, w),
            f"{subject} built for {h}x{w} inputs, got {{h}}x{{w}}: img_size={size} takes "
            f"(N, {in_chans}, {h}, {w}); build it with img_size={{h}} for that resolution",
        )


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
