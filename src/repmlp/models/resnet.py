"""RepMLP-ResNet-50 family (paper Sec. 3.5, 4.2, Appendix A) and the Non-local / GC baselines.

All are :class:`~repmlp.models.blocks.ResNet` configurations; see its docstring for the options.
"""

from collections.abc import Sequence
from typing import Any

from .blocks import ResNet
from .registry import register_model

__all__ = [
    "repmlp_res50",
    "repmlp_res50_g8_16",
    "repmlp_res50_g8_8",
    "repmlp_res50_g4_8",
    "repmlp_res50_light",
    "nl_res50",
    "gc_res50",
]

_LAYERS_50 = (3, 4, 6, 3)


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
    keyword arguments go to :class:`ResNet` (``layers``, ``strides``, ``dilations``, ...).
    """
    return ResNet(
        kwargs.pop("layers", _LAYERS_50),
        repmlp_stages=stages,
        repmlp_block=block,
        reduction=reduction,
        groups=groups,
        partition=partition,
        kernel_sizes=kernel_sizes,
        global_reduction=global_reduction,
        img_size=img_size,
        num_classes=num_classes,
        in_chans=in_chans,
        deploy=deploy,
        **kwargs,
    )


def _res50_320(c3_groups: int, c4_groups: int, **kwargs: Any) -> ResNet:
    """Paper Table comparisons at 320x320: c3+c4, ``h = w = 10``, ``K = 1,3,5,7``, ``r = 2,2,4,4``."""
    opts: dict[str, Any] = dict(
        stages=("c3", "c4"),
        groups=(8, c3_groups, c4_groups, 8),
        partition=10,
        kernel_sizes=(1, 3, 5, 7),
        img_size=320,
    )
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
    return ResNet(
        layers,
        nonlocal_blocks={4: (layers[2] - 1,)},
        num_classes=num_classes,
        in_chans=in_chans,
        img_size=img_size,
        deploy=deploy,
        **kwargs,
    )


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
    return ResNet(
        kwargs.pop("layers", _LAYERS_50),
        gc_stages=("c3", "c4", "c5"),
        gc_ratio=gc_ratio,
        num_classes=num_classes,
        in_chans=in_chans,
        img_size=img_size,
        deploy=deploy,
        **kwargs,
    )
