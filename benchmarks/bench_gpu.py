"""RepMLP against ResNet-50 on a GPU: deployed inference paths and the training step, side by side.

Every configuration runs in its own worker process; all workers build (and compile) at once, since a
compile is CPU work and the machine has many cores, then the parent times them in interleaved rounds, one
worker at a time on the GPU (median of the rounds, each ``k`` calls filling about ``--round-s`` seconds
between two device synchronisations: ``repmlp.bench.timing.time_calls``). Results: a Markdown summary on
stdout and in ``OUT/summary.md``, every number in ``OUT/results.json``, torch.profiler kernel tables of the
main configurations in ``OUT/profiles.txt``.

Deployed (``--phase deploy``; eval, every conv-BN folded by ``repmlp.reparameterize_model``, torchvision's
ResNet-50 too, batch 128, 224x224): torchvision's ResNet-50 (the reference), repmlp's ResNet-50
(``repmlp_res50`` with no RepMLP stage), RepMLP-Res50 and the Light Block model, every one the same way (the
plain modules, no speed pass of repmlp's own): ``eager`` and under CUDA graph replay (``graph``), cuDNN's
fused conv-bias-ReLU(-add) (``fused``, eager), ``compile`` (default mode) and the compiled model replayed as
a CUDA graph (``compile+graph``); fp16 (channels_last) and fp32 with TF32 off (channels_last and NCHW,
weights and input alike).

Training (``--phase train``; SGD with momentum, cross-entropy, batch 128, 224x224, channels_last): the same
three models in AMP bf16 and in fp32 with TF32, eager and compiled, the RepMLP models in the paper's conv
form and the dense form (:mod:`repmlp.engine.forms`); and the paper's pure MLP ``repmlp_cifar`` against the Wide
ConvNet at 32x32. ``--graphs-only``: the steps as ``repmlp train`` runs them on one GPU (the module's forward
and backward captured as CUDA graphs); ``--compiled-graphs``: the steps compiled with
``mode="reduce-overhead"`` (inductor's kernels, which fuse BatchNorm's elementwise work with its
neighbours', replayed as CUDA graphs), AMP bf16.

    PYTHONPATH=src python3 benchmarks/bench_gpu.py [--phase deploy,train] [--out DIR] [--budget-s 420]
    PYTHONPATH=src python3 benchmarks/bench_gpu.py --device cpu --quick      # a smoke run on the CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import selectors
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

# Training paths: eager, torch.compile's default mode, and reduce-overhead (inductor's fused kernels, its
# graphs replayed as CUDA graphs). The suffix each adds to a variant's name.
COMPILE_MODES = {"compile": None, "compile-ro": "reduce-overhead"}
COMPILED_SUFFIX = {"compile": " compiled", "compile-ro": " compiled+graphs"}

MODELS = {
    "tv_r50": ("ResNet-50 (torchvision)", None),
    "r50": ("ResNet-50 (repmlp)", "repmlp_res50"),
    "rmr50": ("RepMLP-Res50", "repmlp_res50"),
    "light": ("RepMLP Light", "repmlp_res50_light"),
    "cifar": ("RepMLP pure MLP (CIFAR)", "repmlp_cifar"),
    "wide": ("Wide ConvNet (CIFAR)", "wide_convnet_cifar"),
    "fmnist": ("the main job's model", "repmlp_fmnist_patch2"),
}


# ----------------------------------------------------------------------------------------------- workers
def _build(name: str, img: int):  # noqa: ANN202
    import torch
    import torchvision

    import repmlp

    torch.manual_seed(0)
    if name == "tv_r50":
        return torchvision.models.resnet50()
    if name == "r50":
        return repmlp.create_model("repmlp_res50", stages=(), img_size=img)
    if name in ("cifar", "wide"):
        return repmlp.create_model(MODELS[name][1])
    if name == "fmnist":
        return repmlp.create_model(MODELS[name][1], num_classes=10, in_chans=1)
    return repmlp.create_model(MODELS[name][1], img_size=img)


def _randomize_bn(model) -> None:  # noqa: ANN001
    import torch

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.rand(m.running_mean.shape, generator=gen) - 0.5)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) + 0.5)
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
                m.bias.copy_(torch.rand(m.bias.shape, generator=gen) - 0.5)


def _set_precision_flags(tf32: bool) -> None:
    import torch

    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def deploy_worker(spec: dict) -> dict:
    """Build one deployed model; returns ``{variant: callable}`` and facts about it."""
    import torch

    from repmlp import reparameterize_model
    from repmlp.deploy.gpu import GraphReplay, fuse_conv_epilogues, prepare_inference

    device = torch.device(spec["device"])
    img, batch = spec["img"], spec["batch"]
    _set_precision_flags(False)
    model = _build(spec["model"], img).eval()
    _randomize_bn(model)
    facts: dict = {}
    trained = model.to(device)  # every model deployed alike: BN folded, torchvision's ResNet-50 included
    deployed = reparameterize_model(trained)
    with torch.no_grad():
        x = torch.randn(4, 3, img, img, device=device)
        ref, out = trained(x), deployed(x)
        facts["conversion_rel_err"] = float((out - ref).norm() / ref.norm())
    model = deployed
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[spec["precision"]]
    model = model.to(device, dtype)
    x = torch.randn(batch, 3, img, img, device=device, dtype=dtype)
    fns = {}
    layouts = spec.get("layouts", ["cl"])
    for layout in layouts:
        fmt = torch.channels_last if layout == "cl" else torch.contiguous_format
        net = model.to(memory_format=fmt)
        xin = x.contiguous(memory_format=fmt)
        suffix = "" if len(layouts) == 1 else f" {layout}"
        if spec["path"] == "eager":
            fns[f"eager{suffix}"] = lambda n=net, v=xin: n(v)
            if device.type == "cuda":
                fns[f"graph{suffix}"] = GraphReplay(net, xin).replay
                try:
                    fused, facts["fused_ops"] = fuse_conv_epilogues(net)
                    fused(xin)
                    fns[f"fused{suffix}"] = lambda n=fused, v=xin: n(v)
                    fns[f"fused+graph{suffix}"] = GraphReplay(fused, xin).replay
                except Exception as exc:  # noqa: BLE001 - a benchmark variant that does not run is reported
                    facts["fused_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        else:
            import torch._inductor.config as inductor_config

            if spec.get("conv1x1_as_mm"):
                inductor_config.conv_1x1_as_mm = True
            t0 = time.perf_counter()
            compiled = prepare_inference(net, xin, "compile")
            facts["compile_s"] = round(time.perf_counter() - t0, 1)
            fns[f"compile{suffix}"] = lambda n=compiled, v=xin: n(v)
            if device.type == "cuda":
                fns[f"compile+graph{suffix}"] = GraphReplay(compiled, xin).replay
    return {"fns": fns, "facts": facts}


def train_worker(spec: dict) -> dict:
    """Build the training steps of one model in one precision; returns ``{variant: step}``."""
    import torch
    import torch.nn.functional as F
    from torch import Tensor

    from repmlp.engine import graph_module
    from repmlp.engine.forms import training_form

    device = torch.device(spec["device"])
    img, batch = spec["img"], spec["batch"]
    bf16 = spec["precision"] == "bf16"
    _set_precision_flags(True)  # fp32 "with TF32"; AMP bf16 runs its convs and matmuls in bf16 anyway
    fns, facts = {}, {}
    for variant in spec["variants"]:
        graphed = variant.endswith("+graph")
        model_name, form = variant.removesuffix("+graph").partition(":")[::2]
        model = _build(model_name, img).to(device).train().to(memory_format=torch.channels_last)
        if form:  # the training form: "dense" its dense Local Perceptron, "conv" the plain convs
            model = training_form(model, dense=form == "dense")  # a new tree sharing the parameters
        chans = 1 if model_name == "fmnist" else 3
        x = torch.randn(batch, chans, img, img, device=device).contiguous(memory_format=torch.channels_last)
        classes = 1000 if model_name in ("tv_r50", "r50", "rmr50", "light") else 10
        y = torch.randint(0, classes, (batch,), device=device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
        path = spec["path"]
        net = torch.compile(model, mode=COMPILE_MODES[path]) if path in COMPILE_MODES else model
        t0 = time.perf_counter()
        if graphed:  # repmlp train's CUDA graphs: the module's forward and backward replayed as graphs
            net = graph_module(model, (x,), torch.bfloat16 if bf16 else None)
        # reduce-overhead replays inductor's graphs: a new step may overwrite the last one's outputs.
        mark_step = torch.compiler.cudagraph_mark_step_begin if path == "compile-ro" else (lambda: None)

        def step(net=net, opt=opt, x=x, y=y, mark_step=mark_step) -> Tensor:  # noqa: ANN001
            mark_step()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss

        losses = [float(step().detach()) for _ in range(2)]
        if not all(math.isfinite(v) for v in losses):
            raise RuntimeError(f"{variant}: non-finite losses {losses}")
        facts[f"{variant} first_steps_s"] = round(time.perf_counter() - t0, 1)
        if path == "compile-ro":  # whether inductor kept its CUDA graphs (it skips them on some patterns)
            from torch._dynamo.utils import counters

            facts[f"{variant} cudagraph_skips"] = dict(counters["inductor"]).get("cudagraph_skips", 0)
        fns[variant + COMPILED_SUFFIX.get(path, "")] = step
    return {"fns": fns, "facts": facts}


def _profile(fn, device, steps: int = 5, rows: int = 22) -> str:  # noqa: ANN001
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    try:
        return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=90)
    except (AttributeError, KeyError):
        key = "self_device_time_total"
        return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=90)


def worker_main(spec: dict) -> None:
    """Serve the parent on stdin/stdout (one JSON line each): build, then ``time`` / ``profile`` requests."""
    import torch

    device = torch.device(spec["device"])
    out = sys.stdout
    sys.stdout = sys.stderr  # library prints must not corrupt the protocol
    try:
        t0 = time.perf_counter()
        built = deploy_worker(spec) if spec["kind"] == "deploy" else train_worker(spec)
        if device.type == "cuda":
            torch.cuda.synchronize()
            if spec["kind"] == "deploy":
                torch.cuda.empty_cache()
        ready = {"ready": True, "build_s": round(time.perf_counter() - t0, 1), "facts": built["facts"]}
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which goes on without this worker
        import traceback

        traceback.print_exc()
        ready = {"ready": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    print(json.dumps(ready), file=out, flush=True)
    if not ready["ready"]:
        return
    from repmlp.bench.timing import time_calls

    fns, reps = built["fns"], {}
    mode = torch.inference_mode() if spec["kind"] == "deploy" else torch.enable_grad()
    with mode:
        for line in sys.stdin:
            request = json.loads(line)
            reply: dict = {}
            try:
                if request["op"] == "time":
                    for name, fn in fns.items():
                        fn()  # the allocator's blocks again, after the other workers' turns
                        if name not in reps:
                            once = time_calls(fn, 1, device)
                            reps[name] = max(1, min(200, int(request["round_s"] / max(once, 1e-6))))
                        reply[name] = time_calls(fn, reps[name], device)
                elif request["op"] == "profile":
                    reply = {
                        name: _profile(fn, device) for name, fn in fns.items() if name in request["names"]
                    }
                if device.type == "cuda" and spec["kind"] == "deploy":
                    torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001
                reply = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(json.dumps(reply), file=out, flush=True)


# ------------------------------------------------------------------------------------------------ parent
class Worker:
    def __init__(self, spec: dict, log) -> None:  # noqa: ANN001
        self.spec = spec
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"), PYTHONUNBUFFERED="1")
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "4")
        cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
        )
        self.ready: dict | None = None

    def ask(self, request: dict, timeout: float) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return {"error": "no answer in time"}
        line = self.proc.stdout.readline()
        return json.loads(line) if line else {"error": f"worker exited ({self.proc.poll()})"}

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def wait_ready(workers: list[Worker], deadline: float) -> None:
    sel = selectors.DefaultSelector()
    for w in workers:
        sel.register(w.proc.stdout, selectors.EVENT_READ, w)
    pending = len(workers)
    while pending and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
            w = key.data
            line = w.proc.stdout.readline()
            w.ready = json.loads(line) if line else {"ready": False, "error": f"exited ({w.proc.poll()})"}
            sel.unregister(w.proc.stdout)
            pending -= 1
    for w in workers:
        if w.ready is None:
            w.ready = {"ready": False, "error": "not built before the deadline"}
            w.proc.kill()


def deploy_specs(device: str, quick: bool) -> list[dict]:
    img, batch = (112, 2) if quick else (224, 128)
    specs = []
    for precision in ("fp16", "fp32") if not quick else ("fp32",):
        common = dict(kind="deploy", device=device, img=img, batch=batch, precision=precision)
        layouts = ["cl", "nchw"] if precision == "fp32" else ["cl"]
        for model in ("tv_r50", "r50", "light", "rmr50"):
            specs.append(dict(common, model=model, path="eager", layouts=layouts))
            if not quick:
                specs.append(dict(common, model=model, path="compile", layouts=["cl"]))
        if not quick and precision == "fp16":
            for model in ("r50", "light"):
                specs.append(dict(common, model=model, path="compile", layouts=["cl"], conv1x1_as_mm=True))
    return specs


def train_specs(
    device: str, quick: bool, graphs_only: bool = False, compiled_graphs: bool = False
) -> list[dict]:
    """The training configurations; ``graphs_only``: the steps replayed as CUDA graphs (the eager and
    compiled ones of run 1 left out), with the main job's model eager too; ``compiled_graphs``: only the
    steps compiled with ``mode="reduce-overhead"``, AMP bf16 (ResNet-50, and the RepMLP models in both
    training forms)."""
    img, batch = (112, 2) if quick else (224, 128)
    graph = "+graph" if device == "cuda" else ""
    if compiled_graphs:
        common = dict(
            kind="train", device=device, img=img, batch=batch, precision="bf16" if not quick else "fp32"
        )
        # reduce-overhead's graphs need CUDA; --quick (a smoke run) compiles nothing
        path = "eager" if quick else "compile-ro" if device == "cuda" else "compile"
        models = ["tv_r50", "rmr50:conv", "rmr50:dense", "light:conv", "light:dense"]
        return [dict(common, variants=[m], path=path) for m in models]
    specs = []
    for precision in ("bf16", "fp32") if not quick else ("fp32",):
        common = dict(kind="train", device=device, img=img, batch=batch, precision=precision)
        if graphs_only:
            models = ["tv_r50", "rmr50:dense", "light:dense"] + (
                ["rmr50:conv"] if precision == "bf16" else []
            )
            specs += [dict(common, variants=[f"{m}{graph}"], path="eager") for m in models]
        else:
            specs.append(dict(common, variants=["tv_r50"], path="eager"))
            for model in ("rmr50", "light"):
                specs.append(dict(common, variants=[f"{model}:conv", f"{model}:dense"], path="eager"))
            if not quick:
                for model in ("tv_r50", "rmr50:dense", "light:dense"):
                    specs.append(dict(common, variants=[model], path="compile"))
        if precision == "bf16" or quick:
            cifar = dict(common, img=32, batch=128 if not quick else 4)
            names = ["cifar:conv", "cifar:dense", "wide"]
            names = [f"{n}{graph}" for n in names] if graphs_only else names
            specs.append(dict(cifar, variants=names, path="eager"))
            # The main job's model and batch (repmlp train's defaults): eager, and its forward and backward
            # as CUDA graphs (what repmlp train does on one GPU), or compiled.
            job = dict(common, img=28, batch=256 if not quick else 4)
            specs.append(dict(job, variants=["fmnist:conv", "fmnist:dense"], path="eager"))
            if graph:
                specs.append(
                    dict(job, variants=[f"fmnist:conv{graph}", f"fmnist:dense{graph}"], path="eager")
                )
            if not quick and not graphs_only:
                specs.append(dict(job, variants=["fmnist:dense"], path="compile"))
    return specs


def spec_label(spec: dict) -> str:
    if spec["kind"] == "deploy":
        extra = " conv1x1-as-mm" if spec.get("conv1x1_as_mm") else ""
        return f"{spec['precision']} {spec['model']}{extra}"
    return f"{spec['precision']}"


def run_phase(specs: list[dict], args: argparse.Namespace, log, start: float) -> list[dict]:  # noqa: ANN001
    workers = [Worker(s, log) for s in specs]
    budget_end = start + args.budget_s
    wait_ready(workers, min(budget_end - 60, time.monotonic() + args.build_s))
    live = [w for w in workers if w.ready and w.ready.get("ready")]
    for w in workers:
        print(f"# built {spec_label(w.spec)} {w.spec.get('path')} {w.spec.get('variants', '')}: {w.ready}")
    samples: dict[tuple[int, str], list[float]] = {}
    for r in range(args.rounds):
        if time.monotonic() > budget_end - 45 and r >= 2:
            print(f"# stopping after {r} rounds: the time budget")
            break
        for i, w in enumerate(live):
            reply = w.ask({"op": "time", "round_s": args.round_s}, timeout=120)
            for name, t in reply.items():
                if name != "error":
                    samples.setdefault((i, name), []).append(t)
            if "error" in reply:
                print(f"# {spec_label(w.spec)}: {reply['error']}")
    profiles = {}
    for i, w in enumerate(live):
        names = [n for (j, n) in samples if j == i and _wants_profile(w.spec, n)]
        if names and time.monotonic() < budget_end - 20:
            for name, text in w.ask({"op": "profile", "names": names}, timeout=120).items():
                profiles[f"{spec_label(w.spec)} {name}"] = text
    results = []
    for (i, name), ts in samples.items():
        spec = live[i].spec
        results.append(
            dict(
                spec=spec,
                label=spec_label(spec),
                variant=name,
                seconds=statistics.median(ts),
                rounds=len(ts),
                spread=(max(ts) - min(ts)) / statistics.median(ts),
                facts=live[i].ready.get("facts", {}),
            )
        )
    for w in workers:
        w.close()
    return results, profiles, [(spec_label(w.spec), w.spec, w.ready) for w in workers]


def _wants_profile(spec: dict, name: str) -> bool:
    if spec["kind"] == "deploy":
        return (
            spec["model"] in ("r50", "light", "rmr50")
            and name in ("compile", "eager", "fused")
            and (not spec.get("conv1x1_as_mm"))
        )
    return spec["precision"] == "bf16" and not name.startswith(("cifar", "wide"))


def summarize(deploy: list[dict], train: list[dict]) -> str:
    lines = []
    if deploy:
        lines += [
            "## Deployed, examples/s (ratio to the same path's ResNet-50; tv = torchvision compiled)",
            "",
        ]
        lines += [
            "| precision | model | variant | examples/s | vs ResNet-50 (repmlp), same variant | "
            "vs torchvision R50 compile | spread |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        ref_tv = {
            r["spec"]["precision"]: r
            for r in deploy
            if r["spec"]["model"] == "tv_r50" and r["variant"] == "compile"
        }
        for r in sorted(deploy, key=lambda r: (r["spec"]["precision"], r["label"], r["variant"])):
            p, batch = r["spec"]["precision"], r["spec"]["batch"]
            same = [
                q
                for q in deploy
                if q["spec"]["precision"] == p
                and q["spec"]["model"] == "r50"
                and q["variant"] == r["variant"]
                and bool(q["spec"].get("conv1x1_as_mm")) == bool(r["spec"].get("conv1x1_as_mm"))
            ]
            ratio = f"{same[0]['seconds'] / r['seconds']:.2f}x" if same else ""
            tv = f"{ref_tv[p]['seconds'] / r['seconds']:.2f}x" if p in ref_tv else ""
            lines.append(
                f"| {p} | {r['label'].split(' ', 1)[1]} | {r['variant']} | {batch / r['seconds']:.0f} "
                f"| {ratio} | {tv} | {100 * r['spread']:.0f}% |"
            )
    if train:
        lines += [
            "",
            "## Training step, examples/s (ratio to torchvision ResNet-50, same precision and mode)",
            "",
        ]
        lines += ["| precision | variant | examples/s | vs ResNet-50 | spread |", "|---|---|---:|---:|---:|"]
        for r in sorted(train, key=lambda r: (r["spec"]["precision"], r["variant"])):
            p, batch, compiled = r["spec"]["precision"], r["spec"]["batch"], "compiled" in r["variant"]
            suffix = "+graph" if r["variant"].split(" ")[0].endswith("+graph") else ""
            refname = "tv_r50" + suffix + (" " + r["variant"].partition(" ")[2] if compiled else "")
            if r["variant"].startswith("cifar"):
                refname = "wide" + suffix
            if r["variant"].startswith("fmnist"):
                refname = "fmnist:conv"
            ref = [q for q in train if q["spec"]["precision"] == p and q["variant"] == refname]
            ratio = f"{ref[0]['seconds'] / r['seconds']:.2f}x" if ref else ""
            lines.append(
                f"| {p} | {r['variant']} | {batch / r['seconds']:.0f} | {ratio} | {100 * r['spread']:.0f}% |"
            )
    return "\n".join(lines)


def environment(device: str) -> str:
    import torch

    lines = [f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"]
    if device == "cuda":
        lines.append(torch.cuda.get_device_name(0))
        try:
            smi = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            )
            lines.append(smi.stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    return "; ".join(lines)


def dense_check(device: str) -> str:
    """float64 forward and gradients of one block, conv form against dense form, on the device."""
    import torch

    from repmlp import RepMLPBlock
    from repmlp.engine.forms import DenseLocalPerceptron, training_form

    torch.manual_seed(0)
    block = RepMLPBlock(64, 64, 28, 7, groups=8, kernel_sizes=(1, 3, 5)).double().to(device).train()
    dense = training_form(block, dense=True)  # a new tree sharing the block's parameters
    if not any(isinstance(m, DenseLocalPerceptron) for m in dense.modules()):
        return f"dense vs conv form on {device}: the block has no dense form"
    x = torch.randn(4, 64, 28, 28, dtype=torch.float64, device=device, requires_grad=True)
    y1, y2 = block(x), dense(x)
    params = [x, *block.parameters()]
    g1 = torch.autograd.grad(y1.square().sum(), params)
    g2 = torch.autograd.grad(y2.square().sum(), params)
    scale = max(float(b.abs().max()) for b in g2)
    grad_err = max(float((a - b).abs().max()) for a, b in zip(g1, g2, strict=True)) / scale
    out_err = float((y1 - y2).detach().abs().max() / y1.detach().abs().max())
    return f"dense vs conv form, float64 on {device}: max rel output {out_err:.1e}, gradients {grad_err:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--phase", default="deploy,train")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-gpu-out"))
    parser.add_argument("--budget-s", type=float, default=480, help="wall-clock budget of the whole run")
    parser.add_argument("--build-s", type=float, default=180, help="longest a phase waits for its builds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-s", type=float, default=0.2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, no compile: a smoke run")
    parser.add_argument(
        "--graphs-only",
        action="store_true",
        help="training: only the steps as CUDA graphs (and the main job's)",
    )
    parser.add_argument(
        "--compiled-graphs",
        action="store_true",
        help='training: only the steps compiled with mode="reduce-overhead" (AMP bf16)',
    )
    args = parser.parse_args()
    start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"# {environment(args.device)}")
    print(f"# {dense_check(args.device)}")
    results: dict = {"environment": environment(args.device), "deploy": [], "train": [], "builds": []}
    profiles: dict = {}
    with open(out / "workers.log", "w") as log:
        for phase in args.phase.split(","):
            specs = (
                deploy_specs(args.device, args.quick)
                if phase == "deploy"
                else train_specs(args.device, args.quick, args.graphs_only, args.compiled_graphs)
            )
            rows, profs, builds = run_phase(specs, args, log, start)
            results[phase] = rows
            results["builds"] += [dict(label=b[0], spec=b[1], ready=b[2]) for b in builds]
            profiles.update(profs)
            (out / "results.json").write_text(json.dumps(results, indent=1))
            print(f"# phase {phase} done at {time.monotonic() - start:.0f} s")
    with open(out / "profiles.txt", "w") as fh:
        for name, text in profiles.items():
            fh.write(f"\n### {name}\n{text}\n")
    text = summarize(results["deploy"], results["train"])
    (out / "summary.md").write_text(text + "\n")
    print(text)
    print(f"# total {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker_main(json.loads(sys.argv[2]))
    else:
        main()
