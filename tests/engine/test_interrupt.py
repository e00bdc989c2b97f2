"""Runs stopped by SIGINT (Ctrl-C) or SIGTERM keep a resumable checkpoint of the step they reached; the
progress bar counts what it says; a diverged run says so and writes no NaN/inf weights.

The signal tests are real ``python -m repmlp`` processes: one gets SIGINT from itself at a fixed step (the
handler path of a real Ctrl-C, deterministically), one SIGTERM from this test while it trains. The edge
cases of the loop (a signal at an epoch's end, at the last step, a second signal) run in-process on a toy.
"""

from __future__ import annotations

import math
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import repmlp.engine.loop as loop
from repmlp.engine import DistInfo, LoopHooks, LoopOptions, Position, check_output, state_hash, train_loop
from repmlp.engine.loop import Diverged, RunInterrupted
from repmlp.io.state import load_state
from repmlp_testdata import make_fashion_mnist, run_cli, subprocess_env, user_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--model-arg", "widths=[4,8]", "--model-arg", "kernel_sizes=[3]"]
# 64 examples in batches of 8: 8 steps an epoch, and no periodic checkpoint before the run's end.
ARGS = ["--train-limit", 64, "--val-limit", 16, "--batch-size", 8, "--ckpt-every", 1000, "--no-bench",
        "--no-export", "--device", "cpu", "--threads", 1, *TINY]  # fmt: skip

