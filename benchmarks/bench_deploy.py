"""Deployed models under the standard inference treatments, against torchvision's ResNet-50.

For each treatment and batch size, every model is timed interleaved with torchvision's ResNet-50 under
the same treatment (same input size), and the table gives examples/s and the ratio to ResNet-50. Every
model of a cell, torchvision's ResNet-50 included, gets the same treatment: BatchNorm fused
(``repmlp.reparameterize_model``), the plain modules (no speed pass of repmlp's own), the same memory format
(weights and input), precision and compile:

* ``eager``: float32, NCHW;  ``channels_last``: float32, eager, channels_last;
* ``compiled``: float32 ``torch.compile`` (inductor), channels_last;  ``bf16``: bfloat16, eager, channels_last;
* ``bf16_compiled``: the same compiled;  ``int8``: onnxruntime static int8, NCHW (``repmlp.deploy.precision``,
  calibrated on random inputs: enough for speed).

Models: deployed RepMLP-Res50 and RepMLP-Res50-Light (224x224), deployed ``repmlp_cifar`` (32x32; its
ResNet-50 reference runs at 32x32 too); each also against *our* deployed ResNet-50 (same structure, built
by repmlp: BN fused, same kernels and layout), which isolates the RepMLP blocks' own gain. It also
measures this machine's matmul peak (a 2048x2048 matmul, same dtype, the faster of ``torch.mm`` and a
oneDNN 1x1 conv) and the fraction of it that deployed ``repmlp_cifar`` reaches (MACs / time).

    python3 benchmarks/bench_deploy.py [--batch-sizes 1 8 32] [--treatments eager compiled ...] [--quick]

Goals (issue 9, 2-core machines): Light >= 1.55x and RepMLP-Res50 >= 1.0x ResNet-50 under eager fp32,
compiled fp32 and compiled bf16 (where the CPU has native bf16); repmlp_cifar >= 70% of fp32 matmul peak.
The ratio goals were set when the RepMLP side ran channels_last and ResNet-50 NCHW; on the fair footing
(issue 62) the goal is a share of the roofline's ceiling ratio, which ``bench_runtimes.py`` prints.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torchvision

from common import cpu_name, device_arg, parse_cpu_only, table
from repmlp import create_model, reparameterize_model
from repmlp.bench.counts import count_macs
from repmlp.bench.timing import time_interleaved
from repmlp.deploy.precision import native_support, to_precision

TREATMENTS = ("eager", "channels_last", "compiled", "bf16", "bf16_compiled", "int8")
# How each treatment runs every model of its cell, as the table names it.
LABELS = {
    "eager": "eager, fp32, NCHW",
    "channels_last": "eager, fp32, channels_last",
    "compiled": "compiled, fp32, channels_last",
    "bf16": "eager, bf16, channels_last",
    "bf16_compiled": "compiled, bf16, channels_last",
    "int8": "onnxruntime, int8, NCHW",
}
MODELS = {"repmlp_res50": 224, "repmlp_res50_light": 224, "repmlp_cifar": 32}
_GOALS = {"repmlp_res50": 1.0, "repmlp_res50_light": 1.55}
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16", "amx_int8")


def cpu_flags() -> str:
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    have = flags.split(":", 1)[1].split()
    return ", ".join(f for f in _FLAGS if f in have) or "none of " + ", ".join(_FLAGS)


def build(name: str) -> torch.nn.Module:
    """Model ``name`` deployed: BN fused (torchvision's ResNet-50 too, as ``repmlp bench`` deploys it)."""
    if name == "resnet50":
        return reparameterize_model(torchvision.models.resnet50().eval())
    if name == "our_resnet50":  # torchvision's ResNet-50 structure in repmlp's code, BN fused
        return reparameterize_model(create_model("repmlp_res50", stages=(), num_classes=1000).eval())
    return reparameterize_model(create_model(name).eval())


def allocator() -> str:
    """The memory allocator settings in effect (they change CPU timings: see docs/benchmarks.md)."""
    tuned = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "LD_PRELOAD"}
    return ", ".join(f"{k}={v}" for k, v in sorted(tuned.items())) or "glibc malloc, default settings"


