"""Import released checkpoints as repmlp model files: the authors' RepMLP-Res50 (Bottleneck and Light) and
RepMLPNet ``.pth`` files, and mmpretrain's RepMLPNet.

Reading is safe: ``torch.load(weights_only=True)`` unpickles only tensors and plain containers, so a file
that would run code is refused. The state dict may sit under ``"model"`` or ``"state_dict"`` and carry
DDP's ``module.`` prefix. The layout (authors' or mmpretrain's key names) and the form (training-time, or
locality-injected) are detected from the keys; every key is mapped onto our names (a key left over, or
one of ours left unfilled, is an error naming them) and the structure is inferred from the shapes and
checked against the named model. Locality-injected files still hold conv+BN pairs in the stem, the
downsampling layers and the FFNs; those are fused here, so the result is our deploy form.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import timm
import torch
from timm.data import ImageNetInfo
from torch import Tensor, nn

from repmlp.data.inputs import not_regular
from repmlp.errors import first_line
from repmlp.io.model_file import (
    FORMAT,
    RESERVED_OPTIONS,
    CheckpointError,
    ModelTooLarge,
    check_finite,
    compare_state,
    meta_build,
    read_metadata,
    save_model,
)
from repmlp.models.registry import create_model, is_model
from repmlp.nn.reparam import fuse_bn

__all__ = [
    "WeightsImportError",
    "read_state_dict",
    "import_checkpoint",
    "import_to_file",
    "ImportResult",
    "detect_layout",
    "eval_preprocessing",
    "imagenet_class_names",
]


# A checkpoint that cannot be imported (unsafe, unknown layout, keys that do not fit): one line, as any file.
WeightsImportError = CheckpointError


def _load(path: Path) -> Any:
    """``torch.load(weights_only=True)``; one-line errors that tell a file that would run code (unsafe)
    from one that is no PyTorch checkpoint at all (text, another format, truncated)."""
    try:
        found = read_metadata(path).get("format")
    except CheckpointError:  # not safetensors: a checkpoint, perhaps
        found = None
    if found == FORMAT:
        raise WeightsImportError(f"{path} is already a repmlp model file: use it as it is (no import needed)")
    try:
        with warnings.catch_warnings():
            # torch's note on checking sparse tensors: a sparse tensor is refused below anyway.
            warnings.filterwarnings("ignore", "Validating sparse tensor invariants", UserWarning)
            # mmap: the tensors of a zip checkpoint are mapped, not read, until they are used.
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as exc:
        if "weights_only" not in str(exc) and "Weights only load failed" not in str(exc):
            raise WeightsImportError(
                f"{path} is not a PyTorch checkpoint (unpickling failed: {first_line(exc)})"
            ) from None
        found = re.search(r"(?:GLOBAL|global) ([\w.]+)", str(exc))
        what = f" (it refers to {found.group(1)})" if found else ""
        raise WeightsImportError(
            f"refusing to load {path}: it holds more than tensors and plain containers{what}, and loading it "
            "could run code"
        ) from None
    except Exception as exc:  # noqa: BLE001 - whatever torch.load raises on a damaged file, it is not readable
        raise WeightsImportError(
            f"cannot read {path} as a PyTorch checkpoint ({type(exc).__name__}: {first_line(exc)[:200]})"
        ) from None


def read_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """The flat tensor dict of a ``.pth`` file, loaded with ``weights_only=True`` (nothing else is run).

    Unwraps ``{"model": sd}`` / ``{"state_dict": sd}`` and strips DDP's ``module.`` prefix. Every tensor
    must be dense, real and non-empty: a sparse, complex or zero-size tensor is no released weight.
    """
    path = Path(path)
    kind = not_regular(path)
    if kind == "missing":
        raise WeightsImportError(f"checkpoint not found: {path}")
    if kind is not None:
        raise WeightsImportError(f"checkpoint {path} is {kind}, not a regular file")
    obj = _load(path)
    for key in ("state_dict", "model"):
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
            break
    if not isinstance(obj, Mapping) or not obj:
        raise WeightsImportError(f"{path} holds no state dict (expected a dict of tensors)")
    tensors = {str(k): v for k, v in obj.items() if isinstance(v, Tensor)}
    others = [str(k) for k, v in obj.items() if not isinstance(v, Tensor)]
    if others:
        raise WeightsImportError(f"{path}: entries that are not tensors: {', '.join(others[:5])}")
    for key, t in tensors.items():
        if t.layout != torch.strided:
            raise WeightsImportError(f"{path}: tensor {key} is not dense ({t.layout}): not a released weight")
        if t.is_complex() or t.is_quantized or not (t.is_floating_point() or t.dtype in _INT_DTYPES):
            raise WeightsImportError(f"{path}: tensor {key} is {t.dtype}, not a real-valued weight")
        if t.numel() == 0:
            raise WeightsImportError(f"{path}: tensor {key} is empty (shape {tuple(t.shape)})")
    _check_keys(path, tensors)
    _check_storage(path, tensors)
    check_finite(path, tensors)  # a NaN weight makes every output NaN: no released weight holds one
    if all(k.startswith("module.") for k in tensors):
        tensors = {k[len("module.") :]: v for k, v in tensors.items()}
    return tensors


_INT_DTYPES = (torch.int64, torch.int32)  # BatchNorm's num_batches_tracked
# A released checkpoint's keys are module paths (``stages.2.1.repmlp_block.fc3.weight``): short, with
# indices of a few digits. Longer keys or numbers are no weights of any model (and int() of a 5,000-digit
# index fails), refused as the file is read.
_MAX_KEY = 300
_MAX_INDEX_DIGITS = 6


def _check_keys(path: Path, tensors: Mapping[str, Tensor]) -> None:
    """Every key is at most :data:`_MAX_KEY` characters, its numbers at most :data:`_MAX_INDEX_DIGITS` digits."""
    for key in tensors:
        if len(key) > _MAX_KEY or re.search(rf"\d{{{_MAX_INDEX_DIGITS + 1}}}", key):
            raise WeightsImportError(
                f"{path}: key {key[:60]!r}{'...' if len(key) > 60 else ''} is no module path of a model "
                f"(keys are at most {_MAX_KEY} characters, indices at most {_MAX_INDEX_DIGITS} digits)"
            )


def _check_storage(path: Path, tensors: Mapping[str, Tensor]) -> None:
    """The tensors' elements must be stored in the file: a tensor with zero or overlapping strides (an
    ``expand``ed one, say) holds more elements than the bytes under it, and copying it out (``.contiguous()``,
    saving) would allocate what a small file asks for, not what it holds. Each tensor's elements must fit its
    storage, and all of them together the file's distinct storages (views of one storage, as released
    checkpoints hold them, are fine)."""
    stored: dict[int, int] = {}
    logical = 0
    for key, t in tensors.items():
        storage = t.untyped_storage()
        size = t.numel() * t.element_size()
        if size > storage.nbytes():
            raise WeightsImportError(
                f"{path}: tensor {key} of shape {tuple(t.shape)} repeats {storage.nbytes()} stored bytes as "
                f"{size} (zero or overlapping strides): not a released weight"
            )
        stored[storage.data_ptr()] = max(stored.get(storage.data_ptr(), 0), storage.nbytes())
        logical += size
    if logical > sum(stored.values()):
        raise WeightsImportError(
            f"{path}: its tensors hold {logical} bytes but the file stores {sum(stored.values())} "
            "(views that overlap): not a released checkpoint"
        )


# ----------------------------------------------------------------------------------- key mapping
_UNIT = r"stages\.(\d+)\.(\d+)\."

# (pattern, replacement) pairs; the replacement may use the groups. Applied after the layout's prefix
# rules; the first match wins. ``{k}`` stands for a Local Perceptron kernel, mapped to a branch index.
_COMMON_RULES: list[tuple[str, str]] = [
    (_UNIT + r"repmlp_block\.fc3\.(weight|bias)$", r"stages.\1.blocks.\2.repmlp.fc3.\3"),
    (_UNIT + r"repmlp_block\.fc3_bn\.(.+)$", r"stages.\1.blocks.\2.repmlp.fc3_bn.\3"),
    (
        _UNIT + r"repmlp_block\.repconv(\d+)\.(conv|bn)\.(.+)$",
        r"stages.\1.blocks.\2.repmlp.local.{k\3}.\4.\5",
    ),
    (_UNIT + r"ffn_block\.ffn_fc([12])\.(conv|bn)\.(.+)$", r"stages.\1.blocks.\2.ffn.fc\3.\4.\5"),
]

_AUTHORS_RULES: list[tuple[str, str]] = [
    (r"conv_embedding\.(conv|bn)\.(.+)$", r"stem.\1.\2"),
    (_UNIT + r"prebn([12])\.(.+)$", r"stages.\1.blocks.\2.norm\3.\4"),
    (_UNIT + r"repmlp_block\.gp\.(fc[12])\.(weight|bias)$", r"stages.\1.blocks.\2.repmlp.gp.\3.\4"),
    (r"embeds\.(\d+)\.(conv|bn)\.(.+)$", r"stages.{next\1}.downsample.\2.\3"),
    (r"head_norm\.(.+)$", r"norm.\1"),
    (r"head\.(weight|bias)$", r"head.\1"),
]

_MMPRETRAIN_RULES: list[tuple[str, str]] = [
    (r"backbone\.patch_embed\.projection\.(.+)$", r"stem.conv.\1"),
    (r"backbone\.patch_embed\.norm\.(.+)$", r"stem.bn.\1"),
    (r"backbone\." + _UNIT + r"(norm[12])\.(.+)$", r"stages.\1.blocks.\2.\3.\4"),
    (
        r"backbone\." + _UNIT + r"repmlp_block\.gp\.conv([12])\.conv\.(.+)$",
        r"stages.\1.blocks.\2.repmlp.gp.fc\3.\4",
    ),
    (r"backbone\.downsample_layers\.(\d+)\.(conv|bn)\.(.+)$", r"stages.{next\1}.downsample.\2.\3"),
    (r"backbone\.final_norm\.(.+)$", r"norm.\1"),
    (r"head\.fc\.(weight|bias)$", r"head.\1"),
]

_RES = r"stage([1-4])\.(\d+)\."
_REP = _RES + r"(?:btnk|light)_repmlp\."
_RES50_RULES: list[tuple[str, str]] = [
    (r"stage0\.0\.(conv|bn)\.(.+)$", r"stem.conv.\1.\2"),
    (_RES + r"shortcut\.(.+)$", r"layer\1.\2.downsample.\3"),
    (_RES + r"(conv[123])\.(.+)$", r"layer\1.\2.\3.\4"),
    (_RES + r"(?:btnk|light)_conv1\.(.+)$", r"layer\1.\2.conv1.\3"),
    (_RES + r"btnk_conv2\.(.+)$", r"layer\1.\2.conv2.\3"),
    (_RES + r"btnk_conv4\.(.+)$", r"layer\1.\2.conv3.\3"),
    (_RES + r"btnk_conv5\.(.+)$", r"layer\1.\2.conv4.\3"),
    (_RES + r"light_conv3\.(.+)$", r"layer\1.\2.conv2.\3"),
    (_REP + r"fc1_fc2\.(fc[12])\.(weight|bias)$", r"layer\1.\2.repmlp.global_perceptron.\3.\4"),
    (_REP + r"avg\.bn\.(.+)$", r"layer\1.\2.repmlp.global_perceptron.bn.\3"),
    (_REP + r"fc3\.(weight|bias)$", r"layer\1.\2.repmlp.partition_perceptron.fc3.\3"),
    (_REP + r"fc3_bn\.(.+)$", r"layer\1.\2.repmlp.partition_perceptron.bn.\3"),
    (_REP + r"repconv(\d+)\.(conv|bn)\.(.+)$", r"layer\1.\2.repmlp.local_perceptron.{k\3}.\4.\5"),
    (r"linear\.(weight|bias)$", r"fc.\1"),
]

LAYOUTS: dict[str, tuple[Callable[[dict[str, Tensor]], bool], list[tuple[str, str]], str]] = {
    "authors": (lambda sd: any(k.startswith("conv_embedding.") for k in sd), _AUTHORS_RULES, ""),
    "mmpretrain": (
        lambda sd: any(k.startswith("backbone.patch_embed.") for k in sd),
        _MMPRETRAIN_RULES,
        "backbone.",
    ),
    "authors-res50": (lambda sd: any(k.startswith("stage0.0.") for k in sd), _RES50_RULES, "-"),
}


def detect_layout(sd: Mapping[str, Tensor]) -> str:
    """``"authors"``, ``"mmpretrain"`` (RepMLPNet) or ``"authors-res50"``; a :class:`WeightsImportError` otherwise."""
    for name, (test, _, _) in LAYOUTS.items():
        if test(sd):
            return name
    shown = ", ".join(list(sd)[:4])
    raise WeightsImportError(
        f"unrecognised checkpoint layout (first keys: {shown}); expected the authors' RepMLPNet "
        "(conv_embedding.*, stages.*), mmpretrain's RepMLPNet (backbone.patch_embed.*, head.fc.*) or the "
        "authors' RepMLP-Res50 (stage0.*, stage1.* ... linear.*)"
    )


def _map_keys(sd: Mapping[str, Tensor], layout: str) -> tuple[dict[str, Tensor], list[str]]:
    """Rename every key to ours; returns the mapped dict and the keys no rule matched."""
    _, rules, prefix = LAYOUTS[layout]
    # The RepMLPNet layouts share their block keys; "-" marks a layout with no shared rules.
    common = [] if prefix == "-" else [((r"backbone\." if prefix else "") + p, r) for p, r in _COMMON_RULES]
    compiled = [(re.compile(p), r) for p, r in (*rules, *common)]
    kernels = sorted({int(m.group(1)) for k in sd if (m := re.search(r"\.repconv(\d+)\.", k))})
    out: dict[str, Tensor] = {}
    unused: list[str] = []
    for key, value in sd.items():
        for pattern, repl in compiled:
            m = pattern.match(key)
            if m is None:
                continue
            new = m.expand(repl)
            new = re.sub(r"\{next(\d+)\}", lambda g: str(int(g.group(1)) + 1), new)
            new = re.sub(r"\{k(\d+)\}", lambda g: f"branches.{kernels.index(int(g.group(1)))}", new)
            if new.endswith("fc3.weight") and value.dim() == 4:
                value = value.reshape(value.shape[0], value.shape[1])  # 1x1 grouped conv -> GroupwiseLinear
            out[new] = value
            break
        else:
            unused.append(key)
    return out, unused


def _fuse_conv_bn_pairs(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Fold every ``P.conv`` + ``P.bn`` pair (eval statistics) into ``P.conv.weight``/``P.conv.bias``."""
    out = dict(sd)
    for key in [k for k in sd if k.endswith(".bn.running_var")]:
        p = key[: -len(".bn.running_var")]
        if f"{p}.conv.weight" not in sd:
            continue
        bn = nn.BatchNorm2d(sd[key].numel(), eps=1e-5)
        bn.load_state_dict(
            {n: sd[f"{p}.bn.{n}"] for n in bn.state_dict() if f"{p}.bn.{n}" in sd}, strict=False
        )
        weight, bias = fuse_bn(sd[f"{p}.conv.weight"].double(), bn.double(), None)
        dtype = sd[f"{p}.conv.weight"].dtype
        out[f"{p}.conv.weight"], out[f"{p}.conv.bias"] = weight.to(dtype), bias.to(dtype)
        for n in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            out.pop(f"{p}.bn.{n}", None)
    return out


