"""Pure, differentiable re-parameterization maths (paper Sec. 3.3-3.4, Appendices B and C).

Every function takes tensors (and, for BatchNorm, the module whose running statistics are used) and returns
new tensors; nothing is modified in place, so the functions may sit inside a loss.

A *groupwise FC* (the paper's FC3) has a 2-D kernel ``(O*S, C*S/g)``: the weight of a grouped 1x1 conv with
``C*S`` inputs, ``O*S`` outputs and ``g`` groups, reshaped. ``S`` is the partition's volume (``h*w`` in 2-D,
``l`` in 1-D, any of 1 to 3 spatial dimensions); rows are ordered ``(o, *position)``, columns
``(c_local, *position)`` with ``c_local`` one of the row's group's ``C/g`` channels.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "fuse_bn",
    "conv_to_fc",
    "conv_to_fc_identity",
    "absorb_bn_into_fc",
    "merge_fc3",
    "ntuple",
    "format_size",
    "ConvBranch",
]

# Every BatchNorm flavour (1d/2d/3d, SyncBatchNorm after multi-GPU training, LazyBatchNorm): eval-mode
# maths is the same affine map of the running statistics. The one definition (convert.py imports it).
_BN = (nn.modules.batchnorm._BatchNorm,)

# One Local Perceptron branch as merge_fc3 takes it: conv kernel ``(O, C/g, *k)``, conv bias ``(O,)``
# or ``None``, and the BatchNorm that follows the conv or ``None`` (a branch already fused).
ConvBranch = tuple[Tensor, Tensor | None, nn.Module | None]


def ntuple(value: int | Sequence[int], dims: int, name: str = "value") -> tuple[int, ...]:
    """Return ``value`` as a ``dims``-tuple of ints, accepting an int or a length-``dims`` sequence."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * dims
    if (
        isinstance(value, Sequence)
        and len(value) == dims
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return tuple(int(v) for v in value)
    raise ValueError(f"{name} must be an int or a sequence of {dims} ints, got {value!r}")


def _compute_dtype(t: Tensor) -> torch.dtype:
    # Half-precision kernels are merged in float32: the sums over many branches lose bits otherwise.
    return t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32


def _bn_scale_shift(bn: nn.Module, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """The per-channel affine map ``y = x * scale + shift`` that an eval-mode BatchNorm applies."""
    if not isinstance(bn, _BN):
        raise TypeError(f"expected a BatchNorm module, got {type(bn).__name__}")
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError("cannot fuse a BatchNorm without running statistics (track_running_stats=False)")
    mean = bn.running_mean.to(device=device, dtype=dtype)
    var = bn.running_var.to(device=device, dtype=dtype)
    std = torch.sqrt(var + bn.eps)
    if bn.affine:
        gamma = bn.weight.to(device=device, dtype=dtype)
        beta = bn.bias.to(device=device, dtype=dtype)
    else:
        gamma = torch.ones_like(mean)
        beta = torch.zeros_like(mean)
    scale = gamma / std
    return scale, beta - mean * scale


def fuse_bn(weight: Tensor, bn: nn.Module, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Fold an eval-mode BatchNorm into the conv or FC kernel before it (paper Eq. 16): ``weight`` ``(O, C/g,
    *k)`` or ``(O, P)``, ``bias`` ``(O,)`` or ``None`` -> ``(weight', bias')`` of shapes ``weight``'s and
    ``(O,)``. The BN's running statistics are used whatever its mode."""
    dtype = _compute_dtype(weight)
    scale, shift = _bn_scale_shift(bn, dtype, weight.device)
    if scale.numel() != weight.shape[0]:
        raise ValueError(
            f"BatchNorm has {scale.numel()} channels but the kernel has {weight.shape[0]} output rows"
        )
    w = weight.to(dtype) * scale.reshape(-1, *([1] * (weight.dim() - 1)))
    b = shift if bias is None else bias.to(dtype) * scale + shift
    return w.to(weight.dtype).contiguous(), b.to(weight.dtype).contiguous()


def _conv_geometry(kernel: Tensor, partition: int | Sequence[int], groups: int) -> tuple[int, ...]:
    """Check a conv kernel ``(O, C/g, *k)`` against its partition (an int, or one size per spatial dimension
    of the kernel); return the partition as a tuple."""
    dims = kernel.dim() - 2
    if not 1 <= dims <= 3:
        raise ValueError(
            f"kernel must be (O, C/g, *k) with 1 to 3 spatial sizes, got shape {tuple(kernel.shape)}"
        )
    if not isinstance(partition, int) and isinstance(partition, Sequence) and len(partition) != dims:
        raise ValueError(
            f"kernel of shape {tuple(kernel.shape)} has {dims} spatial dimensions but partition "
            f"{tuple(partition)} has {len(partition)}"
        )
    size = ntuple(partition, dims, "partition")
    if min(size) < 1:
        raise ValueError(f"partition must be positive, got {size}")
    out_ch, ksize = kernel.shape[0], tuple(kernel.shape[2:])
    if groups < 1 or out_ch % groups:
        raise ValueError(f"groups={groups} must divide the kernel's {out_ch} output channels")
    if any(k % 2 == 0 for k in ksize):
        raise ValueError(f"kernel size must be odd for same padding, got {format_size(ksize)}")
    if any(k > p for k, p in zip(ksize, size, strict=True)):
        raise ValueError(f"kernel {format_size(ksize)} is larger than the partition {format_size(size)}")
    return size


def format_size(size: Sequence[int]) -> str:
    """``(3, 5)`` as ``"3x5"``: kernel and partition sizes as error messages write them."""
    return "x".join(str(v) for v in size)


def conv_to_fc(
    kernel: Tensor,
    bias: Tensor | None,
    partition: int | Sequence[int],
    groups: int = 1,
) -> tuple[Tensor, Tensor | None]:
    """The FC of a groupwise stride-1 same-padded conv on a ``(C, *partition)`` partition (paper Sec. 3.3).

    Built directly: in 2-D, ``W[(o,y,x),(c,y',x')] = kernel[o, c, y'-y+kh//2, x'-x+kw//2]`` (zero outside
    the kernel), alike in 1-D and 3-D, by stacking shifted windows of the zero-padded kernel: memory of one
    FC kernel, where the paper's construction (:func:`conv_to_fc_identity`, the identical result) convolves
    a ``(C*S/g)^2 * g`` identity. ``kernel`` ``(O, C/g, *k)`` (odd ``k_i <= s_i``), ``bias`` ``(O,)`` or
    ``None``, ``partition`` ``(s_1, ..., s_d)`` or an int -> ``(O*S, C*S/g)`` (``S = s_1*...*s_d``; the
    kernel's dtype and device) and ``(O*S,)`` or ``None``.
    """
    size = _conv_geometry(kernel, partition, groups)
    out_ch, cg = kernel.shape[:2]
    volume = math.prod(size)
    # Zero-pad the kernel to (2s-1) in every dimension: the window of the partition's size ending
    # opposite output point p is then exactly that output row of the FC kernel. Stacking the windows
    # writes the result once, so memory is one FC kernel (no identity matrix) and autograd flows
    # through pad/stack. F.pad takes the last dimension first.
    pads = [s - 1 - k // 2 for s, k in zip(size, kernel.shape[2:], strict=True)]
    big = F.pad(kernel.to(_compute_dtype(kernel)), [p for p in reversed(pads) for _ in range(2)])

    def window(point: tuple[int, ...]) -> tuple[slice, ...]:
        return (
            slice(None),
            slice(None),
            *(slice(s - 1 - q, 2 * s - 1 - q) for s, q in zip(size, point, strict=True)),
        )

    rows = [big[window(point)] for point in itertools.product(*(range(s) for s in size))]
    fc = torch.stack(rows, dim=1)  # (O, S, C/g, *size)
    fc_weight = fc.reshape(out_ch * volume, cg * volume).to(kernel.dtype).contiguous()
    fc_bias = None if bias is None else bias.repeat_interleave(volume).contiguous()
    return fc_weight, fc_bias


def _no_tf32() -> contextlib.AbstractContextManager:
    cudnn = torch.backends.cudnn
    return cudnn.flags(
        enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic, allow_tf32=False
    )


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def conv_to_fc_identity(
    kernel: Tensor,
    bias: Tensor | None,
    partition: int | Sequence[int],
    groups: int = 1,
) -> tuple[Tensor, Tensor | None]:
    """The paper's construction (Alg. 1): convolve an identity matrix reshaped to feature maps.

    Same contract and result as :func:`conv_to_fc` (1 to 3 spatial dimensions); kept as the reference
    the direct construction is tested against, and for the benchmark. Allocates ``(C*S/g) x C x
    *partition`` for the identity.
    """
    size = _conv_geometry(kernel, partition, groups)
    out_ch, cg = kernel.shape[:2]
    dtype = _compute_dtype(kernel)
    volume = math.prod(size)
    n = cg * volume
    eye = torch.eye(n, dtype=dtype, device=kernel.device).repeat(1, groups).reshape(n, cg * groups, *size)
    padding = tuple(k // 2 for k in kernel.shape[2:])
    # cuDNN may run float32 convolutions in TF32 (10-bit mantissa), which would round the kernel's
    # entries; this construction is the exact reference, so TF32 is switched off for its conv.
    with _no_tf32():
        fc = _CONV[len(size)](eye, kernel.to(dtype), padding=padding, groups=groups)
    fc_weight = fc.reshape(n, out_ch * volume).t().to(kernel.dtype).contiguous()
    fc_bias = None if bias is None else bias.repeat_interleave(volume).contiguous()
    return fc_weight, fc_bias


def absorb_bn_into_fc(weight: Tensor, bias: Tensor | None, bn: nn.Module) -> tuple[Tensor, Tensor]:
    """Absorb a BatchNorm that *precedes* an FC into the FC (paper Appendix C): the FC's input is the BN's
    output flattened channel-major, each of its ``C`` channels covering ``P / C`` consecutive inputs (the
    Global Perceptron's ``Hp*Wp`` partition means). ``weight`` ``(Q, P)``, ``bias`` ``(Q,)`` or ``None`` ->
    ``(Q, P)``, ``(Q,)``."""
    dtype = _compute_dtype(weight)
    scale, shift = _bn_scale_shift(bn, dtype, weight.device)
    if weight.shape[1] % scale.numel():
        raise ValueError(
            f"FC input width {weight.shape[1]} is not a multiple of the BatchNorm's {scale.numel()} channels"
        )
    rep = weight.shape[1] // scale.numel()
    w = weight.to(dtype)
    new_bias = w @ shift.repeat_interleave(rep)
    if bias is not None:
        new_bias = new_bias + bias.to(dtype)
    new_weight = w * scale.repeat_interleave(rep).unsqueeze(0)
    return new_weight.to(weight.dtype).contiguous(), new_bias.to(weight.dtype).contiguous()


def _fuse_bn_rows(weight: Tensor, bias: Tensor | None, bn: nn.Module) -> tuple[Tensor, Tensor]:
    """:func:`fuse_bn` for a BN whose ``C`` channels each scale ``Q/C`` consecutive rows of ``weight``.

    ``weight`` ``(Q, P)`` and ``bias`` ``(Q,)`` or ``None``, already in the compute dtype; returns
    ``(Q, P)`` and ``(Q,)`` in that dtype. ``C = Q`` is :func:`fuse_bn` itself (RepMLP-Res50's
    ``BatchNorm1d(O*h*w)``); ``C < Q`` is RepMLPNet's ``BatchNorm2d(S)``, which scales all ``h*w``
    outputs of a share-set alike, so its per-set scale and shift are spread over the set's rows.
    """
    if not isinstance(bn, _BN):
        raise TypeError(f"expected a BatchNorm module, got {type(bn).__name__}")
    rows, channels = weight.shape[0], bn.num_features
    if rows == channels:
        return fuse_bn(weight, bn, bias)
    if rows % channels:
        raise ValueError(f"FC3 has {rows} output rows, not a multiple of the BatchNorm's {channels} channels")
    rep = rows // channels
    # fuse_bn on the (C, rep*P) view multiplies every element by its channel's scale, the same products
    # (so the same bits) as scaling the (Q, P) kernel row by row with a repeated scale.
    fused, shift = fuse_bn(weight.reshape(channels, -1), bn)
    fused, shift = fused.reshape(weight.shape), shift.repeat_interleave(rep)
    if bias is None:
        return fused, shift
    scale, _ = _bn_scale_shift(bn, weight.dtype, weight.device)
    return fused, bias * scale.repeat_interleave(rep) + shift


def merge_fc3(
    weight: Tensor,
    bias: Tensor | None,
    bn: nn.Module | None,
    branches: Iterable[ConvBranch],
    partition: int | Sequence[int],
    groups: int,
) -> tuple[Tensor, Tensor]:
    """The inference FC3 (paper Sec. 3.4, "Locality Injection"): FC3, its BN and every conv branch in one.

    FC3's BN is fused (:func:`fuse_bn`), each Local Perceptron conv-BN branch is fused and converted to an
    FC (:func:`conv_to_fc`), and kernels and biases are summed, with the running statistics: the eval-mode
    block. Half-precision inputs are merged in float32 and rounded once. ``weight`` ``(O*h*w, C*h*w/g)``
    (``h*w``: the partition's volume), ``bias`` ``(O*h*w,)`` or ``None``; ``bn``: the BN after FC3 or
    ``None``, whose ``C'`` channels each scale ``O*h*w/C'`` consecutive rows (``BatchNorm1d(O*h*w)``, or
    RepMLPNet's ``BatchNorm2d(S)``); ``branches``: ``(kernel (O, C/g, *k), bias or None, bn or None)`` each.
    Returns new contiguous ``(O*h*w, C*h*w/g)`` and ``(O*h*w,)`` in ``weight``'s dtype and device.
    """
    dtype = weight.dtype
    work = _compute_dtype(weight)

    def up(t: Tensor | None) -> Tensor | None:
        # A copy even when the dtype already matches: the result must never alias the module's own
        # parameters, which the caller replaces.
        return None if t is None else t.to(work, copy=True)

    merged_w, merged_b = up(weight), up(bias)
    if bn is not None:
        merged_w, merged_b = _fuse_bn_rows(merged_w, merged_b, bn)
    if merged_b is None:
        merged_b = torch.zeros(merged_w.shape[0], dtype=work, device=merged_w.device)
    for kernel, kbias, kbn in branches:
        k, kb = up(kernel), up(kbias)
        if kbn is not None:
            k, kb = fuse_bn(k, kbn, kb)
        fc_w, fc_b = conv_to_fc(k, kb, partition, groups)
        merged_w = merged_w + fc_w
        if fc_b is not None:
            merged_b = merged_b + fc_b
    return merged_w.to(dtype).contiguous(), merged_b.to(dtype).contiguous()
