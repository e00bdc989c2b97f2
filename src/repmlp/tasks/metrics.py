"""Evaluation metrics of the paper's tasks, pure functions on tensors: classification accuracy (Sec. 4.1-4.2),
Cityscapes' mIoU with an ignore label (Sec. 4.4), face verification (the LFW protocol) and rank-1
identification against a gallery with distractors (MegaFace's criterion) (Sec. 4.3)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["topk_correct", "accuracy", "confusion_matrix", "iou_from_confusion", "mean_iou",
           "best_threshold", "verification_accuracy", "rank1_identification"]  # fmt: skip


def topk_correct(logits: Tensor, target: Tensor, ks: tuple[int, ...] = (1, 5)) -> list[int]:
    """Number of samples whose target ``(N,)`` is among the top-k of ``logits`` ``(N, K)``, for each k
    (k clipped to ``K``)."""
    kmax = min(max(ks), logits.shape[1])
    top = logits.topk(kmax, dim=1).indices
    hits = top == target[:, None]
    return [int(hits[:, : min(k, kmax)].any(dim=1).sum()) for k in ks]


def accuracy(logits: Tensor, labels: Tensor) -> dict[str, float]:
    """Top-1 and top-5 accuracy (%) of ``logits`` ``(N, K)`` against ``labels`` ``(N,)``."""
    c1, c5 = topk_correct(logits, labels)
    n = max(1, len(labels))
    return {"top1": 100 * c1 / n, "top5": 100 * c5 / n, "n": len(labels)}


def confusion_matrix(pred: Tensor, target: Tensor, num_classes: int, ignore_index: int = 255) -> Tensor:
    """Confusion matrix ``(num_classes, num_classes)`` (int64, rows: target, columns: prediction) of label
    tensors ``pred`` and ``target`` of one shape (e.g. ``(N, H, W)``); targets ``ignore_index`` are not
    counted. Another label outside ``[0, num_classes)`` is a ``ValueError``: dropping it would inflate the IoU."""
    if pred.shape != target.shape:
        raise ValueError(f"pred and target shapes differ: {tuple(pred.shape)} vs {tuple(target.shape)}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be positive, got {num_classes}")
    pred = pred.reshape(-1).long()
    target = target.reshape(-1).long()
    keep = target != ignore_index
    pred, target = pred[keep], target[keep]
    for name, t in (("target", target), ("pred", pred)):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_classes):
            raise ValueError(f"{name} holds labels outside [0, {num_classes}) other than ignore_index={ignore_index}: "
                             f"min {int(t.min())}, max {int(t.max())}")  # fmt: skip
    # One bincount over the flattened (target, pred) pair index: exact integer counts, any device.
    flat = target * num_classes + pred
    return torch.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def iou_from_confusion(confusion: Tensor) -> tuple[float, Tensor]:
    """``(mIoU, per-class IoU (num_classes,) float64)`` of a confusion matrix (rows: target, columns:
    prediction): IoU = TP / (TP + FP + FN). A class absent from both has no IoU (NaN) and is left out of the
    mean, which is NaN when no class is present at all."""
    cm = confusion.double()
    tp = cm.diagonal()
    union = cm.sum(0) + cm.sum(1) - tp
    iou = torch.where(union > 0, tp / union.clamp(min=1), torch.full_like(tp, float("nan")))
    present = ~iou.isnan()
    miou = float(iou[present].mean()) if bool(present.any()) else float("nan")
    return miou, iou


def mean_iou(pred: Tensor, target: Tensor, num_classes: int, ignore_index: int = 255) -> tuple[float, Tensor]:
    """``(miou, per_class_iou)`` of label tensors ``pred`` and ``target`` (one shape). A data set's mIoU is that
    of the sum of its images' confusion matrices (:func:`iou_from_confusion`), not the mean of theirs."""
    return iou_from_confusion(confusion_matrix(pred, target, num_classes, ignore_index))


def _as_1d(name: str, x: Tensor | Sequence[float]) -> Tensor:
    t = torch.as_tensor(x)
    if t.dim() != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(t.shape)}")
    return t


def best_threshold(scores: Tensor, same: Tensor) -> tuple[float, float]:
    """The threshold that maximises verification accuracy on ``scores`` ``(P,)`` and ``same`` ``(P,)`` (bool),
    and that accuracy. A pair is "same" when its score (a similarity) is strictly above the threshold; the
    candidates are the midpoints between distinct scores and one value beyond each end; ties: the lowest."""
    scores = scores.double()
    same = same.bool()
    order = torch.argsort(scores)
    s, y = scores[order], same[order]
    distinct = torch.unique_consecutive(s)
    mids = (distinct[1:] + distinct[:-1]) / 2
    candidates = torch.cat([distinct[:1] - 1, mids, distinct[-1:] + 1])
    # Pairs at or below each candidate: predicted "different". Correct = different at/below + same above.
    below = torch.searchsorted(s, candidates, right=True)
    diff_cum = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(~y, 0)])
    same_cum = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(y, 0)])
    correct = diff_cum[below] + (same_cum[-1] - same_cum[below])
    best = int(torch.argmax(correct))  # first maximum = lowest threshold
    return float(candidates[best]), float(correct[best]) / len(s)


