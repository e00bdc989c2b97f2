"""The roofline of a deployed model: the fastest a device could run it, operator by operator.

The model runs once on ``meta`` tensors (no memory, no arithmetic); every aten operator is recorded with its
multiply-accumulates (GEMMs: convolutions and matmuls, counted as :mod:`repmlp.bench.counts` does) and the
elements it reads and writes. An operator group takes ``max(FLOPs / peak, bytes / bandwidth)``, FLOPs being 2
per MAC; the model's ceiling is the sum over groups. Weights are read once a batch; views move nothing. Three
accountings of the bytes:

- ``fused``: bias, ReLU, residual and other element-wise ops run in their GEMM's epilogue (reading only their
  other operands), the partition permutes fold into the GEMM's addressing;
- ``onepass``: a GEMM writes its raw output, one pass reads it, applies bias and what follows, and writes it;
- ``unfused``: the bias, every element-wise op and every copy is a pass of its own over memory.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from repmlp.bench.timing import time_calls
from repmlp.engine.devices import cpu_name
from repmlp.errors import UserError
from repmlp.models import build_model
from repmlp.nn.convert import reparameterize_model

__all__ = ["ACCOUNTINGS", "GPUS", "Device", "Roofline", "find_device", "walk", "ceiling", "roofline",
           "render"]  # fmt: skip

ACCOUNTINGS = ("fused", "onepass", "unfused")
KINDS = ("conv", "matmul", "elementwise", "pooling", "copy")
ITEMSIZE = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "int8": 1}
_COPIES = {"clone", "_to_copy", "copy_", "cat", "stack", "constant_pad_nd"}
_REDUCTIONS = {"mean", "sum", "amax"}

# Dense peaks (no structured sparsity) in FLOP/s: fp32 (FFMA), TF32 and fp16/bf16 tensor cores; memory
# bandwidth in bytes/s. Sources: NVIDIA's datasheets of the H100 SXM, H200 SXM, A100 80GB SXM and L4, the Ada
# Lovelace architecture whitepaper (RTX 4090, fp16 with fp32 accumulation), the GTX 1080 Ti's specifications
# (no tensor cores: TF32 and fp16 run at the fp32 rate, cuDNN computing fp16 in fp32 on Pascal).
GPUS: dict[str, tuple[str, float, float, float, float]] = {
    "h100": ("NVIDIA H100 SXM", 67e12, 494.7e12, 989.4e12, 3.35e12),
    "h200": ("NVIDIA H200", 67e12, 494.7e12, 989.4e12, 4.8e12),
    "a100": ("NVIDIA A100 SXM 80GB", 19.5e12, 156e12, 312e12, 2.039e12),
    "l4": ("NVIDIA L4", 30.3e12, 60e12, 121e12, 0.3e12),
    "rtx4090": ("NVIDIA GeForce RTX 4090", 82.6e12, 82.6e12, 165.2e12, 1.008e12),
    "gtx1080ti": ("NVIDIA GeForce GTX 1080 Ti", 11.34e12, 11.34e12, 11.34e12, 0.484e12),
}


@dataclass(frozen=True)
class Device:
    """A device's peak arithmetic in one precision (FLOP/s) and memory bandwidth (bytes/s, read + write)."""

    name: str
    peak: float
    bandwidth: float


@dataclass
class Op:
    """One aten operator of a forward pass; counts are elements (not bytes) of the whole batch."""

    kind: str  # one of KINDS
    stage: str  # the model's child module it ran in
    macs: int
    reads: int  # activation elements read (every tensor input but the weights)
    side: int  # of those, what an element-wise op reads besides its main operand (its epilogue operands)
    weights: int  # parameter and buffer elements read
    out: int  # elements written
    root: int | None = None  # element-wise: the GEMM whose output it transforms (its epilogue), else None
    bias: bool = False  # a GEMM adding a bias


