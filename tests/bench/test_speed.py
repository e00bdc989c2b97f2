"""``repmlp tables --speed``: the paper's speed rows built, converted, checked and timed
(``repmlp.bench.speed_tables``).

On the CPU the command runs ``--quick`` on the face rows (small models at 96x96); the other rows are
checked to build (on the meta device) and to have the paper's figures and a reference.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import repmlp.bench.speed_tables as speed
from repmlp.bench.speed_tables import (
    SpeedOptions,
    SpeedResult,
    measure_speed_rows,
    render_speed_tables,
    speed_rows,
)
from repmlp.bench.tables import PAPER_ROWS
from repmlp.models import create_model
from repmlp_testdata import run_cli, user_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

# Rows of the paper's speed tables: Tables 2 (5), 3 (7), 4 (13), 5 (3), 6 (2), Appendix A (3).
COUNTS = {"c4_rg": 5, "stages": 7, "comparisons": 13, "light": 3, "face": 3, "seg": 2}


def test_every_speed_row_of_the_paper_builds_and_has_a_reference():
    rows = speed_rows()
    assert {t: sum(r.table == t for r in rows) for t in COUNTS} == COUNTS
    labels = [r.label for r in rows if r.table == "comparisons"]
    assert {"NL-Res50", "GC-Res50", "EfficientNet-B1", "EfficientNet-B2", "EfficientNet-B3"} <= set(labels)
    for row in rows:
        ref = speed.speed_reference(row)
        assert ref in rows and ref.table == row.table and ref.speed
        with torch.device("meta"):
            create_model(row.model, **row.kwargs)  # the row's model exists and takes its options
    assert [speed.paper_batch(r) for r in rows if r.table in ("face", "seg")] == [512] * 3 + [16] * 2
    # The EfficientNets' ratios are to ResNet-50 at 320, beside which the paper lists them.
    b2 = next(r for r in rows if r.label == "EfficientNet-B2")
    assert (speed.speed_reference(b2).label, speed.speed_reference(b2).input_size, b2.speed) == (
        "ResNet-50",
        320,
        396,
    )


def test_row_filter_keeps_the_references_of_the_rows_it_selects():
    assert [(r.label, r.input_size) for r in speed_rows(["efficientnet"])] == [
        ("ResNet-50", 320), ("EfficientNet-B1", 240), ("EfficientNet-B2", 260), ("EfficientNet-B3", 300)
    ]  # fmt: skip
    assert [r.label for r in speed_rows(["pspnet_repmlp"])] == ["RepMLP-Res50 (g4/8)", "ResNet-50"]
    assert speed_rows(["no such row"]) == []


def test_tables_speed_quick_measures_face_rows_beside_the_paper(tmp_path: Path):
    out = tmp_path / "speed.md"
    res = run_cli(
        "tables", "--speed", "--quick", "--rows", "RepMLP-FaceRes", "--device", "cpu", "--output", out
    )
    assert res.returncode == 0, res.stderr
    assert out.read_text() == res.stdout
    rows = {ln.split(" | ")[0][2:]: ln for ln in res.stdout.splitlines() if ln.startswith("| ") and "`" in ln}
    assert set(rows) == {"MobileFaceNet", "RepMLP-FaceRes"}  # the selected row and its reference
    cells = rows["RepMLP-FaceRes"].strip("| ").split(" | ")
    # Model, built as, input, batch, check, paper examples/s, paper ratio, fp32 examples/s, fp32 ratio.
    assert cells[2:4] == ["96", "1"] and float(cells[4]) < 1e-4
    assert cells[5:7] == ["5,425", "1.08x"]
    assert float(cells[7].replace(",", "")) > 0 and re.fullmatch(r"\d+\.\d\dx", cells[8])
    assert rows["MobileFaceNet"].strip("| ").split(" | ")[-1] == "1.00x"
    assert "Face recognition models (paper Table 5), 96x96 input: speed" in res.stdout
    assert "fp32 (TF32 off); path `eager`" in res.stdout and "Ratios to MobileFaceNet @96." in res.stdout


def test_speed_options_without_speed_and_unknown_rows_are_one_line_errors():
    res = run_cli("tables", "--quick", "--precision", "fp16")
    assert res.returncode == 2
    assert (
        user_error_line(res.stderr)
        == "repmlp: error: --precision, --quick apply to the speed tables: add --speed"
    )
    res = run_cli("tables", "--speed", "--rows", "nothing-like-this", "--device", "cpu")
    assert res.returncode == 2 and "no speed row matches" in user_error_line(res.stderr)


CALLS: list[tuple[str, tuple[int, ...]]] = []


def counting_prepare(model, example):
    """A test path: what a compiled or CUDA-graph path would return, here the model with a call counter."""
    CALLS.append(("prepare", tuple(example.shape)))

    def run(x):
        CALLS.append(("run", tuple(x.shape)))
        return model(x)

    return run


def test_timing_goes_through_the_chosen_path_and_failures_stay_in_their_row(monkeypatch):
    """The chosen path prepares the model once and times every pass; a row that
    fails (here: out of memory) is reported in its row while the others are measured."""
    monkeypatch.setitem(speed.SPEED_PATHS, "counting", counting_prepare)
    CALLS.clear()
    face = [r for r in PAPER_ROWS if r.table == "face"]
    real_build = speed._build

    def build(row):
        if row.label == "FaceResNet":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_build(row)

    monkeypatch.setattr(speed, "_build", build)
    opts = SpeedOptions(quick=True, path="counting")
    results = measure_speed_rows([face[0], face[1]], opts)
    assert CALLS == [("prepare", (1, 3, 96, 96))] + [("run", (1, 3, 96, 96))] * 2  # warm-up, timed pass
    (mobile, ok), (_, failed) = results
    assert mobile.label == "MobileFaceNet" and ok.speed["fp32"] > 0 and ok.check_ok
    assert failed.error == "out of memory" and not failed.speed
    text = render_speed_tables(results, opts)
    assert "| FaceResNet | `face_resnet` | 96 | 1 | - | 3,811 | 0.76x | out of memory | - |" in text


def test_a_failed_conversion_check_is_marked():
    row = next(r for r in PAPER_ROWS if r.label == "MobileFaceNet")
    text = render_speed_tables([(row, SpeedResult(1, 3e-3, {"fp32": 10.0}))], SpeedOptions())
    assert "| 3.0e-03 FAILED |" in text
