"""The two small re-parameterizable layers the block and the models are made of: conv+BN and the groupwise FC."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from repmlp.nn.reparam import fuse_bn, ntuple

__all__ = ["ConvBN", "GroupwiseLinear"]

# Conv and BatchNorm classes by spatial dimensionality (1-D sequences, 2-D images, 3-D volumes).
_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


class ConvBN(nn.Module):
    """Conv followed by BatchNorm; :meth:`reparameterize` folds the BN into a conv with bias.

    ``deploy=True`` builds the fused form (one conv with bias) directly, so a converted state dict loads
    into it. Submodules: ``conv`` and, before conversion, ``bn``. ``dims`` picks ``nn.Conv1d``/``2d``/``3d``
    (and the matching BatchNorm); sizes are ints or ``dims``-tuples; ``padding=None`` is same padding.

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

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Fold ``bn`` into ``conv`` in place (equivalent in eval mode: the running statistics are folded)."""
        if self.bn is None:
            return
        weight, bias = fuse_bn(self.conv.weight, self.bn, self.conv.bias)
        c = self.conv
        fused = type(c)(
            c.in_channels, c.out_channels, c.kernel_size, c.stride, c.padding, c.dilation, c.groups, bias=True
        ).to(device=weight.device, dtype=weight.dtype)
        fused.weight.copy_(weight)
        fused.bias.copy_(bias)
        self.conv, self.bn = fused, None


class GroupwiseLinear(nn.Module):
    """Groupwise FC (the paper's FC3): one FC per group, as a batched matmul over the groups.

    The paper computes it as a grouped 1x1 conv; the kernel keeps that layout, ``weight`` ``(Q, P/g)`` with
    the rows of group ``j`` at ``j*Q/g ... (j+1)*Q/g - 1``, so that :func:`repmlp.nn.reparam.merge_fc3`'s
    kernels load as they are. ``bias``: ``(Q,)`` or absent.

    Shapes: per-group rows ``(g, B, P/g)`` -> ``(g, B, Q/g)``.
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
        # The initialisation of a grouped 1x1 conv of this shape (the paper's formulation).
        bound = 1.0 / (self.in_features // self.groups) ** 0.5
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, rows: Tensor) -> Tensor:
        g, bias = self.groups, self.bias
        kernels = self.weight.reshape(g, self.out_features // g, -1).transpose(1, 2)  # (g, P/g, Q/g)
        if bias is None:
            return torch.bmm(rows, kernels)
        return torch.baddbmm(bias.reshape(g, 1, -1), rows, kernels)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, groups={self.groups}, "
            f"bias={self.bias is not None}"
        )