def treated(model: torch.nn.Module, treatment: str, size: tuple[int, int, int]) -> tuple[object, torch.dtype]:
    """(callable taking a batch from :func:`make_input`, the dtype the input is fed in): ``model`` under
    ``treatment``, the same for every model (:data:`LABELS`)."""
    model = copy.deepcopy(model)
    if treatment == "int8":
        gen = torch.Generator().manual_seed(0)
        return to_precision(
            model, "int8", [torch.randn(4, *size, generator=gen)], input_size=size
        ), torch.float32
    dtype = torch.bfloat16 if treatment.startswith("bf16") else torch.float32
    model = model.to(dtype)
    if treatment != "eager":
        model = model.to(memory_format=torch.channels_last)
    if treatment.endswith("compiled"):
        # Every repmlp ResNet shares ResNet.forward's code: dynamo's default limit of 8 compiled variants
        # per code object (models x batch sizes) would silently leave the later ones running eager.
        torch._dynamo.config.recompile_limit = 64
        model = torch.compile(model)
    return model, dtype


def make_input(batch: int, size: tuple[int, int, int], dtype: torch.dtype, treatment: str) -> torch.Tensor:
    x = torch.randn(batch, *size).to(dtype)
    return x if treatment in ("eager", "int8") else x.contiguous(memory_format=torch.channels_last)


def matmul_fns(dtype: torch.dtype, n: int = 2048) -> dict:
    """An ``n x n`` by ``n x n`` matmul in ``dtype`` (``n**3`` MACs), two ways, as zero-argument callables:
    ``torch.mm`` (PyTorch's BLAS) and a oneDNN 1x1 conv over ``n`` channels_last pixels (oneDNN's own
    GEMM). The machine's peak is the faster of the two."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    image = b.t().contiguous().reshape(1, n, 1, n).permute(0, 3, 1, 2)  # (1, n, n, 1), channels_last
    kernel = a.reshape(n, n, 1, 1)
    return {"mm": lambda: torch.mm(a, b), "onednn": lambda: torch.nn.functional.conv2d(image, kernel)}


def run_treatment(treatment: str, batches: list[int], rounds: int) -> list[list[str]]:
    rows = []
    nets = {name: build(name) for name in ("resnet50", "our_resnet50", *MODELS)}
    refs: dict[int, tuple] = {}  # the references per input size, treated (compiled) once
    for name, res in MODELS.items():
        size = (3, res, res)
        if res not in refs:
            refs[res] = (
                *treated(nets["resnet50"], treatment, size),
                treated(nets["our_resnet50"], treatment, size)[0],
            )
        ref, dtype, ours = refs[res]
        net, _ = treated(nets[name], treatment, size)
        for b in batches:
            x = make_input(b, size, dtype, treatment)
            fns = {
                "ref": lambda r=ref, x=x: r(x),
                "ours": lambda o=ours, x=x: o(x),
                "net": lambda n=net, x=x: n(x),
            }
            with torch.inference_mode():
                secs = time_interleaved(fns, torch.device("cpu"), rounds=rounds, warmup=2)
            ratio = secs["ref"] / secs["net"]
            goal = ""
            if name in _GOALS and treatment in ("eager", "compiled", "bf16_compiled"):
                goal = f">= {_GOALS[name]}x: " + ("met" if ratio >= _GOALS[name] else "**not met**")
            rows.append(
                [
                    LABELS[treatment],
                    name,
                    f"{res}",
                    str(b),
                    f"{b / secs['net']:.1f}",
                    f"{b / secs['ref']:.1f}",
                    f"**{ratio:.2f}x**",
                    f"{secs['ours'] / secs['net']:.2f}x",
                    goal,
                ]
            )
            print(f"  {treatment} {name} batch {b}: {ratio:.2f}x", flush=True, file=sys.stderr)
    return rows


def cifar_peak_fraction(batch: int, rounds: int) -> list[list[str]]:
    """Deployed repmlp_cifar's MAC rate as a fraction of the matmul peak: fp32 (eager and compiled), bf16."""
    net = build("repmlp_cifar")
    macs = count_macs(net, (3, 32, 32)) * batch
    rows = []
    n = 2048
    for dtype, label in ((torch.float32, "fp32"), (torch.float32, "fp32 compiled"), (torch.bfloat16, "bf16")):
        model = copy.deepcopy(net).to(dtype)
        if label.endswith("compiled"):
            model = torch.compile(model)
        x = torch.randn(batch, 3, 32, 32).to(dtype)
        # Model and matmul interleaved: the machine's load hits both alike.
        fns = {"net": lambda m=model, x=x: m(x), **matmul_fns(dtype, n)}
        with torch.inference_mode():
            secs = time_interleaved(fns, torch.device("cpu"), rounds=rounds)
        rate, peak = macs / secs["net"] / 1e9, n**3 / min(secs["mm"], secs["onednn"]) / 1e9
        goal = (
            ">= 70%: " + ("met" if rate >= 0.7 * peak else "**not met**") if label.startswith("fp32") else ""
        )
        rows.append(
            [
                label,
                str(batch),
                f"{macs / 1e9:.2f}",
                f"{rate:.1f}",
                f"{n**3 / secs['mm'] / 1e9:.1f}",
                f"{n**3 / secs['onednn'] / 1e9:.1f}",
                f"**{100 * rate / peak:.0f}%**",
                goal,
            ]
        )
    return rows


