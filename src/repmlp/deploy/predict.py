"""Putting a model file to use: :class:`Predictor` (what ``repmlp predict`` runs), and its output files.

:class:`Predictor` turns image files, PIL images or a batch into the top-k ``(label, index, probability)`` of
each image, with the preprocessing ``repmlp eval`` applies (the file's ``model.metadata``). Files are decoded
a batch at a time, in ``DataLoader`` workers where the model leaves CPU cores free (:func:`auto_workers`); an
undecodable file is yielded with its reason and does not stop the others.
"""

from __future__ import annotations

import copy
import csv
import glob
import io
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn
from tqdm import tqdm

from repmlp.data import NATIVE_SIZE, PixelEvalTransform, folder_eval_transform
from repmlp.data.folder import image_to_channels
from repmlp.data.inputs import InputError, expand_glob, not_regular, open_image, read_text, walk_files
from repmlp.data.loader import default_workers
from repmlp.data.png import png_scanlines, unfilter
from repmlp.deploy.gpu import fused_or_plain, serving_format
from repmlp.deploy.runtimes import RuntimeModel, to_runtime
from repmlp.errors import UserError
from repmlp.io.model_file import (
    ModelMetadata,
    atomic_write_text,
    device_of,
    load_model,
    model_metadata,
    resolve_device,
)
from repmlp.nn.convert import reparameterize_model

__all__ = ["printable", "Prediction", "Predictor", "FileResult", "expand_inputs", "image_to_channels",
           "read_labels"]  # fmt: skip

# A labels file of more than this is not one (ImageNet's 1000 names take 30 kB).
_MAX_LABELS_BYTES = 16 << 20


class Prediction(NamedTuple):
    """One of an image's top-k classes."""

    label: str
    index: int
    probability: float


@dataclass
class FileResult:
    """One input file of :meth:`Predictor.predict_files`: its top-k, or why it was skipped."""

    path: str
    top_k: list[Prediction] | None = None
    error: str | None = None


def eval_image_transform(preprocessing: dict[str, Any]) -> Callable[[Any], Tensor]:
    """PIL image (in the model's channels) -> the model's normalised ``(C, H, W)`` input, as ``repmlp eval``
    does: an in-memory data set's :class:`~repmlp.data.PixelEvalTransform`, else the image folder's
    :func:`~repmlp.data.folder_eval_transform` with the file's resolved ``eval_preprocessing``."""
    _, h, _ = preprocessing["input_size"]
    if preprocessing.get("dataset") in NATIVE_SIZE:
        return PixelEvalTransform(preprocessing["dataset"], h)
    return folder_eval_transform(h, preprocessing["eval_preprocessing"])


def _check_classifier(metadata: ModelMetadata) -> None:
    """:class:`UserError` for a face embedding or segmentation model: prediction gives an image's classes."""
    task = metadata.extra.get("task")
    if task in ("face", "seg"):
        kind = "a face embedding model" if task == "face" else "a segmentation model"
        raise UserError(
            f"{metadata.path or metadata.name} holds {kind} ({metadata.name}), not an image classifier"
        )


def read_labels(path: str | os.PathLike, num_classes: int) -> list[str]:
    """``num_classes`` class names from a regular text file, one a line (trailing blank lines ignored); a
    blank line between names or a name given twice is refused (later classes would get others' names)."""
    try:
        lines = read_text(path, _MAX_LABELS_BYTES, "labels file").splitlines()
    except InputError as exc:
        raise UserError(str(exc)) from None
    while lines and not lines[-1].strip():
        lines.pop()
    names, first = [ln.strip() for ln in lines], {}
    for i, name in enumerate(names):
        if not name:
            raise UserError(
                f"labels file {path}: line {i + 1} is blank (one name a line, no blank lines between them)"
            )
        if first.setdefault(name, i) != i:
            raise UserError(f"labels file {path}: line {i + 1} repeats {name!r} of line {first[name] + 1}")
    if len(names) != num_classes:
        raise UserError(f"labels file {path} has {len(names)} names but the model has {num_classes} classes")
    return names


