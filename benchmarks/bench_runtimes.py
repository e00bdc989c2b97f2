"""Deployed RepMLP models against ResNet-50 in every CPU runtime: PyTorch, ONNX Runtime, OpenVINO.

For each runtime, precision and batch size, the deployed RepMLP-Res50-Light, RepMLP-Res50 and
RepMLPNet-B224 and torchvision's ResNet-50 (BatchNorm fused by ``repmlp.reparameterize_model``) run
interleaved, round after round, in one process (``repmlp.bench.timing.time_rounds``), and the table
gives examples/s (medians) and each model's ratio to ResNet-50 in the same cell: the median of the rounds'
ratios, with their range (a shared machine's load moves single rounds, and shows there). Every model of a
cell runs alike: PyTorch (``eager``, ``compiled``) runs the plain modules (no speed pass of repmlp's own),
weights and input channels_last for every model (``--nchw``: NCHW for every model), the runtime's name in
the table saying which; the ONNX runtimes get the graph of ``repmlp.deploy.runtimes.to_runtime`` (the
``repmlp export`` file, checked against PyTorch; NCHW), int8 the QDQ graph of
``repmlp.deploy.precision.quantize_int8`` (calibrated on random inputs: enough for speed). bf16: PyTorch's
runtimes run the models and the input in bfloat16, OpenVINO the float32 graph at its bf16 inference precision;
ONNX Runtime has no bf16 CPU kernels (no row).

    python3 benchmarks/bench_runtimes.py [--runtimes eager compiled onnxruntime openvino] [--nchw]
        [--precisions fp32 bf16 int8] [--batch-sizes 1 8 32] [--profile [--profile-shapes]] [--quick]

Every model runs alike (issue 62's fair footing): BN fused, the same runtime, precision and threads, and in
PyTorch the same memory format (channels_last; ``--nchw`` for NCHW). Beside each ratio
stands the ceiling ratio of ``repmlp.bench.roofline`` for this CPU and the cell's precision (its peak and
bandwidth measured at the start in each precision, int8's with the fastest int8 GEMM; fused accounting) and the
measured ratio's share of it: the model's share of its own roofline over ResNet-50's share, which the goal
wants at 95% or more for Light and RepMLP-Res50 at batches 8 and 32 in every runtime and precision (at batch
1, where the weights' bytes bound FC3, the ceiling ratio is below the MAC ratio). ``--profile``
then lists, per ONNX runtime, the operator types that take the time of each model (at
``--profile-batches``, default 8), from the runtime's own profiler; ``--profile-shapes`` splits ONNX Runtime's
by the operators' input shapes, in milliseconds too (a convolution's input and weight: enough to tell a model's
layers apart and compute each one's rate). ``--int8-fc3 per_group float`` adds, in the int8 cells, Light and
RepMLP-Res50 with FC3 as one int8 product per group, or left in float32. ``--batched-fc3`` adds, in the ONNX
runtimes' float32 cells, Light and RepMLP-Res50 exported with FC3 as one batched MatMul
(``export_onnx(per_group=False)``) beside the graph the runtimes get (one 2-D product per group).
The header says whether the process was started with ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647``
(glibc's malloc then keeps freed memory, so PyTorch's large activations are not faulted in afresh on every
pass: docs/benchmarks.md); the script itself leaves glibc's defaults.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import torchvision

from common import cpu_name, device_arg, parse_cpu_only, table
from repmlp import create_model, reparameterize_model
from repmlp.bench.counts import count_macs, count_params
from repmlp.bench.roofline import measure_cpu, roofline
from repmlp.bench.timing import time_rounds
from repmlp.deploy.export import export_onnx
from repmlp.deploy.precision import quantize_int8
from repmlp.deploy.runtimes import RuntimeModel, missing_runtime, onnx_bytes_of

MODELS = ("repmlp_res50_light", "repmlp_res50", "repmlpnet_b224")
REFERENCE = "resnet50"
GOAL_MODELS = ("repmlp_res50_light", "repmlp_res50")  # their share of the ceiling ratio is marked, batches 8+
RUNTIMES = ("eager", "compiled", "onnxruntime", "openvino")
TORCH_RUNTIMES = ("eager", "compiled")  # PyTorch's: run in the memory format of the run (--nchw)
SIZE = (3, 224, 224)
SHARE_GOAL = 0.95  # of the roofline's ceiling ratio, every runtime (issue 62)


def build(name: str) -> torch.nn.Module:
    net = torchvision.models.resnet50() if name == REFERENCE else create_model(name)
    return reparameterize_model(net.eval())


def runtime_label(runtime: str, channels_last: bool) -> str:
    """``runtime`` as the table names it: PyTorch's with the memory format every model runs in."""
    if runtime not in TORCH_RUNTIMES:
        return runtime
    return f"{runtime} ({'channels_last' if channels_last else 'NCHW'})"


