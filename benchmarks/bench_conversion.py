"""Conv-to-FC conversion: the direct construction (``conv_to_fc``) vs the paper's identity-matrix one.

Part 1 - the issue's case (C=O=64, h=w=8, K=7; also g=8): time per conversion (interleaved medians)
and peak *extra* memory of one conversion, as a multiple of the FC kernel's own size
(``O*h*w * C*h*w/g`` elements); goal: direct >= 10x faster, peak extra <= 2x the kernel.

Part 2 - scaling with C at h=w=14, g=1, K=7: time and peak extra memory of each construction for the
sizes that fit ``--max-gb``, and the memory each needs at C=512 (where the FC kernel alone is 40 GB in
float32): the identity construction's measured multiple applied to the kernel size. On a GPU with
room for one kernel but not for the identity construction's multiple, the direct one is run at C=512.

How peak memory is measured:
* CPU: each measurement runs in a fresh subprocess (this script with ``--child``). After building the
  kernel and one small warm-up conversion it resets the kernel's peak-RSS counter (writing ``5`` to
  ``/proc/self/clear_refs``, which resets ``VmHWM``), converts once, and reports
  ``VmHWM - VmRSS(before)`` from ``/proc/self/status``: the resident-memory high-water mark the
  conversion added, output included. (tracemalloc does not see torch's allocations.) Falls back to
  ``ru_maxrss`` differences if ``clear_refs`` is not writable.
* CUDA: ``torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()`` around the conversion,
  after ``torch.cuda.reset_peak_memory_stats()``, in-process.

    python3 benchmarks/bench_conversion.py [--device cuda] [--max-gb 3] [--quick]
"""

from __future__ import annotations

import json
import logging
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import device_arg, hardware, set_tf32, table
from repmlp import conv_to_fc, conv_to_fc_identity
from repmlp.bench.timing import time_interleaved

