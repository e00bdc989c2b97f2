"""Model registry: repmlp's own names, registered with timm too, plus timm/torchvision fall-backs.

``@register_model`` on ``fn(pretrained: bool = False, **kwargs) -> nn.Module`` records ``fn`` under its
``__name__`` and registers a timm-compatible entrypoint of the same name, so that after
``import repmlp`` both ``repmlp.create_model(name)`` and ``timm.create_model(name)`` build it.
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import functools
import numbers
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from repmlp.data.normalization import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "register_model",
    "create_model",
    "list_models",
    "model_default_cfg",
    "is_model",
    "file_head_prefixes",
    "model_options",
]

ModelFn = Callable[..., nn.Module]

_MODELS: dict[str, ModelFn] = {}
_CFGS: dict[str, dict[str, Any]] = {}

# ImageNet's per-channel statistics, the one copy (models' cfgs, ImageNet folders, Cityscapes).

# Models built through timm's build_model_with_cfg (those registered with timm, and repmlp-only models with
# feature levels): their feature_cfg. _TIMM_NAMES: the ones registered with timm.
_FEATURE_CFGS: dict[str, dict[str, Any]] = {}
_TIMM_NAMES: set[str] = set()

# Keyword arguments timm's factory passes to every entrypoint; our builders do not use them.
_TIMM_ONLY_KWARGS = ("pretrained_cfg", "cache_dir")


def _default_cfg(name: str, **overrides: Any) -> dict[str, Any]:
    """A timm ``pretrained_cfg`` dict (no weights: ``url``/``hf_hub_id`` empty)."""
    cfg: dict[str, Any] = {
        "url": "",
        "hf_hub_id": None,
        "architecture": name,
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": None,
        "crop_pct": 0.875,
        "interpolation": "bilinear",
        "mean": IMAGENET_MEAN,
        "std": IMAGENET_STD,
        "first_conv": "",
        "classifier": "head.fc",
        "license": "mit",
    }
    cfg.update(overrides)
    return cfg


def _no_pretrained(name: str, pretrained: bool) -> None:
    if pretrained:
        raise ValueError(
            f"no pretrained weights are distributed for {name!r}; train one with `repmlp train` (or "
            "`repmlp import` released ones) and load the file with repmlp.load_model, or with "
            "pretrained=True, pretrained_cfg_overlay=dict(file=PATH)"
        )


def register_model(
    fn: ModelFn | None = None, *, feature_cfg: dict[str, Any] | None = None, timm: bool = True, **cfg: Any
) -> Any:
    """Register a model builder under its ``__name__`` (usable bare or as ``@register_model(**cfg)``).

    ``cfg`` overrides the timm ``pretrained_cfg`` fields (``input_size``, ``num_classes``, ``mean``,
    ``pool_size``, ``fixed_input_size``, ...); ``num_classes`` and ``input_size`` there should be the
    builder's defaults. With ``timm=True`` the model is registered with timm as well and built through
    timm's ``build_model_with_cfg``: ``features_only=True`` (with ``out_indices``) then wraps it in
    timm's feature extractor chosen by ``feature_cfg`` (``FeatureListNet`` on the model's
    ``feature_info`` by default; ``feature_cls="getter"`` for models with ``forward_intermediates``).
    ``timm=False`` keeps it in repmlp's registry only, for models outside timm's image-model contract (a
    dense predictor, 1-D feature maps): ``timm.create_model`` does not know the name. Such a model given a
    ``feature_cfg`` is still built by ``build_model_with_cfg`` (its cfg passed explicitly), so
    ``repmlp.create_model(name, features_only=True)`` wraps it as timm would.
    """

    def wrap(fn: ModelFn) -> ModelFn:
        name = fn.__name__
        _MODELS[name] = fn
        _CFGS[name] = _default_cfg(name, **cfg)
        if timm and _register_with_timm(name, fn):
            _TIMM_NAMES.add(name)
            _FEATURE_CFGS[name] = dict(feature_cfg or {})
        elif feature_cfg is not None and _timm_importable():
            _FEATURE_CFGS[name] = dict(feature_cfg)
        return fn

    return wrap(fn) if fn is not None else wrap


def _timm_importable() -> bool:
    try:
        import timm.models  # noqa: F401
    except ImportError:  # timm is a dependency, but the registry works without it
        return False
    return True


def _register_with_timm(name: str, fn: ModelFn) -> bool:
    """Register ``fn``'s timm entrypoint and its default cfg; False when timm is not installed."""
    try:
        import timm.models as tm
        from timm.models import generate_default_cfgs
    except ImportError:  # timm is a dependency, but the registry works without it
        return False

    @functools.wraps(fn)
    def entrypoint(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        for key in _TIMM_ONLY_KWARGS:
            kwargs.pop(key, None)
        return _build(name, pretrained=pretrained, **kwargs)

    # timm looks the pretrained cfg up in ``sys.modules[fn.__module__].default_cfgs`` at registration.
    module = sys.modules[fn.__module__]
    if not hasattr(module, "default_cfgs"):
        module.default_cfgs = {}
    module.default_cfgs.update(generate_default_cfgs({name: dict(_CFGS[name])}))
    tm.register_model(entrypoint)
    return True


def _call_builder(fn: ModelFn, **kwargs: Any) -> nn.Module:
    """Call a builder as timm's ``build_model_with_cfg`` does; a square ``img_size`` pair becomes an int.

    timm passes ``img_size=input_size[-2:]`` to fixed-size models; ours take an int (square inputs).
    """
    size = kwargs.get("img_size")
    if isinstance(size, (tuple, list)) and len(size) == 2 and size[0] == size[1]:
        kwargs["img_size"] = int(size[0])
    return fn(pretrained=False, **kwargs)


def _pretrained_file(name: str, pretrained: bool, overlay: dict | None) -> str | None:
    """The model file of ``pretrained=True, pretrained_cfg_overlay=dict(file=PATH)`` (timm's way to
    point a model at local weights); an error for ``pretrained=True`` without one (nothing is downloaded)."""
    path = (overlay or {}).get("file") if pretrained else None
    if pretrained and not path:
        _no_pretrained(name, pretrained)
    return str(path) if path else None


def _read_pretrained(name: str, path: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], Any, dict]:
    """A repmlp model file for ``name``: its tensors and metadata, and ``kwargs`` completed with the file's
    model options (those not given; ``num_classes`` given keeps its value, as timm adapts the head). The
    metadata is checked (:func:`repmlp.models.file_metadata.parse_metadata`) and the model it describes is sized on
    the ``meta`` device against the file before anything real is built."""
    from pathlib import Path

    from repmlp.models.file_format import FORMAT, CheckpointError, read_tensors
    from repmlp.models.file_metadata import build_error, check_tensors, meta_model, parse_metadata

    tensors, meta = read_tensors(Path(path))
    if meta.get("format") != FORMAT or meta.get("model") != name:
        found = meta.get("model") if meta.get("format") == FORMAT else "not a repmlp model file"
        raise CheckpointError(f"pretrained file {path} does not hold {name} ({found})")
    fm = parse_metadata(path, meta, model_options)
    check_tensors(path, tensors)
    if fm.precision == "int8":
        raise CheckpointError(f"{path} is an int8 (ONNX) file: load it with repmlp.load_model")
    form, deploy = fm.form, bool(kwargs.get("deploy", False))
    if (form == "deploy") != deploy:
        hint = "pass deploy=True" if form == "deploy" else "leave deploy out (the file is the training form)"
        raise CheckpointError(f"{path} holds the {form} form of {name}: {hint}")
    merged = {**fm.model_kwargs, **kwargs}
    held = sum(t.numel() for t in tensors.values())
    try:  # the file's options may describe any size: measure on the meta device first
        plain = {k: v for k, v in merged.items() if k != "features_only"}  # sized as the plain model
        meta_model(lambda: _build_empty(name, **plain), 4 * held + (1 << 20),
                   4 * len(tensors) + 10_000)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the options come from the file
        raise build_error(path, name, fm.model_kwargs, held, exc) from None
    return merged, tensors, meta


