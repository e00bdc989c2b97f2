"""Reduced-precision deployment: a deployed model in float32, bfloat16, float16 or int8.

* ``fp32`` / ``bf16`` / ``fp16``: the deployed model's parameters cast to that dtype; a forward
  pre-hook casts the input to it, so callers keep feeding float32 images. Logits come out in that dtype.
* ``int8``: post-training static quantization with onnxruntime (``onnxruntime.quantization``,
  maintained by Microsoft and already a dependency of ``repmlp export``): the deployed model is
  exported to ONNX, its activation ranges are calibrated (min/max) on batches of the run's training
  data, and weights are quantized per output channel to int8 (activations uint8, QDQ format; FC3's
  batched weight with one scale, so that runtimes run it with their int8 matmul kernel). The
  result is an :class:`Int8OnnxModel`, a module that runs the quantized graph with onnxruntime on
  the CPU and keeps the ONNX bytes in a ``uint8`` buffer, so it saves to and loads from safetensors
  like any other model (the ONNX wrapper of ``--runtime``, :class:`repmlp.deploy.onnx_model.RuntimeModel`).

Why onnxruntime and not torchao or PyTorch's PT2E quantizer: both produce graph modules whose
quantized weights are tied to a traced program (torchao's tensor subclasses need pickling or its own
safetensors layer; a PT2E program must be re-exported and re-calibrated on load), while the ONNX
int8 graph is one self-contained byte string that onnxruntime runs with its VNNI/AVX-512 int8 kernels.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from repmlp.deploy.onnx_model import RuntimeModel
from repmlp.models.file_metadata import PRECISIONS
from repmlp.models.model_file import register_precision_loader

__all__ = [
    "PRECISIONS",
    "DTYPES",
    "to_precision",
    "precision_of",
    "native_support",
    "Int8OnnxModel",
    "quantize_int8",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _cast_input(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook: floating-point inputs take the dtype of the module's first parameter."""
    param = next(module.parameters(), None)
    if param is None or not args or not isinstance(args[0], Tensor) or not args[0].is_floating_point():
        return args
    return (args[0].to(param.dtype), *args[1:])


def _float_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    model = model.to(dtype)
    if not getattr(model, "_repmlp_casts_input", False):
        model.register_forward_pre_hook(_cast_input)
        model._repmlp_casts_input = True
    return model


def precision_of(model: nn.Module) -> str:
    """``"int8"`` for an int8 ONNX graph (an :class:`Int8OnnxModel`, or one ``--runtime`` runs), else the
    precision of the first parameter's dtype."""
    if isinstance(model, RuntimeModel) and model.int8:
        return "int8"
    param = next(model.parameters(), None)
    dtype = torch.float32 if param is None else param.dtype
    return next((p for p, d in DTYPES.items() if d == dtype), str(dtype))


class Int8OnnxModel(RuntimeModel):
    """An int8 (QDQ) ONNX graph run by onnxruntime on the CPU; ``(N, C, H, W)`` -> ``(N, classes)``.

    :class:`repmlp.deploy.onnx_model.RuntimeModel` with onnxruntime, marked int8: the ONNX bytes live in the
    ``onnx`` buffer (``uint8``), so ``state_dict`` round-trips them and a model file holds the graph.
    Inputs on any device are run on the CPU and the logits returned (float32) on the input's device.
    """

    def __init__(self, onnx_bytes: bytes | Tensor, *, threads: int | None = None) -> None:
        super().__init__(onnx_bytes, "onnxruntime", threads=threads, int8=True)


