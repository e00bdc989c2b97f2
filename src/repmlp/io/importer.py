"""Released checkpoints (the authors' RepMLP-Res50 and RepMLPNet ``.pth`` files, mmpretrain's RepMLPNet) as
repmlp model files: nothing but tensors and plain containers unpickled, the layout and form read from the
keys, every key mapped onto ours, the structure inferred from the shapes and checked against the named model
(docs/models.md, "Importing released weights")."""

from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import timm
import torch
from timm.data import ImageNetInfo
from torch import Tensor
from torch.nn.utils import fuse_conv_bn_weights

from repmlp.data.inputs import not_regular
from repmlp.errors import first_line
from repmlp.io.model_file import (
    FORMAT,
    RESERVED_OPTIONS,
    CheckpointError,
    check_finite,
    compare_state,
    meta_model,
    read_metadata,
    save_model,
)
from repmlp.models import create_model, is_model

__all__ = ["WeightsImportError", "read_state_dict", "import_checkpoint", "import_to_file", "ImportResult",
           "detect_layout", "eval_preprocessing", "imagenet_class_names"]  # fmt: skip

# A checkpoint that cannot be imported (unsafe, unknown layout, keys that do not fit): one line, as any file.
WeightsImportError = CheckpointError
# A released checkpoint's keys are module paths: short, with indices of a few digits (int() of 5,000 fails).
_MAX_KEY, _MAX_INDEX_DIGITS = 300, 6


def _load(path: Path) -> Any:
    """``torch.load(weights_only=True)``; one-line errors that tell a file that would run code (unsafe) from
    one that is no PyTorch checkpoint at all (text, another format, truncated)."""
    try:
        found = read_metadata(path).get("format")
    except CheckpointError:  # not safetensors: a checkpoint, perhaps
        found = None
    if found == FORMAT:
        raise WeightsImportError(f"{path} is already a repmlp model file: no import needed")
    try:
        with warnings.catch_warnings():  # torch's note on checking sparse tensors: they are refused below
            warnings.filterwarnings("ignore", "Validating sparse tensor invariants", UserWarning)
            # mmap: the tensors of a zip checkpoint are mapped, not read, until they are used.
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as exc:
        if "weights_only" not in str(exc) and "Weights only load failed" not in str(exc):
            why = f"{path} is not a PyTorch checkpoint (unpickling failed: {first_line(exc)})"
            raise WeightsImportError(why) from None
        found = re.search(r"(?:GLOBAL|global) ([\w.]+)", str(exc))
        what = f" (it refers to {found.group(1)})" if found else ""
        raise WeightsImportError(f"refusing to load {path}: it holds more than tensors and plain containers{what}, "
                                 "and loading it could run code") from None  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - whatever torch.load raises on a damaged file, it is not readable
        why = f"cannot read {path} as a PyTorch checkpoint ({type(exc).__name__}: {first_line(exc)[:200]})"
        raise WeightsImportError(why) from None


def read_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """The flat tensor dict of a ``.pth`` file (``weights_only=True``), ``"model"`` / ``"state_dict"`` unwrapped,
    DDP's ``module.`` stripped: dense, real, non-empty, finite tensors keyed by module paths, stored in the file."""
    path = Path(path)
    kind = not_regular(path)
    if kind is not None:
        raise WeightsImportError(f"checkpoint not found: {path}" if kind == "missing"
                                 else f"checkpoint {path} is {kind}, not a regular file")  # fmt: skip
    obj = _load(path)
    for key in ("state_dict", "model"):
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
            break
    if not isinstance(obj, Mapping) or not obj:
        raise WeightsImportError(f"{path} holds no state dict (expected a dict of tensors)")
    others = [str(k) for k, v in obj.items() if not isinstance(v, Tensor)]
    if others:
        raise WeightsImportError(f"{path}: entries that are not tensors: {', '.join(others[:5])}")
    tensors = {str(k): v for k, v in obj.items()}
    for key, t in tensors.items():
        if len(key) > _MAX_KEY or re.search(rf"\d{{{_MAX_INDEX_DIGITS + 1}}}", key):
            raise WeightsImportError(f"{path}: key {key[:60]!r}{'...' if len(key) > 60 else ''} is no module path "
                                     f"of a model (keys are at most {_MAX_KEY} characters, indices at most "
                                     f"{_MAX_INDEX_DIGITS} digits)")  # fmt: skip
        if t.layout != torch.strided:
            raise WeightsImportError(f"{path}: tensor {key} is not dense ({t.layout}): not a released weight")
        if (
            t.is_complex()
            or t.is_quantized
            or not (t.is_floating_point() or t.dtype in (torch.int64, torch.int32))
        ):
            raise WeightsImportError(f"{path}: tensor {key} is {t.dtype}, not a real-valued weight")
        if t.numel() == 0:
            raise WeightsImportError(f"{path}: tensor {key} is empty (shape {tuple(t.shape)})")
    _check_storage(path, tensors)
    check_finite(path, tensors)  # a NaN weight makes every output NaN: no released weight holds one
    if all(k.startswith("module.") for k in tensors):
        tensors = {k[len("module.") :]: v for k, v in tensors.items()}
    return tensors


