"""RepMLP-ResNet-50 family (paper Sec. 3.5, 4.2, Appendix A) and the Non-local / GC baselines.

Each is a :class:`~repmlp.models.blocks.ResNet` composed of the stages :func:`repmlp_res50_stages`
specifies (torchvision's ResNet-50 stages, with RepMLP, Non-local or GC blocks where the model has them).
"""

from collections.abc import Sequence
from typing import Any

from repmlp.models.blocks import RepMLPSpec, ResNet, StageSpec, parse_stages, per_stage
from repmlp.models.registry import register_model

__all__ = [
    "repmlp_res50_stages",
    "split_resnet_kwargs",
    "repmlp_res50",
    "repmlp_res50_g8_16",
    "repmlp_res50_g8_8",
    "repmlp_res50_g4_8",
    "repmlp_res50_light",
    "nl_res50",
    "gc_res50",
]

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
    indices, ...)}``, a Non-local block before each. ``stages=()`` with the defaults is torchvision's
    ``resnet50``.
    """
    n = len(layers)
    if n != 4:
        raise ValueError(f"layers must give 4 stages (c2..c5), got {layers!r}")
    if block not in ("bottleneck", "light"):
        raise ValueError(f"repmlp_block must be 'bottleneck' or 'light', got {block!r}")
    widths = per_stage(widths, n, "widths")
    mids = per_stage(mid_channels, n, "mid_channels") if mid_channels is not None else (None,) * n
    strides, dilations = per_stage(strides, n, "strides"), per_stage(dilations, n, "dilations")
    reduction, groups = per_stage(reduction, n, "reduction"), per_stage(groups, n, "groups")
    partitions = per_stage(partition, n, "partition") if _is_per_stage(partition, n) else (partition,) * n
    kernels = kernel_sizes if _is_nested(kernel_sizes) else (tuple(kernel_sizes),) * n
    kernels = per_stage(tuple(tuple(k) for k in kernels), n, "kernel_sizes")
    global_reduction = per_stage(global_reduction, n, "global_reduction")
    repmlp, gc = parse_stages(stages), parse_stages(gc_stages)
    nl = {parse_stages([k])[0]: tuple(v) for k, v in (nonlocal_blocks or {}).items()}
    return tuple(
        StageSpec(
            depth=layers[i],
            width=widths[i],
            stride=strides[i],
            dilation=dilations[i],
            first_dilation=dilations[i - 1] if i > 0 else 1,
            mid_channels=mids[i],
            repmlp=RepMLPSpec(
                block=block,
                partition=_tuple(partitions[i]),
                reduction=reduction[i],
                groups=groups[i],
                kernel_sizes=kernels[i],
                global_reduction=global_reduction[i],
                mid_channels=mids[i],
            )
            if i in repmlp
            else None,
            gc_ratio=gc_ratio if i in gc else None,
            nonlocal_before=nl.get(i, ()),
        )
        for i in range(n)
    )


def split_resnet_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split keyword arguments into :class:`ResNet`'s own and :func:`repmlp_res50_stages`'s."""
    own = {k: v for k, v in kwargs.items() if k in _MODEL_OPTIONS}
    return own, {k: v for k, v in kwargs.items() if k not in _MODEL_OPTIONS}


def _resnet(kwargs: dict[str, Any], deploy: bool) -> ResNet:
    """A ResNet of the stages and model options in ``kwargs`` (the registered models' arguments)."""
    own, stage_options = split_resnet_kwargs(kwargs)
    return ResNet(repmlp_res50_stages(**stage_options), deploy=deploy, **own)


def _tuple(value: Any) -> Any:
    """Lists as tuples (a frozen spec holds no mutable values); anything else unchanged."""
    return tuple(value) if isinstance(value, list) else value


def _is_per_stage(value: Any, n: int) -> bool:
    """A per-stage partition is a length-n sequence whose items are ints or pairs (an (h, w) pair is not)."""
    return isinstance(value, (list, tuple)) and len(value) == n and n != 2


