"""RepMLPBlock speed against the paper's formulation of the same block, measured side by side.

(a) deployed block (inference form, ``torch.no_grad``) vs the paper's deployed block (FC3 as a grouped
    1x1 conv), batch 32 - goal >= 5x throughput;
(b) one training step (forward + backward + SGD step) of the training-time block vs the paper's
    training-time formulation (FC3 as grouped 1x1 conv + BN1d, each Local Perceptron branch a grouped
    conv + BN in NCHW) - goal >= 3x;
(c) batch 1: our deployed block vs our training-time block (eval mode, ``no_grad``) - goal >= 1x;
(d) the 1-D block (``RepMLPBlock1d``, ``(N, C, L)``) beside a 2-D block with as many partitions of as
    many positions: deployed vs training-time (eval mode, ``no_grad``), batch 32.

The paper's blocks (:class:`PaperRepMLPBlock`, written from the paper's Sec. 3.2: partitions by one permute
of NCHW, the Global Perceptron added by broadcasting, FC3 as a grouped 1x1 conv on the ``(B, C*h*w, 1, 1)`` map
then BN, each Local Perceptron branch a grouped conv + BN on the NCHW partition map) are built with copies of
our block's weights and checked to give the same outputs before anything is timed. Times are medians of
interleaved rounds (``repmlp.bench.timing.time_interleaved``).

    python3 benchmarks/bench_block.py [--device cuda] [--quick] [--sections abcd]
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common import device_arg, hardware, set_tf32, table
from repmlp import RepMLPBlock, RepMLPBlock1d, reparameterize_model
from repmlp.bench.timing import time_interleaved

log = logging.getLogger("bench_block")


class PaperRepMLPBlock(nn.Module):
    """Paper-formulation block; ``deploy`` mirrors the inference form (no BN, no conv branches).

    Shapes: ``(N, C, H, W)`` -> ``(N, O, H, W)``.
    """

    def __init__(self, ref: RepMLPBlock) -> None:
        super().__init__()
        c, o, g = ref.in_channels, ref.out_channels, ref.groups
        h, w = ref.partition
        self.c, self.o, self.h, self.w, self.g = c, o, h, w, g
        self.resolution, self.parts, self.padding = ref.resolution, ref.parts, ref.padding
        deploy = ref.deploy
        gp = ref.global_perceptron
        self.has_global = gp is not None
        if gp is not None:
            width = c * self.parts[0] * self.parts[1]
            self.gp_bn = None if gp.bn is None else nn.BatchNorm2d(c)
            self.fc1 = nn.Linear(width, gp.fc1.out_features)
            self.fc2 = nn.Linear(gp.fc1.out_features, width)
        self.fc3 = nn.Conv2d(c * h * w, o * h * w, 1, groups=g, bias=deploy)
        self.fc3_bn = None if deploy else nn.BatchNorm1d(o * h * w)
        self.convs = nn.ModuleList()
        self.bns = nn.ModuleList()
        if not deploy:
            for kh, kw in ref.kernel_sizes:
                self.convs.append(nn.Conv2d(c, o, (kh, kw), padding=(kh // 2, kw // 2), groups=g, bias=False))
                self.bns.append(nn.BatchNorm2d(o))

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        h, w = self.h, self.w
        hp, wp = self.parts
        if self.padding != (0, 0):
            x = F.pad(x, (0, self.padding[1], 0, self.padding[0]))
        parts = x.reshape(n, self.c, hp, h, wp, w).permute(0, 2, 4, 1, 3, 5).reshape(-1, self.c, h, w)
        if self.has_global:
            v = F.avg_pool2d(x, (h, w))
            if self.gp_bn is not None:
                v = self.gp_bn(v)
            v = self.fc2(F.relu(self.fc1(v.flatten(1))))
            v = v.reshape(n, self.c, hp, wp).permute(0, 2, 3, 1).reshape(-1, self.c, 1, 1)
            parts = parts + v
        b = parts.shape[0]
        fc = self.fc3(parts.reshape(b, -1, 1, 1)).reshape(b, -1)
        if self.fc3_bn is not None:
            fc = self.fc3_bn(fc)
        out = fc.reshape(b, self.o, h, w)
        for conv, bn in zip(self.convs, self.bns, strict=True):
            out = out + bn(conv(parts))
        out = out.reshape(n, hp, wp, self.o, h, w).permute(0, 3, 1, 4, 2, 5)
        out = out.reshape(n, self.o, hp * h, wp * w)
        if self.padding != (0, 0):
            out = out[:, :, : self.resolution[0], : self.resolution[1]].contiguous()
        return out


def _copy_bn(dst: nn.Module, src: nn.Module) -> None:
    dst.load_state_dict(src.state_dict())


@torch.no_grad()
def paper_block_from(ref: RepMLPBlock) -> PaperRepMLPBlock:
    """A :class:`PaperRepMLPBlock` holding copies of ``ref``'s weights and BN statistics."""
    paper = PaperRepMLPBlock(ref).to(device=ref.partition_perceptron.fc3.weight.device)
    paper = paper.to(dtype=ref.partition_perceptron.fc3.weight.dtype)
    gp = ref.global_perceptron
    if gp is not None:
        if gp.bn is not None:
            _copy_bn(paper.gp_bn, gp.bn)
        paper.fc1.load_state_dict(gp.fc1.state_dict())
        paper.fc2.load_state_dict(gp.fc2.state_dict())
    pp = ref.partition_perceptron
    paper.fc3.weight.copy_(pp.fc3.weight.reshape(paper.fc3.weight.shape))
    if pp.fc3.bias is not None:
        paper.fc3.bias.copy_(pp.fc3.bias)
    if pp.bn is not None:
        _copy_bn(paper.fc3_bn, pp.bn)
    if ref.local_perceptron is not None:
        for branch, conv, bn in zip(ref.local_perceptron.branches, paper.convs, paper.bns, strict=True):
            conv.weight.copy_(branch.conv.weight)
            _copy_bn(bn, branch.bn)
    paper.train(ref.training)
    return paper