def variants(
    nets: dict[str, torch.nn.Module], runtime: str, precision: str, batched_fc3: bool = False,
    channels_last: bool = True, int8_fc3: tuple[str, ...] = (),
) -> dict[str, object] | None:  # fmt: skip
    """name -> callable on a batch (float32; bf16 for PyTorch's runtimes in bf16; channels_last for them with
    ``channels_last``), for one runtime and precision; ``None`` when it has no such form. Every model gets the
    same treatment."""
    if precision == "int8" and runtime not in ("onnxruntime", "openvino"):
        return (
            None  # PyTorch's CPU int8 is onnxruntime's graph here (repmlp.deploy.precision): see those rows
        )
    if precision == "bf16" and runtime == "onnxruntime":
        return None  # no bf16 CPU kernels: OpenVINO's and PyTorch's rows
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if runtime in ("onnxruntime", "openvino") and missing_runtime(runtime):
        print(f"  skipped {runtime}: {missing_runtime(runtime)}", file=sys.stderr)
        return None
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = {}
    for name, net in nets.items():
        if runtime == "eager":  # the plain modules, every model in the same memory format
            out[name] = copy.deepcopy(net).to(dtype=dtype, memory_format=fmt)
        elif runtime == "compiled":
            # All repmlp ResNets share one forward's code: raise dynamo's per-code limit of compiled variants.
            torch._dynamo.config.recompile_limit = 64
            out[name] = torch.compile(copy.deepcopy(net).to(dtype=dtype, memory_format=fmt))
        else:
            # bf16: OpenVINO runs the float32 graph at its bf16 inference precision
            onnx, int8 = graphs(name, net, "int8" if precision == "int8" else "fp32")
            out[name] = RuntimeModel(onnx, runtime, int8=int8, bf16=precision == "bf16")
            if batched_fc3 and precision == "fp32" and name in GOAL_MODELS:
                out[f"{name} (batched FC3)"] = RuntimeModel(batched_graph(name, net), runtime)
            for form in int8_fc3 if precision == "int8" and name in GOAL_MODELS else ():
                out[f"{name} (int8 FC3 {form})"] = RuntimeModel(
                    graphs(name, net, "int8", form)[0], runtime, int8=True
                )
    return out


_GRAPHS: dict[tuple[str, str], tuple[bytes, bool]] = {}


def graphs(name: str, net: torch.nn.Module, precision: str, fc3: str = "batched") -> tuple[bytes, bool]:
    """The ONNX graph of ``net`` in ``precision`` (int8: with FC3 in the form ``fc3`` of ``quantize_int8``),
    built once for both runtimes."""
    key = (name, precision if precision != "int8" or fc3 == "batched" else f"int8 FC3 {fc3}")
    if key not in _GRAPHS:
        model = net
        if precision == "int8":
            gen = torch.Generator().manual_seed(0)
            model = quantize_int8(net, SIZE, [torch.randn(4, *SIZE, generator=gen)], fc3=fc3)
        _GRAPHS[key] = onnx_bytes_of(model, SIZE)
    return _GRAPHS[key]


