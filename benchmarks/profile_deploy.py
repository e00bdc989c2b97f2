"""Where a deployed RepMLP-ResNet's time goes, stage by stage, against ResNet-50 (float32, CPU).

Times the stem and c2..c5 of a deployed RepMLP-Res50 family model, torchvision's ResNet-50 (each stage's
BN fused by ``repmlp.reparameterize_model``) and repmlp's own deployed ResNet-50 (`repmlp_res50` with
``stages=()``: same structure, BN fused), interleaved, each stage fed the activation its own model produces.
Every model runs alike: the plain modules (no speed pass of repmlp's own), weights and input channels_last
(``--nchw``: NCHW), eager or (``--compile``) compiled. Then the bound this puts on the whole-model ratio: the
ratio if the stages holding RepMLPs took no time at all. Beside each stage: the model's speed and MAC ratio
against our ResNet-50 and their quotient, the model's MAC rate as a share of ResNet-50's there. Last, the
deployed model's top operators (``torch.profiler``). ``--compile``: every stage and the profiled model
through ``torch.compile`` (Inductor's generated kernels named in the profile, by kind).

    python3 benchmarks/profile_deploy.py [--model repmlp_res50_light] [--batch-size 8] [--rounds 7] [--compile]
        [--nchw]
"""

from __future__ import annotations

import re

import torch
import torch._inductor.config
import torchvision
from torch import nn

from common import cpu_name, device_arg, parse_cpu_only, table
from repmlp import create_model, reparameterize_model
from repmlp.bench.counts import count_macs
from repmlp.bench.timing import time_interleaved

STAGES = ("stem", "c2", "c3", "c4", "c5")


def stages_of(model: nn.Module) -> list[nn.Module]:
    """The stem and the four stages of a torchvision or repmlp ResNet, in order (BN fused by the caller)."""
    if isinstance(model, torchvision.models.ResNet):
        stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
        return [stem, model.layer1, model.layer2, model.layer3, model.layer4]
    return [model.stem, model.layer1, model.layer2, model.layer3, model.layer4]


