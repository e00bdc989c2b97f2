"""Training a Local Perceptron branch (groupwise conv + BatchNorm on the partition map) on a CPU: plain NCHW
vs what the training speed pass runs (``repmlp.speed.modules.LayoutConv2d``).

Forward and backward of one branch, ``(B, C, h, h)`` partition maps in NCHW with an NCHW gradient (as the
training-time RepMLP block hands them), ``g = 2``, for channels per group 2 to 16 and kernels 1, 3 and 7.
"NCHW" is the conv on the plain input; "channels_last" the conv on a channels_last copy, its output made
plain again (its backward gets a channels_last gradient); "repmlp" is what the library picks (channels_last
where oneDNN has no direct NCHW kernel: a group's channels not a multiple of 8, a kernel above 1x1).
Interleaved rounds, medians (``benchmarks/common.py``); each case has about the activations of the main
job's old 28x28 stage at batch 128.

    python3 benchmarks/bench_local_convs.py [--rounds 7] [--quick]
"""

from __future__ import annotations

import torch

from common import device_arg, hardware, parse_cpu_only, table
from repmlp.bench.timing import time_interleaved
from repmlp.nn.layers import ConvBN
from repmlp.speed import modules

CASES = [(cg, k, h) for cg in (2, 4, 6, 8, 16) for k in (1, 3, 7) for h in (7, 8)]


def branch_step(layer: ConvBN, x: torch.Tensor, grad: torch.Tensor, channels_last: bool | None):
    """One forward and backward of ``layer`` on ``x``: channels_last or NCHW convs, or (``None``) the
    library's own choice."""
    slow_in_nchw = modules.slow_in_nchw

    def run() -> None:
        if channels_last is not None:
            modules.slow_in_nchw = lambda conv: channels_last
        try:
            layer(x).backward(grad)
        finally:
            modules.slow_in_nchw = slow_in_nchw

    return run


def main() -> None:
    parser = device_arg(__doc__.splitlines()[0])
    args = parse_cpu_only(parser, "CPU kernels' memory layouts")
    device = torch.device("cpu")
    print(hardware(device))
    rows = []
    for cg, k, h in CASES:
        torch.manual_seed(0)
        c = 2 * cg
        b = 128 * 8 * 28 * 28 // (c * h * h)
        layer = ConvBN(c, c, k, groups=2).train()
        layer.conv.__class__ = modules.LayoutConv2d  # what the training pass makes of a partition map's conv
        x = torch.randn(b, c, h, h)
        grad = torch.randn(b, c, h, h)
        t = time_interleaved(
            {
                "nchw": branch_step(layer, x, grad, False),
                "cl": branch_step(layer, x, grad, True),
                "repmlp": branch_step(layer, x, grad, None),
            },
            device,
            rounds=3 if args.quick else args.rounds,
            min_round_s=0.05 if args.quick else 0.2,
        )
        picks = "channels_last" if modules.slow_in_nchw(layer.conv) else "NCHW"
        rows.append(
            [f"{cg}", f"{k}x{k}", f"({b}, {c}, {h}, {h})", f"{t['nchw'] * 1e3:.2f}", f"{t['cl'] * 1e3:.2f}",
             f"{t['nchw'] / t['cl']:.2f}x", picks, f"{t['nchw'] / t['repmlp']:.2f}x"]
        )  # fmt: skip
    header = ["channels / group", "kernel", "partition map", "NCHW (ms)", "channels_last (ms)",
              "channels_last vs NCHW", "repmlp picks", "repmlp vs NCHW"]  # fmt: skip
    print(table(header, rows))


if __name__ == "__main__":
    main()