def batched_graph(name: str, net: torch.nn.Module) -> bytes:
    """The float32 graph with every FC3 as one batched 3-D MatMul, built once for both runtimes."""
    key = (name, "batched FC3")
    if key not in _GRAPHS:
        with tempfile.TemporaryDirectory() as tmp:
            export_onnx(net, Path(tmp) / "model.onnx", SIZE, per_group=False)
            _GRAPHS[key] = ((Path(tmp) / "model.onnx").read_bytes(), False)
    return _GRAPHS[key][0]


def measure(
    fns: dict[str, object],
    batch: int,
    rounds: int,
    channels_last: bool = False,
    dtype: torch.dtype = torch.float32,
) -> dict[str, list[float]]:
    """Seconds per call of each model in each of ``rounds`` interleaved rounds (0.2 s or more each), on one
    batch in ``dtype`` (``channels_last``: in that memory format)."""
    x = torch.randn(batch, *SIZE, dtype=dtype)
    x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    calls = {name: (lambda f=f: f(x)) for name, f in fns.items()}
    with torch.inference_mode():
        return time_rounds(calls, torch.device("cpu"), rounds=rounds, warmup=2, min_round_s=0.2)


def ceiling_ratios(
    batches: list[int], precisions: list[str]
) -> tuple[str, dict[tuple[str, int, str], float]]:
    """This CPU as the roofline measures it in each precision, and each model's ceiling ratio to ResNet-50
    (fused accounting) at each batch and precision: ``(name, batch, precision) -> ratio``."""
    said, ratios = [], {}
    for precision in precisions:
        device = measure_cpu(precision)
        said.append(f"{precision} {device.peak / 1e9:.0f} G(FL)OP/s, {device.bandwidth / 1e9:.1f} GB/s")
        ratios.update({(n, b, precision): roofline(n, b, precision, device).ratio("fused")
                       for n in MODELS for b in batches})  # fmt: skip
    return "; ".join(said), ratios


def rows_for(
    runtime: str, precision: str, fns: dict[str, object], batches: list[int], rounds: int,
    ceilings: dict[tuple[str, int, str], float], channels_last: bool = False,
) -> list:  # fmt: skip
    """The table's rows of one runtime and precision: each model against ResNet-50 at each batch
    (``channels_last``: the input in that format, for PyTorch's runtimes)."""
    rows, label = [], runtime_label(runtime, channels_last)
    for b in batches:
        torch_bf16 = precision == "bf16" and runtime in TORCH_RUNTIMES
        secs = measure(fns, b, rounds, channels_last and runtime in TORCH_RUNTIMES,
                       torch.bfloat16 if torch_bf16 else torch.float32)  # fmt: skip
        ref = secs[REFERENCE]
        for name in [n for n in fns if n != REFERENCE]:
            ratios = [r / s for r, s in zip(ref, secs[name], strict=True)]  # each round's own ratio
            ratio, goal = statistics.median(ratios), ""
            roof = ceilings[name.split(" (")[0], b, precision]  # this precision's ceiling ratio
            share = f"{roof:.2f}x; {100 * ratio / roof:.0f}%"
            if name in GOAL_MODELS and b >= 8:
                share += " (met)" if ratio >= SHARE_GOAL * roof else " (**not met**)"
            if " (" in name:  # the graph the runtimes get against this form, round by round
                gains = [t / u for t, u in zip(secs[name], secs[name.split(" (")[0]], strict=True)]
                default = "per-group FC3" if name.endswith(" (batched FC3)") else "batched int8 FC3"
                goal = f"{default}: {statistics.median(gains):.2f}x ({min(gains):.2f}-{max(gains):.2f})"
            rows.append([label, precision, str(b), name, f"{b / statistics.median(secs[name]):.1f}",
                         f"{b / statistics.median(ref):.1f}", f"**{ratio:.2f}x** ({min(ratios):.2f}-{max(ratios):.2f})",
                         share, goal])  # fmt: skip
            print(f"  {label} {precision} batch {b} {name}: {ratio:.2f}x", file=sys.stderr, flush=True)
    return rows


