"""Small re-parameterizable layers shared by the block and the models."""

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from repmlp.nn.ops import FC3_ROW_CLASSES, fc3_form, groupwise_fc, is_channels_last
from repmlp.nn.reparam import fuse_bn, ntuple

# A torch.fx leaf: a traced graph calls groupwise_fc as the module does, so it makes the same FC3 choice
# when it runs (bitwise the eager result) instead of freezing one form into the graph.
torch.fx.wrap("groupwise_fc")

__all__ = [
    "ConvBN",
    "GroupwiseLinear",
    "MaxPool2x2",
    "channels_last_weights_on_cpu",
    "cpu_channels_last",
    "prepare_fc3",
]


# Conv and BatchNorm classes by spatial dimensionality (1-D sequences, 2-D images, 3-D volumes).
_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


class ConvBN(nn.Module):
    """Conv followed by BatchNorm; :meth:`reparameterize` folds the BN into a conv with bias.

    ``deploy=True`` builds the fused form (a single conv with bias) directly, so a converted state
    dict loads into it. Submodule names: ``conv`` and, before conversion, ``bn``. ``dims`` picks
    ``nn.Conv1d``/``2d``/``3d`` (and the matching BatchNorm); sizes are ints or ``dims``-tuples.

    Shapes: ``(N, C_in, *spatial)`` -> ``(N, C_out, *spatial')`` as the conv; 2-D by default.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] | None = None,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        *,
        deploy: bool = False,
        dims: int = 2,
    ) -> None:
        super().__init__()
        if dims not in _CONV:
            raise ValueError(f"dims must be 1, 2 or 3, got {dims!r}")
        kernel = ntuple(kernel_size, dims, "kernel_size")
        dilations = ntuple(dilation, dims, "dilation")
        if padding is None:
            padding = tuple(d * (k - 1) // 2 for k, d in zip(kernel, dilations, strict=True))
        self.conv = _CONV[dims](
            in_channels, out_channels, kernel, stride, padding, dilations, groups, bias=deploy
        )
        self.bn: nn.modules.batchnorm._BatchNorm | None = None if deploy else _BN[dims](out_channels)

    @property
    def deploy(self) -> bool:
        return self.bn is None

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv(x)
        return x if self.bn is None else self.bn(x)

    def forward_by_grad_mode(self, x: Tensor) -> Tensor:
        """:meth:`forward_in_input_layout` with autograd on, :meth:`forward` without (:func:`conv_by_grad_mode`),
        chosen when it runs: a torch.fx graph traced in either mode computes bitwise what the module computes in
        the mode it runs in. TorchScript compiles :meth:`forward`. Shapes: as :meth:`forward`."""
        c = self.conv
        if torch.jit.is_scripting():  # the plain conv, as forward_in_input_layout compiles
            x = c(x)
        else:
            x = conv_by_grad_mode(x, c.weight, c.bias, c.stride, c.padding, c.dilation, c.groups)
        return x if self.bn is None else self.bn(x)

    def forward_in_input_layout(self, x: Tensor) -> Tensor:
        """:meth:`forward`, with the conv writing its output in ``x``'s memory format on a CPU (see
        :func:`conv_in_layout_of`), so that the BatchNorm's input and gradient share a layout. Elsewhere the
        same as :meth:`forward`."""
        c = self.conv
        if torch.jit.is_scripting():  # TorchScript compiles no branch below: the plain conv
            x = c(x)
        else:
            x = conv_in_layout_of(x, c.weight, c.bias, c.stride, c.padding, c.dilation, c.groups)
        return x if self.bn is None else self.bn(x)

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Fold ``bn`` into ``conv`` in place (the module must be in eval mode to be equivalent)."""
        if self.bn is None:
            return
        weight, bias = fuse_bn(self.conv.weight, self.bn, self.conv.bias)
        c = self.conv
        fused = type(c)(
            c.in_channels, c.out_channels, c.kernel_size, c.stride, c.padding, c.dilation, c.groups, bias=True
        ).to(device=weight.device, dtype=weight.dtype)
        fused.weight.copy_(weight)
        fused.bias.copy_(bias)
        self.conv = fused
        self.bn = None


_CONV_FN = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}  # by the weight's dimensions


