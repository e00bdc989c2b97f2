"""Reduced-precision deployment (``repmlp convert --precision``) through the real entry point.

A tiny ``repmlp_fmnist`` saved with ``save_model`` and a generated Fashion-MNIST stand in for a run.
Each precision is converted once (module fixture) and the commands run in this process through
:func:`repmlp.cli.main`; one ``eval`` of the int8 file runs as a real ``python -m repmlp`` process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import repmlp
from repmlp.bench.counts import profile_model
from repmlp.deploy.precision import Int8OnnxModel, precision_of, to_precision
from repmlp.io.model_file import CheckpointError, load_model, read_metadata, save_model
from repmlp_testdata import make_fashion_mnist, run_cli, subprocess_env, user_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "repmlp_fmnist"
KWARGS = {"widths": [4, 8], "kernel_sizes": [1, 3]}


cli = run_cli  # repmlp.cli.main in this process


def subprocess_cli(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "repmlp", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=subprocess_env(),
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("run")
    data = make_fashion_mnist(root / "fmnist", n_train=64, n_test=40)
    torch.manual_seed(0)
    model = repmlp.create_model(NAME, **KWARGS).eval()
    extra = {"dataset": "fashion-mnist", "data_dir": str(data)}
    save_model(root / "model.safetensors", model, name=NAME, model_kwargs=KWARGS, form="train", extra=extra)
    save_model(root / "nodata.safetensors", model, name=NAME, model_kwargs=KWARGS, form="train")
    assert cli("convert", "--checkpoint", root / "model.safetensors", "--num-examples", 8).returncode == 0
    return root


@pytest.fixture(scope="module")
def converted(run_dir: Path):
    """``convert(precision)``: ``repmlp convert --precision`` of the fp32 run, run once per precision;
    returns the output path and the command's result."""
    done: dict[str, tuple[Path, object]] = {}

    def convert(precision: str):
        if precision not in done:  # the default name, as the README's convert lines run in order
            res = cli("convert", "--checkpoint", run_dir / "model.safetensors", "--precision", precision)
            done[precision] = (run_dir / f"deploy-{precision}.safetensors", res)
        return done[precision]

    return convert


# int8 calibrates, quantises and times an onnxruntime session: the slow tier (its graph and metadata stay fast).
@pytest.mark.parametrize("precision", ["bf16", "fp16", pytest.param("int8", marks=pytest.mark.slow)])
def test_convert_eval_bench_in_precision(run_dir: Path, converted, precision: str) -> None:
    fp32_deploy = (run_dir / "deploy.safetensors").read_bytes()
    out, res = converted(precision)
    assert res.returncode == 0, res.stderr
    assert f"{precision}: max abs logit change vs float32" in res.stdout
    # Its own default name: the run's float32 deploy.safetensors stays, and loads into deploy=True as before.
    assert (run_dir / "deploy.safetensors").read_bytes() == fp32_deploy
    assert load_model(run_dir / "deploy.safetensors", form="deploy").metadata.precision == "fp32"
    assert read_metadata(out)["precision"] == precision
    model = load_model(out)
    assert model.metadata.precision == precision and precision_of(model) == precision
    if precision == "int8":
        assert isinstance(model, Int8OnnxModel)
    fp32 = run_dir / "model.safetensors"
    assert out.stat().st_size < fp32.stat().st_size * (0.4 if precision == "int8" else 0.6)

    res = cli("eval", "--checkpoint", out, "--workers", 0, "--json")
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["precision"] == precision and result["n"] == 40
    if precision == "int8":  # one end-to-end run in a fresh process: the ONNX model loads there too
        proc = subprocess_cli("eval", "--checkpoint", out, "--workers", 0, "--json")
        assert proc.returncode == 0, proc.stderr
        fresh = json.loads(proc.stdout.strip().splitlines()[-1])
        assert fresh.keys() == result.keys() and fresh["precision"] == precision and fresh["n"] == 40
        assert fresh["loss"] == pytest.approx(result["loss"], rel=1e-4)

    res = cli("bench", "--checkpoint", out, "--batch-size", 2, "--warmup", 0, "--repeats", 1)
    assert res.returncode == 0, res.stderr
    assert f"input 1x28x28, {precision}," in res.stdout
    # Parameters and MACs of the deployed structure the file holds, in any precision (an int8 graph has
    # no PyTorch parameters: its counts are the structure's, not 0).
    row = next(ln for ln in res.stdout.splitlines() if ln.startswith(f"| {NAME} | deploy"))
    params, macs = (float(c) for c in row.split("|")[4:6])
    want = profile_model(NAME, (28, 28), deploy=True, **KWARGS)
    # The table rounds to 3 decimals below 1M and to 2 above.
    assert params == pytest.approx(want[0] / 1e6, abs=6e-3) and macs == pytest.approx(want[1] / 1e6, abs=6e-3)
    assert params > 0 and macs > 0