# ``python -m repmlp`` that sends itself SIGINT once step 5 is done and again while the loop writes its
# checkpoint (a user pressing Ctrl-C twice): the real handlers, at a known step.
SELF_SIGINT = """
import runpy, signal, sys
import repmlp.engine.loop as loop
import repmlp.io.state as state_file

step, save_state = loop._Loop.step, state_file.save_state

def step_then_sigint(self, images, labels):
    lr = step(self, images, labels)
    if self.pos.step == 5:
        signal.raise_signal(signal.SIGINT)
    return lr

def save_state_under_sigint(path, state):
    signal.raise_signal(signal.SIGINT)
    save_state(path, state)

loop._Loop.step, state_file.save_state = step_then_sigint, save_state_under_sigint
sys.argv = ["repmlp", *sys.argv[1:]]
runpy.run_module("repmlp", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory) -> Path:
    return make_fashion_mnist(tmp_path_factory.mktemp("data") / "fmnist", n_train=64, n_test=16)


def python(*args: object, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *map(str, args)], env=subprocess_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)  # fmt: skip


@pytest.mark.slow  # real signals to training processes
def test_ctrl_c_keeps_the_step_reached_and_resume_continues_bitwise(fmnist, tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    argv = ["train", "--data-dir", fmnist, *ARGS, "--epochs", 2]
    cut_run = python("-c", SELF_SIGINT, *argv, "--output", cut)
    reference = run_cli(*argv, "--output", full)  # meanwhile
    _, err = cut_run.communicate(timeout=300)
    assert reference.returncode == 0, reference.stderr
    assert cut_run.returncode == 130, err
    checkpoint = cut / "checkpoint.safetensors"
    assert "Traceback" not in err and err.splitlines()[-1] == (
        f"repmlp: interrupted by SIGINT at epoch 1, batch 5 (step 5): checkpoint saved to {checkpoint}; "
        "continue with --resume"
    )
    assert not (cut / "model.safetensors").exists()
    assert not [p for p in cut.iterdir() if p.name.endswith(".tmp")]  # the second Ctrl-C left no half file
    state = load_state(checkpoint)
    assert (state["epoch"], state["batch"], state["step"]) == (0, 5, 5)
    assert state["epoch_acc"]["seconds"] > 0  # the interrupted epoch's time so far is kept

    resumed = run_cli("train", "--output", cut, "--resume", "--no-bench", "--no-export")
    assert resumed.returncode == 0, resumed.stderr
    assert "at epoch 1, batch 5 (step 5)" in resumed.stderr
    a, b = load_file(full / "model.safetensors"), load_file(cut / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def losses(out: Path) -> list[list[str]]:  # metrics.csv less the epoch's seconds (its last column)
        return [line.split(",")[:-1] for line in (out / "metrics.csv").read_text().splitlines()]

    assert losses(cut) == losses(full) and len(losses(full)) == 3


@pytest.mark.slow
def test_sigterm_while_training_exits_143_with_a_resumable_checkpoint(fmnist, tmp_path):
    out = tmp_path / "run"
    # 8 steps an epoch for 100 epochs: still training when the signal comes.
    run = python("-m", "repmlp", "train", "--data-dir", fmnist, *ARGS, "--epochs", 100, "--output", out)
    deadline = time.monotonic() + 300
    while not out.exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # the engine makes the run folder once its signal handlers are in place
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=300)
    assert run.returncode == 143, err
    last = err.splitlines()[-1]
    assert re.fullmatch(
        r"repmlp: interrupted by SIGTERM at epoch \d+, batch \d \(step \d+\): checkpoint saved to "
        rf"{re.escape(str(out / 'checkpoint.safetensors'))}; continue with --resume",
        last,
    ), last
    state = check_output(out, resume=True, procs=DistInfo())
    assert state is not None and 1 <= state["step"] < 800
    assert not (out / "model.safetensors").exists()


def test_a_diverged_run_says_where_and_keeps_its_last_finite_checkpoint(fmnist, tmp_path):
    out = tmp_path / "run"
    res = run_cli("train", "--data-dir", fmnist, *ARGS, "--epochs", 2, "--lr", 1000, "--ckpt-every", 2,
                  "--output", out)  # fmt: skip
    assert res.returncode == 2
    line = user_error_line(res.stderr)
    # The loss is checked every step, the weights at every checkpoint (every 2 steps here).
    found = re.fullmatch(r"repmlp: error: training diverged: the (loss became nan at|weights hold NaN/inf after) "
                         r"step (\d+) \(epoch \d, batch \d[^;]*; the checkpoint of step (\d+) is kept in (\S+) "
                         r"\(try a smaller --lr into another --output\)", line)  # fmt: skip
    assert found and found[4] == str(out / "checkpoint.safetensors"), line
    state = load_state(out / "checkpoint.safetensors")
    assert state["step"] == int(found[3]) < int(found[2])
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
    assert not (out / "model.safetensors").exists()


# --------------------------------------------------------------------------------------------- toy loops
class Toy:
    """4 batches an epoch of a linear classifier; ``at``: what to do after the step of that number."""

    def __init__(self, at: dict[int, object] | None = None) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(12, 5, generator=gen), torch.randint(0, 3, (12,), generator=gen)
        self.at = at or {}

    def __len__(self) -> int:
        return 4

    def batches(self, epoch: int, start: int = 0):
        for b in range(start, 4):
            yield self.x[3 * b : 3 * b + 3], self.y[3 * b : 3 * b + 3]

    def step(self, net: nn.Module, x: torch.Tensor, y: torch.Tensor, pos: Position):
        action = self.at.get(pos.step)  # pos.step: the steps done before this one
        if callable(action):
            action(net)
        loss = nn.functional.cross_entropy(net(x), y)
        return loss, {"loss": loss.item() * len(y), "n": float(len(y))}

    def end_epoch(self, pos: Position) -> dict:
        return {"epoch": pos.epoch + 1, "loss": pos.epoch_acc["loss"] / pos.epoch_acc["n"]}


def toy_run(out: Path, toy: Toy, state=None, **options) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 3), nn.BatchNorm1d(3))
    opts = LoopOptions(
        output=out, config={}, lr_at=lambda step: [0.1], metric_fields=("epoch", "loss"), **options
    )
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    train_loop(net, optimizer, toy, opts, DistInfo(), state, LoopHooks(toy.step, toy.end_epoch))
    return net


def sigint(times: int = 1):
    return lambda net: [signal.raise_signal(signal.SIGINT) for _ in range(times)]


def test_interrupts_at_an_epochs_end_at_the_last_step_and_twice(tmp_path):
    handler = signal.getsignal(signal.SIGINT)
    full = state_hash(toy_run(tmp_path / "full", Toy(), epochs=2))
    # (signal during step, where the run stops: epoch, batch, step); the 4th step ends epoch 1: the run
    # stops after that epoch's evaluation and checkpoint; the 8th is the last: after the final checkpoint.
    for during, stop in ((2, (0, 3, 3)), (3, (1, 0, 4)), (7, (2, 0, 8))):
        out = tmp_path / f"at{during}"
        with pytest.raises(RunInterrupted, match=rf"step {stop[2]}\): checkpoint saved to") as info:
            toy_run(out, Toy({during: sigint()}), epochs=2)
        assert info.value.signum == signal.SIGINT and signal.getsignal(signal.SIGINT) is handler
        state = load_state(out / "checkpoint.safetensors")
        assert (state["epoch"], state["batch"], state["step"]) == stop
        assert state_hash(toy_run(out, Toy(), state, epochs=2)) == full
    # A second signal before the step ends stops at once: the last checkpoint (epoch 1's) stays.
    with pytest.raises(
        RunInterrupted, match=r"again by SIGINT before step 6 ended: .* checkpoint of step 4 is"
    ):
        toy_run(tmp_path / "twice", Toy({5: sigint(2)}), epochs=2)
    assert load_state(tmp_path / "twice" / "checkpoint.safetensors")["step"] == 4


def test_a_dead_worker_is_one_line_though_child_exits_keep_signalling(tmp_path, monkeypatch):
    """Once a DataLoader worker has died, torch's SIGCHLD handler raises again whenever any child process ends.
    One may end while the loop reads the first error: the loop must stop listening before it reads it, and
    still say what happened in one line."""
    dead = "DataLoader worker (pid 12345) is killed by signal: Killed. "

    def torchs_handler(signum, frame):  # as torch.utils.data's, with that worker dead
        raise RuntimeError(dead)

    def worker_dies(net: nn.Module) -> None:
        raise RuntimeError(dead)

    first_line = loop.first_line

    def first_line_as_a_child_exits(exc: BaseException) -> str:
        signal.raise_signal(signal.SIGCHLD)  # another child process ends now
        return first_line(exc)

    monkeypatch.setattr(loop, "first_line", first_line_as_a_child_exits)
    previous = signal.signal(signal.SIGCHLD, torchs_handler)
    try:
        with pytest.raises(
            loop.ProcessLost, match=r"a data loading worker process died during step 3 \(Data"
        ):
            toy_run(tmp_path / "run", Toy({2: worker_dies}), epochs=1)
        assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_weights_that_diverge_while_the_loss_is_finite_are_never_saved(tmp_path):
    def poison(net: nn.Module) -> None:  # BatchNorm statistics that overflowed
        net[1].running_var.fill_(math.inf)

    with pytest.raises(Diverged, match=r"weights hold NaN/inf after step 6 \(epoch 2, batch 2: 1.running_var\)"
                       r" although the loss was finite; the checkpoint of step 4 is kept"):  # fmt: skip
        toy_run(tmp_path / "bn", Toy({5: poison}), epochs=2, ckpt_every=2)
    assert load_state(tmp_path / "bn" / "checkpoint.safetensors")["step"] == 4
    # Finite weights whose evaluation overflows: the epoch's row says so.
    toy = Toy()
    toy.end_epoch = lambda pos: {"epoch": pos.epoch + 1, "loss": math.nan}
    with pytest.raises(Diverged, match=r"evaluation after step 4 \(epoch 1\) gave loss nan .*no checkpoint"):
        toy_run(tmp_path / "eval", toy, epochs=2)
    assert not (tmp_path / "eval" / "checkpoint.safetensors").exists()


def test_progress_bars_count_what_they_say(tmp_path, monkeypatch):
    from tqdm import tqdm

    bars: list[tqdm] = []

    def progress(iterable, total, desc, enabled, initial=0):  # loop.progress, shown even without a terminal
        import io

        bars.append(tqdm(iterable, total=total, initial=initial, desc=desc, file=io.StringIO(), leave=False))
        return bars[-1]

    monkeypatch.setattr(loop, "progress", progress)
    toy_run(tmp_path / "epochs", Toy(), epochs=2, ckpt_every=3)  # the checkpoint of step 3 records seconds
    assert [(b.desc, b.total, b.n) for b in bars] == [("epoch 1/2", 4, 4), ("epoch 2/2", 4, 4)]
    assert all(re.fullmatch(r"loss=[\d.]+, lr=0.1", b.postfix) for b in bars), [b.postfix for b in bars]
    bars.clear()
    toy_run(tmp_path / "iterations", Toy(), iterations=6)
    assert [(b.desc, b.total, b.n) for b in bars] == [("train (epoch 1)", 6, 4), ("train (epoch 2)", 6, 6)]


# ``python -m repmlp`` that gets SIGTERM once training is done, as it converts the model.
SIGTERM_CONVERTING = """
import runpy, signal, sys
import repmlp.tasks.classification_report as report