def _is_nested(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and isinstance(value[0], (list, tuple))


def _cfg(size: int, fixed: bool = True) -> dict[str, Any]:
    """timm pretrained cfg at ``size`` x ``size``; ``fixed``: the RepMLP layers fix the input size."""
    return dict(
        input_size=(3, size, size),
        pool_size=(size // 32, size // 32),
        fixed_input_size=fixed,
        classifier="fc",
        first_conv="stem.conv.conv",
        feature_cfg=dict(out_indices=(0, 1, 2, 3, 4)),
    )


@register_model(**_cfg(224))
def repmlp_res50(
    pretrained: bool = False,
    *,
    stages: Sequence[int | str] | str = ("c3", "c4"),
    reduction: int | Sequence[int] = (2, 2, 4, 4),
    groups: int | Sequence[int] = 8,
    partition: int | Sequence[Any] = 7,
    kernel_sizes: Sequence[int] | Sequence[Sequence[int]] = (1, 3, 5),
    global_reduction: int | Sequence[int] = 1,
    block: str = "bottleneck",
    img_size: int | Sequence[int] = 224,
    num_classes: int = 1000,
    in_chans: int = 3,
    deploy: bool = False,
    **kwargs: Any,
) -> ResNet:
    """RepMLP-Res50: torchvision's ResNet-50 with RepMLP Bottlenecks in ``stages`` (paper Sec. 4.2).

    Defaults: the paper's 78.55% model (c3+c4, ``r = 2,2,4,4`` for c2..c5, ``g = 8``, ``h = w = 7``,
    ``K = 1,3,5``, 224x224). ``stages=()`` is exactly torchvision's ``resnet50``. ``reduction``,
    ``groups``, ``partition``, ``global_reduction`` take one value or one per stage (c2..c5); further
    keyword arguments go to :func:`repmlp_res50_stages` (``layers``, ``strides``, ``dilations``, ...)
    or :class:`ResNet` (``global_pool``, ``stem_channels``, ...).
    """
    options = dict(stages=stages, block=block, reduction=reduction, groups=groups, partition=partition)
    options.update(kernel_sizes=kernel_sizes, global_reduction=global_reduction)
    options.update(img_size=img_size, num_classes=num_classes, in_chans=in_chans)
    return _resnet({**options, **kwargs}, deploy)


def res50_320_options(c3_groups: int, c4_groups: int) -> dict[str, Any]:
    """Stage options of the paper's 320x320 comparisons: c3+c4, ``h = w = 10``, ``K = 1,3,5,7``,
    ``r = 2,2,4,4``, ``g`` = ``c3_groups`` in c3 and ``c4_groups`` in c4."""
    return dict(
        stages=("c3", "c4"), groups=(8, c3_groups, c4_groups, 8), partition=10, kernel_sizes=(1, 3, 5, 7)
    )


def _res50_320(c3_groups: int, c4_groups: int, **kwargs: Any) -> ResNet:
    """A RepMLP-Res50 of :func:`res50_320_options` at 320x320."""
    opts: dict[str, Any] = dict(res50_320_options(c3_groups, c4_groups), img_size=320)
    opts.update(kwargs)
    return repmlp_res50(**opts)


@register_model(**_cfg(320))
def repmlp_res50_g8_16(pretrained: bool = False, **kwargs: Any) -> ResNet:
    """RepMLP-Res50-g8/16 (320x320): ``g = 8`` in c3, 16 in c4."""
    return _res50_320(8, 16, **kwargs)


@register_model(**_cfg(320))
def repmlp_res50_g8_8(pretrained: bool = False, **kwargs: Any) -> ResNet:
    """RepMLP-Res50-g8/8 (320x320): ``g = 8`` in c3 and c4."""
    return _res50_320(8, 8, **kwargs)


@register_model(**_cfg(320))
def repmlp_res50_g4_8(pretrained: bool = False, **kwargs: Any) -> ResNet:
    """RepMLP-Res50-g4/8 (320x320): ``g = 4`` in c3, 8 in c4 (the PSPNet backbone of Sec. 4.4)."""
    return _res50_320(4, 8, **kwargs)


@register_model(**_cfg(224))
def repmlp_res50_light(pretrained: bool = False, **kwargs: Any) -> ResNet:
    """ResNet-50 with RepMLP Light Blocks in c3+c4 (paper Appendix A).

    8x channel reduction/expansion by 1x1 convs around each RepMLP, ``g = 8``, ``h = w = 7``, ``K = 1,3,5``.
    """
    opts: dict[str, Any] = dict(block="light", reduction=8, groups=8, partition=7, kernel_sizes=(1, 3, 5))
    opts.update(kwargs)
    return repmlp_res50(**opts)


@register_model(**_cfg(320, fixed=False))
def nl_res50(
    pretrained: bool = False,
    *,
    num_classes: int = 1000,
    in_chans: int = 3,
    img_size: int = 320,
    deploy: bool = False,
    **kwargs: Any,
) -> ResNet:
    """NL-Res50: ResNet-50 + one Non-local block (embedded Gaussian, subsampled ``phi``/``g``) in c4,
    right before its last residual block - the Non-local paper's ImageNet-style "1 block in res4".
    """
    layers = kwargs.pop("layers", _LAYERS_50)
    options = dict(stages=(), layers=layers, nonlocal_blocks={4: (layers[2] - 1,)})
    options.update(num_classes=num_classes, in_chans=in_chans, img_size=img_size)
    return _resnet({**options, **kwargs}, deploy)


@register_model(**_cfg(320, fixed=False))
def gc_res50(
    pretrained: bool = False,
    *,
    num_classes: int = 1000,
    in_chans: int = 3,
    img_size: int = 320,
    deploy: bool = False,
    gc_ratio: int = 16,
    **kwargs: Any,
) -> ResNet:
    """GC-Res50: ResNet-50 with a GC block (ratio 1/16) after the last 1x1 conv of every bottleneck of
    c3, c4 and c5 (GCNet's ImageNet setting).
    """
    options = dict(stages=(), gc_stages=("c3", "c4", "c5"), gc_ratio=gc_ratio)
    options.update(num_classes=num_classes, in_chans=in_chans, img_size=img_size)
    return _resnet({**options, **kwargs}, deploy)
