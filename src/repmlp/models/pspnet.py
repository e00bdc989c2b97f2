"""PSPNet (Zhao et al. 2017) on ResNet-50 and RepMLP-Res50-g4/8 backbones (paper Sec. 4.4).

Backbones as the paper sets them up for 713x713 Cityscapes crops:

- ``pspnet_res50``: torchvision's ResNet-50 with c4 and c5 dilated instead of strided (dilation 2
  and 4, output stride 8), as PSPNet-50.
- ``pspnet_repmlp_res50``: RepMLP-Res50-g4/8 (c3+c4 RepMLP Bottlenecks, ``h = w = 10``, ``g = 4``/``8``,
  ``K = 1,3,5,7``) with c4 not strided and *not* dilated (its receptive field is already large) and
  c5 dilated (2, so c5's effective stride stays continuous with c4's), so c3 and c4 both run at 90x90
  (81 partitions). Their Global Perceptron FC1 outputs / FC2 inputs are reduced 4x in c3 and 8x in c4.

Head: pyramid pooling on c5, a 3x3 conv-BN-ReLU to 512, dropout 0.1 and a 1x1 classifier; the auxiliary
head on c4 serves only the auxiliary loss: the converted (``deploy``) model, whose parameters the paper
counts, has none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from timm.models import FeatureListNet, generate_default_cfgs
from torch import Tensor, nn

from repmlp.models.layers import ConvBNReLU, build, cfg, check_input_size
from repmlp.models.registry import register_outside
from repmlp.models.resnet import (
    ResNet,
    StageSpec,
    per_stage,
    repmlp_res50_stages,
    res50_320_options,
    split_resnet_kwargs,
)

__all__ = ["PyramidPooling", "PSPNet", "pspnet_res50", "pspnet_repmlp_res50"]


class PyramidPooling(nn.Module):
    """PSPNet's pyramid pooling module: ``(N, C, H, W)`` -> ``(N, C + len(bins) * C/len(bins), H, W)``.

    Each bin size ``b`` average-pools the map to ``b x b``, reduces it with a 1x1 conv-BN-ReLU and
    bilinearly upsamples it back; the branches are concatenated with the input.
    """

    def __init__(self, in_channels: int, bins: Sequence[int] = (1, 2, 3, 6), *, deploy: bool = False) -> None:
        super().__init__()
        self.bins = tuple(bins)
        reduced = in_channels // len(self.bins)
        self.branches = nn.ModuleList(ConvBNReLU(in_channels, reduced, 1, deploy=deploy) for _ in self.bins)
        self.out_channels = in_channels + reduced * len(self.bins)

    def forward(self, x: Tensor) -> Tensor:
        size = x.shape[-2:]
        outs = [x]
        for b, branch in zip(self.bins, self.branches, strict=True):
            y = branch(F.adaptive_avg_pool2d(x, b))
            outs.append(F.interpolate(y, size=size, mode="bilinear", align_corners=True))
        return torch.cat(outs, 1)


class _SegHead(nn.Sequential):
    """3x3 conv-BN-ReLU, dropout, 1x1 classifier: ``(N, C, H, W)`` -> ``(N, num_classes, H, W)``."""

    def __init__(
        self, in_channels: int, channels: int, num_classes: int, dropout: float, deploy: bool
    ) -> None:
        super().__init__(
            ConvBNReLU(in_channels, channels, 3, deploy=deploy),
            nn.Dropout2d(dropout),
            nn.Conv2d(channels, num_classes, 1),
        )


class PSPNet(nn.Module):
    """PSPNet on a :class:`~repmlp.models.resnet.ResNet` backbone (``num_classes=0``) whose c4 and c5
    outputs have ``c4_channels`` and ``c5_channels`` channels.

    The backbone is used through timm's feature interface: ``self.backbone`` is timm's
    ``FeatureListNet`` over the ResNet's ``feature_info`` with ``out_indices=(1, 2, 3, 4)`` (c2..c5),
    what ``timm.create_model(name, features_only=True, out_indices=(1, 2, 3, 4))`` builds; its
    submodules (``stem``, ``layer1`` .. ``layer4``) and so the state-dict keys are the ResNet's.

    ``forward`` returns logits ``(N, num_classes, H, W)`` upsampled to the input size; in training mode,
    with the auxiliary head present, it returns ``(main, aux)`` (both at the input size).
    """

    def __init__(
        self,
        backbone: ResNet,
        c4_channels: int,
        c5_channels: int,
        *,
        num_classes: int = 19,
        bins: Sequence[int] = (1, 2, 3, 6),
        head_channels: int = 512,
        aux_channels: int = 256,
        dropout: float = 0.1,
        aux: bool = True,
        deploy: bool = False,
    ) -> None:
        super().__init__()
        self.num_classes, self.in_chans, self.img_size = num_classes, backbone.in_chans, backbone.img_size
        # The features skip the ResNet's own forward (and its input check): PSPNet checks the input.
        self._fixed_input_size = len(backbone.repmlp_stages) > 0
        self.backbone = FeatureListNet(backbone, out_indices=(1, 2, 3, 4))
        self.ppm = PyramidPooling(c5_channels, bins, deploy=deploy)
        self.head = _SegHead(self.ppm.out_channels, head_channels, num_classes, dropout, deploy)
        # The auxiliary head is training-only: the inference form (deploy) has none.
        self.aux_head = (
            _SegHead(c4_channels, aux_channels, num_classes, dropout, deploy) if aux and not deploy else None
        )

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        check_input_size(
            x, "this model's RepMLP layers are", self.in_chans, self.img_size, self._fixed_input_size
        )
        size = x.shape[-2:]
        c2, c3, c4, c5 = self.backbone(x)
        out = F.interpolate(self.head(self.ppm(c5)), size=size, mode="bilinear", align_corners=True)
        if self.training and self.aux_head is not None:
            aux = F.interpolate(self.aux_head(c4), size=size, mode="bilinear", align_corners=True)
            return out, aux
        return out

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Drop the auxiliary head (training-only); conv-BN pairs fuse in their own ``reparameterize``."""
        self.aux_head = None


