"""Reduced-precision deployment: a deployed model in float32, bfloat16, float16 or int8.

``fp32``/``bf16``/``fp16``: the parameters cast, and a forward pre-hook casting the input (callers keep
feeding float32 images; the logits come in that dtype). ``int8``: onnxruntime's post-training static
quantization of the ONNX export, calibrated (min/max) on the run's training images, weights int8 per output
channel, activations uint8 (QDQ); an :class:`Int8OnnxModel` runs the graph and keeps its bytes in a buffer,
so it saves to and loads from safetensors like any model (torchao's or PT2E's weights are tied to a program
that must be pickled). An int8 model file's graph is checked before it runs (:func:`check_int8_graph`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from repmlp.deploy.export import export_onnx
from repmlp.deploy.runtimes import RuntimeModel
from repmlp.io.model_file import PRECISION_LOADERS, PRECISIONS

__all__ = ["PRECISIONS", "DTYPES", "to_precision", "precision_of", "native_support", "Int8OnnxModel",
           "quantize_int8"]  # fmt: skip

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
    """An int8 (QDQ) ONNX graph run by onnxruntime on the CPU, ``(N, C, H, W)`` -> ``(N, classes)``: a
    :class:`repmlp.deploy.runtimes.RuntimeModel` marked int8 (its bytes in the ``onnx`` buffer)."""

    def __init__(self, onnx_bytes: bytes | Tensor, *, threads: int | None = None) -> None:
        super().__init__(onnx_bytes, "onnxruntime", threads=threads, int8=True)


def quantize_int8(model: nn.Module, input_size: Sequence[int], calibration: Iterable[Tensor], *,
                  per_channel: bool = True, fc3: str = "batched") -> Int8OnnxModel:  # fmt: skip
    """Post-training static int8 quantization of a deployed float32 ``model`` (a copy is exported) with
    onnxruntime, calibrated on ``calibration`` batches ``(N, C, H, W)`` (the run's training images; none is
    a ``ValueError``); ``input_size``: ``(C, H, W)``. ``fc3``: FC3 as one batched int8 product (measured the
    fastest in both runtimes: docs/benchmarks.md), ``"per_group"`` (one 2-D int8 product per group) or
    ``"float"`` (left in float32)."""
    if fc3 not in ("batched", "per_group", "float"):
        raise ValueError(f"fc3 must be 'batched', 'per_group' or 'float', got {fc3!r}")
    import onnx  # optional, as the two below: the repmlp[export] extra
    from onnxruntime import quantization as q

    batches = [np.ascontiguousarray(x.detach().float().cpu().numpy()) for x in calibration]
    if not batches:
        raise ValueError("int8 quantization needs calibration data (at least one batch)")

    class _Reader(q.CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter(batches)

        def get_next(self) -> dict[str, np.ndarray] | None:
            x = next(self._it, None)
            return None if x is None else {"input": x}

    with tempfile.TemporaryDirectory(prefix="repmlp-int8-") as tmp:
        fp32, pre, q8 = (Path(tmp) / n for n in ("fp32.onnx", "pre.onnx", "int8.onnx"))
        export_onnx(model, fp32, input_size, check=False, per_group=fc3 == "per_group")
        q.quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=True)
        # One scale for each constant 3-D MatMul weight (FC3's (g, P/g, Q/g), batched): per-channel scales would
        # keep onnxruntime from its int8 kernel (QLinearMatMul), dequantizing the weight on every run instead.
        graph = onnx.load(str(pre), load_external_data=False).graph
        ranks = {t.name: len(t.dims) for t in graph.initializer}
        batched = {n.input[1] for n in graph.node if n.op_type == "MatMul" and ranks.get(n.input[1]) == 3}
        overrides = {name: [{"quant_type": q.QuantType.QInt8, "symmetric": True}] for name in sorted(batched)}
        # The partition maps' reshapes and transposes (7-D around FC3) stay in float: OpenVINO runs the Q/DQ
        # pairs the quantizer would put around them as passes of their own (a fifth of Light's int8 time; ONNX
        # Runtime is as fast either way: docs/benchmarks.md).
        in_float = [n.name for n in graph.node if n.op_type in ("Reshape", "Transpose")]
        if fc3 == "float":
            in_float += [n.name for n in graph.node if n.op_type == "MatMul" and ranks.get(n.input[1]) == 3]
        q.quantize_static(str(pre), str(q8), _Reader(), quant_format=q.QuantFormat.QDQ, per_channel=per_channel,
                          weight_type=q.QuantType.QInt8, activation_type=q.QuantType.QUInt8,
                          calibrate_method=q.CalibrationMethod.MinMax, nodes_to_exclude=in_float,
                          extra_options={"TensorQuantOverrides": overrides})  # fmt: skip
        return Int8OnnxModel(q8.read_bytes())


def to_precision(model: nn.Module, precision: str, calibration: Iterable[Tensor] | None = None, *,
                 input_size: Sequence[int] | None = None) -> nn.Module:  # fmt: skip
    """The deployed ``model`` in ``precision`` (:data:`PRECISIONS`): ``fp32``/``bf16``/``fp16`` cast in place
    (and returned); ``int8`` a new :class:`Int8OnnxModel`, which needs ``calibration`` batches and
    ``input_size`` ``(C, H, W)``. ``ValueError`` for an unknown precision or int8 without them."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})")
    if precision != "int8":
        return _float_model(model, DTYPES[precision])
    if calibration is None or input_size is None:
        raise ValueError("int8 quantization needs calibration data and the input size")
    return quantize_int8(model.float().eval(), input_size, calibration)


