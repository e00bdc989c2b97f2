"""``repmlp train`` / ``repmlp eval`` (classification) through the real entry point, on generated data.

Every data set is written in its real on-disk format (Fashion-MNIST IDX .gz files, torchvision's
``cifar-10-batches-py`` pickles, ImageNet-style ``train/`` and ``val/`` folders; see ``repmlp_testdata``).
Models are tiny variants of the paper's pure MLP (``--model-arg widths=...``) and runs last one or two
epochs of a few batches, so the file stays well under a minute and a half on two cores. Most runs call
``repmlp.cli.main`` in-process (the function the console script runs); the killed runs of the resume tests
start ``python -m repmlp`` in subprocesses. Training under torchrun: tests/tasks/test_torchrun.py.
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from repmlp import cli, engine
from repmlp.commands._parser import ArgumentParser
from repmlp.commands.task_options import TASK_OPTIONS
from repmlp.data import CIFAR10_CLASSES, FMNIST_CLASSES
from repmlp.io.model_file import load_model
from repmlp.io.state import load_state, save_state
from repmlp.tasks import TASK_MODULES
from repmlp_testdata import (
    FACE_TINY,
    SEG_TINY,
    CliResult,
    fault_env,
    make_cifar10,
    make_cityscapes,
    make_faces,
    make_fashion_mnist,
    make_image_folder,
    model_arg_options,
    run_cli,
    subprocess_env,
    write_idx,
)

# Two 28x28 stages of 4 channels, then 8 and 8: ~0.4M parameters, mostly FC3.
FMNIST_TINY = ["--model-arg", "widths=[4,8]"]
# The paper's CIFAR pure MLP with two stages of 4 and 8 channels and K = 1, 3 (32x32 inputs, 8x8 partitions).
CIFAR_TINY = ["--model", "repmlp_cifar", "--model-arg", "widths=[4,8]", "--model-arg", "kernel_sizes=[1,3]"]
RUN_FILES = {
    "model.safetensors",
    "deploy.safetensors",
    "checkpoint.safetensors",
    "metrics.csv",
    "curves.png",
    "fc3.png",
    "report.md",
}
PNG = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_thread")


def train(*args: object) -> tuple[int, str]:
    """``repmlp train ARGS`` in-process; returns the exit status and what went to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli.main(["train", *map(str, args)])
    return status, err.getvalue()


def repmlp_cli(
    *args: object, timeout: float = 300, crash_after: int | None = None
) -> subprocess.CompletedProcess:
    """``python -m repmlp ARGS`` (the console script's program) in a subprocess, output captured;
    ``crash_after``: the process dies without cleanup after that step (``repmlp_testdata.fault_env``).

    The output goes through files, not pipes: a run killed that way leaves its DataLoader
    workers holding the pipes until PyTorch's watchdog notices the dead parent (up to 5 s), and reading a
    pipe to its end would wait for them. Waiting for the process itself is what the tests mean.
    """
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "repmlp", *map(str, args)],
            stdout=out,
            stderr=err,
            timeout=timeout,
            # this checkout's repmlp, one OpenMP thread
            env=subprocess_env() if crash_after is None else fault_env(step=crash_after),
        )
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, different[:5]


