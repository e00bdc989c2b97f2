"""Whole-model conversion into the inference form (timm's ``reparameterize_model`` shape), and BatchNorm folding
for models this package did not build."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import torch.fx as fx
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

from repmlp.nn.reparam import _BN
from repmlp.numerics import full_float32

__all__ = ["reparameterize_model", "fuse_conv_bn", "ConversionReport", "swap_modules"]

log = logging.getLogger(__name__)

# The flavours whose forward only normalises (a fold leaves nothing behind).
_PLAIN_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
# The BatchNorms each layer kind folds: the channels of a conv's batched output (dim 1), as torch.ao's
# fuse_modules pairs them. BatchNorm1d after a Linear stays: it normalises dim 1 of a 2-D or 3-D input, which on a
# Linear's (N, L, F) output is L, and this walk cannot see the rank. After a Conv1d it folds: its channels are
# dim 1 of the (N, C, L) output; only an unbatched (C, L) input with L == C (the one shape on which BatchNorm1d
# takes a Conv1d's unbatched output) would make the unfused model normalise the length instead.
_PAIRS = {
    nn.Conv1d: (nn.BatchNorm1d, nn.SyncBatchNorm),
    nn.Conv2d: (nn.BatchNorm2d, nn.SyncBatchNorm),
    nn.Conv3d: (nn.BatchNorm3d, nn.SyncBatchNorm),
}
_FUSABLE = tuple(_PAIRS)


def swap_modules(model: nn.Module, swap: Callable[[nn.Module], nn.Module | None]) -> nn.Module:
    """A new tree of ``model`` in which each module that ``swap`` maps to a module (rather than ``None``) is
    that module, as ``torch.ao``'s convert builds one; ``model`` is left as it is, and returned itself where
    nothing is swapped. The modules above a swapped one are shallow copies holding the same parameters,
    buffers and hooks (training the tree trains ``model``); names, and so state-dict keys, stay."""
    new = swap(model)
    if new is not None:
        return new
    children = {name: swap_modules(child, swap) for name, child in model.named_children()}
    if all(child is model._modules[name] for name, child in children.items()):
        return model
    tree = copy.copy(model)
    tree._modules = {**model._modules, **children}
    tree._parameters, tree._buffers = dict(model._parameters), dict(model._buffers)
    return tree


class ConversionReport(list):
    """Names of the BatchNorm modules :func:`reparameterize_model` could not fold (a ``list``)."""


class _Tracer(fx.Tracer):
    """Leaves: modules with their own ``reparameterize`` (already converted) and every BatchNorm (timm's
    ``BatchNormAct2d`` too, which the tracer would otherwise inline into ``F.batch_norm`` calls)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return hasattr(m, "reparameterize") or isinstance(m, _BN) or super().is_leaf_module(m, qualname)


def _after_fold(bn: nn.Module) -> nn.Module | None:
    """What replaces ``bn`` once folded into the layer before it: ``nn.Identity`` for a plain BatchNorm, the
    ``drop`` and ``act`` of timm's ``BatchNormAct2d``, ``None`` (not folded) for other subclasses."""
    if type(bn) in _PLAIN_BN:
        return nn.Identity()
    drop, act = getattr(bn, "drop", None), getattr(bn, "act", None)
    if type(bn).__name__ == "BatchNormAct2d" and isinstance(drop, nn.Module) and isinstance(act, nn.Module):
        return nn.Sequential(drop, act)
    return None


def _bn_matches(layer: nn.Module, bn: nn.Module) -> bool:
    """Whether folding ``bn`` into ``layer`` (torch's ``fuse_conv_bn_eval``) computes the same function for every
    input: a BatchNorm of the layer's channels (see ``_PAIRS``), in eval mode with running statistics."""
    kinds = next((v for k, v in _PAIRS.items() if isinstance(layer, k)), ())
    stats = not (layer.training or bn.training) and bn.running_var is not None
    return stats and isinstance(bn, kinds) and layer.out_channels == bn.num_features


def _fuse_sequential(module: nn.Module, prefix: str, fused: set[str]) -> None:
    """Fold ``layer, BN`` pairs that sit next to each other in ``nn.Sequential`` containers."""
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, nn.Sequential):
            keys = list(child._modules.keys())
            for a, b in zip(keys, keys[1:], strict=False):
                layer, bn = child._modules[a], child._modules[b]
                if not (isinstance(layer, _FUSABLE) and isinstance(bn, _BN) and _bn_matches(layer, bn)):
                    continue
                rest = _after_fold(bn)
                if rest is not None:
                    child._modules[a] = fuse_conv_bn_eval(layer, bn)
                    child._modules[b] = rest
                    fused.add(f"{path}.{b}")
        _fuse_sequential(child, path + ".", fused)


