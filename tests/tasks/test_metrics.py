"""Metrics and losses on hand-made cases with answers worked out by hand."""

import math

import pytest
import torch
import torch.nn.functional as F

from repmlp.tasks.losses import AMSoftmax, pspnet_loss
from repmlp.tasks.metrics import (
    best_threshold,
    confusion_matrix,
    iou_from_confusion,
    mean_iou,
    rank1_identification,
    verification_accuracy,
)


def test_confusion_matrix_and_miou_by_hand():
    target = torch.tensor([[0, 0, 1, 1], [2, 2, 255, 255]])
    pred = torch.tensor([[0, 1, 1, 1], [2, 0, 3, 0]])
    cm = confusion_matrix(pred, target, num_classes=4)
    # rows = target, cols = prediction; the two ignored pixels are not counted.
    expected = torch.tensor([[1, 1, 0, 0], [0, 2, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    assert torch.equal(cm, expected)
    miou, iou = mean_iou(pred, target, num_classes=4)
    # class 0: tp 1, fp 1 (target 2 -> 0), fn 1 -> 1/3; class 1: tp 2, fp 1 -> 2/3; class 2: 1/2.
    # class 3 appears in neither prediction (its pixel is ignored) nor target: left out of the mean.
    assert iou[:3].tolist() == pytest.approx([1 / 3, 2 / 3, 1 / 2])
    assert math.isnan(iou[3])
    assert miou == pytest.approx((1 / 3 + 2 / 3 + 1 / 2) / 3)


def test_class_only_predicted_counts_with_zero_iou():
    miou, iou = mean_iou(torch.tensor([0, 1]), torch.tensor([0, 0]), num_classes=3)
    assert iou[0] == pytest.approx(0.5) and iou[1] == 0 and math.isnan(iou[2])
    assert miou == pytest.approx(0.25)


def test_known_confusion_matrix_gives_known_miou():
    cm = torch.tensor([[50, 10, 0, 0], [5, 30, 5, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    miou, iou = iou_from_confusion(cm)
    # class 0: 50 / (60 + 55 - 50); class 1: 30 / (40 + 40 - 30); class 2 only predicted: 0;
    # class 3 absent from both: NaN, not in the mean.
    assert iou[:3].tolist() == pytest.approx([50 / 65, 30 / 50, 0.0]) and math.isnan(iou[3])
    assert miou == pytest.approx((50 / 65 + 30 / 50 + 0.0) / 3)


def test_perfect_prediction_and_bad_labels():
    t = torch.randint(0, 19, (2, 8, 8))
    assert mean_iou(t, t, 19)[0] == 1.0
    with pytest.raises(ValueError, match="outside"):
        mean_iou(t, torch.full_like(t, 19), 19)
    with pytest.raises(ValueError, match="shapes"):
        mean_iou(t, t[0], 19)


def test_best_threshold_by_hand():
    scores = torch.tensor([0.1, 0.2, 0.6, 0.4, 0.9])
    same = torch.tensor([False, False, False, True, True])
    threshold, acc = best_threshold(scores, same)
    # 0.6 (different) sits above 0.4 (same): best is 4/5, first reached between 0.2 and 0.4.
    assert threshold == pytest.approx(0.3) and acc == pytest.approx(0.8)


def test_verification_uses_threshold_from_other_folds():
    # Two folds. Fold A is separable at ~0.5; fold B's pairs would need a threshold near 0.85.
    scores = torch.tensor([0.2, 0.3, 0.7, 0.8, 0.75, 0.8, 0.9, 0.95])
    same = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1]).bool()
    # Threshold from B (first best: 0.85) applied to A: 0.2, 0.3 diff ok; 0.7, 0.8 same -> wrong: 1/2.
    # Threshold from A (first best: 0.5) applied to B: 0.75, 0.8 predicted same -> wrong: 1/2.
    assert verification_accuracy(scores, same, folds=2) == pytest.approx(0.5)
    # Scores separated by a wide gap are perfectly verified whichever fold is held out.
    same = torch.arange(40) % 2 == 0
    s = torch.where(same, 0.6 + torch.rand(40) * 0.4, torch.rand(40) * 0.4)
    assert verification_accuracy(s, same, folds=10) == 1.0
    with pytest.raises(ValueError):
        verification_accuracy(s, same, folds=1)


def test_rank1_identification_with_distractors():
    probe = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    probe_ids = ["a", "b", "c"]
    gallery = torch.tensor([[2.0, 0.1], [0.1, 3.0], [-1.0, 0.0], [0.9, 1.2], [1.0, 0.95]])
    gallery_ids = ["a", "b", "x", "c", "y"]  # x, y: distractors
    # Probe c (1,1): cosine with y (1,0.95) beats its mate (0.9,1.2) -> wrong; a and b right.
    assert rank1_identification(probe, probe_ids, gallery, gallery_ids) == pytest.approx(2 / 3)
    # Chunking the gallery changes nothing.
    assert rank1_identification(probe, probe_ids, gallery, gallery_ids, chunk_size=2) == pytest.approx(2 / 3)
    assert rank1_identification(probe, torch.tensor([0, 1, 2]), gallery, torch.tensor([0, 1, 9, 2, 8])) == (
        pytest.approx(2 / 3)
    )
    with pytest.raises(ValueError, match="no mate"):
        rank1_identification(probe, ["a", "b", "z"], gallery, gallery_ids)


def test_am_softmax_by_hand():
    loss = AMSoftmax(2, 2, scale=10.0, margin=0.5)
    with torch.no_grad():
        loss.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 3.0]]))
    emb = torch.tensor([[2.0, 0.0]])
    # cos = (1, 0); target 0 -> logits 10 * (1 - 0.5, 0) = (5, 0).
    expected = -math.log(math.exp(5) / (math.exp(5) + 1))
    assert loss(emb, torch.tensor([0])).item() == pytest.approx(expected)
    # Margin makes the loss larger than plain normalised softmax.
    plain = AMSoftmax(2, 2, scale=10.0, margin=0.0)
    plain.weight.data.copy_(loss.weight.data)
    assert plain(emb, torch.tensor([0])).item() < loss(emb, torch.tensor([0])).item()


def test_pspnet_loss_combines_main_and_aux_and_ignores():
    torch.manual_seed(0)
    target = torch.randint(0, 3, (2, 8, 8))
    target[:, :2] = 255
    main, aux = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 4, 4)
    aux_up = F.interpolate(aux, size=(8, 8), mode="bilinear", align_corners=False)
    expected = F.cross_entropy(main, target, ignore_index=255) + 0.4 * F.cross_entropy(
        aux_up, target, ignore_index=255
    )
    torch.testing.assert_close(pspnet_loss(main, aux, target), expected)
    torch.testing.assert_close(
        pspnet_loss(main, None, target), F.cross_entropy(main, target, ignore_index=255)
    )
    assert float(pspnet_loss(main, aux, torch.full_like(target, 255))) == 0.0
