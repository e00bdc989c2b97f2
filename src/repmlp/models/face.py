"""Face-recognition models of the paper's Sec. 4.3 (96x96 aligned faces -> embedding).

- :class:`MobileFaceNet` (Chen et al. 2018) at 96x96: the global depthwise conv covers the 6x6 map.
- :class:`FaceResNet`: the paper's customised ResNet, optionally with RepMLP Bottlenecks replacing the
  stride-1 bottlenecks of chosen stages (``repmlp_face_resnet``: c2, c3, c4 with h=w=6, r=2, g=4).

Every model returns an embedding ``(N, embedding_dim)``; the classification layer lives in the
loss (:class:`repmlp.tasks.losses.AMSoftmax`), so the deployed model is the embedding network alone.
"""

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from timm.models import generate_default_cfgs, register_model
from torch import Tensor, nn

from repmlp.models.layers import ConvBNReLU, build, cfg, check_input_size, layer_like
from repmlp.models.resnet import RepMLPSpec, ResNet, StageSpec, parse_stages, per_stage
from repmlp.nn.layers import ConvBN
from repmlp.nn.reparam import absorb_bn_into_fc, fuse_bn

__all__ = ["MobileFaceNet", "FaceResNet", "DeepStem", "EmbeddingHead", "face_stages", "mobilefacenet",
           "face_resnet", "repmlp_face_resnet"]  # fmt: skip


def _check_pool(model: str, global_pool: str, own: str) -> str:
    """A face model's ``global_pool``: ``own`` (its reduction of the last map) or ``""``, timm's "no pooling":
    without an embedding layer (``num_classes=0``) the model then returns the last map ``(N, C, k, k)``; an
    embedding layer takes only the reduced map (timm sets ``num_classes`` and ``global_pool`` apart)."""
    if global_pool not in (own, ""):
        raise ValueError(
            f"{model} takes global_pool={own!r} (its own reduction of the last map) or '' (the map "
            f"itself, when num_classes=0), got {global_pool!r}"
        )
    return global_pool


class _ConvBNAct(nn.Sequential):
    """ConvBN followed by PReLU (MobileFaceNet's activation) or nothing (a linear layer)."""

    def __init__(
        self, cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, *, act: bool, deploy: bool
    ) -> None:
        layers: list[nn.Module] = [ConvBN(cin, cout, k, stride, groups=groups, deploy=deploy)]
        if act:
            layers.append(nn.PReLU(cout))
        super().__init__(*layers)


class _InvertedResidual(nn.Module):
    """MobileNetV2 bottleneck (1x1 expand, 3x3 depthwise, linear 1x1 project), residual when shapes allow.

    Shapes: ``(N, C, H, W)`` -> ``(N, O, H/s, W/s)``.
    """

    def __init__(self, cin: int, cout: int, stride: int, expansion: int, deploy: bool) -> None:
        super().__init__()
        mid = cin * expansion
        self.body = nn.Sequential(
            _ConvBNAct(cin, mid, 1, act=True, deploy=deploy),
            _ConvBNAct(mid, mid, 3, stride, groups=mid, act=True, deploy=deploy),
            _ConvBNAct(mid, cout, 1, act=False, deploy=deploy),
        )
        self.residual = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        y = self.body(x)
        return x + y if self.residual else y


