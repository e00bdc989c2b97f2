"""The paper's FC3 weight figure (Sec. 4.2, Fig. "FC weights sampled from FC3").

FC3's kernel ``(O*h*w, C*h*w/g)`` is viewed as ``W(O, h, w, C/g, h, w)``; for one output channel, one output
point ``(y, x)`` and one input channel of its group, ``W[o, y, x, c, :, :]`` says how much every input
position of the partition counts for that point. The figure shows it as ``ln(|W| / min |W|)`` for the
training-time FC3 and for FC3 with the Local Perceptron merged in: merging adds the conv kernels around the
point (a local prior), while positions outside the largest kernel keep what FC3 learnt (global capacity).

A 1-D block (partitions of ``l`` positions) has one output point per position: its figure is the whole
``l x l`` matrix ``W[o, :, c, :]`` (rows: output positions), where the Local Perceptron adds a band around
the diagonal; the sampled point ``(y, y)`` marks one row.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from repmlp.engine.report import pyplot, save_figure
from repmlp.models.repmlpnet import RepMLPNetBlock
from repmlp.nn.block import RepMLPBlock, RepMLPBlock1d

__all__ = ["FC3Sample", "find_repmlp_blocks", "sample_fc3", "fc3_log_weights", "plot_fc3"]

log = logging.getLogger(__name__)
_BLOCKS = (RepMLPBlock, RepMLPBlock1d, RepMLPNetBlock)


@dataclass
class FC3Sample:
    """The two sampled matrices of the figure, log-normalised, and where they come from."""

    block_name: str
    out_channel: int
    in_channel: int  # index inside the group of ``out_channel`` (0 .. C/g - 1)
    input_channel: int  # the same channel as an index of the block's input (0 .. C - 1)
    point: tuple[int, int]
    largest_kernel: tuple[int, int] | None
    train: np.ndarray  # ln(|W| / min |W|) of the training-time FC3, (h, w)
    merged: np.ndarray  # the same for FC3 merged with the Local Perceptron, (h, w)
    one_d: bool = False  # a 1-D block: train/merged are (l, l), rows output and columns input positions


def find_repmlp_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every RepMLP block (RepMLP-Res50's, the pure MLPs' 2-D and 1-D ones, RepMLPNet's) of ``model`` as
    ``(name, block)``, in module order."""
    if isinstance(model, _BLOCKS):
        return [("", model)]
    return [(name, m) for name, m in model.named_modules() if isinstance(m, _BLOCKS)]


def _fc3_layout(block: nn.Module) -> tuple[Tensor, int, int, bool, tuple[tuple[int, int], ...]]:
    """``(FC3 kernel, output channels, groups, has Local Perceptron, kernels)`` of either block kind
    (RepMLPNet's FC3 maps each of its ``S`` parameter sets on its own: ``S`` channels in ``S`` groups)."""
    if isinstance(block, (RepMLPBlock, RepMLPBlock1d)):
        fc3 = block.partition_perceptron.fc3.weight
        return fc3, block.out_channels, block.groups, block.local_perceptron is not None, block.kernel_sizes
    kernels = tuple((k, k) for k in block.kernel_sizes) if block.local is not None else ()
    return block.fc3.weight, block.sharesets, block.sharesets, block.local is not None, kernels


def _select_block(model: nn.Module, block_name: str | None) -> tuple[str, nn.Module]:
    blocks = find_repmlp_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no RepMLP block to visualise")
    if block_name is None:  # the paper samples a block with a Local Perceptron
        with_local = [(n, b) for n, b in blocks if _fc3_layout(b)[3]]
        if not with_local:
            log.warning("no RepMLP block has a Local Perceptron: both panels will show the same FC3")
        return (with_local or blocks)[0]
    for name, block in blocks:
        if name == block_name:
            return name, block
    names = ", ".join(n or "<root>" for n, _ in blocks[:8]) + (", ..." if len(blocks) > 8 else "")
    raise ValueError(f"no RepMLP block named {block_name!r}; blocks: {names}")


def fc3_log_weights(matrix: Tensor) -> np.ndarray:
    """``ln(|W| / min |W|)`` of a sampled matrix (the paper's normalisation), float64, all >= 0; the minimum
    over non-zero magnitudes (a zero weight would make the log infinite), zeros mapping to 0."""
    mag = matrix.detach().abs().double().cpu()
    nonzero = mag[mag > 0]
    if nonzero.numel() == 0:
        return np.zeros(tuple(mag.shape))
    return torch.log(mag.clamp_min(nonzero.min()) / nonzero.min()).numpy()


