"""An ONNX graph as a module: :class:`RuntimeModel`, run by onnxruntime or OpenVINO on the CPU.

The one wrapper of an ONNX graph in an inference engine: ``--runtime`` of bench and predict
(:func:`repmlp.deploy.runtimes.to_runtime`) wraps a deployed model's exported graph in it, and an int8
model (:class:`repmlp.deploy.precision.Int8OnnxModel`) is one whose graph is quantized. A module of its own
so that both of those import it without importing each other.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["ONNX_RUNTIMES", "RuntimeModel"]

ONNX_RUNTIMES = ("onnxruntime", "openvino")


class RuntimeModel(nn.Module):
    """An ONNX graph run on the CPU by onnxruntime or OpenVINO: ``(N, C, H, W)`` float32 -> the graph's
    first output (logits ``(N, K)``): the one wrapper of an ONNX graph as a module, for ``--runtime`` and
    for int8 models (:class:`repmlp.deploy.precision.Int8OnnxModel` is this with onnxruntime).

    The graph's bytes live in the ``onnx`` buffer (``uint8``), so ``state_dict`` round-trips them (a model
    file can hold the graph); the runtime's engine is built from them at once (bytes that are no graph
    fail here, not at the first batch), and again after a copy, unpickling or a ``load_state_dict`` that
    brought other bytes (an engine cannot be copied). Inputs on any device run on the CPU; the output
    (float32) comes back on the input's device; a ``meta`` input gives a ``meta`` output of the graph's
    output shape (shape-only passes: :func:`repmlp.profile`). Not trainable.

    ``threads``: intra-op threads (default: ``torch.get_num_threads()`` now); ``int8``: the graph is
    quantized (OpenVINO then picks its own precision; a float graph runs in float32 even on bf16 CPUs).
    """

    def __init__(
        self,
        onnx: bytes | Tensor,
        runtime: str = "onnxruntime",
        *,
        threads: int | None = None,
        int8: bool = False,
    ) -> None:
        super().__init__()
        if runtime not in ONNX_RUNTIMES:
            raise ValueError(f"RuntimeModel runs onnxruntime or openvino, not {runtime!r}")
        data = onnx if isinstance(onnx, Tensor) else torch.frombuffer(bytearray(onnx), dtype=torch.uint8)
        self.register_buffer("onnx", data.detach().clone())
        self.runtime = runtime
        self.threads = threads or torch.get_num_threads()
        self.int8 = int8
        self._drop_engines()
        self._build_engine()
        self.register_load_state_dict_post_hook(_graph_loaded)

    def extra_repr(self) -> str:
        return f"runtime={self.runtime}, threads={self.threads}, int8={self.int8}"

    def _drop_engines(self) -> None:
        self._built_from: bytes | None = None  # the graph bytes the engines below were built from
        self._session = None  # onnxruntime.InferenceSession
        self._ov_model = None  # openvino.Model, read once ...
        self._engines: dict[tuple[int, ...], object] = {}  # ... and compiled per input shape

    def _build_engine(self) -> None:
        raw = self.onnx.cpu().numpy().tobytes()
        if self.runtime == "onnxruntime":
            self._session = self._ort_session(raw)
        else:
            self._ov_model = self._read_openvino(raw)
        self._built_from = raw

    def __getstate__(self) -> dict:
        # Engines cannot be pickled (deepcopy, DataLoader workers): rebuilt from the bytes on first use.
        state = self.__dict__.copy()
        state.update(_built_from=None, _session=None, _ov_model=None, _engines={})
        return state

    def _ort_session(self, raw: bytes):  # noqa: ANN202 - onnxruntime.InferenceSession
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        return ort.InferenceSession(raw, opts, providers=["CPUExecutionProvider"])

    def _read_openvino(self, raw: bytes):  # noqa: ANN202 - openvino.Model
        import openvino as ov

        with tempfile.TemporaryDirectory(prefix="repmlp-ov-") as tmp:
            path = Path(tmp) / "model.onnx"
            path.write_bytes(raw)
            return ov.Core().read_model(str(path))

    def _openvino_engine(self, shape: tuple[int, ...]):  # noqa: ANN202 - openvino.InferRequest
        engine = self._engines.get(shape)
        if engine is None:
            import openvino as ov

            model = self._ov_model.clone()
            model.reshape({model.inputs[0].get_any_name(): ov.PartialShape(list(shape))})
            config = {"INFERENCE_NUM_THREADS": self.threads, "PERFORMANCE_HINT": "LATENCY"}
            if not self.int8:
                config["INFERENCE_PRECISION_HINT"] = "f32"
            engine = ov.Core().compile_model(model, "CPU", config).create_infer_request()
            self._engines[shape] = engine
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
    """``load_state_dict`` post-hook: engines built from other bytes than the ``onnx`` buffer now holds
    are dropped (rebuilt on first use)."""
    if module._built_from is not None and module._built_from != module.onnx.cpu().numpy().tobytes():
        module._drop_engines()
