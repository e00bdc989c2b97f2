"""The paper's tables of parameters and FLOPs, with our models' counts beside them.

:data:`PAPER_ROWS` is the single source of the paper's numbers (also for the tests), each row naming the
model (and keyword arguments) that reproduces it. :func:`render_tables` counts every available row on the
``meta`` device and prints Markdown tables; the paper's "FLOPs" are multiply-accumulates, so ours are MACs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import timm
import torchvision
from tqdm import tqdm

from repmlp.bench.counts import profile_model
from repmlp.models import is_model

__all__ = ["PaperRow", "PAPER_ROWS", "TABLE_TITLES", "RowResult", "measure_row", "render_tables", "deviation"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PaperRow:
    """One row of a paper table: the model that reproduces it and the paper's counts, ``params``/``macs`` in
    millions as printed; ``form``: ``"deploy"`` (converted, the paper's convention) or ``"train"`` (row A);
    ``speed``: the paper's examples/s on its 1080Ti (batch 128; face models 512, PSPNets 16), if timed."""

    table: str
    label: str
    model: str
    input_size: int
    params: float
    macs: float | None
    kwargs: dict[str, Any] = field(default_factory=dict)
    form: str = "deploy"
    note: str = ""
    speed: float | None = None

    @property
    def call(self) -> str:
        """How to build the row's model, e.g. ``repmlp_res50(stages='c4', reduction=(2, 2, 8, 4))``."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.model}({args})" if args else self.model


TABLE_TITLES = {
    "puremlp": "Pure MLP and ablations on CIFAR-10 (paper Table 1), 32x32 input",
    "c4_rg": "RepMLP-Res50 with different r, g in c4 only (paper Table 2), 224x224 input",
    "stages": "RepMLP in different stages of ResNet-50 (paper Table 3), 224x224 input",
    "comparisons": "Comparisons with traditional ConvNets on ImageNet (paper Table 4)",
    "light": "ResNet-50 with different blocks in c3 and c4 (paper Appendix A), 224x224 input",
    "face": "Face recognition models (paper Table 5), 96x96 input",
    "seg": "Semantic segmentation, PSPNet on Cityscapes (paper Table 6), 713x713 input, 19 classes",
    "repmlpnet": "RepMLPNet (Ding et al., CVPR 2022; the authors' README), counted after Locality Injection",
}

_R = "repmlp_res50"
_PURE = (
    "we found no structure following the paper's description that reaches its params for rows D, E and "
    "the Wide ConvNet while matching its FLOPs (see docs/models.md); our FLOPs match"
)
_FACE = (
    "the paper's FaceResNet (40.35M, 1050M) minus the four bottlenecks its text replaces (3.97M, 415M) "
    "is already above its RepMLP-FaceRes, so no RepMLP Bottleneck reaches these counts (see docs/models.md)"
)
_NET = (
    "the authors' README prints 4.2G; their own code, counted with torch's FlopCounterMode over their "
    "model after `locality_injection()`, gives 4,245.6M, which the README rounds, so that unrounded count "
    "is compared here (ours: `repmlp.bench.counts.profile_model('repmlpnet_t256', deploy=True)`)"
)


def _c4(r: int, g: int) -> dict[str, Any]:
    return {"stages": "c4", "reduction": (2, 2, r, 4), "groups": g}


PAPER_ROWS: tuple[PaperRow, ...] = (
    PaperRow("puremlp", "Pure MLP", "repmlp_cifar", 32, 22.41, 52.8),
    PaperRow("puremlp", "A) before conversion", "repmlp_cifar", 32, 22.91, 118.9, form="train"),
    PaperRow("puremlp", "B) w/o Local", "repmlp_cifar_no_local", 32, 22.41, 52.8),
    PaperRow("puremlp", "C) w/o Global", "repmlp_cifar_no_global", 32, 22.08, 52.5),
    PaperRow("puremlp", "D) FC3 as conv9", "repmlp_cifar_fc3_conv9", 32, 0.81, 66.2, note=_PURE),
    PaperRow("puremlp", "E) RepMLP as conv9", "repmlp_cifar_conv9", 32, 0.48, 65.8, note=_PURE),
    PaperRow("puremlp", "Wide ConvNet", "wide_convnet_cifar", 32, 0.50, 65.1, note=_PURE),
    PaperRow("c4_rg", "RepMLP-Res50 r=4 g=8", _R, 224, 30.87, None, _c4(4, 8), speed=671),
    PaperRow("c4_rg", "RepMLP-Res50 r=4 g=2", _R, 224, 49.31, None, _c4(4, 2), speed=666),
    PaperRow("c4_rg", "RepMLP-Res50 r=8 g=8", _R, 224, 25.02, None, _c4(8, 8), speed=759),
    PaperRow("c4_rg", "RepMLP-Res50 r=2 g=8", _R, 224, 52.77, None, _c4(2, 8), speed=639),
    PaperRow("c4_rg", "Original Res50", _R, 224, 25.53, None, {"stages": ()}, speed=689),
    PaperRow("stages", "c2+c3+c4+c5", _R, 224, 74.46, None, {"stages": "c2+c3+c4+c5"}, speed=574),
    PaperRow("stages", "c2+c3+c4", _R, 224, 66.97, None, {"stages": "c2+c3+c4"}, speed=575),
    PaperRow("stages", "c3+c4+c5", _R, 224, 48.35, None, {"stages": "c3+c4+c5"}, speed=632),
    PaperRow("stages", "c3+c4", _R, 224, 40.87, None, {"stages": "c3+c4"}, speed=636),
    PaperRow("stages", "c3", _R, 224, 35.52, None, {"stages": "c3"}, speed=644),
    PaperRow("stages", "c4", _R, 224, 30.87, None, {"stages": "c4"}, speed=671),
    PaperRow("stages", "Original Res50", _R, 224, 25.53, None, {"stages": ()}, speed=689),
    PaperRow("comparisons", "ResNet-50", "torchvision:resnet50", 224, 25.53, 4089, speed=689),
    PaperRow("comparisons", "ResNet-101", "torchvision:resnet101", 224, 44.49, 7801, speed=421),
    PaperRow("comparisons", "RepMLP-Res50", _R, 224, 40.87, 3890, speed=636),
    PaperRow("comparisons", "ResNet-50", "torchvision:resnet50", 320, 25.53, 8343, speed=344),
    PaperRow("comparisons", "ResNet-101", "torchvision:resnet101", 320, 44.49, 15919, speed=213),
    PaperRow("comparisons", "RepMLP-Res50-g8/16", "repmlp_res50_g8_16", 320, 59.22, 8057, speed=312),
    PaperRow("comparisons", "RepMLP-Res50-g8/8", "repmlp_res50_g8_8", 320, 72.02, 8108, speed=311),
    PaperRow("comparisons", "RepMLP-Res50-g4/8", "repmlp_res50_g4_8", 320, 87.38, 8354, speed=305),
    PaperRow("comparisons", "NL-Res50", "nl_res50", 320, 27.63, 9182, speed=316),
    PaperRow("comparisons", "GC-Res50", "gc_res50", 320, 28.05, 8351, speed=312),
    PaperRow("comparisons", "EfficientNet-B1", "timm:efficientnet_b1", 240, 7.76, 686, speed=512),
    PaperRow("comparisons", "EfficientNet-B2", "timm:efficientnet_b2", 260, 9.07, 993, speed=396),
    PaperRow("comparisons", "EfficientNet-B3", "timm:efficientnet_b3", 300, 12.18, 1827, speed=228),
    PaperRow("light", "Original", _R, 224, 25.53, 4089, {"stages": ()}, speed=689),
    PaperRow("light", "RepMLP Bottleneck", _R, 224, 40.87, 3890, speed=636),
    PaperRow("light", "RepMLP Light Block", "repmlp_res50_light", 224, 57.86, 2919, speed=1074),
    PaperRow("face", "MobileFaceNet", "mobilefacenet", 96, 0.98, 162, speed=5002),
    PaperRow("face", "FaceResNet", "face_resnet", 96, 40.35, 1050, speed=3811),
    PaperRow("face", "RepMLP-FaceRes", "repmlp_face_resnet", 96, 28.32, 406, note=_FACE, speed=5425),
    PaperRow("seg", "RepMLP-Res50 (g4/8)", "pspnet_repmlp_res50", 713, 175.41, 342696, speed=10.43),
    PaperRow("seg", "ResNet-50", "pspnet_res50", 713, 46.56, 350004, speed=10.22),
    *(
        PaperRow("repmlpnet", f"RepMLPNet-{v.upper()}{s}", f"repmlpnet_{v}{s}", s, p, g * 1000,
                 note=_NET if (v, s) == ("t", 256) else "")
        for v, s, p, g in (("t", 224, 38.3, 2.8), ("t", 256, 58.7, 4.2456), ("b", 224, 68.2, 6.7),
                           ("b", 256, 96.5, 9.6), ("d", 256, 86.9, 8.6), ("l", 256, 117.7, 11.5))
    ),
)  # fmt: skip


@dataclass(frozen=True)
class RowResult:
    """Our counts (millions) for a :class:`PaperRow`."""

    row: PaperRow
    params: float
    macs: float


def deviation(ours: float, paper: float | None) -> float | None:
    """Relative deviation of ours from the paper's figure, in percent (``None`` without a paper figure)."""
    return None if paper is None else 100.0 * (ours - paper) / paper


def _available(name: str) -> bool:
    source, _, bare = name.rpartition(":")
    if source == "timm":
        return timm.is_model(bare)
    if source == "torchvision":
        return bare in torchvision.models.list_models()
    return is_model(name)


def measure_row(row: PaperRow) -> RowResult:
    """Count ``row``'s model on the ``meta`` device (form as the row says)."""
    params, macs = _count(row.model, row.input_size, row.form == "deploy", tuple(sorted(row.kwargs.items())))
    return RowResult(row, params / 1e6, macs / 1e6)


@functools.cache
def _count(model: str, input_size: int, deploy: bool, kwargs: tuple) -> tuple[int, int]:
    """``profile_model``'s counts, once per process (``kwargs``: sorted ``(name, value)`` pairs, hashable)."""
    return profile_model(model, input_size, deploy=deploy, **dict(kwargs))


def _fmt_dev(value: float | None) -> str:
    return "" if value is None else f"{value:+.2f}%"


def _fmt_num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}" if value < 1000 else f"{value:,.0f}"


