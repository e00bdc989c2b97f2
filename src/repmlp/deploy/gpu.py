"""Fast inference paths for a deployed model on a GPU: CUDA graphs, cuDNN-fused epilogues, torch.compile.

Run eagerly on a GPU, a deployed model spends much of its time launching kernels from Python and in the
separate elementwise kernels of every conv's bias, ReLU and residual addition (docs/gpu.md). :data:`PATHS`:

* ``eager``: the model as it is;
* ``graph``: the model's kernels captured once as a CUDA graph and replayed (no launch overhead);
* ``fused``: every conv-bias-ReLU and conv-bias-add-ReLU as one cuDNN call
  (``torch.cudnn_convolution_relu`` / ``torch.cudnn_convolution_add_relu``), found in the model's
  ``torch.fx`` graph; ``fused+graph`` replays that as a CUDA graph;
* ``compile``: ``torch.compile`` (default mode: inductor fuses the elementwise work into the convs'
  neighbours); ``compile+graph`` replays the compiled model as a CUDA graph.

Which is fastest depends on the GPU, the precision and the model (``benchmarks/bench_gpu.py``, docs/gpu.md).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PATHS", "GraphReplay", "fuse_conv_epilogues", "prepare_inference", "fastest_path", "serving_format",
           "fused_or_plain", "prepare_fast"]  # fmt: skip

log = logging.getLogger(__name__)

PATHS = ("eager", "graph", "fused", "fused+graph", "compile", "compile+graph")

_RELUS = (F.relu, torch.relu, torch.relu_)
_ADDS = (operator.add, operator.iadd, torch.add)
# Not fused: kernels this large (a ResNet's 7x7 stem), where cuDNN's fused kernel was reported many times
# slower than the plain conv (pytorch/pytorch#68506).
_MAX_FUSED_KERNEL = 5


class GraphReplay:
    """``fn`` captured as a CUDA graph for inputs like ``example``; call it with a tensor.

    An input of the example's shape and dtype is copied into the graph's static input (any memory layout:
    the copy converts it) and the graph replayed; the result is a fresh copy of the graph's output, so a
    later call does not overwrite what an earlier one returned. Other inputs run ``fn`` itself. Capture
    and replays run under ``torch.inference_mode``.

    Shapes: as ``fn``.
    """

    def __init__(self, fn: Callable[[Tensor], Tensor], example: Tensor, warmup: int = 3) -> None:
        if example.device.type != "cuda":
            raise ValueError(f"a CUDA graph needs a CUDA input, got one on {example.device}")
        self.fn = fn
        with torch.inference_mode():
            self.static_input = example.clone()
            stream = torch.cuda.Stream(example.device)
            stream.wait_stream(torch.cuda.current_stream(example.device))
            with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
                for _ in range(warmup):
                    fn(self.static_input)
            torch.cuda.current_stream(example.device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.static_output = fn(self.static_input)

    def replay(self) -> Tensor:
        """Replay on whatever the static input holds; returns the static output (overwritten next time)."""
        self.graph.replay()
        return self.static_output

    def __call__(self, x: Tensor) -> Tensor:
        s = self.static_input
        with torch.inference_mode():
            if x.shape != s.shape or x.dtype != s.dtype or x.device != s.device:
                return self.fn(x)
            s.copy_(x)
            return self.replay().clone()


def _conv_module(node: fx.Node, modules: dict[str, nn.Module]) -> nn.Conv2d | None:
    """The ``nn.Conv2d`` that ``node`` calls, when fusing its epilogue is allowed (its output has no other
    use, zero padding given as numbers, a kernel of at most ``_MAX_FUSED_KERNEL``)."""
    if node.op != "call_module" or len(node.users) != 1:
        return None
    conv = modules.get(str(node.target))
    if not isinstance(conv, nn.Conv2d) or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return None
    return conv if max(conv.kernel_size) <= _MAX_FUSED_KERNEL else None


def fuse_conv_epilogues(model: nn.Module) -> tuple[fx.GraphModule, int]:
    """``model`` with each ``relu(conv(x))`` and ``relu(conv(x) + z)`` as one cuDNN call; returns the
    rewritten module (a ``torch.fx.GraphModule`` sharing ``model``'s parameters) and how many it fused.

    ``model`` must be traceable by ``torch.fx`` and deployed (BatchNorms folded: a conv followed by a
    BatchNorm is left alone). The fused ops run on CUDA only. Shapes: as ``model``.
    """
    gm = fx.symbolic_trace(model)
    modules = dict(gm.named_modules())
    fused = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _RELUS or not node.args:
            continue
        src, other, conv_node = node.args[0], None, None
        if _conv_module(src, modules) is not None:
            conv_node = src
        elif src.op == "call_function" and src.target in _ADDS and len(src.users) == 1 and len(src.args) == 2:
            a, b = src.args
            if isinstance(a, fx.Node) and _conv_module(a, modules) is not None:
                conv_node, other = a, b
            elif isinstance(b, fx.Node) and _conv_module(b, modules) is not None:
                conv_node, other = b, a
        if conv_node is None or (other is not None and not isinstance(other, fx.Node)):
            continue
        conv = modules[str(conv_node.target)]
        with gm.graph.inserting_before(node):
            weight = gm.graph.get_attr(f"{conv_node.target}.weight")
            bias = gm.graph.get_attr(f"{conv_node.target}.bias") if conv.bias is not None else None
            geometry = (list(conv.stride), list(conv.padding), list(conv.dilation), conv.groups)
            x = conv_node.args[0]
            if other is None:
                new = gm.graph.call_function(torch.cudnn_convolution_relu, (x, weight, bias, *geometry))
            else:
                args = (x, weight, other, 1.0, bias, *geometry)
                new = gm.graph.call_function(torch.cudnn_convolution_add_relu, args)
        node.replace_all_uses_with(new)
        fused += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm, fused


def prepare_inference(
    model: nn.Module, example: Tensor, path: str = "compile+graph"
) -> Callable[[Tensor], Tensor]:
    """``model`` (deployed, in eval mode, on ``example``'s device and dtype) ready to run by ``path``.

    Builds what the path needs now (the fx rewrite, the compile, the graph
    capture: a first call with ``example``), so that calls afterwards are timed or served at full speed.
    ``graph`` paths need a CUDA device. Returns a callable ``(N, C, H, W) -> output``; with a graph, inputs
    of ``example``'s shape and dtype replay it (see :class:`GraphReplay`).
    """
    if path not in PATHS:
        raise ValueError(f"unknown inference path {path!r}: one of {', '.join(PATHS)}")
    fn: Callable[[Tensor], Tensor] = model
    if path.startswith("fused"):
        fn = fuse_conv_epilogues(model)[0]
    elif path.startswith("compile"):
        fn = torch.compile(model)
    with torch.inference_mode():
        fn(example)  # compiles, tunes cuDNN (benchmark mode), allocates
    if path.endswith("graph"):
        return GraphReplay(fn, example)
    return fn


def fastest_path(device: torch.device, dtype: torch.dtype) -> str:
    """The path measured fastest for deployed models on ``device`` in ``dtype`` (docs/gpu.md, run 1: ResNet-50,
    RepMLP-Res50 and the Light model at batch 128): ``compile+graph`` in fp16/bf16, ``fused+graph`` in fp32
    (TF32 off: inductor's code was slower than cuDNN's fused kernels there);
    ``eager`` on a CPU."""
    if device.type != "cuda":
        return "eager"
    return "fused+graph" if dtype == torch.float32 else "compile+graph"


def serving_format(device: torch.device, dtype: torch.dtype) -> torch.memory_format:
    """The activations' and weights' layout for a deployed model: channels_last on a CPU (oneDNN's native
    layout: on NCHW tensors PyTorch reorders input and output around every conv, docs/benchmarks.md) and for
    half precision on CUDA (tensor-core convolutions), NCHW for fp32 on CUDA (faster there: docs/gpu.md)."""
    cuda_fp32 = device.type == "cuda" and dtype not in (torch.float16, torch.bfloat16)
    return torch.contiguous_format if cuda_fp32 else torch.channels_last


def fused_or_plain(model: nn.Module) -> nn.Module:
    """:func:`fuse_conv_epilogues` of ``model``, or ``model`` itself where it cannot be traced (logged)."""
    try:
        return fuse_conv_epilogues(model)[0]
    except Exception as exc:  # noqa: BLE001 - any tracing failure leaves the model as it is
        log.info("no fused conv epilogues (%s: %s): running the model as it is", type(exc).__name__, exc)
        return model


def prepare_fast(model: nn.Module, example: Tensor) -> Callable[[Tensor], Tensor]:
    """:func:`prepare_inference` by :func:`fastest_path` for the model's parameter dtype on ``example``'s
    device, for inputs of ``example``'s dtype and layout (``repmlp tables --speed --path fast``)."""
    param = next(model.parameters(), None)
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    return prepare_inference(model, example, fastest_path(example.device, dtype))