log = logging.getLogger("bench_conversion")
METHODS = {"direct": conv_to_fc, "identity": conv_to_fc_identity}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def kernel_bytes(c: int, o: int, p: int, g: int, itemsize: int = 4) -> int:
    """Bytes of the FC kernel ``(O*h*w, C*h*w/g)``."""
    return o * p * p * (c * p * p // g) * itemsize


def identity_bytes(c: int, p: int, g: int, itemsize: int = 4) -> int:
    """Bytes of the paper's identity feature map ``(C*h*w/g, C, h, w)``."""
    return (c * p * p // g) * c * p * p * itemsize


def _make_kernel(c: int, k: int, g: int, device: torch.device) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(c, c // g, k, k, device=device)


def child(method: str, c: int, p: int, k: int, g: int) -> None:
    """Runs in a subprocess: one CPU conversion, prints JSON with its time and peak extra bytes."""
    kernel = _make_kernel(c, k, g, torch.device("cpu"))
    METHODS[method](kernel[:, :, :1, :1].contiguous(), None, 1, g)  # warm-up: load code paths
    try:
        Path("/proc/self/clear_refs").write_text("5")
        mode = "VmHWM"
        before = _status_kb("VmRSS")
    except OSError:
        mode = "ru_maxrss"
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    fc, _ = METHODS[method](kernel, None, p, g)
    seconds = time.perf_counter() - t0
    peak = _status_kb("VmHWM") if mode == "VmHWM" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert fc.shape == (c * p * p, c * p * p // g)
    print(json.dumps({"seconds": seconds, "peak_extra_bytes": (peak - before) * 1024, "mode": mode}))


def measure_cpu(method: str, c: int, p: int, k: int, g: int) -> dict:
    cmd = [sys.executable, __file__, "--child", method, str(c), str(p), str(k), str(g)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        return {"error": (res.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure_cuda(method: str, c: int, p: int, k: int, g: int, device: torch.device) -> dict:
    kernel = _make_kernel(c, k, g, device)
    METHODS[method](kernel[:, :, :1, :1].contiguous(), None, 1, g)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    try:
        t0 = time.perf_counter()
        fc, _ = METHODS[method](kernel, None, p, g)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    except torch.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        return {"error": f"CUDA out of memory ({str(exc).splitlines()[0][:80]}...)"}
    out = {"seconds": seconds, "peak_extra_bytes": torch.cuda.max_memory_allocated(device) - before}
    del fc
    torch.cuda.empty_cache()
    return out


def measure(method: str, c: int, p: int, k: int, g: int, device: torch.device) -> dict:
    if device.type == "cuda":
        return measure_cuda(method, c, p, k, g, device)
    return measure_cpu(method, c, p, k, g)


def _mem_cell(m: dict, kb: int) -> str:
    if "error" in m:
        return m["error"]
    return f"{m['peak_extra_bytes'] / 2**20:.0f} MiB ({m['peak_extra_bytes'] / kb:.2f}x)"


def part1(device: torch.device, rounds: int, round_s: float) -> None:
    print("## Part 1: C=O=64, h=w=8, K=7 (goal: direct >= 10x faster, peak extra <= 2x kernel)")
    rows = []
    for g in (1, 8):
        c, p, k = 64, 8, 7
        kernel = _make_kernel(c, k, g, device)
        a, _ = conv_to_fc(kernel, None, p, g)
        b, _ = conv_to_fc_identity(kernel, None, p, g)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        del a, b
        t = time_interleaved(
            {name: (lambda f=f, k=kernel, p=p, g=g: f(k, None, p, g)) for name, f in METHODS.items()},
            device,
            rounds=rounds,
            min_round_s=round_s,
        )
        kb = kernel_bytes(c, c, p, g)
        mem = {name: measure(name, c, p, k, g, device) for name in METHODS}
        speed = t["identity"] / t["direct"]
        direct_x = mem["direct"].get("peak_extra_bytes", float("inf")) / kb
        goal = "met" if speed >= 10 and direct_x <= 2 else "MISSED"
        rows.append(
            [
                f"g={g}",
                f"{kb / 2**20:.0f} MiB",
                f"{t['direct'] * 1e3:.2f}",
                f"{t['identity'] * 1e3:.2f}",
                f"**{speed:.1f}x**",
                _mem_cell(mem["direct"], kb),
                _mem_cell(mem["identity"], kb),
                goal,
            ]
        )
    header = [
        "groups",
        "FC kernel",
        "direct ms",
        "identity ms",
        "speed-up",
        "direct peak extra",
        "identity peak extra",
        "goal",
    ]
    print(table(header, rows) + "\n")


def part2(device: torch.device, max_gb: float, quick: bool) -> None:
    p, k, g = 14, 7, 1
    limit = "CUDA: every size attempted" if device.type == "cuda" else f"runs limited to ~{max_gb:g} GB"
    print(f"## Part 2: scaling in C at h=w={p}, g={g}, K={k} ({limit})")
    channels = [8, 16, 32] if quick else [8, 16, 32, 64, 128, 256, 512]
    rows = []
    identity_multiple = None
    for c in channels:
        kb = kernel_bytes(c, c, p, g)
        row = [str(c), f"{kb / 2**20:.0f} MiB", f"{identity_bytes(c, p, g) / 2**20:.0f} MiB"]
        cells = {}
        for name in METHODS:
            # Predict from the measured multiple (identity) or ~1x (direct) before trying.
            multiple = (identity_multiple or 5.0) if name == "identity" else 1.2
            # On CUDA an allocation that does not fit fails cleanly (OutOfMemoryError), so every size
            # is attempted; on the CPU it would take the machine down, so predicted misfits are skipped.
            if device.type != "cuda" and kb * multiple > max_gb * 2**30:
                cells[name] = {"error": f"skipped: needs ~{kb * multiple / 2**30:.1f} GB"}
                continue
            cells[name] = measure(name, c, p, k, g, device)
            if name == "identity" and "peak_extra_bytes" in cells[name]:
                identity_multiple = cells[name]["peak_extra_bytes"] / kb
        for name in METHODS:
            m = cells[name]
            row.append(f"{m['seconds']:.3f}" if "seconds" in m else "-")
        for name in METHODS:
            row.append(_mem_cell(cells[name], kb))
        rows.append(row)
    header = ["C", "FC kernel", "identity matrix", "direct s", "identity s", "direct peak", "identity peak"]
    print(table(header, rows) + "\n")
    c = 512
    kb = kernel_bytes(c, c, p, g)
    ident = identity_multiple if identity_multiple is not None else float("nan")
    print(
        f"At C={c}, h=w={p}, g={g}: the FC kernel is {kb / 1e9:.1f} GB in float32 and the identity "
        f"matrix {identity_bytes(c, p, g) / 1e9:.1f} GB. With the multiples measured above, the identity "
        f"construction needs ~{ident * kb / 1e9:.0f} GB at its peak, the direct one ~{kb / 1e9:.0f} GB "
        f"(the output itself).\n"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        method, c, p, k, g = sys.argv[2], *map(int, sys.argv[3:7])
        child(method, c, p, k, g)
        return
    parser = device_arg(__doc__.splitlines()[0])
    parser.add_argument("--max-gb", type=float, default=3.0, help="skip runs predicted to need more")
    args = parser.parse_args()
    set_tf32(args.tf32)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    rounds = 3 if args.quick else args.rounds
    round_s = 0.05 if args.quick else 0.2
    print(f"# bench_conversion on {args.device}\n{hardware(device)}\n")
    part1(device, rounds, round_s)
    part2(device, args.max_gb, args.quick)


if __name__ == "__main__":
    main()
