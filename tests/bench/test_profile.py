"""Parameter / MAC counting and the paper's tables (counts on meta tensors, so these stay fast)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import repmlp
from repmlp import create_model, reparameterize_model
from repmlp.bench.counts import count_macs, profile, profile_model
from repmlp.bench.tables import PAPER_ROWS, deviation, measure_row, render_tables

# Segmentation models are checked by their own tests.
_OTHERS = {"pspnet_res50", "pspnet_repmlp_res50"}

# Rows whose paper parameter count we could not reproduce with a structure that follows the paper's
# description: our FLOPs for these rows match within 0.1%, and the missing ~31k (D, E) / ~62k (Wide
# ConvNet) parameters would need e.g. a classifier of ~C*500 weights, i.e. >= 31k more MACs than row
# E's and the Wide ConvNet's FLOPs leave room for. See docs/models.md.
_PARAMS_XFAIL = {
    "D) FC3 as conv9": "paper's 0.81M params not matched with its 66.2M FLOPs (ours 0.78M, -4%)",
    "E) RepMLP as conv9": "paper's 0.48M params not matched with its 65.8M FLOPs (ours 0.45M, -6.5%)",
    "Wide ConvNet": "paper's 0.50M params not matched with its 65.1M FLOPs (ours 0.44M, -12.5%)",
}


# RepMLP-FaceRes as the paper's text builds it (FaceResNet with its four stride-1 bottlenecks of c2, c3,
# c4 replaced) cannot reach the paper's counts: the paper's own FaceResNet (40.35M, 1050M) minus those
# four bottlenecks (3.97M, 415M) already exceeds its RepMLP-FaceRes (28.32M, 406M). See docs/models.md.
_FACE_XFAIL = {
    "RepMLP-FaceRes": "paper's 28.32M / 406M are below FaceResNet minus the replaced blocks "
    "(36.4M / 635M by the paper's own FaceResNet counts); ours 38.84M / 682M",
}


def _rows():
    for row in PAPER_ROWS:
        if row.model in _OTHERS:
            continue
        marks = []
        if row.label in _PARAMS_XFAIL and row.table == "puremlp":
            marks.append(pytest.mark.xfail(strict=True, reason=_PARAMS_XFAIL[row.label]))
        if row.label in _FACE_XFAIL and row.table == "face":
            marks.append(pytest.mark.xfail(strict=True, reason=_FACE_XFAIL[row.label]))
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


def test_repmlp_face_resnet_cannot_reach_paper_counts() -> None:
    """The arithmetic behind the RepMLP-FaceRes xfail (docs/models.md, "Deviations").

    The bottlenecks the paper replaces (c2's last two, c3's and c4's last) cost 3.97M params and 415M
    MACs in FaceResNet; removing them from the paper's own FaceResNet (40.35M, 1050M) without any
    replacement still leaves more than the paper's RepMLP-FaceRes (28.32M, 406M).
    """
    with torch.device("meta"):
        face = create_model("face_resnet", deploy=True)
        ours = create_model("repmlp_face_resnet", deploy=True)
    replaced = [(0, 1), (0, 2), (1, 1), (2, 1)]
    assert [
        (i, j)
        for i, s in enumerate(ours.trunk.stages)
        for j, b in enumerate(s)
        if "RepMLP" in type(b).__name__
    ] == replaced
    params = macs = 0
    for i, j in replaced:
        block, (h, w) = face.trunk.stages[i][j], face.trunk.stage_resolutions[i]
        p, m = profile(block, (block.conv1.conv.in_channels, h, w))
        params, macs = params + p, macs + m
    assert round(params / 1e6, 2) == 3.97 and round(macs / 1e6) == 415
    assert 40.35 - params / 1e6 > 28.32 * 1.25 and 1050 - macs / 1e6 > 406 * 1.5


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
