"""What every model family shares: how its models are built (timm's ``build_model_with_cfg``, :func:`build`),
the conv-BN-ReLU, the input-size check, timm's classifier methods."""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg
from torch import Tensor, nn

from repmlp.models.registry import get_pretrained_cfg
from repmlp.nn import checks
from repmlp.nn.layers import ConvBN

__all__ = ["cfg", "build", "FILE_LOADER", "ConvBNReLU", "check_input_size", "PooledClassifierMixin",
           "layer_like"]  # fmt: skip

# ``FILE_LOADER["file"](name, kwargs)``: the model of ``pretrained=True, pretrained_cfg_overlay=dict(file=PATH)``
# from a repmlp model file, with the file's options; set by repmlp.io, which reads the files (above the models).
FILE_LOADER: dict[str, Callable[[str, dict[str, Any]], nn.Module]] = {}


def cfg(**kwargs: Any) -> dict[str, Any]:
    """A family's pretrained cfg: no weights (no URL), ImageNet's by default."""
    base = dict(url="", num_classes=1000, input_size=(3, 224, 224), crop_pct=0.875, interpolation="bilinear")
    return {**base, "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD, "license": "mit", **kwargs}


def build(cls: Callable[..., nn.Module], variant: str, pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """timm's ``build_model_with_cfg(cls, variant, pretrained, **kwargs)`` for a family's ``_create_*``, with
    what repmlp adds: ``pretrained=True`` reads a repmlp model file (:data:`FILE_LOADER`; no weights are
    distributed), timm's ``device``/``dtype`` place the model (no options of repmlp's classes), and its
    ``pretrained_cfg`` says the classes, input size and final map size it was built for."""
    if pretrained:
        return FILE_LOADER["file"](variant, kwargs)
    built: list[nn.Module] = []

    def call(img_size: Any = None, **kw: Any) -> nn.Module:
        if isinstance(img_size, (tuple, list)) and len(img_size) == 2 and img_size[0] == img_size[1]:
            img_size = img_size[0]  # timm passes a fixed-size model (H, W); ours take an int for a square
        built.append(cls(**kw) if img_size is None else cls(img_size=img_size, **kw))
        return built[-1]

    kwargs["pretrained_cfg"] = kwargs.get("pretrained_cfg") or get_pretrained_cfg(variant)  # outside timm too
    device, dtype, _ = kwargs.pop("device", None), kwargs.pop("dtype", None), kwargs.pop("cache_dir", None)
    with torch.device(device or torch.get_default_device()):
        model = build_model_with_cfg(call, variant, False, **kwargs).to(dtype=dtype)
    net, pc = built[0], model.pretrained_cfg
    if "num_classes" in pc and getattr(net, "num_classes", None) is not None:  # features: no classes
        pc["num_classes"] = net.num_classes
    if (size := getattr(net, "img_size", None)) is not None:
        size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        pc["input_size"] = (getattr(net, "in_chans", pc["input_size"][0]), *size)
        if (pool := pc.get("pool_size")) and getattr(net, "feature_info", None):  # the final map at that size
            pc["pool_size"] = tuple(s // net.feature_info[-1]["reduction"] for s in size[-len(pool) :])
    return model


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
