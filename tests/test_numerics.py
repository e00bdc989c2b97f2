"""Full float32 for the checks that compare a training-time model with its converted form
(:func:`repmlp.numerics.full_float32`), whatever TF32 and autocast settings the caller holds.

On a GPU, cuDNN runs float32 convolutions in TF32 by default; a check run with the caller's settings
compares a TF32-rounded training-time form with an FC3 computed in float32 and fails although the
conversion is exact (issue 34). The flags can be set on a CPU build, so these tests turn them on as a
caller would, record what every forward pass of a check sees (a global forward pre-hook) and check that
the caller's settings come back afterwards.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from repmlp import create_model, reparameterize_model
from repmlp.cli import main as cli_main
from repmlp.io.model_file import save_model
from repmlp.numerics import full_float32
from repmlp_testdata import make_fashion_mnist, model_arg_options, run_cli, subprocess_env

pytestmark = pytest.mark.usefixtures("one_thread")

FULL = (False, False, "highest", False, False)  # what a check must see: see flags()


def flags() -> tuple:
    """cuDNN TF32, matmul TF32, float32 matmul precision, CPU and CUDA autocast, through torch's own
    getters (the legacy ones raise if the two interfaces disagree: a check must not leave them so)."""
    return (
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
        torch.get_float32_matmul_precision(),
        torch.is_autocast_enabled("cpu"),
        torch.is_autocast_enabled("cuda"),
    )


@pytest.fixture
def caller_tf32():
    """TF32 on for cuDNN and CUDA matmuls and CPU autocast on, as a GPU user's script may leave them."""
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            before = flags()
            assert before == (True, True, "high", True, False)
            yield before
            assert flags() == before  # the caller's settings are back
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@contextlib.contextmanager
def recorded(select=lambda module: True):
    """The flags every forward pass of a selected module saw while the body ran (a list, filled in)."""
    seen: list[tuple] = []

    def hook(module: nn.Module, args) -> None:
        if select(module):
            seen.append(flags())

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def _evaluated_root(module: nn.Module) -> bool:
    """A whole registered model (it has a timm config) in eval mode: a check's forward, not training's."""
    return hasattr(module, "pretrained_cfg") and not module.training


# --------------------------------------------------------------------------- the context manager
SETTINGS_SCRIPT = """
import warnings
warnings.simplefilter("error")  # a deprecation notice of the legacy flags must not surface
import torch
from repmlp.numerics import _precision_holders, _save, float32_flags, full_float32

B = torch.backends
DEFAULT = {p: o.fp32_precision for p, o in _precision_holders()}
NEW = bool(DEFAULT)  # torch >= 2.9: fp32_precision per backend and operator


def reset():
    torch.set_float32_matmul_precision("highest")
    B.cudnn.allow_tf32 = True
    for p, o in _precision_holders():
        o.fp32_precision = DEFAULT[p]


CASES = {
    "defaults": [],
    "matmul high": [lambda: torch.set_float32_matmul_precision("high")],
    "matmul medium": [lambda: torch.set_float32_matmul_precision("medium")],
    "legacy TF32 on": [lambda: setattr(B.cuda.matmul, "allow_tf32", True)],
    "legacy cuDNN TF32 off": [lambda: setattr(B.cudnn, "allow_tf32", False)],
}
if NEW:  # states the new interface makes, mixed ones included (the legacy getters raise on those)
    CASES.update({
        "new matmul tf32": [lambda: setattr(B.cuda.matmul, "fp32_precision", "tf32")],
        "new conv ieee": [lambda: setattr(B.cudnn.conv, "fp32_precision", "ieee")],
        "generic tf32": [lambda: setattr(B, "fp32_precision", "tf32")],
        "oneDNN matmul bf16": [lambda: setattr(B.mkldnn.matmul, "fp32_precision", "bf16")],
    })
for name, steps in CASES.items():
    reset()
    for step in steps:
        step()
    before, seen = _save(), float32_flags()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autocast("cuda", enabled=torch.cuda.is_available()):
        with full_float32():
            inside = float32_flags()
            assert not inside["cudnn_tf32"] and not inside["matmul_tf32"], (name, inside)
            assert inside["matmul_precision"] == "highest" and not any(inside["autocast"].values()), name
            assert B.cudnn.allow_tf32 is False and B.cuda.matmul.allow_tf32 is False, name  # consistent
            with full_float32():
                pass
            assert float32_flags() == inside, name
        assert torch.is_autocast_enabled("cpu"), name
    assert _save() == before and float32_flags() == seen, (name, before, _save())
    try:
        with full_float32():
            raise KeyError(name)
    except KeyError:
        pass
    assert _save() == before, name
print(len(CASES), "cases")
"""


