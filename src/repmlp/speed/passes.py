"""The speed passes and their undoing: :func:`fast_training`, :func:`fast_inference`, :func:`onnx_form`, :func:`plain`.

A pass walks a model once and changes the class of the modules it has a faster version of (the subclasses
of :mod:`repmlp.speed.modules` and :mod:`repmlp.speed.fc3`, which override ``forward`` only): parameters,
buffers, state-dict keys and hooks stay, and :func:`plain` changes every class back. Only modules of the
plain class itself are changed (a user's subclass keeps its own forward), and none that a hook watches
when the pass runs: a forward hook, a forward pre-hook (``torch.nn.utils.prune``), a backward hook on the
module or anything in it, or such a hook registered for every module. Hooks registered after a pass may
not fire where a fast module reads a module it does not call (the dense Local Perceptron's convs).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from repmlp.models.pure_mlp import PartitionConvBlock
from repmlp.models.repmlpnet import ChannelGate, RepMLPNet, RepMLPNetBlock
from repmlp.models.resnet import ResNet
from repmlp.nn.block import LocalPerceptron, RepMLPBlock
from repmlp.nn.layers import GroupwiseLinear
from repmlp.speed.dense import fits_dense
from repmlp.speed.fc3 import ROW_CLASSES, PerGroupLinear, TunedGroupwiseLinear, fastest_kernel, rows_class
from repmlp.speed.modules import (
    DenseLocalPerceptron,
    DensePartitionConvBlock,
    FastPartitionConvBlock,
    FastRepMLPBlock,
    LayoutConv2d,
    MaxPool2x2,
    PatchwiseConv2d,
)

__all__ = ["fast_training", "fast_inference", "onnx_form", "plain"]


def _is_fast(cls: type) -> bool:
    return cls.__module__.startswith("repmlp.speed.")


def _watched(module: nn.Module) -> bool:
    every = nn.modules.module
    if every._global_forward_hooks or every._global_forward_pre_hooks or every._global_backward_hooks:
        return True
    return any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
        for m in module.modules()
    )


def _swap(module: nn.Module, plain_cls: type, fast_cls: type) -> bool:
    """Give ``module`` the class ``fast_cls`` if it is exactly a ``plain_cls`` and nothing watches it."""
    if type(module) is not plain_cls or _watched(module):
        return False
    module.__class__ = fast_cls
    return True


def _device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _patch_convs(model: nn.Module) -> Iterable[nn.Conv2d]:
    """Convs computed better as a matmul: one-channel patch stems, and RepMLPNet's gate on its 1x1 map."""
    gates = {id(c) for m in model.modules() if isinstance(m, ChannelGate) for c in m.children()}
    for m in model.modules():
        if isinstance(m, nn.Conv2d) and PatchwiseConv2d.tiles(m) and (m.in_channels == 1 or id(m) in gates):
            yield m


def fast_training(model: nn.Module, *, dense: bool | None = None) -> nn.Module:
    """The training-time fast modules, in place, for the device the parameters are on; returns ``model``.

    Every RepMLP block keeps its input's memory format and makes its partition copies as custom ops; the
    Local Perceptron (and row D's big conv) trains as one dense FC on a CPU where the groups are narrow, and
    with ``dense=True`` wherever it fits (on CUDA the convs measured faster: docs/gpu.md); on a CPU the convs
    on partition maps write the map's layout (:class:`~repmlp.speed.modules.LayoutConv2d`), ResNet and
    RepMLPNet trunks take their input channels_last, one-channel patch stems run as a matmul and 2x2 max
    pools as two elementwise maxima. The same function: bits may differ where sums are reordered (the dense
    version).
    """
    cpu = _device(model).type == "cpu"
    dense = bool(dense)
    for m in list(model.modules()):
        if isinstance(m, RepMLPBlock) and m.local_perceptron is not None:
            lp = m.local_perceptron
            if (dense or cpu) and fits_dense(list(lp.branches), m.partition, cpu=not dense):
                if _swap(lp, LocalPerceptron, DenseLocalPerceptron):
                    lp.map_size = m.partition
        if isinstance(m, PartitionConvBlock):
            branches = [m.conv, *(m.local or ())]
            fits = (dense or cpu) and fits_dense(branches, (m.partition, m.partition), cpu=not dense)
            _swap(m, PartitionConvBlock, DensePartitionConvBlock if fits else FastPartitionConvBlock)
        _swap(m, RepMLPBlock, FastRepMLPBlock)
        if cpu and isinstance(m, (LocalPerceptron, PartitionConvBlock)):
            for conv in m.modules():
                _swap(conv, nn.Conv2d, LayoutConv2d)
    if cpu:
        _channels_last_trunks(model)
        _cpu_modules(model)
    return model


