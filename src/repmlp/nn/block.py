"""The RepMLP block (paper Sec. 3.2 and 3.4): Global, Partition and Local Perceptron.

Training-time block::

    x (N,C,H,W) --pad--> partitions (N*Hp*Wp, C, h, w) + GlobalPerceptron(x) (broadcast)
        -> PartitionPerceptron: FC3 (groupwise) + BN1d(O*h*w)
        +  LocalPerceptron: sum of conv(K)+BN branches, groupwise, same padding
        -> un-partition -> crop -> (N, O, H, W)

After :meth:`RepMLPBlock.reparameterize` the block computes the same function with three FC layers:
FC1 (Global Perceptron's BN absorbed), FC2 and FC3 (BN1d and every conv branch merged).

:class:`RepMLPBlock1d` is the same block for sequences ``(N, C, L)``: partitions of length ``l``, 1-D
convs in the Local Perceptron, and the same conversion (:func:`repmlp.nn.reparam.merge_fc3` in 1-D).
Both share the perceptrons and the construction, validation and conversion (:class:`_RepMLPBlockBase`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from repmlp.nn import checks
from repmlp.nn.branches_fc import FCBranches
from repmlp.nn.dense import (
    add_partition_values,
    dense_partition_sum,
    from_group_columns_like,
    to_group_columns,
)
from repmlp.nn.layers import ConvBN, GroupwiseLinear, modules_observed
from repmlp.nn.ops import from_group_rows, is_channels_last, partition_for, to_group_rows, unpartition_like
from repmlp.nn.reparam import absorb_bn_into_fc, format_size, merge_fc3, ntuple

__all__ = [
    "GlobalPerceptron",
    "PartitionPerceptron",
    "LocalPerceptron",
    "RepMLPBlock",
    "RepMLPBlock1d",
    "TRAIN_FORMS",
    "set_train_form",
]

# How a training-time 2-D block computes FC3 and the Local Perceptron in training mode: "conv" (the
# paper's parallel conv-BN branches; on a CPU narrow groups run as one FC, repmlp.nn.branches_fc), "dense"
# (every branch and FC3 as dense batched matmuls, repmlp.nn.dense), or "auto": dense on CUDA, conv elsewhere.
TRAIN_FORMS = ("auto", "conv", "dense")


def _positive_size(value: int | Sequence[int], dims: int, name: str) -> tuple[int, ...]:
    """``value`` as a ``dims``-tuple of positive ints (an int is repeated); ``ValueError`` naming ``name``."""
    size = ntuple(value, dims, name)
    if min(size) < 1:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return size


class GlobalPerceptron(nn.Module):
    """Adds inter-partition correlations onto every partition (paper Sec. 3.2).

    Average-pools each ``(h, w)`` partition to one pixel, then BN -> FC1 -> ReLU -> FC2 on the
    flattened ``(C, Hp, Wp)`` vector. FC1 maps ``C*Hp*Wp`` to ``C*Hp*Wp // reduction``. With 1-tuples
    ``parts = (Lp,)`` and ``partition = (l,)`` the same on sequences (``BatchNorm1d``, 1-D pooling).

    Shapes: ``(N, C, Hp*h, Wp*w)`` -> ``(N, C, Hp, Wp)`` (one value per channel and partition);
    1-D: ``(N, C, Lp*l)`` -> ``(N, C, Lp)``.
    """

    def __init__(
        self,
        channels: int,
        parts: tuple[int, ...],
        partition: tuple[int, ...],
        reduction: int = 1,
        deploy: bool = False,
    ) -> None:
        super().__init__()
        self.channels, self.parts, self.partition = channels, tuple(parts), tuple(partition)
        if len(self.parts) != len(self.partition) or len(self.partition) not in (1, 2):
            raise ValueError(f"parts {parts} and partition {partition} must both be 1-D or both 2-D")
        width = channels * math.prod(self.parts)
        if not isinstance(reduction, int) or isinstance(reduction, bool) or reduction < 1:
            raise ValueError(f"global_reduction must be a positive int, got {reduction!r}")
        if width // reduction < 1:
            raise ValueError(f"global_reduction={reduction} leaves FC1 no outputs (input width {width})")
        two_d = len(self.partition) == 2
        bn = nn.BatchNorm2d(channels) if two_d else nn.BatchNorm1d(channels)
        self.bn: nn.modules.batchnorm._BatchNorm | None = None if deploy else bn
        # A pooling module, not F.avg_pool1d/2d in forward: TorchScript compiles only the one it holds.
        self.pool = nn.AvgPool2d(self.partition) if two_d else nn.AvgPool1d(self.partition)
        self.fc1 = nn.Linear(width, width // reduction)
        self.fc2 = nn.Linear(width // reduction, width)

    def forward(self, x: Tensor) -> Tensor:
        v = self.pool(x)  # (N, C, *parts)
        if self.bn is not None:
            # contiguous: flatten below hands the BN its gradient in this layout, and PyTorch's BatchNorm
            # backward is slow when gradient and input differ in layout (a channels_last model's pooling)
            v = self.bn(v.contiguous())
        shape = v.shape
        v = self.fc2(F.relu(self.fc1(v.flatten(1)), inplace=True))
        return v.reshape(shape)

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Absorb the BN into FC1 (paper Appendix C)."""
        if self.bn is None:
            return
        weight, bias = absorb_bn_into_fc(self.fc1.weight, self.fc1.bias, self.bn)
        self.fc1.weight.copy_(weight)
        self.fc1.bias.copy_(bias)
        self.bn = None