def _build(
    name: str, *, pretrained: bool = False, pretrained_cfg_overlay: dict | None = None, **kwargs: Any
) -> nn.Module:
    file = _pretrained_file(name, pretrained, pretrained_cfg_overlay)
    if file:
        kwargs, tensors, meta = _read_pretrained(name, file, kwargs)
    model = _build_empty(name, pretrained_cfg_overlay=pretrained_cfg_overlay, **kwargs)
    if file and not kwargs.get("features_only"):
        from repmlp.models.file_format import load_matching

        # Strict, but a classifier for another number of classes keeps its fresh initialisation (timm's
        # load_pretrained). bf16/fp16 weights are copied into the float32 model.
        load_matching(
            model, tensors, meta, file_head=file_head_prefixes(name), what=f"pretrained file {file}"
        )
    elif file:
        raise ValueError("features_only with a pretrained file: load the model, then wrap it")
    return model


def _pretrained_cfg_arg(name: str, given: Any) -> Any:
    """``build_model_with_cfg``'s ``pretrained_cfg``: the one given, else none for a model registered with timm
    (timm's registry holds its cfg), else the model's own cfg (a repmlp-only model)."""
    if given is not None or name in _TIMM_NAMES:
        return given
    return dict(_CFGS[name])


def _build_empty(name: str, *, pretrained_cfg_overlay: dict | None = None, **kwargs: Any) -> nn.Module:
    device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
    if name in _FEATURE_CFGS:
        from timm.models import build_model_with_cfg

        model = build_model_with_cfg(
            functools.partial(_call_builder, _MODELS[name]),
            name,
            pretrained=False,
            pretrained_cfg=_pretrained_cfg_arg(name, kwargs.pop("pretrained_cfg", None)),
            pretrained_cfg_overlay=pretrained_cfg_overlay,
            feature_cfg=dict(_FEATURE_CFGS[name]),
            **kwargs,
        )
        if kwargs.get("features_only"):
            return model if device is None and dtype is None else model.to(device=device, dtype=dtype)
        cfg = {**model.pretrained_cfg}
    else:
        model = _MODELS[name](pretrained=False, **kwargs)
        cfg = {**_CFGS[name], **(pretrained_cfg_overlay or {})}
    if getattr(model, "num_classes", None) is not None:
        cfg["num_classes"] = model.num_classes
    if getattr(model, "img_size", None) is not None:
        size = model.img_size if isinstance(model.img_size, tuple) else (model.img_size, model.img_size)
        cfg["input_size"] = (getattr(model, "in_chans", cfg["input_size"][0]), *size)
    model.pretrained_cfg = cfg
    model.default_cfg = cfg
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    return model


