"""A deployed model run by ONNX Runtime or OpenVINO instead of PyTorch: ``--runtime`` of bench and predict.

:func:`to_runtime` exports the model to ONNX and wraps the graph in a :class:`RuntimeModel`, a module that
feeds float32 ``(N, C, H, W)`` batches to the runtime's CPU engine and returns a tensor (an int8 model is a
``RuntimeModel`` already). onnxruntime runs one session with all graph optimizations (dynamic batch);
OpenVINO compiles the graph once per input shape, in float32 unless the graph is int8 (on CPUs with bf16
units it would otherwise run float32 graphs in bf16 unasked).
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from repmlp.deploy.export import DEFAULT_RTOL, ExportError, _check_close, _example, export_onnx
from repmlp.errors import UserError
from repmlp.numerics import full_float32

__all__ = ["RUNTIMES", "ONNX_RUNTIMES", "RuntimeModel", "missing_runtime", "to_runtime", "onnx_bytes_of"]

ONNX_RUNTIMES = ("onnxruntime", "openvino")
RUNTIMES = ("torch", *ONNX_RUNTIMES)
# runtime -> (the repmlp extra that installs it, the packages it needs: the exporter's and its own)
_EXTRAS = {
    "onnxruntime": ("export", ("onnx", "onnxscript", "onnxruntime")),
    "openvino": ("openvino", ("onnx", "onnxscript", "openvino")),
}


class RuntimeModel(nn.Module):
    """An ONNX graph run on the CPU by onnxruntime or OpenVINO: ``(N, C, H, W)`` float32 -> the graph's first
    output (logits ``(N, K)``) on the input's device (a ``meta`` input: a ``meta`` output, for
    :func:`repmlp.profile`). Not trainable. The graph's bytes live in the ``onnx`` buffer (``uint8``), so a
    model file can hold them; the engine is built from them at once, and again after a copy, unpickling or
    a ``load_state_dict`` of other bytes. ``threads``: intra-op threads (default
    ``torch.get_num_threads()``); ``int8``: the graph is quantized (OpenVINO picks its own precision);
    ``bf16``: OpenVINO runs the float32 graph in bfloat16 (its inference precision; onnxruntime has no such
    setting).
    """

    def __init__(self, onnx: bytes | Tensor, runtime: str = "onnxruntime", *, threads: int | None = None,
                 int8: bool = False, bf16: bool = False) -> None:  # fmt: skip
        super().__init__()
        if runtime not in ONNX_RUNTIMES:
            raise ValueError(f"RuntimeModel runs onnxruntime or openvino, not {runtime!r}")
        if bf16 and (runtime != "openvino" or int8):
            raise ValueError("bf16 is OpenVINO's inference precision for a float32 graph")
        data = onnx if isinstance(onnx, Tensor) else torch.frombuffer(bytearray(onnx), dtype=torch.uint8)
        self.register_buffer("onnx", data.detach().clone())
        self.runtime, self.threads = runtime, threads or torch.get_num_threads()
        self.int8, self.bf16 = int8, bf16
        self._drop_engines()
        self._build_engine()
        self.register_load_state_dict_post_hook(_graph_loaded)

    def extra_repr(self) -> str:
        return f"runtime={self.runtime}, threads={self.threads}, int8={self.int8}, bf16={self.bf16}"

    def _drop_engines(self) -> None:
        self._built_from: bytes | None = None  # the graph bytes the engines below were built from
        self._session = None  # onnxruntime.InferenceSession
        self._ov_model = None  # openvino.Model, read once ...
        self._engines: dict[tuple[int, ...], object] = {}  # ... and compiled per input shape

    def _build_engine(self) -> None:
        raw = self.onnx.cpu().numpy().tobytes()
        if self.runtime == "onnxruntime":
            import onnxruntime as ort  # optional: the repmlp[export] extra

            opts = ort.SessionOptions()
            opts.intra_op_num_threads, opts.inter_op_num_threads = self.threads, 1
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            self._session = ort.InferenceSession(raw, opts, providers=["CPUExecutionProvider"])
        else:
            import openvino as ov  # optional: the repmlp[openvino] extra

            with tempfile.TemporaryDirectory(prefix="repmlp-ov-") as tmp:
                path = Path(tmp) / "model.onnx"
                path.write_bytes(raw)
                self._ov_model = ov.Core().read_model(str(path))
        self._built_from = raw

    def __getstate__(self) -> dict:
        # Engines cannot be pickled (deepcopy, DataLoader workers): rebuilt from the bytes on first use.
        return {**self.__dict__, "_built_from": None, "_session": None, "_ov_model": None, "_engines": {}}

    def _openvino_engine(self, shape: tuple[int, ...]):  # noqa: ANN202 - openvino.InferRequest
        engine = self._engines.get(shape)
        if engine is None:
            import openvino as ov  # optional: the repmlp[openvino] extra

            model = self._ov_model.clone()
            model.reshape({model.inputs[0].get_any_name(): ov.PartialShape(list(shape))})
            config = {"INFERENCE_NUM_THREADS": self.threads, "PERFORMANCE_HINT": "LATENCY"}
            if not self.int8:
                config["INFERENCE_PRECISION_HINT"] = "bf16" if self.bf16 else "f32"
            engine = self._engines[shape] = (
                ov.Core().compile_model(model, "CPU", config).create_infer_request()
            )
        return engine

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The graph's first output shape without the batch (static in the graphs repmlp exports)."""
        if self._built_from is None:
            self._build_engine()
        if self._session is not None:
            return tuple(int(d) for d in self._session.get_outputs()[0].shape[1:])
        return tuple(d.get_length() for d in self._ov_model.outputs[0].get_partial_shape()[1:])

    def run(self, x: np.ndarray) -> np.ndarray:
        """The graph's first output for a float32 batch ``x`` ``(N, C, H, W)``."""
        if self._built_from is None:
            self._build_engine()
        if self._session is not None:
            return self._session.run(None, {self._session.get_inputs()[0].name: x})[0]
        engine = self._openvino_engine(tuple(x.shape))
        engine.infer({0: x})
        return engine.get_output_tensor(0).data.copy()

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type == "meta":  # shape-only passes: no graph to run
            return torch.empty(x.shape[0], *self.out_shape, device="meta")
        batch = np.ascontiguousarray(x.detach().float().cpu().numpy())
        return torch.from_numpy(np.asarray(self.run(batch))).to(x.device)