class PartitionPerceptron(nn.Module):
    """FC3 (groupwise FC over a whole partition) followed, during training, by ``BatchNorm1d(O*h*w)``.

    ``partition`` is ``(h, w)``, or ``(l,)`` for sequences (``h*w`` below is then ``l``).

    Shapes: per-group rows ``(g, B, C/g*h*w)`` -> ``(g, B, O/g*h*w)``.
    """

    def __init__(
        self, in_channels: int, out_channels: int, partition: tuple[int, ...], groups: int, deploy: bool
    ) -> None:
        super().__init__()
        volume = math.prod(partition)
        self.fc3 = GroupwiseLinear(in_channels * volume, out_channels * volume, groups, bias=deploy)
        self.bn: nn.BatchNorm1d | None = None if deploy else nn.BatchNorm1d(out_channels * volume)

    def forward(self, rows: Tensor) -> Tensor:
        y = self.fc3(rows)
        if self.bn is None:
            return y
        g, b, q = y.shape
        y = self.bn(y.transpose(0, 1).reshape(b, g * q))
        return y.reshape(b, g, q).transpose(0, 1)


@torch.fx.wrap
def _layout_for_branches(x: Tensor) -> Tensor:
    """The partition map in the layout the Local Perceptron's convs take: channels_last without autograd
    (4-D maps only: the layout exists for 4-d tensors alone), as it is with autograd.

    A torch.fx leaf, since it branches on the autograd mode and on the map's dimensions: a traced graph
    decides when it runs, as the module does. Shapes: ``(B, C, h, w)`` or ``(B, C, l)``, unchanged.
    """
    if not torch.is_grad_enabled() and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x


