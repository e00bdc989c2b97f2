"""Nothing a user owns is ever replaced unasked: one rule for every ``--output`` file, one writer per run.

``train --output`` takes a missing or empty folder (or its own run, with ``--resume``) and locks it for the
whole run; the other commands replace an existing file only with ``--force``, never one of their inputs,
and write atomically. predict's outputs are safe to print and to open in a spreadsheet, whatever the file
and class names.
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


def test_an_existing_output_is_replaced_only_with_force(files, tmp_path):
    """Every command with an ``--output`` file refuses an existing one without ``--force`` (naming the flag),
    and replaces it with it; an empty file holds nothing to lose."""
    model, image = str(files["model"]), str(files["image"])
    mine = {name: tmp_path / name for name in ("d.safetensors", "m.onnx", "m.pt", "p.csv", "b.md", "t.md",
                                                "fc3.png", "i.safetensors")}  # fmt: skip
    for path in mine.values():
        path.write_bytes(b"the user's own file\n")
    argv = {
        "d.safetensors": ["convert", "--checkpoint", model, "--num-examples", 2],
        "m.onnx": ["export", "--checkpoint", model, "--no-check"],
        "m.pt": ["export", "--checkpoint", model, "--format", "torchscript"],
        "p.csv": ["predict", "--checkpoint", model, image, "--workers", 0],
        "b.md": ["bench", "--checkpoint", model, "--batch-size", 2, "--warmup", 0, "--repeats", 1],
        "t.md": ["tables"],
        "fc3.png": ["viz", "--checkpoint", model],
        "i.safetensors": ["import", image, "--model", "repmlpnet_b224"],
    }
    for name, path in mine.items():
        refused(run_cli(*argv[name], "--output", path), f"--output {path} already exists", "--force")
    assert all(p.read_bytes() == b"the user's own file\n" for p in mine.values())  # nothing written
    # --format both: refused when either file exists, and writes neither.
    (tmp_path / "new.pt").write_bytes(b"mine")
    refused(run_cli(*argv["m.onnx"], "--format", "both", "--output", tmp_path / "new.onnx"), "new.pt")
    assert not (tmp_path / "new.onnx").exists()
    # With --force the file is replaced (an empty one without it).
    for name in ("d.safetensors", "m.onnx", "p.csv", "fc3.png"):
        res = run_cli(*argv[name], "--output", mine[name], "--force")
        assert res.returncode == 0, res.stderr
        assert mine[name].read_bytes() != b"the user's own file\n"
    empty = tmp_path / "empty.csv"
    empty.touch()
    assert run_cli(*argv["p.csv"], "--output", empty).returncode == 0 and empty.read_text().startswith(
        "path,"
    )
    # The tasks' evaluations write --output-json by the same rule.
    json_out = tmp_path / "m.json"
    json_out.write_text("{}")
    eval_argv = ["eval", "--task", "face", "--checkpoint", model, "--output-json", json_out]
    refused(run_cli(*eval_argv), f"--output-json {json_out} already exists", "--force")


def test_an_input_is_never_replaced(files, tmp_path):
    """An ``--output`` that is one of the command's inputs (also through a link) is refused, with or without
    ``--force``; so is a folder."""
    model, image = files["model"], str(files["image"])
    labels = tmp_path / "names.csv"
    labels.write_text("".join(f"n{i}\n" for i in range(10)))
    link = tmp_path / "link.safetensors"
    link.symlink_to(model)
    before = model.read_bytes()
    for force in ([], ["--force"]):
        refused(run_cli("predict", "--checkpoint", model, image, "--labels", labels, "--output", labels, *force),
                "would overwrite its input")  # fmt: skip
        refused(
            run_cli("convert", "--checkpoint", model, "--output", link, *force),
            "would overwrite the checkpoint",
        )
        refused(
            run_cli("viz", "--checkpoint", link, "--output", model, *force), "would overwrite the checkpoint"
        )
        refused(
            run_cli("bench", "--checkpoint", model, "--output", tmp_path, *force), "is a folder, not a file"
        )
    assert model.read_bytes() == before and labels.read_text().startswith("n0\n")


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
    from repmlp.errors import UserError
    from repmlp.io.model_file import atomic_write_text, staged

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match=r"cannot write .*file/out\.csv: ") as info:
        atomic_write_text(blocker / "out.csv", "a")
    assert ".tmp" not in str(info.value)
    with pytest.raises(UserError, match=r"cannot write .*file/m\.onnx: "):
        with staged(blocker / "m.onnx"):
            pass
    with pytest.raises(ValueError, match="the writer failed"):  # the staged file goes, the old one stays
        with staged(blocker) as tmp:
            tmp.write_text("half")
            raise ValueError("the writer failed")
    assert blocker.read_text() == "x"
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
