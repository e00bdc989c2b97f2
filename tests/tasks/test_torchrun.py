"""Training past one process: torchrun's multi-node rendezvous, elastic restarts, preemption, and the
failures a cluster brings (a process killed, a data loading worker killed, a loss that diverges on one
process, a resume with another number of processes).

Every run trains the same tiny Fashion-MNIST model for 2 epochs of 4 steps, with a checkpoint every 2 steps,
on two processes (gloo on the CPU), and is compared with an uninterrupted ``torchrun --standalone`` run:
a run continued from a checkpoint must end with the same weights, bitwise. Faults come from
``tests/faults/sitecustomize.py``, loaded into every process: one fault injected once, after a given step.
The uninterrupted run also records every file write of each process (only process 0 writes the run).
"""

from __future__ import annotations

import csv
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from repmlp.engine import state_hash
from repmlp.io.model_file import load_model
from repmlp_testdata import fault_env, make_fashion_mnist, make_image_folder, run_cli, user_error_line

TORCHRUN = ["-m", "torch.distributed.run"]
STEPS = [
    "--train-limit",
    "64",
    "--val-limit",
    "16",
    "--batch-size",
    "16",
    "--epochs",
    "2",
    "--ckpt-every",
    "2",
]
RUN = ["--model-arg", "widths=[4,8]", *STEPS, "--device", "cpu", "--no-bench", "--no-export"]


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory) -> Path:
    return make_fashion_mnist(tmp_path_factory.mktemp("data") / "fmnist", n_train=96, n_test=48)


def python(tmp_path: Path, argv: list[str], timeout: int = 240, **fault: str) -> subprocess.CompletedProcess:
    """``python <argv>`` in ``tmp_path``; ``fault``: one injected once (``repmlp_testdata.fault_env``)."""
    env = fault_env(once=str(tmp_path / "fault"), **fault)
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=tmp_path)  # fmt: skip


def torchrun(tmp_path: Path, launch: list[str], args: list[str], timeout: int = 240,
             **fault: str) -> subprocess.CompletedProcess:  # fmt: skip
    """``torchrun <launch> -m repmlp <args>`` (see :func:`python`)."""
    return python(tmp_path, [*TORCHRUN, *launch, "-m", "repmlp", *args], timeout, **fault)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "the weights differ"


def repmlp_lines(stderr: str) -> list[str]:
    """The processes' ``repmlp:`` lines; two processes' lines may meet on the shared stderr (each writes
    its text, then its newline)."""
    return ["repmlp:" + part.split("\n")[0] for part in stderr.split("repmlp:")[1:]]


# repmlp's CLI with an audit hook that records every file write (open for writing, rename, mkdir, remove)
# inside the run folder, per rank, to show that only rank 0 writes there.
AUDITED_CLI = """
import os, sys
run_dir = os.path.realpath(os.environ["RUN_DIR"])
writes = []
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def hook(event, args):
    if event == "open":
        if not isinstance(args[2], int) or not args[2] & WRITE_FLAGS:
            return
        path = args[0]
    elif event in ("os.rename", "os.remove", "os.mkdir", "os.rmdir"):
        path = args[1] if event == "os.rename" else args[0]
    else:
        return
    if isinstance(path, (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(path))
        if path == run_dir or path.startswith(run_dir + os.sep):
            writes.append(event + " " + os.path.basename(path))

sys.addaudithook(hook)
from repmlp.cli import main
status = main(sys.argv[1:])
with open(os.path.join(os.environ["AUDIT_DIR"], "rank%s.txt" % os.environ["RANK"]), "w") as f:
    f.write("\\n".join(writes))
sys.exit(status)
"""