def test_int8_exports_its_onnx_graph(converted, tmp_path: Path) -> None:
    src, res = converted("int8")
    assert res.returncode == 0, res.stderr
    onnx_path = tmp_path / "m.onnx"
    res = cli("export", "--checkpoint", src, "--output", onnx_path)
    assert res.returncode == 0, res.stderr
    # The file's own graph, byte for byte.
    assert onnx_path.read_bytes() == load_model(src).onnx.numpy().tobytes()
    # The partition maps' reshapes and transposes move float32 values: no Q/DQ pair between them.
    graph = pytest.importorskip("onnx").load(str(onnx_path)).graph
    made_by = {out: n.op_type for n in graph.node for out in n.output}
    transposes = [n for n in graph.node if n.op_type == "Transpose"]
    assert transposes and all(made_by.get(n.input[0]) == "Reshape" for n in transposes)
    assert sum(n.op_type == "QuantizeLinear" for n in graph.node) > 4  # and the rest is quantized
    res = cli("export", "--checkpoint", src, "--format", "torchscript", "--output", tmp_path / "m.pt")
    assert res.returncode == 2 and "ONNX only" in user_error_line(res.stderr)
    assert not (tmp_path / "m.pt").exists()


def test_int8_file_metadata_and_a_wrong_recorded_input_size(converted, tmp_path: Path) -> None:
    """An int8 file's graph knows its class count (the file records none: the graph is asked), and a
    recorded input size the graph does not take is one error line at loading, not a failure later."""
    src, res = converted("int8")
    assert res.returncode == 0, res.stderr
    model = load_model(src)
    meta = model.metadata
    assert "num_classes" not in meta.model_kwargs
    assert (meta.precision, meta.num_classes, meta.input_size) == ("int8", 10, (1, 28, 28))
    bad = tmp_path / "bad.safetensors"
    save_model(bad, model, name=NAME, model_kwargs=KWARGS, form="deploy", precision="int8",
               extra={**meta.extra, "input_size": [1, 20, 20]})  # fmt: skip
    with pytest.raises(CheckpointError, match="not a batch of 1x20x20 images"):
        load_model(bad)
    res = cli("eval", "--checkpoint", bad, "--workers", 0)
    assert res.returncode == 2 and "not a batch of 1x20x20 images" in user_error_line(res.stderr)


def test_int8_without_calibration_data_writes_nothing(run_dir: Path) -> None:
    out = run_dir / "nodata-int8.safetensors"
    res = cli(
        "convert", "--checkpoint", run_dir / "nodata.safetensors", "--output", out, "--precision", "int8"
    )
    assert res.returncode == 2
    assert "needs calibration data" in user_error_line(res.stderr)
    assert not out.exists() and not list(run_dir.glob(".nodata-int8*"))


def test_bad_precision_is_a_usage_error(run_dir: Path) -> None:
    res = cli("convert", "--checkpoint", run_dir / "model.safetensors", "--precision", "int4")
    assert res.returncode == 2 and "invalid choice: 'int4'" in res.stderr


def test_to_precision_casts_inputs_and_keeps_predictions() -> None:
    torch.manual_seed(0)
    model = repmlp.reparameterize_model(repmlp.create_model(NAME, **KWARGS).eval())
    x = torch.randn(4, 1, 28, 28)
    with torch.inference_mode():
        ref = model(x)
        out = to_precision(model, "bf16")(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)
    with pytest.raises(ValueError, match="calibration"):
        to_precision(model, "int8")
    with pytest.raises(ValueError, match="unknown precision"):
        to_precision(model, "fp8")