def _cpu_modules(model: nn.Module) -> None:
    """What both passes do on a CPU: patch stems and RepMLPNet's gate as a matmul, 2x2 max pools as two
    elementwise maxima."""
    for m in model.modules():
        if isinstance(m, nn.MaxPool2d) and (m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode) == (
            2, 2, 0, 1, False,
        ):  # fmt: skip
            _swap(m, nn.MaxPool2d, MaxPool2x2)
    for conv in _patch_convs(model):
        _swap(conv, nn.Conv2d, PatchwiseConv2d)


def _to_channels_last(module: nn.Module, args: tuple) -> tuple:
    x = args[0]
    return (x.contiguous(memory_format=torch.channels_last), *args[1:]) if x.dim() == 4 else args


def _channels_last_trunks(model: nn.Module) -> bool:
    """ResNet and RepMLPNet trunks take their input channels_last (a forward pre-hook): oneDNN's convs run
    their native layout then, and reorder input and output around every conv otherwise. Returns whether
    ``model`` has such a trunk."""
    trunks = [m for m in model.modules() if isinstance(m, (ResNet, RepMLPNet)) and not _watched(m)]
    for trunk in trunks:
        trunk._speed_hook = trunk.register_forward_pre_hook(_to_channels_last)
    return bool(trunks)


def fast_inference(model: nn.Module, *, batch_sizes: Sequence[int] | None = None) -> nn.Module:
    """The inference fast modules, in place, for the device the parameters are on; returns ``model``.

    Every RepMLP block keeps its input's memory format. On a CPU: ResNet and RepMLPNet trunks run
    channels_last (their weights stored so, their input reordered by a forward pre-hook); float32 FC3s
    take the kernel timed fastest for their kernel and rows (:mod:`repmlp.speed.fc3`: now, for the rows of
    ``batch_sizes``, default every batch up to 512 rows a group); patch stems and RepMLPNet's gate run as
    a matmul; 2x2 max pools as two maxima. The same function; FC3's kernel may change the last bits.
    """
    for m in model.modules():
        _swap(m, RepMLPBlock, FastRepMLPBlock)
    if _device(model).type != "cpu":
        return model
    if _channels_last_trunks(model):
        model.to(memory_format=torch.channels_last)
    _cpu_modules(model)
    _tune_fc3(model, batch_sizes)
    return model


def _tune_fc3(model: nn.Module, batch_sizes: Sequence[int] | None) -> None:
    """Time and fix the FC3 kernels of every float32 FC3 of ``model`` for the rows it will see."""
    for block in model.modules():
        fc3 = getattr(block, "fc3", None) if isinstance(block, RepMLPNetBlock) else None
        if isinstance(block, RepMLPBlock):
            fc3 = block.partition_perceptron.fc3
        if (
            fc3 is None
            or fc3.weight.dtype != torch.float32
            or not _swap(fc3, GroupwiseLinear, TunedGroupwiseLinear)
        ):
            continue
        parts = block.parts[0] * block.parts[1]
        per_group = parts * (block.channels // block.sharesets if isinstance(block, RepMLPNetBlock) else 1)
        rows = (
            ROW_CLASSES if batch_sizes is None else sorted({rows_class(b * per_group) for b in batch_sizes})
        )
        fc3.kernels = {
            c: fastest_kernel(fc3.groups, tuple(fc3.weight.shape), fc3.bias is not None, c) for c in rows
        }


def onnx_form(model: nn.Module) -> nn.Module:
    """The form a model's ONNX graph runs fastest in, in place; returns ``model``: every RepMLP block's FC3 as
    one 2-D product per group (:class:`~repmlp.speed.fc3.PerGroupLinear`). The same function; applied by
    :func:`repmlp.deploy.export.export_onnx` to the copy it exports."""
    for m in model.modules():
        if isinstance(m, RepMLPBlock):
            _swap(m.partition_perceptron.fc3, GroupwiseLinear, PerGroupLinear)
    return model


def plain(model: nn.Module) -> nn.Module:
    """Undo :func:`fast_training`, :func:`fast_inference` and :func:`onnx_form` in place: every module of a fast
    class gets its plain class back, the channels_last pre-hooks go (the weights keep their memory format);
    returns it."""
    for m in model.modules():
        if _is_fast(type(m)):
            m.__class__ = next(c for c in type(m).__mro__ if not _is_fast(c))
            for attr in ("kernels", "map_size"):  # what the passes set beside the class
                m.__dict__.pop(attr, None)
        hook = m.__dict__.pop("_speed_hook", None)
        if hook is not None:
            hook.remove()
    return model
