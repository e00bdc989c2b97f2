"""``repmlp study ablation`` through the real entry point, on tiny synthetic Fashion-MNIST and tiny models.

One study folder is shared (module fixture): it starts with a killed run (``repmlp train`` that crashes
after its second step) that the first study call must resume; a second call must reuse
every finished run and train nothing. The killed run and the first study call are real ``python -m
repmlp`` processes; the other calls run :func:`repmlp.cli.main` in this process.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from repmlp.tasks.study import ROWS, trained_rows
from repmlp_testdata import fault_env, make_fashion_mnist, run_cli, subprocess_env, user_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--epochs", "2", "--train-limit", "16", "--val-limit", "16"]


def repmlp(*args: str, **fault: str) -> subprocess.CompletedProcess:
    """``python -m repmlp ARGS``; ``fault``: one injected (``repmlp_testdata.fault_env``)."""
    env = fault_env(**fault) if fault else subprocess_env()
    return subprocess.run([sys.executable, "-m", "repmlp", *args], capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip


def study(out: Path, data: Path, *extra: str, process: bool = False):
    """``repmlp study ablation`` with the tiny options: a subprocess if ``process``, else in this process."""
    return (repmlp if process else run_cli)(
        "study",
        "ablation",
        "--output",
        str(out),
        "--data-dir",
        str(data),
        *TINY,
        "--width-multiplier",
        "0.125",
        "--bench-batch-size",
        "2",
        *extra,
    )


def mtimes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def studied(tmp_path_factory):
    """A study folder after (1) a killed run of the Pure MLP's seed 0 and (2) a one-seed study call that
    trains two runs at a time (``--jobs 2``)."""
    root = tmp_path_factory.mktemp("study")
    data = make_fashion_mnist(root / "fmnist", n_train=32, n_test=16)
    out = root / "study"
    # 16 examples = one step per epoch: stopping at step 2 leaves the checkpoint of epoch 1.
    killed = repmlp(
        "train", "--data-dir", str(data), "--preset", "cifar", "--model", "repmlp_cifar",
        "--model-arg", "width_multiplier=0.125", "--img-size", "32", "--seed", "0",
        "--output", str(out / "pure_mlp" / "seed0"), *TINY, step="2",
    )  # fmt: skip
    assert killed.returncode == 3, killed.stderr
    assert not (out / "pure_mlp" / "seed0" / "result.json").exists()
    # Two runs at a time in worker processes: the killed run must still be resumed, its log still shown.
    first = study(out, data, "--seeds", "1", "--jobs", "2", process=True)
    assert first.returncode == 0, first.stderr
    return data, out, first


@pytest.mark.slow  # the killed run and the study are processes (~15 s on 2 cores)
def test_study_writes_every_row_and_resumes_the_killed_run(studied):
    _, out, first = studied
    assert "resuming" in first.stderr and "at epoch 2" in first.stderr
    text = (out / "study.md").read_text()
    for row in ROWS:
        assert f"| {row.label} | " in text, row.label
        assert f"{row.paper_top1:.2f}" in text
    assert "Local Perceptron helps" in text and "FC3 beats a 9x9 conv" in text
    assert (out / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for row in trained_rows():
        result = json.loads((out / row.key / "seed0" / "result.json").read_text())
        assert result["model"] == row.model and result["equivalent"] is True
        history = (out / row.key / "seed0" / "metrics.csv").read_text().splitlines()
        assert len(history) == 1 + 2, history  # header + both epochs, the resumed run included
    assert first.stderr.count("resuming") == 1
    # The learning curves: each row's validation top-1 after every epoch, as its run logged it (one seed).
    curves = text.split("## Validation top-1 (%) by epoch, mean over seeds", 1)[1]
    assert "| row | epoch 1 | epoch 2 |" in curves
    for row in trained_rows():
        with open(out / row.key / "seed0" / "metrics.csv", newline="") as f:
            top1 = [float(r["val_top1"]) for r in csv.DictReader(f)]
        label = "Pure MLP (=A)" if row.key == "pure_mlp" else row.label
        assert f"| {label} | {top1[0]:.2f} | {top1[1]:.2f} |" in curves, (label, top1)


@pytest.mark.slow
def test_second_call_reuses_finished_runs(studied):
    data, out, _ = studied
    before = {row.key: mtimes(out / row.key) for row in trained_rows()}
    (out / "study.md").unlink()
    second = study(out, data, "--seeds", "1")
    assert second.returncode == 0, second.stderr
    assert not [line for line in second.stderr.splitlines() if line.startswith(("training ", "resuming "))]
    for row in trained_rows():
        assert mtimes(out / row.key) == before[row.key], row.key
    text = (out / "study.md").read_text()  # written again from the reused results
    assert "one run: no spread" in text and "| Pure MLP | " in text


@pytest.mark.slow
def test_reusing_runs_of_other_options_is_refused(studied):
    data, out, _ = studied
    args = ["study", "ablation", "--output", str(out), "--data-dir", str(data), "--seeds", "1"]
    res = run_cli(
        *args, "--epochs", "3", "--width-multiplier", "0.125", "--train-limit", "16", "--val-limit", "16"
    )
    assert res.returncode == 2
    assert "cannot resume" in user_error_line(res.stderr) and "--epochs 2" in res.stderr


def _children(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is ``pid``, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if int(ppid) == pid and state != "Z":
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
@pytest.mark.slow  # a study process and its two worker processes
def test_a_killed_study_leaves_no_worker_training(tmp_path):
    """SIGKILL the study process mid-run: its worker processes end too, instead of training on into run
    folders that the next call resumes."""
    import os
    import signal
    import time

    data = make_fashion_mnist(tmp_path / "fmnist", n_train=32, n_test=16)
    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "repmlp", "study", "ablation", "--output", str(out), "--data-dir", str(data),
           "--epochs", "1000", "--train-limit", "16", "--val-limit", "16", "--width-multiplier", "0.125",
           "--seeds", "1", "--jobs", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not list(out.rglob("metrics.csv")):  # a worker is training
            assert proc.poll() is None and time.monotonic() < deadline, "the study did not start training"
            time.sleep(0.2)
        workers = [
            pid for pid in _children(proc.pid) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()
        ]
        assert len(workers) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in workers if _alive(pid)], "workers outlived the study process"
    finally:
        proc.kill()
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--width-multiplier", "nan"], "--width-multiplier"),  # argparse
        (["--jobs", "0"], "--jobs"),
        (["--dataset", "cifar10"], "needs --data-dir"),  # StudyOptions.validate
        (["--data-dir", "/nonexistent/fmnist"], "not found"),  # the first run's data loading
        pytest.param(  # raised in a worker process (started with spawn: it imports torch)
            ["--data-dir", "/nonexistent/fmnist", "--jobs", "2"], "not found", marks=pytest.mark.slow
        ),
    ],
)
def test_bad_options_are_one_error_line(tmp_path, args, message):
    res = run_cli("study", "ablation", "--output", str(tmp_path / "s"), "--epochs", "1", *args)
    assert res.returncode == 2, res.stderr
    assert message in user_error_line(res.stderr)
    assert not list((tmp_path / "s").rglob("result.json"))


def test_pad_to_centres_the_images_and_refuses_to_crop():
    import torch

    from repmlp.data import pad_to
    from repmlp.errors import UserError

    images = torch.randint(1, 256, (2, 1, 28, 28), dtype=torch.uint8)
    padded = pad_to(images, 32)
    assert padded.shape == (2, 1, 32, 32) and padded.dtype == torch.uint8
    assert torch.equal(padded[:, :, 2:30, 2:30], images)
    assert int(padded.sum()) == int(images.sum())  # the border is zero
    assert pad_to(images, None) is images
    with pytest.raises(UserError, match="smaller"):
        pad_to(images, 24)


@pytest.mark.parametrize("name", sorted({row.model for row in ROWS}))
def test_width_multiplier_scales_every_rows_widths(name):
    import torch

    from repmlp import create_model

    with torch.device("meta"):
        full = create_model(name, in_chans=1, img_size=32)
        half = create_model(name, in_chans=1, img_size=32, width_multiplier=0.5)
        same = create_model(name, in_chans=1, img_size=32, width_multiplier=1.0)
    assert half.num_features * 2 == full.num_features == same.num_features
    assert half.stem.conv.out_channels * 2 == full.stem.conv.out_channels


@pytest.mark.parametrize("preset", ["cifar", "fmnist"])
def test_each_run_takes_the_studys_preset_with_the_rows_model_and_the_studys_scale(tmp_path, preset):
    from repmlp.tasks.recipes import PRESETS
    from repmlp.tasks.study import StudyOptions, train_config
    from repmlp.tasks.study_report import describe_recipe

    opts = StudyOptions(output=str(tmp_path), epochs=4, width_multiplier=0.5, preset=preset, train_limit=64)
    cfg = train_config("repmlp_cifar_conv9", 2, opts, tmp_path / "run")
    recipe = PRESETS[preset]
    assert (cfg.preset, cfg.model, cfg.epochs, cfg.seed, cfg.img_size) == (
        preset,
        "repmlp_cifar_conv9",
        4,
        2,
        32,
    )
    assert cfg.model_args == {"width_multiplier": 0.5} and cfg.train_limit == 64
    taken = ("batch_size", "lr", "warmup_epochs", "label_smoothing", "pad", "weight_decay", "nesterov")
    assert [getattr(cfg, k) for k in taken] == [getattr(recipe, k) for k in taken]
    # The report's recipe line states the values the runs trained with.
    line = describe_recipe(preset)
    assert f"preset `{preset}`" in line and f"batch {recipe.batch_size}," in line
    assert ("label smoothing 0.1" in line) == (recipe.label_smoothing == 0.1)
    assert ("random crop" in line) == (recipe.pad > 0) and ("warm-up" in line) == (recipe.warmup_epochs > 0)


def test_runs_side_by_side_start_longest_first_and_one_at_a_time_seed_by_seed(tmp_path):
    from repmlp.tasks.study import StudyOptions, _training_macs, start_order

    rows = trained_rows()
    jobs = [(row, seed) for seed in range(2) for row in rows]
    opts = StudyOptions(output=str(tmp_path), width_multiplier=0.25, jobs=1)
    assert start_order(jobs, opts) == list(range(len(jobs)))
    opts.jobs = 2
    order = start_order(jobs, opts)
    assert sorted(order) == list(range(len(jobs)))
    costs = [_training_macs(jobs[i][0].model, opts) for i in order]
    assert costs == sorted(costs, reverse=True) and costs[0] > costs[-1]
    assert {jobs[i][0].key for i in order[:2]} == {"fc3_conv9"}  # the costliest row at this width: D


def _sleep_watching(parent: int) -> None:
    """Start the study worker's watchdog for ``parent``, then idle (exit status 3 if the watchdog fails)."""
    import os

    from repmlp.tasks.study import _exit_with_parent

    try:
        _exit_with_parent(parent, poll_s=0.05)
    except BaseException:
        os._exit(3)
    time.sleep(60)


def test_a_worker_started_after_the_study_died_ends_at_once():
    """A worker whose study process is already gone when it starts (it got another parent meanwhile) ends
    instead of training: the parent it watches is the study's pid, handed over by the study itself."""
    import multiprocessing
    import os

    # A pid that is not the child's parent (this process is): as if the study had died before the child started.
    child = multiprocessing.get_context("fork").Process(target=_sleep_watching, args=(os.getpid() + 1000000,))
    child.start()
    child.join(timeout=30)  # well before its sleep ends
    if child.is_alive():
        child.kill()
    assert child.exitcode == 1  # the watchdog's os._exit(1)