def native_support(precision: str) -> str | None:
    """Why this CPU has no native ``precision`` (bf16: AVX512_BF16 or AMX; fp16: AVX512_FP16 or AMX-FP16;
    without them PyTorch converts, slower than float32), or ``None`` when it has."""
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


# ------------------------------------------------------------------------ an int8 file's graph, checked
# The operators repmlp's int8 export writes: no Loop/If/Scan (a loop that never ends), no ConstantOfShape,
# Expand or Tile (gigabytes from a few bytes).
INT8_OPS = frozenset("""Add AveragePool BatchNormalization Cast Concat Conv DequantizeLinear Div Erf Flatten
    Gather GatherND Gelu Gemm GlobalAveragePool Identity LayerNormalization MatMul Max MaxPool Mul PRelu Pad
    QuantizeLinear Range ReduceMean Relu Reshape Resize ScatterND Shape Sigmoid Slice Softmax Sqrt Squeeze Sub
    Transpose Unsqueeze Where""".split())  # fmt: skip
# Ops whose output size follows their inputs' values or attributes: shape inference must tell it. Any other
# op's output is at most the product of its inputs' sizes.
_SIZED_BY_VALUES = frozenset({"Range", "Pad", "Resize", "Conv", "AveragePool", "MaxPool"})
# Ops whose output has at most the elements of their first input.
_NOT_GROWING = frozenset("""BatchNormalization Cast DequantizeLinear Erf Flatten Gelu GlobalAveragePool Identity
    LayerNormalization QuantizeLinear ReduceMean Relu Reshape ScatterND Sigmoid Slice Softmax Sqrt Squeeze
    Transpose Unsqueeze""".split())  # fmt: skip
MAX_GRAPH_ELEMENTS = 1 << 28  # elements of one tensor of the graph for one example (1 GiB of float32)
_ATTRIBUTE_TYPES = {1, 2, 3, 6, 7, 8}  # FLOAT, INT, STRING, FLOATS, INTS, STRINGS: no graph, no tensor


def check_int8_graph(raw: bytes, input_size: Sequence[int] | None = None) -> None:
    """A ``ValueError`` saying why, for an ONNX graph that is not one repmlp's int8 export writes, before
    onnxruntime sees it: only :data:`INT8_OPS` of the default domain, no sub-graphs or tensor attributes, no
    external or sparse data, one input ``(N, C, H, W)`` (``input_size`` the file's, when given) and one
    output, and at batch 1 every tensor at most :data:`MAX_GRAPH_ELEMENTS` elements (shape inference)."""
    import onnx  # optional: the repmlp[export] extra

    try:
        model = onnx.load_from_string(raw)
    except Exception as exc:  # noqa: BLE001 - protobuf's errors: the bytes are no ONNX model
        raise ValueError(f"not an ONNX model ({type(exc).__name__})") from None
    graph = model.graph
    if len(model.functions) or len(graph.sparse_initializer):
        raise ValueError("it holds functions or sparse data, which repmlp's int8 export never writes")
    for i, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx") or node.op_type not in INT8_OPS:
            raise ValueError(f"node {i} is a {node.domain + '.' if node.domain else ''}{node.op_type[:40]}, "
                             "not an operator repmlp's int8 export writes")  # fmt: skip
        if any(a.type not in _ATTRIBUTE_TYPES for a in node.attribute):
            raise ValueError(f"node {i} ({node.op_type}) has a graph or tensor attribute")
    if any(t.data_location == onnx.TensorProto.EXTERNAL or t.external_data for t in graph.initializer):
        raise ValueError("it refers to external data files")
    _check_graph_input(graph, input_size)
    _check_graph_sizes(model, onnx.shape_inference.infer_shapes)


def _check_graph_input(graph, input_size: Sequence[int] | None) -> None:  # noqa: ANN001 - onnx.GraphProto
    """One input ``(N, C, H, W)`` with a static ``(C, H, W)`` (the file's ``input_size`` when given), one output."""
    inits = {t.name for t in graph.initializer}
    inputs = [v for v in graph.input if v.name not in inits]
    if len(inputs) != 1 or len(graph.output) != 1:
        raise ValueError(f"it has {len(inputs)} inputs and {len(graph.output)} outputs, not one image batch "
                         "and one result")  # fmt: skip
    dims = inputs[0].type.tensor_type.shape.dim
    sizes = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    if len(sizes) != 4 or None in sizes[1:] or (input_size is not None and sizes[1:] != list(input_size)):
        shown = "x".join("?" if s is None else str(s) for s in sizes)
        want = "x".join(str(s) for s in input_size) if input_size is not None else "C x H x W"
        raise ValueError(f"its input is {shown}, not a batch of {want} images (the file's input size)")


