"""A device out-of-memory error in ``repmlp train``, ``eval``, ``bench`` and ``predict``: one line that names
the batch size and what to try, exit status 2, and a training run's last checkpoint left whole.

There is no GPU here: the model's ``forward`` raises ``torch.OutOfMemoryError`` (CUDA's own exception
type, ``torch.cuda.OutOfMemoryError``) with CUDA's message, from inside the real code paths.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from repmlp import create_model
from repmlp.data.fashion_mnist import load_fashion_mnist
from repmlp.io.model_file import save_model
from repmlp.io.state import load_state
from repmlp_testdata import make_fashion_mnist, run_cli, user_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

NAME, KWARGS = "repmlp_fmnist", {"widths": [4, 8]}
CUDA_MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"


@pytest.fixture
def out_of_memory(monkeypatch):
    """``oom(when)`` makes the model class's forward raise a CUDA out-of-memory error whenever
    ``when(module, x)`` holds (it counts calls in ``calls``)."""
    cls = type(create_model(NAME, **KWARGS))
    forward = cls.forward
    calls: list[int] = []

    def oom(when) -> list[int]:
        def patched(self, x, *args, **kwargs):
            calls.append(len(x))
            if when(self, x):
                raise torch.OutOfMemoryError(CUDA_MESSAGE)
            return forward(self, x, *args, **kwargs)

        monkeypatch.setattr(cls, "forward", patched)
        return calls

    return oom


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory) -> Path:
    return make_fashion_mnist(tmp_path_factory.mktemp("fmnist"), n_train=64, n_test=24)


@pytest.fixture(scope="module")
def model_file(fmnist, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "model.safetensors"
    save_model(path, create_model(NAME, **KWARGS).eval(), name=NAME, model_kwargs=KWARGS, form="train",
               extra={"dataset": "fashion-mnist", "data_dir": str(fmnist)})  # fmt: skip
    return path


TRAIN = ["--model-arg", "widths=[4,8]", "--train-limit", 64, "--val-limit", 16, "--batch-size", 16,
         "--epochs", 1, "--ckpt-every", 2, "--no-bench", "--no-export", "--device", "cpu"]  # fmt: skip


def test_train_out_of_memory_keeps_the_last_checkpoint_and_resumes(fmnist, tmp_path, out_of_memory):
    """4 steps of 16 examples, a checkpoint every 2: the third training step runs out of memory."""
    calls = out_of_memory(lambda module, x: module.training and len(calls) == 3)
    out = tmp_path / "run"
    res = run_cli("train", "--data-dir", fmnist, *TRAIN, "--output", out)
    assert res.returncode == 2
    line = user_error_line(res.stderr)
    assert line.startswith("repmlp: error: CUDA out of memory in `repmlp train` at --batch-size 16; try "
                           "--batch-size 8 in a new --output (the run's last checkpoint is intact")  # fmt: skip
    assert "Traceback" not in res.stderr
    state = load_state(out / "checkpoint.safetensors")  # whole: it loads, and it is the step-2 one
    assert state["step"] == 2 and not (out / "model.safetensors").exists()
    calls.clear()
    out_of_memory(lambda module, x: False)
    res = run_cli("train", "--output", out, "--resume", "--no-bench", "--no-export")
    assert res.returncode == 0, res.stderr
    assert "(step 2)" in res.stderr and (out / "model.safetensors").is_file()


def test_eval_and_bench_out_of_memory_name_their_batch_size(model_file, out_of_memory):
    out_of_memory(lambda module, x: True)
    res = run_cli("eval", "--checkpoint", model_file, "--batch-size", 12, "--device", "cpu")
    assert res.returncode == 2
    assert user_error_line(res.stderr) == (
        "repmlp: error: CUDA out of memory in `repmlp eval` at --batch-size 12; try --batch-size 6 or "
        "another --device"
    )
    # bench checks the model on one example first; the timed batch is what runs out of memory.
    out_of_memory(lambda module, x: len(x) > 1)
    res = run_cli("bench", "--model", NAME, "--batch-size", 64, "--device", "cpu", "--repeats", 1)
    assert res.returncode == 2
    assert "CUDA out of memory in `repmlp bench` at --batch-size 64; try --batch-size 32" in (
        user_error_line(res.stderr)
    )


def test_predict_out_of_memory_names_its_batch_size(model_file, fmnist, tmp_path, out_of_memory):
    images, _ = load_fashion_mnist(fmnist, train=False)
    for i in range(3):
        Image.fromarray(images[i, 0]).save(tmp_path / f"{i}.png")
    out_of_memory(lambda module, x: True)
    res = run_cli("predict", "--checkpoint", model_file, "--device", "cpu", "--workers", 0, tmp_path)
    assert res.returncode == 2
    assert "CUDA out of memory in `repmlp predict` at --batch-size 64; try --batch-size 32" in (
        user_error_line(res.stderr)
    )


def test_out_of_memory_wrapped_by_torch_compile_is_found():
    """torch.compile re-raises a failure inside a compiled region with the original as its cause."""
    from repmlp.cli import out_of_memory

    try:
        try:
            raise torch.OutOfMemoryError(CUDA_MESSAGE)
        except torch.OutOfMemoryError as exc:
            raise RuntimeError("compiled step failed") from exc
    except RuntimeError as exc:
        assert isinstance(out_of_memory(exc), torch.OutOfMemoryError)
    assert out_of_memory(RuntimeError("a bug")) is None