def expand_inputs(inputs: Iterable[str | os.PathLike]) -> tuple[list[str], list[tuple[str, str]]]:
    """The image files of ``inputs`` (each once) and ``(input, reason)`` of the problems: a file whatever
    its name (decoding tells); a folder's files with an extension Pillow reads, recursively, sorted; a
    pattern's matches (:func:`~repmlp.data.inputs.expand_glob`). Missing paths, patterns that match nothing
    and special files (FIFO, device, socket) are named, never read."""
    exts = sorted({ext.lower() for ext in Image.registered_extensions()})
    files: list[str] = []
    problems: list[tuple[str, str]] = []

    def add(item: str) -> None:
        kind = not_regular(item)
        if kind == "a folder":
            found, skipped = walk_files(item, exts)
            problems.extend(skipped)
            if not found:
                problems.append((item, "folder holds no image files"))
            files.extend(found)
        elif kind is None:
            files.append(item)
        else:
            problems.append(
                (item, "no such file or folder" if kind == "missing" else f"{kind}, not a regular file")
            )

    for item in map(str, inputs):
        if not_regular(item) == "missing" and glob.has_magic(item):
            matches = expand_glob(item)
            if not matches:
                problems.append((item, "pattern matches no file"))
            for m in matches:
                add(m)
        else:
            add(item)
    return list(dict.fromkeys(files)), problems


def decode_image(path: str, channels: int, transform: Callable[[Any], Any]) -> Any:
    """``transform`` of one image file in the model's ``channels``, read within bounds (a GIF's first frame)."""
    with open_image(path) as im:  # everything inside: a closed image has no pixels
        return transform(image_to_channels(im, channels))


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    if isinstance(exc, UserError) and text:  # repmlp's own reasons read as they are
        return text[0]
    msg = getattr(exc, "strerror", None) or (text[0] if text else "")
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


class _FileBatches(torch.utils.data.Dataset):
    """Item ``i``: batch ``i`` of ``paths`` decoded, ``(first index, (N, C, H, W), ok mask, errors)``; an
    undecodable file leaves a zero image, ``ok[j] = False`` and its reason. A
    :class:`~repmlp.data.PixelEvalTransform` decodes to uint8 (plain PNGs all at once) and normalises the
    batch at once, as the evaluation loader does."""

    def __init__(self, paths: list[str], batch_size: int, channels: int, transform: Callable, size) -> None:
        self.paths, self.batch_size, self.channels, self.transform = paths, batch_size, channels, transform
        self.size = tuple(size)
        self.batched = hasattr(transform, "pixels") and hasattr(transform, "normalize")

    def __len__(self) -> int:
        return (len(self.paths) + self.batch_size - 1) // self.batch_size

    def __getitem__(self, item: int) -> tuple[int, Tensor, Tensor, list[str]]:
        start = item * self.batch_size
        chunk = self.paths[start : start + self.batch_size]
        images: list[Any] = [None] * len(chunk)
        errors = [""] * len(chunk)
        plain: dict[int, bytes] = {}  # plain PNGs of the data set's size: decoded together below
        for j, path in enumerate(chunk):
            try:
                raw = png_scanlines(path, self.channels, self.transform.native) if self.batched else None
                if raw is not None:
                    plain[j] = raw
                else:
                    images[j] = decode_image(path, self.channels, self.transform.pixels if self.batched
                                             else self.transform)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - any undecodable file is skipped with its reason
                errors[j] = _reason(exc)
        if plain:
            pixels = unfilter(list(plain.values()), self.channels, self.transform.native)
            for j, x in zip(plain, pixels, strict=True):
                images[j] = x
        ok = torch.tensor([x is not None for x in images], dtype=torch.bool)
        first = next((x for x in images if x is not None), None)
        if first is None:
            return start, torch.zeros(len(chunk), *self.size), ok, errors
        if self.batched:  # uint8 (H, W, C) arrays: one batch, normalised at once
            batch = np.stack([np.zeros_like(first) if x is None else x for x in images])
            out = self.transform.normalize(torch.from_numpy(batch).permute(0, 3, 1, 2))
        else:
            out = torch.stack([torch.zeros_like(first) if x is None else x for x in images])
        if tuple(out.shape[1:]) != self.size:
            raise ValueError(f"preprocessing gave {tuple(out.shape[1:])}, expected {self.size}")
        return start, out, ok, errors


def auto_workers(device: str | torch.device = "cpu") -> int:
    """Decoding processes for the CPU cores the model leaves free (``--workers auto``): a CPU model's threads
    would be preempted by more, each stalling the others; a GPU model leaves all but one core free."""
    busy = torch.get_num_threads() if torch.device(device).type == "cpu" else 1
    return max(0, min(default_workers() - busy, 8))


