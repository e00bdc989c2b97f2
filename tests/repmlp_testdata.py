"""Small data sets in the real on-disk formats, for the CLI and data tests (shared helpers, not tests)."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
from PIL import Image


def write_idx(path: Path, array: np.ndarray) -> None:
    """An IDX file (``.gz`` compressed when the name ends so) of a uint8 array."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)


def make_fashion_mnist(root: Path, n_train: int = 256, n_test: int = 128, seed: int = 0) -> Path:
    """Four Fashion-MNIST-named IDX .gz files with learnable synthetic data (class = a bright band)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
        for i, c in enumerate(labels):
            images[i, 2 * c + 4 : 2 * c + 7, :] = 250
        write_idx(root / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return root


def make_cifar10(root: Path, per_batch: int = 16, seed: int = 0) -> Path:
    """``root/cifar-10-batches-py`` exactly as torchvision lays it out (pickled dicts with bytes keys)."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        labels = [int(v) for v in rng.integers(0, 10, per_batch)]
        data = rng.integers(0, 256, (per_batch, 3072)).astype(np.uint8)
        batch = {
            b"batch_label": name.encode(),
            b"labels": labels,
            b"data": data,
            b"filenames": [f"img_{i}.png".encode() for i in range(per_batch)],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
    meta = {
        b"num_cases_per_batch": per_batch,
        b"label_names": [b"c%d" % i for i in range(10)],
        b"num_vis": 3072,
    }
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(meta, f, protocol=2)
    return root


def make_image_folder(
    root: Path, classes: int = 3, per_class: int = 4, size: int = 40, seed: int = 0
) -> Path:
    """``root/{train,val}/<class>/*.png`` with small random RGB images."""
    rng = np.random.default_rng(seed)
    for split in ("train", "val"):
        for c in range(classes):
            d = root / split / f"class{c}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                arr = rng.integers(0, 256, (size, size + 4, 3)).astype(np.uint8)
                Image.fromarray(arr).save(d / f"{i}.png")
    return root


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for ``python -m repmlp`` subprocesses: this checkout's ``src`` first, one OpenMP thread."""
    import os

    src = str(Path(__file__).resolve().parents[1] / "src")
    # Not this process's test shard (benchmarks/pytest_shards.sh): a pytest started here selects its own tests.
    env = {k: v for k, v in os.environ.items() if k != "REPMLP_TEST_SHARD"}
    return {**env, "PYTHONPATH": src, "OMP_NUM_THREADS": "1", **extra}


FAULTS = Path(__file__).resolve().parent / "faults"  # its sitecustomize injects one fault into training


def lonely_process(monkeypatch, **extra: str) -> int:
    """The environment of process 0 of 2 as torchrun sets it (``extra`` added), its peer never coming;
    returns the free port it waits on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "WORLD_SIZE": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    for key, value in {**env, **extra}.items():
        monkeypatch.setenv(key, value)
    return port


def fault_env(**fault: str) -> dict[str, str]:
    """:func:`subprocess_env` with ``tests/faults`` first on ``PYTHONPATH`` and ``fault`` as its ``FAULT_*``
    variables (``step=5``: ``FAULT_STEP=5``; see ``tests/faults/sitecustomize.py``)."""
    env = subprocess_env(**{f"FAULT_{k.upper()}": str(v) for k, v in fault.items()})
    return {**env, "PYTHONPATH": f"{FAULTS}:{env['PYTHONPATH']}"}


def user_error_line(err: str) -> str:
    """The one stderr line of a UserError (after any cleared progress bar), checked for shape."""
    assert "Traceback" not in err
    last = err.splitlines()[-1]  # tqdm clears its line with '\r': a bar left open would come last
    assert last.startswith("repmlp: error: ") and err.endswith(last + "\n"), err
    return last


def assert_diverged_weights_are_clear_errors(model, save_eval, user_error) -> None:
    """A task's ``eval`` on diverged weights: ``save_eval(name, *options)`` saves ``model`` under ``name``
    and evaluates it (exit status); ``user_error()`` returns the UserError line it printed."""
    import torch

    # Finite weights, but so large that the outputs overflow: the training form is checked first.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 4:
                p.mul_(1e6)
    assert save_eval("huge.safetensors", "--check-conversion") == 2
    assert "the training-form model's outputs are NaN/inf (diverged weights?)" in user_error()
    assert save_eval("huge.safetensors") == 2
    assert "the converted model's outputs are NaN/inf (diverged weights?)" in user_error()
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    assert save_eval("nan.safetensors") == 2
    line = user_error()  # load_model refuses the file, naming the tensor
    assert "NaN or infinite value(s)" in line and "a run that diverged?" in line


def assert_kill_and_resume_is_bitwise(argv: list[str], root: Path, stop: int, auto: bool = False) -> None:
    """``repmlp *argv`` trained into ``root/full``; again into ``root/cut``, killed after ``stop`` steps
    (:func:`fault_env`: a crash without cleanup) and continued with ``--resume`` (``auto``: both the killed and the
    continued run with ``--resume auto``, as a job a scheduler reruns): both runs must end with bitwise
    identical weights. Also checks the run files and that a finished run is not overwritten.

    The killed run is a real ``python -m repmlp`` process (the kill is ``os._exit``, no cleanup); the
    uninterrupted reference run, the resumed run and the refused rerun call :func:`repmlp.cli.main` in this
    process (as ``test_train``'s resume tests do), which saves three Python starts."""
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file

    def run(out: Path, *extra: str, **fault: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "repmlp", *argv, "--output", str(out), *extra]
        return subprocess.run(cmd, capture_output=True, text=True, env=fault_env(**fault), timeout=600)

    def run_here(out: Path) -> CliResult:
        return run_cli(*argv, "--output", str(out))

    full, cut = root / "full", root / "cut"
    reference = run_here(full)
    assert reference.returncode == 0, reference.stderr
    resume = ["--resume", "auto"] if auto else ["--resume"]
    killed = run(cut, *(resume if auto else []), step=str(stop))
    assert killed.returncode == 3, killed.stderr
    assert (cut / "checkpoint.safetensors").is_file() and not (cut / "model.safetensors").exists()
    resumed = run_cli(*argv, "--output", str(cut), *resume)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr
    a, b = load_file(full / "model.safetensors"), load_file(cut / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)

    def losses(out: Path) -> list[list[str]]:  # the loss log without its timings
        return [line.split(",")[:4] for line in (out / "metrics.csv").read_text().splitlines()]

    assert losses(full) == losses(cut) and len(losses(full)) > 2
    for name in ("report.md", "curves.png", "deploy.safetensors"):
        assert (cut / name).is_file(), name
    again = run_here(full)
    assert again.returncode == 2 and "already holds a run" in user_error_line(again.stderr)


class CliResult:
    """What :func:`run_cli` returns: the fields of a ``subprocess.CompletedProcess`` that tests read."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run_cli(*args: object) -> CliResult:
    """``repmlp *args`` in this process through the real entry point (:func:`repmlp.cli.main`, which returns
    the exit status), its stdout and stderr captured: for tests that are not about the process itself, it
    saves a Python start and the imports (seconds on a loaded machine) per call."""
    import contextlib
    import io

    from repmlp.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return CliResult(code, out.getvalue(), err.getvalue())


def model_arg_options(options: dict) -> list[str]:
    """``--model-arg KEY=VALUE`` for each option (VALUE as JSON), as the tasks' command lines take them."""
    import json

    return [a for k, v in options.items() for a in ("--model-arg", f"{k}={json.dumps(v)}")]


# A small RepMLP face model.
FACE_TINY = {
    "widths": [16, 32, 64, 128], "embedding_dim": 32, "partition": 4, "kernel_sizes": [1, 3], "groups": 2,
}  # fmt: skip


def make_faces(root: Path, identities: int, per_id: int, size: int = 32, seed: int = 0, prefix: str = "id"):
    """Synthetic aligned 'faces': each identity a fixed random pattern, each image that plus noise."""
    rng = np.random.default_rng(seed + 1000)  # noise; the identity patterns depend on (seed, i) only
    for i in range(identities):
        base = np.random.default_rng([seed, i]).uniform(0, 255, (size // 4, size // 4, 3))
        base = np.kron(base, np.ones((4, 4, 1)))
        folder = root / f"{prefix}{i:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        for j in range(per_id):
            img = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(folder / f"{j:03d}.png")


# A small RepMLP PSPNet: c3/c4 RepMLPs with 2x2 partitions at 64x64 input (global perceptron present).
SEG_TINY = {
    "widths": [32, 64, 128, 128], "partition": 4, "kernel_sizes": [1, 3], "head_channels": 16,
    "aux_channels": 8,
}  # fmt: skip


def make_cityscapes(root: Path, split: str, n: int, size: tuple[int, int], seed: int) -> None:
    """Cityscapes-layout images: sky (10) above, road (0) below, a car (13) box, an ignored border."""
    rng = np.random.default_rng(seed)
    h, w = size
    for i in range(n):
        city = f"city{i % 2}"
        name = f"{city}_{i:06d}_000019"
        label = np.zeros((h, w), np.uint8)
        horizon = int(rng.integers(h // 3, 2 * h // 3))
        label[:horizon] = 10
        top, left = int(rng.integers(horizon, h - 8)), int(rng.integers(0, w - 16))
        label[top : top + 8, left : left + 16] = 13
        label[:2] = 255
        palette = {0: (128, 64, 128), 10: (70, 130, 180), 13: (0, 0, 142), 255: (0, 0, 0)}
        image = np.zeros((h, w, 3), np.float64)
        for k, c in palette.items():
            image[label == k] = c
        image = np.clip(image + rng.normal(0, 20, image.shape), 0, 255).astype(np.uint8)
        img_dir, lab_dir = root / "leftImg8bit" / split / city, root / "gtFine" / split / city
        img_dir.mkdir(parents=True, exist_ok=True)
        lab_dir.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(img_dir / f"{name}_leftImg8bit.png")
        Image.fromarray(label).save(lab_dir / f"{name}_gtFine_labelTrainIds.png")
