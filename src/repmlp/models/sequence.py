"""The pure MLP for sequences: :class:`SequenceMLP` on ``(N, C, L)``, and Fashion-MNIST read row by row.

The 1-D counterpart of :class:`repmlp.models.pure_mlp.PureMLP`: a 1x1 "FC" stem, then stages at full, 1/2,
1/4 length (max pooling by 2 between them), each ``mixer, FC(C, C), mixer, FC(C, C_next)`` with a ReLU
after every mixer and every FC (a kernel-1 conv1d-BN), then average pooling over the sequence and the
classifier. The mixer is a :class:`repmlp.RepMLPBlock1d` (``"repmlp"``), converted exactly into FC1, FC2,
FC3 by :func:`repmlp.reparameterize_model`, or a groupwise conv1d-BN (``"conv"``), the baseline.

:class:`RowSequenceMLP` puts an image in front: ``(N, C, H, W)`` is read as ``H`` steps (the rows) of
``C*W`` features (each row's pixels). Registered on Fashion-MNIST (a sequence of 28 rows of 28 pixels):
``repmlp1d_fmnist`` and its baseline of about the same MACs, ``conv1d_fmnist``.
"""

from collections.abc import Sequence
from functools import partial
from typing import Any

from timm.models import generate_default_cfgs
from torch import Tensor, nn

from repmlp.models.layers import ConvBNReLU, PooledClassifierMixin, build
from repmlp.models.pure_mlp import MixerSpec, pure_mlp_cfg, pure_mlp_stages
from repmlp.models.registry import register_outside
from repmlp.nn import checks

__all__ = ["SequenceMLP", "RowSequenceMLP", "SequenceInput", "RowsAsSequence", "rows_as_sequence",
           "repmlp1d_fmnist", "conv1d_fmnist"]  # fmt: skip


def rows_as_sequence(x: Tensor) -> Tensor:
    """Images as sequences of rows: ``(N, C, H, W)`` -> ``(N, C*W, H)``; step ``i`` is row ``i``, its feature
    ``c*W + j`` channel ``c``, column ``j`` (a transpose and a flatten: the batch stays dynamic in exports)."""
    return x.transpose(2, 3).flatten(1, 2)


def _check_positive(**values: Any) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


class SequenceInput(nn.Module):
    """A :class:`SequenceMLP`'s first layer: ``ValueError`` unless the input is ``(N, in_chans, length)``."""

    def __init__(self, in_chans: int, length: int) -> None:
        super().__init__()
        self.in_chans, self.length = in_chans, length

    def forward(self, x: Tensor) -> Tensor:
        c, length = self.in_chans, self.length
        checks.check_input_shape(
            x, (c, length), f"model built for sequences (N, {c}, {length}), got {{shape}}"
        )
        return x


class RowsAsSequence(nn.Module):
    """A :class:`RowSequenceMLP`'s first layer: an ``(N, in_chans, img_size, img_size)`` image (checked) as a
    sequence (:func:`rows_as_sequence`). Shapes: ``(N, C, S, S)`` -> ``(N, C*S, S)``."""

    def __init__(self, in_chans: int, img_size: int) -> None:
        super().__init__()
        self.in_chans, self.img_size = in_chans, img_size

    def forward(self, x: Tensor) -> Tensor:
        c, s = self.in_chans, self.img_size
        checks.check_input_shape(
            x,
            (c, s, s),
            f"model built for inputs (N, {c}, {s}, {s}), got {{shape}}; build it with img_size/in_chans "
            "matching the data",
        )
        return rows_as_sequence(x)