def _check_graph_sizes(model, infer_shapes: Callable) -> None:  # noqa: ANN001 - onnx.ModelProto
    """Every tensor the graph computes for one example is at most :data:`MAX_GRAPH_ELEMENTS` elements: known
    from shape inference (onnx's ``infer_shapes``), else bounded by the product of its inputs' sizes (an op
    whose size follows values must be inferred; a ``Range`` up to a dimension of a tensor is bounded by it)."""
    producer = {out: node for node in model.graph.node for out in node.output}
    for i, node in enumerate(model.graph.node):
        # A Range counts up to a dimension of a tensor, never to a constant (which shape inference's data
        # propagation below would compute element by element)
        if node.op_type == "Range" and not _dimension(node, producer):
            raise ValueError(f"node {i} (Range) counts to a constant, not to a dimension of a tensor")
    model = type(model).FromString(model.SerializeToString())
    del model.graph.value_info[:]
    first = model.graph.input[0].type.tensor_type.shape.dim[0]
    first.Clear()
    first.dim_value = 1
    try:
        # Data propagation computes small values (shapes, a Range up to a dimension: checked first).
        inferred = infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - onnx's inference errors: shapes that do not fit together
        raise ValueError(f"its shapes do not fit together ({str(exc).splitlines()[0][:120]})") from None
    shapes: dict[str, list[int]] = {t.name: list(t.dims) for t in model.graph.initializer}
    for v in [*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input]:
        dims = v.type.tensor_type.shape.dim if v.type.tensor_type.HasField("shape") else None
        if dims is not None and all(d.HasField("dim_value") for d in dims):
            shapes[v.name] = [d.dim_value for d in dims]
    known = {name: int(np.prod(dims, dtype=object)) for name, dims in shapes.items()}
    for i, node in enumerate(model.graph.node):
        for out in node.output:
            size = known.get(out)
            if size is None:
                size = _bound(node, known, producer, shapes)
                known[out] = size
            if size > MAX_GRAPH_ELEMENTS:
                raise ValueError(f"node {i} ({node.op_type}) makes a tensor of up to {size} elements per "
                                 f"example (at most {MAX_GRAPH_ELEMENTS})")  # fmt: skip


def _dimension(node, producer: dict):  # noqa: ANN001, ANN202 - onnx.NodeProto
    """The ``Shape`` node a ``Range``'s limit is a dimension of (maybe squeezed or gathered), else ``None``."""
    source = producer.get(node.input[1]) if len(node.input) == 3 else None
    while source is not None and source.op_type in ("Squeeze", "Gather", "Unsqueeze", "Cast"):
        source = producer.get(source.input[0])
    return source if source is not None and source.op_type == "Shape" else None


def _bound(node, known: dict[str, int], producer: dict, shapes: dict) -> int:  # noqa: ANN001 - onnx.NodeProto
    """An upper bound of the elements of an output shape inference did not size (see :func:`_check_graph_sizes`)."""
    sizes = [known.get(name, MAX_GRAPH_ELEMENTS + 1) for name in node.input if name]
    if node.op_type == "Range":
        source = _dimension(node, producer)
        return known.get(source.input[0], MAX_GRAPH_ELEMENTS + 1) if source else MAX_GRAPH_ELEMENTS + 1
    if node.op_type in _SIZED_BY_VALUES:
        return MAX_GRAPH_ELEMENTS + 1
    if node.op_type in _NOT_GROWING and sizes:
        return sizes[0]
    data = shapes.get(node.input[0]) if node.input else None
    weight = shapes.get(node.input[1]) if len(node.input) > 1 else None
    if node.op_type in ("Gemm", "MatMul") and weight and len(weight) >= 2 and min(weight) > 0:
        # (..., M, K) @ (..., K, N): M * N (times the weight's batch) <= (elements of A / K) * N
        flip = any(a.name == "transB" and a.i for a in node.attribute)
        k, n = (weight[-1], weight[-2]) if flip else (weight[-2], weight[-1])
        return sizes[0] // k * n * int(np.prod(weight[:-2], dtype=object))
    if node.op_type == "Gather" and data and len(sizes) == 2:  # indices' shape + data's without the axis
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if -len(data) <= axis < len(data) and data[axis] > 0:
            return sizes[1] * (sizes[0] // data[axis])
    bound = 1
    for size in sizes:
        bound *= max(1, size)
    return bound + sum(sizes)


def _load_int8(onnx: Tensor, input_size: Sequence[int] | None = None) -> Int8OnnxModel:
    """An int8 model file's graph (the ``onnx`` tensor), checked (:func:`check_int8_graph`), as a module."""
    check_int8_graph(onnx.cpu().numpy().tobytes(), input_size)
    return Int8OnnxModel(onnx)


# Model files in a reduced precision are rebuilt by these (repmlp.io.model_file reads the files).
PRECISION_LOADERS["int8"] = _load_int8
for _precision, _dtype in DTYPES.items():
    if _precision != "fp32":
        PRECISION_LOADERS[_precision] = lambda model, dtype=_dtype: _float_model(model, dtype)