@pytest.fixture(scope="module")
def reference_result(fmnist, tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """The uninterrupted run, ``torchrun --standalone --nproc_per_node 2``, through the audited CLI: the run
    folder, the folder of each rank's writes, the finished process."""
    tmp = tmp_path_factory.mktemp("reference")
    out, audit, script = tmp / "run", tmp / "audit", tmp / "audited_cli.py"
    audit.mkdir()
    script.write_text(AUDITED_CLI)
    env = {**fault_env(), "RUN_DIR": str(out), "AUDIT_DIR": str(audit)}
    res = subprocess.run([sys.executable, *TORCHRUN, "--standalone", "--nproc_per_node", "2", str(script), "train",
                          "--data-dir", str(fmnist), *RUN, "--output", str(out)],
                         capture_output=True, text=True, env=env, timeout=240, cwd=tmp)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return out, audit, res


@pytest.fixture(scope="module")
def reference(reference_result) -> Path:
    return reference_result[0]


@pytest.mark.slow
def test_two_processes_keep_replicas_identical_and_only_process_0_writes(reference_result):
    out, audit, res = reference_result
    files = {"model.safetensors", "deploy.safetensors", "checkpoint.safetensors", "metrics.csv", "curves.png",
             "fc3.png", "report.md"}  # fmt: skip
    assert {p.name for p in out.iterdir()} == files
    # Rank 0 wrote the run (temp file + rename for each file); rank 1 wrote nothing there.
    rank0 = (audit / "rank0.txt").read_text().splitlines()
    assert "os.rename model.safetensors" in rank0 and "os.rename checkpoint.safetensors" in rank0
    assert (audit / "rank1.txt").read_text() == ""
    # Each rank's final weights hash (gathered by rank 0 into the report) equals the saved weights' hash.
    report = (out / "report.md").read_text()
    (line,) = [ln for ln in report.splitlines() if ln.startswith("- Replicas:")]
    assert line.startswith("- Replicas: 2 process(es)") and line.endswith("(identical)"), line
    hashes = [part.split("`")[1] for part in line.split("rank ")[1:]]
    assert hashes == [state_hash(load_model(out / "model.safetensors"))[:16]] * 2, line
    assert f"final weights identical on all 2 processes (sha256 {hashes[0]})" in res.stderr
    assert "2 processes (DDP)" in report
    # 64 examples, global batch 16 = 8 per process: 4 steps an epoch, each process saw half of every batch.
    with open(out / "metrics.csv", newline="") as f:
        assert next(csv.DictReader(f))["step"] == "4"


@pytest.mark.slow
def test_two_nodes_with_a_c10d_rendezvous_train_the_standalone_run(fmnist, reference, tmp_path):
    """Two torchrun agents of one process each (two "nodes" on 127.0.0.1) meet at a c10d rendezvous."""
    out, port = tmp_path / "run", str(free_port())
    launch = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes"]  # fmt: skip
    env = fault_env()
    args = [sys.executable, *TORCHRUN, *launch, "-m", "repmlp", "train", "--data-dir", str(fmnist), *RUN,
            "--output", str(out)]  # fmt: skip
    nodes = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]  # fmt: skip
    results = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in results]
    assert_same_weights(out, reference)
    said = [err for _, err in results if "final weights identical on all 2 processes" in err]
    assert len(said) == 1  # by global rank 0 only


@pytest.mark.slow
def test_a_restarted_worker_group_continues_from_the_checkpoint(fmnist, reference, tmp_path):
    """SIGKILL one process after step 5 (checkpoint at 4): torchrun restarts both, which resume at step 4."""
    out = tmp_path / "run"
    res = torchrun(tmp_path, ["--standalone", "--nproc_per_node", "2", "--max-restarts", "1"],
                   ["train", "--data-dir", str(fmnist), *RUN, "--output", str(out)],
                   RANK="1", SIGNAL="SIGKILL", STEP="5")  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert (
        f"resuming {out} at epoch 2, batch 0 (step 4) (torchrun restarted the processes: restart 1)"
        in res.stderr
    )
    assert_same_weights(out, reference)


@pytest.mark.slow
def test_a_preempted_run_checkpoints_and_the_same_command_resumes_it(fmnist, reference, tmp_path):
    """SIGTERM to every process and to torchrun's agent (``repmlp launch``'s own process), as a scheduler
    preempts a job: every process stops at the same step, process 0 says (once) where the checkpoint is; the
    launch exits 143 (plain torchrun: 1); one process cannot resume the run; the same command (``--resume
    auto``) continues it to the uninterrupted run's weights."""
    out = tmp_path / "run"
    args = ["train", "--data-dir", str(fmnist), *RUN, "--output", str(out), "--resume", "auto"]
    command = ["-m", "repmlp", "launch", "--standalone", "--nproc-per-node", "2", *args]
    res = python(tmp_path, command, SIGNAL="SIGTERM", STEP="5", AGENT="1", RANK="0")
    assert res.returncode == 143, res.stderr[-3000:]
    assert "holds no checkpoint: starting the run" in res.stderr
    said = "repmlp: interrupted by SIGTERM at epoch 2, batch 2 (step 6): checkpoint saved"
    assert res.stderr.count(said) == 1  # once for the run: by process 0, none by the other or the launch
    assert len(repmlp_lines(res.stderr)) == 1, res.stderr[-3000:]
    # One process: each process's share of a batch, and its BatchNorm statistics, would differ.
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    alone = python(tmp_path, ["-m", "repmlp", *args], timeout=120)
    assert alone.returncode == 2, alone.stderr
    assert "trained by 2 process(es), this run has 1" in user_error_line(alone.stderr)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    res = python(tmp_path, command)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resuming {out} at epoch 2, batch 2 (step 6)\n" in res.stderr
    assert_same_weights(out, reference)