class MobileFaceNet(nn.Module):
    """MobileFaceNet (Chen et al. 2018, Table 1), sized for ``img_size`` inputs (paper: 96).

    The global depthwise conv (GDConv) has the kernel size of the last feature map (``img_size/16``),
    which is what makes it "global"; it and the final 1x1 conv are linear (BN, no activation).

    Shapes: ``(N, in_chans, img_size, img_size)`` -> ``(N, embedding_dim)``.
    """

    # (expansion t, output channels c, repeats n, first stride s) of the paper's Table 1.
    SETTINGS = ((2, 64, 5, 2), (4, 128, 1, 2), (2, 128, 6, 1), (4, 128, 1, 2), (2, 128, 2, 1))

    def __init__(
        self,
        *,
        embedding_dim: int = 128,
        in_chans: int = 3,
        img_size: int = 96,
        width: int = 64,
        global_pool: str = "gdconv",
        deploy: bool = False,
    ) -> None:
        super().__init__()
        self.global_pool = _check_pool("MobileFaceNet", global_pool, "gdconv")
        if img_size % 16:
            raise ValueError(
                f"MobileFaceNet needs img_size divisible by 16 (four stride-2 stages), got {img_size}"
            )
        self.embedding_dim, self.img_size, self.in_chans = embedding_dim, img_size, in_chans
        scale = width / 64
        layers: list[nn.Module] = [
            _ConvBNAct(in_chans, width, 3, 2, act=True, deploy=deploy),
            _ConvBNAct(width, width, 3, groups=width, act=True, deploy=deploy),
        ]
        # timm's feature_info: the last layer at each resolution (module, channels, reduction).
        self.feature_info: list[dict[str, Any]] = []
        cin, reduction = width, 2
        for t, c, n, s in self.SETTINGS:
            if s != 1:
                self.feature_info.append(
                    dict(num_chs=cin, reduction=reduction, module=f"features.{len(layers) - 1}")
                )
                reduction *= s
            cout = max(1, round(c * scale))
            for i in range(n):
                layers.append(_InvertedResidual(cin, cout, s if i == 0 else 1, t, deploy))
                cin = cout
        last = max(1, round(512 * scale))
        k = img_size // 16
        layers.append(_ConvBNAct(cin, last, 1, act=True, deploy=deploy))
        self.feature_info.append(
            dict(num_chs=last, reduction=reduction, module=f"features.{len(layers) - 1}")
        )
        layers += [
            _ConvBNAct(last, last, k, groups=last, act=False, deploy=deploy),  # GDConv: k x k -> 1 x 1
            _ConvBNAct(last, embedding_dim, 1, act=False, deploy=deploy) if embedding_dim else nn.Identity(),
        ]
        # ConvBN's default "same" padding would keep the GDConv's output k x k; it must be valid.
        layers[-2][0].conv.padding = (0, 0)
        self.features = nn.Sequential(*layers)
        # timm's contract: forward_features ends before the GDConv (the "global pool"), the head is
        # GDConv + the embedding layer (the "classifier"), whose width is num_classes.
        self.num_features = self.head_hidden_size = last
        self.num_classes = embedding_dim
        self._deploy = deploy

    def forward_features(self, x: Tensor) -> Tensor:
        """``(N, in_chans, S, S)`` -> the last map before the GDConv ``(N, num_features, S/16, S/16)``."""
        # The GDConv's kernel is the last map's size: another input size would not be reduced to 1x1,
        # and the "embedding" would silently be a flattened map of another width.
        check_input_size(x, "MobileFaceNet is", self.in_chans, (self.img_size, self.img_size), True)
        for i, layer in enumerate(self.features):  # all but the GDConv and the embedding layer
            if i < len(self.features) - 2:
                x = layer(x)
        return x

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """GDConv (``pre_logits``: ``(N, num_features)``), then the embedding layer: ``(N, embedding_dim)``.

        With ``global_pool=""`` and no embedding layer: the map ``(N, num_features, k, k)``.
        """
        if self.global_pool == "" and not self.num_classes:
            return x
        x = self.features[-2](x)
        return x.flatten(1) if pre_logits else self.features[-1](x).flatten(1)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def get_classifier(self) -> nn.Module:
        return self.features[-1]

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A fresh ``num_classes``-wide embedding layer (none for 0).

        ``global_pool``: ``"gdconv"`` (the GDConv reduces the map, as built) or ``""`` (with
        ``num_classes=0`` the model returns the unreduced last map); ``None`` keeps the current one.
        """
        if global_pool is not None:
            self.global_pool = _check_pool("MobileFaceNet", global_pool, "gdconv")
        self.num_classes = self.embedding_dim = num_classes
        self.features[-1] = layer_like(
            self,
            _ConvBNAct(self.num_features, num_classes, 1, act=False, deploy=self._deploy)
            if num_classes > 0
            else nn.Identity(),
        )


class EmbeddingHead(nn.Module):
    """Face-ResNet embedding head: BN -> flatten -> FC -> BN (the usual "BN-FC-BN" output layer).

    Keeps the spatial layout of the last ``(C, k, k)`` map (faces are aligned, so where a feature
    is matters, which is the paper's point about FC layers on faces) instead of pooling it away.
    Both BNs are foldable into the FC for inference. Shapes: ``(N, C, k, k)`` -> ``(N, D)``.
    """

    def __init__(self, channels: int, spatial: int, embedding_dim: int, deploy: bool = False) -> None:
        super().__init__()
        # Without an embedding layer (embedding_dim=0, timm's num_classes=0) bn_in has no FC to fold into.
        self.bn_in = nn.Identity() if deploy and embedding_dim else nn.BatchNorm2d(channels)
        self.fc = nn.Linear(channels * spatial * spatial, embedding_dim) if embedding_dim else nn.Identity()
        self.bn_out = nn.Identity() if deploy or not embedding_dim else nn.BatchNorm1d(embedding_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn_out(self.fc(self.bn_in(x).flatten(1)))

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Fold both BNs into the FC (equivalent in eval mode)."""
        if isinstance(self.bn_out, nn.Identity):
            return
        w, b = self.fc.weight, self.fc.bias
        # bn_in normalises each channel of a (C, k, k) map: one affine per channel, repeated k*k times.
        w, b = absorb_bn_into_fc(w, b, self.bn_in)
        w, b = fuse_bn(w, self.bn_out, b)
        self.fc.weight.copy_(w)
        self.fc.bias.copy_(b)
        self.bn_in, self.bn_out = nn.Identity(), nn.Identity()


class DeepStem(nn.Module):
    """Deep stem (ResNet-C of He et al., "Bag of Tricks", 2019): three 3x3 conv-BN-ReLU with ``C/2``,
    ``C/2``, ``C`` channels (the first strided) + 3x3/2 max pool, in place of the 7x7/2 conv.

    FaceResNet's stem: the paper does not describe it, its parameter and MAC counts single it out
    (docs/models.md, "Deviations"). Shapes: ``(N, C_in, H, W)`` -> ``(N, C, H/4, W/4)``.
    """

    def __init__(self, in_chans: int, channels: int, *, deploy: bool = False) -> None:
        super().__init__()
        half = channels // 2
        self.convs = nn.Sequential(
            ConvBNReLU(in_chans, half, 3, 2, deploy=deploy),
            ConvBNReLU(half, half, 3, deploy=deploy),
            ConvBNReLU(half, channels, 3, deploy=deploy),
        )
        self.pool = nn.MaxPool2d(3, 2, 1)

    @staticmethod
    def out_size(size: tuple[int, int]) -> tuple[int, int]:
        return tuple((((s + 1) // 2) + 1) // 2 for s in size)  # type: ignore[return-value]

    def forward(self, x: Tensor) -> Tensor:
        return self.pool(self.convs(x))


class FaceResNet(nn.Module):
    """The paper's FaceResNet, optionally with RepMLP Bottlenecks (RepMLP-FaceRes).

    A :class:`~repmlp.models.resnet.ResNet` trunk (:class:`DeepStem` by default, ``stem="resnet"`` for
    ResNet-50's 7x7/2 conv and 3x3/2 max pool; then c2..c5 of ``layers`` bottlenecks whose three
    convs all have ``widths[i]`` channels: the 1x1 convs neither reduce nor expand), followed by
    :class:`EmbeddingHead`.

    In every stage of ``repmlp_stages`` the bottlenecks after the first become RepMLP Bottlenecks (paper:
    "the last two bottlenecks of c2 and the last blocks of c3, c4"; c2's first block has stride 1 in a
    ResNet-50 but changes the width, and the paper keeps it). A RepMLP Bottleneck is the paper's block
    of Sec. 3.5 as defined there: its 1x1 conv reduces ``widths[i]`` 4x, its 3x3 conv a further ``r``x,
    then a RepMLP with partition ``h = w = partition`` and ``groups`` (no Global Perceptron in c4,
    whose 6x6 map is a single partition). This is as cheap as the text allows, yet the paper's
    RepMLP-FaceRes counts cannot be reached: see docs/models.md, "Deviations".

    Shapes: ``(N, in_chans, img_size, img_size)`` -> ``(N, embedding_dim)``; c2..c5 see
    ``img_size/4 .. img_size/32`` (24, 12, 6, 3 at 96).
    """

    def __init__(
        self,
        *,
        layers: Sequence[int] = (3, 2, 2, 2),
        widths: Sequence[int] = (128, 256, 512, 1024),
        stem_channels: int = 64,
        embedding_dim: int = 1024,
        in_chans: int = 3,
        img_size: int = 96,
        repmlp_stages: Sequence[int | str] | str = (),
        partition: int = 6,
        reduction: int = 2,
        groups: int = 4,
        kernel_sizes: Sequence[int] = (1, 3, 5),
        stem: str = "deep",
        global_pool: str = "flatten",
        deploy: bool = False,
    ) -> None:
        super().__init__()
        self.global_pool = _check_pool("FaceResNet", global_pool, "flatten")
        if stem not in ("resnet", "deep"):
            raise ValueError(f"stem must be 'resnet' or 'deep', got {stem!r}")
        stem_opts: dict[str, Any] = {}
        if stem == "deep":
            stem_opts = dict(
                stem=DeepStem(in_chans, stem_channels, deploy=deploy), stem_size=DeepStem.out_size
            )
        if img_size % 32:
            raise ValueError(f"FaceResNet needs img_size divisible by 32 (c5 is img_size/32), got {img_size}")
        self.embedding_dim, self.img_size, self.in_chans = embedding_dim, img_size, in_chans
        self.num_classes = embedding_dim
        self.repmlp_stages = parse_stages(repmlp_stages)
        repmlp = RepMLPSpec(
            partition=partition, reduction=reduction, groups=groups, kernel_sizes=tuple(kernel_sizes)
        )
        specs = face_stages(layers, widths, self.repmlp_stages, repmlp)
        self.trunk = ResNet(specs, num_classes=0, in_chans=in_chans, img_size=img_size, stem_channels=stem_channels,
                            deploy=deploy, **stem_opts)  # fmt: skip
        h, w = self.trunk.stage_resolutions[-1]
        self.head = EmbeddingHead(widths[-1], h, embedding_dim, deploy)
        # timm's contract: the embedding FC is the "classifier", the flattened c5 map its input.
        self.num_features, self.head_hidden_size = widths[-1], widths[-1] * h * w
        self.feature_info = [{**f, "module": f"trunk.{f['module']}"} for f in self.trunk.feature_info]

    def forward_features(self, x: Tensor) -> Tensor:
        """``(N, in_chans, S, S)`` -> c5 map ``(N, num_features, S/32, S/32)``."""
        check_input_size(x, "FaceResNet is", self.in_chans, (self.img_size, self.img_size), True)
        return self.trunk.forward_features(x)

    def forward_intermediates(self, x: Tensor, *args: Any, **kwargs: Any) -> Any:
        """timm's intermediate-feature API (:meth:`ResNet.forward_intermediates` of the trunk)."""
        check_input_size(x, "FaceResNet is", self.in_chans, (self.img_size, self.img_size), True)
        return self.trunk.forward_intermediates(x, *args, **kwargs)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """``(N, C, k, k)`` -> embedding ``(N, embedding_dim)``; ``pre_logits``: the flattened map.

        With ``global_pool=""`` and no embedding layer: the normalised map ``(N, C, k, k)``.
        """
        if self.global_pool == "" and not self.num_classes:
            return self.head.bn_in(x)
        return self.head.bn_in(x).flatten(1) if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A fresh ``num_classes``-wide embedding FC (+ BN in the training form); none for 0.

        ``global_pool``: ``"flatten"`` (the c5 map flattened into the FC, as built) or ``""`` (with
        ``num_classes=0`` the model returns the c5 map itself); ``None`` keeps the current one.
        """
        if global_pool is not None:
            self.global_pool = _check_pool("FaceResNet", global_pool, "flatten")
        self.num_classes = self.embedding_dim = num_classes
        train_form = not isinstance(self.head.bn_out, nn.Identity)
        fc = nn.Linear(self.head_hidden_size, num_classes) if num_classes > 0 else nn.Identity()
        bn_out = nn.BatchNorm1d(num_classes) if num_classes > 0 and train_form else nn.Identity()
        self.head.fc, self.head.bn_out = layer_like(self, fc), layer_like(self, bn_out)


def face_stages(
    layers: Sequence[int], widths: Sequence[int], repmlp_stages: Sequence[int], repmlp: RepMLPSpec
) -> tuple[StageSpec, ...]:
    """FaceResNet's c2..c5: ``layers`` bottlenecks whose three convs all have ``widths[i]`` channels,
    c3..c5 strided, and in the stages of ``repmlp_stages`` (0-based) RepMLP Bottlenecks after the first
    block: ``repmlp`` with the paper's Sec. 3.5 widths (``widths[i]/4`` after the first 1x1 conv).
    """
    n = len(layers)
    if n != 4:
        raise ValueError(f"layers must give 4 stages (c2..c5), got {layers!r}")
    widths = per_stage(widths, n, "widths")
    return tuple(
        StageSpec(
            depth=layers[i],
            width=widths[i],
            stride=1 if i == 0 else 2,
            mid_channels=widths[i],
            repmlp=replace(repmlp, mid_channels=widths[i] // 4) if i in repmlp_stages else None,
            keep_first=True,
        )  # fmt: skip
        for i in range(n)
    )


_FACE_CFG: dict[str, Any] = dict(
    input_size=(3, 96, 96), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), crop_pct=1.0, fixed_input_size=True
)
_FACE_RESNET_CFG = cfg(num_classes=1024, first_conv="trunk.stem.convs.0.conv", classifier="head.fc",
                       pool_size=(3, 3), **_FACE_CFG)  # fmt: skip
default_cfgs = generate_default_cfgs({
    "mobilefacenet": cfg(num_classes=128, first_conv="features.0.0.conv", classifier="features.19.0.conv",
                         pool_size=(6, 6), **_FACE_CFG),
    "face_resnet": _FACE_RESNET_CFG,
    "repmlp_face_resnet": _FACE_RESNET_CFG,
})  # fmt: skip


def _create_face(cls: Callable[..., nn.Module], variant: str, pretrained: bool, **kwargs: Any) -> nn.Module:
    """timm's ``num_classes`` is the embedding width; ``features_only``: MobileFaceNet's layers (timm's
    FeatureListNet), FaceResNet's stages (its own ``forward_intermediates``, timm's FeatureGetterNet)."""
    default = default_cfgs[variant].default.num_classes

    def make(*, num_classes: int | None = None, **kw: Any) -> nn.Module:
        # timm's builder passes the cfg's num_classes (default) to every model: next to an explicit
        # embedding_dim that value defers to it; any other disagreement is an error.
        if num_classes is not None and not (num_classes == default and "embedding_dim" in kw):
            if kw.get("embedding_dim", num_classes) != num_classes:
                raise ValueError(
                    "give embedding_dim or num_classes (the same thing for a face model), not both"
                )
            kw["embedding_dim"] = num_classes
        return cls(**kw)

    feature_cfg = (dict(flatten_sequential=True, out_indices=(0, 1, 2, 3)) if variant == "mobilefacenet"
                   else dict(feature_cls="getter", out_indices=(0, 1, 2, 3, 4)))  # fmt: skip
    return build(make, variant, pretrained, feature_cfg=feature_cfg, **kwargs)


@register_model
def mobilefacenet(pretrained: bool = False, **kwargs: Any) -> MobileFaceNet:
    """MobileFaceNet at 96x96 (the paper's face table), 128-d embedding."""
    return _create_face(MobileFaceNet, "mobilefacenet", pretrained, **kwargs)


@register_model
def face_resnet(pretrained: bool = False, **kwargs: Any) -> FaceResNet:
    """FaceResNet (paper Sec. 4.3): blocks 3,2,2,2, widths 128..1024, 1024-d embedding, 96x96."""
    return _create_face(FaceResNet, "face_resnet", pretrained, **kwargs)


@register_model
def repmlp_face_resnet(pretrained: bool = False, **kwargs: Any) -> FaceResNet:
    """RepMLP-FaceRes (paper Sec. 4.3): FaceResNet with RepMLP Bottlenecks (h=w=6, r=2, g=4) in c2, c3, c4."""
    cls = partial(FaceResNet, repmlp_stages=("c2", "c3", "c4"))
    return _create_face(cls, "repmlp_face_resnet", pretrained, **kwargs)