class LocalPerceptron(FCBranches, nn.Module):
    """Parallel groupwise conv+BN branches on the partition map, summed (training time only).

    Every kernel size is a ``(kh, kw)`` pair (``nn.Conv2d``) or, for sequences, a 1-tuple ``(k,)``
    (``nn.Conv1d``); all of one kind.

    Shapes: ``(B, C, h, w)`` -> ``(B, O, h, w)``; 1-D: ``(B, C, l)`` -> ``(B, O, l)``.
    """

    def __init__(
        self, in_channels: int, out_channels: int, kernel_sizes: Sequence[tuple[int, ...]], groups: int
    ) -> None:
        super().__init__()
        self.kernel_sizes = tuple(tuple(k) for k in kernel_sizes)
        self.branches = nn.ModuleList(
            ConvBN(in_channels, out_channels, k, groups=groups, dims=len(k), layout_choice=True)
            for k in self.kernel_sizes
        )

    def forward(self, x: Tensor) -> Tensor:
        # Measured on CPU (benchmarks/bench_block.py (b), (c)): without autograd, channels_last convs are a
        # little faster on these small maps. In a training step BatchNorm's backward is slow when its gradient
        # (NCHW, from FC3's side of the sum) and its input differ in layout, so on a CPU, with autograd, the
        # branches write the partition map's own layout even in a channels_last model (whose weights are
        # stored channels_last); a conv that oneDNN runs slowly in NCHW still computes in channels_last
        # inside (layers.conv_in_layout_of; benchmarks/bench_train.py, not measured on CUDA).
        # Both choices depend on the autograd mode, so they are made inside torch.fx leaves
        # (_layout_for_branches, and layers.conv_by_grad_mode in each branch's LayoutConv2d): a traced graph
        # makes them when it runs, as here. The FC form is eager and unwatched only (branches_fit_fc declines
        # a traced input, and branches with hooks, which it would not call): otherwise the convs run.
        if torch.is_grad_enabled() and not torch.jit.is_scripting() and self._fits_fc(x):
            return self._forward_as_fc(x)  # few channels a group on a CPU: one FC for all branches
        x = _layout_for_branches(x)
        out: Tensor | None = None  # a loop over the whole ModuleList: TorchScript slices none
        for branch in self.branches:
            y = branch(x)
            out = y if out is None else out + y
        assert out is not None  # at least one branch (checked in __init__)
        return out

    def _conv_branches(self) -> list[ConvBN]:
        return list(self.branches)


def _check_block_input(x: Tensor, in_channels: int, resolution: tuple[int, int]) -> None:
    """Raise ``ValueError`` unless ``x`` is ``(N, in_channels, *resolution)`` (see :mod:`repmlp.nn.checks`)."""
    checks.check_input_shape(
        x,
        (in_channels, *resolution),
        f"RepMLPBlock expected input of shape (N, {in_channels}, {resolution[0]}, {resolution[1]}), "
        "got {shape}",
    )


# Leaves of traced graphs: they branch on the layout and the mode.
torch.fx.wrap("partition_for")
torch.fx.wrap("unpartition_like")
torch.fx.wrap("from_group_columns_like")


@torch.fx.wrap
def _from_group_rows_like(x: Tensor, y: Tensor, n: int, hp: int, wp: int, h: int, w: int) -> Tensor:
    """:func:`~repmlp.nn.ops.from_group_rows` in ``x``'s memory format: a channels_last input (the
    channels_last treatment) gets a channels_last output, so the next conv needs no layout change.

    A ``torch.fx`` leaf, since it branches on the input's layout. Shapes: ``y`` ``(g, N*hp*wp, O/g*h*w)``
    -> ``(N, O, hp*h, wp*w)``.
    """
    return from_group_rows(y, n, hp, wp, h, w, channels_last=is_channels_last(x))


