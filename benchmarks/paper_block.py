"""The paper's formulation of the RepMLP block, as a speed reference (not part of the package).

Written from the paper's description (Sec. 3.2, Eq. for gMMUL): partitions by one permute of NCHW,
Global Perceptron added by broadcasting onto the partition map, FC3 as a grouped 1x1 conv on the
``(B, C*h*w, 1, 1)`` map followed by BN, each Local Perceptron branch a grouped conv + BN on the NCHW
partition map. :func:`paper_block_from` builds it with the weights of a :class:`repmlp.RepMLPBlock`
(either form), so the two compute the same function and can be timed side by side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from repmlp import RepMLPBlock


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