def metrics_rows(run: Path) -> list[dict[str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (names and bytes), to prove a failed command changed nothing."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------ data sets
@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    return {
        "fmnist": make_fashion_mnist(root / "fmnist", n_train=96, n_test=48),
        "cifar": make_cifar10(root / "cifar", per_batch=8),
        "folder": make_image_folder(root / "folder", classes=3, per_class=4, size=36),
    }


# --------------------------------------------------------------------------- one run per data format
@pytest.fixture(scope="module")
def fmnist_run_result(data, tmp_path_factory) -> tuple[Path, CliResult]:
    out = tmp_path_factory.mktemp("runs") / "fmnist"
    res = run_cli(
        "train", "--data-dir", data["fmnist"], *FMNIST_TINY, "--train-limit", 64, "--val-limit", 40,
        "--batch-size", 16, "--epochs", 1, "--no-bench", "--output", out,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return out, res


@pytest.fixture(scope="module")
def fmnist_run(fmnist_run_result) -> Path:
    return fmnist_run_result[0]


def test_train_prints_its_results_on_stdout_and_its_progress_on_stderr(fmnist_run_result):
    """``repmlp train > out.txt`` keeps what a user keeps (the final metrics and the conversion check, the run
    folder), as other command-line tools do; the progress stays on the terminal."""
    out, res = fmnist_run_result
    results = res.stdout.splitlines()
    assert any(ln.startswith("top-1 ") and ln.endswith("-> equivalent") for ln in results), res.stdout
    assert any(ln.startswith(f"run folder: {out} (report.md)") for ln in results), res.stdout
    assert "epoch 1/1: train loss" in res.stderr and "s this epoch" in res.stderr
    assert "epoch 1/1" not in res.stdout and "training repmlp_fmnist" not in res.stdout


def check_run_folder(out: Path, *, onnx: bool, classes: list[str], n_val: int) -> None:
    """The files of a finished run and a report that states an equivalent conversion."""
    assert {p.name for p in out.iterdir()} == RUN_FILES | ({"deploy.onnx"} if onnx else set())
    for png in ("curves.png", "fc3.png"):
        assert (out / png).read_bytes().startswith(PNG)
    meta = load_model(out / "model.safetensors", form="train").metadata
    deployed = load_model(out / "deploy.safetensors", form="deploy")  # deploy=True model, strict
    assert meta.extra["classes"] == classes and meta.classes == classes
    assert deployed.metadata.model_kwargs == meta.model_kwargs and deployed.metadata.classes == classes
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in deployed.modules())
    state = load_state(out / "checkpoint.safetensors")
    assert (state["epoch"], state["batch"]) == (1, 0)  # the end of the only epoch
    (row,) = metrics_rows(out)
    report = (out / "report.md").read_text()
    assert "**equivalent**" in report and "NOT" not in report, report
    (train_row,) = [ln for ln in report.splitlines() if ln.startswith("| training-time")]
    (deploy_row,) = [ln for ln in report.splitlines() if ln.startswith("| converted")]
    assert train_row.split("|")[2:4] == deploy_row.split("|")[2:4]  # same top-1 and top-5
    # The epoch's validation score is the final model's: the report and metrics.csv agree.
    assert row["epoch"] == "1" and float(row["val_top1"]) == pytest.approx(
        float(train_row.split("|")[2]), abs=0.01
    )
    assert f" / {n_val} validation examples" in report
    assert "\n- Finished: 20" in report and "Date:" not in report  # the end time, said as such


def test_fashion_mnist_idx_run(fmnist_run, data):
    import onnxruntime as ort

    check_run_folder(fmnist_run, onnx=True, classes=FMNIST_CLASSES, n_val=40)
    # The ONNX file computes what the deployed checkpoint computes.
    deployed = load_model(fmnist_run / "deploy.safetensors")
    x = torch.randn(3, 1, 28, 28)
    with torch.inference_mode():
        ref = deployed(x).numpy()
    session = ort.InferenceSession(str(fmnist_run / "deploy.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_classification_learns_and_missing_export_packages_only_skip_export(
    data, tmp_path, monkeypatch, capsys
):
    """On learnable data (class = a bright band) the loss falls (to about 0.6x here: a wide margin);
    the reported validation top-1 is the saved model's, as ``repmlp eval`` scores it (what it is after
    a few steps is not asserted: that depends on the CPU's rounding). Without the optional ONNX
    packages the job still succeeds, noting the skipped export."""
    monkeypatch.setattr("repmlp.deploy.export.missing_onnx_packages", lambda: ["onnxscript"])
    out = tmp_path / "learn"
    status, err = train(
        "--data-dir", data["fmnist"], *FMNIST_TINY, "--batch-size", 16, "--epochs", 6,
        "--no-bench", "--output", out,
    )  # fmt: skip
    assert status == 0, err
    rows = metrics_rows(out)
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])
    capsys.readouterr()
    assert cli.main(["eval", "--checkpoint", str(out / "model.safetensors"), "--workers", "0", "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["top1"] == pytest.approx(float(rows[-1]["val_top1"]), abs=0.01)
    assert not (out / "deploy.onnx").exists()
    assert "ONNX export skipped: onnxscript not installed" in (out / "report.md").read_text()


def test_train_config_defaults_are_the_fmnist_preset():
    from repmlp.tasks.classification import TrainConfig
    from repmlp.tasks.recipes import PRESETS

    cfg = TrainConfig()
    assert cfg.preset == "fmnist"
    recipe = PRESETS["fmnist"].to_dict()
    assert {k: getattr(cfg, k) for k in recipe} == recipe


class _Prepared(Exception):
    """Raised in place of ``repmlp.engine.prepare_module``: the run stops before its first step."""


@pytest.mark.parametrize("task", ["cls", "face", "seg"])
def test_no_fast_training_reaches_every_tasks_prepare_module(task, data, tmp_path, monkeypatch):
    """``repmlp train --no-fast-training`` (any task) is the config's ``fast_training``, a runtime option
    (no change to the maths: a resumed run may change it), and every task's run hands it to
    ``prepare_module`` as ``form`` (which builds the training form: tests/engine/test_engine.py)."""
    forms: list[bool] = []

    def prepare(module: torch.nn.Module, procs: engine.DistInfo, *, form: bool = True) -> torch.nn.Module:
        forms.append(form)
        raise _Prepared

    monkeypatch.setattr(engine, "prepare_module", prepare)
    module = importlib.import_module(f"repmlp.tasks.{TASK_MODULES[task]}")
    if task == "cls":
        task_args = ["--data-dir", data["fmnist"], *FMNIST_TINY, "--train-limit", 32, "--val-limit", 16]
    elif task == "face":
        make_faces(tmp_path / "faces", 2, 2)
        task_args = ["--data-dir", tmp_path / "faces", "--model", "repmlp_face_resnet",
                     *model_arg_options(FACE_TINY), "--img-size", 32]  # fmt: skip
    else:
        make_cityscapes(tmp_path / "city", "train", 2, (64, 96), seed=0)
        task_args = ["--data-dir", tmp_path / "city", "--model", "pspnet_repmlp_res50",
                     *model_arg_options(SEG_TINY), "--crop-size", 64]  # fmt: skip
    for flags, fast in (([], True), (["--no-fast-training"], False)):
        argv = [*map(str, task_args), "--batch-size", "2", "--workers", "0", "--output", str(tmp_path / str(fast)),
                *flags]  # fmt: skip
        if task == "cls":
            args = cli.build_parser().parse_args(["train", *argv])
            fields = module.TrainConfig.__dataclass_fields__  # as commands/train.py takes them
            cfg = module.resolve_config(**{f: getattr(args, f) for f in fields if hasattr(args, f)})
        else:
            parser = ArgumentParser()
            TASK_OPTIONS[task]["train"](parser)
            cfg = module.TrainConfig.from_args(parser.parse_args(argv))
        assert cfg.fast_training is fast and "fast_training" in cfg.RUNTIME
        with pytest.raises(_Prepared):
            module.train(cfg)
    assert forms == [True, False]  # one prepared module a run: the training form, then the plain model


def test_cifar10_batches_run(data, tmp_path, capsys):
    out = tmp_path / "cifar"
    status, err = train(
        "--dataset", "cifar10", "--data-dir", data["cifar"], *CIFAR_TINY, "--train-limit", 32,
        "--batch-size", 16, "--epochs", 1, "--no-bench", "--no-export", "--output", out,
    )  # fmt: skip
    assert status == 0, err
    assert "32 train / 8 val examples" in err
    check_run_folder(out, onnx=False, classes=CIFAR10_CLASSES, n_val=8)
    # The paper's CIFAR recipe filled what the command line left out.
    assert "Recipe (preset `cifar`)" in (out / "report.md").read_text()
    assert "crop padding 4, flip True" in (out / "report.md").read_text()
    # The checkpoint records its data set and folder: eval needs neither --dataset nor --data-dir.
    extra = load_model(out / "deploy.safetensors").metadata.extra
    assert extra["dataset"] == "cifar10" and extra["data_dir"] == str(data["cifar"].resolve())
    res = eval_json(capsys, "--checkpoint", out / "deploy.safetensors")
    assert res["dataset"] == "cifar10" and res["n"] == 8


@pytest.mark.slow  # a DataLoader worker process, the imagenet preset's augmentations
def test_image_folder_run(data, tmp_path):
    out = tmp_path / "folder"
    # The ImageNet preset brings mixup and AutoAugment; one DataLoader worker process decodes the images.
    status, err = train(
        "--dataset", "imagefolder", "--data-dir", data["folder"], *CIFAR_TINY, "--img-size", 32,
        "--preset", "imagenet", "--batch-size", 4, "--epochs", 1, "--workers", 1, "--no-bench", "--output", out,
    )  # fmt: skip
    assert status == 0, err
    check_run_folder(out, onnx=True, classes=["class0", "class1", "class2"], n_val=12)
    report = (out / "report.md").read_text()
    assert "Recipe (preset `imagenet`)" in report and "mixup 0.2" in report and "autoaugment True" in report
    meta = load_model(out / "model.safetensors").metadata
    assert meta.model_kwargs["num_classes"] == 3 and meta.model_kwargs["img_size"] == 32
    assert meta.num_classes == 3 and meta.input_size == (3, 32, 32)


def test_cifar_batches_are_read_without_running_pickled_code(tmp_path, capsys):
    """The CIFAR batches are pickles (the data set's own format): anything but arrays/containers is refused."""
    folder = make_cifar10(tmp_path / "evil", per_batch=4) / "cifar-10-batches-py"
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return os.mkdir, (str(marker),)

    with open(folder / "test_batch", "wb") as f:
        pickle.dump({b"data": Payload(), b"labels": [0]}, f, protocol=2)
    status = cli.main(
        [
            "train",
            "--dataset",
            "cifar10",
            "--data-dir",
            str(tmp_path / "evil"),
            "--output",
            str(tmp_path / "o"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and err.startswith("repmlp: error: ") and "refusing to load posix.mkdir" in err, err
    assert not marker.exists() and not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------- eval
def eval_json(capsys, *args: object) -> dict:
    capsys.readouterr()
    assert cli.main(["eval", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_eval_of_training_time_and_deployed_checkpoints_agree(fmnist_run, data, capsys):
    res = {
        form: eval_json(
            capsys, "--checkpoint", fmnist_run / f"{name}.safetensors", "--data-dir", data["fmnist"]
        )
        for form, name in (("train", "model"), ("deploy", "deploy"))
    }
    assert res["train"]["form"] == "train" and res["deploy"]["form"] == "deploy"
    assert res["train"]["n"] == res["deploy"]["n"] == 48  # the whole generated test split
    assert res["train"]["top1"] == res["deploy"]["top1"] and res["train"]["top5"] == res["deploy"]["top5"]
    assert res["train"]["loss"] == pytest.approx(res["deploy"]["loss"], rel=1e-4)
    # On the training run's 40 validation examples, eval reproduces the run's last validation score.
    limited = eval_json(
        capsys,
        "--checkpoint",
        fmnist_run / "deploy.safetensors",
        "--data-dir",
        data["fmnist"],
        "--val-limit",
        40,
    )
    assert limited["top1"] == pytest.approx(float(metrics_rows(fmnist_run)[-1]["val_top1"]), abs=1e-3)


# ------------------------------------------------------------------------ resume and reproducibility
# 64 examples in batches of 16: 4 steps per epoch, 2 epochs, checkpoints at steps 3, 4 (epoch end) and 6.
# Random crops, flips, mixup and label smoothing make the data order and the RNG positions matter. On the
# CPU: bitwise equality is what these tests check, and CUDA kernels need not be deterministic.
RESUME_ARGS = [
    *FMNIST_TINY, "--train-limit", 64, "--val-limit", 16, "--batch-size", 16, "--epochs", 2, "--pad", 2,
    "--mixup", 0.2, "--ckpt-every", 3, "--no-bench", "--no-export", "--device", "cpu",
]  # fmt: skip


@pytest.fixture(scope="module")
def reference_run(data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "reference"
    status, err = train("--data-dir", data["fmnist"], *RESUME_ARGS, "--output", out)
    assert status == 0, err
    return out


@pytest.mark.slow  # a killed training process
def test_resume_after_a_kill_mid_epoch_gives_the_uninterrupted_weights(reference_run, data, tmp_path,
                                                                       monkeypatch):  # fmt: skip
    out = tmp_path / "killed"
    # A real process that dies without cleanup after step 7: the last checkpoint is step 6 (epoch 2, batch 2).
    res = repmlp_cli("train", "--data-dir", data["fmnist"], *RESUME_ARGS, "--threads", 1, "--output", out,
                     crash_after=7)  # fmt: skip
    assert res.returncode not in (0, 2), res.stderr
    assert "Traceback" not in res.stderr
    # Its stderr is a file, not a terminal: no bar, but a progress line after each epoch's first step.
    assert all(f"epoch {e}/2 batch 1/4  loss " in res.stderr for e in (1, 2)), res.stderr
    monkeypatch.setattr("repmlp.engine.loop.PROGRESS_SECONDS", 0.0)  # the resumed run: a line every step
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.safetensors", "metrics.csv"]
    state = load_state(out / "checkpoint.safetensors")
    assert (state["epoch"], state["batch"], state["step"]) == (1, 2, 6)
    # The README's form: the run folder; every setting comes from the checkpoint (--no-* are not settings).
    status, err = train("--output", out, "--resume", "--no-bench", "--no-export")
    assert status == 0, err
    assert "resuming" in err and "at epoch 2, batch 2 (step 6)" in err
    assert "epoch 2/2 batch 3/4  loss " in err and "epoch 2/2 batch 4/4  loss " in err, err
    assert_same_weights(reference_run / "model.safetensors", out / "model.safetensors")
    assert_same_weights(reference_run / "deploy.safetensors", out / "deploy.safetensors")
    # The first epoch's metrics came back from the checkpoint, the second's were recomputed identically.
    drop_time = [{k: v for k, v in r.items() if k != "epoch_s"} for r in metrics_rows(reference_run)]
    assert [{k: v for k, v in r.items() if k != "epoch_s"} for r in metrics_rows(out)] == drop_time


@pytest.mark.slow  # a subprocess and DataLoader worker processes (~20 s on 2 cores)
def test_resume_of_an_image_folder_run(data, tmp_path):
    """The same for decoded files: per-sample seeded RandomResizedCrop/AutoAugment, mixup, a worker process."""
    args = [
        "--dataset", "imagefolder", "--data-dir", data["folder"], *CIFAR_TINY, "--img-size", 32,
        "--preset", "imagenet", "--batch-size", 4, "--epochs", 2, "--workers", 1, "--ckpt-every", 2, "--no-bench",
        "--no-export",
        "--device", "cpu",
    ]  # fmt: skip
    status, err = train(*args, "--output", tmp_path / "reference")
    assert status == 0, err
    # 12 images in batches of 4: 3 steps per epoch; killed after step 5, the last checkpoint is step 4.
    res = repmlp_cli("train", *args, "--threads", 1, "--output", tmp_path / "killed", crash_after=5)
    assert res.returncode not in (0, 2) and "Traceback" not in res.stderr, res.stderr
    # The same command plus --resume: options equal to the saved settings are accepted.
    status, err = train(*args, "--output", tmp_path / "killed", "--resume")
    assert status == 0, err
    assert "at epoch 2, batch 1 (step 4)" in err
    assert_same_weights(
        tmp_path / "reference" / "model.safetensors", tmp_path / "killed" / "model.safetensors"
    )


def test_seeded_runs_are_reproducible(reference_run, data, tmp_path):
    status, err = train("--data-dir", data["fmnist"], *RESUME_ARGS, "--output", tmp_path / "again")
    assert status == 0, err
    assert_same_weights(reference_run / "model.safetensors", tmp_path / "again" / "model.safetensors")
    # ... and the comparison can tell runs apart: another seed gives other weights.
    status, err = train(
        "--data-dir", data["fmnist"], *RESUME_ARGS, "--seed", 1, "--output", tmp_path / "seed1"
    )
    assert status == 0, err
    a, b = weights(reference_run / "model.safetensors"), weights(tmp_path / "seed1" / "model.safetensors")
    assert not all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def bad_data(data, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    gz = shutil.copytree(data["fmnist"], root / "truncated-gz")
    name = "train-images-idx3-ubyte.gz"
    (gz / name).write_bytes((gz / name).read_bytes()[:-100])
    raw = shutil.copytree(data["fmnist"], root / "truncated-raw")
    images = np.zeros((96, 28, 28), np.uint8)
    (raw / name).unlink()
    write_idx(raw / "train-images-idx3-ubyte", images)
    (raw / "train-images-idx3-ubyte").write_bytes((raw / "train-images-idx3-ubyte").read_bytes()[:-28])
    no_val = shutil.copytree(data["folder"], root / "no-val")
    shutil.rmtree(no_val / "val")
    no_test = shutil.copytree(data["cifar"], root / "no-test-batch")
    (no_test / "cifar-10-batches-py" / "test_batch").unlink()
    return {"truncated_gz": gz, "truncated_raw": raw, "no_val": no_val, "no_test": no_test, "root": root}


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--data-dir", "{root}/does-not-exist"], ["data folder not found"]),
        (["--data-dir", "{truncated_gz}"], ["cannot read", "train-images-idx3-ubyte.gz"]),
        (["--data-dir", "{truncated_raw}"], ["truncated or malformed"]),
        (["--dataset", "imagefolder", "--data-dir", "{no_val}"], ["has no 'val' sub-folder"]),
        (["--dataset", "cifar10", "--data-dir", "{no_test}"], ["CIFAR-10 batch missing", "test_batch"]),
        (["--dataset", "cifar10"], ["needs --data-dir"]),
        (["--model", "no_such_model_xyz"], ["argument --model: unknown model 'no_such_model_xyz'"]),
        (["--model-arg", "widths=[4,8,8,8,8]"], ["cannot build model 'repmlp_fmnist_patch2'"]),
        (["--epochs", "0"], ["--epochs: must be in 1..100000, got 0"]),
        (["--lr", "-1"], ["--lr: must be in (0, 1e+06], got -1"]),
        (["--lr", "nan"], ["--lr: must be in (0, 1e+06], got nan"]),
        (["--batch-size", "0"], ["--batch-size: must be in 1..1048576, got 0"]),
        (["--momentum", "1"], ["--momentum: must be in [0, 1), got 1"]),
        (["--label-smoothing", "1.5"], ["--label-smoothing: must be in [0, 1), got 1.5"]),
        (["--train-limit", "0"], ["--train-limit: must be in 1..2147483647, got 0"]),
        (["--device", "cuda:7"], ["--device cuda:7"]),
        (["--dataset", "mnist"], ["invalid choice: 'mnist'"]),
        (["--resume"], ["nothing to resume"]),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(args, fragments, data, bad_data, tmp_path, capsys):
    paths = {k: str(v) for k, v in bad_data.items()}
    argv = [a.format(**paths) for a in args]
    if "--data-dir" not in argv and "--dataset" not in argv:
        argv += ["--data-dir", str(data["fmnist"])]
    out = tmp_path / "out"
    # Small limits first (the case's own options come later and win), so a wrongly accepted case ends fast.
    small = ["--train-limit", "16", "--epochs", "1", "--no-bench", "--no-export"]
    status = cli.main(["train", *small, *argv, "--output", str(out)])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert status == 2 and lines and lines[-1].startswith("repmlp: error: "), err
    assert sum("error" in ln.lower() for ln in lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]
    assert not out.exists()  # the run folder is created only once data and model are ready


@pytest.mark.parametrize("workers", [0, 1])
def test_an_unreadable_image_stops_training_with_one_line(data, tmp_path, workers, capsys):
    folder = Path(shutil.copytree(data["folder"], tmp_path / "folder"))
    (folder / "train" / "class1" / "2.png").write_bytes(b"not a png")
    out = tmp_path / "out"
    argv = ["--dataset", "imagefolder", "--data-dir", str(folder), *CIFAR_TINY, "--img-size", "32",
            "--epochs", "1", "--batch-size", "4", "--workers", str(workers), "--output", str(out)]  # fmt: skip
    # In a DataLoader worker the error comes back wrapped in the worker's traceback text: still one line.
    run_and_expect_error(capsys, argv, "cannot read image", "2.png")
    assert not any(out.iterdir())  # failed in the first epoch, before any checkpoint


@pytest.fixture
def finished_run(reference_run, tmp_path) -> Path:
    """A copy of a finished run folder to point failing commands at."""
    return Path(shutil.copytree(reference_run, tmp_path / "run"))


@pytest.fixture
def interrupted_run(finished_run) -> Path:
    """A run killed after its last checkpoint, before its report: resumable."""
    (finished_run / "report.md").unlink()
    return finished_run


def test_a_resumed_run_keeps_its_options_and_its_report_the_original_command(interrupted_run):
    """The end of the run is the original run's (--no-bench --no-export, not given again); the report shows
    the command that started the run and the one that resumed it."""
    status, err = train("--output", interrupted_run, "--resume", "--workers", 0)
    assert status == 0, err
    assert not (interrupted_run / "deploy.onnx").exists()  # --no-export kept
    report = (interrupted_run / "report.md").read_text()
    assert "## Speed\n\nnot measured" in report  # --no-bench kept
    command = next(ln for ln in report.splitlines() if ln.startswith("- Command: "))
    assert "--no-bench" in command and "--mixup" in command and "--resume" not in command, command
    resumed = next(ln for ln in report.splitlines() if ln.startswith("- Resumed with: "))
    assert f"--output {interrupted_run} --resume --workers 0" in resumed, resumed


def test_resume_of_a_finished_run_is_refused_and_changes_nothing(finished_run, capsys):
    before = snapshot(finished_run)
    run_and_expect_error(capsys, ["--output", str(finished_run), "--resume"], "holds a finished run")
    run_and_expect_error(capsys, ["--output", str(finished_run), "--resume", "--no-export"], "finished run")
    assert snapshot(finished_run) == before


def run_and_expect_error(capsys, argv: list[str], *fragments: str) -> None:
    capsys.readouterr()
    status = cli.main(["train", *argv])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert status == 2 and lines[-1].startswith("repmlp: error: ") and "Traceback" not in err, err
    assert sum("error" in ln.lower() for ln in lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        # The run was trained with widths 4, 8 (FMNIST_TINY): another model or recipe cannot continue it.
        (
            ["--resume", "--model", "repmlp_cifar"],
            ["cannot resume", "--model 'repmlp_fmnist_patch2', not 'repmlp_cifar'"],
        ),
        (["--resume", "--model-arg", "widths=[4,16]"], ["--model-arg {'widths': [4, 8]}"]),
        (["--resume", "--lr", "0.1", "--seed", "5"], ["--lr 0.2, not 0.1", "--seed 0, not 5"]),
        (
            ["--resume", "--dataset", "cifar10", "--data-dir", "x"],
            ["--dataset 'fashion-mnist', not 'cifar10'"],
        ),
        # Mixed precision changes the maths: a CPU run (amp off) cannot continue with it.
        (["--resume", "--amp"], ["--amp False, not True"]),
        # Without --resume a run folder is never overwritten.
        ([], ["already holds a run", "--resume"]),
    ],
)
def test_resume_with_another_model_or_recipe_is_refused(argv, fragments, interrupted_run, data, capsys):
    before = snapshot(interrupted_run)
    run_and_expect_error(capsys, ["--output", str(interrupted_run), "--data-dir", str(data["fmnist"]), *argv],
                         *fragments)  # fmt: skip
    assert snapshot(interrupted_run) == before


def test_resume_after_a_kill_past_the_last_checkpoint_redoes_only_the_end(finished_run, reference_run):
    # Killed after the final epoch's checkpoint, before metrics.csv and the run's files were written.
    for name in ("metrics.csv", "model.safetensors", "deploy.safetensors", "report.md", "curves.png"):
        (finished_run / name).unlink()
    status, err = train("--output", finished_run, "--resume", "--no-bench", "--no-export")
    assert status == 0, err
    assert "at epoch 3, batch 0 (step 8)" in err and "epoch 2/2" not in err  # no training step left
    assert {p.name for p in finished_run.iterdir()} == RUN_FILES
    assert_same_weights(reference_run / "model.safetensors", finished_run / "model.safetensors")
    assert metrics_rows(finished_run) == metrics_rows(reference_run)


def test_resume_with_a_checkpoint_that_does_not_fit_or_is_damaged(interrupted_run, capsys):
    finished_run = interrupted_run  # resumable: its report is not written
    state_path = finished_run / "checkpoint.safetensors"
    # A training state whose weights belong to another model than its recorded configuration.
    state = load_state(state_path)
    state["config"]["model_args"] = {"widths": [4, 16]}
    save_state(state_path, state)
    before = snapshot(finished_run)
    run_and_expect_error(capsys, ["--output", str(finished_run), "--resume"], "does not fit this run")
    assert snapshot(finished_run) == before
    # A truncated one (as a crash while copying it could leave).
    state_path.write_bytes(state_path.read_bytes()[:1000])
    before = snapshot(finished_run)
    run_and_expect_error(capsys, ["--output", str(finished_run), "--resume"], "truncated")
    assert snapshot(finished_run) == before
    # --resume needs the run folder.
    run_and_expect_error(capsys, ["--resume"], "--resume needs --output")


@pytest.mark.parametrize("flip", [True, False])
def test_image_folder_flip_follows_the_option(data, flip):
    """``--no-flip`` must reach image folders too (the report states the flip setting)."""
    from repmlp.data import DataConfig, build_data

    built = build_data(
        DataConfig(dataset="imagefolder", data_dir=str(data["folder"]), flip=flip, img_size=32)
    )
    assert built.train.dataset.transform.flip == flip


def test_a_folder_counted_only_in_part_says_at_least(tmp_path, monkeypatch, caplog):
    """An image folder's batch is fitted on its first images only (counted up to a few batches): the log line
    says "at least" for a folder that holds more, and the exact count for one counted to its end."""
    from repmlp.tasks import recipes

    folder = make_image_folder(tmp_path / "imgs", classes=3, per_class=12, size=28)  # 36 training images
    options = {"dataset": "imagefolder", "data_dir": str(folder), "model": "repmlp_fmnist_patch2"}
    monkeypatch.setattr(recipes, "FOLDER_COUNT_STEPS", 0.125)  # count up to 32 images (256 x 0.125)
    with caplog.at_level("INFO", logger=recipes.log.name):
        recipes.folder_recipe(dict(options))
        recipes.folder_recipe({**options, "train_limit": 32})  # the run uses exactly 32
    capped, exact = [r.getMessage() for r in caplog.records if r.getMessage().startswith("image folder:")]
    assert "batch 8 (at least 4 steps an epoch on at least 32 training images)" in capped, capped
    assert "batch 8 (4 steps an epoch on 32 training images)" in exact, exact
