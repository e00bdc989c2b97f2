"""The pure MLP of paper Sec. 4.1 (CIFAR-10), its ablations, the Wide ConvNet, and its Fashion-MNIST variants.

One builder, :class:`PureMLP`: a 1x1 "FC" stem (or an FC on ``p x p`` patches, ``patch_size``), then stages
at full, 1/2, 1/4 of the stem's resolution (2x2 max pool between them), each ``mixer, FC(C, C), mixer,
FC(C, C_next)`` with a ReLU after every mixer and every FC (a 1x1 conv-BN), then the classifier. The mixer
is what the paper's variants change:

* ``"repmlp"``: a RepMLP (``g = 2``, ``h = w = 8``, ``K = 1,3,5,7`` on CIFAR) - the pure MLP;
  ``global_perceptron=False`` / ``kernel_sizes=()`` give rows C (w/o Global) and B (w/o Local);
* ``"fc3_conv9"``: a RepMLP whose FC3 is a groupwise 9x9 conv-BN on the partition map (row D);
* ``"conv"``: a plain groupwise ``K x K`` conv-BN (row E with ``K = 9``, ``g = 2``; the Wide ConvNet
  with ``K = 3``, ``g = 1`` and doubled widths).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from timm.models import generate_default_cfgs, register_model
from torch import Tensor, nn

from repmlp.data import NATIVE_SIZE, NORMALIZATION
from repmlp.models.layers import ConvBNReLU, PooledClassifierMixin, build, cfg, check_input_size
from repmlp.nn import block as rep
from repmlp.nn import checks
from repmlp.nn.block import GlobalPerceptron, RepMLPBlock, RepMLPBlock1d
from repmlp.nn.layers import ConvBN

__all__ = ["PureMLP", "MixerSpec", "mixer_layer", "pure_mlp_stages", "PartitionConvBlock", "pure_mlp_cfg",
           "repmlp_cifar", "repmlp_cifar_no_local", "repmlp_cifar_no_global", "repmlp_cifar_fc3_conv9",
           "repmlp_cifar_conv9", "wide_convnet_cifar", "repmlp_fmnist", "repmlp_fmnist_patch2"]  # fmt: skip


class PartitionConvBlock(nn.Module):
    """Row D of the paper's ablation: a RepMLP whose FC3 is replaced by a groupwise ``K x K`` conv + BN.

    Global Perceptron as in RepMLP, then the partition map goes through the big conv (zero-padded per
    partition, so its receptive field is the partition) plus the Local Perceptron convs; all are
    merged into the big conv by :meth:`reparameterize` (smaller kernels zero-padded to ``K x K``).

    Shapes: ``(N, C, H, W)`` -> ``(N, O, H, W)``; ``H, W`` multiples of the partition.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        resolution: int,
        partition: int,
        *,
        kernel_size: int = 9,
        groups: int = 1,
        kernel_sizes: Sequence[int] = (1, 3, 5, 7),
        global_perceptron: bool = True,
        deploy: bool = False,
    ) -> None:
        super().__init__()
        if resolution % partition:
            raise ValueError(f"resolution {resolution} must be a multiple of the partition {partition}")
        if any(k > kernel_size or k % 2 == 0 for k in kernel_sizes):
            raise ValueError(f"Local Perceptron kernels {kernel_sizes} must be odd and <= {kernel_size}")
        self.resolution, self.partition, self.in_channels = resolution, partition, in_channels
        self.parts = resolution // partition
        self.kernel_size = kernel_size
        self.global_perceptron = (
            GlobalPerceptron(in_channels, (self.parts, self.parts), (partition, partition), 1, deploy)
            if global_perceptron and self.parts > 1
            else None
        )
        self.conv = ConvBN(in_channels, out_channels, kernel_size, groups=groups, deploy=deploy)
        self.local = (
            nn.ModuleList(ConvBN(in_channels, out_channels, k, groups=groups) for k in kernel_sizes)
            if kernel_sizes and not deploy
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        c, r = self.in_channels, self.resolution
        checks.check_input_shape(x, (c, r, r), f"block built for input (N, {c}, {r}, {r}), got {{shape}}")
        n, h, cl = x.shape[0], self.partition, rep.is_channels_last(x)
        # through the module, as torch.fx patches these leaves there (repmlp.nn.block)
        parts = rep.partition(x, h, h, cl)
        if self.global_perceptron is not None:
            v = self.global_perceptron(x).permute(0, 2, 3, 1).reshape(parts.shape[0], c, 1, 1)
            parts = parts + v
        out = self.conv(parts)
        if self.local is not None:
            for branch in self.local:
                out = out + branch(parts)
        return rep.unpartition(out, n, self.parts, self.parts, cl)

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Fold every BN and the Local Perceptron into one ``K x K`` conv with bias (eval mode)."""
        if self.global_perceptron is not None:
            self.global_perceptron.reparameterize()
        if self.local is None and self.conv.bn is None:
            return
        self.conv.reparameterize()
        weight, bias = self.conv.conv.weight, self.conv.conv.bias
        for branch in self.local or ():
            branch.reparameterize()  # no-op when reparameterize_model already converted the children
            kw, kb = branch.conv.weight, branch.conv.bias
            pad = (self.kernel_size - kw.shape[-1]) // 2
            weight = weight + F.pad(kw, (pad, pad, pad, pad))
            bias = bias + kb
        self.conv.conv.weight.copy_(weight)
        self.conv.conv.bias.copy_(bias)
        self.local = None


@dataclass(frozen=True)
class MixerSpec:
    """What a pure MLP's mixers are (the options :class:`PureMLP` and its 1-D counterpart share).

    ``kind``: ``"repmlp"``, ``"fc3_conv9"`` (2-D only) or ``"conv"``; ``partition`` is capped at a stage's
    size by the builder that reads it.
    """

    kind: str
    partition: int
    groups: int
    kernel_sizes: Sequence[int]
    global_perceptron: bool
    conv_kernel: int
    deploy: bool


def pure_mlp_stages(
    widths: Sequence[int], size: int, spec: MixerSpec, dims: int = 2
) -> tuple[nn.Sequential, list[dict[str, Any]]]:
    """The stages of the pure MLP (paper Sec. 4.1), in 2-D or 1-D (``dims``): stage ``i`` runs at
    ``size // 2**i`` as ``[max pool by 2,] mixer(C), FC(C, C), mixer(C), FC(C, C_next)``, ``C = widths[i]``,
    each mixer (:func:`mixer_layer` of ``spec``) and FC (a 1x1 conv-BN) with its ReLU. Returns the stages
    and timm's ``feature_info`` for them.
    """
    stages, info = [], []
    pool = nn.MaxPool2d if dims == 2 else nn.MaxPool1d
    fc = partial(ConvBNReLU, kernel_size=1, deploy=spec.deploy, dims=dims)
    for i, c in enumerate(widths):
        c_next = widths[i + 1] if i + 1 < len(widths) else c
        layers: list[nn.Module] = [] if i == 0 else [pool(2)]
        mixer = partial(mixer_layer, spec, c, size, dims)
        layers += [mixer(), fc(c, c), mixer(), fc(c, c_next)]
        stages.append(nn.Sequential(*layers))
        info.append(dict(num_chs=c_next, reduction=2**i, module=f"stages.{i}"))
        size //= 2
    return nn.Sequential(*stages), info


def mixer_layer(spec: MixerSpec, channels: int, size: int, dims: int = 2) -> nn.Module:
    """A pure-MLP stage's mixing layer (``C -> C`` at ``size``), followed by ReLU: 2-D on ``(N, C, S, S)``
    (:class:`~repmlp.RepMLPBlock`, :class:`PartitionConvBlock`, conv2d-BN) or 1-D on ``(N, C, L)``
    (:class:`~repmlp.RepMLPBlock1d`, conv1d-BN; Local Perceptron kernels longer than the partition are
    left out there)."""
    part = min(spec.partition, size)
    common = dict(groups=spec.groups, global_perceptron=spec.global_perceptron, deploy=spec.deploy)
    if spec.kind == "repmlp" and dims == 1:
        kernels = [k for k in spec.kernel_sizes if k <= part]
        block: nn.Module = RepMLPBlock1d(channels, channels, size, part, kernel_sizes=kernels, **common)
    elif spec.kind == "repmlp":
        block = RepMLPBlock(channels, channels, size, part, kernel_sizes=spec.kernel_sizes, **common)
    elif spec.kind == "fc3_conv9" and dims == 2:
        block = PartitionConvBlock(channels, channels, size, part, kernel_size=spec.conv_kernel,
                                   kernel_sizes=spec.kernel_sizes, **common)  # fmt: skip
    elif spec.kind == "conv":
        block = ConvBN(
            channels, channels, spec.conv_kernel, groups=spec.groups, deploy=spec.deploy, dims=dims
        )
    else:
        kinds = "repmlp, fc3_conv9 or conv" if dims == 2 else "repmlp or conv"
        raise ValueError(f"unknown mixer {spec.kind!r}: {kinds}")
    # Not in place: a block may return a view of its own result (one partition), and an in-place op on a view
    # makes autograd copy the whole base back in the backward pass.
    return nn.Sequential(block, nn.ReLU())


class PureMLP(PooledClassifierMixin, nn.Module):
    """Configurable pure MLP / ConvNet counterpart of paper Fig. "pure MLP" (see the module docstring).

    Args:
        widths: channels of the stages (16, 32, 64 for the pure MLP; 32, 64, 128 for the Wide ConvNet).
        img_size: input resolution (stage ``i`` runs at ``img_size / 2**i``).
        mixer: ``"repmlp"``, ``"fc3_conv9"`` or ``"conv"``.
        partition: ``h = w`` of the RepMLPs (capped at a stage's resolution).
        groups: ``g`` of RepMLPs / convs.
        kernel_sizes: Local Perceptron kernels.
        global_perceptron: keep FC1/FC2.
        conv_kernel: ``K`` of the conv mixers.
        width_multiplier: scales ``widths`` (each rounded to a multiple of ``groups``, at least
            ``groups``): the ablation study's knob for a cheaper run of the same architectures.
        patch_size: ``p``; the stem is an FC on each non-overlapping ``p x p`` patch (a ``p x p`` conv of
            stride ``p``, as MLP-Mixer's patch embedding), so the stages run at ``img_size / p``; 1 (the
            paper's 1x1 FC) by default. A stem with ``p > 1`` is the first entry of ``feature_info``.
        num_classes, in_chans, deploy: as everywhere.
        global_pool: ``"avg"`` or ``""`` (no pooling), as timm's models.

    Shapes: ``(N, in_chans, img_size, img_size)`` -> ``(N, num_classes)``.
    """

    def __init__(
        self,
        *,
        widths: Sequence[int] = (16, 32, 64),
        img_size: int = 32,
        mixer: str = "repmlp",
        partition: int = 8,
        groups: int = 2,
        kernel_sizes: Sequence[int] = (1, 3, 5, 7),
        global_perceptron: bool = True,
        conv_kernel: int = 9,
        num_classes: int = 10,
        global_pool: str = "avg",
        in_chans: int = 3,
        width_multiplier: float = 1.0,
        patch_size: int = 1,
        deploy: bool = False,
    ) -> None:
        super().__init__()
        if not width_multiplier > 0:
            raise ValueError(f"width_multiplier must be positive, got {width_multiplier}")
        if width_multiplier != 1.0:
            widths = [max(groups, round(c * width_multiplier / groups) * groups) for c in widths]
        if not isinstance(img_size, int):
            raise ValueError(f"img_size must be an int (square inputs), got {img_size!r}")
        n = len(widths)
        if not (isinstance(patch_size, int) and patch_size >= 1):
            raise ValueError(f"patch_size must be a positive int, got {patch_size!r}")
        if img_size % (patch_size * 2 ** (n - 1)):
            raise ValueError(
                f"img_size={img_size} must be divisible by {patch_size * 2 ** (n - 1)} "
                f"(patch_size={patch_size}, {n} stages)"
            )
        self.num_classes, self.in_chans, self.img_size = num_classes, in_chans, img_size
        self.stem = ConvBNReLU(in_chans, widths[0], patch_size, patch_size, 0, deploy=deploy)
        spec = MixerSpec(
            mixer, partition, groups, tuple(kernel_sizes), global_perceptron, conv_kernel, deploy
        )
        self.stages, self.feature_info = pure_mlp_stages(widths, img_size // patch_size, spec)
        for info in self.feature_info:
            info["reduction"] *= patch_size
        if patch_size > 1:
            # A stem that downsamples is a feature level of its own, as timm lists ResNet's (stride 2): so a
            # two-stage model still has the three levels timm's backbones give (docs/models.md).
            self.feature_info.insert(0, dict(num_chs=widths[0], reduction=patch_size, module="stem"))
        self.num_features = self.head_hidden_size = widths[-1]
        self.reset_classifier(num_classes, global_pool)

    def forward_features(self, x: Tensor) -> Tensor:
        """``(N, in_chans, S, S)`` -> ``(N, widths[-1], S / 2**(n-1), ...)``."""
        check_input_size(x, "this model is", self.in_chans, (self.img_size, self.img_size), True)
        return self.stages(self.stem(x))


def pure_mlp_cfg(dataset: str, pool_size: tuple[int, ...]) -> dict[str, Any]:
    """timm's ``pretrained_cfg`` of a pure MLP for ``dataset`` (``"cifar10"`` or ``"fashion-mnist"``: its
    size and normalisation, 10 classes) whose last features are ``pool_size``."""
    mean, std = NORMALIZATION[dataset]
    size = NATIVE_SIZE[dataset]
    return cfg(input_size=(len(mean), size, size), num_classes=10, mean=mean, std=std, crop_pct=1.0,
               classifier="head", first_conv="stem.conv", pool_size=pool_size, fixed_input_size=True)  # fmt: skip


_CIFAR = ("repmlp_cifar", "repmlp_cifar_no_local", "repmlp_cifar_no_global", "repmlp_cifar_fc3_conv9",
          "repmlp_cifar_conv9", "wide_convnet_cifar")  # fmt: skip
default_cfgs = generate_default_cfgs({
    **{name: pure_mlp_cfg("cifar10", (8, 8)) for name in _CIFAR},
    "repmlp_fmnist": pure_mlp_cfg("fashion-mnist", (7, 7)),
    "repmlp_fmnist_patch2": pure_mlp_cfg("fashion-mnist", (7, 7)),  # the patch stem and two stages
})  # fmt: skip


def _create_pure_mlp(variant: str, pretrained: bool, defaults: dict[str, Any], **kwargs: Any) -> PureMLP:
    """A :class:`PureMLP` of the variant's ``defaults`` (under ``kwargs``; a model file's options, with
    ``pretrained``); ``features_only``: timm's FeatureListNet over the stem and the stages (``feature_info``)."""
    feature_cfg = dict(flatten_sequential=True, out_indices=(0, 1, 2))
    return build(partial(PureMLP, **defaults), variant, pretrained, feature_cfg=feature_cfg, **kwargs)


@register_model
def repmlp_cifar(pretrained: bool = False, **kwargs: Any) -> PureMLP:
    """The pure MLP on CIFAR-10 (paper Table "pure MLP"): RepMLPs with g=2, h=w=8, K=1,3,5,7."""
    return _create_pure_mlp("repmlp_cifar", pretrained, {}, **kwargs)


@register_model
def repmlp_cifar_no_local(pretrained: bool = False, **kwargs: Any) -> PureMLP:
    """Row B, "w/o Local": the pure MLP without Local Perceptron."""
    return _create_pure_mlp("repmlp_cifar_no_local", pretrained, {"kernel_sizes": ()}, **kwargs)


@register_model
def repmlp_cifar_no_global(pretrained: bool = False, **kwargs: Any) -> PureMLP:
    """Row C, "w/o Global": the pure MLP without Global Perceptron (no FC1/FC2)."""
    return _create_pure_mlp("repmlp_cifar_no_global", pretrained, {"global_perceptron": False}, **kwargs)


@register_model
def repmlp_cifar_fc3_conv9(pretrained: bool = False, **kwargs: Any) -> PureMLP:
    """Row D, "FC3 as conv9": FC3 replaced by a groupwise 9x9 conv (p=4) + BN."""
    options = {"mixer": "fc3_conv9", "conv_kernel": 9}
    return _create_pure_mlp("repmlp_cifar_fc3_conv9", pretrained, options, **kwargs)


@register_model
def repmlp_cifar_conv9(pretrained: bool = False, **kwargs: Any) -> PureMLP:
    """Row E, "RepMLP as conv9": every RepMLP replaced by a groupwise 9x9 conv + BN."""
    return _create_pure_mlp("repmlp_cifar_conv9", pretrained, {"mixer": "conv", "conv_kernel": 9}, **kwargs)


@register_model
def wide_convnet_cifar(pretrained: bool = False, **kwargs: Any) -> PureMLP:
    """The Wide ConvNet: the pure MLP with 3x3 convs instead of RepMLPs and widths 32, 64, 128."""
    options = {"mixer": "conv", "conv_kernel": 3, "groups": 1, "widths": (32, 64, 128)}
    return _create_pure_mlp("wide_convnet_cifar", pretrained, options, **kwargs)


_FMNIST = dict(img_size=28, in_chans=1, partition=7, groups=2, kernel_sizes=(3,), num_classes=10)  # both


@register_model
def repmlp_fmnist(pretrained: bool = False, **kwargs: Any) -> PureMLP:
    """The pure MLP adapted to Fashion-MNIST (28x28x1): stages at 28/14/7, ``h = w = 7``, 10 classes; small
    widths and only the K=3 Local Perceptron branch by default (every :class:`PureMLP` option can be given)."""
    return _create_pure_mlp("repmlp_fmnist", pretrained, {**_FMNIST, "widths": (8, 16, 32)}, **kwargs)


@register_model
def repmlp_fmnist_patch2(pretrained: bool = False, **kwargs: Any) -> PureMLP:
    """:func:`repmlp_fmnist` with an FC on 2x2 patches as its stem, so that its two stages run at 14 and 7
    (widths 16, 32; ``h = w = 7``: at 14 four partitions and the Global Perceptron, at 7 one partition); the
    main job's model, cheaper to train than ``repmlp_fmnist`` (docs/benchmarks.md). Its feature levels
    (``features_only``): the stem's 14x14 map and both stages' (strides 2, 2, 4)."""
    defaults = {**_FMNIST, "widths": (16, 32), "patch_size": 2}
    return _create_pure_mlp("repmlp_fmnist_patch2", pretrained, defaults, **kwargs)