def in_runtime(model: nn.Module, runtime: str) -> nn.Module:
    """A classifier run by ``runtime``: its deployed form (a training-time model is converted, as a copy),
    exported and checked, with the same ``metadata``."""
    if device_of(model).type != "cpu":
        raise UserError(f"runtime {runtime} runs on the CPU: load the model there")
    metadata = model.metadata
    if not isinstance(model, RuntimeModel):  # an ONNX graph (int8) is deployed already
        model = reparameterize_model(model.eval())
    wrapped = to_runtime(model, runtime, metadata.input_size)
    wrapped.metadata = metadata
    return wrapped


class Predictor:
    """Top-k classes of images under a model file (read by :func:`load_model`) or a model (with its
    ``metadata`` when it has one, else class indices and its timm config). ``device=None``: the model's own;
    ``labels`` replaces the class names. ``runtime``: ``"torch"`` (a copy in the serving layout,
    :func:`repmlp.deploy.gpu.serving_format`; on a GPU :func:`repmlp.deploy.gpu.fused_or_plain` of it), or
    ``"onnxruntime"``/``"openvino"`` running the deployed model's ONNX graph. A face or segmentation model is a
    :class:`UserError`.
    """

    def __init__(self, model: str | os.PathLike | nn.Module, *, device: str | torch.device | None = None,
                 top_k: int = 5, labels: Sequence[str] | None = None, runtime: str = "torch") -> None:  # fmt: skip
        device = None if device is None else resolve_device(device)
        if not isinstance(model, nn.Module):
            model = load_model(model, device=device or "cpu")
        else:  # a copy: the caller's module keeps its mode, device, layout and attributes
            model = copy.deepcopy(model)
            if getattr(model, "metadata", None) is None:
                model.metadata = model_metadata(model.eval(), name=type(model).__name__, form="unknown")
        _check_classifier(model.metadata)
        if runtime != "torch":
            model = in_runtime(model, runtime)
        if device is not None:
            model = model.to(device)
        self.model: nn.Module = model.eval()
        self.metadata: ModelMetadata = model.metadata
        self.device = torch.device(device) if device is not None else device_of(model)
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.top_k = min(top_k, self.metadata.num_classes)
        n = self.metadata.num_classes
        if labels is not None and len(labels) != n:
            raise UserError(f"{len(labels)} labels given but the model has {n} classes")
        names = labels if labels is not None else self.metadata.classes
        self.labels = list(names) if names and len(names) == n else [str(i) for i in range(n)]
        self.transform = eval_image_transform(self.metadata.preprocessing)
        param = next(self.model.parameters(), None)
        self._dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
        self._format = torch.contiguous_format
        self._run: Any = self.model
        if runtime == "torch":  # in the serving layout
            self._format = serving_format(self.device, self._dtype)
            run = self.model.to(memory_format=self._format)
            self._run = fused_or_plain(run) if self.device.type == "cuda" else run

    @property
    def input_size(self) -> tuple[int, int, int]:
        return self.metadata.input_size

    @torch.inference_mode()
    def predict_batch(self, x: Tensor) -> list[list[Prediction]]:
        """Top-k of a preprocessed float32 batch ``(N, C, H, W)``, cast to the model's dtype (float64, bf16...)."""
        x = x.to(self.device, self._dtype, non_blocking=True)
        x = x.contiguous(memory_format=self._format) if x.dim() == 4 else x
        probs = torch.softmax(self._run(x).float(), dim=1).cpu()
        top = probs.topk(self.top_k, dim=1)
        return [[Prediction(self.labels[i], i, float(p)) for p, i in zip(ps.tolist(), idx.tolist(), strict=True)]
                for ps, idx in zip(top.values, top.indices, strict=True)]  # fmt: skip

    def preprocess(self, image: Any) -> Tensor:
        """A PIL image -> the model's ``(C, H, W)`` input (the evaluation preprocessing)."""
        return self.transform(image_to_channels(image, self.input_size[0]))

    def predict(self, inputs: Any) -> list[list[Prediction]]:
        """Top-k ``(label, index, probability)`` per image of ``inputs``: a path, a PIL image, a list of these,
        or a preprocessed batch ``(N, C, H, W)`` (``(C, H, W)``: one image). An unreadable file raises a
        :class:`~repmlp.errors.UserError` naming it (:meth:`predict_files` skips it instead)."""
        if isinstance(inputs, Tensor):
            x, c = (inputs[None] if inputs.dim() == 3 else inputs), self.input_size[0]
            ok = x.dtype == torch.float32 and x.dim() == 4 and len(x) and x.shape[1] == c and not x.is_meta
            if not (ok and bool(torch.isfinite(x).all())):  # in this order: isfinite needs real floats
                raise ValueError(f"predict takes a finite float32 batch (N, {c}, H, W), N >= 1, or one image "
                                 f"({c}, H, W); got {x.dtype} {tuple(inputs.shape)} on {x.device}")  # fmt: skip
            return self.predict_batch(x)
        one = isinstance(inputs, (str, os.PathLike)) or hasattr(inputs, "mode")
        batch = []
        for item in [inputs] if one else list(inputs):
            if hasattr(item, "mode"):  # a PIL image
                batch.append(self.preprocess(item))
                continue
            try:
                batch.append(decode_image(str(item), self.input_size[0], self.transform))
            except Exception as exc:  # noqa: BLE001 - the API names the file and why
                raise UserError(f"cannot read image {item}: {_reason(exc)}") from None
        return self.predict_batch(torch.stack(batch)) if batch else []

    def predict_files(self, paths: Sequence[str], *, batch_size: int = 64,
                      workers: int | None = None) -> Iterator[FileResult]:  # fmt: skip
        """Top-k of each file of ``paths``, in order (an undecodable one with ``error`` set); ``workers``
        processes decode batches ahead (0: this process; ``None``: :func:`auto_workers`). A bad
        ``batch_size`` or ``workers`` is a ``ValueError`` at the call, before anything is read."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
            raise ValueError(f"workers must be an int >= 0 (or None: auto), got {workers!r}")
        return self._predict_files(
            paths, batch_size, auto_workers(self.device) if workers is None else workers
        )

    def _predict_files(self, paths: Sequence[str], batch_size: int, workers: int) -> Iterator[FileResult]:
        if not paths:
            return
        dataset = _FileBatches(list(paths), batch_size, self.input_size[0], self.transform, self.input_size)
        if workers == 0 or len(dataset) == 1:  # no process to start, nothing to overlap
            loader: Iterable = (dataset[i] for i in range(len(dataset)))
        else:  # batch_size=None: one item is one batch
            loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=min(workers, len(dataset)),
                                                 prefetch_factor=2, persistent_workers=False)  # fmt: skip
        for start, x, ok, errors in loader:
            decoded = ok.tolist()
            tops = iter(self.predict_batch(x if all(decoded) else x[ok]) if any(decoded) else ())
            for j, (good, error) in enumerate(zip(decoded, errors, strict=True)):
                path = paths[start + j]
                yield FileResult(path, top_k=next(tops)) if good else FileResult(path, error=error)


def predict_paths(checkpoint: str | os.PathLike, inputs: Sequence[str | os.PathLike], *, top_k: int = 5,
                  batch_size: int = 64, device: str | torch.device = "cpu", workers: int | None = None,
                  labels_file: str | os.PathLike | None = None, on_skip: Callable[[str, str], None] | None = None,
                  progress: bool = True, runtime: str = "torch",
                  ) -> tuple[list[FileResult], list[tuple[str, str]]]:  # fmt: skip
    """``repmlp predict``: the top-k of every image under ``inputs`` -> ``(predicted, skipped)``, ``skipped``
    the ``(path, reason)`` of missing or undecodable inputs, each also given to ``on_skip`` as found. A
    :class:`UserError` when no input is an image file, or the checkpoint or labels file cannot be used."""
    files, skipped = expand_inputs(inputs)
    report = on_skip or (lambda path, reason: None)
    for path, reason in skipped:
        report(path, reason)
    if not files:
        raise UserError("no input images (" + "; ".join(f"{printable(p)}: {r}" for p, r in skipped[:3]) + ")"
                        if skipped else "no input images given")  # fmt: skip
    model = load_model(checkpoint, device=device)
    _check_classifier(model.metadata)  # before the labels file: that a model has no classes comes first
    labels = read_labels(labels_file, model.metadata.num_classes) if labels_file else None
    predictor = Predictor(model, top_k=top_k, labels=labels, runtime=runtime)
    done: list[FileResult] = []
    # A bar only where it helps: more than a few files, and stderr a terminal (disable=None).
    with tqdm(total=len(files), unit="img", desc="predict", leave=False,
              disable=None if progress and len(files) > 8 else True) as bar:  # fmt: skip
        for res in predictor.predict_files(files, batch_size=batch_size, workers=workers):
            if res.error is not None:
                skipped.append((res.path, res.error))
                report(res.path, res.error)
            else:
                done.append(res)
            bar.update(1)
    return done, skipped


def result_record(res: FileResult) -> dict[str, Any]:
    """The JSON (Lines) record of one file: ``{"path", "top_k": [{"label", "index", "probability"}]}``."""
    top = [{"label": p.label, "index": p.index, "probability": p.probability} for p in res.top_k or []]
    return {"path": res.path, "top_k": top}


def _utf8_safe(text: str) -> str:
    """``text`` with a file name's non-UTF-8 bytes (lone surrogates ``U+DC80..U+DCFF`` after ``os.fsdecode``)
    as ``\\xNN`` and any other lone surrogate as ``\\uNNNN``."""
    return "".join(
        f"\\x{ord(ch) - 0xDC00:02x}" if 0xDC80 <= ord(ch) <= 0xDCFF
        else ch.encode("unicode_escape").decode("ascii") if 0xD800 <= ord(ch) <= 0xDFFF
        else ch
        for ch in text
    )  # fmt: skip


def printable(text: str) -> str:
    """``text`` safe for a terminal: unprintable characters (escape sequences, a newline forging a line) as
    Python escapes, a file name's non-UTF-8 bytes as ``\\xNN``."""
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in _utf8_safe(text)
    )