def stage_inputs(stages: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """The input each of ``stages`` sees when they run one after the other on ``x``."""
    inputs = []
    with torch.inference_mode():
        for stage in stages:
            inputs.append(x)
            x = stage(x)
    return inputs


def stage_times(
    models: dict[str, list[nn.Module]], x: torch.Tensor, rounds: int, compiled: bool = False
) -> dict[str, list[float]]:
    """Seconds per call of every stage of every model (name -> its stages), each stage's models
    interleaved; ``compiled``: each stage through its own ``torch.compile``."""
    inputs = {name: stage_inputs(ss, x) for name, ss in models.items()}
    stages = dict(models)
    if compiled:
        stages = {name: [torch.compile(s) for s in ss] for name, ss in stages.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(len(STAGES)):
        fns = {name: (lambda s=stages[name][i], a=inputs[name][i]: s(a)) for name in models}
        with torch.inference_mode():
            secs = time_interleaved(fns, torch.device("cpu"), rounds=rounds)
        for name in models:
            times[name].append(secs[name])
    return times


def stage_macs(stages: list[nn.Module]) -> list[int]:
    """Multiply-accumulates of each of ``stages`` for one 224x224 image."""
    inputs = stage_inputs(stages, torch.randn(1, 3, 224, 224))
    return [count_macs(s, tuple(a.shape[1:])) for s, a in zip(stages, inputs, strict=True)]


def top_operators(model: nn.Module, x: torch.Tensor, k: int = 8, compiled: bool = False) -> list[list[str]]:
    """The ``k`` operators (by input shapes) taking the most self CPU time in 3 passes of ``model``; with
    ``compiled``, of ``torch.compile(model)``, Inductor's kernels grouped by kind (their fused ops)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), torch._inductor.config.patch({"cpp.enable_kernel_profile": compiled}):
        model = torch.compile(model) if compiled else model
        model(x)
        model(x)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(3):
                model(x)
    spent: dict[tuple[str, str], float] = {}
    for e in prof.key_averages(group_by_input_shape=True):
        key = (re.sub(r"^graph_\d+_cpp_(.*?)(_\d+)?$", r"inductor: \1", e.key), str(e.input_shapes[:2]))
        spent[key] = spent.get(key, 0.0) + e.self_cpu_time_total
    total = sum(spent.values())
    top = sorted(spent.items(), key=lambda kv: -kv[1])[:k]
    return [
        [op, shapes.replace("|", "/"), f"{100 * t / total:.1f}%", f"{t / 3e3:.2f}"] for (op, shapes), t in top
    ]


def main() -> None:
    parser = device_arg(__doc__.splitlines()[0])
    parser.add_argument("--model", default="repmlp_res50_light")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--compile", action="store_true", help="the stages and the profile through torch.compile"
    )
    parser.add_argument("--top", type=int, default=8, help="operators listed")
    parser.add_argument("--nchw", action="store_true", help="every model NCHW (default: channels_last)")
    args = parse_cpu_only(parser, "deployment")
    # Every repmlp ResNet stage shares one forward's code: room for each model's compiled variants.
    torch._dynamo.config.recompile_limit = 64
    rounds = 2 if args.quick else args.rounds
    fmt = torch.contiguous_format if args.nchw else torch.channels_last
    net = reparameterize_model(create_model(args.model).eval()).to(memory_format=fmt)
    ours = reparameterize_model(create_model("repmlp_res50", stages=()).eval())
    models = {  # name -> its stages, every one BN fused, in the same memory format
        args.model: stages_of(net),
        "torchvision ResNet-50": stages_of(reparameterize_model(torchvision.models.resnet50().eval())),
        "our ResNet-50": stages_of(ours),
    }
    models = {name: [s.to(memory_format=fmt) for s in ss] for name, ss in models.items()}
    x = torch.randn(args.batch_size, 3, 224, 224).contiguous(memory_format=fmt)
    layout = "NCHW" if args.nchw else "channels_last"
    print(
        f"**profile_deploy: {args.model} (deployed) stage by stage, batch {args.batch_size}, "
        f"{'compiled' if args.compile else 'eager'} float32, every model BN fused and {layout} (weights and "
        "input)**"
    )
    print(f"CPU: {cpu_name()}; {torch.get_num_threads()} torch threads; torch {torch.__version__}\n")
    times = stage_times(models, x, rounds, args.compile)
    macs = {n: stage_macs(m) for n, m in models.items() if n != "torchvision ResNet-50"}
    ours, mine = times["our ResNet-50"], times[args.model]
    speed = [a / b for a, b in zip(ours, mine, strict=True)] + [sum(ours) / sum(mine)]
    work = [a / b for a, b in zip(macs["our ResNet-50"], macs[args.model], strict=True)]
    work.append(sum(macs["our ResNet-50"]) / sum(macs[args.model]))
    rows = [[s, *(f"{1000 * times[n][i]:.1f}" for n in models)] for i, s in enumerate(STAGES)]
    rows.append(["**total**", *(f"**{1000 * sum(times[n]):.1f}**" for n in models)])
    for row, v, w in zip(rows, speed, work, strict=True):  # the speed ratio over the work ratio: rate's share
        row += [f"{v:.2f}x", f"{w:.2f}x", f"{100 * v / w:.0f}%"]
    extra = ["speed vs ours", "MAC ratio vs ours", "MAC rate vs ours"]
    print(table(["stage", *(f"{n} (ms)" for n in models), *extra], rows))
    repmlp_stages = [i + 1 for i, s in enumerate(net.stages) if any("RepMLP" in type(b).__name__ for b in s)]
    rest = sum(t for i, t in enumerate(times[args.model]) if i not in repmlp_stages)
    ref = sum(times["torchvision ResNet-50"])
    names = ", ".join(STAGES[i] for i in repmlp_stages)
    print(
        f"\nWhole model vs torchvision's ResNet-50: **{ref / sum(times[args.model]):.2f}x**; vs our ResNet-50: "
        f"{sum(times['our ResNet-50']) / sum(times[args.model]):.2f}x. Bound if the stages with RepMLPs "
        f"({names}) took no time: {ref / rest:.2f}x vs torchvision's, "
        f"{sum(times['our ResNet-50']) / rest:.2f}x vs ours.\n"
    )
    print(f"Top operators of deployed {args.model} (self CPU time, 3 passes):\n")
    rows = top_operators(net, x, args.top, args.compile)
    print(table(["operator", "input shapes (first two)", "share", "ms per pass"], rows))


if __name__ == "__main__":
    main()