# A leaf of traced graphs (it branches on the layout and the shapes), which TorchScript of a traced graph
# calls as Python; the conv's sizes are typed Any for it (tuples of one to three ints, or a padding string).
@torch.fx.wrap
@torch.jit.ignore
def conv_in_layout_of(
    x: Tensor, weight: Tensor, bias: Tensor | None, stride: Any, padding: Any, dilation: Any, groups: int
) -> Tensor:
    """The conv ``F.conv{1,2,3}d(x, weight, ...)``, written in ``x``'s memory format when ``x`` is a plain
    contiguous CPU tensor; otherwise as it is.

    ``model.to(memory_format=torch.channels_last)`` stores every 4-D weight channels_last, and oneDNN then
    writes a channels_last output even for an NCHW input (a 1x1 kernel too, whose channels_last weight also
    counts as contiguous): so a plain input normally gets a weight with plain strides. But oneDNN has a
    direct NCHW kernel for a grouped conv only when each group's channels fill whole vector registers; for
    others (:func:`_slow_in_nchw`) it runs an im2col GEMM per image and group, which on the many small
    partition maps of a Local Perceptron trains several times slower than its channels_last kernels
    (``benchmarks/bench_local_convs.py``). Those convs run channels_last and hand back a plain output
    (:class:`_Relayout`).
    """
    conv = _CONV_FN[weight.dim()]
    args = (bias, stride, padding, dilation, groups)
    if x.device.type != "cpu" or not x.is_contiguous():
        return conv(x, weight, *args)
    if (
        x.dim() == 4
        and _slow_in_nchw(weight, groups)
        and not (torch.jit.is_tracing() or torch.compiler.is_exporting())
    ):
        cl = torch.channels_last
        y = conv(_Relayout.apply(x, cl), weight.contiguous(memory_format=cl), *args)
        return _Relayout.apply(y, torch.contiguous_format)
    return conv(x, weight.clone(memory_format=torch.contiguous_format), *args)


# A leaf of traced graphs (it branches on the autograd mode), called as Python by TorchScript of a traced graph.
@torch.fx.wrap
@torch.jit.ignore
def conv_by_grad_mode(
    x: Tensor, weight: Tensor, bias: Tensor | None, stride: Any, padding: Any, dilation: Any, groups: int
) -> Tensor:
    """With autograd on, :func:`conv_in_layout_of` (the training step's layout choice); without, the plain
    ``F.conv{1,2,3}d(x, weight, ...)``, which is what ``nn.Conv{1,2,3}d`` with zero padding computes.

    Decided when the call runs, so that a graph traced with or without autograd (torch.fx,
    torchvision's ``create_feature_extractor``) takes the eager module's path in either mode.
    Shapes: as the conv.
    """
    if torch.is_grad_enabled():
        return conv_in_layout_of(x, weight, bias, stride, padding, dilation, groups)
    return _CONV_FN[weight.dim()](x, weight, bias, stride, padding, dilation, groups)


