"""timm's classifier methods, shared by the classification families (ResNets, pure MLPs, RepMLPNet)."""

from torch import nn

__all__ = ["PooledClassifierMixin", "layer_like"]

GLOBAL_POOLS = ("avg", "")


def layer_like(model: nn.Module, layer: nn.Module) -> nn.Module:
    """``layer`` on the device and dtype of ``model``'s parameters and in its training mode: what timm's
    contract expects of a classifier that ``reset_classifier`` puts into an existing model."""
    ref = next(model.parameters(), None)
    if ref is not None:
        layer = layer.to(device=ref.device, dtype=ref.dtype)
    return layer.train(model.training)


class PooledClassifierMixin:
    """``get_classifier`` / ``reset_classifier`` for a model with a ``global_pool`` (``"avg"`` or ``""``:
    none) before a linear classifier held in the attribute named by ``classifier_attr``.

    The model sets ``num_features`` before calling ``reset_classifier`` from its ``__init__``.
    """

    classifier_attr = "head"
    num_features: int

    def get_classifier(self) -> nn.Module:
        return getattr(self, self.classifier_attr)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A fresh ``num_classes``-way classifier (none for 0); ``global_pool`` ``"avg"`` or ``""``."""
        if global_pool is not None:
            if global_pool not in GLOBAL_POOLS:
                raise ValueError(f"global_pool must be 'avg' or '' (none), got {global_pool!r}")
            self.global_pool = global_pool
        self.num_classes = num_classes
        head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        setattr(self, self.classifier_attr, layer_like(self, head))  # type: ignore[arg-type]
