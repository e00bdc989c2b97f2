"""The end-of-run equivalence check: near-ties may flip, real changes may not."""

from __future__ import annotations

import torch

from repmlp.pipeline import compare_logits


def test_compare_logits_tolerates_only_flips_at_near_ties():
    ref = torch.tensor([[1.0, 1.0 + 1e-7, 0.0], [3.0, 1.0, 0.0]])
    near_tie = torch.tensor([[1.0 + 2e-7, 1.0, 0.0], [3.0, 1.0, 0.0]])
    cmp = compare_logits(ref, near_tie)
    assert cmp["changed_predictions"] == 1 and cmp["changed_beyond_ties"] == 0
    assert cmp["max_abs_diff"] < 1e-6

    real_change = torch.tensor([[1.0, 1.0, 0.0], [3.0, 3.5, 0.0]])
    cmp = compare_logits(ref, real_change)
    assert cmp["changed_predictions"] == 1 and cmp["changed_beyond_ties"] == 1
    assert abs(cmp["max_rel_diff"] - 2.5 / 3.0) < 1e-6
