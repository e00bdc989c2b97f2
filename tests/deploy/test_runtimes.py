"""Deployed models run by ONNX Runtime and OpenVINO (``repmlp.deploy.runtimes``, ``--runtime`` of bench/predict).

What the code guarantees: the wrapped graph gives PyTorch's logits (float32, within the export check's
tolerance) at any batch size, an int8 graph runs as it is, a runtime that is not installed is one error
line naming the extra, and the commands run through the real entry point. OpenVINO tests skip where the
optional ``openvino`` package is missing, and run in a pytest process of their own
(``test_openvino_tests_in_their_own_process``): with OpenVINO's CPU plugin loaded, a later PyTorch training
test of the suite crashed the process (seen in two runs, torch 2.14.1, OpenVINO 2026.4.1).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import repmlp
from repmlp.deploy.runtimes import RuntimeModel, missing_runtime, onnx_bytes_of, to_runtime
from repmlp.errors import UserError
from repmlp.io.model_file import save_model
from repmlp_testdata import run_cli, subprocess_env, user_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "repmlp_fmnist"
KWARGS = {"widths": [4, 8], "kernel_sizes": [1, 3]}
SIZE = (1, 28, 28)
HAS_OPENVINO = importlib.util.find_spec("openvino") is not None
OPENVINO_PROCESS = os.environ.get("REPMLP_TEST_OPENVINO") == "1"  # set by the test that starts that process
ONNX_RUNTIMES = [
    "onnxruntime",
    pytest.param(
        "openvino",
        marks=[
            pytest.mark.skipif(not HAS_OPENVINO, reason="openvino not installed"),
            pytest.mark.skipif(
                not OPENVINO_PROCESS, reason="run by test_openvino_tests_in_their_own_process"
            ),
        ],
    ),
]


@pytest.mark.skipif(not HAS_OPENVINO or OPENVINO_PROCESS, reason="openvino not installed")
@pytest.mark.slow  # a pytest process that imports torch and OpenVINO
def test_openvino_tests_in_their_own_process():
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "openvino"],
        capture_output=True,
        text=True,
        timeout=600,
        env=subprocess_env(REPMLP_TEST_OPENVINO="1"),
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "4 passed" in res.stdout, res.stdout[-1000:]  # the four openvino cases, not skipped


def deployed(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = repmlp.create_model(NAME, **KWARGS)
    for m in model.modules():  # statistics that make the conversion and the outputs non-trivial
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.3, 0.3)
            m.running_var.uniform_(0.5, 2.0)
    return repmlp.reparameterize_model(model.eval())


@pytest.mark.parametrize("runtime", ONNX_RUNTIMES)
def test_runtime_model_gives_pytorchs_logits_at_every_batch_size(runtime):
    model = deployed()
    wrapped = to_runtime(model, runtime, SIZE)
    assert isinstance(wrapped, RuntimeModel) and wrapped.runtime == runtime
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for batch in (1, 5, 1):  # OpenVINO compiles per shape: a shape seen before reuses its engine
            x = torch.randn(batch, *SIZE, generator=gen)
            got, ref = wrapped(x), model(x)
            assert got.dtype == torch.float32 and got.shape == ref.shape
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    if runtime == "openvino":
        # to_runtime's check ran batch 3; batches 1 and 5 added one engine each, the second 1 none.
        assert sorted(shape[0] for shape in wrapped._engines) == [1, 3, 5]


@pytest.mark.parametrize("runtime", ONNX_RUNTIMES[1:])
def test_openvino_runs_a_float_graph_in_bf16(runtime):
    """bf16: OpenVINO's inference precision for a float32 graph (where the CPU has no bf16, float32): the
    logits within bf16's rounding (8 bits of mantissa) of PyTorch's float32 ones; no such setting elsewhere."""
    model = deployed()
    graph, _ = onnx_bytes_of(model, SIZE)
    x = torch.randn(4, *SIZE, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        torch.testing.assert_close(RuntimeModel(graph, runtime, bf16=True)(x), model(x), rtol=0.05, atol=0.05)
    for other in ({"runtime": "onnxruntime"}, {"runtime": runtime, "int8": True}):
        with pytest.raises(ValueError, match="bf16 is OpenVINO's inference precision for a float32 graph"):
            RuntimeModel(graph, bf16=True, **other)


def test_torch_runtime_is_the_model_itself():
    model = deployed()
    assert to_runtime(model, "torch", SIZE) is model


@pytest.mark.parametrize("runtime", ONNX_RUNTIMES)
@pytest.mark.slow
def test_int8_graph_runs_as_it_is(runtime):
    """An int8 model's own QDQ graph goes to the runtime: onnxruntime gives the int8 model's own logits."""
    model = deployed()
    gen = torch.Generator().manual_seed(1)
    int8 = repmlp.to_precision(model, "int8", [torch.randn(8, *SIZE, generator=gen)], input_size=SIZE)
    wrapped = to_runtime(int8, runtime, SIZE)
    assert wrapped.int8
    x = torch.randn(4, *SIZE, generator=gen)
    with torch.inference_mode():
        got, ref, fp32 = wrapped(x), int8(x), model(x)
    if runtime == "onnxruntime":
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # Either runtime's int8 kernels stay near the float32 model (a scale of the logits, not bits).
    assert (got - fp32).abs().max() <= 0.1 * fp32.abs().max()


@pytest.mark.slow
def test_one_onnx_wrapper_for_runtimes_and_int8_models():
    """``--runtime``'s wrapper and the int8 model are one class: both keep the graph in the ``onnx`` buffer
    (the state dict round-trips the bytes), survive a copy (the engine is rebuilt), answer shape-only
    passes, and rebuild their engine when ``load_state_dict`` brings another graph."""
    import copy

    from repmlp.deploy.precision import Int8OnnxModel, precision_of

    model = deployed()
    gen = torch.Generator().manual_seed(1)
    int8 = repmlp.to_precision(model, "int8", [torch.randn(8, *SIZE, generator=gen)], input_size=SIZE)
    fp32 = to_runtime(model, "onnxruntime", SIZE)
    assert isinstance(int8, Int8OnnxModel) and isinstance(int8, RuntimeModel) and type(fp32) is RuntimeModel
    assert (int8.runtime, int8.int8, precision_of(int8)) == ("onnxruntime", True, "int8")
    assert (fp32.int8, precision_of(fp32)) == (False, "fp32")
    x = torch.randn(4, *SIZE, generator=gen)
    with torch.inference_mode():
        ref_int8, ref_fp32 = int8(x), fp32(x)
        for wrapper, ref in ((int8, ref_int8), (fp32, ref_fp32)):
            state = wrapper.state_dict()
            assert list(state) == ["onnx"] and state["onnx"].dtype == torch.uint8
            rebuilt = RuntimeModel(state["onnx"], "onnxruntime", int8=wrapper.int8)
            assert torch.equal(rebuilt(x), ref) and torch.equal(copy.deepcopy(wrapper)(x), ref)
            assert wrapper(torch.empty(2, *SIZE, device="meta")).shape == (2, 10)
        # Other bytes loaded: the engine built from the old ones is dropped, the new ones are what runs.
        loaded = Int8OnnxModel(int8.onnx)
        loaded.load_state_dict({"onnx": torch.zeros_like(int8.onnx)})  # no graph at all
        with pytest.raises(Exception, match="(?i)protobuf|invalid|parse|load"):
            loaded(x)
        loaded.load_state_dict(int8.state_dict())
        assert torch.equal(loaded(x), ref_int8)
    with pytest.raises(ValueError, match="onnxruntime or openvino"):
        RuntimeModel(fp32.onnx, "torch")


@pytest.mark.slow
def test_int8_fc3_runs_as_an_int8_matmul(tmp_path):
    """onnxruntime fuses every FC3 of the int8 graph (one per RepMLP block) into its int8 matmul kernel,
    with int8 weights: no float MatMul is left behind a weight dequantizer running on every call."""
    import onnx
    import onnxruntime as ort

    from repmlp.nn.block import RepMLPBlock

    model = deployed()
    blocks = [m for m in model.modules() if isinstance(m, RepMLPBlock)]
    gen = torch.Generator().manual_seed(1)
    int8 = repmlp.to_precision(model, "int8", [torch.randn(8, *SIZE, generator=gen)], input_size=SIZE)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(int8.onnx.numpy().tobytes(), opts, providers=["CPUExecutionProvider"])
    graph = onnx.load(str(tmp_path / "optimized.onnx")).graph
    ops = [n.op_type for n in graph.node]
    assert "MatMul" not in ops
    # FC3's weights are the batched (g, P/g, Q/g) ones; the one-channel stem is a matmul too.
    batched = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 3}
    fused = [n for n in graph.node if n.op_type == "QLinearMatMul" and n.input[3] in batched]
    assert len(fused) == len(blocks)


@pytest.mark.slow
def test_int8_fc3_forms_of_quantize_int8():
    """The two other int8 forms of FC3 bench_runtimes compares: left in float32 (a float MatMul on its 3-D
    weight, every convolution still int8), and one int8 product per group (no 3-D weight left); both give
    the float model's logits within int8's rounding."""
    import onnx

    from repmlp.deploy.precision import quantize_int8

    model = deployed()
    gen = torch.Generator().manual_seed(1)
    calibration = [torch.randn(8, *SIZE, generator=gen)]
    x = torch.randn(4, *SIZE, generator=gen)
    for fc3 in ("float", "per_group"):
        int8 = quantize_int8(model, SIZE, calibration, fc3=fc3)
        graph = onnx.load_from_string(int8.onnx.numpy().tobytes()).graph
        weights = {t.name: (t.data_type, len(t.dims)) for t in graph.initializer}
        matmul_weights = [weights.get(n.input[1]) for n in graph.node if n.op_type == "MatMul"]
        if fc3 == "float":
            assert (onnx.TensorProto.FLOAT, 3) in matmul_weights
        else:
            assert all(rank != 3 for _, rank in weights.values())
        assert any(n.op_type == "QuantizeLinear" for n in graph.node)
        with torch.inference_mode():
            ref = model(x)
            assert (int8(x) - ref).abs().max() <= 0.2 * ref.abs().max()
    with pytest.raises(ValueError, match="fc3 must be"):
        quantize_int8(model, SIZE, calibration, fc3="int4")


@pytest.mark.slow
def test_float_graph_has_fc3_as_constant_2d_products(tmp_path):
    """The float graph the runtimes run holds FC3 as one product per group on a constant 2-D weight (which
    onnxruntime pre-packs once at load), after onnxruntime's optimizations: no batched MatMul is left."""
    import onnx
    import onnxruntime as ort

    from repmlp.nn.block import RepMLPBlock

    model = deployed()
    groups = sum(m.groups for m in model.modules() if isinstance(m, RepMLPBlock))
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    wrapped = to_runtime(model, "onnxruntime", SIZE)  # checked against PyTorch
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(wrapped.onnx.numpy().tobytes(), opts, providers=["CPUExecutionProvider"])
    graph = onnx.load(str(tmp_path / "optimized.onnx")).graph
    ranks = {t.name: len(t.dims) for t in graph.initializer}
    assert not [n for n in graph.node if n.op_type == "MatMul" and ranks.get(n.input[1]) == 3]
    products = [n for n in graph.node if n.op_type in ("Gemm", "FusedGemm") and ranks.get(n.input[1]) == 2]
    assert len(products) == groups + linears