def sample_fc3(block_or_model: nn.Module, *, block_name: str | None = None, out_channel: int = 0,
               point: Sequence[int] | None = None, in_channel: int = 0) -> FC3Sample:  # fmt: skip
    """``W[out_channel, y, x, in_channel, :, :]`` of the training-time FC3 (its own kernel: its BatchNorm
    scales each row by one factor, which the normalisation cancels) and of the merged one
    (:meth:`RepMLPBlock.merged_fc3`: BN fused, every Local Perceptron branch added).

    ``block_or_model``: a training-time block or a model holding some; ``block_name``: the block's module
    name (default: the first with a Local Perceptron); ``point``: ``(y, x)`` in the partition (default the
    centre; the paper samples ``(6, 6)`` of a 10x10 partition); a 1-D block's point is ``(y,)`` or ``(y, y)``
    (default ``l // 2``); ``in_channel``: inside ``out_channel``'s group. ``ValueError`` for no such block, a
    deployed block, or an index out of range.
    """
    name, block = _select_block(block_or_model, block_name)
    if block.deploy:
        raise ValueError(
            f"RepMLP block {name or '<root>'} is already deployed: the figure compares the training-time "
            "FC3 with the merged one, so it needs the training-time model"
        )
    fc3, out_c, groups, _, kernels = _fc3_layout(block)
    one_d = len(block.partition) == 1
    if one_d:
        (length,) = block.partition
        cg = fc3.shape[1] // length
        y = length // 2 if point is None else int(point[0])
        if point is not None and (len(point) not in (1, 2) or (len(point) == 2 and point[1] != point[0])):
            raise ValueError(f"a 1-D block's point is one position (y, or y y), got {tuple(point)}")
        _check_channels(out_channel, out_c, in_channel, cg)
        if not 0 <= y < length:
            raise ValueError(
                f"point must lie in the partition of {length} positions (0..{length - 1}), got {y}"
            )
        x, shape, index = y, (out_c, length, cg, length), (out_channel, slice(None), in_channel)
        largest = max((k[0] for k in kernels), default=None)
        largest_kernel = (1, largest) if largest else None
    else:
        h, w = block.partition
        cg = fc3.shape[1] // (h * w)
        point = (h // 2, w // 2) if point is None else point
        if len(point) != 2:
            raise ValueError(f"point must be (y, x), got {tuple(point)}")
        y, x = (int(p) for p in point)
        _check_channels(out_channel, out_c, in_channel, cg)
        if not (0 <= y < h and 0 <= x < w):
            raise ValueError(
                f"point must lie in the {h}x{w} partition (0..{h - 1}, 0..{w - 1}), got ({y}, {x})"
            )
        shape, index = (out_c, h, w, cg, h, w), (out_channel, y, x, in_channel)
        largest_kernel = max(kernels, key=lambda k: k[0] * k[1]) if kernels else None
    train, merged = (
        fc3_log_weights(weight.detach().reshape(shape)[index]) for weight in (fc3, block.merged_fc3()[0])
    )
    input_channel = (out_channel // (out_c // groups)) * cg + in_channel
    return FC3Sample(
        name, out_channel, in_channel, input_channel, (y, x), largest_kernel, train, merged, one_d
    )


def _check_channels(out_channel: int, out_c: int, in_channel: int, cg: int) -> None:
    if not 0 <= out_channel < out_c:
        raise ValueError(f"out_channel must be in 0..{out_c - 1}, got {out_channel}")
    if not 0 <= in_channel < cg:
        raise ValueError(f"in_channel must be in 0..{cg - 1} (channels per group), got {in_channel}")


def describe(sample: FC3Sample) -> str:
    """The sampled matrix in words: ``W[o, y, x, c, :, :] (input channel C`` or, 1-D, ``W[o, :, c, :]
    (rows: output positions, columns: input positions; input channel C`` (the caller closes the bracket)."""
    o, c, y, x = sample.out_channel, sample.in_channel, *sample.point
    if sample.one_d:
        return (f"W[{o}, :, {c}, :] (rows: output positions, columns: input positions; input channel "
                f"{sample.input_channel}")  # fmt: skip
    return f"W[{o}, {y}, {x}, {c}, :, :] (input channel {sample.input_channel}"


def plot_fc3(block_or_model: nn.Module, path: str | os.PathLike, *, block_name: str | None = None,
             out_channel: int = 0, point: Sequence[int] | None = None, in_channel: int = 0,
             title: str | None = None, dpi: int = 150) -> FC3Sample:  # fmt: skip
    """Draw the paper's FC3 figure into the PNG ``path`` (atomically) and return its data (arguments as
    :func:`sample_fc3`). Left the training-time FC3, right FC3 merged with the Local Perceptron; darker is a
    larger ``ln(|W| / min |W|)``; the sampled point is the dashed red square, the largest Local Perceptron
    kernel centred on it the blue one."""
    plt = pyplot()
    from matplotlib.patches import Rectangle  # slow to import: only this figure needs it

    sample = sample_fc3(block_or_model, block_name=block_name, out_channel=out_channel, point=point,
                        in_channel=in_channel)  # fmt: skip
    y, x = sample.point
    h, w = sample.train.shape
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 4.3), constrained_layout=True)
    panels = ((sample.train, "training-time FC3"), (sample.merged, "FC3 merged with Local Perceptron"))
    for ax, (data, label) in zip(axes, panels, strict=True):
        im = ax.imshow(data, cmap="Greys", interpolation="nearest")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="ln(|W| / min |W|)")
        ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, ec="red", ls="--", lw=2))
        if sample.largest_kernel is not None:
            kh, kw = sample.largest_kernel
            top, left = max(y - kh // 2, 0), max(x - kw // 2, 0)
            bottom, right = min(y + kh // 2, h - 1), min(x + kw // 2, w - 1)
            box = (left - 0.5, top - 0.5), right - left + 1, bottom - top + 1
            ax.add_patch(Rectangle(*box, fill=False, ec="tab:blue", lw=1.5))
        ax.set_title(label)
        ax.set_xticks(range(w))
        ax.set_yticks(range(h))
        ax.tick_params(labelsize=7)
    kernel = f", largest kernel {'x'.join(map(str, sample.largest_kernel))}" if sample.largest_kernel else ""
    fig.suptitle(title or f"{sample.block_name or 'RepMLP block'}: {describe(sample)}{kernel})", fontsize=10)
    save_figure(fig, path, dpi=dpi)
    return sample