def find_device(device: str | torch.device, precision: str, peak: float | None = None,
                bandwidth: float | None = None) -> Device:  # fmt: skip
    """The roofline's :class:`Device`: a GPU of :data:`GPUS` by key or by a CUDA name holding one (``"NVIDIA
    GeForce RTX 4090"``; it need not be here), this machine's CUDA GPU, or its CPU measured now
    (:func:`measure_cpu`); ``peak`` (FLOP/s) and ``bandwidth`` (bytes/s) replace the table's or measured figures
    (both given: nothing is measured). A GPU not in the table, or int8 on a GPU, without both is a
    :class:`UserError`."""
    name = torch.cuda.get_device_name(device) if str(device).startswith("cuda") else str(device)
    words = name.lower().replace("-", " ").split()
    spans = {"".join(words[i:j]) for i in range(len(words)) for j in range(i + 1, len(words) + 1)}
    key = next((k for k in GPUS if k in spans), None)
    if peak and bandwidth:
        return Device(GPUS[key][0] if key else cpu_name() if name == "cpu" else name, peak, bandwidth)
    if name == "cpu":
        found = measure_cpu(precision)
    elif precision == "int8":
        raise UserError(f"the roofline's table of GPUs holds no int8 peak: pass the peak and bandwidth of {name} "
                        "(--peak, --bandwidth)")  # fmt: skip
    elif key is None:
        raise UserError(f"{name} is not in the roofline's table of GPUs ({', '.join(GPUS)}): pass the peak and "
                        "bandwidth (--peak, --bandwidth)")  # fmt: skip
    else:
        full, *peaks, bw = GPUS[key]
        found = Device(full, peaks[("fp32", "tf32", "fp16").index(precision.replace("bf16", "fp16"))], bw)
    return Device(found.name, peak or found.peak, bandwidth or found.bandwidth)


def measure_cpu(precision: str, size: int = 2048) -> Device:
    """This CPU's :class:`Device` at torch's thread count, measured: peak from the faster of a ``size``-square
    ``torch.mm`` and a channels-last 1x1 convolution (oneDNN's kernels beat the BLAS on some CPUs); int8's from
    the faster of ``torch._int_mm`` and the quantized engine's ``Linear`` (the VNNI/AMX kernels an int8 graph's
    runtime calls); bandwidth from a copy of ``16 * size**2`` elements (bytes read + written per second)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}.get(precision, torch.float32)
    src = torch.ones(16 * size * size, dtype=dtype)
    dst = torch.empty_like(src)
    with torch.inference_mode():
        peak = _int8_peak(size) if precision == "int8" else _float_peak(dtype, size)
        bandwidth = 2 * src.numel() * src.element_size() / _seconds(lambda: dst.copy_(src))
    return Device(f"{cpu_name()}, {torch.get_num_threads()} threads (measured)", peak, bandwidth)


def _seconds(fn) -> float:
    """The best of three calls of ``fn`` after a warm-up: noise only ever slows a kernel down."""
    return min(time_calls(fn, 1, warmup=1 if i == 0 else 0) for i in range(3))


def _float_peak(dtype: torch.dtype, size: int) -> float:
    a = torch.randn(size, size, dtype=dtype)
    c = max(size // 8, 8)
    conv = nn.Conv2d(c, c, 1).to(dtype=dtype, memory_format=torch.channels_last)
    x = torch.randn(32, c, 56, 56, dtype=dtype).to(memory_format=torch.channels_last)
    return max(2 * size**3 / _seconds(lambda: torch.mm(a, a)), 2 * x.numel() * c / _seconds(lambda: conv(x)))


def _int8_peak(size: int) -> float:
    a = torch.randint(-64, 64, (size, size), dtype=torch.int8)
    rates = [2 * size**3 / _seconds(lambda: torch._int_mm(a, a))]
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch: measured while they exist
        warnings.simplefilter("ignore")
        try:
            fc = torch.ao.nn.quantized.Linear(size, size)
            fc.set_weight_bias(torch.quantize_per_tensor(a.float(), 1.0, 0, torch.qint8), None)
            x = torch.quantize_per_tensor(a.float(), 1.0, 64, torch.quint8)
            rates.append(2 * size**3 / _seconds(lambda: fc(x)))
        except (AttributeError, RuntimeError, NotImplementedError):  # this torch has no quantized engine
            pass
    return max(rates)


class _Recorder(TorchDispatchMode):
    """Records an :class:`Op` for every aten operator that moves memory (views do not)."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.stage = "(other)"
        # id -> (tensor kept alive, producing op's index: -1 weight, -2 input, its GEMM root or None)
        self.src: dict[int, tuple[torch.Tensor, int, int | None]] = {id(w): (w, -1, None) for w in weights}

    def _source(self, t: torch.Tensor) -> tuple[int, int | None]:
        return self.src.get(id(t), (t, -2, None))[1:]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs:  # nothing written (a size or a scalar read)
            return out
        if func.is_view or func is torch.ops.aten._unsafe_view.default:  # the view's elements are its base's
            self.src.update({id(t): (t, *self._source(ins[0])) for t in outs})
            return out
        name = func.__name__.split(".")[0]
        acts = [t for t in ins if self._source(t)[0] != -1]
        weights = sum(t.numel() for t in ins if self._source(t)[0] == -1)
        op = Op("elementwise", self.stage, 0, sum(t.numel() for t in acts), 0, weights, outs[0].numel())
        root = None
        if func.overloadpacket in flop_registry:
            op.kind = "conv" if "conv" in name else "matmul"
            op.macs = flop_registry[func.overloadpacket](*args, **(kwargs or {}), out_val=out) // 2
            op.bias = args[2] is not None if op.kind == "conv" else name in ("addmm", "baddbmm")
            root = len(self.ops)
        elif "pool" in name or name in _REDUCTIONS:
            op.kind = "pooling"
        elif name in _COPIES:  # folded into its consumer's or producer's addressing: keeps its input's root
            op.kind, root = "copy", self._source(acts[0])[1] if acts else None
        else:  # main operand: the latest-made input of the output's size; an epilogue op when a GEMM made it
            full = [t for t in acts if t.numel() == op.out]
            main = max(full, key=lambda t: self._source(t)[0]) if full else None
            op.side = op.reads - (main.numel() if main is not None else 0)
            op.root = root = self._source(main)[1] if main is not None else None
        self.ops.append(op)
        self.src.update({id(t): (t, len(self.ops) - 1, root) for t in outs})
        return out