def _slow_in_nchw(weight: Tensor, groups: int) -> bool:
    """Whether oneDNN runs this 2-D training conv on NCHW tensors as an im2col GEMM, much slower than in
    channels_last: a kernel larger than 1x1 whose groups have a number of input or output channels that is
    not a multiple of 8 (the float32 vector width of AVX2, where it was measured; ``ONEDNN_VERBOSE=1`` names
    the kernel). 1x1 kernels are a GEMM in either layout, and timed too close to switch."""
    out_channels, per_group = weight.shape[:2]
    return weight.shape[2] * weight.shape[3] > 1 and bool(per_group % 8 or (out_channels // groups) % 8)


class _Relayout(torch.autograd.Function):
    """``x.contiguous(memory_format=layout)`` whose backward hands back the gradient in ``x``'s own layout:
    around a channels_last conv on a plain input, the conv's backward gets a channels_last gradient (the
    layout its kernels run fastest in) and the layers before it a plain one, as their other inputs give."""

    @staticmethod
    def forward(ctx, x: Tensor, layout: torch.memory_format) -> Tensor:
        ctx.layout = torch.channels_last if is_channels_last(x) else torch.contiguous_format
        return x.contiguous(memory_format=layout)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad.contiguous(memory_format=ctx.layout), None


class GroupwiseLinear(nn.Module):
    """Groupwise FC (the paper's FC3) with a kernel in grouped-1x1-conv layout.

    ``weight``: ``(out_features, in_features/g)``; ``bias``: ``(out_features,)`` or absent.
    :meth:`forward` takes per-group rows ``(g, B, in_features/g)`` and returns ``(g, B, out/g)``.
    """

    def __init__(self, in_features: int, out_features: int, groups: int = 1, bias: bool = True) -> None:
        super().__init__()
        if in_features % groups or out_features % groups:
            raise ValueError(f"groups={groups} must divide in_features={in_features} and out={out_features}")
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        self.weight = nn.Parameter(torch.empty(out_features, in_features // groups))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Same initialisation as a grouped 1x1 conv of this shape (the paper's formulation).
        bound = 1.0 / (self.in_features // self.groups) ** 0.5
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, rows: Tensor) -> Tensor:
        # Positional: TorchScript passes keyword arguments of an ignored (Python) function wrongly.
        return groupwise_fc(rows, self.weight, self.bias, self.training)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, groups={self.groups}, "
            f"bias={self.bias is not None}"
        )


def prepare_fc3(model: nn.Module, rows: Sequence[int] | None = None) -> int:
    """Make the FC3 form choice (:func:`repmlp.nn.ops.fc3_form`) now for every float32 CPU
    :class:`GroupwiseLinear` in ``model``, so that no forward pays for it; returns how many it saw.

    ``rows``: the row counts a group to prepare for (a batch times the partitions of the layer's input);
    by default every class :func:`repmlp.nn.ops.fc3_form` times (the powers of two up to 512), which covers
    every batch.
    """
    counts = FC3_ROW_CLASSES if rows is None else rows
    layers = [m for m in model.modules() if isinstance(m, GroupwiseLinear)]
    for m in layers:
        if m.weight.device.type == "cpu" and m.weight.dtype == torch.float32:
            for count in counts:
                fc3_form(m.groups, m.weight.shape, m.bias is not None, count)
    return len(layers)


class MaxPool2x2(nn.Module):
    """2x2 max pooling, stride 2 (``nn.MaxPool2d(2)``), fast on contiguous NCHW CPU tensors.

    PyTorch's CPU NCHW max-pool kernel runs an order of magnitude slower than a memory copy of its
    input (it also computes indices); two element-wise maxima over strided views (row pairs, then
    column pairs) give the same values at about the cost of one copy. channels_last and CUDA
    tensors, and odd sizes, use ``F.max_pool2d``, which is fast there.

    Shapes: ``(N, C, H, W)`` -> ``(N, C, H//2, W//2)``.
    """

    def forward(self, x: Tensor) -> Tensor:
        return max_pool_2x2(x)


@torch.fx.wrap
def max_pool_2x2(x: Tensor) -> Tensor:
    """:class:`MaxPool2x2` as a function; a ``torch.fx`` leaf, since it branches on shape and layout.

    Shapes: ``(N, C, H, W)`` -> ``(N, C, H//2, W//2)``.
    """
    n, c, h, w = x.shape
    if x.device.type != "cpu" or h % 2 or w % 2 or not x.is_contiguous():
        return F.max_pool2d(x, 2)
    rows = x.view(n, c, h // 2, 2, w)
    pairs = torch.maximum(rows[:, :, :, 0], rows[:, :, :, 1]).view(n, c, h // 2, w // 2, 2)
    return torch.maximum(pairs[..., 0], pairs[..., 1])


def channels_last_weights_on_cpu(model: nn.Module) -> nn.Module:
    """Store ``model``'s 4-D weights channels_last when it runs its activations channels_last on a CPU (a
    module in it sets ``runs_channels_last_on_cpu``: the trunks that call :func:`cpu_channels_last`) and its
    parameters are on the CPU. Otherwise every such conv first copies its NCHW weight into the activations'
    layout, on every call: at batch 1 a visible share of a deployed ResNet's time
    (``benchmarks/profile_deploy.py --batch-size 1``). Values unchanged; returns ``model`` (changed in place).
    """
    params = list(model.parameters())
    cpu = bool(params) and all(p.device.type == "cpu" for p in params)
    if cpu and any(getattr(m, "runs_channels_last_on_cpu", False) for m in model.modules()):
        model.to(memory_format=torch.channels_last)
    return model


@torch.fx.wrap
def cpu_channels_last(x: Tensor) -> Tensor:
    """``x`` in channels_last memory when it is a 4-d CPU tensor, else ``x`` itself; values unchanged.

    oneDNN's CPU convolutions run their native layout on channels_last tensors; on NCHW tensors PyTorch
    reorders input and output around every conv (markedly slower: ``benchmarks/profile_deploy.py``
    times a ResNet-50 stage by stage both ways). A convolutional trunk that calls this once on its input
    runs every later conv in that layout (conv outputs keep their input's layout). A ``torch.fx`` leaf,
    since it branches on the device: call it as ``layers.cpu_channels_last`` (see :mod:`repmlp.nn.checks`).
    Shapes: ``(N, C, H, W)`` -> the same.
    """
    if x.device.type == "cpu" and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x