def _check_storage(path: Path, tensors: Mapping[str, Tensor]) -> None:
    """The tensors' elements must be stored in the file: one with zero or overlapping strides (``expand``) holds
    more than the bytes under it, and copying it out would allocate what a small file asks for."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()}
    stored = sum(storages.values())
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    if held > stored:
        raise WeightsImportError(f"{path}: its tensors hold {held} bytes but the file stores {stored} (zero or "
                                 "overlapping strides, or views that overlap): not a released checkpoint")  # fmt: skip


# ----------------------------------------------------------------------------------- key mapping
# (pattern, replacement) pairs, the first match wins; ``{k3}`` stands for the Local Perceptron branch of
# kernel 3, ``{next1}`` for stage 1 + 1.
# fmt: off
_UNIT = r"stages\.(\d+)\.(\d+)\."
_COMMON_RULES = [  # the block keys both RepMLPNet layouts share
    (_UNIT + r"repmlp_block\.fc3\.(weight|bias)$", r"stages.\1.blocks.\2.repmlp.fc3.\3"),
    (_UNIT + r"repmlp_block\.fc3_bn\.(.+)$", r"stages.\1.blocks.\2.repmlp.fc3_bn.\3"),
    (_UNIT + r"repmlp_block\.repconv(\d+)\.(conv|bn)\.(.+)$", r"stages.\1.blocks.\2.repmlp.local.{k\3}.\4.\5"),
    (_UNIT + r"ffn_block\.ffn_fc([12])\.(conv|bn)\.(.+)$", r"stages.\1.blocks.\2.ffn.fc\3.\4.\5"),
]
_AUTHORS_RULES = [
    (r"conv_embedding\.(conv|bn)\.(.+)$", r"stem.\1.\2"),
    (_UNIT + r"prebn([12])\.(.+)$", r"stages.\1.blocks.\2.norm\3.\4"),
    (_UNIT + r"repmlp_block\.gp\.(fc[12])\.(weight|bias)$", r"stages.\1.blocks.\2.repmlp.gp.\3.\4"),
    (r"embeds\.(\d+)\.(conv|bn)\.(.+)$", r"stages.{next\1}.downsample.\2.\3"),
    (r"head_norm\.(.+)$", r"norm.\1"),
    (r"head\.(weight|bias)$", r"head.\1"),
    *_COMMON_RULES,
]
_MMPRETRAIN_RULES = [
    (r"backbone\.patch_embed\.projection\.(.+)$", r"stem.conv.\1"),
    (r"backbone\.patch_embed\.norm\.(.+)$", r"stem.bn.\1"),
    (r"backbone\." + _UNIT + r"(norm[12])\.(.+)$", r"stages.\1.blocks.\2.\3.\4"),
    (r"backbone\." + _UNIT + r"repmlp_block\.gp\.conv([12])\.conv\.(.+)$", r"stages.\1.blocks.\2.repmlp.gp.fc\3.\4"),
    (r"backbone\.downsample_layers\.(\d+)\.(conv|bn)\.(.+)$", r"stages.{next\1}.downsample.\2.\3"),
    (r"backbone\.final_norm\.(.+)$", r"norm.\1"),
    (r"head\.fc\.(weight|bias)$", r"head.\1"),
    *[(r"backbone\." + p, r) for p, r in _COMMON_RULES],
]
_RES = r"stage([1-4])\.(\d+)\."
_REP = _RES + r"(?:btnk|light)_repmlp\."
_RES50_RULES = [
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
# layout -> (its first key's prefix, its rules, the registered models it can hold).
LAYOUTS: dict[str, tuple[str, list[tuple[str, str]], tuple[str, ...]]] = {
    "authors": ("conv_embedding.", _AUTHORS_RULES, ("repmlpnet_",)),
    "mmpretrain": ("backbone.patch_embed.", _MMPRETRAIN_RULES, ("repmlpnet_",)),
    "authors-res50": ("stage0.0.", _RES50_RULES, ("repmlp_res50", "repmlp_res50_light")),
}
# fmt: on


def detect_layout(sd: Mapping[str, Tensor]) -> str:
    """``"authors"``, ``"mmpretrain"`` (RepMLPNet) or ``"authors-res50"``; a :class:`WeightsImportError` otherwise."""
    for name, (prefix, _, _) in LAYOUTS.items():
        if any(k.startswith(prefix) for k in sd):
            return name
    prefixes = ", ".join(f"{prefix}* ({name})" for name, (prefix, _, _) in LAYOUTS.items())
    raise WeightsImportError(f"unrecognised checkpoint layout (first keys: {', '.join(list(sd)[:4])}); expected "
                             f"the keys of a released checkpoint: {prefixes}")  # fmt: skip


def _map_keys(sd: Mapping[str, Tensor], layout: str) -> tuple[dict[str, Tensor], list[str]]:
    """Every key renamed to ours; returns the mapped dict and the keys no rule matched."""
    compiled = [(re.compile(p), r) for p, r in LAYOUTS[layout][1]]
    kernels = sorted({int(m.group(1)) for k in sd if (m := re.search(r"\.repconv(\d+)\.", k))})
    out: dict[str, Tensor] = {}
    unused: list[str] = []
    for key, value in sd.items():
        m, repl = next(((m, r) for p, r in compiled if (m := p.match(key))), (None, ""))
        if m is None:
            unused.append(key)
            continue
        new = re.sub(r"\{next(\d+)\}", lambda g: str(int(g.group(1)) + 1), m.expand(repl))
        new = re.sub(r"\{k(\d+)\}", lambda g: f"branches.{kernels.index(int(g.group(1)))}", new)
        if new.endswith("fc3.weight") and value.dim() == 4:
            value = value.reshape(value.shape[0], value.shape[1])  # 1x1 grouped conv -> GroupwiseLinear
        out[new] = value
    return out, unused


def _fuse_conv_bn_pairs(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Every ``P.conv`` + ``P.bn`` pair (eval statistics) folded into ``P.conv.weight``/``P.conv.bias``."""
    out = dict(sd)
    for key in [k for k in sd if k.endswith(".bn.running_var")]:
        p = key[: -len(".bn.running_var")]
        if f"{p}.conv.weight" in sd:
            bn = [out.pop(f"{p}.bn.{n}").double() for n in ("running_mean", "running_var", "weight", "bias")]
            out.pop(f"{p}.bn.num_batches_tracked", None)
            conv = sd[f"{p}.conv.weight"]
            fused = fuse_conv_bn_weights(conv.double(), None, bn[0], bn[1], 1e-5, bn[2], bn[3])
            out[f"{p}.conv.weight"], out[f"{p}.conv.bias"] = (t.detach().to(conv.dtype) for t in fused)
    return out