def _fuse_fx(model: nn.Module, fused: set[str]) -> None:
    """Fold a BN that follows a conv anywhere, also across containers: a ``torch.fx`` trace finds each conv
    whose one use is a BN (each called once), then both are swapped in place (the fused conv, and an
    ``nn.Identity`` or what a BN subclass leaves) so the model keeps its own forward (its in-place adds...)."""
    graph = _Tracer().trace(model)
    modules = dict(model.named_modules())
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    for node in graph.nodes:
        src = node.args[0] if node.op == "call_module" and node.args else None
        if not isinstance(modules.get(node.target), _BN) or not isinstance(src, fx.Node):
            continue
        layer, bn = modules.get(src.target) if src.op == "call_module" else None, modules[node.target]
        rest = _after_fold(bn)
        once = calls.get(src.target) == 1 and calls[node.target] == 1 and len(src.users) == 1
        if not (isinstance(layer, _FUSABLE) and once and rest is not None and _bn_matches(layer, bn)):
            continue
        for target, new in ((src.target, fuse_conv_bn_eval(layer, bn)), (node.target, rest)):
            parent, _, attr = target.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
        fused.add(node.target)


def fuse_conv_bn(model: nn.Module) -> tuple[nn.Module, ConversionReport]:
    """Fold every eval-mode BatchNorm1d/2d/3d that directly follows a 1-D/2-D/3-D conv into it (torch's
    ``fuse_conv_bn_eval``): inside ``nn.Sequential`` containers (the model keeps its class), then anywhere else
    through a ``torch.fx`` trace (torchvision's ResNet calls ``self.conv1`` then ``self.bn1``). Returns the
    model and the BatchNorms left (also those in training mode or without running statistics)."""
    fused: set[str] = set()
    _fuse_sequential(model, "", fused)
    remaining = [n for n, m in model.named_modules() if isinstance(m, _BN)]
    if remaining:
        try:
            _fuse_fx(model, fused)
        except Exception as exc:  # noqa: BLE001 - untraceable forward: report, keep what was fused
            log.warning(
                "torch.fx could not trace %s (%s); BatchNorms outside Sequentials stay",
                type(model).__name__,
                exc,
            )
    left = ConversionReport(n for n, m in model.named_modules() if isinstance(m, _BN))
    return model, left


# The conversion hooks of re-parameterizable blocks, in timm's order of preference: ``fuse()`` returns the
# module's replacement (timm's RepViT, LeViT); ``reparameterize()`` (ours, timm's MobileOne, RepVGG, FastViT)
# and ``switch_to_deploy()`` (timm's GhostNet, RepGhost) convert in place.
_HOOKS = ("fuse", "reparameterize", "switch_to_deploy")


def _convert_module(module: nn.Module) -> nn.Module:
    """Run ``module``'s first conversion hook; return the module that takes its place."""
    for hook in _HOOKS:
        fn = getattr(module, hook, None)
        if callable(fn):
            result = fn()
            # A fuse() that converts in place and returns nothing (or self) leaves the module where it is.
            return result if hook == "fuse" and isinstance(result, nn.Module) else module
    return module


def _reparameterize_tree(module: nn.Module) -> nn.Module:
    """Convert ``module``, then the children it still has; return its replacement. Parents first, as timm
    does: a :class:`RepMLPBlock` merges its children's unfused kernels in float32 and rounds once. Unlike
    timm's walk, the root is converted too (a bare block), and the walk goes on into what ``fuse()`` returned.
    """
    module = _convert_module(module)
    for name, child in list(module.named_children()):
        new = _reparameterize_tree(child)
        if new is not child:
            setattr(module, name, new)  # Sequential, ModuleList and plain attributes alike
    return module


def reparameterize_model(model: nn.Module, *, inplace: bool = False, fuse_bn: bool = True) -> nn.Module:
    """Return the inference form of ``model`` (in eval mode: BatchNorm running statistics are merged).

    Runs every module's conversion hook, parents before children (``reparameterize()``: RepMLP blocks,
    :class:`ConvBN`, timm's MobileOne/RepVGG/FastViT; ``switch_to_deploy()``; ``fuse()``, whose result
    replaces the module), then, with ``fuse_bn``, folds every BatchNorm left after a conv
    (:func:`fuse_conv_bn`); those it cannot fold are logged and listed in ``model.unfused_batchnorms``
    (a BatchNorm1d after a Linear among them: what it normalises depends on its input's rank).
    ``inplace=True`` converts in place, but use the returned module (``fuse()`` or an fx fold may replace
    the root); otherwise the copy carries none of ``model``'s forward, pre-forward and backward hooks (its
    modules are new: register hooks on the result).
    """
    if model.training:
        raise RuntimeError(
            "reparameterize_model needs the model in eval mode (call model.eval()): BatchNorm running "
            "statistics are merged, so a training-mode model would not stay equivalent"
        )
    if not inplace:
        model = copy.deepcopy(model)
        for m in model.modules():
            for hooks in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks):
                hooks.clear()
    # The merged weights are products of weights (BN scales, conv kernels into FC matrices): computed in
    # full float32 whatever TF32 or autocast settings the caller holds, or they would carry its rounding.
    with full_float32():
        model = _reparameterize_tree(model)
        left = ConversionReport()
        if fuse_bn:
            model, left = fuse_conv_bn(model)
    if left:
        shown = ", ".join(left[:8]) + (f", ... ({len(left) - 8} more)" if len(left) > 8 else "")
        log.info("reparameterize_model: %d BatchNorm(s) not fused (kept, exact): %s", len(left), shown)
    model.eval()
    try:
        model.unfused_batchnorms = left
    except Exception:  # noqa: BLE001 - e.g. a scripted module
        pass
    return model