def _graph_loaded(module: RuntimeModel, incompatible_keys: object) -> None:
    """``load_state_dict`` post-hook: engines built from other bytes than the buffer's are dropped."""
    if module._built_from is not None and module._built_from != module.onnx.cpu().numpy().tobytes():
        module._drop_engines()


def missing_runtime(runtime: str) -> str | None:
    """Why ``runtime`` cannot run here (one line naming the extra to install), or ``None`` when it can."""
    if runtime not in RUNTIMES:
        return f"unknown runtime {runtime!r} (choose from {', '.join(RUNTIMES)})"
    if runtime == "torch":
        return None
    extra, packages = _EXTRAS[runtime]
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return (
        f"--runtime {runtime} needs {', '.join(missing)}: pip install 'repmlp[{extra}]'" if missing else None
    )


def onnx_bytes_of(model: nn.Module, input_size: Sequence[int]) -> tuple[bytes, bool]:
    """``(ONNX graph, is int8)`` of a deployed ``model``: a :class:`RuntimeModel`'s graph, else a float32
    export. A :class:`UserError` for a bf16/fp16 model (runtimes choose their precision) or a failed export."""
    if isinstance(model, RuntimeModel):  # already a graph (an int8 model): as it is
        return model.onnx.cpu().numpy().tobytes(), model.int8
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    if dtype != torch.float32:
        precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
        raise UserError(f"a {precision} model runs in PyTorch only; export the fp32 or int8 model instead")
    with tempfile.TemporaryDirectory(prefix="repmlp-runtime-") as tmp:
        path = Path(tmp) / "model.onnx"
        try:
            export_onnx(model, path, input_size)
        except ExportError as exc:
            raise UserError(f"cannot run {type(model).__name__} outside PyTorch: {exc}") from None
        if any(p.name != path.name for p in Path(tmp).iterdir()):  # external weights (over 2 GB): no bytes
            raise UserError(f"{type(model).__name__} is too large for an in-memory ONNX graph")
        return path.read_bytes(), False


def to_runtime(model: nn.Module, runtime: str, input_size: Sequence[int], *, threads: int | None = None,
               ) -> nn.Module:  # fmt: skip
    """``model`` (deployed, eval mode) ready to run in ``runtime``: itself for ``torch``, else a
    :class:`RuntimeModel` of its ONNX graph, float graphs checked against PyTorch (int8 graphs round
    differently in each runtime). A :class:`UserError` when the runtime is not installed (naming the extra)
    or the model cannot be exported or reproduced there."""
    if runtime == "torch":
        return model
    reason = missing_runtime(runtime)
    if reason is not None:
        raise UserError(reason)
    onnx, int8 = onnx_bytes_of(model, input_size)
    wrapped = RuntimeModel(onnx, runtime, threads=threads, int8=int8)
    if hasattr(model, "metadata"):
        wrapped.metadata = model.metadata
    if not int8 and runtime != "onnxruntime":  # export_onnx already checked onnxruntime's output
        x = _example(input_size, 3, seed=1)
        with torch.inference_mode(), full_float32():
            try:
                _check_close(wrapped.runtime, wrapped(x), model(x), DEFAULT_RTOL)
            except ExportError as exc:
                raise UserError(f"{wrapped.runtime} does not reproduce PyTorch: {exc}") from None
    return wrapped