# timm's pretrained_cfg of both PSPNets: Cityscapes' 19 classes, the paper's 713x713 crops (ImageNet statistics).
# Not registered with timm (register_outside): a dense predictor has no pooled classifier, so timm's classifier
# contract (num_features, forward_head, reset_classifier, pool_size) has no meaning for it.
default_cfgs = generate_default_cfgs({
    name: cfg(input_size=(3, 713, 713), num_classes=19, classifier="head.2", first_conv="backbone.stem.conv.conv")
    for name in ("pspnet_res50", "pspnet_repmlp_res50")
})  # fmt: skip


@register_outside
def pspnet_res50(pretrained: bool = False, **kwargs: Any) -> PSPNet:
    """PSPNet with a ResNet-50 backbone, c4/c5 dilated 2/4 (output stride 8), 19 Cityscapes classes.

    Options: ``num_classes``, ``img_size``, ``in_chans``, ``deploy``; PSPNet's ``bins``, ``head_channels``,
    ``aux_channels``, ``dropout``, ``aux``; the stage options of
    :func:`~repmlp.models.resnet.repmlp_res50_stages` (``widths``, ``layers``, ``strides``, ``dilations``, ...).
    """
    stages = partial(repmlp_res50_stages, stages=())
    return build(partial(_pspnet, stages, (1, 1, 2, 4)), "pspnet_res50", pretrained, **kwargs)


@register_outside
def pspnet_repmlp_res50(pretrained: bool = False, **kwargs: Any) -> PSPNet:
    """PSPNet with a RepMLP-Res50-g4/8 backbone (c4 neither strided nor dilated, c5 dilated 2).

    FC1/FC2 of the Global Perceptrons are reduced 4x in c3 and 8x in c4 (``global_reduction``). Options as
    :func:`pspnet_res50`, plus the RepMLP-Res50 ones (``groups``, ``partition``, ...).
    """
    stages = partial(repmlp_res50_stages, **res50_320_options(4, 8), global_reduction=(1, 4, 8, 1))
    return build(partial(_pspnet, stages, (1, 1, 1, 2)), "pspnet_repmlp_res50", pretrained, **kwargs)


_HEAD_OPTIONS = ("bins", "head_channels", "aux_channels", "dropout", "aux")


def _pspnet(
    stages: Callable[..., Sequence[StageSpec]],
    dilations: tuple[int, ...],
    *,
    num_classes: int = 19,
    img_size: int | Sequence[int] = 713,
    deploy: bool = False,
    **kwargs: Any,
) -> PSPNet:
    """A PSPNet on the ImageNet backbone ``stages(**stage_options)`` made dense for segmentation: c3 strided
    (the default ``strides``), c4/c5 at the given default ``dilations``. ``kwargs``: PSPNet's head options,
    the ResNet's model options and the stage options."""
    own = {k: kwargs.pop(k) for k in _HEAD_OPTIONS if k in kwargs}
    model_options, stage_options = split_resnet_kwargs(kwargs)
    widths = stage_options.get("widths", (256, 512, 1024, 2048))
    strides = stage_options.pop("strides", (1, 2, 1, 1))
    specs = _dilated(stages(**stage_options), strides, stage_options.pop("dilations", dilations))
    backbone = ResNet(specs, num_classes=0, img_size=img_size, deploy=deploy, **model_options)
    return PSPNet(backbone, widths[2], widths[3], num_classes=num_classes, deploy=deploy, **own)


def _dilated(
    specs: Sequence[StageSpec], strides: int | Sequence[int], dilations: int | Sequence[int]
) -> tuple[StageSpec, ...]:
    """The ImageNet backbone's stages with segmentation's ``strides`` and ``dilations`` (one per stage, or
    one for all); a stage's first block takes the previous stage's dilation (torchvision's
    ``replace_stride_with_dilation``).

    Every stage's first block stays the ImageNet model's plain bottleneck (``keep_first``): the ImageNet
    RepMLP-Res50 keeps each stage's first (stride-2) bottleneck, and un-striding c4 must not turn it into a
    RepMLP Bottleneck, or the backbone would no longer be the pretrained one (and c4 would gain a sixth RepMLP).
    """
    strides = per_stage(strides, len(specs), "strides")
    dilations = per_stage(dilations, len(specs), "dilations")
    previous = (1, *dilations[:-1])
    return tuple(
        replace(spec, stride=s, dilation=d, first_dilation=p, keep_first=True)
        for spec, s, d, p in zip(specs, strides, dilations, previous, strict=True)
    )
