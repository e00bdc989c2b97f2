"""FC3 (the groupwise FC of the Partition Perceptron) implemented several ways, permutes included.

Every candidate maps the block's (padded) input ``(N, C, H, W)`` to ``(N, O, H, W)`` contiguous NCHW:
split into partitions, groupwise FC ``(O*h*w, C*h*w/g)`` with bias, merge the partitions back. They are
checked equal once, then timed interleaved (``repmlp.bench.timing.time_interleaved``). Reported:
milliseconds per call, GMAC/s of the FC's multiply-adds (``N*Hp*Wp * O*h*w * C*h*w/g``; the
block-diagonal candidate does ``g`` times more work but is credited with the same useful MACs), and the
speed-up over the paper's grouped 1x1 conv.

    python3 benchmarks/bench_fc3.py [--device cuda] [--quick]
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from common import device_arg, hardware, set_tf32, table
from repmlp.bench.timing import time_interleaved
from repmlp.nn.block import from_group_rows, partition, to_group_rows, unpartition
from repmlp.speed.fc3 import KERNELS, fastest_kernel

log = logging.getLogger("bench_fc3")

# (N, C, O, H/W, h/w, g): the two block configurations, then RepMLP-ResNet-like stage shapes.
CONFIGS = [
    (32, 16, 16, 32, 8, 2),
    (32, 64, 64, 28, 7, 8),
    (32, 32, 32, 14, 7, 4),
    (32, 128, 128, 14, 7, 8),
    (32, 64, 64, 14, 7, 1),
]


def x_is_cpu_float(weight: Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def candidates(n: int, c: int, o: int, res: int, p: int, g: int, weight: Tensor, bias: Tensor):
    """name -> fn(x) for every FC3 formulation; ``weight``: ``(O*p*p, C*p*p/g)``."""
    hp = res // p
    q = o * p * p
    w4 = weight.reshape(q, -1, 1, 1)
    wg = weight.reshape(g, q // g, -1)  # (g, Q/g, P/g)
    wgt = wg.transpose(1, 2)  # (g, P/g, Q/g), a view
    wgt_c = wgt.contiguous()
    block_diag = torch.block_diag(*wg.unbind(0))  # (Q, P): g times the MACs, one dense GEMM

    def conv1x1(x: Tensor) -> Tensor:  # the paper's gMMUL
        parts = partition(x, p, p)
        y = F.conv2d(parts.reshape(parts.shape[0], -1, 1, 1), w4, bias, groups=g)
        return unpartition(y.reshape(parts.shape[0], o, p, p), n, hp, hp)

    def baddbmm_group_rows(x: Tensor) -> Tensor:  # one permute straight into (g, B, P/g), one baddbmm
        return from_group_rows(KERNELS["bmm"](to_group_rows(x, p, p, g), weight, bias), n, hp, hp, p, p)

    def onednn_group_rows(x: Tensor) -> Tensor:  # the same rows, one oneDNN 1x1 conv per group
        return from_group_rows(KERNELS["onednn"](to_group_rows(x, p, p, g), weight, bias), n, hp, hp, p, p)

    # What the inference pass runs on a CPU in float32: the form timed fastest for this shape and rows.
    picked = (
        KERNELS[fastest_kernel(g, tuple(weight.shape), True, n * hp * hp)] if x_is_cpu_float(weight) else None
    )

    def repmlp_ops(x: Tensor) -> Tensor:
        return from_group_rows(
            (picked or KERNELS["bmm"])(to_group_rows(x, p, p, g), weight, bias), n, hp, hp, p, p
        )

    def baddbmm_contig_weight(x: Tensor) -> Tensor:  # same, weight pre-transposed to (g, P/g, Q/g)
        rows = to_group_rows(x, p, p, g)
        return from_group_rows(torch.baddbmm(bias.reshape(g, 1, -1), rows, wgt_c), n, hp, hp, p, p)

    def baddbmm_weight_left(x: Tensor) -> Tensor:  # transposed problem W @ X^T: weight used as stored
        xv = x.reshape(n, g, c // g, hp, p, hp, p).permute(1, 2, 4, 6, 0, 3, 5).reshape(g, -1, n * hp * hp)
        y = torch.baddbmm(bias.reshape(g, -1, 1), wg, xv)  # (g, Q/g, B)
        return y.reshape(g, o // g, p, p, n, hp, hp).permute(4, 0, 1, 5, 2, 6, 3).reshape(n, o, res, res)

    def bmm_strided_rows(x: Tensor) -> Tensor:  # partition map (B, C, h, w) viewed as (g, B, P/g)
        parts = partition(x, p, p)
        rows = parts.reshape(parts.shape[0], g, -1).transpose(0, 1)
        y = torch.baddbmm(bias.reshape(g, 1, -1), rows, wgt)
        return unpartition(y.transpose(0, 1).reshape(parts.shape[0], o, p, p), n, hp, hp)

    def einsum_views(x: Tensor) -> Tensor:  # no explicit permute: einsum on the 7-D views
        xv = x.reshape(n, g, c // g, hp, p, hp, p)
        wv = weight.reshape(g, o // g, p, p, c // g, p, p)
        y = torch.einsum("ngcaybx,gkijcyx->ngkaibj", xv, wv)
        return (y + bias.reshape(1, g, o // g, 1, p, 1, p)).reshape(n, o, res, res)

    def linear_block_diag(x: Tensor) -> Tensor:  # dense (Q, P) block-diagonal kernel
        parts = partition(x, p, p)
        y = F.linear(parts.reshape(parts.shape[0], -1), block_diag, bias)
        return unpartition(y.reshape(parts.shape[0], o, p, p), n, hp, hp)

    fns: dict[str, Callable[[Tensor], Tensor]] = {
        "conv1x1 (paper)": conv1x1,
        "repmlp.speed.fc3 (the pass's pick)": repmlp_ops,
        "baddbmm group rows": baddbmm_group_rows,
        "oneDNN conv per group, group rows": onednn_group_rows,
        "baddbmm, weight pre-transposed": baddbmm_contig_weight,
        "baddbmm W @ X^T (columns)": baddbmm_weight_left,
        "baddbmm strided rows": bmm_strided_rows,
        "einsum on views": einsum_views,
        "linear block-diagonal": linear_block_diag,
    }
    return fns


def main() -> None:
    parser = device_arg(__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args()
    set_tf32(args.tf32)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rounds = 3 if args.quick else args.rounds
    round_s = 0.05 if args.quick else 0.2
    print(f"# bench_fc3 on {args.device} ({args.dtype}, tf32={args.tf32})\n{hardware(device)}\n")
    wins: dict[str, int] = {}
    for n, c, o, res, p, g in CONFIGS:
        torch.manual_seed(0)
        q, pg = o * p * p, c * p * p // g
        weight = (torch.randn(q, pg) / pg**0.5).to(device, dtype)
        bias = torch.randn(q).to(device, dtype)
        x = torch.randn(n, c, res, res).to(device, dtype)
        fns = candidates(n, c, o, res, p, g, weight, bias)
        with torch.no_grad():
            ref = fns["conv1x1 (paper)"](x)
            tol = 1e-4 if dtype == torch.float32 and not args.tf32 else 5e-2
            for name, fn in fns.items():
                out = fn(x)
                assert out.shape == ref.shape and out.is_contiguous(), name
                torch.testing.assert_close(out, ref, rtol=tol, atol=tol, msg=lambda m, k=name: f"{k}: {m}")
            calls = {k: (lambda f=f, x=x: f(x)) for k, f in fns.items()}
            times = time_interleaved(calls, device, rounds=rounds, min_round_s=round_s)
        macs = n * (res // p) ** 2 * q * pg
        base = times["conv1x1 (paper)"]
        best = min(times, key=times.get)
        wins[best] = wins.get(best, 0) + 1
        print(f"## N={n} C={c} O={o} H=W={res} h=w={p} g={g}  ({macs / 1e9:.3f} GMAC per call)")
        rows = [
            [k, f"{t * 1e3:.3f}", f"{macs / t / 1e9:.1f}", f"{base / t:.2f}x", "**fastest**" * (k == best)]
            for k, t in times.items()
        ]
        print(table(["FC3 formulation", "ms/call", "GMAC/s", "vs conv1x1", ""], rows) + "\n")
    print("fastest per config count:", ", ".join(f"{k}: {v}" for k, v in sorted(wins.items())))


if __name__ == "__main__":
    main()