def csv_cell(text: str) -> str:
    """A text cell of predict's CSV: UTF-8 safe, and prefixed with ``'`` where a spreadsheet would take it
    for a formula (``= + - @``, tab, carriage return: OWASP's defence against CSV injection)."""
    text = _utf8_safe(text)
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def render_csv(results: Sequence[FileResult], k: int) -> str:
    """CSV with columns ``path,label_1,prob_1,index_1,...,label_K,prob_K,index_K`` (cells :func:`csv_cell`)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["path"] + [f"{c}_{i}" for i in range(1, k + 1) for c in ("label", "prob", "index")])
    for res in results:
        row: list[Any] = [csv_cell(res.path)]
        for p in res.top_k or []:
            row += [csv_cell(p.label), f"{p.probability:.6g}", p.index]
        writer.writerow(row)
    return buf.getvalue()


def render_table(results: Sequence[FileResult]) -> str:
    """Each file and its top-k labels with their probabilities, names :func:`printable`."""
    if not results:
        return ""
    paths = [printable(r.path) for r in results]
    width = min(60, max(len("file"), *(len(p) for p in paths)))
    k = max(len(r.top_k or []) for r in results)
    lines = [(f"{'file':<{width}}  " + "  ".join(f"{'top-' + str(i + 1):<24}" for i in range(k))).rstrip()]
    for res, path in zip(results, paths, strict=True):
        path = path if len(path) <= width else "..." + path[-(width - 3) :]
        cells = [f"{printable(p.label)[:16]} {100 * p.probability:5.1f}%" for p in res.top_k or []]
        lines.append((f"{path:<{width}}  " + "  ".join(f"{c:<24}" for c in cells)).rstrip())
    return "\n".join(lines) + "\n"


def write_results(path: str | os.PathLike, results: Sequence[FileResult], k: int) -> None:
    """``OUT.csv`` or ``OUT.jsonl`` (by the suffix), written atomically."""
    if output_format(path) == "csv":
        text = render_csv(results, k)
    else:
        text = "".join(json.dumps(result_record(r)) + "\n" for r in results)
    atomic_write_text(path, text)


def output_format(path: str | os.PathLike) -> str:
    """``"csv"`` or ``"jsonl"`` by the file name's suffix; :class:`UserError` for anything else."""
    suffix = Path(path).suffix.lower()
    if suffix in (".csv", ".jsonl", ".ndjson"):
        return "csv" if suffix == ".csv" else "jsonl"
    if Path(path).is_dir():
        raise UserError(f"--output {path} is a folder")
    raise UserError(f"--output {path}: expected a .csv or .jsonl file name")
