"""The CUDA tier: on a GPU, what the CPU suite checks (every test here is marked ``cuda``; skipped without one).

    PYTHONPATH=src python3 -m pytest -q -m cuda tests/test_cuda.py    # benchmarks/gpu_check.sh runs it

- conversion of every registered model (shallow builds, tests/zoo.py) on the GPU: float32 exact with TF32
  off (:func:`repmlp.numerics.full_float32`), fp16 and bf16 within their precision;
- the main job's pipeline (``python -m repmlp train --device cuda --compile on``) on a subset of the real
  Fashion-MNIST (``$REPMLP_FMNIST_DIR``, else Debian's ``/usr/share/datasets/fashion-mnist``; skipped
  without either), then on its files: ONNX checked with onnxruntime (CPU), ``eval`` and ``predict`` on
  CUDA, ``convert --precision bf16|int8`` evaluated;
- kill and resume bitwise on CUDA (deterministic algorithms: see docs/testing.md);
- face and segmentation training and evaluation (``--check-conversion``) steps;
- ``torchrun --nproc_per_node 1``: an NCCL process group and a DDP step, then ``repmlp train`` under it.

``REPMLP_CUDA_TIER_DEVICE=cpu`` runs the same tests on the CPU (without compile, gloo instead of NCCL):
a development aid to check their logic where no GPU is at hand.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from repmlp import create_model, list_models, reparameterize_model, to_precision
from repmlp.data.fashion_mnist import DEBIAN_DIR, load_fashion_mnist
from repmlp.io.model_file import load_model
from repmlp.numerics import full_float32
from repmlp_testdata import fault_env, make_fashion_mnist, model_arg_options, run_cli, subprocess_env
from zoo import shallow

DEVICE = os.environ.get("REPMLP_CUDA_TIER_DEVICE", "cuda")
ON_GPU = DEVICE.startswith("cuda")

pytestmark = pytest.mark.cuda

# Max |converted - training-time| / max |training-time output|: float32 with TF32 off is exact to rounding;
# fp16 (10 mantissa bits) and bf16 (7) round every layer's output: measured on a CPU up to 7.1e-4 (fp16) and
# 5.5e-3 (bf16) for these shallow builds (PSPNets not measured), so the bounds leave ~10x margin and still
# catch wrong weights.
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2}
VAL = 2048  # test images the main job's run evaluates
FMNIST_STEMS = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def _real_fmnist() -> Path | None:
    """The folder of the four real Fashion-MNIST IDX files: ``$REPMLP_FMNIST_DIR``, else Debian's."""
    for folder in (os.environ.get("REPMLP_FMNIST_DIR"), str(DEBIAN_DIR)):
        if folder and all(any((Path(folder) / (s + e)).is_file() for e in ("", ".gz")) for s in FMNIST_STEMS):
            return Path(folder)
    return None


def _randomize_bn(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                n = m.num_features
                m.running_mean.copy_(torch.rand(n, generator=gen) * 0.2 - 0.1)
                m.running_var.copy_(torch.rand(n, generator=gen) * 1.5 + 0.5)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-12)).item()


