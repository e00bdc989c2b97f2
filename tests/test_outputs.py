"""Nothing a user owns is ever replaced (issue 46): one rule for every ``--output``, one writer per run.

``train --output`` takes a missing or empty folder (or its own run, with ``--resume``) and locks it for the
whole run; the other commands replace only a file of their own earlier output (recognised by the mark
repmlp's files carry), never an input and nothing in a finished run's folder. predict's outputs are safe to
print and to open in a spreadsheet, whatever the file and class names.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import repmlp
from repmlp.io.model_file import save_model
from repmlp_testdata import make_fashion_mnist, run_cli, subprocess_env, user_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "repmlp_fmnist"
KWARGS = {"widths": [4, 8], "kernel_sizes": [3]}
TRAIN = ["train", "--model", NAME, "--model-arg", "widths=[4,8]", "--model-arg", "kernel_sizes=[3]",
         "--epochs", 1, "--train-limit", 16, "--val-limit", 16, "--batch-size", 16, "--workers", 0,
         "--no-bench", "--no-export"]  # fmt: skip


def snapshot(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()
    }


def refused(res, *fragments: str) -> str:
    assert res.returncode == 2, res.stderr
    line = user_error_line(res.stderr)
    for fragment in fragments:
        assert fragment in line, line
    return line


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A tiny model file whose class names are hostile, an image, and a data set."""
    root = tmp_path_factory.mktemp("outputs")
    torch.manual_seed(0)
    classes = ['=HYPERLINK("http://x")', "\x1b[31mred\nrepmlp: error: forged"] + [f"c{i}" for i in range(8)]
    extra = {"dataset": "fashion-mnist", "classes": classes, "input_size": [1, 28, 28]}
    model = root / "model.safetensors"
    save_model(model, repmlp.create_model(NAME, **KWARGS).eval(), name=NAME, model_kwargs=KWARGS, form="train",
               extra=extra)  # fmt: skip
    image = root / "image.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (28, 28), dtype=np.uint8), "L").save(image)
    return {"root": root, "model": model, "image": image, "fm": make_fashion_mnist(root / "fm", 16, 16)}


