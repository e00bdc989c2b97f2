"""repmlp's models in timm's registry (``@register_model``), and any model by name: :func:`create_model`, a thin
wrapper over timm's and torchvision's that adds ``deploy=True``, and :func:`build_model`, sized for a run.

Only models that keep timm's classifier contract are registered with timm (``timm.create_model``, and timm's
own model tests, take every timm model for an image classifier); the others (the PSPNets, dense predictors,
and the sequence models, whose maps are 1-D) are registered here only, in :data:`OUTSIDE_TIMM`:
:func:`create_model` builds them (with timm's ``build_model_with_cfg`` too) and :func:`list_models` lists them."""

from __future__ import annotations

import copy
import fnmatch
import functools
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import timm
import torch
import torchvision
from timm.data import IMAGENET_DEFAULT_MEAN as IMAGENET_MEAN
from timm.data import IMAGENET_DEFAULT_STD as IMAGENET_STD
from timm.models import PretrainedCfg, build_model_with_cfg, generate_default_cfgs
from torch import nn

from repmlp.errors import UserError, first_line
from repmlp.nn.convert import reparameterize_model
from repmlp.numerics import full_float32

__all__ = ["register_model", "create_model", "list_models", "is_model", "resolve_model",
           "build_model", "takes_img_size", "default_input_size", "check_forward", "get_pretrained_cfg"]  # fmt: skip

# How ``pretrained=True, pretrained_cfg_overlay=dict(file=PATH)`` reads a repmlp model file: repmlp.io
# (which reads model files, above the models) sets ``FILE_LOADER["file"]``; ``import repmlp`` imports it.
FILE_LOADER: dict[str, Callable[[str, str, dict[str, Any]], nn.Module]] = {}

# repmlp's models outside timm's classifier contract: name -> (entrypoint, its pretrained cfg).
OUTSIDE_TIMM: dict[str, tuple[Callable[..., nn.Module], PretrainedCfg]] = {}


def _no_pretrained(name: str) -> ValueError:
    return ValueError(f"no pretrained weights are distributed for {name!r}; train one with `repmlp train` (or "
                      "`repmlp import` released ones) and load the file with repmlp.load_model, or with "
                      "pretrained=True, pretrained_cfg_overlay=dict(file=PATH)")  # fmt: skip