def test_full_float32_switches_everything_off_and_restores_every_interface():
    """Every state a caller can set (the legacy flags, the new per-operator settings, mixed states), with
    warnings as errors: off inside, nested too; exactly restored after, also after an exception. In a
    process of its own: the cases change torch's global state."""
    res = subprocess.run(
        [sys.executable, "-c", SETTINGS_SCRIPT],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "cases" in res.stdout


def test_the_conversion_itself_computes_in_full_float32(caller_tf32, monkeypatch):
    import repmlp.nn.convert as convert

    seen = []
    fold = convert.fuse_conv_bn_eval  # torch's fold, as repmlp.nn.convert calls it
    monkeypatch.setattr(
        convert, "fuse_conv_bn_eval", lambda *a, **k: (seen.append(flags()), fold(*a, **k))[1]
    )
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    reparameterize_model(model)
    assert seen and set(seen) == {FULL}


# ------------------------------------------------------------------ every check, through its real path
@pytest.fixture(scope="module")
def fmnist(tmp_path_factory) -> Path:
    return make_fashion_mnist(tmp_path_factory.mktemp("fmnist"), n_train=64, n_test=32)


def test_train_checks_the_conversion_in_full_float32(caller_tf32, fmnist, tmp_path, monkeypatch):
    """``repmlp train``: both forms' predictions for the check (``classification_report.predict``) in
    full float32; the report says which precision each figure used."""
    import repmlp.tasks.classification_report as report

    seen: list[tuple] = []
    predict = report.predict

    def spied(*args, **kwargs):
        with recorded() as during:
            out = predict(*args, **kwargs)
        seen.extend(during)
        return out

    monkeypatch.setattr(report, "predict", spied)
    out = tmp_path / "run"
    res = run_cli("train", "--data-dir", fmnist, "--model-arg", "widths=[4,8]", "--train-limit", 32,
                  "--val-limit", 16, "--batch-size", 16, "--epochs", 1, "--no-bench", "--no-export",
                  "--device", "cpu", "--output", out)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert seen and set(seen) == {FULL}
    text = (out / "report.md").read_text()
    assert "- Precision: training and the per-epoch validation of the training curve in float32; the " in text
    assert "Both forms on the whole validation set in full float32 (no autocast, no TF32):" in text


@pytest.mark.parametrize("task", ["face", "seg"])
def test_face_and_seg_training_check_the_conversion_in_full_float32(caller_tf32, task, tmp_path):
    """The face and segmentation runs check their converted model against the training form on random
    inputs at the end, in full float32, and report it; their training steps keep the caller's settings."""
    if task == "face":
        from repmlp_testdata import FACE_TINY as TINY
        from repmlp_testdata import make_faces as _make_faces

        _make_faces(tmp_path / "data", 2, 4, seed=1)
        data = tmp_path / "data"
        argv = ["--model", "repmlp_face_resnet", *model_arg_options(TINY), "--img-size", "32", "--batch-size",
                "4", "--iterations", "2", "--lr-steps", "1"]  # fmt: skip
    else:
        from repmlp_testdata import SEG_TINY as TINY
        from repmlp_testdata import make_cityscapes as _make_cityscapes

        _make_cityscapes(tmp_path / "data", "train", 2, (64, 96), seed=0)
        data = tmp_path / "data"
        argv = ["--model", "pspnet_repmlp_res50", *model_arg_options(TINY), "--crop-size", "64",
                "--batch-size", "2", "--iterations", "1"]  # fmt: skip
    out = tmp_path / "run"
    with recorded(_evaluated_root) as seen:
        res = run_cli("train", "--task", task, "--data-dir", data, "--output", out, "--device", "cpu",
                      "--workers", "0", *argv)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert len(seen) >= 2 and set(seen) == {FULL}  # the training form and the converted one
    line = next(ln for ln in (out / "report.md").read_text().splitlines() if ln.startswith("- Conversion:"))
    assert "both forms in full float32 (no autocast, no TF32)" in line and line.endswith("-> equivalent"), (
        line
    )
    assert "-> equivalent" in res.stdout


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A training-time ``repmlp_fmnist`` file with non-trivial BatchNorm statistics."""
    torch.manual_seed(0)
    model = create_model("repmlp_fmnist", widths=[4, 8], kernel_sizes=[1, 3]).eval()
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    save_model(path, model, name="repmlp_fmnist", model_kwargs={"widths": [4, 8], "kernel_sizes": [1, 3]},
               form="train")  # fmt: skip
    return path


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["convert", "--output", "{tmp}/deploy.safetensors"], id="convert"),
        pytest.param(
            ["convert", "--precision", "bf16", "--output", "{tmp}/bf16.safetensors"], id="convert-bf16"
        ),
        pytest.param(["export", "--format", "torchscript", "--output", "{tmp}/model.pt"], id="export"),
    ],
)
def test_convert_and_export_checks_run_in_full_float32(caller_tf32, tiny_checkpoint, tmp_path, argv):
    """Every forward pass of ``repmlp convert`` (its check, the precision check) and ``repmlp export``
    (tracing and the exported files' checks)."""
    argv = [a.format(tmp=tmp_path) for a in argv]
    with recorded() as seen:
        res = run_cli(argv[0], "--checkpoint", tiny_checkpoint, *argv[1:])
    assert res.returncode == 0, res.stderr
    assert seen and set(seen) == {FULL}


def test_selfcheck_and_bench_input_check_run_in_full_float32(caller_tf32, tiny_checkpoint):
    from repmlp.models import check_forward

    with recorded() as seen:
        res = run_cli("selfcheck")
    assert res.returncode == 0, res.stderr
    with recorded() as seen_bench:
        check_forward(create_model("repmlp_fmnist", widths=[4, 8]).eval(), (1, 28, 28), "repmlp_fmnist")
    assert seen and seen_bench and set(seen + seen_bench) == {FULL}


def test_eval_check_conversion_runs_both_forms_in_full_float32(caller_tf32):
    """``repmlp eval --task face|seg --check-conversion`` evaluates both forms in full float32; without the
    check, the converted model alone runs in the caller's precision."""
    from repmlp.tasks._common import evaluate_both_forms

    seen = []

    def evaluate(model, what):
        seen.append((what, flags()))
        return {}

    evaluate_both_forms(evaluate, object(), object(), check=True)
    evaluate_both_forms(evaluate, None, object(), check=False)
    assert seen == [("the training-form model", FULL), ("the converted model", FULL),
                    ("the converted model", caller_tf32)]  # fmt: skip


def test_full_float32_on_a_model_in_reduced_precision_keeps_its_dtype():
    """Models and inputs keep their dtype: the context turns off implicit precision changes only."""
    model = nn.Linear(4, 2).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), full_float32():
        assert model(torch.ones(1, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16
        assert nn.Linear(4, 2)(torch.ones(1, 4)).dtype == torch.float32  # autocast would give bfloat16


def test_face_run_fails_when_its_conversion_check_does(tmp_path, monkeypatch):
    """A converted model that does not reproduce the training form makes the run exit 1, after saving."""
    import repmlp.nn.convert as convert_module  # save_run imports it from there when it runs
    from repmlp_testdata import FACE_TINY as TINY
    from repmlp_testdata import make_faces as _make_faces

    _make_faces(tmp_path / "data", 2, 4, seed=1)

    real = convert_module.reparameterize_model

    def broken(model, **kwargs):
        deployed = real(model, **kwargs)
        with torch.no_grad():
            next(p for p in deployed.parameters() if p.dim() > 1).mul_(1.5)
        return deployed

    monkeypatch.setattr(convert_module, "reparameterize_model", broken)
    out = tmp_path / "run"
    status = cli_main(["train", "--task", "face", "--data-dir", str(tmp_path / "data"), "--output", str(out),
                       "--model", "repmlp_face_resnet", *model_arg_options(TINY), "--img-size", "32",
                       "--batch-size", "4", "--iterations", "1", "--lr-steps", "1", "--device", "cpu",
                       "--workers", "0"])  # fmt: skip
    assert status == 1
    assert (out / "deploy.safetensors").is_file()
    assert "-> NOT EQUIVALENT" in (out / "report.md").read_text()