class SequenceMLP(PooledClassifierMixin, nn.Module):
    """Pure MLP (RepMLP1d mixers) or its conv1d counterpart on sequences (see the module docstring).

    Args:
        in_chans: ``C``, features per step of the input.
        length: ``L``, steps of the input (stage ``i`` runs at ``L // 2**i``).
        widths: channels of the stages.
        mixer: ``"repmlp"`` (:class:`repmlp.RepMLPBlock1d`) or ``"conv"`` (groupwise conv1d-BN).
        partition: ``l`` of the RepMLPs (capped at a stage's length; Local Perceptron kernels larger
            than the cap are left out there).
        groups: ``g`` of the RepMLPs / convs.
        kernel_sizes: Local Perceptron kernels (odd).
        global_perceptron: keep FC1/FC2 (absent anyway in a stage that is a single partition).
        conv_kernel: ``K`` of the conv mixers.
        num_classes, deploy: as everywhere.
        global_pool: ``"avg"`` (mean over the steps) or ``""`` (none), as timm's models.
        to_sequence: the first layer, which turns the model's input into the ``(N, in_chans, length)``
            sequence (default: :class:`SequenceInput`, which only checks it); parameter-free.

    Shapes: ``(N, in_chans, length)`` -> ``(N, num_classes)`` (the input as ``to_sequence`` takes it).
    """

    def __init__(
        self,
        in_chans: int,
        length: int,
        *,
        widths: Sequence[int] = (32, 64, 128),
        mixer: str = "repmlp",
        partition: int = 7,
        groups: int = 2,
        kernel_sizes: Sequence[int] = (1, 3, 5),
        global_perceptron: bool = True,
        conv_kernel: int = 7,
        num_classes: int = 10,
        global_pool: str = "avg",
        deploy: bool = False,
        to_sequence: nn.Module | None = None,
    ) -> None:
        super().__init__()
        n = len(widths)
        _check_positive(in_chans=in_chans, length=length)
        if n < 1 or length < 2 ** (n - 1):
            raise ValueError(f"length={length} is too short for {n} stages (halved between stages)")
        self.in_chans, self.length, self.num_classes = in_chans, length, num_classes
        # The first child: timm's feature extractors run the children in order, from the raw input.
        self.to_sequence = to_sequence if to_sequence is not None else SequenceInput(in_chans, length)
        self.stem = ConvBNReLU(in_chans, widths[0], 1, deploy=deploy, dims=1)
        spec = MixerSpec(
            mixer, partition, groups, tuple(kernel_sizes), global_perceptron, conv_kernel, deploy
        )
        self.stages, self.feature_info = pure_mlp_stages(widths, length, spec, dims=1)
        self.num_features = self.head_hidden_size = widths[-1]
        self.reset_classifier(num_classes, global_pool)

    def forward_features(self, x: Tensor) -> Tensor:
        """The input (``to_sequence``'s) -> ``(N, widths[-1], length // 2**(n-1))``."""
        return self.stages(self.stem(self.to_sequence(x)))

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """``(N, num_features, l)`` -> logits ``(N, num_classes)``; pooled features if ``pre_logits``."""
        if self.global_pool == "avg":
            x = x.mean(dim=2)
        return x if pre_logits else self.head(x)


class RowSequenceMLP(SequenceMLP):
    """:class:`SequenceMLP` on square images read row by row (:func:`rows_as_sequence`).

    The sequence has ``img_size`` steps of ``in_chans * img_size`` features; ``in_chans`` and
    ``img_size`` here are the image's, as for the other image models (data pipelines, ``repmlp
    predict`` and the profiler read them). Other keyword arguments go to :class:`SequenceMLP`.

    Shapes: ``(N, in_chans, img_size, img_size)`` -> ``(N, num_classes)``; features
    ``(N, widths[-1], img_size // 2**(n-1))``.
    """

    def __init__(self, *, img_size: int = 28, in_chans: int = 1, **kwargs: Any) -> None:
        _check_positive(img_size=img_size, in_chans=in_chans)
        adapter = RowsAsSequence(in_chans, img_size)
        super().__init__(in_chans * img_size, img_size, to_sequence=adapter, **kwargs)
        self.in_chans, self.img_size = in_chans, img_size


# Not registered with timm (register_outside), whose classifier contract they cannot keep: their feature maps
# are 1-D, (N, C, L), where timm's forward_features and features_only give (N, C, H, W) maps (docs/models.md).
default_cfgs = generate_default_cfgs(
    dict.fromkeys(("repmlp1d_fmnist", "conv1d_fmnist"), pure_mlp_cfg("fashion-mnist", (7,)))
)

# Shared by both Fashion-MNIST models, so that only the mixer differs.
_FMNIST_DEFAULTS = dict(img_size=28, in_chans=1, widths=(32, 64, 128), partition=7, groups=2, num_classes=10)


def _create_sequence_mlp(
    variant: str, pretrained: bool, mixer: dict[str, Any], **kwargs: Any
) -> RowSequenceMLP:
    """A :class:`RowSequenceMLP` of the ``mixer`` options (under ``kwargs``; a model file's options, with
    ``pretrained``); ``features_only``: timm's FeatureListNet over the stem and the stages, 1-D maps."""
    feature_cfg = dict(flatten_sequential=True, out_indices=(0, 1, 2))
    cls = partial(RowSequenceMLP, **_FMNIST_DEFAULTS, **mixer)
    return build(cls, variant, pretrained, feature_cfg=feature_cfg, **kwargs)


@register_outside
def repmlp1d_fmnist(pretrained: bool = False, **kwargs: Any) -> RowSequenceMLP:
    """The sequence pure MLP on Fashion-MNIST read as 28 rows of 28 pixels: RepMLP1d mixers with
    ``l = 7``, ``g = 2``, Local Perceptron ``K = 1, 3, 5``; stages at 28, 14, 7 steps."""
    options = {"mixer": "repmlp", "kernel_sizes": (1, 3, 5)}
    return _create_sequence_mlp("repmlp1d_fmnist", pretrained, options, **kwargs)


@register_outside
def conv1d_fmnist(pretrained: bool = False, **kwargs: Any) -> RowSequenceMLP:
    """The baseline of ``repmlp1d_fmnist``: the same network with groupwise conv1d-BN mixers (``g = 2``)
    of a kernel size giving about the same deployed MACs (docs/sequences.md)."""
    return _create_sequence_mlp("conv1d_fmnist", pretrained, {"mixer": "conv", "conv_kernel": 7}, **kwargs)