class _RepMLPBlockBase(nn.Module):
    """Construction, validation and conversion shared by :class:`RepMLPBlock` and :class:`RepMLPBlock1d`.

    ``size`` is the input's spatial size (``(H, W)`` or ``(L,)``) and ``size_name`` the argument that
    gave it, for error messages; ``partition`` and every kernel size have as many dimensions. Subclasses
    implement ``forward``.
    """

    __jit_unused_properties__ = ["train_form"]  # a Python-side setting: TorchScript reads the flag it sets

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        size: int | Sequence[int],
        partition: int | Sequence[int],
        *,
        dims: int,
        size_name: str,
        groups: int,
        kernel_sizes: Sequence[int | Sequence[int]],
        global_reduction: int,
        global_perceptron: bool,
        deploy: bool,
    ) -> None:
        super().__init__()
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels), ("groups", groups)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"groups={groups} must divide in_channels={in_channels} and out_channels={out_channels}"
            )
        self.size = _positive_size(size, dims, size_name)
        self.partition = _positive_size(partition, dims, "partition")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_sizes = _kernel_sizes(kernel_sizes, self.partition)
        # ceil: padded size / partition; the padding goes at the end of each dimension.
        self.parts = tuple(-(-n // p) for n, p in zip(self.size, self.partition, strict=True))
        self.padding = tuple(k * p - n for k, p, n in zip(self.parts, self.partition, self.size, strict=True))

        has_global = global_perceptron and math.prod(self.parts) > 1
        self.global_perceptron = (
            GlobalPerceptron(in_channels, self.parts, self.partition, global_reduction, deploy)
            if has_global
            else None
        )
        self.partition_perceptron = PartitionPerceptron(
            in_channels, out_channels, self.partition, groups, deploy
        )
        self.local_perceptron = (
            LocalPerceptron(in_channels, out_channels, self.kernel_sizes, groups)
            if self.kernel_sizes and not deploy
            else None
        )
        self._deploy = deploy
        self._train_form = "auto"
        self._dense_training = False  # read by forward: a plain flag, which tracers and compilers follow
        self._update_train_form()

    @property
    def deploy(self) -> bool:
        return self._deploy

    @property
    def train_form(self) -> str:
        """How training mode computes FC3 and the Local Perceptron (one of :data:`TRAIN_FORMS`)."""
        return self._train_form

    @train_form.setter
    def train_form(self, form: str) -> None:
        if form not in TRAIN_FORMS:
            raise ValueError(f"train_form must be one of {', '.join(TRAIN_FORMS)}, got {form!r}")
        self._train_form = form
        self._update_train_form()

    def _update_train_form(self) -> None:
        """Resolve ``train_form`` against where the parameters are (``"auto"``: dense on CUDA). Called on
        construction, on every ``.to()``/``.cuda()`` (``_apply``) and when the setting changes, so that
        ``forward`` branches on a flag, not on the input's device."""
        on_cuda = self.partition_perceptron.fc3.weight.is_cuda
        dense = self._train_form == "dense" or (self._train_form == "auto" and on_cuda)
        self._dense_training = dense and len(self.partition) == 2

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's signature
        module = super()._apply(fn, recurse)
        self._update_train_form()
        return module

    @torch.no_grad()
    def merged_fc3(self) -> tuple[Tensor, Tensor]:
        """The inference FC3 kernel ``(O*h*w, C*h*w/g)`` and bias ``(O*h*w,)`` of this block (1-D: ``l``
        for ``h*w``).

        FC3 with its BN1d fused, plus every Local Perceptron branch (conv-BN fused, converted to an
        FC), by :func:`repmlp.nn.reparam.merge_fc3`. Uses running statistics: call in eval mode for the
        result to be equivalent. Half-precision blocks are merged in float32 and rounded once.
        """
        pp = self.partition_perceptron
        branches = [] if self.local_perceptron is None else self.local_perceptron.branches
        return merge_fc3(
            pp.fc3.weight,
            pp.fc3.bias,
            pp.bn,
            [(b.conv.weight, b.conv.bias, b.bn) for b in branches],
            self.partition,
            self.groups,
        )

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Convert in place into the inference form: FC1, FC2, FC3 only (paper Sec. 3.4).

        Equivalent only in eval mode (BatchNorm running statistics are what gets merged).
        """
        if self._deploy:
            return
        weight, bias = self.merged_fc3()
        fc3 = GroupwiseLinear(weight.shape[1] * self.groups, weight.shape[0], self.groups, bias=True)
        fc3 = fc3.to(device=weight.device, dtype=weight.dtype).train(self.training)  # mode picks the FC3 form
        fc3.weight.copy_(weight)
        fc3.bias.copy_(bias)
        self.partition_perceptron.fc3 = fc3
        self.partition_perceptron.bn = None
        self.local_perceptron = None
        if self.global_perceptron is not None:
            self.global_perceptron.reparameterize()
        self._deploy = True


def set_train_form(model: nn.Module, form: str) -> int:
    """Set :attr:`RepMLPBlock.train_form` on every 2-D RepMLP block in ``model``; returns how many.

    ``"auto"`` (the default): FC3 and the Local Perceptron as dense batched matmuls when the block's
    parameters are on a CUDA device (fewer, larger kernels: eager training steps ran 3-18% faster there,
    docs/gpu.md), the paper's conv-BN branches elsewhere;
    ``"conv"`` / ``"dense"`` pin one form. Both compute the same function (BatchNorms on batch statistics
    in training) to float rounding; evaluation mode always runs the conv form.
    """
    if form not in TRAIN_FORMS:
        raise ValueError(f"train_form must be one of {', '.join(TRAIN_FORMS)}, got {form!r}")
    blocks = [m for m in model.modules() if isinstance(m, RepMLPBlock)]
    for block in blocks:
        block.train_form = form
    return len(blocks)


def _kernel_sizes(
    kernel_sizes: Sequence[int | Sequence[int]], part: tuple[int, ...]
) -> tuple[tuple[int, ...], ...]:
    """Validate the Local Perceptron's kernel sizes against the partition ``part``; return them as tuples."""
    if not isinstance(kernel_sizes, Sequence) or isinstance(kernel_sizes, str):
        raise ValueError(
            f"kernel_sizes must be a sequence of kernel sizes such as (1, 3, 5), got {kernel_sizes!r}"
        )
    kernels = []
    for k in kernel_sizes:
        size = _positive_size(k, len(part), "kernel_sizes")
        if any(v % 2 == 0 for v in size):
            raise ValueError(f"kernel_sizes must be odd (same padding), got {format_size(size)}")
        if any(v > p for v, p in zip(size, part, strict=True)):
            raise ValueError(
                f"kernel_sizes entry {format_size(size)} is larger than the partition {format_size(part)}"
            )
        kernels.append(size)
    return tuple(kernels)


class RepMLPBlock(_RepMLPBlockBase):
    """RepMLP: Global, Partition and Local Perceptron, re-parameterizable into three FC layers.

    Args:
        in_channels: ``C``.
        out_channels: ``O``.
        resolution: ``(H, W)`` of the input the block will see (int or pair).
        partition: ``(h, w)`` of each partition. ``H, W`` that are not multiples are zero-padded at
            the bottom/right and the output cropped back.
        groups: ``g`` of FC3 and every Local Perceptron conv.
        kernel_sizes: Local Perceptron branches, each an odd int or an ``(kh, kw)`` pair no larger
            than the partition; empty for none.
        global_reduction: FC1 output width = ``C*Hp*Wp // global_reduction`` (rounded down, as
            squeeze-and-excitation widths are).
        global_perceptron: ``False`` drops the Global Perceptron (it is also absent when the padded
            input is a single partition).
        deploy: build the inference form (FC1, FC2, FC3 with bias; no BN, no conv).

    Shapes: ``(N, C, H, W)`` -> ``(N, O, H, W)``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        resolution: int | Sequence[int],
        partition: int | Sequence[int],
        *,
        groups: int = 1,
        kernel_sizes: Sequence[int | Sequence[int]] = (1, 3, 5, 7),
        global_reduction: int = 1,
        global_perceptron: bool = True,
        deploy: bool = False,
    ) -> None:
        super().__init__(
            in_channels,
            out_channels,
            resolution,
            partition,
            dims=2,
            size_name="resolution",
            groups=groups,
            kernel_sizes=kernel_sizes,
            global_reduction=global_reduction,
            global_perceptron=global_perceptron,
            deploy=deploy,
        )
        self.resolution: tuple[int, int] = (self.size[0], self.size[1])

    def extra_repr(self) -> str:
        return (
            f"in_channels={self.in_channels}, out_channels={self.out_channels}, "
            f"resolution={self.resolution}, partition={self.partition}, groups={self.groups}, "
            f"kernel_sizes={self.kernel_sizes}, deploy={self._deploy}"
        )

    def forward(self, x: Tensor) -> Tensor:
        _check_block_input(x, self.in_channels, self.resolution)
        n = x.shape[0]
        h, w = self.partition
        hp, wp = self.parts
        if self.padding != (0, 0):
            x = F.pad(x, (0, self.padding[1], 0, self.padding[0]))
        g = self.groups
        cg = self.in_channels // g

        if self.local_perceptron is None:
            # Inference path (or a block without Local Perceptron): one permute into per-group rows.
            rows = to_group_rows(x, h, w, g)
            if self.global_perceptron is not None:
                v = self.global_perceptron(x)  # (N, C, Hp, Wp)
                v = v.reshape(n, g, cg, hp, wp).permute(1, 0, 3, 4, 2).reshape(g, n * hp * wp, cg, 1)
                rows = (rows.reshape(g, n * hp * wp, cg, h * w) + v).reshape(rows.shape)
            out = _from_group_rows_like(x, self.partition_perceptron(rows), n, hp, wp, h, w)
        elif self._dense_training and self.training and not torch.jit.is_scripting():
            out = self._forward_dense(x, n, hp, wp)
        else:
            out = self._forward_conv(x, n, hp, wp)
        if self.padding != (0, 0):
            out = out[:, :, : self.resolution[0], : self.resolution[1]]
        return out

    def _forward_conv(self, x: Tensor, n: int, hp: int, wp: int) -> Tensor:
        """The training-time block as the paper draws it: FC3 on the partitions' per-group rows plus the Local
        Perceptron's conv-BN branches on the partition map.

        Shapes: padded ``x`` ``(N, C, Hp*h, Wp*w)`` -> ``(N, O, Hp*h, Wp*w)``.
        """
        h, w = self.partition
        g = self.groups
        cg = self.in_channels // g
        local = self.local_perceptron
        assert local is not None  # forward runs the inference path without a Local Perceptron
        parts = partition_for(x, h, w, self.training)  # (N*Hp*Wp, C, h, w)
        if self.global_perceptron is not None:
            v = self.global_perceptron(x).permute(0, 2, 3, 1).reshape(n * hp * wp, self.in_channels, 1, 1)
            parts = parts + v
        b = parts.shape[0]
        rows = parts.reshape(b, g, cg * h * w).transpose(0, 1)
        fc = self.partition_perceptron(rows).transpose(0, 1).reshape(b, self.out_channels, h, w)
        return unpartition_like(x, fc + local(parts), n, hp, wp, self.training)

    def _observed(self) -> bool:
        """Whether a hook watches a module the dense form reads but does not call (the Partition and Local
        Perceptrons and everything in them: FC3, the convs, the BatchNorms), or every module's hooks are
        set (:func:`repmlp.nn.layers.modules_observed`): then the conv form runs, which calls them all.
        Called from :meth:`_forward_dense` (which TorchScript leaves out), not from ``forward``, so that
        TorchScript never compiles it."""
        watched: list[nn.Module] = [self.partition_perceptron]
        if self.local_perceptron is not None:
            watched.append(self.local_perceptron)
        return modules_observed(watched)

    @torch.jit.unused
    def _forward_dense(self, x: Tensor, n: int, hp: int, wp: int) -> Tensor:
        """The training-time block with FC3 and every Local Perceptron branch as dense batched matmuls
        (:func:`repmlp.nn.dense.dense_partition_sum`); the same function as the conv form, which runs instead
        while hooks watch the modules this form reads without calling them (:meth:`_observed`).

        Shapes: padded ``x`` ``(N, C, Hp*h, Wp*w)`` -> ``(N, O, Hp*h, Wp*w)``.
        """
        if self._observed():
            return self._forward_conv(x, n, hp, wp)
        h, w = self.partition
        columns = to_group_columns(x, h, w, self.groups)  # (g, C/g*h*w, N*Hp*Wp)
        if self.global_perceptron is not None:
            columns = add_partition_values(columns, self.global_perceptron(x), h, w)
        pp = self.partition_perceptron
        branches = [] if self.local_perceptron is None else list(self.local_perceptron.branches)
        maps = dense_partition_sum(columns, pp.fc3.weight, pp.fc3.bias, pp.bn, branches, (h, w))
        return from_group_columns_like(x, maps, n, hp, wp, h, w)


class RepMLPBlock1d(_RepMLPBlockBase):
    """RepMLP for sequences: the 2-D block's perceptrons and exact conversion on ``(N, C, L)`` tensors.

    Partitions are ``l`` consecutive positions; the Global Perceptron pools each to one value per
    channel, FC3 maps a whole ``(C, l)`` partition, and the Local Perceptron runs 1-D convs. After
    :meth:`reparameterize` only FC1, FC2 and FC3 remain, as in 2-D (:func:`repmlp.nn.reparam.merge_fc3`
    with 1-D kernels).

    Args:
        in_channels: ``C``.
        out_channels: ``O``.
        length: ``L`` of the input the block will see.
        partition: ``l``, the length of each partition (int or 1-tuple). An ``L`` that is not a
            multiple is zero-padded at the end and the output cropped back.
        groups: ``g`` of FC3 and every Local Perceptron conv.
        kernel_sizes: Local Perceptron branches, each an odd int (or 1-tuple) no larger than ``l``;
            empty for none.
        global_reduction: FC1 output width = ``C*Lp // global_reduction`` (rounded down).
        global_perceptron: ``False`` drops the Global Perceptron (it is also absent when the padded
            input is a single partition).
        deploy: build the inference form (FC1, FC2, FC3 with bias; no BN, no conv).

    Shapes: ``(N, C, L)`` -> ``(N, O, L)``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        length: int,
        partition: int | Sequence[int],
        *,
        groups: int = 1,
        kernel_sizes: Sequence[int | Sequence[int]] = (1, 3, 5, 7),
        global_reduction: int = 1,
        global_perceptron: bool = True,
        deploy: bool = False,
    ) -> None:
        super().__init__(
            in_channels,
            out_channels,
            length,
            partition,
            dims=1,
            size_name="length",
            groups=groups,
            kernel_sizes=kernel_sizes,
            global_reduction=global_reduction,
            global_perceptron=global_perceptron,
            deploy=deploy,
        )
        self.length: int = length

    def extra_repr(self) -> str:
        return (
            f"in_channels={self.in_channels}, out_channels={self.out_channels}, length={self.length}, "
            f"partition={self.partition[0]}, groups={self.groups}, kernel_sizes={self.kernel_sizes}, "
            f"deploy={self._deploy}"
        )

    def forward(self, x: Tensor) -> Tensor:
        checks.check_input_shape(
            x,
            (self.in_channels, self.length),
            f"RepMLPBlock1d expected input of shape (N, {self.in_channels}, {self.length}), got {{shape}}",
        )
        n, c, o = x.shape[0], self.in_channels, self.out_channels
        (l,), (lp,), g = self.partition, self.parts, self.groups
        if self.padding[0]:
            x = F.pad(x, (0, self.padding[0]))
        parts = x.reshape(n, c, lp, l).transpose(1, 2).reshape(n * lp, c, l)  # (N*Lp, C, l)
        if self.global_perceptron is not None:
            # (N, C, Lp) -> one value per partition and channel, broadcast over the partition's positions.
            parts = parts + self.global_perceptron(x).transpose(1, 2).reshape(n * lp, c, 1)
        b = n * lp
        rows = parts.reshape(b, g, c // g * l).transpose(0, 1)  # (g, N*Lp, C/g*l)
        out = self.partition_perceptron(rows).transpose(0, 1).reshape(b, o, l)
        if self.local_perceptron is not None:
            out = out + self.local_perceptron(parts)
        out = out.reshape(n, lp, o, l).transpose(1, 2).reshape(n, o, lp * l)
        return out[:, :, : self.length] if self.padding[0] else out