def register_model(
    fn: Callable[..., nn.Module] | None = None,
    *,
    feature_cfg: dict | None = None,
    in_timm: bool = True,
    **cfg: Any,
) -> Any:
    """Register ``fn(pretrained=False, **kwargs) -> nn.Module`` with timm under its name, bare or as
    ``@register_model(**cfg)``: ``cfg`` overrides fields of its ``pretrained_cfg`` (the builder's defaults; no
    weights). timm's ``build_model_with_cfg`` builds it: ``features_only=True`` wraps it in the extractor
    ``feature_cfg`` chooses (``FeatureListNet`` on the model's ``feature_info`` by default). ``in_timm=False``:
    a model outside timm's classifier contract, registered in :data:`OUTSIDE_TIMM` only."""

    def wrap(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        name = fn.__name__
        default = {"url": "", "hf_hub_id": None, "architecture": name, "num_classes": 1000,
                   "input_size": (3, 224, 224), "pool_size": None, "crop_pct": 0.875, "interpolation": "bilinear",
                   "mean": IMAGENET_MEAN, "std": IMAGENET_STD, "first_conv": "", "classifier": "head.fc",
                   "license": "mit"}  # fmt: skip

        @functools.wraps(fn)
        def entrypoint(pretrained: bool = False, **kwargs: Any) -> nn.Module:
            if pretrained:
                path = (kwargs.get("pretrained_cfg_overlay") or {}).get("file")
                if not path:
                    raise _no_pretrained(name)
                if kwargs.get("features_only"):
                    raise ValueError("features_only with a pretrained file: load the model, then wrap it")
                skip = ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")
                return FILE_LOADER["file"](
                    name, str(path), {k: v for k, v in kwargs.items() if k not in skip}
                )
            if not in_timm:  # timm's registry does not hold its cfg: build_model_with_cfg takes it here
                kwargs["pretrained_cfg"] = kwargs.get("pretrained_cfg") or OUTSIDE_TIMM[name][1]
            return _build(fn, name, dict(feature_cfg or {}), **kwargs)

        cfgs = generate_default_cfgs({name: {**default, **cfg}})
        if not in_timm:
            OUTSIDE_TIMM[name] = (entrypoint, cfgs[name].default)
            return fn
        # timm reads the default cfg from ``sys.modules[fn.__module__].default_cfgs`` when registering.
        module = sys.modules[fn.__module__]
        module.default_cfgs = {**getattr(module, "default_cfgs", {}), **cfgs}
        timm.models.register_model(entrypoint)
        return fn

    return wrap(fn) if fn is not None else wrap


def _build(fn: Callable[..., nn.Module], name: str, feature_cfg: dict, **kwargs: Any) -> nn.Module:
    """``fn`` built by timm's ``build_model_with_cfg`` (on timm's ``device``, in its ``dtype``), its cfg (its
    feature extractor's too) then holding the network's own class count, input size and final map size
    (``pool_size``)."""
    kwargs.pop("cache_dir", None)
    built: list[nn.Module] = []

    def call(**kw: Any) -> nn.Module:
        size = kw.get("img_size")  # timm passes fixed-size models (H, W): ours take an int for a square
        if isinstance(size, (tuple, list)) and len(size) == 2 and size[0] == size[1]:
            kw["img_size"] = int(size[0])
        built.append(fn(pretrained=False, **kw))
        return built[-1]

    dtype = kwargs.pop("dtype", None)  # timm's factory options: where and in which float type to build
    with torch.device(kwargs.pop("device", None) or torch.get_default_device()):
        model = build_model_with_cfg(call, name, pretrained=False, feature_cfg=feature_cfg, **kwargs)
    if dtype is not None:
        model.to(dtype=dtype)
    net, cfg = built[0], model.pretrained_cfg
    if "num_classes" in cfg and getattr(net, "num_classes", None) is not None:  # features: no classes
        cfg["num_classes"] = net.num_classes
    size = getattr(net, "img_size", None)
    if size is not None:
        size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        cfg["input_size"] = (getattr(net, "in_chans", cfg["input_size"][0]), *size)
        pool = cfg.get("pool_size")
        if pool and getattr(net, "feature_info", None):  # the final map at that size (1-D: its length)
            cfg["pool_size"] = tuple(s // net.feature_info[-1]["reduction"] for s in size[-len(pool) :])
    return model


def is_model(name: str) -> bool:
    """Whether ``name`` is one of repmlp's models (registered with timm by a module of this package, or
    outside timm: :data:`OUTSIDE_TIMM`)."""
    return name in OUTSIDE_TIMM or (
        timm.is_model(name) and timm.models.model_entrypoint(name).__module__.startswith("repmlp.")
    )


def list_models(pattern: str = "") -> list[str]:
    """Sorted names of repmlp's models, optionally filtered by a shell-style ``pattern``."""
    outside = fnmatch.filter(OUTSIDE_TIMM, pattern) if pattern else list(OUTSIDE_TIMM)
    return sorted([*(n for n in timm.list_models(pattern) if is_model(n)), *outside])


def get_pretrained_cfg(name: str) -> PretrainedCfg | None:
    """timm's ``get_pretrained_cfg``, which knows repmlp's models outside timm too (``None``: no cfg)."""
    return copy.deepcopy(OUTSIDE_TIMM[name][1]) if name in OUTSIDE_TIMM else timm.get_pretrained_cfg(name)


def resolve_model(name: str) -> tuple[str, str]:
    """``(source, bare name)``: ``"repmlp"``, ``"timm"`` or ``"torchvision"``, in that order (prefixes ``repmlp:``,
    ``timm:``, ``torchvision:`` force one); a ``ValueError`` for a name none knows (close names are the
    command line's: :func:`repmlp.commands._common.model_name`)."""
    source, _, bare = name.rpartition(":")
    if source not in ("", "repmlp", "timm", "torchvision"):
        raise ValueError(f"unknown model source {source!r} in {name} (repmlp, timm, torchvision)")
    if source in ("", "repmlp") and is_model(bare):
        return "repmlp", bare
    if source in ("", "timm") and timm.is_model(bare):
        return "timm", bare
    if source in ("", "torchvision") and bare in torchvision.models.list_models(module=torchvision.models):
        return "torchvision", bare
    raise ValueError(f"unknown model {name!r} (not a repmlp, timm or torchvision model name); "
                     "`repmlp.list_models()` lists repmlp's models")  # fmt: skip


def create_model(name: str, *, num_classes: int | None = None, in_chans: int | None = None,
                 deploy: bool = False, pretrained: bool = False, **kwargs: Any) -> nn.Module:  # fmt: skip
    """A model by name (:func:`resolve_model`); ``num_classes``/``in_chans`` left ``None`` keep its defaults
    (``num_classes=0``: no classifier). ``deploy=True``: the inference form (repmlp's models build the
    converted structure, which takes ``reparameterize_model(model)``'s state dict; timm's and torchvision's
    are converted). A ``ValueError`` for an unknown name or an option the model does not take."""
    source, bare = resolve_model(name)
    for key, value, lowest in (("in_chans", in_chans, 1), ("num_classes", num_classes, 0)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lowest
        ):
            floor = "a positive integer" if lowest else "an integer >= 0 (0: no classifier)"
            raise ValueError(f"{key} must be {floor}, got {value!r}")
    opts = {k: v for k, v in (("num_classes", num_classes), ("in_chans", in_chans)) if v is not None}
    if source == "repmlp" and bare in OUTSIDE_TIMM:
        return OUTSIDE_TIMM[bare][0](pretrained=pretrained, deploy=deploy, **opts, **kwargs)
    if source == "repmlp":
        return timm.create_model(bare, pretrained=pretrained, deploy=deploy, **opts, **kwargs)
    if pretrained:  # this package never downloads weights
        raise _no_pretrained(bare)
    if source == "timm":
        model = timm.create_model(bare, **opts, **kwargs)
    elif opts.pop("in_chans", 3) != 3:
        raise ValueError(f"torchvision model {bare!r} supports only in_chans=3")
    else:
        model = torchvision.models.get_model(bare, weights=None, **opts, **kwargs)
    return reparameterize_model(model.eval(), inplace=True) if deploy else model


def takes_img_size(name: str) -> bool:
    """Whether model ``name`` is built for one input size: every repmlp model (FC3 and the partitions depend
    on it), and timm models whose config says ``fixed_input_size`` (vision transformers...)."""
    try:
        source, bare = resolve_model(name)
    except ValueError:
        return False
    return source == "repmlp" or (
        source == "timm" and bool(getattr(timm.get_pretrained_cfg(bare), "fixed_input_size", False))
    )


def default_input_size(model: nn.Module, fallback: Sequence[int] = (3, 224, 224)) -> tuple[int, ...]:
    """``(C, H, W)`` a built model expects: its timm ``pretrained_cfg`` input size, else ``fallback``."""
    return tuple(int(s) for s in (getattr(model, "pretrained_cfg", None) or {}).get("input_size") or fallback)


def build_model(
    name: str,
    model_args: Mapping[str, Any] | None = None,
    *,
    num_classes: int | None = None,
    in_chans: int | None = None,
    img_size: int | None = None,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """``(create_model(name, **kwargs), kwargs)``: ``model_args`` with the data's sizes (``img_size`` only for a
    model built for one: :func:`takes_img_size`), seen by ``check`` before the build. An unknown name or an
    option the model rejects is a :class:`UserError`; any other exception is a bug and keeps its traceback."""
    kwargs = dict(model_args or {})
    kwargs.update({k: v for k, v in (("num_classes", num_classes), ("in_chans", in_chans)) if v is not None})
    if img_size is not None and takes_img_size(name):
        kwargs = {"img_size": img_size, **kwargs}
    if check is not None:
        check(kwargs)
    try:
        return create_model(name, **kwargs), kwargs
    except (TypeError, ValueError) as exc:
        raise UserError(f"cannot build model {name!r}: {first_line(exc)}") from exc


def check_forward(model: nn.Module, input_size: Sequence[int], what: str) -> None:
    """Run one zero example through ``model`` (in full float32); a shape it rejects is a :class:`UserError`."""
    try:
        with torch.inference_mode(), full_float32():
            model(torch.zeros(1, *input_size))
    except (RuntimeError, ValueError) as exc:
        if type(exc).__name__ == "OutOfMemoryError":  # the device's limit, not the input's shape
            raise
        size = "x".join(str(s) for s in input_size)
        raise UserError(
            f"{what} does not take {size} inputs ({first_line(exc)}); pass the right --img-size"
        ) from None