# ------------------------------------------------------------------------ the runtimes' own profilers
def profile_onnxruntime(
    onnx: bytes, int8: bool, x: torch.Tensor, runs: int, shapes: bool = False
) -> dict[str, float]:
    """Seconds per run spent in each ONNX operator type (with ``shapes``: type and input shapes), from
    onnxruntime's profiler."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        opts.enable_profiling = True
        opts.profile_file_prefix = str(Path(tmp) / "ort")
        sess = ort.InferenceSession(onnx, opts, providers=["CPUExecutionProvider"])
        feed = {sess.get_inputs()[0].name: x.numpy()}
        for _ in range(runs):
            sess.run(None, feed)
        events = json.loads(Path(sess.end_profiling()).read_text())
    spent: dict[str, float] = defaultdict(float)
    for ev in events:
        if ev.get("cat") == "Node" and ev["name"].endswith("_kernel_time"):
            key = ev["args"]["op_name"]
            if shapes:  # the inputs' shapes, a weight's too: [{"float": [8, 64, 28, 28]}, ...]
                key += " " + " ".join(str(next(iter(t.values()))) for t in ev["args"]["input_type_shape"][:2])
            spent[key] += ev["dur"] / 1e6 / runs
    return spent


def profile_openvino(
    onnx: bytes, int8: bool, x: torch.Tensor, runs: int, shapes: bool = False
) -> dict[str, float]:
    """Seconds per run spent in each OpenVINO node type (with the kernel it chose), from PERF_COUNT; ``shapes``
    is ONNX Runtime's option only."""
    import openvino as ov

    model = RuntimeModel(onnx, "openvino")._ov_model
    model.reshape({model.inputs[0].get_any_name(): ov.PartialShape(list(x.shape))})
    config = {"PERF_COUNT": True, "INFERENCE_NUM_THREADS": torch.get_num_threads()}
    if not int8:  # as RuntimeModel: float32 graphs in float32 even on CPUs with bf16 units
        config["INFERENCE_PRECISION_HINT"] = "f32"
    req = ov.Core().compile_model(model, "CPU", config).create_infer_request()
    spent: dict[str, float] = defaultdict(float)
    for _ in range(runs):
        req.infer({0: x.numpy()})
        for info in req.get_profiling_info():
            spent[f"{info.node_type} ({info.exec_type})"] += info.real_time.total_seconds() / runs
    return spent


def profile_rows(
    nets: dict[str, torch.nn.Module], runtimes: list[str], batch: int, precision: str, shapes: bool = False
) -> list[list[str]]:
    x = torch.randn(batch, *SIZE)
    rows = []
    for runtime in runtimes:
        fn = {"onnxruntime": profile_onnxruntime, "openvino": profile_openvino}.get(runtime)
        if fn is None or missing_runtime(runtime):
            continue
        for name, net in nets.items():
            spent = fn(*graphs(name, net, precision), x, runs=3, shapes=shapes)
            total = sum(spent.values())
            top = sorted(spent.items(), key=lambda kv: -kv[1])[: 12 if shapes else 6]
            listed = ", ".join(
                f"{op} {100 * s / total:.0f}%" + (f" {1e3 * s:.2f} ms" if shapes else "") for op, s in top
            )
            rows.append([runtime, precision, name, str(batch), f"{1e3 * total:.1f}", listed])
    return rows