# ------------------------------------------------------------------------------ shape inference
def _local_kernels(sd: Mapping[str, Tensor], branch: str) -> list[int]:
    """The Local Perceptron's kernel sizes: those of the ``{branch}.branches.i.conv.weight`` tensors."""
    pattern = rf"{branch}\.branches\.\d+\.conv\.weight$"
    return sorted({int(t.shape[-1]) for k, t in sd.items() if re.search(pattern, k)})


def _infer_repmlpnet(sd: Mapping[str, Tensor]) -> dict[str, Any]:
    """A RepMLPNet's structure from our-named tensors: channels, depths, sharesets, img_size, ..."""
    stem = sd["stem.conv.weight"]
    depths, channels, sharesets, sides = [], [], [], []
    while f"stages.{len(depths)}.blocks.0.norm1.weight" in sd:
        i = len(depths)
        depths.append(sum(1 for k in sd if re.fullmatch(rf"stages\.{i}\.blocks\.\d+\.norm1\.weight", k)))
        channels.append(int(sd[f"stages.{i}.blocks.0.norm1.weight"].numel()))
        fc3 = sd[f"stages.{i}.blocks.0.repmlp.fc3.weight"]
        sharesets.append(int(fc3.shape[0]) // int(fc3.shape[1]))
        sides.append(round(int(fc3.shape[1]) ** 0.5))
    if not depths:  # not one block: a partial state dict
        raise KeyError("stages.0.blocks.0.norm1.weight")
    gate = channels[-1] // int(sd[f"stages.{len(depths) - 1}.blocks.0.repmlp.gp.fc1.weight"].shape[0])
    head = sd.get("head.weight")
    return dict(patch_size=int(stem.shape[-1]), channels=tuple(channels),
                depths=tuple(depths), sharesets=tuple(sharesets), img_size=sides[0] * int(stem.shape[-1]),
                gate_reduction=gate, kernel_sizes=tuple(_local_kernels(sd, r"repmlp\.local")),
                num_classes=int(head.shape[0]) if head is not None else 0)  # fmt: skip


def _check_structure(path: object, name: str, inferred: dict[str, Any], args: dict[str, Any],
                     sd: Mapping[str, Tensor]) -> None:  # fmt: skip
    """The inferred structure must be the named model's (with ``--model-arg``), built on the ``meta`` device
    within the budget of the file's weights (any zoo model fits 2**28 elements)."""
    ref = meta_model(path, name, args, sd, field_name="--model-arg", floor=(1 << 28, 20_000))
    expected = _infer_repmlpnet(ref.state_dict())
    keys = ("channels", "depths", "sharesets", "img_size", "patch_size", "gate_reduction")
    # Partitions smaller than the map (not in any released model) hide the input size from the shapes.
    keys = [k for k in keys if not (k == "img_size" and args.get("partitions") is not None)]
    wrong = [f"{k} {inferred[k]} (the model has {expected[k]})" for k in keys if inferred[k] != expected[k]]
    if wrong:
        raise WeightsImportError(f"the checkpoint is not a {name}: its {'; '.join(wrong)}; pick the matching "
                                 "--model or pass --model-arg")  # fmt: skip


def _infer_res50(sd: Mapping[str, Tensor]) -> dict[str, Any]:
    """What a RepMLP-Res50's shapes fix: FC3 groups per stage, Local kernels, classes."""
    groups: list[int] = [8, 8, 8, 8]
    for key, w in sd.items():
        if m := re.fullmatch(r"layer(\d)\.\d+\.repmlp\.partition_perceptron\.fc3\.weight", key):
            groups[int(m[1]) - 1] = int(w.shape[0]) // int(w.shape[1])  # FC3 is (C*h*w, C*h*w / g)
    return dict(groups=groups, kernel_sizes=_local_kernels(sd, "local_perceptron"),
                num_classes=int(sd["fc.weight"].shape[0]))  # fmt: skip


class ImportResult(dict):
    """``{"model", "name", "model_kwargs", "form", "layout"}`` of an imported checkpoint."""


def _structure(path: object, name: str, layout: str, mapped: dict[str, Tensor], args: dict[str, Any],
               form: str) -> tuple[dict[str, Any], dict[str, Tensor]]:  # fmt: skip
    """The model options that rebuild the file's model (``--model-arg``'s, then what its shapes fix) and its
    tensors in our form (a deploy form's conv-BN pairs fused); tensors that make no model are one error."""
    kwargs = dict(args)
    try:
        if form == "deploy":
            mapped = _fuse_conv_bn_pairs(mapped)
        if layout == "authors-res50":
            inferred, default_k = _infer_res50(mapped), [1, 3, 5]
            if inferred["groups"] != [8, 8, 8, 8]:
                kwargs.setdefault("groups", inferred["groups"])
        else:
            inferred, default_k = _infer_repmlpnet(mapped), [1, 3]
            _check_structure(path, name, inferred, args, mapped)
    except WeightsImportError:
        raise
    except KeyError as exc:  # a partial state dict: name the first tensor the structure needs
        why = f"{path} is not a complete {layout} checkpoint: it has no {exc.args[0]} (in our names)"
        raise WeightsImportError(why) from None
    except (IndexError, ZeroDivisionError, ValueError, RuntimeError) as exc:
        why = f"{path}: its tensors' shapes do not make a model of the {layout} layout ({first_line(exc)[:200]})"
        raise WeightsImportError(why) from None
    if inferred["num_classes"] != 1000:
        kwargs.setdefault("num_classes", inferred["num_classes"])
    if form == "train" and list(inferred["kernel_sizes"]) != default_k:
        kwargs.setdefault("kernel_sizes", list(inferred["kernel_sizes"]))
    return kwargs, mapped


def import_checkpoint(
    path: str | os.PathLike, name: str, model_args: dict[str, Any] | None = None
) -> ImportResult:
    """``path`` (a released RepMLPNet or RepMLP-Res50 ``.pth``) read into the registered model ``name``: the model
    (eval mode, loaded strictly), the ``model_kwargs`` that rebuild it with :func:`repmlp.create_model`, its
    ``form`` (``"deploy"`` for a converted or locality-injected file) and the detected ``layout``."""
    if not is_model(name):
        raise WeightsImportError(f"--model {name!r} is not a registered repmlp model")
    args = dict(model_args or {})
    for key in sorted(set(args) & set(RESERVED_OPTIONS)):  # whether the model takes the others: its build
        raise WeightsImportError(f"--model-arg {key}: not a model option an imported file may set")
    raw = read_state_dict(path)
    layout = detect_layout(raw)
    family = LAYOUTS[layout][2]
    if not any(name == f or (f.endswith("_") and name.startswith(f)) for f in family):
        names = ", ".join(f + "*" if f.endswith("_") else f for f in family)
        raise WeightsImportError(f"{path} holds {layout} weights; --model must be one of {names}")
    light = any("light_repmlp" in k for k in raw)
    if layout == "authors-res50" and (name == "repmlp_res50_light") != light:
        kind = "RepMLP Light Blocks" if light else "RepMLP Bottlenecks"
        raise WeightsImportError(f"{path} holds a RepMLP-Res50 with {kind}, not a {name}")
    mapped, unused = _map_keys(raw, layout)
    if unused:
        raise WeightsImportError(f"{path}: {len(unused)} key(s) fit no key of the {layout} layout: "
                                 f"{', '.join(unused[:5])}")  # fmt: skip
    form = "train" if any(".fc3_bn." in k for k in raw) else "deploy"
    kwargs, mapped = _structure(path, name, layout, mapped, args, form)
    # The model the shapes and --model-arg describe, sized on the meta device against the file first.
    deploy = form == "deploy"
    own = meta_model(path, name, kwargs, mapped, deploy=deploy, field_name="--model-arg").state_dict()
    # A file without BatchNorm's num_batches_tracked counters keeps the model's (they are unused).
    mapped.update({k: torch.zeros((), dtype=torch.long) for k in own if k.endswith("num_batches_tracked")
                   and k not in mapped})  # fmt: skip
    compare_state(path, name, own, mapped)
    model = create_model(name, deploy=deploy, **kwargs)
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in mapped.items()}, strict=True)
    return ImportResult(model=model.eval(), name=name, model_kwargs=kwargs, form=form, layout=layout)