# ------------------------------------------------------------------------------ shape inference
def infer_repmlpnet(sd: Mapping[str, Tensor]) -> dict[str, Any]:
    """Structure of a RepMLPNet from our-named tensors: channels, depths, sharesets, img_size, ..."""
    stem = sd["stem.conv.weight"]
    patch, in_chans = int(stem.shape[-1]), int(stem.shape[1])
    depths: list[int] = []
    channels, sharesets, sides = [], [], []
    gate = None
    i = 0
    while f"stages.{i}.blocks.0.norm1.weight" in sd:
        j = 0
        while f"stages.{i}.blocks.{j}.norm1.weight" in sd:
            j += 1
        depths.append(j)
        c = int(sd[f"stages.{i}.blocks.0.norm1.weight"].numel())
        channels.append(c)
        fc3 = sd[f"stages.{i}.blocks.0.repmlp.fc3.weight"]
        hw = int(fc3.shape[1])
        sharesets.append(int(fc3.shape[0]) // hw)
        side = round(hw**0.5)
        sides.append(side)
        gate = c // int(sd[f"stages.{i}.blocks.0.repmlp.gp.fc1.weight"].shape[0])
        i += 1
    if not depths:  # not one block: a partial state dict
        raise KeyError("stages.0.blocks.0.norm1.weight")
    kernels = sorted(
        {int(sd[k].shape[-1]) for k in sd if re.search(r"repmlp\.local\.branches\.\d+\.conv\.weight$", k)}
    )
    head = sd.get("head.weight")
    return dict(
        in_chans=in_chans,
        patch_size=patch,
        channels=tuple(channels),
        depths=tuple(depths),
        sharesets=tuple(sharesets),
        img_size=sides[0] * patch if sides else None,
        gate_reduction=gate,
        kernel_sizes=tuple(kernels),
        num_classes=int(head.shape[0]) if head is not None else 0,
    )


class ImportResult(dict):
    """``{"model", "name", "model_kwargs", "form", "layout"}`` of an imported checkpoint."""


_STRUCTURE = ("channels", "depths", "sharesets", "img_size", "patch_size", "gate_reduction")


def _check_structure(name: str, inferred: dict[str, Any], model_args: dict[str, Any],
                     sd: Mapping[str, Tensor]) -> None:  # fmt: skip
    """The inferred structure must be the named model's (with ``--model-arg`` overrides). The model is
    built on the ``meta`` device within the budget of the file's weights ``sd`` (:func:`_meta_build`)."""
    ref = _meta_build(name, model_args, sd, floor=(1 << 28, 20_000))
    expected = {
        "channels": tuple(s.blocks[0].norm1.num_features for s in ref.stages),
        "depths": tuple(len(s.blocks) for s in ref.stages),
        "sharesets": tuple(s.blocks[0].repmlp.sharesets for s in ref.stages),
        "img_size": ref.img_size[0],
        "patch_size": ref.stem.conv.kernel_size[0],
        "gate_reduction": ref.stages[0].blocks[0].repmlp.channels
        // ref.stages[0].blocks[0].repmlp.gp.fc1.out_channels,
    }
    # Partitions smaller than the map (not in any released model) hide the input size from the shapes.
    keys = [k for k in _STRUCTURE if not (k == "img_size" and model_args.get("partitions") is not None)]
    wrong = [f"{k} {inferred[k]} (the model has {expected[k]})" for k in keys if inferred[k] != expected[k]]
    if wrong:
        raise WeightsImportError(
            f"the checkpoint is not a {name}: its {'; '.join(wrong)}; pick the matching --model "
            "or pass --model-arg"
        )


def infer_res50(sd: Mapping[str, Tensor]) -> dict[str, Any]:
    """Options of a RepMLP-Res50 fixed by its shapes: FC3 groups per stage, Local kernels, classes."""
    groups: list[int] = [8, 8, 8, 8]
    for s in range(1, 5):
        key = next(
            (k for k in sd if re.fullmatch(rf"layer{s}\.\d+\.repmlp\.partition_perceptron\.fc3\.weight", k)),
            None,
        )
        if key is None:
            continue
        w = sd[key]
        block = key[: -len(".repmlp.partition_perceptron.fc3.weight")]
        c = int(sd[f"{block}.conv1.conv.weight"].shape[0])  # the block's first conv feeds the RepMLP width
        if f"{block}.conv4.conv.weight" in sd:  # Bottleneck: conv2 (3x3) sets the RepMLP width
            c = int(sd[f"{block}.conv2.conv.weight"].shape[0])
        hw = int(w.shape[0]) // c
        groups[s - 1] = c * hw // int(w.shape[1])
    kernels = sorted(
        {int(sd[k].shape[-1]) for k in sd if re.search(r"local_perceptron\.branches\.\d+\.conv\.weight$", k)}
    )
    return dict(groups=groups, kernel_sizes=kernels, num_classes=int(sd["fc.weight"].shape[0]))


# Which registered models each layout can hold.
_FAMILIES = {
    "authors": ("repmlpnet_",),
    "mmpretrain": ("repmlpnet_",),
    "authors-res50": ("repmlp_res50", "repmlp_res50_light"),
}


def import_checkpoint(
    path: str | os.PathLike, name: str, model_args: dict[str, Any] | None = None
) -> ImportResult:
    """Read ``path`` (a released RepMLPNet or RepMLP-Res50 ``.pth``) into the registered model ``name``.

    Returns the model (eval mode, weights loaded strictly), ``model_kwargs`` that rebuild it with
    :func:`repmlp.create_model`, its ``form`` (``"train"``, or ``"deploy"`` for a converted /
    locality-injected file) and the detected ``layout``.
    """
    if not is_model(name):
        raise WeightsImportError(f"--model {name!r} is not a registered repmlp model")
    args = dict(model_args or {})
    for key in sorted(set(args) & set(RESERVED_OPTIONS)):  # whether the model takes the others: its build
        raise WeightsImportError(f"--model-arg {key}: not a model option an imported file may set")
    raw = read_state_dict(path)
    layout = detect_layout(raw)
    family = _FAMILIES[layout]
    if not (name in family or any(name.startswith(f) and f.endswith("_") for f in family)):
        names = ", ".join(f + "*" if f.endswith("_") else f for f in family)
        raise WeightsImportError(f"{path} holds {layout} weights; --model must be one of {names}")
    if layout == "authors-res50" and (name == "repmlp_res50_light") != any("light_repmlp" in k for k in raw):
        kind = "RepMLP Light Blocks" if any("light_repmlp" in k for k in raw) else "RepMLP Bottlenecks"
        raise WeightsImportError(f"{path} holds a RepMLP-Res50 with {kind}, not a {name}")
    mapped, unused = _map_keys(raw, layout)
    if unused:
        raise WeightsImportError(
            f"{path}: {len(unused)} key(s) fit no key of the {layout} layout: {', '.join(unused[:5])}"
        )
    form = "train" if any(".fc3_bn." in k for k in raw) else "deploy"
    kwargs = dict(args)
    try:
        if layout == "authors-res50":
            inferred = infer_res50(mapped)
            if inferred["groups"] != [8, 8, 8, 8]:
                kwargs.setdefault("groups", inferred["groups"])
            default_k = [1, 3, 5]
        else:
            inferred = infer_repmlpnet(mapped)
            _check_structure(name, inferred, args, mapped)
            default_k = [1, 3]
    except WeightsImportError:
        raise
    except KeyError as exc:  # a partial state dict: name the first tensor the structure needs
        raise WeightsImportError(
            f"{path} is not a complete {layout} checkpoint: it has no {exc.args[0]} (in our names)"
        ) from None
    except (IndexError, ZeroDivisionError, ValueError, RuntimeError) as exc:
        raise WeightsImportError(
            f"{path}: its tensors' shapes do not make a model of the {layout} layout ({first_line(exc)[:200]})"
        ) from None
    if inferred["num_classes"] != 1000:
        kwargs.setdefault("num_classes", inferred["num_classes"])
    if form == "train" and list(inferred["kernel_sizes"]) != default_k:
        kwargs.setdefault("kernel_sizes", list(inferred["kernel_sizes"]))
    if form == "deploy":
        mapped = _fuse_conv_bn_pairs(mapped)
    # The model the shapes and --model-arg describe, sized on the meta device against the file first.
    own = _meta_build(name, kwargs, mapped, deploy=form == "deploy").state_dict()
    # A file without BatchNorm's num_batches_tracked counters keeps the model's (they are unused).
    counters = [k for k in own if k.endswith("num_batches_tracked") and k not in mapped]
    mapped.update({k: torch.zeros((), dtype=torch.long) for k in counters})
    compare_state(path, name, own, mapped)
    model = create_model(name, deploy=form == "deploy", **kwargs)
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in mapped.items()}, strict=True)
    return ImportResult(model=model.eval(), name=name, model_kwargs=kwargs, form=form, layout=layout)


