"""Parameter / MAC counting and the paper's tables (counts on meta tensors, so these stay fast)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import repmlp
from repmlp import create_model, reparameterize_model
from repmlp.profile import count_macs, profile, profile_model
from repmlp.tables import PAPER_ROWS, deviation, measure_row, render_tables

# Models built by the face/segmentation helper are checked by their own tests.
_OTHERS = {"mobilefacenet", "face_resnet", "repmlp_face_resnet", "pspnet_res50", "pspnet_repmlp_res50"}

# Rows whose paper parameter count we could not reproduce with a structure that follows the paper's
# description: our FLOPs for these rows match within 0.1%, and the missing ~31k (D, E) / ~62k (Wide
# ConvNet) parameters would need e.g. a classifier of ~C*500 weights, i.e. >= 31k more MACs than row
# E's and the Wide ConvNet's FLOPs leave room for. See docs/models.md.
_PARAMS_XFAIL = {
    "D) FC3 as conv9": "paper's 0.81M params not matched with its 66.2M FLOPs (ours 0.78M, -4%)",
    "E) RepMLP as conv9": "paper's 0.48M params not matched with its 65.8M FLOPs (ours 0.45M, -6.5%)",
    "Wide ConvNet": "paper's 0.50M params not matched with its 65.1M FLOPs (ours 0.44M, -12.5%)",
}


def _rows():
    for row in PAPER_ROWS:
        if row.model in _OTHERS:
            continue
        marks = []
        if row.label in _PARAMS_XFAIL and row.table == "puremlp":
            marks.append(pytest.mark.xfail(strict=True, reason=_PARAMS_XFAIL[row.label]))
        yield pytest.param(row, id=f"{row.table}-{row.label}-{row.input_size}", marks=marks)


@pytest.mark.parametrize("row", list(_rows()))
def test_counts_match_paper(row) -> None:
    ours = measure_row(row)
    assert abs(deviation(ours.params, row.params)) < 1.0, f"params {ours.params:.3f}M vs paper {row.params}M"
    if row.macs is not None:
        assert abs(deviation(ours.macs, row.macs)) < 1.0, f"MACs {ours.macs:.1f}M vs paper {row.macs}M"


@pytest.mark.parametrize(
    "row", [r for r in PAPER_ROWS if r.label in _PARAMS_XFAIL and r.table == "puremlp"], ids=lambda r: r.label
)
def test_unmatched_rows_still_match_flops(row) -> None:
    assert abs(deviation(measure_row(row).macs, row.macs)) < 1.0


def test_counts_of_a_known_layer() -> None:
    conv = nn.Conv2d(3, 8, 3, padding=1)
    assert profile(conv, (3, 8, 8)) == (3 * 8 * 9 + 8, 8 * 8 * 8 * 3 * 9)
    lin = nn.Sequential(nn.Flatten(), nn.Linear(12, 5))
    assert profile(lin, (1, 3, 4, 1)) == (65, 60)
    assert count_macs(conv, (2, 3, 8, 8)) == 2 * 8 * 8 * 8 * 3 * 9  # an explicit batch is honoured


def test_profile_leaves_the_model_untouched_and_is_cheap() -> None:
    model = create_model("repmlp_fmnist")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params, macs = profile(model, 28)
    assert params == sum(p.numel() for p in model.parameters()) and macs > 0
    assert all(v.device.type == "cpu" for v in model.state_dict().values())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="input_size"):
        profile(model, (1, 2, 3, 4, 5))


def test_train_and_deploy_counts_agree_with_conversion() -> None:
    torch.manual_seed(0)
    model = create_model("repmlp_cifar", widths=(4, 8, 16)).eval()
    deployed = reparameterize_model(model)
    assert profile(model, 32) == profile_model("repmlp_cifar", deploy=False, widths=(4, 8, 16))
    assert profile(deployed, 32) == profile_model("repmlp_cifar", deploy=True, widths=(4, 8, 16))
    assert profile(deployed, 32)[0] < profile(model, 32)[0]
    assert repmlp.profile is profile


def test_render_tables_markdown() -> None:
    text = render_tables(["light", "puremlp"])
    assert "| RepMLP Light Block | `repmlp_res50_light` | 224 | 57.86 | 57.87 | +0.01% |" in text
    assert "(training-time)" in text and "### Pure MLP" in text and "r, g in c4" not in text
    with pytest.raises(ValueError, match="unknown table"):
        render_tables(["nope"])