def converting(result):
    signal.raise_signal(signal.SIGTERM)

report._convert_and_check = converting
sys.argv = ["repmlp", *sys.argv[1:]]
runpy.run_module("repmlp", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_sigterm_after_training_is_one_line_and_resume_finishes_the_run(fmnist, tmp_path):
    out = tmp_path / "run"
    run = python(
        "-c", SIGTERM_CONVERTING, "train", "--data-dir", fmnist, *ARGS, "--epochs", 1, "--output", out
    )
    _, err = run.communicate(timeout=300)
    assert run.returncode == 143, err
    assert "Traceback" not in err and err.splitlines()[-1] == "repmlp: interrupted by SIGTERM", err
    assert not (out / "report.md").exists()
    resumed = run_cli("train", "--output", out, "--resume", "--no-bench", "--no-export")
    assert resumed.returncode == 0, resumed.stderr
    assert (out / "report.md").is_file() and (out / "deploy.safetensors").is_file()


def files_of(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every entry under ``folder``: its bytes (``b""`` for a folder) and modification time."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"", p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}  # fmt: skip


def test_resume_auto_clears_a_killed_writes_leftover_and_a_finished_run_is_a_success(fmnist, tmp_path):
    """A SIGKILL (a scheduler's, after its grace period) during the first checkpoint write leaves only the
    write's temporary folder (as ``staged()`` names it): the rerun starts the run and clears it; a rerun of the
    finished run says so on one line and exits 0, touching nothing; a leftover beside a run killed after its
    last checkpoint goes when the resumed run finishes."""
    out = tmp_path / "run"
    out.mkdir()
    cut = Path(tempfile.mkdtemp(dir=out, prefix=".checkpoint.safetensors.tmp-"))
    (cut / "checkpoint.safetensors").write_bytes(b"\0" * 100)  # the write's partial file
    command = ["train", "--data-dir", fmnist, *ARGS, "--epochs", 1, "--output", out, "--resume", "auto"]
    started = run_cli(*command)
    assert started.returncode == 0, started.stderr
    assert (out / "report.md").is_file() and not [p for p in out.iterdir() if ".tmp-" in p.name]
    # The scheduler reruns the finished job: a success, one line, nothing written.
    before = files_of(out)
    again = run_cli(*command)
    assert (again.returncode, again.stdout.splitlines()) == (0, [
        f"repmlp: {out} holds a run that has finished already: nothing to do (its results: {out / 'report.md'})"
    ]), again.stderr  # fmt: skip
    assert "error" not in again.stderr and files_of(out) == before
    # Killed while writing after the last checkpoint (the model file): resumed, finished, no leftover.
    (out / "report.md").unlink()
    cut = Path(tempfile.mkdtemp(dir=out, prefix=".model.safetensors.tmp-"))
    (cut / "model.safetensors").write_bytes(b"\0" * 100)
    resumed = run_cli(*command)
    assert resumed.returncode == 0, resumed.stderr
    assert (out / "report.md").is_file() and not [p for p in out.iterdir() if ".tmp-" in p.name]