def _render(table: str, results: Iterable[RowResult]) -> str:
    lines = [f"### {TABLE_TITLES[table]}", "", "| Model | Built as | Input | Params (M) paper | Params (M) ours "
             "| Dev. | FLOPs (M) paper | MACs (M) ours | Dev. |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    notes: list[str] = []
    for r in results:
        row, label = r.row, r.row.label
        form = " (training-time)" if row.form == "train" else ""
        if row.note:
            notes += [row.note] if row.note not in notes else []
            label += f" [{notes.index(row.note) + 1}]"
        lines.append(
            f"| {label} | `{row.call}`{form} | {row.input_size} | {_fmt_num(row.params)} | "
            f"{_fmt_num(r.params)} | {_fmt_dev(deviation(r.params, row.params))} | {_fmt_num(row.macs)} | "
            f"{_fmt_num(r.macs)} | {_fmt_dev(deviation(r.macs, row.macs))} |"
        )
    if notes:
        lines += ["", *(f"[{i}] {note}." for i, note in enumerate(notes, 1))]
    return "\n".join(lines)


def render_tables(tables: Iterable[str] | None = None, *, progress: bool = False) -> str:
    """Every paper table (or those named in ``tables``) as Markdown, our counts beside the paper's: params of
    the converted model (training-time for row A), MACs at batch 1."""
    wanted = list(TABLE_TITLES) if tables is None else list(tables)
    unknown = [t for t in wanted if t not in TABLE_TITLES]
    if unknown:
        raise ValueError(f"unknown table(s) {unknown}; choose from {', '.join(TABLE_TITLES)}")
    rows = [r for r in PAPER_ROWS if r.table in wanted]
    by_table: dict[str, list[RowResult]] = {t: [] for t in wanted}
    for row in tqdm(rows, desc="counting", disable=not progress, leave=False):
        if not _available(row.model):
            log.info("skipping %s: model %s is not available", row.label, row.model)
            continue
        by_table[row.table].append(measure_row(row))  # rows of the same model are counted once
    parts = [
        "Params: converted model (RepMLPs merged, conv-BN fused) unless marked training-time. "
        "FLOPs: the paper's multiply-accumulates; ours are MACs at batch 1 from "
        "torch.utils.flop_counter (FLOPs / 2) on meta tensors. Dev.: (ours - paper) / paper."
    ]
    parts += [_render(t, res) for t, res in by_table.items() if res]
    return "\n\n".join(parts) + "\n"