def test_train_output_is_new_or_empty_and_one_writer_holds_it(files, tmp_path):
    fm = files["fm"]
    # A folder of the user's (a report.md is no run) is not trained into: its files stay as they are.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("my notes\n")
    refused(
        run_cli(*TRAIN, "--data-dir", fm, "--output", mine), "holding other files (report.md)", "empty folder"
    )
    assert snapshot(mine) == {"report.md": hashlib.sha256(b"my notes\n").hexdigest()}

    # A second writer (here: this process through another open file; then another process) is refused,
    # and writes nothing.
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        refused(run_cli(*TRAIN, "--data-dir", fm, "--output", out), "another repmlp process is writing", str(out),
                f"pid {os.getpid()}")  # fmt: skip
    finally:
        os.close(fd)
    assert not any(out.iterdir())
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(120)")  # fmt: skip
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True,
                              env=subprocess_env())  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        refused(run_cli(*TRAIN, "--data-dir", fm, "--output", out, "--resume"), f"pid {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
    # The lock died with its process: the folder trains now (and this process then holds it).
    res = run_cli(*TRAIN, "--data-dir", fm, "--output", out)
    assert res.returncode == 0, res.stderr
    # Rerunning into a finished run says it is finished, not "use --resume" (which it would refuse).
    line = refused(run_cli(*TRAIN, "--data-dir", fm, "--output", out), "already holds a run", "finished")
    assert "--resume" not in line


def test_other_commands_replace_only_their_own_output(files, tmp_path):
    model, image = str(files["model"]), str(files["image"])
    # export: a torch.save checkpoint is a zip like TorchScript, and is not replaced (nor by --format both).
    ckpt = tmp_path / "mine.pt"
    torch.save({"w": torch.zeros(2)}, ckpt)
    saved = ckpt.read_bytes()
    both = ["--format", "both", "--output", ckpt.with_suffix(".onnx")]
    for argv in (["--format", "torchscript", "--output", ckpt], both):
        refused(run_cli("export", "--checkpoint", model, *argv), "mine.pt", "did not write")
    assert ckpt.read_bytes() == saved and not ckpt.with_suffix(".onnx").exists()
    # predict's output over its own input (the labels file) or over a text file it did not write.
    labels = tmp_path / "names.csv"
    labels.write_text("".join(f"n{i}\n" for i in range(10)))
    refused(
        run_cli("predict", "--checkpoint", model, image, "--labels", labels, "--output", labels), "its input"
    )
    user = tmp_path / "mine.md"
    user.write_text("| my | table |\n")
    refused(run_cli("bench", "--checkpoint", model, "--output", user), "did not write")
    refused(run_cli("tables", "--output", user), "did not write")
    png = tmp_path / "photo.png"
    Image.new("L", (4, 4)).save(png)
    refused(
        run_cli("viz", "--checkpoint", model, "--output", png), "a PNG image that this command did not write"
    )
    assert user.read_text() == "| my | table |\n" and labels.read_text().startswith("n0\n")
    # A finished run's folder: nothing replaced, nothing added.
    run = tmp_path / "run"
    run.mkdir()
    for name in ("model.safetensors", "report.md", "metrics.csv"):
        (run / name).write_bytes(files["model"].read_bytes() if name == "model.safetensors" else b"x\n")
    before = snapshot(run)
    for argv in (
        ["predict", "--checkpoint", model, image, "--output", run / "p.csv"],
        ["bench", "--checkpoint", model, "--output", run / "b.md"],
        ["viz", "--checkpoint", model, "--output", run / "fc3.png"],
        ["tables", "--output", run / "t.md"],
        ["import", image, "--model", "repmlpnet_b224", "--output", run / "model.safetensors"],
    ):
        refused(run_cli(*argv), "holds a finished run")
    assert snapshot(run) == before
    # Its own earlier output is replaced: predict twice into one CSV.
    out = tmp_path / "p.csv"
    for _ in range(2):
        res = run_cli("predict", "--checkpoint", model, image, "--output", out, "--workers", 0)
        assert res.returncode == 0, res.stderr


def test_predict_writes_hostile_names_safely(files, tmp_path):
    """File and class names with escape sequences, newlines, formulas and bytes that are not UTF-8: the
    terminal gets escapes, the CSV quoted text that no spreadsheet evaluates, and both are written."""
    folder = tmp_path / "in"
    folder.mkdir()
    raw = os.fsencode(folder) + b"/=cmd|\x1b[2J\nrepmlp: error: forged\xff.png"
    with open(raw, "wb") as f:
        f.write(files["image"].read_bytes())
    (folder / "empty.png").write_bytes(b"")
    out = tmp_path / "p.csv"
    res = run_cli(
        "predict", "--checkpoint", files["model"], folder, "--output", out, "--workers", 0, "--top-k", 10
    )
    assert res.returncode == 1, res.stderr  # the empty file is skipped and named
    assert f"skipped {folder / 'empty.png'}: the file is empty" in res.stderr
    for text in (res.stdout, res.stderr):
        assert "\x1b" not in text and "\nrepmlp: error: forged" not in text
    assert "\\x1b[2J\\nrepmlp: error: forged\\xff.png" in res.stdout
    assert "\\x1b[31mred\\nrep" in res.stdout  # the class name, escaped, cut to the column
    rows = out.read_text(encoding="utf-8").split("\n", 1)[1]  # UTF-8 throughout: the \xff byte escaped
    assert "forged\\xff.png" in rows and "'=HYPERLINK" in rows and ",=HYPERLINK" not in rows
    # Predictor's arguments are checked when given.
    from repmlp.deploy.predict import Predictor

    predictor = Predictor(files["model"])
    for bad in ({"batch_size": 0}, {"batch_size": -1}, {"workers": -2}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            predictor.predict_files([str(files["image"])], **bad)


def test_a_failed_write_names_the_users_path(tmp_path):
    from repmlp.deploy.export import _staging
    from repmlp.errors import UserError
    from repmlp.io.model_file import atomic_write_text

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match=r"cannot write .*file/out\.csv: ") as info:
        atomic_write_text(blocker / "out.csv", "a")
    assert ".tmp" not in str(info.value)
    with pytest.raises(UserError, match=r"cannot write .*file/m\.onnx: "):
        with _staging(blocker / "m.onnx"):
            pass
    (tmp_path / "dir.csv").mkdir()
    with pytest.raises(UserError, match=r"cannot write .*dir\.csv: ") as info:
        atomic_write_text(tmp_path / "dir.csv", "a")
    assert ".tmp" not in str(info.value) and sorted(p.name for p in tmp_path.iterdir()) == ["dir.csv", "file"]


def test_a_forked_child_does_not_keep_the_run_lock(tmp_path):
    """A DataLoader worker (a fork) that outlives its trainer for a moment must not hold the run's lock: a
    ``--resume`` right after a kill would be refused. The child closes its copy; the parent's lock holds."""
    from repmlp.engine import DistInfo, state

    run = tmp_path / "run"
    state.lock_output(run, DistInfo())
    key = (os.stat(run).st_dev, os.stat(run).st_ino)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child (its at-fork hooks have run): says so, then stays alive while the parent checks
        import time

        os.write(ready_w, b"1")
        time.sleep(5)
        os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"1"
        probe = os.open(run, os.O_RDONLY)
        with pytest.raises(BlockingIOError):  # the parent's lock still holds while the child lives
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(state._LOCKS.pop(key))  # the trainer is gone: only the child could hold the lock now
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free at once
        os.close(probe)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(ready_w)