def file_head_prefixes(name: str) -> list[str]:
    """State-dict prefixes of registered model ``name``'s classifier (its cfg); ``[]`` for other names.

    What a file of that model holds as its head, to drop when it does not fit another model."""
    if name not in _CFGS:
        return []
    cls = _CFGS[name].get("classifier")
    return [c + "." for c in ([cls] if isinstance(cls, str) else cls or []) if c]


def _option_names(fn: Callable[..., Any], skip: tuple[str, ...] = ()) -> tuple[set[str], bool]:
    """The keyword parameters of ``fn`` and whether it also takes ``**kwargs``."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: it takes anything
        return set(), True
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named - set(skip), any(p.kind == p.VAR_KEYWORD for p in params)


def model_options(name: str) -> set[str] | None:
    """The options (keyword arguments) registered model ``name`` takes, from its builder's signature
    (``num_classes`` and ``in_chans``, which :func:`create_model` passes, included); ``None`` when the
    signature cannot tell (a builder that hands ``**kwargs`` on; timm's and torchvision's models): the
    model is then checked by building it."""
    source, _, bare = name.rpartition(":")
    if source not in ("", "repmlp") or bare not in _MODELS:
        return None
    names, open_ended = _option_names(_MODELS[bare], ("pretrained",))
    return None if open_ended else names | {"num_classes", "in_chans"}


def is_model(name: str) -> bool:
    """Whether ``name`` is one of repmlp's registered models."""
    return name in _MODELS


def model_default_cfg(name: str) -> dict[str, Any]:
    """A copy of the timm-style default cfg of a registered model (``input_size``, ``num_classes``, ...)."""
    if name not in _MODELS:
        raise ValueError(f"unknown repmlp model {name!r}")
    return copy.deepcopy(_CFGS[name])