@pytest.mark.slow
def test_launch_says_in_one_line_that_a_node_never_joined(fmnist, tmp_path):
    """Two nodes expected, one started: the rendezvous times out after join_timeout, in one line."""
    endpoint = f"127.0.0.1:{free_port()}"
    res = python(tmp_path, ["-m", "repmlp", "launch", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
                            "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "alone", "--rdzv-conf",
                            "join_timeout=2", "train", "--data-dir", str(fmnist), *RUN, "--output",
                            str(tmp_path / "run")], timeout=120)  # fmt: skip
    assert res.returncode == 2
    line = user_error_line(res.stderr)
    assert line.startswith(
        f"repmlp: error: the rendezvous at {endpoint} timed out after 2 s before all 2 nodes"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_loss_that_diverges_on_one_process_stops_every_process(fmnist, tmp_path):
    """Process 1's loss becomes NaN at step 4: both stop there with one line each, no one waits for the other."""
    res = torchrun(tmp_path, ["--standalone", "--nproc_per_node", "2"],
                   ["train", "--data-dir", str(fmnist), *RUN, "--output", str(tmp_path / "run")],
                   timeout=120, RANK="1", SIGNAL="NAN", STEP="3")  # fmt: skip
    assert res.returncode != 0
    lines = sorted(repmlp_lines(res.stderr))
    assert len(lines) == 2, res.stderr[-3000:]
    assert all(ln.startswith("repmlp: error: training diverged: the loss became") and "at step 4 " in ln
               for ln in lines), lines  # fmt: skip
    assert sum("NaN/inf on another process" in ln for ln in lines) == 1
    assert all("the checkpoint of step 2 is kept" in ln for ln in lines)


@pytest.mark.slow
def test_a_killed_data_loading_worker_stops_every_process_with_one_line(tmp_path):
    """SIGKILL process 1's DataLoader worker after step 2 (as the kernel's OOM killer does): process 1 says so,
    process 0 that its peer stopped, each in one line naming the checkpoint kept; ``repmlp launch`` lists both.
    """
    folder = make_image_folder(tmp_path / "folder", classes=3, per_class=8, size=36)
    args = ["train", "--dataset", "imagefolder", "--data-dir", str(folder), "--model", "repmlp_cifar",
            "--model-arg", "widths=[4,8]", "--model-arg", "kernel_sizes=[1,3]", "--batch-size", "8",
            "--epochs", "6", "--ckpt-every", "2", "--workers", "1", "--device", "cpu", "--no-bench",
            "--no-export", "--output", str(tmp_path / "run")]  # fmt: skip
    res = python(tmp_path, ["-m", "repmlp", "launch", "--standalone", "--nproc-per-node", "2", *args],
                 timeout=120, RANK="1", SIGNAL="SIGKILL", STEP="2", WORKERS="1")  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]  # the first failure's status
    *processes, launch = repmlp_lines(res.stderr)
    worker, peer = sorted(processes, key=lambda ln: "another process" in ln)
    assert worker.startswith("repmlp: error: a data loading worker process died during step 3 (")
    assert peer.startswith("repmlp: error: process 0 of 2: another process stopped during step 3 (")
    assert all("the checkpoint of step 2 is kept" in ln for ln in (worker, peer))
    # Process 0's status: 2, or 143 when torchrun's SIGTERM, stopping the others, comes first.
    assert re.fullmatch(r"repmlp: launch failed: process 0 exit (2|143), process 1 exit 2", launch), launch
    assert "Traceback" not in res.stderr


BAD_LAUNCHES = [
    [], ["--nproc-per-node"], ["--bogus", "3", "train"], ["--nproc-per-node", "abc", "train"],
    ["--nproc-per-node", "0", "train"], ["--nnodes", "1:x", "train"], ["--nnodes", "3:1", "train"],
    ["--rdzv-backend", "nope", "train"], ["--no-python", "train"], ["--rdzv-conf", "foo", "train"],
    ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:port", "train"], ["--max-restarts", "-1", "train"],
    ["--monitor-interval", "0", "train"], ["nosuch"], ["--nproc-per-node", "2", "launch", "train"],
    ["--rdzv-backend", "c10d", "--rdzv-endpoint", "nosuchhost.invalid:29400", "train"],
    ["--local-addr", "nosuchhost.invalid", "train"],
    *(["--rdzv-conf", f"join_timeout={t}", "train"] for t in ("0", "-5", "abc", "3.7", "99999999999999999999")),
]  # fmt: skip


@pytest.mark.parametrize("argv", BAD_LAUNCHES, ids=" ".join)
def test_launch_refuses_bad_torchrun_options_in_one_line(argv, monkeypatch):
    """torchrun's own checks (its parser, its configuration, its agent's rendezvous and processes) and the
    command's name: one line and exit 2 before any process starts."""

    def start(*args: object) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(LocalElasticAgent, "_start_workers", start)
    res = run_cli("launch", *argv, "--epochs", "1")
    assert res.returncode == 2
    assert user_error_line(res.stderr).startswith("repmlp: error: launch: ")
    assert res.stderr.count("\n") == 1, res.stderr  # nor torchrun's warnings