def main() -> None:
    parser = device_arg(__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--treatments", nargs="+", choices=TREATMENTS, default=list(TREATMENTS))
    parser.add_argument("--cifar-batch", type=int, default=128, help="batch of the matmul-peak comparison")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's; 1 on a shared machine)",
    )
    args = parse_cpu_only(parser, "deployment")
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = 2 if args.quick else args.rounds
    batches = [1] if args.quick else args.batch_sizes
    print(
        "**bench_deploy: deployed models vs torchvision ResNet-50, per treatment; every model of a cell, "
        "ResNet-50 included, BN fused and run alike (the treatment's runtime, precision and memory format)**"
    )
    print(
        f"CPU: {cpu_name()}, flags: {cpu_flags()}; {torch.get_num_threads()} torch threads; torch {torch.__version__}; "
        f"allocator: {allocator()}"
    )
    reason = native_support("bf16")
    if reason:
        print(f"\nNote: {reason}.")
    print()
    rows = []
    for treatment in args.treatments:
        rows += run_treatment(treatment, batches, rounds)
    header = [
        "treatment",
        "model",
        "input",
        "batch",
        "model ex/s",
        "ResNet-50 ex/s",
        "vs ResNet-50",
        "vs our ResNet-50",
        "goal",
    ]
    print(table(header, rows))
    print(
        f"\nMedians of {rounds} interleaved rounds (model, torchvision's ResNet-50 and ours alternate); ResNet-50 "
        "at the same input size. *Our ResNet-50* is torchvision's structure built by repmlp "
        "(`repmlp_res50` with `stages=()`), deployed: BN fused, the same kernels as the RepMLP models, so "
        "that column isolates what the RepMLP blocks themselves gain. torchvision's ResNet-50 is BN fused too "
        "(`repmlp.reparameterize_model`); every model of a row runs the treatment's memory format."
    )
    print(
        "\n**Deployed repmlp_cifar vs this machine's matmul peak (2048x2048 matmul, same dtype, the faster "
        "of torch.mm and oneDNN, interleaved with the model)**\n"
    )
    header = [
        "dtype",
        "batch",
        "GMAC/pass",
        "model GMAC/s",
        "torch.mm GMAC/s",
        "oneDNN GMAC/s",
        "fraction",
        "goal",
    ]
    print(table(header, cifar_peak_fraction(args.cifar_batch, rounds)))


if __name__ == "__main__":
    main()
