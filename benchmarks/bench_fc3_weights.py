"""FC3 at batch 1 in forms that read fewer weight bytes (issue 20, item 4): evidence for the next form.

At batch 1 a deployed model's FC3 is a matrix product of a few rows (the partitions of one image) with a
kernel of megabytes, bound by reading the kernel. This script takes every FC3 of a deployed model as it
runs at batch 1 (the rows each ``GroupwiseLinear`` gets, recorded by a hook) and times, interleaved, the
whole set of them per form:

- ``fp32``: what the deployed model runs after the inference pass (``repmlp.speed.fc3``, float32: the form
  timed fastest for the kernel shape and row count on this machine), and each float32 form on its own
  (``bmm``, ``onednn``, ``transposed``: ``repmlp.speed.fc3.KERNELS``);
- ``bf16``: kernel and rows in bfloat16 (batched matmul), the result back in float32;
- ``int8 w, fp32 rows`` / ``int8 w, bf16 rows``: the kernel in int8 with one scale per output row,
  through PyTorch's weight-only int8 matmul (``torch._weight_int8pack_mm``, one call per group), rows
  in float32 or bfloat16.

Reported: milliseconds per model pass summed over its FC3s, the speed-up over ``fp32`` and the largest
error relative to the largest float32 output (random weights), and the floor a float32 form cannot beat
at batch 1: the kernels' bytes at the rate this machine reads memory (a sum over 256 MB, in the same
run). The reduced-precision forms are not deployed forms: the numbers say whether one is worth
building on this machine. CPU only.

    python3 benchmarks/bench_fc3_weights.py [--model repmlp_res50_light] [--rounds 7] [--quick]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from common import device_arg, hardware, parse_cpu_only, table
from repmlp import create_model, reparameterize_model
from repmlp.bench.timing import time_interleaved, time_rounds
from repmlp.nn.layers import GroupwiseLinear
from repmlp.speed.fc3 import KERNELS, fastest_kernel


def fc3_calls(model: torch.nn.Module, size: int) -> list[tuple[Tensor, Tensor, Tensor | None]]:
    """``(rows, weight, bias)`` of every FC3 call of ``model`` on one random ``size x size`` image."""
    calls: list[tuple[Tensor, Tensor, Tensor | None]] = []
    hooks = [
        m.register_forward_pre_hook(
            lambda mod, args: calls.append(
                (args[0].clone(memory_format=torch.contiguous_format), mod.weight, mod.bias)
            )
        )
        for m in model.modules()
        if isinstance(m, GroupwiseLinear)
    ]
    with torch.inference_mode():
        model(torch.randn(1, 3, size, size))
    for h in hooks:
        h.remove()
    return calls


# torch._weight_int8pack_mm (2.14, CPU) crashes unless the inner size is a multiple of 16 (FC3's P/g often
# is not: 392 = 8 x 7 x 7): kernel and rows get zero columns up to it, the rows' padding inside the timing.
_K_MULTIPLE = 16


def int8_rows(weight: Tensor, groups: int) -> tuple[list[Tensor], list[Tensor]]:
    """Per group: the kernel ``(Q/g, P/g)`` in int8, zero-padded to ``_K_MULTIPLE`` columns, and its scale
    per output row (symmetric)."""
    kernels = weight.reshape(groups, weight.shape[0] // groups, weight.shape[1])
    scales = kernels.abs().amax(dim=2).clamp_min(1e-12) / 127
    q = torch.round(kernels / scales[..., None]).clamp(-127, 127).to(torch.int8)
    q = F.pad(q, (0, -q.shape[2] % _K_MULTIPLE))
    return [q[j].contiguous() for j in range(groups)], [scales[j] for j in range(groups)]


def forms(rows: Tensor, weight: Tensor, bias: Tensor | None) -> dict[str, Callable[[], Tensor]]:
    """The four forms of one FC3 call, each returning float32 ``(g, B, Q/g)``."""
    g = rows.shape[0]
    q, s = int8_rows(weight, g)
    s16 = [t.to(torch.bfloat16) for t in s]
    rows16, weight16 = rows.to(torch.bfloat16), weight.to(torch.bfloat16)
    bias16 = None if bias is None else bias.to(torch.bfloat16)
    b = [None] * g if bias is None else list(bias.reshape(g, -1))

    pad = -rows.shape[2] % _K_MULTIPLE

    def int8(act: Tensor, scales: list[Tensor]) -> Tensor:
        act = F.pad(act, (0, pad)) if pad else act
        outs = [torch._weight_int8pack_mm(act[j], q[j], scales[j]).float() for j in range(g)]
        return torch.stack([o if b[j] is None else o + b[j] for j, o in enumerate(outs)])

    picked = KERNELS[fastest_kernel(g, tuple(weight.shape), bias is not None, rows.shape[1])]
    return {
        "fp32": lambda: picked(rows, weight, bias),
        **{f"fp32 {form}": (lambda fn=fn: fn(rows, weight, bias)) for form, fn in KERNELS.items()},
        "bf16": lambda: KERNELS["bmm"](rows16, weight16, bias16).float(),
        "int8 w, fp32 rows": lambda: int8(rows, s),
        "int8 w, bf16 rows": lambda: int8(rows16, s16),
    }


def read_rate() -> float:
    """Bytes a second this machine's threads read from memory: a sum over a 256 MB tensor, best of 5."""
    x = torch.ones(64 << 20)
    best = min(time_rounds({"sum": x.sum}, rounds=5, warmup=1)["sum"])
    return x.numel() * 4 / best


def main() -> None:
    parser = device_arg(__doc__.splitlines()[0])
    parser.add_argument("--model", default="repmlp_res50_light")
    parser.add_argument("--img-size", type=int, default=224)
    args = parse_cpu_only(parser, "FC3 weight forms")
    model = reparameterize_model(create_model(args.model).eval())
    raw = fc3_calls(model, args.img_size)
    calls = [forms(*c) for c in raw]
    names = list(calls[0])
    with torch.inference_mode():
        ref = [c["fp32"]() for c in calls]
        errors = {
            n: max(float((c[n]() - r).abs().max() / r.abs().max()) for c, r in zip(calls, ref, strict=True))
            for n in names
        }
        passes = {n: (lambda n=n: [c[n]() for c in calls]) for n in names}
        rounds = 3 if args.quick else args.rounds
        times = time_interleaved(
            passes, torch.device("cpu"), rounds=rounds, min_round_s=0.05 if args.quick else 0.2
        )
    print(
        f"**bench_fc3_weights: the FC3s of deployed {args.model} at batch 1 ({len(calls)} calls per pass)**"
    )
    print(hardware(torch.device("cpu")))
    print()
    rows = [
        [n, f"{times[n] * 1e3:.2f}", f"{times['fp32'] / times[n]:.2f}x", f"{errors[n]:.1e}"] for n in names
    ]
    print(table(["form", "ms per pass", "vs fp32", "max error (rel.)"], rows))
    print()
    kernel_bytes = sum(w.numel() * w.element_size() for _, w, _ in raw)
    rate = read_rate()
    print(
        f"Medians of {rounds} interleaved rounds. Float32 kernels read per pass: {kernel_bytes / 1e6:.1f} MB; "
        f"this machine reads {rate / 1e9:.1f} GB/s, so reading them once takes {kernel_bytes / rate * 1e3:.2f} ms "
        f"(the floor of a float32 form at batch 1; fp32 takes {times['fp32'] * rate / kernel_bytes:.1f}x that)."
    )


if __name__ == "__main__":
    main()