def test_reduced_float_precision_is_refused():
    model = repmlp.to_precision(deployed(), "bf16")
    with pytest.raises(UserError, match="PyTorch only"):
        to_runtime(model, "onnxruntime", SIZE)


def test_missing_runtime_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "openvino" else real(n, *a))
    assert missing_runtime("torch") is None
    assert "pip install 'repmlp[openvino]'" in missing_runtime("openvino")
    with pytest.raises(UserError, match=r"repmlp\[openvino\]"):
        to_runtime(deployed(), "openvino", SIZE)


@pytest.mark.parametrize("runtime", ONNX_RUNTIMES)
def test_bench_runtime_through_the_entry_point(runtime, monkeypatch):
    res = run_cli("-q", "bench", "--model", NAME, "--batch-size", "2", "--forms", "deploy",
                  "--warmup", "0", "--repeats", "1", "--runtime", runtime)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert f"run by {runtime}" in res.stdout and f"| {NAME} | deploy |" in res.stdout
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "openvino" else real(n, *a))
    res = run_cli("bench", "--model", NAME, "--runtime", "openvino")
    assert res.returncode == 2
    assert "repmlp[openvino]" in user_error_line(res.stderr)


@pytest.mark.slow
def test_predict_runtime_gives_the_same_top_k(tmp_path):
    """``repmlp predict --runtime onnxruntime`` on a training-time file: converted, exported, and the same
    classes and probabilities (to the export check's tolerance) as PyTorch."""
    from PIL import Image

    torch.manual_seed(0)
    model = repmlp.create_model(NAME, **KWARGS).eval()
    save_model(tmp_path / "model.safetensors", model, name=NAME, model_kwargs=KWARGS, form="train")
    gen = torch.Generator().manual_seed(0)
    for i in range(6):
        pixels = (torch.rand(28, 28, generator=gen) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(tmp_path / f"{i}.png")
    got = {}
    for runtime in ("torch", "onnxruntime"):
        out = tmp_path / f"{runtime}.jsonl"
        res = run_cli("predict", "--checkpoint", tmp_path / "model.safetensors", *sorted(tmp_path.glob("*.png")),
                      "--runtime", runtime, "--workers", "0", "--top-k", "3", "--output", out)  # fmt: skip
        assert res.returncode == 0, res.stderr
        got[runtime] = [line for line in out.read_text().splitlines() if line]
    import json

    for a, b in zip(got["torch"], got["onnxruntime"], strict=True):
        a, b = json.loads(a), json.loads(b)
        assert [t["index"] for t in a["top_k"]] == [t["index"] for t in b["top_k"]]
        for ta, tb in zip(a["top_k"], b["top_k"], strict=True):
            assert abs(ta["probability"] - tb["probability"]) < 1e-4