def walk(model: nn.Module, input_shape: tuple[int, ...]) -> list[Op]:
    """The :class:`Op` list of one forward pass of ``model`` (on ``meta``) on a batch ``(N, C, H, W)``; each
    op's stage is the name of the model's child module it ran in (``(other)`` outside them)."""
    rec = _Recorder([*model.parameters(), *model.buffers()])
    # Every module names its stage, so that an FX graph calling leaf modules directly has stages too.
    hooks = [m.register_forward_pre_hook(lambda *_, n=n: setattr(rec, "stage", n.split(".")[0]))
             for n, m in model.named_modules() if n]  # fmt: skip
    hooks += [m.register_forward_hook(lambda *_: setattr(rec, "stage", "(other)")) for m in model.children()]
    x = torch.empty(input_shape, device="meta")
    try:
        with torch.no_grad(), rec:
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return rec.ops


def ceiling(ops: list[Op], device: Device, precision: str, accounting: str) -> list[tuple[float, int]]:
    """``(seconds, bytes)`` of each op under ``accounting``: an op's own bytes; the time of the bytes its GEMM's
    arithmetic overlaps (its own, a fused epilogue's) counts with the GEMM, a pass over memory with its op."""
    size, gemm_bytes, pass_bytes = ITEMSIZE[precision], [0] * len(ops), [0] * len(ops)
    moved = [op.reads + op.weights + op.out for op in ops]
    epilogues = {op.root for op in ops if op.root is not None}
    for i, op in enumerate(ops):
        if op.kind in ("conv", "matmul"):  # a bias pass reads the raw output and writes it back
            bias_pass = op.bias if accounting == "unfused" else op.bias or i in epilogues
            gemm_bytes[i], pass_bytes[i] = moved[i], 2 * op.out * (accounting != "fused" and bias_pass)
            moved[i] += pass_bytes[i]
        elif (
            op.kind == "pooling" or accounting == "unfused" or (op.kind == "elementwise" and op.root is None)
        ):
            pass_bytes[i] = moved[i]
        elif op.kind == "copy":  # folded into the addressing of its producer or consumer
            moved[i] = 0
        else:  # an epilogue reads its other operands: within its GEMM (fused) or in the GEMM's pass (onepass)
            moved[i] = op.side + op.weights
            if accounting == "fused":
                gemm_bytes[op.root] += moved[i]
            else:
                pass_bytes[i] = moved[i]
    return [
        (max(2 * op.macs / device.peak, size * g / device.bandwidth) + size * p / device.bandwidth, size * m)
        for op, g, p, m in zip(ops, gemm_bytes, pass_bytes, moved, strict=True)
    ]


def deployed(name: str, input_size: tuple[int, ...], num_classes: int | None = None, **kwargs) -> nn.Module:
    """Model ``name``'s inference form on the ``meta`` device, for inputs ``(C, H, W)``."""
    with torch.device("meta"):
        model, _ = build_model(
            name, kwargs, num_classes=num_classes, in_chans=input_size[0], img_size=input_size[1]
        )
        return reparameterize_model(model.eval())


