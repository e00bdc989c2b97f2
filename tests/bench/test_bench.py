"""``repmlp bench`` on a fair footing: every model and form run alike (plain modules; ``--channels-last``,
``--compile`` and ``--precision`` for all of them), timed in one series of interleaved rounds, each row's
path printed and, with more than one model, its speed ratio to the first model's. No test asserts a timing.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

import repmlp
from repmlp.bench import throughput
from repmlp.models import build_model
from repmlp.nn.convert import reparameterize_model
from repmlp_testdata import run_cli, subprocess_env, user_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = "repmlp_fmnist"
TINY_SIZE = (1, 28, 28)
RATIO = r"\d+\.\d\dx( \(\d+\.\d\d-\d+\.\d\d\))?"  # "1.23x (1.18-1.27)"; the reference: "1.00x"


def tiny() -> nn.Module:
    return repmlp.create_model(TINY, widths=[4, 8], kernel_sizes=[3]).eval()


def table_rows(stdout: str) -> dict[tuple[str, str], dict[str, str]]:
    """(model, form) -> {column: cell} of the Markdown table on ``stdout``."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")), strict=True)) for ln in lines[1:]]
    return {(r["Model"], r["Form"]): r for r in rows}


@pytest.mark.slow  # times ResNet-50 beside a RepMLP model
def test_bf16_baseline_beside_a_repmlp_model_through_the_entry_point():
    """The baseline's deployed form in bf16 (once a traceback: the input stayed float32) beside a RepMLP
    model's, each row's path and ratio printed, and nothing of repmlp.speed imported on the way."""
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "repmlp", "bench", "--model", "resnet50", "repmlp_fmnist_patch2",
         "--precision", "bf16", "--img-size", "32", "--in-chans", "3", "--batch-size", "2", "--repeats", "2",
         "--warmup", "1"],
        capture_output=True, text=True, timeout=300, env=subprocess_env(),
    )  # fmt: skip
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    rows = table_rows(res.stdout)
    assert list(rows) == [("resnet50", "deploy"), ("repmlp_fmnist_patch2", "deploy")]
    assert rows["resnet50", "deploy"]["vs. first"] == "1.00x"
    assert re.fullmatch(RATIO, rows["repmlp_fmnist_patch2", "deploy"]["vs. first"])
    assert {r["Path"] for r in rows.values()} == {"eager, NCHW, bf16, BN fused"}
    assert "flags: --precision bf16" in res.stdout and "vs. first is the speed over resnet50's" in res.stdout
    imported = {line.split("|")[-1].strip() for line in res.stderr.splitlines() if "|" in line}
    assert "repmlp.bench.throughput" in imported  # the import log was read
    assert not {m for m in imported if m == "repmlp.speed" or m.startswith("repmlp.speed.")}


@pytest.mark.slow  # torch.compile
def test_channels_last_and_compile_apply_to_every_row_and_show_in_the_path():
    res = run_cli("bench", "--model", TINY, "resnet18", "--in-chans", "1", "--img-size", "28", "--batch-size", "2",
                  "--warmup", "0", "--repeats", "2", "--channels-last", "--compile", "eager")  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = table_rows(res.stdout)
    assert list(rows) == [(TINY, "train"), (TINY, "deploy"), ("resnet18", "train"), ("resnet18", "deploy")]
    assert [r["Path"] for r in rows.values()] == [
        "compiled (eager), channels_last, fp32, BN unfused", "compiled (eager), channels_last, fp32, BN fused"
    ] * 2  # fmt: skip
    assert rows[TINY, "train"]["vs. first"] == rows[TINY, "deploy"]["vs. first"] == "1.00x"
    assert all(re.fullmatch(RATIO, rows["resnet18", f]["vs. first"]) for f in ("train", "deploy"))
    assert rows[TINY, "deploy"]["vs. train"].endswith("x")
    assert "flags: --channels-last --compile eager" in res.stdout


def test_one_model_has_no_ratio_column_and_every_table_a_path_column():
    res = run_cli("bench", "--model", TINY, "--batch-size", "2", "--warmup", "0", "--repeats", "1")
    assert res.returncode == 0, res.stderr
    head = res.stdout.splitlines()[0]
    assert head.endswith("| vs. train | Path |") and "vs. first" not in res.stdout
    assert [r["Path"] for r in table_rows(res.stdout).values()] == [
        "eager, NCHW, fp32, BN unfused", "eager, NCHW, fp32, BN fused"
    ]  # fmt: skip
    assert "flags: none" in res.stdout


def test_layout_flags_need_the_torch_runtime():
    res = run_cli("bench", "--model", TINY, "--runtime", "onnxruntime", "--channels-last")
    assert res.returncode == 2
    assert user_error_line(res.stderr) == (
        "repmlp: error: --channels-last and --compile apply to --runtime torch, not onnxruntime"
    )