def _process(cmd: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``cmd`` in a subprocess, its output captured through files (a killed run's orphaned DataLoader
    workers would hold pipes open: see test_train.repmlp_cli)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run(cmd, stdout=out, stderr=err, env=env, timeout=timeout)
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


def _json(res) -> object:
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


# ------------------------------------------------------------------------------------ every model
@pytest.mark.parametrize("name", list_models())
def test_every_registered_model_converts_on_the_device(name: str):
    """Training-time vs converted on the device in full float32 (random BatchNorm statistics, shallow
    builds), and the converted model in fp16 and bf16 against the float32 one."""
    torch.manual_seed(0)
    model = create_model(name, **shallow(name)).eval()
    _randomize_bn(model)
    model = model.to(DEVICE)
    size = model.pretrained_cfg["input_size"]
    x = torch.randn(2, *size, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    deployed = reparameterize_model(model)
    with torch.inference_mode(), full_float32():
        ref, out = _first(model(x)), _first(deployed(x))
    errors = {"fp32": _rel(out, ref)}
    for precision in ("fp16", "bf16"):
        reduced = to_precision(copy.deepcopy(deployed), precision)
        with torch.inference_mode(), full_float32():
            low = _first(reduced(x)).float()
        assert torch.isfinite(low).all(), f"{name} overflows in {precision}"
        errors[precision] = _rel(low, out)
    assert all(errors[p] <= TOLERANCE[p] for p in errors), errors


# ------------------------------------------------------------------------- the main job's pipeline
@pytest.fixture(scope="module")
def main_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, Path]:
    """``python -m repmlp train --device cuda`` with the main job's defaults on a subset: 4096 training and
    2048 test images, one epoch (on one GPU the default step runs as CUDA graphs, not compiled)."""
    data = _real_fmnist()
    if data is None:
        pytest.skip(
            "no Fashion-MNIST IDX files: set REPMLP_FMNIST_DIR to a folder holding the four files, or install "
            "Debian's dataset-fashion-mnist (/usr/share/datasets/fashion-mnist)"
        )
    out = tmp_path_factory.mktemp("main") / "run"
    res = _process(
        [sys.executable, "-m", "repmlp", "train", "--device", DEVICE, "--data-dir", str(data), "--train-limit",
         "4096", "--val-limit", str(VAL), "--epochs", "1", "--output", str(out)],
        subprocess_env(), timeout=600,
    )  # fmt: skip
    return out, res, data


def _reported_top1(res: subprocess.CompletedProcess) -> tuple[float, float]:
    found = re.search(r"top-1 ([\d.]+)% \(training-time\) vs ([\d.]+)% \(converted\)", res.stdout)
    assert found, res.stdout[-3000:]
    return float(found.group(1)), float(found.group(2))


def test_main_job_pipeline_on_a_subset_ends_with_exit_0(main_run):
    out, res, _ = main_run
    assert res.returncode == 0, res.stderr[-4000:]
    assert "-> equivalent" in res.stdout
    _reported_top1(
        res
    )  # both forms' accuracies are reported (16 steps leave BatchNorm's statistics unsettled)
    # It learned: the epoch's training loss is below chance level, ln(10) = 2.30 (measured 1.93 on a CPU).
    with open(out / "metrics.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert float(row["train_loss"]) < 2.2, row
    report = (out / "report.md").read_text()
    assert "**equivalent**" in report and "in full float32 (no autocast, no TF32)" in report
    for name in ("model.safetensors", "deploy.safetensors", "deploy.onnx", "checkpoint.safetensors"):
        assert (out / name).is_file(), name
    if ON_GPU:
        assert torch.cuda.get_device_name(0) in report
        assert "CUDA graphs training step" in report, "the step did not run as CUDA graphs: see the run's log"


def test_compile_on_trains_on_the_device(tmp_path):
    """``--compile on`` (CUDA graphs off then) trains a short run through torch.compile, without falling back."""
    data = _real_fmnist()
    if data is None:
        pytest.skip("no Fashion-MNIST IDX files (see main_run)")
    out = tmp_path / "run"
    res = _process(
        [sys.executable, "-m", "repmlp", "train", "--device", DEVICE, "--data-dir", str(data), "--train-limit",
         "1024", "--val-limit", "256", "--epochs", "1", "--compile", "on", "--no-bench", "--no-export",
         "--workers", "0", "--output", str(out)],
        subprocess_env(), timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    report = (out / "report.md").read_text()
    assert "compilation failed" not in report, "--compile on fell back to eager: see the run's log"


def test_onnx_export_of_the_run_matches_onnxruntime(main_run):
    """The pipeline's ``deploy.onnx`` (exported from the model trained on the device) in onnxruntime's CPU
    provider against the deployed model on the device, in full float32."""
    import onnxruntime as ort

    out, res, _ = main_run
    assert res.returncode == 0, res.stderr[-3000:]
    deployed = load_model(out / "deploy.safetensors", device=DEVICE, form="deploy")
    x = torch.randn(5, *deployed.metadata.input_size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode(), full_float32():
        ref = deployed(x.to(DEVICE)).float().cpu()
    session = ort.InferenceSession(str(out / "deploy.onnx"), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
    assert (got - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_eval_and_predict_on_the_device(main_run, tmp_path):
    """``repmlp eval`` of both files on the device gives the run's accuracies (which the report computed in
    full float32: a near-tie may flip, hence the bound); ``repmlp predict`` on the device gives the CPU's
    classes for real test images."""
    out, res, data = main_run
    assert res.returncode == 0, res.stderr[-3000:]
    n = VAL
    for name, reported in zip(("model", "deploy"), _reported_top1(res), strict=True):
        got = _json(run_cli("eval", "--checkpoint", out / f"{name}.safetensors", "--device", DEVICE, "--json",
                            "--val-limit", n, "--workers", 0))  # fmt: skip
        assert got["n"] == n and abs(got["top1"] - reported) <= 100 * 3 / n, (name, got, reported)
    images, _ = load_fashion_mnist(data, train=False)
    for i in range(16):
        Image.fromarray(images[i, 0]).save(tmp_path / f"{i:02d}.png")
    by_device = {}
    for device in (DEVICE, "cpu"):
        records = _json(run_cli("predict", "--checkpoint", out / "deploy.safetensors", "--device", device,
                                "--json", "--workers", 0, tmp_path))  # fmt: skip
        by_device[device] = {r["path"]: r["top_k"] for r in records}
    assert len(by_device["cpu"]) == 16
    for path, top in by_device["cpu"].items():
        other = by_device[DEVICE][path]
        # cuDNN's default TF32 convolutions (the session's own precision) move logits by ~1e-3.
        assert abs(other[0]["probability"] - top[0]["probability"]) < 1e-2, (path, top[:2], other[:2])
        if top[0]["probability"] - top[1]["probability"] > 1e-2:  # no near-tie: the same class
            assert other[0]["index"] == top[0]["index"], path


@pytest.mark.parametrize(("precision", "bound"), [("bf16", 2.0), ("int8", 3.0)])
def test_reduced_precision_conversions_evaluate_on_the_device(main_run, tmp_path, precision, bound):
    """``repmlp convert --precision`` of the run's training-time file (checked against it, calibrated on its
    training images for int8), evaluated on the device (int8 runs in onnxruntime on the CPU) within
    ``bound`` points of the float32 model's top-1."""
    out, res, _ = main_run
    assert res.returncode == 0, res.stderr[-3000:]
    target = tmp_path / f"{precision}.safetensors"
    conv = run_cli("convert", "--checkpoint", out / "model.safetensors", "--precision", precision, "--output",
                   target, "--calibration-examples", 256, "--num-examples", 32)  # fmt: skip
    assert conv.returncode == 0, conv.stderr[-3000:]
    n = VAL
    fp32 = _json(run_cli("eval", "--checkpoint", out / "deploy.safetensors", "--device", DEVICE, "--json",
                         "--val-limit", n, "--workers", 0))  # fmt: skip
    got = _json(run_cli("eval", "--checkpoint", target, "--device", DEVICE, "--json", "--val-limit", n,
                        "--workers", 0))  # fmt: skip
    assert got["precision"] == precision and abs(got["top1"] - fp32["top1"]) <= bound, (got, fp32)


# ----------------------------------------------------------------------------------- kill and resume
DETERMINISTIC_CLI = """
import sys
import torch
# Bitwise repeatable CUDA training: deterministic kernels (cuDNN's convolution algorithms and PyTorch's
# scatter/index kernels; warn only where none exists) and no cuDNN autotuning, whose choice depends on
# timings. CUBLAS_WORKSPACE_CONFIG (set by the test) makes cuBLAS deterministic.
torch.use_deterministic_algorithms(True, warn_only=True)
torch.backends.cudnn.benchmark = False
from repmlp.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_kill_and_resume_is_bitwise_on_the_device(tmp_path):
    """A run killed after step 5 (checkpoints every 3 steps) and resumed ends with the weights and losses of
    the uninterrupted run, bitwise; AMP (the CUDA default), mixup and random crops make the RNG matter.
    Every run is a process of its own with deterministic algorithms (``DETERMINISTIC_CLI``)."""
    data = make_fashion_mnist(tmp_path / "fmnist", n_train=96, n_test=32)
    (tmp_path / "cli.py").write_text(DETERMINISTIC_CLI)
    argv = ["train", "--data-dir", str(data), "--model-arg", "widths=[4,8]", "--train-limit", "64", "--val-limit",
            "16", "--batch-size", "16", "--epochs", "2", "--pad", "2", "--mixup", "0.2", "--ckpt-every", "3",
            "--no-bench", "--no-export", "--device", DEVICE, "--compile", "off", "--workers", "0"]  # fmt: skip
    env = subprocess_env(CUBLAS_WORKSPACE_CONFIG=":4096:8")

    def run(out: Path, *extra: str, env: dict[str, str] = env) -> subprocess.CompletedProcess:
        return _process([sys.executable, str(tmp_path / "cli.py"), *argv, "--output", str(out), *extra], env)

    full, cut = tmp_path / "full", tmp_path / "cut"
    assert (res := run(full)).returncode == 0, res.stderr[-3000:]
    crash = {**fault_env(step="5"), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # dies without cleanup after step 5
    assert (res := run(cut, env=crash)).returncode == 3, res.stderr[-3000:]
    assert (res := run(cut, "--resume")).returncode == 0, res.stderr[-3000:]
    assert "at epoch 2, batch 0 (step 4)" in res.stderr, res.stderr[-2000:]  # the epoch-end checkpoint
    a, b = load_file(full / "model.safetensors"), load_file(cut / "model.safetensors")
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []

    def losses(out: Path) -> list[list[str]]:  # the loss log without its timings
        return [line.split(",")[:4] for line in (out / "metrics.csv").read_text().splitlines()]

    assert losses(full) == losses(cut) and len(losses(full)) > 2


# ---------------------------------------------------------------------------------- face and seg
def test_face_training_and_evaluation_steps_on_the_device(tmp_path):
    from repmlp_testdata import FACE_TINY as TINY
    from repmlp_testdata import make_faces as _make_faces

    _make_faces(tmp_path / "train", 4, 6, seed=1)
    lines = [f"train/id{a:02d}/000.png train/id{a:02d}/001.png 1" for a in range(4)]
    lines += [f"train/id{a:02d}/002.png train/id{(a + 1) % 4:02d}/003.png 0" for a in range(4)]
    (tmp_path / "pairs.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    res = run_cli("train", "--task", "face", "--data-dir", tmp_path / "train", "--output", out, "--model",
                  "repmlp_face_resnet", *model_arg_options(TINY), "--img-size", 32, "--batch-size", 8,
                  "--iterations", 6, "--lr-steps", 4, "--device", DEVICE, "--workers", 0)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "-> equivalent" in (out / "report.md").read_text()
    metrics = _json(run_cli("eval", "--task", "face", "--checkpoint", out / "model.safetensors", "--pairs",
                            tmp_path / "pairs.txt", "--folds", 2, "--check-conversion", "--device", DEVICE,
                            "--workers", 0, "--batch-size", 8, "--json"))  # fmt: skip
    # One pair of a fold (4 pairs) may cross the threshold between the forms (see test_face.py).
    assert abs(metrics["verification_accuracy"] - metrics["training_time"]["verification_accuracy"]) <= 0.25


def test_segmentation_training_and_evaluation_steps_on_the_device(tmp_path):
    from repmlp_testdata import SEG_TINY as TINY
    from repmlp_testdata import make_cityscapes as _make_cityscapes

    _make_cityscapes(tmp_path / "city", "train", 4, (64, 96), seed=0)
    _make_cityscapes(tmp_path / "city", "val", 2, (80, 112), seed=1)
    out = tmp_path / "run"
    res = run_cli("train", "--task", "seg", "--data-dir", tmp_path / "city", "--output", out, "--model",
                  "pspnet_repmlp_res50", *model_arg_options(TINY), "--crop-size", 64, "--batch-size", 2,
                  "--iterations", 3, "--device", DEVICE, "--workers", 0)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "-> equivalent" in (out / "report.md").read_text()
    m = _json(run_cli("eval", "--task", "seg", "--checkpoint", out / "model.safetensors", "--data-dir",
                      tmp_path / "city", "--check-conversion", "--device", DEVICE, "--workers", 0,
                      "--json"))  # fmt: skip
    changed = (
        torch.tensor(m["confusion_matrix"]) - torch.tensor(m["training_time"]["confusion_matrix"])
    ).abs()
    assert changed.sum() / 2 <= 0.001 * 2 * 80 * 112  # both forms in full float32: only exact ties may differ


# -------------------------------------------------------------------------------------------- torchrun
TORCHRUN_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
from torch import nn

from repmlp import create_model
from repmlp.cli import main

device = sys.argv[1]
backend = "nccl" if device.startswith("cuda") else "gloo"
if backend == "nccl":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group(backend)
assert dist.get_backend() == backend and dist.get_world_size() == 1
t = torch.ones(3, device=device)
dist.all_reduce(t)
assert t.tolist() == [1.0, 1.0, 1.0]
# One DDP step of a RepMLP model, with SyncBatchNorm on GPUs (what repmlp does with several of them).
model = create_model("repmlp_fmnist", widths=[4, 8])
if backend == "nccl":
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
model = model.to(device)
ids = [torch.cuda.current_device()] if backend == "nccl" else None
ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
loss = ddp(torch.randn(4, 1, 28, 28, device=device)).square().mean()
loss.backward()
assert torch.isfinite(loss) and any(p.grad is not None for p in model.parameters())
dist.destroy_process_group()
print(f"{backend} ok", flush=True)
sys.exit(main(sys.argv[2:]))
"""


def test_torchrun_one_process_with_nccl(tmp_path):
    """``torchrun --nproc_per_node 1``: a process group on NCCL, an all-reduce and a DDP step with
    SyncBatchNorm, then ``repmlp train`` in the same torchrun process (one process: repmlp's single-process
    path, which the report states)."""
    data = make_fashion_mnist(tmp_path / "fmnist", n_train=64, n_test=32)
    (tmp_path / "script.py").write_text(TORCHRUN_SCRIPT)
    out = tmp_path / "run"
    res = _process(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
         str(tmp_path / "script.py"), DEVICE, "train", "--data-dir", str(data), "--model-arg", "widths=[4,8]",
         "--train-limit", "64", "--val-limit", "16", "--batch-size", "16", "--epochs", "1", "--device", DEVICE,
         "--compile", "off", "--no-bench", "--no-export", "--workers", "0", "--output", str(out)],
        subprocess_env(),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("nccl ok" if ON_GPU else "gloo ok") in res.stdout
    assert "- Replicas: 1 process(es)" in (out / "report.md").read_text()