def _meta_build(name: str, kwargs: dict[str, Any], sd: Mapping[str, Tensor], *, deploy: bool = False,
                floor: tuple[int, int] = (0, 0)) -> nn.Module:  # fmt: skip
    """``create_model(name, **kwargs)`` on the ``meta`` device within the budget of the file's weights ``sd``
    (:func:`repmlp.io.model_file.meta_build`): ``depths=[10**8, ...]`` is refused in milliseconds instead of
    building for minutes. ``floor``: the budget the structure check builds the named model with before the
    file's fit is known (any zoo model fits 2**28 elements and 20,000 tensors)."""
    try:
        return meta_build(lambda: create_model(name, deploy=deploy, **kwargs), sd, floor)
    except ModelTooLarge:
        raise WeightsImportError(f"{name} with {repr(kwargs)[:120]} (the file's shapes and --model-arg) is far "
                                 f"larger than the file's {sum(t.numel() for t in sd.values())} weights: check "
                                 "--model-arg") from None  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the options come from the file's shapes and --model-arg
        unknown = re.search(r"unexpected keyword argument '(\w+)'", first_line(exc))
        why = f"cannot build {name} with {repr(kwargs)[:120]}: {first_line(exc)[:200]}"
        if isinstance(exc, TypeError) and unknown:
            why = f"--model-arg {unknown.group(1)}: {name} has no option {unknown.group(1)!r}"
        raise WeightsImportError(why) from None


