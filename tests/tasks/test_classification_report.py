"""The end-of-run equivalence check of ``repmlp train``."""

from __future__ import annotations

import torch

from repmlp.deploy.conversion import compare_outputs


def test_compare_outputs_reports_differences_and_flips():
    ref = torch.tensor([[1.0, 1.0 + 1e-6, 0.0], [3.0, 1.0, 0.0]])
    # A near-tie may flip within float rounding: reported, but the relative error stays tiny.
    near_tie = torch.tensor([[1.0 + 2e-6, 1.0, 0.0], [3.0, 1.0, 0.0]])
    cmp = compare_outputs(ref, near_tie).as_dict()
    assert cmp["changed_predictions"] == 1
    assert 1e-6 < cmp["max_abs_diff"] < 3e-6 and cmp["max_rel_diff"] < 1e-6

    real_change = torch.tensor([[1.0, 1.0 + 1e-6, 0.0], [3.0, 3.5, 0.0]])
    cmp = compare_outputs(ref, real_change).as_dict()
    assert cmp["changed_predictions"] == 1
    assert abs(cmp["max_rel_diff"] - 2.5 / 3.0) < 1e-6


def test_a_failed_optional_step_fails_the_run_and_a_note_that_says_failed_does_not():
    from repmlp.tasks.classification_report import Outcome, _optional

    outcome = Outcome({}, {}, {"max_rel_diff": 0.0}, 0.0)
    outcome.notes.append("a note that happens to contain the word failed")
    assert _optional("figure", lambda: 42, outcome) == 42 and outcome.failed == []

    def boom():
        raise RuntimeError("no display")

    assert _optional("figure", boom, outcome) is None
    assert outcome.failed == ["figure"] and outcome.notes[-1] == "figure failed: no display"
