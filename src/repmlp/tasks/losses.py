"""Training losses of the paper's face-recognition and segmentation experiments.

- :class:`AMSoftmax`: additive-margin softmax (Wang et al. 2018), used for face recognition (Sec. 4.3).
- :func:`pspnet_loss`: PSPNet's main + weighted auxiliary cross-entropy with an ignore label (Sec. 4.4).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["AMSoftmax", "pspnet_loss"]


class AMSoftmax(nn.Module):
    """Additive-margin softmax: ``CE(s * (cos(theta) - m * onehot(y)))``.

    Both the embeddings and the class weights are L2-normalised, so the logits are cosines; the margin ``m``
    (AM-Softmax paper: 0.35) is subtracted from the target class's cosine only, and everything is scaled by
    ``s`` (paper: 30). The class weights ``(num_classes, D)`` are the loss's own parameters, not part of the
    embedding model, which is what gets deployed. Shapes: embeddings ``(N, D)``, labels ``(N,)`` -> scalar.
    """

    def __init__(
        self, embedding_dim: int, num_classes: int, scale: float = 30.0, margin: float = 0.35
    ) -> None:
        super().__init__()
        if scale <= 0:
            raise ValueError(f"scale must be positive, got {scale}")
        if not 0 <= margin < 2:
            raise ValueError(f"margin must be in [0, 2) (cosines lie in [-1, 1]), got {margin}")
        self.embedding_dim, self.num_classes = embedding_dim, num_classes
        self.scale, self.margin = float(scale), float(margin)
        self.weight = nn.Parameter(torch.empty(num_classes, embedding_dim))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def extra_repr(self) -> str:
        return f"embedding_dim={self.embedding_dim}, num_classes={self.num_classes}, s={self.scale}, m={self.margin}"

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        cos = F.linear(F.normalize(embeddings, dim=1), F.normalize(self.weight, dim=1))  # (N, num_classes)
        margin = F.one_hot(labels, self.num_classes).to(cos.dtype) * self.margin
        return F.cross_entropy(self.scale * (cos - margin), labels)


def pspnet_loss(
    main_logits: Tensor,
    aux_logits: Tensor | None,
    target: Tensor,
    *,
    aux_weight: float = 0.4,
    ignore_index: int = 255,
) -> Tensor:
    """PSPNet's training loss: ``CE(main) + aux_weight * CE(aux)`` over non-ignored pixels.

    ``main_logits``/``aux_logits`` ``(N, K, h, w)``; ``target`` ``(N, H, W)`` labels with ``ignore_index`` for
    unlabelled pixels. Logits at another resolution than the target are bilinearly resized to it first (the
    labels are never interpolated). PSPNet weighs the auxiliary loss, attached to c4, by 0.4; ``aux_logits=None``
    gives the main loss alone."""

    def ce(logits: Tensor) -> Tensor:
        if logits.shape[-2:] != target.shape[-2:]:
            logits = F.interpolate(logits, size=target.shape[-2:], mode="bilinear", align_corners=False)
        if not bool((target != ignore_index).any()):
            # A crop with only ignored pixels: zero loss (cross-entropy's mean over nothing is NaN).
            return logits.sum() * 0.0
        return F.cross_entropy(logits, target.long(), ignore_index=ignore_index)

    loss = ce(main_logits)
    if aux_logits is not None and aux_weight:
        loss = loss + aux_weight * ce(aux_logits)
    return loss