def eval_preprocessing(name: str) -> dict[str, object]:
    """How the published top-1 of ``name`` was measured: the model's default cfg (resize/crop/mean/std)."""
    cfg = timm.get_pretrained_cfg(name).to_dict()
    keys = ("input_size", "crop_pct", "crop_mode", "interpolation", "mean", "std")
    return {k: list(cfg[k]) if isinstance(cfg.get(k), tuple) else cfg.get(k) for k in keys if k in cfg}


def imagenet_class_names(num_classes: int) -> list[str] | None:
    """ImageNet-1k's class names (timm's ``ImageNetInfo`` descriptions, e.g. ``"tench, Tinca tinca"``) for a
    1000-class model; ``None`` for any other number of classes (the file then has none)."""
    return list(ImageNetInfo().label_descriptions()) if num_classes == 1000 else None


def import_to_file(
    path: str | os.PathLike, name: str, model_args: dict[str, Any] | None, output: str | os.PathLike
) -> ImportResult:
    """:func:`import_checkpoint`, then the model file ``repmlp import`` writes: the imported model with its
    input size, the preprocessing its published accuracy was measured with, and ImageNet-1k's class names
    for a 1000-class model (what ``repmlp predict`` shows)."""
    result = import_checkpoint(path, name, model_args)
    model = result["model"]
    size = [int(getattr(model, "in_chans", 3)), *(int(s) for s in getattr(model, "img_size", (224, 224)))]
    extra = dict(imported_from=Path(path).name, layout=result["layout"], input_size=size,
                 eval_preprocessing=eval_preprocessing(name))  # fmt: skip
    kwargs = result["model_kwargs"]
    classes = imagenet_class_names(kwargs.get("num_classes", getattr(model, "num_classes", 0)))
    if classes:
        extra["classes"] = classes
    save_model(output, model, name=name, model_kwargs=kwargs, form=result["form"], extra=extra)
    return result