def list_models(pattern: str | None = None) -> list[str]:
    """Sorted names of repmlp's registered models, optionally filtered by a shell-style ``pattern``."""
    names = sorted(_MODELS)
    return [n for n in names if fnmatch.fnmatch(n, pattern)] if pattern else names


def _torchvision_names() -> list[str]:
    import torchvision

    return list(torchvision.models.list_models(module=torchvision.models))


def _timm_names() -> list[str]:
    import timm

    return list(timm.list_models())


def _unknown(name: str) -> ValueError:
    candidates = list(_MODELS)
    for source in (_timm_names, _torchvision_names):
        try:
            candidates += source()
        except Exception:  # noqa: BLE001 - suggestions only; never hide the real error
            pass
    # repmlp's names are timm's too: each name once, in the order found.
    close = difflib.get_close_matches(name, list(dict.fromkeys(candidates)), n=5, cutoff=0.6)
    hint = f"; did you mean: {', '.join(close)}" if close else ""
    return ValueError(
        f"unknown model {name!r} (not a repmlp, timm or torchvision model name){hint}. "
        "`repmlp.list_models()` lists repmlp's models"
    )


def _check_counts(opts: dict[str, Any]) -> None:
    """``in_chans`` must be a positive integer and ``num_classes`` a non-negative one (0 is timm's "no
    classifier": the model returns its pooled features). Every builder would otherwise make something of a
    zero or negative count: an empty first conv, a head of -1 outputs that fails at its first forward."""
    for key, lowest in (("in_chans", 1), ("num_classes", 0)):
        value = opts.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lowest
        ):
            floor = "a positive integer" if lowest else "an integer >= 0 (0: no classifier)"
            raise ValueError(f"{key} must be {floor}, got {value!r}")


def _maybe_deploy(model: nn.Module, deploy: bool) -> nn.Module:
    if not deploy:
        return model
    from repmlp.nn.convert import reparameterize_model

    return reparameterize_model(model.eval(), inplace=True)


def create_model(
    name: str,
    *,
    num_classes: int | None = None,
    in_chans: int | None = None,
    deploy: bool = False,
    pretrained: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """Build a model by name: repmlp's registry first, then timm's, then torchvision's.

    Prefixes ``timm:`` and ``torchvision:`` force a source (both also build a model whose name repmlp
    uses for something else). ``num_classes``/``in_chans`` left ``None`` keep the model's defaults.
    ``deploy=True`` builds the inference form: for repmlp's models the converted structure directly
    (load the state dict of ``reparameterize_model(model)`` into it with ``strict=True``); for timm's
    and torchvision's, the freshly built eval model passed through ``reparameterize_model``.

    Raises:
        ValueError: unknown name (with close matches) or an option the model does not support.
    """
    source = None
    if ":" in name:
        source, name = name.split(":", 1)
        if source not in ("repmlp", "timm", "torchvision"):
            raise ValueError(
                f"unknown model source {source!r} in {source}:{name} (repmlp, timm, torchvision)"
            )
    opts = {k: v for k, v in (("num_classes", num_classes), ("in_chans", in_chans)) if v is not None}
    _check_counts(opts)

    if source in (None, "repmlp") and name in _MODELS:
        return _build(name, pretrained=pretrained, deploy=deploy, **opts, **kwargs)
    if source == "repmlp":
        raise _unknown(name)

    if source in (None, "timm"):
        import timm

        if timm.is_model(name):
            _no_pretrained(name, pretrained)  # this package never downloads weights
            return _maybe_deploy(timm.create_model(name, pretrained=False, **opts, **kwargs), deploy)
        if source == "timm":
            raise _unknown(name)

    import torchvision

    if name in _torchvision_names():
        _no_pretrained(name, pretrained)
        if opts.get("in_chans", 3) != 3:
            raise ValueError(f"torchvision model {name!r} supports only in_chans=3")
        if "num_classes" in opts:
            kwargs["num_classes"] = opts["num_classes"]
        model = torchvision.models.get_model(name, weights=None, **kwargs)
        return _maybe_deploy(model, deploy)
    raise _unknown(name)