def verification_accuracy(
    scores: Tensor | Sequence[float], same: Tensor | Sequence[bool], folds: int = 10
) -> float:
    """Mean k-fold verification accuracy (the LFW protocol) of pair similarities ``scores`` ``(P,)`` (higher:
    more alike) against ``same`` ``(P,)``: the pairs split into ``folds`` consecutive folds (LFW's
    ``pairs.txt`` order), each fold's accuracy at the best threshold of the others (:func:`best_threshold`)."""
    scores = _as_1d("scores", scores).double()
    same = _as_1d("same", same).bool()
    if scores.shape != same.shape:
        raise ValueError(f"scores and same differ in length: {len(scores)} vs {len(same)}")
    if folds < 2:
        raise ValueError(f"folds must be at least 2 (the threshold is chosen on other folds), got {folds}")
    if len(scores) < folds:
        raise ValueError(f"{len(scores)} pairs cannot be split into {folds} folds")
    index = torch.arange(len(scores))
    accuracies = []
    for test in torch.tensor_split(index, folds):
        train = torch.ones(len(scores), dtype=torch.bool)
        train[test] = False
        threshold, _ = best_threshold(scores[train], same[train])
        predicted = scores[test] > threshold
        accuracies.append(float((predicted == same[test]).double().mean()))
    return sum(accuracies) / len(accuracies)


def _ids_to_tensor(probe_ids: Tensor | Sequence, gallery_ids: Tensor | Sequence) -> tuple[Tensor, Tensor]:
    """Identity labels (ints or any hashable, e.g. folder names) as int64 tensors on a shared code."""
    if isinstance(probe_ids, Tensor) and isinstance(gallery_ids, Tensor):
        return probe_ids.reshape(-1).long(), gallery_ids.reshape(-1).long()
    codes: dict = {}
    key = lambda i: i.item() if isinstance(i, Tensor) else i  # noqa: E731 - a tensor's value, else the label
    p = [codes.setdefault(key(i), len(codes)) for i in probe_ids]
    g = [codes.setdefault(key(i), len(codes)) for i in gallery_ids]
    return torch.tensor(p, dtype=torch.long), torch.tensor(g, dtype=torch.long)


def rank1_identification(
    probe_emb: Tensor, probe_ids: Tensor | Sequence, gallery_emb: Tensor, gallery_ids: Tensor | Sequence, *,
    chunk_size: int = 4096,
) -> float:  # fmt: skip
    """Rank-1 identification accuracy by cosine similarity: a probe ``(P, D)`` is right when its most similar
    gallery entry ``(G, D)`` has its identity (ids: int tensors or sequences of hashables, such as folder
    names). The gallery may hold distractors (MegaFace's million), but every probe needs a mate in it
    (``ValueError`` otherwise); similarities are computed ``chunk_size`` gallery rows at a time."""
    if probe_emb.dim() != 2 or gallery_emb.dim() != 2 or probe_emb.shape[1] != gallery_emb.shape[1]:
        raise ValueError(f"embeddings must be (P, D) and (G, D), got {tuple(probe_emb.shape)} and "
                         f"{tuple(gallery_emb.shape)}")  # fmt: skip
    pid, gid = _ids_to_tensor(probe_ids, gallery_ids)
    if len(pid) != len(probe_emb) or len(gid) != len(gallery_emb):
        raise ValueError("each embedding needs exactly one id")
    if len(pid) == 0:
        raise ValueError("no probes")
    missing = sorted(set(pid.tolist()) - set(gid.tolist()))
    if missing:
        raise ValueError(f"{len(missing)} probe identities have no mate in the gallery")
    probe = F.normalize(probe_emb.double(), dim=1)
    pid, gid = pid.to(probe.device), gid.to(probe.device)
    best = torch.full((len(probe),), -float("inf"), dtype=torch.float64, device=probe.device)
    best_id = torch.full((len(probe),), -1, dtype=torch.long, device=probe.device)
    for start in range(0, len(gallery_emb), chunk_size):
        g = F.normalize(gallery_emb[start : start + chunk_size].double(), dim=1)
        sim = probe @ g.T  # (P, chunk)
        value, idx = sim.max(dim=1)
        better = value > best
        best = torch.where(better, value, best)
        best_id = torch.where(better, gid[start : start + chunk_size][idx], best_id)
    return float((best_id == pid).double().mean())