def eval_preprocessing(name: str) -> dict[str, object]:
    """How the published top-1 of ``name`` was measured: the model's default cfg (resize/crop/mean/std)."""
    cfg = timm.get_pretrained_cfg(name).to_dict()
    keys = ("input_size", "crop_pct", "crop_mode", "interpolation", "mean", "std")
    return {k: list(cfg[k]) if isinstance(cfg.get(k), tuple) else cfg.get(k) for k in keys if k in cfg}


def imagenet_class_names(num_classes: int) -> list[str] | None:
    """ImageNet-1k's class names (timm's ``ImageNetInfo`` descriptions, e.g. ``"tench, Tinca tinca"``)
    for a 1000-class model; ``None`` for any other number of classes (the file then has none)."""
    if num_classes != 1000:
        return None
    return list(ImageNetInfo().label_descriptions())


def import_to_file(
    path: str | os.PathLike, name: str, model_args: dict[str, Any] | None, output: str | os.PathLike
) -> ImportResult:
    """:func:`import_checkpoint`, then the model file ``repmlp import`` writes: the imported model with
    its input size, the preprocessing its published accuracy was measured with, and ImageNet-1k's class
    names for a 1000-class model (what ``repmlp predict`` shows)."""
    result = import_checkpoint(path, name, model_args)
    model = result["model"]
    img = getattr(model, "img_size", (224, 224))
    extra: dict[str, Any] = {
        "imported_from": Path(path).name,
        "layout": result["layout"],
        "input_size": [int(getattr(model, "in_chans", 3)), int(img[0]), int(img[1])],
        "eval_preprocessing": eval_preprocessing(name),
    }
    classes = imagenet_class_names(
        result["model_kwargs"].get("num_classes", getattr(model, "num_classes", 0))
    )
    if classes:
        extra["classes"] = classes
    save_model(
        output, model, name=name, model_kwargs=result["model_kwargs"], form=result["form"], extra=extra
    )
    return result