def quantize_int8(
    model: nn.Module, input_size: Sequence[int], calibration: Iterable[Tensor], *, per_channel: bool = True
) -> Int8OnnxModel:
    """Post-training static int8 quantization of a deployed float model with onnxruntime.

    Args:
        model: the deployed model (float32; a copy is exported, the model is not changed).
        input_size: ``(C, H, W)``.
        calibration: batches ``(N, C, H, W)`` of representative inputs (the run's training images).

    Raises:
        ValueError: no calibration batch.
    """
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from repmlp.deploy.export import export_onnx

    batches = [np.ascontiguousarray(x.detach().float().cpu().numpy()) for x in calibration]
    if not batches:
        raise ValueError("int8 quantization needs calibration data (at least one batch)")

    class _Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter(batches)

        def get_next(self) -> dict[str, np.ndarray] | None:
            x = next(self._it, None)
            return None if x is None else {"input": x}

    with tempfile.TemporaryDirectory(prefix="repmlp-int8-") as tmp:
        fp32, pre, q8 = (Path(tmp) / n for n in ("fp32.onnx", "pre.onnx", "int8.onnx"))
        export_onnx(model, fp32, input_size, check=False)
        quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=True)
        quantize_static(
            str(pre),
            str(q8),
            _Reader(),
            quant_format=QuantFormat.QDQ,
            per_channel=per_channel,
            weight_type=QuantType.QInt8,
            activation_type=QuantType.QUInt8,
            calibrate_method=CalibrationMethod.MinMax,
            extra_options={"TensorQuantOverrides": _per_tensor_batched_weights(pre)},
        )
        return Int8OnnxModel(q8.read_bytes())


def _per_tensor_batched_weights(path: Path) -> dict[str, list[dict]]:
    """Quantization overrides: one scale for each constant 3-D ``MatMul`` weight (FC3's ``(g, P/g, Q/g)``).

    Per-channel scales on a batched weight keep the runtime from fusing the ``MatMul`` into its int8 kernel
    (``QLinearMatMul``): onnxruntime would dequantize the weight to float32 on every run instead.
    """
    import onnx
    from onnxruntime.quantization import QuantType

    graph = onnx.load(str(path), load_external_data=False).graph
    ranks = {t.name: len(t.dims) for t in graph.initializer}
    batched = {n.input[1] for n in graph.node if n.op_type == "MatMul" and ranks.get(n.input[1]) == 3}
    return {name: [{"quant_type": QuantType.QInt8, "symmetric": True}] for name in sorted(batched)}


def to_precision(
    model: nn.Module,
    precision: str,
    calibration: Iterable[Tensor] | None = None,
    *,
    input_size: Sequence[int] | None = None,
) -> nn.Module:
    """The deployed ``model`` in ``precision`` (one of :data:`PRECISIONS`).

    ``fp32``/``bf16``/``fp16`` cast ``model`` in place (and return it); ``int8`` returns a new
    :class:`Int8OnnxModel` and needs ``calibration`` batches and ``input_size`` ``(C, H, W)``.

    Raises:
        ValueError: unknown precision, or int8 without calibration data / input size.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})")
    if precision != "int8":
        return _float_model(model, DTYPES[precision])
    if calibration is None or input_size is None:
        raise ValueError("int8 quantization needs calibration data and the input size")
    return quantize_int8(model.float().eval(), input_size, calibration)


def native_support(precision: str) -> str | None:
    """Why this CPU has no native support for ``precision`` (a reason), or ``None`` when it has.

    bfloat16 matmuls are native with AVX512_BF16 or AMX, float16 with AVX512_FP16 or AMX-FP16; without
    them PyTorch still runs the model, by converting (slower than float32).
    """
    if precision in ("fp32", "int8"):
        return None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        return None
    need = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}[precision]
    if any(f in flags for f in need):
        return None
    return f"this CPU lacks {' and '.join(need)}: {precision} runs emulated, likely slower than fp32"


# Model files in a reduced precision are rebuilt by these (repmlp.models.model_file reads the files).
register_precision_loader("int8", lambda onnx: Int8OnnxModel(onnx))
for _precision, _dtype in DTYPES.items():
    if _precision != "fp32":
        register_precision_loader(_precision, lambda model, dtype=_dtype: _float_model(model, dtype))
