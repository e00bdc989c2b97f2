"""Small re-parameterizable layers shared by the block and the models."""

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from repmlp.nn.ops import FC3_ROW_CLASSES, fc3_form, groupwise_fc, is_channels_last, pointwise_conv_as_linear
from repmlp.nn.reparam import fuse_bn, ntuple

# A torch.fx leaf: a traced graph calls groupwise_fc as the module does, so it makes the same FC3 choice
# when it runs (bitwise the eager result) instead of freezing one form into the graph.
torch.fx.wrap("groupwise_fc")

__all__ = [
    "ConvBN",
    "GroupwiseLinear",
    "LayoutConv1d",
    "LayoutConv2d",
    "LayoutConv3d",
    "MaxPool2x2",
    "PatchwiseConv2d",
    "channels_last_weights_on_cpu",
    "cpu_channels_last",
    "modules_observed",
    "prepare_fc3",
]


class _LayoutConv:
    """Mixin of :class:`LayoutConv1d` / ``2d`` / ``3d``: a conv whose ``forward`` makes the Local Perceptron's
    CPU layout choice (:func:`conv_by_grad_mode`) inside the module's own call, so that forward hooks and
    ``torch.nn.utils.prune`` (a forward pre-hook that recomputes ``weight``) see the conv run.

    Not a torch.fx leaf (its class is not from ``torch.nn``): a traced graph records the
    :func:`conv_by_grad_mode` leaf call itself, which makes the choice when the graph runs (as the graphs
    traced before this class existed did), and :func:`repmlp.deploy.gpu.fuse_conv_epilogues` leaves it alone.
    """

    def forward(self, x: Tensor) -> Tensor:
        # TorchScript compiles the plain conv (the leaf would be a Python call in a scripted model), as does a
        # padding mode other than zeros, which _conv_forward pads and the leaf's F.conv would not.
        if torch.jit.is_scripting() or self.padding_mode != "zeros":
            return self._conv_forward(x, self.weight, self.bias)
        return conv_by_grad_mode(
            x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups
        )


class LayoutConv1d(_LayoutConv, nn.Conv1d):
    """``nn.Conv1d`` computing :func:`conv_by_grad_mode` (for 1-D maps the plain conv's values); same
    parameters and state-dict keys. Shapes: ``(N, C_in, L)`` -> ``(N, C_out, L')``."""


class LayoutConv2d(_LayoutConv, nn.Conv2d):
    """``nn.Conv2d`` computing :func:`conv_by_grad_mode`: with autograd on, on a plain CPU input, the output in
    the input's layout (channels_last inside where oneDNN's NCHW kernel is slow); otherwise the plain conv.
    Same parameters and state-dict keys. Shapes: ``(N, C_in, H, W)`` -> ``(N, C_out, H', W')``."""


class LayoutConv3d(_LayoutConv, nn.Conv3d):
    """``nn.Conv3d`` computing :func:`conv_by_grad_mode` (for 3-D maps the plain conv's values); same
    parameters and state-dict keys. Shapes: ``(N, C_in, D, H, W)`` -> ``(N, C_out, D', H', W')``."""


class PatchwiseConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose kernel tiles its input (kernel = stride, no padding, no dilation, one group),
    computed as one matmul over each patch's pixels (:func:`~repmlp.nn.ops.pointwise_conv_as_linear` after
    ``pixel_unshuffle``, which orders a patch's values as the kernel's entries): the paper's FC on each
    pixel or ``k x k`` patch. oneDNN runs such a conv slowly on one input channel (its weight gradient
    most), and on a ``1 x 1`` map a conv kernel's per-call set-up outweighs the product; the matmul is the
    same sums. Same parameters and state-dict keys as the conv; use it where :meth:`tiles` holds.

    Shapes: ``(N, C_in, H, W)`` -> ``(N, C_out, H/k, W/k)``.
    """

    @staticmethod
    def tiles(
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int],
        padding: int | Sequence[int] | None,
        dilation: int | Sequence[int],
        groups: int,
    ) -> bool:
        """Whether a 2-D conv of these sizes tiles its input with square patches (``padding=None``: same
        padding, which is none for a 1x1 kernel)."""
        k, s, d = (ntuple(v, 2, "size") for v in (kernel_size, stride, dilation))
        p = (0, 0) if padding is None and k == (1, 1) else None if padding is None else ntuple(padding, 2, "")
        return k[0] == k[1] and k == s and p == (0, 0) and d == (1, 1) and groups == 1

    def forward(self, x: Tensor) -> Tensor:
        k = self.kernel_size[0]
        return pointwise_conv_as_linear(F.pixel_unshuffle(x, k) if k > 1 else x, self.weight, self.bias)


# Conv and BatchNorm classes by spatial dimensionality (1-D sequences, 2-D images, 3-D volumes).
_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_LAYOUT_CONV = {1: LayoutConv1d, 2: LayoutConv2d, 3: LayoutConv3d}
_BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


class ConvBN(nn.Module):
    """Conv followed by BatchNorm; :meth:`reparameterize` folds the BN into a conv with bias.

    ``deploy=True`` builds the fused form (a single conv with bias) directly, so a converted state
    dict loads into it. Submodule names: ``conv`` and, before conversion, ``bn``. ``dims`` picks
    ``nn.Conv1d``/``2d``/``3d`` (and the matching BatchNorm); sizes are ints or ``dims``-tuples.
    ``layout_choice=True`` builds a :class:`LayoutConv2d` (``1d``/``3d``) instead, whose forward makes the
    CPU training step's layout choice (:func:`conv_by_grad_mode`): the Local Perceptron's convs on partition
    maps. A subclass that sets :attr:`patches_as_matmul` computes a conv on one input channel that tiles its
    input as a :class:`PatchwiseConv2d`. Either way the state-dict keys are ``conv.weight`` (``conv.bias``)
    and ``bn.*``.

    Shapes: ``(N, C_in, *spatial)`` -> ``(N, C_out, *spatial')`` as the conv; 2-D by default.
    """

    # A stem on one input channel (Fashion-MNIST) whose kernel tiles the input, an FC on each pixel or patch:
    # oneDNN runs such a conv slowly (its weight gradient most), and its output would leave a channels_last
    # model in NCHW. Subclasses (the models' ConvBNReLU) opt in to computing it as one matmul.
    patches_as_matmul: ClassVar[bool] = False

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
        layout_choice: bool = False,
    ) -> None:
        super().__init__()
        if dims not in _CONV:
            raise ValueError(f"dims must be 1, 2 or 3, got {dims!r}")
        kernel = ntuple(kernel_size, dims, "kernel_size")
        dilations = ntuple(dilation, dims, "dilation")
        if padding is None:
            padding = tuple(d * (k - 1) // 2 for k, d in zip(kernel, dilations, strict=True))
        conv = _LAYOUT_CONV[dims] if layout_choice else _CONV[dims]
        if self.patches_as_matmul and dims == 2 and in_channels == 1:
            conv = (
                PatchwiseConv2d if PatchwiseConv2d.tiles(kernel, stride, padding, dilations, groups) else conv
            )
        self.conv = conv(in_channels, out_channels, kernel, stride, padding, dilations, groups, bias=deploy)
        self.bn: nn.modules.batchnorm._BatchNorm | None = None if deploy else _BN[dims](out_channels)

    @property
    def deploy(self) -> bool:
        return self.bn is None

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv(x)
        return x if self.bn is None else self.bn(x)

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Fold ``bn`` into ``conv`` in place (the module must be in eval mode to be equivalent); the fused
        conv is of ``conv``'s own class, so a :class:`LayoutConv2d` keeps its layout choice."""
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


def modules_observed(modules: Iterable[nn.Module]) -> bool:
    """Whether a hook watches any of ``modules`` or their submodules: forward hooks, forward pre-hooks
    (``torch.nn.utils.prune`` registers one that recomputes ``weight``), backward hooks, or such hooks
    registered for every module (``torch.nn.modules.module.register_module_forward_hook`` and the like).

    The fused training forms (:mod:`repmlp.nn.branches_fc`, :mod:`repmlp.nn.dense`) read the weights of
    modules they never call, so their hooks would not fire: they step aside when this is true. A plain
    Python check of module state, which a tracer evaluates once, at trace time.
    """
    every = torch.nn.modules.module  # where the hooks registered for every module live
    if (
        every._global_forward_hooks
        or every._global_forward_pre_hooks
        or every._global_backward_hooks
        or every._global_backward_pre_hooks
    ):
        return True
    return any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
        for module in modules
        for m in module.modules()
    )


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