def main() -> None:
    parser = device_arg(__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--runtimes", nargs="+", choices=RUNTIMES, default=list(RUNTIMES))
    parser.add_argument(
        "--precisions", nargs="+", choices=("fp32", "bf16", "int8"), default=["fp32", "bf16", "int8"]
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="threads of every runtime (default: torch's)"
    )
    parser.add_argument("--profile", action="store_true", help="operator profile of each ONNX runtime (fp32)")
    parser.add_argument("--profile-batches", type=int, nargs="+", default=[8], help="batches of --profile")
    parser.add_argument(
        "--profile-shapes",
        action="store_true",
        help="--profile: ONNX Runtime's operators by input shapes too",
    )
    parser.add_argument(
        "--batched-fc3", action="store_true", help="also the graphs with FC3 as a batched MatMul"
    )
    parser.add_argument("--int8-fc3", nargs="+", choices=("per_group", "float"), default=[],
                        help="also the int8 graphs with FC3 in these forms (quantize_int8's fc3)")  # fmt: skip
    parser.add_argument(
        "--nchw", action="store_true", help="PyTorch's runtimes: every model NCHW (default: channels_last)"
    )
    args = parse_cpu_only(parser, "runtimes")
    if args.threads:
        torch.set_num_threads(args.threads)
    kept = os.environ.get("MALLOC_MMAP_MAX_") == "0"
    rounds = 2 if args.quick else args.rounds
    batches = [1] if args.quick else args.batch_sizes
    nets = {name: build(name) for name in (*MODELS, REFERENCE)}
    macs = {name: count_macs(net, SIZE) for name, net in nets.items()}
    rates, ceilings = ceiling_ratios(batches, args.precisions)
    layout = "NCHW" if args.nchw else "channels_last"
    print(
        "**bench_runtimes: deployed models vs ResNet-50 in each CPU runtime; every model BN fused and run "
        f"alike (PyTorch: the plain modules, {layout}, weights and input; the ONNX runtimes: NCHW)**"
    )
    print(
        f"CPU: {cpu_name()}; {torch.get_num_threads()} threads in every runtime; torch {torch.__version__}; "
        f"the roofline's peak and bandwidth, measured: {rates}; MALLOC_MMAP_MAX_=0: {'yes' if kept else 'no'}\n"
    )
    rows = []
    for precision in args.precisions:
        for runtime in args.runtimes:
            fns = variants(nets, runtime, precision, args.batched_fc3, not args.nchw, tuple(args.int8_fc3))
            if fns is not None:
                rows += rows_for(runtime, precision, fns, batches, rounds, ceilings, not args.nchw)
    header = [
        "runtime",
        "precision",
        "batch",
        "model",
        "model ex/s",
        "ResNet-50 ex/s",
        "vs ResNet-50 (range over rounds)",
        f"ceiling ratio; share (>= {100 * SHARE_GOAL:.0f}%)",
        "goal",
    ]
    print(table(header, rows))
    ratios = ", ".join(f"{n} {macs[REFERENCE] / macs[n]:.2f}x" for n in MODELS)
    params = ", ".join(f"{n} {count_params(net) / 1e6:.1f}M" for n, net in nets.items())
    print(
        f"\nMedians of {rounds} interleaved rounds (a ratio: of the rounds' own ratios). MAC ratios (ResNet-50's "
        "MACs / the model's, the speed ratio "
        f"at equal work per second): {ratios}. Deployed parameters (the bytes a batch-1 pass reads): "
        f"{params}. int8: the QDQ graph of repmlp.deploy.precision.quantize_int8 (per-channel weights, FC3's "
        "per tensor, reshapes and transposes in float), run by each ONNX runtime with its own int8 kernels; "
        "bf16: OpenVINO's inference precision on the float32 graph; eager/compiled are PyTorch "
        f"(compiled: torch.compile), every model {layout}, the plain modules."
    )
    if args.profile:
        runtimes = [r for r in args.runtimes if r not in ("eager", "compiled")]
        header = [
            "runtime",
            "precision",
            "model",
            "batch",
            "ms per run",
            "top operator types (share of run time)",
        ]
        for precision in args.precisions:
            for batch in args.profile_batches:
                print(f"\n**Where the time goes: each runtime's own profiler, {precision}, batch {batch}**\n")
                print(table(header, profile_rows(nets, runtimes, batch, precision, args.profile_shapes)))


if __name__ == "__main__":
    main()