def _spy(monkeypatch) -> list[dict]:
    """Record the callables :func:`repmlp.bench.throughput.benchmark` hands to ``time_rounds`` (which still
    times them): one dict a call."""
    calls: list[dict] = []
    real = throughput.time_rounds

    def spy(fns, *args, **kwargs):
        calls.append(dict(fns))
        return real(fns, *args, **kwargs)

    monkeypatch.setattr(throughput, "time_rounds", spy)
    return calls


def test_every_form_of_every_model_is_timed_in_one_interleaved_call_as_plain_modules(monkeypatch):
    calls = _spy(monkeypatch)
    model = tiny()
    rows = throughput.benchmark(
        {"a": model, "b": tiny()}, TINY_SIZE, 2, warmup=0, repeats=2, channels_last=True
    )
    assert len(calls) == 1 and len(calls[0]) == len(rows) == 4
    passes = list(calls[0].values())
    assert all(isinstance(p, functools.partial) for p in passes)
    # The modules as built and as re-parameterized, no class swapped; weights and input channels_last.
    built = [type(m) for m in model.modules()]
    deployed = [type(m) for m in reparameterize_model(model).modules()]
    assert [type(m) for m in passes[0].func.modules()] == built
    assert [type(m) for m in passes[1].func.modules()] == deployed
    for p in passes:
        assert p.args[0].is_contiguous(memory_format=torch.channels_last) and p.args[0].dtype == torch.float32
        weights = [w for w in p.func.parameters() if w.dim() == 4]
        assert weights and all(w.is_contiguous(memory_format=torch.channels_last) for w in weights)
    assert {r.path for r in rows} == {
        "eager, channels_last, fp32, BN unfused",
        "eager, channels_last, fp32, BN fused",
    }
    # The caller's model is not touched.
    assert all(p.is_contiguous() for p in model.parameters())
    assert any(getattr(m, "deploy", None) is False for m in model.modules())


def test_a_reduced_precision_model_gets_its_input_in_its_dtype(monkeypatch):
    """The bf16 cast of a deployed fx graph (a timm ResNet's) loses its input-casting hook in a copy: the
    benchmark casts the input itself, for every model alike."""
    calls = _spy(monkeypatch)
    model, _ = build_model("resnet18", in_chans=1, img_size=28)
    models = {"resnet18": throughput.in_precision(model.eval(), "bf16", TINY_SIZE),
              "tiny": throughput.in_precision(tiny(), "bf16", TINY_SIZE)}  # fmt: skip
    rows = throughput.benchmark(models, TINY_SIZE, 2, warmup=0, repeats=1, forms=("deploy",))
    assert [p.args[0].dtype for p in calls[0].values()] == [torch.bfloat16] * 2
    assert [r.path for r in rows] == ["eager, NCHW, bf16, BN fused"] * 2


def test_ratios_to_the_first_model_are_taken_round_by_round(monkeypatch):
    times = {0: [0.010] * 4, 1: [0.020] * 4, 2: [0.005, 0.005, 0.010, 0.010], 3: [0.010, 0.010, 0.040, 0.040]}
    monkeypatch.setattr(throughput, "time_rounds", lambda fns, *a, **k: {i: times[i] for i in fns})
    rows = throughput.benchmark({"a": tiny(), "b": tiny()}, TINY_SIZE, 2, repeats=4)
    assert [(r.model, r.form) for r in rows] == [
        ("a", "train"),
        ("a", "deploy"),
        ("b", "train"),
        ("b", "deploy"),
    ]
    # Same form: b's train over a's train (0.010 / [0.005, 0.005, 0.010, 0.010]), deploy over deploy.
    assert [r.vs_first for r in rows] == [1.0, 1.0, 1.5, 1.25]
    assert rows[2].vs_first_quartiles == (1.0, 2.0) and rows[3].vs_first_quartiles == (0.5, 2.0)
    table = throughput.render_markdown(rows)
    assert "| 1.50x (1.00-2.00) |" in table and "| 1.25x (0.50-2.00) |" in table and "| 1.00x |" in table
    single = throughput.benchmark({"a": tiny()}, TINY_SIZE, 2, repeats=4)
    assert all(r.vs_first is None for r in single) and "vs. first" not in throughput.render_markdown(single)


@pytest.mark.parametrize("name", ["resnet50", "torchvision:resnet50"])
def test_the_baselines_deployed_form_has_no_batchnorm_left(name):
    model, _ = build_model(name)
    bn = nn.modules.batchnorm._BatchNorm
    assert sum(isinstance(m, bn) for m in model.modules()) == 53
    deployed = reparameterize_model(model.eval())
    assert not any(isinstance(m, bn) for m in deployed.modules())
    assert throughput.run_path(deployed, "deploy") == "eager, NCHW, fp32, BN fused"
