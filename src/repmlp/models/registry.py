"""repmlp's models in timm's registry: each family registers its models as timm's own do (module-level
``default_cfgs``, timm's ``@register_model``, a ``_create_*`` building with :func:`repmlp.models.layers.build`),
but a model outside timm's classifier contract (the PSPNets, dense predictors; the sequence models, whose maps
are 1-D; timm's tests take every timm model for an image classifier) takes :func:`register_outside` instead."""

from __future__ import annotations

import dataclasses
import fnmatch
import sys
from collections.abc import Callable

import timm
import torchvision
from timm.models import PretrainedCfg
from torch import nn

OUTSIDE_TIMM: dict[str, Callable[..., nn.Module]] = {}  # name -> entrypoint (cfgs: its module's default_cfgs)


def register_outside(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """timm's ``register_model`` for a model outside timm's classifier contract: in :data:`OUTSIDE_TIMM`."""
    OUTSIDE_TIMM[fn.__name__] = fn
    return fn


def get_pretrained_cfg(name: str) -> PretrainedCfg | None:
    """timm's ``get_pretrained_cfg``, which knows repmlp's models outside timm too (``None``: no cfg)."""
    if name not in OUTSIDE_TIMM:
        return timm.get_pretrained_cfg(name)
    cfgs = sys.modules[OUTSIDE_TIMM[name].__module__].default_cfgs  # as timm's register_model reads them
    return dataclasses.replace(cfgs[name].default, architecture=name)


def is_model(name: str) -> bool:
    """Whether ``name`` is one of repmlp's models (registered with timm by this package, or outside timm)."""
    own = timm.is_model(name) and timm.models.model_entrypoint(name).__module__.startswith("repmlp.")
    return own or name in OUTSIDE_TIMM


def list_models(pattern: str = "") -> list[str]:
    """Sorted names of repmlp's models, optionally filtered by a shell-style ``pattern``."""
    outside = fnmatch.filter(OUTSIDE_TIMM, pattern) if pattern else list(OUTSIDE_TIMM)
    return sorted([*(n for n in timm.list_models(pattern) if is_model(n)), *outside])


def resolve_model(name: str) -> tuple[str, str]:
    """``(source, bare name)`` of a name ``repmlp.create_model`` builds: ``"repmlp"``, ``"timm"`` or
    ``"torchvision"``, in that order (a prefix ``repmlp:``, ``timm:``, ``torchvision:`` forces one); else a
    ``ValueError`` (close names are the command line's)."""
    source, _, bare = name.rpartition(":")
    if source not in ("", "repmlp", "timm", "torchvision"):
        raise ValueError(f"unknown model source {source!r} in {name} (repmlp, timm, torchvision)")
    vision = torchvision.models.list_models(module=torchvision.models)
    known = {"repmlp": is_model(bare), "timm": timm.is_model(bare), "torchvision": bare in vision}
    for src in [source] if source else known:
        if known[src]:
            return src, bare
    raise ValueError(f"unknown model {name!r} (not a repmlp, timm or torchvision model name); "
                     "`repmlp.list_models()` lists repmlp's models")  # fmt: skip