def _goal_row(
    c: int, res: int, p: int, g: int, paper: str, ours: str, t: dict[str, float], goal: float
) -> list[str]:
    """One table row: configuration, the two measurements as shown, speed-up and whether it meets ``goal``."""
    ratio = t["paper"] / t["ours"]
    return [
        f"C=O={c}, {res}x{res}, h=w={p}, g={g}",
        paper,
        ours,
        f"**{ratio:.2f}x**",
        "met" if ratio >= goal else "MISSED",
    ]


# (C, H=W, h=w, g): the two configurations.
GOAL_CONFIGS = [(16, 32, 8, 2), (64, 28, 7, 8)]
# Batch-1 configurations: the above, a ResNet-stage-like one, one without Global Perceptron,
# one with a non-divisible resolution (padding) and non-square kernels.
BATCH1_CONFIGS = [
    dict(c=16, res=32, p=8, g=2),
    dict(c=64, res=28, p=7, g=8),
    dict(c=32, res=14, p=7, g=4),
    dict(c=32, res=7, p=7, g=1),
    dict(c=24, res=30, p=8, g=3, kernel_sizes=(1, (3, 5), 7)),
]


@torch.no_grad()
def randomize_bn(model: nn.Module, seed: int = 0) -> None:
    """Random running statistics and affine parameters, so BN folding is actually exercised."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            shape = m.running_mean.shape
            m.running_mean.copy_(torch.randn(shape, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(shape, generator=gen) + 0.5)
            m.weight.copy_(torch.rand(shape, generator=gen) + 0.5)
            m.bias.copy_(torch.randn(shape, generator=gen) * 0.1)


def make_block(device: torch.device, c: int, res: int, p: int, g: int, **kw) -> RepMLPBlock:
    torch.manual_seed(0)
    block = RepMLPBlock(c, c, res, p, groups=g, **kw)
    randomize_bn(block)
    return block.to(device)


TOLERANCE = {"rel": 1e-4}  # max relative error allowed in the equality checks (raised for --tf32)


def check_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
    if err > TOLERANCE["rel"]:
        raise AssertionError(f"{what}: outputs differ (max rel. error {err:.2e})")


def bench_deployed(device: torch.device, batch: int, rounds: int, round_s: float) -> list[list[str]]:
    rows = []
    for c, res, p, g in GOAL_CONFIGS:
        ours = reparameterize_model(make_block(device, c, res, p, g).eval())
        paper = paper_block_from(ours).eval()
        x = torch.randn(batch, c, res, res, device=device)
        with torch.no_grad():
            check_close(ours(x), paper(x), "deployed vs paper deployed")
            t = time_interleaved(
                {"paper": lambda m=paper: m(x), "ours": lambda m=ours: m(x)},  # noqa: B023 - called right here
                device,
                rounds=rounds,
                min_round_s=round_s,
            )
        rows.append(_goal_row(c, res, p, g, f"{batch / t['paper']:.0f}", f"{batch / t['ours']:.0f}", t, 5))
    return rows


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, grad: torch.Tensor):
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).backward(grad)
        opt.step()

    return step


def bench_training(device: torch.device, batch: int, rounds: int, round_s: float) -> list[list[str]]:
    rows = []
    for c, res, p, g in GOAL_CONFIGS:
        ours = make_block(device, c, res, p, g).train()
        paper = paper_block_from(ours).train()
        x = torch.randn(batch, c, res, res, device=device)
        grad = torch.randn(batch, c, res, res, device=device)
        # Same function in training mode too (BN on batch statistics); on copies, so that the
        # running statistics of the timed modules are not disturbed.
        a, b = copy.deepcopy(ours), copy.deepcopy(paper)
        check_close(a(x), b(x), "training-time vs paper training-time")
        opt_ours = torch.optim.SGD(ours.parameters(), lr=1e-3, momentum=0.9)
        opt_paper = torch.optim.SGD(paper.parameters(), lr=1e-3, momentum=0.9)
        t = time_interleaved(
            {
                "paper": _train_step(paper, opt_paper, x, grad),
                "ours": _train_step(ours, opt_ours, x, grad),
            },
            device,
            rounds=rounds,
            min_round_s=round_s,
        )
        rows.append(_goal_row(c, res, p, g, f"{t['paper'] * 1e3:.1f}", f"{t['ours'] * 1e3:.1f}", t, 3))
    return rows


def time_train_vs_deployed(
    train_form: nn.Module, x: torch.Tensor, what: str, rounds: int, round_s: float
) -> dict[str, float]:
    """Seconds per inference pass (``no_grad``) of an eval-mode block and of its deployed form on ``x``,
    interleaved, once the two are checked to give the same outputs: ``{"train-form", "deployed"}``."""
    deployed = reparameterize_model(train_form)
    with torch.no_grad():
        check_close(deployed(x), train_form(x), what)
        return time_interleaved(
            {"train-form": lambda: train_form(x), "deployed": lambda: deployed(x)},
            x.device,
            rounds=rounds,
            min_round_s=round_s,
        )


def bench_batch1(device: torch.device, rounds: int, round_s: float) -> list[list[str]]:
    rows = []
    for cfg in BATCH1_CONFIGS:
        cfg = dict(cfg)
        c, res = cfg["c"], cfg["res"]
        train_form = make_block(device, **cfg).eval()
        x = torch.randn(1, c, res, res, device=device)
        t = time_train_vs_deployed(train_form, x, "deployed vs training-time", rounds, round_s)
        ratio = t["train-form"] / t["deployed"]
        ks = ",".join("x".join(map(str, k)) for k in train_form.kernel_sizes)
        rows.append(
            [
                f"C=O={c}, {res}x{res}, h=w={cfg['p']}, g={cfg['g']}, K=({ks})",
                f"{t['train-form'] * 1e3:.3f}",
                f"{t['deployed'] * 1e3:.3f}",
                f"**{ratio:.2f}x**",
                "met" if ratio >= 1 else "MISSED",
            ]
        )
    return rows


# (channels, 2-D resolution and partition, 1-D length and partition, groups): the two blocks of a row have
# the same number of partitions (resolution/partition squared = length/partition) of the same size.
PAIRS_1D = ((64, 32, 8, 1024, 64, 4), (128, 16, 8, 256, 64, 8))


def bench_1d(device: torch.device, batch: int, rounds: int, round_s: float) -> list[list[str]]:
    rows = []
    for c, res, p2, length, p1, g in PAIRS_1D:
        torch.manual_seed(0)
        block_1d = RepMLPBlock1d(c, c, length, p1, groups=g)
        randomize_bn(block_1d)
        cases = {
            f"2-D: C={c}, {res}x{res}, h=w={p2}, g={g}": (
                make_block(device, c, res, p2, g).eval(),
                (c, res, res),
            ),
            f"1-D: C={c}, L={length}, l={p1}, g={g}": (block_1d.to(device).eval(), (c, length)),
        }
        for label, (train_form, shape) in cases.items():
            x = torch.randn(batch, *shape, device=device)
            t = time_train_vs_deployed(train_form, x, f"{label}: deployed vs training-time", rounds, round_s)
            ratio = t["train-form"] / t["deployed"]
            rows.append(
                [label, f"{batch / t['train-form']:.0f}", f"{batch / t['deployed']:.0f}", f"**{ratio:.2f}x**"]
            )
    return rows


def main() -> None:
    parser = device_arg(__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sections", default="abcd", help="which sections to run (default: abcd)")
    args = parser.parse_args()
    set_tf32(args.tf32)
    if args.tf32:
        TOLERANCE["rel"] = 1e-2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    rounds = 3 if args.quick else args.rounds
    round_s = 0.05 if args.quick else 0.3
    print(f"# bench_block on {args.device} (tf32={args.tf32})\n{hardware(device)}\n")

    if "a" in args.sections:
        print(f"## (a) deployed block, batch {args.batch}, inference (goal >= 5x)")
        header = ["config", "paper deployed img/s", "ours deployed img/s", "speed-up", "goal"]
        print(table(header, bench_deployed(device, args.batch, rounds, round_s)) + "\n")
    if "b" in args.sections:
        print(f"## (b) training step (fwd + bwd + SGD), batch {args.batch} (goal >= 3x)")
        header = ["config", "paper train ms/step", "ours train ms/step", "speed-up", "goal"]
        print(table(header, bench_training(device, args.batch, rounds, round_s)) + "\n")
    if "c" in args.sections:
        print("## (c) batch 1, inference: deployed vs training-time block (goal >= 1x)")
        header = ["config", "training-time ms", "deployed ms", "speed-up", "goal"]
        print(table(header, bench_batch1(device, rounds, round_s)) + "\n")
    if "d" in args.sections:
        print(f"## (d) the 1-D block beside the 2-D block, batch {args.batch}: deployed vs training-time")
        header = ["block", "training-time examples/s", "deployed examples/s", "speed-up"]
        print(table(header, bench_1d(device, args.batch, rounds, round_s)) + "\n")


if __name__ == "__main__":
    main()
