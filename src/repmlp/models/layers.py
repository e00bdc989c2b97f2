"""What every model family shares: the conv-BN-ReLU, the input-size check, timm's classifier methods."""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from repmlp.nn import checks
from repmlp.nn.layers import ConvBN

__all__ = ["ConvBNReLU", "check_input_size", "PooledClassifierMixin", "layer_like"]


class ConvBNReLU(ConvBN):
    """:class:`ConvBN` followed by ReLU; also the paper's "FC" (a 1x1 conv-BN-ReLU) of the pure MLP.

    Shapes: ``(N, C_in, H, W)`` -> ``(N, C_out, H', W')`` (1-D with ``dims=1``).
    """

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv(x)  # written out, not super().forward: TorchScript compiles no super() calls
        if self.bn is not None:
            x = self.bn(x)
        return F.relu(x, inplace=True)  # the conv/BN output is a fresh tensor nothing else holds


@torch.jit.ignore  # a Python-side check: TorchScript calls it as Python
def check_input_size(x: Tensor, subject: str, in_chans: int, img_size: Any, fixed: bool) -> None:
    """Raise ``ValueError`` unless ``x`` is ``(N, in_chans, H, W)``, with ``(H, W) == img_size`` when ``fixed``.

    ``subject`` says what fixes the size (``"MobileFaceNet is"``, ``"this model's RepMLP layers are"``): a
    fixed-size layer fed another size would fail deep inside, or silently change meaning (a GDConv no
    longer reducing to 1x1), so the error says which size to build for. Traces (:mod:`repmlp.nn.checks`).
    """
    h, w = int(img_size[0]), int(img_size[1])
    size = h if h == w else (h, w)
    want = (
        f"(N, {in_chans}, {h}, {w}) (in_chans={in_chans}, img_size={size})"
        if fixed
        else f"(N, {in_chans}, H, W)"
    )
    checks.check_input_shape(x, (in_chans, None, None), f"expected input {want}, got {{shape}}")
    if fixed:
        checks.check_input_shape(
            x,
            (in_chans, h, w),
            f"{subject} built for {h}x{w} inputs, got {{h}}x{{w}}: img_size={size} takes "
            f"(N, {in_chans}, {h}, {w}); build it with img_size={{h}} for that resolution",
        )


def layer_like(model: nn.Module, layer: nn.Module) -> nn.Module:
    """``layer`` on the device and dtype of ``model``'s parameters and in its training mode: what timm's
    contract expects of a classifier that ``reset_classifier`` puts into an existing model."""
    ref = next(model.parameters(), None)
    if ref is not None:
        layer = layer.to(device=ref.device, dtype=ref.dtype)
    return layer.train(model.training)


class PooledClassifierMixin:
    """timm's ``get_classifier`` / ``reset_classifier`` for a model with a ``global_pool`` (``"avg"`` or
    ``""``: none) before a linear classifier in the attribute ``classifier_attr``; the model sets
    ``num_features`` before calling ``reset_classifier`` from its ``__init__``."""

    classifier_attr = "head"
    num_features: int

    def get_classifier(self) -> nn.Module:
        return getattr(self, self.classifier_attr)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A fresh ``num_classes``-way classifier (none for 0); ``global_pool`` ``"avg"`` or ``""``."""
        if global_pool is not None:
            if global_pool not in ("avg", ""):
                raise ValueError(f"global_pool must be 'avg' or '' (none), got {global_pool!r}")
            self.global_pool = global_pool
        self.num_classes = num_classes
        head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        setattr(self, self.classifier_attr, layer_like(self, head))  # type: ignore[arg-type]

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """``(N, num_features, h, w)`` -> logits ``(N, num_classes)``; pooled features if ``pre_logits``."""
        if self.global_pool == "avg":
            x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return x if pre_logits else self.head(x)  # a model whose classifier is named otherwise overrides this

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))  # type: ignore[attr-defined]