def _parts(ops: list[Op], device: Device, precision: str, batch_size: int) -> dict[str, list[float]]:
    """Operator kind, stage and ``"total"`` -> [MACs per image, bytes and seconds a batch per accounting]."""
    costs = [ceiling(ops, device, precision, a) for a in ACCOUNTINGS]
    names = [*(k for k in KINDS if any(op.kind == k for op in ops)), *(op.stage for op in ops), "total"]
    parts = {p: [0.0] * (1 + 2 * len(ACCOUNTINGS)) for p in names}
    for i, op in enumerate(ops):
        row = [op.macs / batch_size, *(c[i][1] for c in costs), *(c[i][0] for c in costs)]
        for p in (op.kind, op.stage, "total"):
            parts[p] = [a + b for a, b in zip(parts[p], row, strict=True)]
    return parts


@dataclass
class Roofline:
    """A deployed model's ceilings on one device: ``parts`` as :func:`_parts` gives them; ``baseline``:
    ResNet-50's seconds a batch per accounting (``repmlp_res50`` without RepMLP stages: torchvision's with BN
    folded), on the same device, precision, batch and input."""

    model: str
    batch_size: int
    input_size: tuple[int, ...]
    precision: str
    device: Device
    parts: dict[str, list[float]]
    baseline: list[float]

    def throughput(self, accounting: str) -> float:
        """The ceiling in examples/s."""
        return self.batch_size / self.parts["total"][1 + len(ACCOUNTINGS) + ACCOUNTINGS.index(accounting)]

    def ratio(self, accounting: str) -> float:
        """This model's ceiling over ResNet-50's."""
        return self.throughput(accounting) * self.baseline[ACCOUNTINGS.index(accounting)] / self.batch_size


def roofline(name: str, batch_size: int, precision: str, device: Device, input_size: tuple[int, ...] = (3, 224, 224),
             num_classes: int | None = None, **kwargs) -> Roofline:  # fmt: skip
    """The :class:`Roofline` of registered model ``name`` (``kwargs`` to its constructor), deployed, on batches
    ``(batch_size, *input_size)`` in ``precision`` (fp32, tf32, fp16, bf16, int8: every element one byte, at
    the int8 GEMM's peak) on ``device``."""
    if precision not in ITEMSIZE:
        raise ValueError(f"the roofline knows precisions {', '.join(ITEMSIZE)}, not {precision!r}")
    shape, size = (batch_size, *input_size), tuple(input_size)
    parts = _parts(walk(deployed(name, size, num_classes, **kwargs), shape), device, precision, batch_size)
    base = _parts(
        walk(deployed("repmlp_res50", size, num_classes, stages=()), shape), device, precision, batch_size
    )
    return Roofline(name, batch_size, size, precision, device, parts, base["total"][1 + len(ACCOUNTINGS) :])


def render(r: Roofline, measured: float | None = None) -> str:
    """``r`` as a Markdown table (per operator kind, per stage, in total) and a line of its ceilings, ratios to
    ResNet-50 and, given the ``measured`` examples/s, the share of each ceiling the model reaches."""
    d, each = r.device, " / ".join(ACCOUNTINGS)
    lines = [
        f"{r.model}: batch {r.batch_size}, input {'x'.join(map(str, r.input_size))}, {r.precision} on {d.name} "
        f"({d.peak / 1e12:.3g} TFLOP/s, {d.bandwidth / 1e9:.4g} GB/s: ridge {d.peak / d.bandwidth:.0f} FLOP/byte)",
        "",
        "| part | GMAC/image | " + " | ".join([*(f"GB {a}" for a in ACCOUNTINGS), *(f"ms {a}" for a in ACCOUNTINGS)])
        + " |",
        "|---|" + "---:|" * (1 + 2 * len(ACCOUNTINGS)),
        *(f"| {p} | " + " | ".join(f"{v * f:.3f}" for v, f in zip(row, [1e-9] * 4 + [1e3] * 3, strict=True)) + " |"
          for p, row in r.parts.items()),
        "",
        f"Ceiling ({each}): " + " / ".join(_number(r.throughput(a)) for a in ACCOUNTINGS) + " examples/s, "
        + " / ".join(f"{r.ratio(a):.3f}" for a in ACCOUNTINGS) + "x ResNet-50's.",
    ]  # fmt: skip
    if measured is not None:
        shares = " / ".join(f"{100 * measured / r.throughput(a):.1f}%" for a in ACCOUNTINGS)
        lines[-1] += f" Measured {_number(measured)} examples/s: {shares} of the ceilings."
    return "\n".join(lines)


def _number(x: float) -> str:
    """``77,443``; three significant digits below 100 (``3.90``)."""
    return f"{x:,.0f}" if x >= 100 else f"{x:#.3g}"
