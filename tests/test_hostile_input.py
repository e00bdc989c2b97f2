"""Everything a user hands the program is input (issue 37): model files from elsewhere, options, data
files, resumed runs and special files.

Hypothesis draws model-file metadata and option values; a table of damaged files covers every command
that reads a file (predict, eval, convert, export, bench, viz, import, train's --init, --resume and data
readers). Each case must end as a user error: exit status 2 (1 where predict skips some of its inputs),
one line ``repmlp: error: ...``, no traceback, within seconds (a guard interrupts a call that hangs), and
a finished run's files must stay as they were (compared by hash). The commands run in this process
through :func:`repmlp.cli.main`, as the other CLI tests do, each under a time limit (a signal interrupts
a read that blocks, on a FIFO say) and a memory limit (an allocation a hostile file asks for, or an
endless read of ``/dev/zero``, fails instead of exhausting a shared machine).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

import repmlp
from repmlp.io.model_file import save_model
from repmlp.io.state import load_state, save_state
from repmlp_testdata import lonely_process, make_fashion_mnist, make_image_folder, run_cli, subprocess_env

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "repmlp_fmnist"
KWARGS = {"widths": [4, 8], "kernel_sizes": [3]}
SETTINGS = settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


# ------------------------------------------------------------------------------------------ helpers
class Hang(BaseException):
    """A command that did not return within its time (a BaseException: no ``except Exception`` in the
    code under test swallows it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`Hang` in this (the main) thread after ``seconds``: a blocked read is interrupted."""

    def expire(signum, frame):  # noqa: ANN001 - signal handler
        raise Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_BASE_SIZE: list[int] = []  # the process's address space when the first command ran


@contextlib.contextmanager
def memory_limit(extra: int = 3 << 30) -> Iterator[None]:
    """At most ``extra`` bytes of address space beyond what the process held at its first command: a
    command that allocated what a hostile file asks for fails with a MemoryError instead of exhausting a
    shared machine (the limit is absolute: memory a command freed but the allocator kept does not raise
    it)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if not _BASE_SIZE:
        with open("/proc/self/status") as f:
            _BASE_SIZE.append(next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmSize:")))
    limit = _BASE_SIZE[0] + extra
    resource.setrlimit(
        resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard)
    )
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def cli(*argv: object, seconds: float = 60):
    """``repmlp ARGV`` in this process (output captured), within ``seconds`` and a memory limit."""
    with time_limit(seconds), memory_limit():
        return run_cli(*argv)


def assert_one_line(res, *fragments: str, status: int = 2) -> str:
    """Exit ``status``, the last stderr line ``repmlp: error: ...`` (the only error line), no traceback;
    returns that line."""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == status, (res.returncode, res.stderr[-2000:])
    if status == 2:
        assert lines and lines[-1].startswith("repmlp: error: "), res.stderr
        assert sum("repmlp: error" in ln for ln in lines) == 1, res.stderr
        assert all(f in lines[-1] for f in fragments), (fragments, lines[-1])
        return lines[-1]
    return ""


def hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (and the names): what "unchanged" means."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def rewrite(src: Path, dst: Path, meta: dict[str, object] | None = None, drop: tuple[str, ...] = (),
            header: Callable[[dict], None] | None = None) -> Path:  # fmt: skip
    """A copy of safetensors file ``src`` with its metadata changed (values as given: a value that is not
    a string stays in the header as it is, as a hostile file may hold it) and ``header`` applied."""
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8 : 8 + n])
    body = raw[8 + n :]
    metadata = head.setdefault("__metadata__", {})
    for key in drop:
        metadata.pop(key, None)
    metadata.update(meta or {})
    if header is not None:
        header(head)
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    dst.write_bytes(struct.pack("<Q", len(text)) + text + body)
    return dst


def png_header(width: int, height: int) -> bytes:
    """The start of a PNG that claims ``width x height`` pixels (a decompression bomb's header)."""
    import zlib

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    chunk = struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + chunk


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """A model file, a data set, images, and a finished run (real, tiny) whose files are hashed."""
    root = tmp_path_factory.mktemp("hostile")
    fm = make_fashion_mnist(root / "fm", n_train=32, n_test=16)
    torch.manual_seed(0)
    model = repmlp.create_model(NAME, **KWARGS).eval()
    extra = {"dataset": "fashion-mnist", "data_dir": str(fm), "classes": [f"c{i}" for i in range(10)],
             "input_size": [1, 28, 28]}  # fmt: skip
    save_model(root / "model.safetensors", model, name=NAME, model_kwargs=KWARGS, form="train", extra=extra)
    image = root / "image.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (28, 28), dtype=np.uint8), "L").save(image)
    run = root / "run"
    res = run_cli("train", "--data-dir", fm, "--model", NAME, "--model-arg", "widths=[4,8]", "--model-arg",
                  "kernel_sizes=[3]", "--epochs", 1, "--batch-size", 16, "--train-limit", 16, "--val-limit",
                  16, "--workers", 0, "--no-bench", "--no-export", "--output", run)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return {"root": root, "fm": fm, "model": root / "model.safetensors", "image": image, "run": run}


@pytest.fixture
def interrupted(world, tmp_path) -> Path:
    """A resumable copy of the run: killed after its last checkpoint, before anything else was written."""
    out = tmp_path / "cut"
    out.mkdir()
    shutil.copy(world["run"] / "checkpoint.safetensors", out / "checkpoint.safetensors")
    return out


# ------------------------------------------------------------------------ hypothesis: model metadata
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5,
)
_OPTIONS = ["num_classes", "img_size", "in_chans", "widths", "kernel_sizes", "partition", "groups", "deploy",
            "device", "bogus", "depths", "patch_size"]  # fmt: skip
_EXTRA = ["classes", "input_size", "dataset", "eval_preprocessing", "task", "data_dir", "identities"]


def _dumps(value: object) -> str:
    return json.dumps(value, allow_nan=True)


@st.composite
def metadata(draw) -> dict[str, object]:
    """A model file's metadata with some fields replaced by drawn values (JSON text or raw text)."""
    kwargs = dict(KWARGS)
    kwargs.update(draw(st.dictionaries(st.sampled_from(_OPTIONS), _JSON, max_size=2)))
    extra = draw(st.dictionaries(st.sampled_from(_EXTRA), _JSON, max_size=2))
    meta: dict[str, object] = {
        "model_kwargs": draw(st.sampled_from([_dumps(kwargs), "{", "[1]", "null", '"x"'])),
        "extra": draw(st.one_of(st.just(_dumps(extra)), st.text(max_size=8))),
        "model": draw(
            st.sampled_from([NAME, "", "no_such_model", "../../etc/passwd", "timm:resnet18", NAME])
        ),
        "form": draw(st.sampled_from(["train", "train", "deploy", "", "TRAIN"])),
    }
    if draw(st.booleans()):
        meta["precision"] = draw(st.sampled_from(["fp32", "bf16", "int8", "int4", ""]))
    return meta


@SETTINGS
@given(meta=metadata())
@example(meta={"extra": _dumps({"eval_preprocessing": {"": None}})})  # no mean for a one-channel model
def test_drawn_metadata_is_predicted_or_one_line(world, tmp_path, meta):
    """Whatever a file's metadata says, predict either works (exit 0) or says why in one line (2)."""
    bad = rewrite(world["model"], tmp_path / "drawn.safetensors", meta)
    res = cli("predict", "--checkpoint", bad, world["image"], "--workers", 0, seconds=30)
    if res.returncode != 0:
        line = assert_one_line(res)
        assert "drawn.safetensors" in line, line  # the file is named


@SETTINGS
@given(kwargs=st.dictionaries(st.sampled_from(_OPTIONS), st.integers(0, 2**40) | st.integers(-(2**40), 0),
                              min_size=1, max_size=3))  # fmt: skip
@example(kwargs={"img_size": 22})  # a size the file's recorded input size contradicts
def test_drawn_model_sizes_are_checked_before_anything_is_allocated(world, tmp_path, kwargs):
    """Options that describe a model of any size (10**12 classes, 100000-pixel inputs, ...) are compared
    with the file's tensors on the meta device: a one-line error naming the file and the field, fast."""
    bad = rewrite(
        world["model"], tmp_path / "sized.safetensors", {"model_kwargs": json.dumps({**KWARGS, **kwargs})}
    )
    res = cli("bench", "--checkpoint", bad, "--batch-size", 1, "--warmup", 0, "--repeats", 1, seconds=30)
    if res.returncode != 0:
        line = assert_one_line(res, "sized.safetensors")
        # The field at fault: model_kwargs, or the recorded input size that the drawn img_size contradicts.
        assert any(
            f in line for f in ("model_kwargs", "does not fit", "metadata field 'extra.input_size'")
        ), line


# --------------------------------------------------------------------- hypothesis: option values
# (command, flag, lowest, highest): the documented range of each option (ints, or floats for *.0 bounds);
# the other arguments of each command end in a known cheap refusal once the options passed the boundary.
RANGES = [
    ("train", "--seed", 0, 2**32 - 1),
    ("train", "--img-size", 8, 4096),
    ("train", "--pad", 0, 1024),
    ("train", "--epochs", 1, 100_000),
    ("train", "--batch-size", 1, 2**20),
    ("train", "--workers", 0, 256),
    ("train", "--lr", 0.0, 1e6),
    ("train", "--warmup-epochs", 0.0, 1e6),
    ("train", "--weight-decay", 0.0, 1e6),
    ("train", "--mixup", 0.0, 1e6),
    ("predict", "--top-k", 1, 10**6),
    ("predict", "--batch-size", 1, 2**20),
    ("eval", "--img-size", 8, 4096),
    ("eval", "--val-limit", 1, 2**31 - 1),
    ("convert", "--img-size", 1, 4096),
    ("convert", "--tolerance", 0.0, 1e6),
    ("convert", "--num-examples", 1, 100_000),
    ("export", "--img-size", 1, 4096),
    ("export", "--opset", 7, 100),
    ("bench", "--batch-size", 1, 2**20),
    ("bench", "--repeats", 1, 10**6),
    ("bench", "--img-size", 1, 4096),
]
_TEXT = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(
        ["-1", "0", "1", "nan", "inf", "-inf", "1e308", "1e-308", "4097", "1025", "abc", "", "0x10"]
    ),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


def _in_range(text: str, lo: float, hi: float) -> bool:
    """Whether ``text`` is a value the option takes (positive floats exclude 0 for --lr/--tolerance)."""
    try:
        value = int(text) if isinstance(lo, int) else float(text)
    except ValueError:
        return False
    if isinstance(lo, float) and not np.isfinite(value):
        return False
    return lo <= value <= hi


@SETTINGS
@given(spec=st.sampled_from(RANGES), text=_TEXT)
def test_drawn_option_values_are_range_checked_at_the_boundary(world, tmp_path, spec, text):
    """An option value out of its range is refused before any work, naming the option; one in range
    passes the boundary (and the command then stops at the refusal its other arguments cause)."""
    command, flag, lo, hi = spec
    missing = tmp_path / "missing.safetensors"
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    rest = {
        "train": ["--data-dir", world["fm"], "--output", blocker],
        "predict": ["--checkpoint", missing, world["image"]],
        "eval": ["--checkpoint", missing],
        "convert": ["--checkpoint", missing],
        "export": ["--checkpoint", missing],
        "bench": ["--checkpoint", missing],
    }[command]
    res = cli(command, *rest, f"{flag}={text}", seconds=30)
    line = assert_one_line(res)
    ok = _in_range(text, lo, hi) and not (flag in ("--lr", "--tolerance") and float(text) == 0)
    if ok:
        assert "not a run folder" in line or "checkpoint not found" in line, line
    else:
        assert flag in line, line


# ------------------------------------------------------------------------ the table of damaged files
def _model_cases(world: dict[str, Path], tmp: Path) -> dict[str, tuple[Path, str]]:
    """Damaged or foreign model files: name -> (file, a fragment of the expected error)."""
    model = world["model"]
    text = tmp / "text.safetensors"
    text.write_text("hello, not a model\n")
    truncated = tmp / "truncated.safetensors"
    truncated.write_bytes(model.read_bytes()[:5000])
    state = tmp / "checkpoint.safetensors"
    save_state(state, {"step": 1, "config": {}})

    def complex_tensor(head: dict) -> None:  # a float32 tensor's bytes read as half as many complex64
        key = next(k for k, v in head.items() if k != "__metadata__" and v["dtype"] == "F32")
        head[key]["dtype"] = "C64"
        head[key]["shape"] = [int(np.prod(head[key]["shape"])) // 2]

    def bad_offsets(head: dict) -> None:
        key = next(k for k in head if k != "__metadata__")
        head[key]["data_offsets"] = [0, 10**15]

    return {
        "text": (text, "not a safetensors file"),
        "truncated": (truncated, "truncated"),
        "training state": (state, "model.safetensors"),
        "extra a list": (rewrite(model, tmp / "e.safetensors", {"extra": "[1, 2]"}), "'extra'"),
        "input_size text": (
            rewrite(model, tmp / "i.safetensors", {"extra": '{"input_size": "abc"}'}),
            "extra.input_size",
        ),  # fmt: skip
        "10**12 classes": (
            rewrite(
                model, tmp / "n.safetensors", {"model_kwargs": json.dumps({**KWARGS, "num_classes": 10**12})}
            ),
            "model_kwargs.num_classes",
        ),  # fmt: skip
        "img_size 100000": (
            rewrite(
                model, tmp / "s.safetensors", {"model_kwargs": json.dumps({**KWARGS, "img_size": 100000})}
            ),
            "model_kwargs",
        ),  # fmt: skip
        "unknown option": (
            rewrite(model, tmp / "u.safetensors", {"model_kwargs": json.dumps({**KWARGS, "bogus": 1})}),
            "model_kwargs.bogus",
        ),  # fmt: skip
        "reserved option": (
            rewrite(model, tmp / "r.safetensors", {"model_kwargs": json.dumps({**KWARGS, "device": "cuda"})}),
            "model_kwargs.device",
        ),  # fmt: skip
        "precision": (rewrite(model, tmp / "p.safetensors", {"precision": "int4"}), "precision"),
        "not a string": (rewrite(model, tmp / "m.safetensors", {"model": 5}), "model"),
        "no form": (rewrite(model, tmp / "f.safetensors", drop=("form",)), "form"),
        "classes count": (
            rewrite(model, tmp / "c.safetensors", {"extra": '{"classes": ["a", "b"]}'}),
            "extra.classes",
        ),  # fmt: skip
        "offsets": (rewrite(model, tmp / "o.safetensors", header=bad_offsets), "truncated"),
        "complex": (rewrite(model, tmp / "x.safetensors", header=complex_tensor), ".safetensors"),
    }


# Each command that reads a model file: its arguments around the file (``{f}``).
MODEL_COMMANDS = {
    "predict": ["predict", "--checkpoint", "{f}", "{image}", "--workers", "0"],
    "eval": ["eval", "--checkpoint", "{f}", "--workers", "0"],
    "convert": ["convert", "--checkpoint", "{f}", "--output", "{tmp}/out.safetensors"],
    "export": ["export", "--checkpoint", "{f}", "--output", "{tmp}/out.onnx", "--no-check"],
    "bench": ["bench", "--checkpoint", "{f}", "--batch-size", "1", "--warmup", "0", "--repeats", "1"],
    "viz": ["viz", "--checkpoint", "{f}", "--output", "{tmp}/fc3.png"],
    "train --init": ["train", "--data-dir", "{fm}", "--init", "{f}", "--output", "{tmp}/run"],
    "eval --task seg": [
        "eval",
        "--task",
        "seg",
        "--checkpoint",
        "{f}",
        "--data-dir",
        "{tmp}",
        "--workers",
        "0",
    ],
}
# Every damaged file goes to predict (the cheapest reader); three to each other command.
_MODEL_TABLE = [(case, "predict") for case in (
    "text", "truncated", "training state", "extra a list", "input_size text", "10**12 classes", "img_size 100000",
    "unknown option", "reserved option", "precision", "not a string", "no form", "classes count", "offsets",
    "complex")] + [(case, cmd) for cmd in MODEL_COMMANDS if cmd != "predict"
                   for case in ("extra a list", "10**12 classes", "img_size 100000")]  # fmt: skip


@pytest.mark.parametrize(("case", "command"), _MODEL_TABLE)
def test_damaged_model_files_are_one_line(world, tmp_path, case, command):
    path, fragment = _model_cases(world, tmp_path)[case]
    argv = [
        a.format(f=path, image=world["image"], tmp=tmp_path, fm=world["fm"]) for a in MODEL_COMMANDS[command]
    ]
    line = assert_one_line(cli(*argv, seconds=60), fragment)
    assert path.name in line or path.stem in line, line  # the file is named
    assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "run").exists()


def _gz_idx(kind: int, dims: tuple[int, ...], data: bytes = b"") -> bytes:
    """A gzip-compressed IDX file: uint8 data of ``dims`` (``kind`` 3 images, 1 labels) from its header."""
    import gzip

    return gzip.compress(bytes([0, 0, 8, kind]) + struct.pack(f">{len(dims)}I", *dims) + data)


class Ctx:
    """What the damaged-data cases build their files and command lines from (one test's folder)."""

    def __init__(self, world: dict[str, Path], tmp: Path) -> None:
        self.world, self.tmp = world, tmp
        self.fm, self.model, self.image, self.run = world["fm"], world["model"], world["image"], world["run"]
        self.small = ["--epochs", "1", "--batch-size", "4", "--workers", "0", "--no-bench", "--no-export"]

    def data(self, **files: bytes) -> Path:
        """A copy of the Fashion-MNIST folder with ``files`` (dots spelt as underscores) replaced."""
        folder = shutil.copytree(self.fm, self.tmp / "data")
        for name, data in files.items():
            (folder / name.replace("_", "-").replace("-gz", ".gz")).write_bytes(data)
        return folder

    def eval_on(self, **files: bytes) -> list[object]:
        return ["eval", "--checkpoint", self.model, "--data-dir", self.data(**files), "--workers", "0"]

    def train_on(self, **files: bytes) -> list[object]:
        return self.train("--data-dir", self.data(**files))

    def train(self, *argv: object) -> list[object]:
        return ["train", *argv, *self.small, "--output", self.tmp / "r"]

    def predict(self, *argv: object) -> list[object]:
        return ["predict", "--checkpoint", self.model, self.image, *argv]

    def corrupt_gzip(self) -> bytes:
        raw = (self.fm / "t10k-images-idx3-ubyte.gz").read_bytes()
        return raw[:40] + bytes(60) + raw[100:]

    def labels(self, names: list[str]) -> Path:
        (self.tmp / "labels.txt").write_text("\n".join(names) + "\n")
        return self.tmp / "labels.txt"

    def bomb_folder(self) -> Path:
        """An image folder whose training split (one batch) holds a PNG claiming 40000x40000 pixels."""
        folder = make_image_folder(self.tmp / "folder", classes=2, per_class=1, size=12)
        (folder / "train" / "class0" / "bomb.png").write_bytes(png_header(40000, 40000) + bytes(64))
        return folder

    def pth(self, name: str) -> Path:
        """A ``.pth`` that is no importable checkpoint: text, partial, sparse, complex or empty tensors."""
        path, w = self.tmp / f"{name}.pth", torch.zeros(8, 3, 4, 4)
        if name == "text":
            path.write_text("hello world\n")
            return path
        tensors = {
            "partial": {"stage0.0.conv.weight": torch.zeros(8, 3, 3, 3)},
            "sparse": {"conv_embedding.conv.weight": w.to_sparse()},
            "complex": {"conv_embedding.conv.weight": w.to(torch.complex64)},
            "empty": {"conv_embedding.conv.weight": torch.zeros(0, 3, 4, 4)},
        }[name]
        torch.save(tensors, path)
        return path

    def imports(self, name: str, model: str = "repmlpnet_b224", out: Path | None = None) -> list[object]:
        return ["import", self.pth(name), "--model", model, "--output", out or self.tmp / "x.safetensors"]


NAMES = [f"c{i}" for i in range(10)]
# A one-stage pure MLP for 8x8 RGB images: the smallest model an image folder trains.
TINY_8 = ["--img-size", "8", "--model", NAME, "--model-arg", "widths=[4]", "--model-arg", "partition=4"]
IDX_BOMB = _gz_idx(1, (16,), bytes(16) + bytes(50_000_000))  # 16 labels, then 50 MB more
HUGE = (2**31, 2**31, 2**31)
# name -> (the command line, a fragment of its one error line)
DATA_CASES: dict[str, tuple[Callable[[Ctx], list[object]], str]] = {
    "corrupt gzip IDX": (lambda c: c.eval_on(t10k_images_idx3_ubyte_gz=c.corrupt_gzip()), "t10k-images"),
    "huge IDX header": (lambda c: c.eval_on(t10k_images_idx3_ubyte_gz=_gz_idx(3, HUGE)), "header claims"),
    "IDX bomb": (lambda c: c.eval_on(t10k_labels_idx1_ubyte_gz=IDX_BOMB), "t10k-labels"),
    "empty test set": (
        lambda c: c.eval_on(
            t10k_labels_idx1_ubyte_gz=_gz_idx(1, (0,)), t10k_images_idx3_ubyte_gz=_gz_idx(3, (0, 28, 28))
        ),
        "no examples",
    ),
    "empty training set": (
        lambda c: c.train_on(
            train_labels_idx1_ubyte_gz=_gz_idx(1, (0,)), train_images_idx3_ubyte_gz=_gz_idx(3, (0, 28, 28))
        ),
        "no examples",
    ),
    "image bomb": (
        lambda c: c.train("--dataset", "imagefolder", "--data-dir", c.bomb_folder(), *TINY_8),
        "bomb.png",
    ),
    "labels blank line": (
        lambda c: c.predict("--labels", c.labels([*NAMES[:5], "", *NAMES[5:]])),
        "line 6 is blank",
    ),
    "labels twice": (
        lambda c: c.predict("--labels", c.labels(["a", "b", "a", *NAMES[3:]])),
        "line 3 repeats",
    ),
    "import text": (lambda c: c.imports("text"), "text.pth"),
    "import partial": (lambda c: c.imports("partial"), "partial.pth"),
    "import sparse": (lambda c: c.imports("sparse"), "not dense"),
    "import complex": (lambda c: c.imports("complex"), "complex64"),
    "import empty tensor": (lambda c: c.imports("empty"), "is empty"),
    "import partial res50": (lambda c: c.imports("partial", "repmlp_res50"), "fc.weight"),
    "import a model file": (
        lambda c: ["import", c.model, "--model", "repmlpnet_b224", "--output", c.tmp / "x.safetensors"],
        "already a repmlp model file",
    ),
    "model-arg not JSON": (
        lambda c: c.train("--data-dir", c.fm, "--model-arg", "kernel_sizes=1,3"),
        "kernel_sizes=1,3",
    ),
    "convert over a state": (
        lambda c: ["convert", "--checkpoint", c.model, "--output", c.run / "checkpoint.safetensors"],
        "already exists: add --force",
    ),
    "export over a model": (
        lambda c: ["export", "--checkpoint", c.model, "--output", c.run / "deploy.safetensors"],
        "writes a .onnx file",
    ),
    "export suffix": (
        lambda c: [
            "export",
            "--checkpoint",
            c.model,
            "--format",
            "exported-program",
            "--output",
            c.tmp / "x.onnx",
        ],
        "writes a .pt2 file",
    ),
    "bench over a report": (
        lambda c: ["bench", "--checkpoint", c.model, "--output", c.run / "report.md"],
        "already exists: add --force",
    ),
    "import over a state": (
        lambda c: c.imports("partial", "repmlp_res50", c.run / "checkpoint.safetensors"),
        "already exists: add --force",
    ),
    "train into a file": (lambda c: ["train", "--data-dir", c.fm, "--output", c.image], "not a run folder"),
    "convert size": (
        lambda c: [
            "convert",
            "--checkpoint",
            c.model,
            "--img-size",
            "13",
            "--output",
            c.tmp / "d.safetensors",
        ],
        "13x13",
    ),
    "unknown model": (
        lambda c: ["train", "--model", "repmlp_fmnistt", "--data-dir", c.fm, "--output", c.tmp / "r"],
        "did you mean",
    ),
}


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_damaged_data_and_outputs_are_one_line(world, tmp_path, case):
    before = hashes(world["run"])
    command, fragment = DATA_CASES[case]
    line = assert_one_line(cli(*command(Ctx(world, tmp_path)), seconds=120), fragment)
    assert hashes(world["run"]) == before, "the finished run's files changed"
    if case == "unknown model":  # each suggestion once
        names = line.split("did you mean: ")[1].split(". ")[0].split(", ")
        assert len(names) == len(set(names)), line
    assert not (tmp_path / "x.safetensors").exists()
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())  # no file of a run written


# --------------------------------------------------------------------------------- resumed runs
def test_resume_of_a_finished_run_changes_nothing(world):
    before = hashes(world["run"])
    for extra in ([], ["--no-bench"], ["--device", "cpu", "--workers", "0"]):
        line = assert_one_line(cli("train", "--output", world["run"], "--resume", *extra), "finished run")
        assert str(world["run"]) in line
    assert hashes(world["run"]) == before


def _edit(key: str, value: object) -> Callable[[dict], None]:
    def edit(state: dict) -> None:
        if key.startswith("config."):
            state["config"][key[len("config.") :]] = value
        else:
            state[key] = value

    return edit


EDITS = {
    "batch_size -4": (_edit("config.batch_size", -4), "batch-size"),
    "epochs 0": (_edit("config.epochs", 0), "epochs"),
    "epochs text": (_edit("config.epochs", "five"), "epochs"),
    "lr not finite": (_edit("config.lr", float("inf")), "lr"),
    "seed -1": (_edit("config.seed", -1), "seed"),
    "model_args img_size": (_edit("config.model_args", {**KWARGS, "img_size": 100000}), "config.model_args"),
    "model_args device": (_edit("config.model_args", {**KWARGS, "device": "cuda"}), "model_args.device"),
    "config a list": (_edit("config", [1, 2]), "config"),
    "step -1": (_edit("step", -1), "step"),
    "step huge": (_edit("step", 10**9), "step"),
    "history text": (_edit("history", "x"), "history"),
    "weights of another model": (_edit("model", {"w": torch.zeros(3)}), "does not fit this run"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_edited_training_states_are_refused_before_anything_changes(interrupted, edit):
    """A training state is validated like a model file: an edited one resumes nothing and changes nothing."""
    change, fragment = EDITS[edit]
    path = interrupted / "checkpoint.safetensors"
    state = load_state(path)
    change(state)
    save_state(path, state)
    before = hashes(interrupted)
    assert_one_line(cli("train", "--output", interrupted, "--resume", "--workers", "0"), fragment)
    assert hashes(interrupted) == before


# ------------------------------------------------------------------------------------ special files
def test_special_files_are_named_never_read(world, tmp_path):
    """FIFOs, devices and sockets are named and skipped (or refused), never opened for reading; a folder
    whose symlinks loop is walked once; nothing blocks, nothing reads without bound."""
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    labels_fifo = tmp_path / "labels.fifo"
    os.mkfifo(labels_fifo)
    sock_path = tmp_path / "sock.png"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    loop = tmp_path / "loop"
    (loop / "a").mkdir(parents=True)
    shutil.copy(world["image"], loop / "a" / "x.png")
    (loop / "a" / "back").symlink_to(loop, target_is_directory=True)
    (loop / "self").symlink_to(".", target_is_directory=True)
    data = shutil.copytree(world["fm"], tmp_path / "fm-fifo")
    (data / "t10k-images-idx3-ubyte.gz").unlink()
    os.mkfifo(data / "t10k-images-idx3-ubyte.gz")
    model, image = str(world["model"]), str(world["image"])
    predict = ["predict", "--checkpoint", model, "--workers", "0"]
    cases = [
        ("fifo input", [*predict, image, str(fifo)], 1, "fifo.png: a FIFO"),
        ("device input", [*predict, "/dev/zero"], 2, "/dev/zero: a character device"),
        ("socket input", [*predict, image, str(sock_path)], 1, "sock.png: a socket"),
        ("fifo labels", [*predict, image, "--labels", str(labels_fifo)], 2, "labels file"),
        ("fifo checkpoint", ["predict", "--checkpoint", str(fifo), image], 2, "FIFO"),
        ("symlink loop glob", [*predict, f"{loop}/**/*.png"], 0, ""),
        ("symlink loop folder", [*predict, str(loop)], 0, ""),
        ("fifo IDX", ["eval", "--checkpoint", model, "--data-dir", str(data), "--workers", "0"], 2, "FIFO"),
        (
            "fifo init",
            ["train", "--data-dir", str(world["fm"]), "--init", str(fifo), "--output", str(tmp_path / "r")],
            2,
            "FIFO",
        ),  # fmt: skip
        (
            "fifo import",
            ["import", str(fifo), "--model", "repmlpnet_b224", "--output", str(tmp_path / "i.safetensors")],
            2,
            "FIFO",
        ),  # fmt: skip
    ]
    results = {}
    try:
        for name, argv, _, _ in cases:  # each within its time and memory: a blocked open is interrupted
            try:
                results[name] = cli(*argv, seconds=20)
            except Hang:
                pytest.fail(f"{name}: no answer within 20 s (a blocking read?)")
    finally:
        sock.close()
    for name, _, status, fragment in cases:
        res = results[name]
        assert res.returncode == status and "Traceback" not in res.stderr, (name, res.returncode, res.stderr)
        assert fragment in res.stderr, (name, res.stderr)
        if status == 2:
            assert_one_line(res)
    for name in ("symlink loop glob", "symlink loop folder"):  # the loop's one image, once
        rows = results[name].stdout.strip().splitlines()
        assert len(rows) == 2 and "x.png" in rows[1], (name, rows)


# ------------------------------------------------ small but hostile model files and graphs (issue 46)
def _int8_file(path: Path, nodes: list, inits: list, inputs: list | None = None) -> Path:
    """An int8 model file of repmlp_fmnist whose ONNX graph is ``nodes`` (input ``input``, output ``logits``)."""
    from onnx import TensorProto
    from onnx import helper as oh
    from safetensors.torch import save_file

    inputs = inputs or [oh.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1, 28, 28])]
    graph = oh.make_graph(nodes, "g", inputs, [oh.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
                          initializer=inits)  # fmt: skip
    raw = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8).SerializeToString()
    meta = {"format": "repmlp", "model": NAME, "model_kwargs": json.dumps(KWARGS), "form": "deploy",
            "precision": "int8", "extra": json.dumps({"input_size": [1, 28, 28]})}  # fmt: skip
    save_file({"onnx": torch.frombuffer(bytearray(raw), dtype=torch.uint8)}, str(path), metadata=meta)
    return path


def test_hostile_int8_graphs_are_refused_at_load(world, tmp_path):
    """An int8 file's graph holds only what the int8 export writes: a Loop of 10**15 iterations, a
    ConstantOfShape or Range of 10**12 elements, another input: refused before onnxruntime runs them."""
    from onnx import TensorProto, numpy_helper
    from onnx import helper as oh

    def const(name: str, value: object, dtype: type = np.int64):  # noqa: ANN202
        return numpy_helper.from_array(np.array(value, dtype), name)

    body = oh.make_graph(
        [oh.make_node("Identity", ["c"], ["c_out"]), oh.make_node("Identity", ["x"], ["x_out"])], "body",
        [oh.make_tensor_value_info(n, t, None) for n, t in (("i", TensorProto.INT64), ("c", TensorProto.BOOL),
                                                            ("x", TensorProto.FLOAT))],
        [oh.make_tensor_value_info(n, t, None) for n, t in (("c_out", TensorProto.BOOL), ("x_out", TensorProto.FLOAT))],
    )  # fmt: skip
    mean = oh.make_node("ReduceMean", ["input"], ["r"], axes=[2, 3], keepdims=0)
    cases = {
        "loop": ([oh.make_node("Loop", ["n", "go", "input"], ["logits"], body=body)],
                 [const("n", 10**15), const("go", True, bool)], None, "Loop"),
        "bomb": ([oh.make_node("ConstantOfShape", ["s"], ["big"]), mean, oh.make_node("Add", ["r", "big"], ["logits"])],
                 [const("s", [1, 10**6, 10**6])], None, "ConstantOfShape"),
        "range": ([oh.make_node("Range", ["a", "b", "d"], ["big"]), oh.make_node("Cast", ["big"], ["logits"], to=1)],
                  [const("a", 0), const("b", 10**12), const("d", 1)], None, "Range"),
        "size": ([mean], [], [oh.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 500, 500])],
                 "3x500x500"),
    }  # fmt: skip
    bench = ["--batch-size", "1", "--warmup", "0", "--repeats", "1"]
    for name, (nodes, inits, inputs, fragment) in cases.items():
        if name == "size":  # its ReduceMean writes logits
            nodes = [oh.make_node("ReduceMean", ["input"], ["logits"], axes=[2, 3], keepdims=0)]
        path = _int8_file(tmp_path / f"{name}.safetensors", nodes, inits, inputs)
        command = (
            ["bench", "--checkpoint", path, *bench] if name != "loop" else ["eval", "--checkpoint", path]
        )
        line = assert_one_line(cli(*command, seconds=20), fragment, f"{name}.safetensors")
        assert "not a usable ONNX graph" in line, line


def test_hostile_model_files_and_checkpoints_are_one_line(world, tmp_path, monkeypatch):
    """Header offsets of Infinity, an input size of 8192 pixels, NaN weights, JSON nested 100,000 deep, and
    .pth files with an expanded (zero-stride) head, 5,000-digit keys, NaN weights or model args that are
    unknown, reserved or describe 10**8 blocks: each one line, in seconds, before anything large is made."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "models"))
    from test_import import ARCH, ours, to_authors  # authors-layout checkpoints

    def infinite(head: dict) -> None:
        head[next(k for k in head if k != "__metadata__")]["data_offsets"] = [0, float("inf")]

    model = world["model"]
    nan_model = tmp_path / "nan.safetensors"
    weights = load_state(world["run"] / "checkpoint.safetensors")["model"]
    weights = {k: v.clone() for k, v in weights.items()}
    key = next(k for k, v in weights.items() if v.is_floating_point())
    weights[key].view(-1)[0] = float("nan")
    save_model(nan_model, _Weights(weights), name=NAME, model_kwargs=KWARGS, form="train",
               extra={"input_size": [1, 28, 28]}, check=False)  # fmt: skip
    deep = tmp_path / "deep.safetensors"
    from safetensors.torch import save_file

    save_file({}, str(deep), metadata={"format": "repmlp-state", "state": "[" * 100_000 + "]" * 100_000})
    bench = ["--batch-size", "1", "--warmup", "0", "--repeats", "1"]
    files = [
        (rewrite(model, tmp_path / "inf.safetensors", header=infinite), "is not a safetensors file"),
        (rewrite(model, tmp_path / "big.safetensors", {"extra": json.dumps({"input_size": [1, 8192, 8192]})}),
         "extra.input_size[1]"),
        (nan_model, f"tensor {key!r} holds 1 NaN"),
    ]  # fmt: skip
    for path, fragment in files:
        assert_one_line(cli("bench", "--checkpoint", path, *bench, seconds=20), fragment, path.name)
    assert_one_line(
        cli("train", "--output", _resumable(tmp_path, deep), "--resume", seconds=20), "nested too deep"
    )

    sd = to_authors(ours().state_dict())
    pths = {
        "expanded": {**sd, "head.weight": torch.zeros(1, 1).expand(30_000, 40_000)},
        "digits": {**sd, "embeds." + "9" * 5000 + ".conv.weight": sd["embeds.0.conv.weight"]},
        "nan": {**sd, "head.weight": torch.full_like(sd["head.weight"], float("nan"))},
    }
    arch = [a for k, v in ARCH.items() if k != "depths" for a in ("--model-arg", f"{k}={json.dumps(v)}")]
    good = tmp_path / "good.pth"
    torch.save(sd, good)
    cases = [(p, ["--model-arg", "depths=[1,1,2,1]"], frag) for p, frag in (
        ("expanded", "zero or overlapping strides"), ("digits", "indices at most 6 digits"), ("nan", "NaN"))] + [
        ("good", ["--model-arg", "depths=[1,1,2,1]", "--model-arg", "evil=1"], "--model-arg evil is not an option"),
        ("good", ["--model-arg", "depths=[1,1,2,1]", "--model-arg", 'device="meta"'], "device"),
        ("good", ["--model-arg", "depths=[100000000,1,2,1]"], "far larger than the file's"),
    ]  # fmt: skip
    for name, args, fragment in cases:
        path = good if name == "good" else tmp_path / f"{name}.pth"
        if name != "good":
            torch.save(pths[name], path)
        out = tmp_path / "x.safetensors"
        res = cli("import", path, *arch, *args, "--model", "repmlpnet_b224", "--output", out, seconds=30)
        assert_one_line(res, fragment)
        assert not out.exists()


class _Weights(torch.nn.Module):
    """A module whose state dict is ``weights`` (to write a model file of given tensors)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._w = weights

    def state_dict(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return dict(self._w)


def _resumable(tmp: Path, state: Path) -> Path:
    out = tmp / "deep-run"
    out.mkdir()
    shutil.copy(state, out / "checkpoint.safetensors")
    return out


def test_create_model_refuses_non_positive_counts():
    for kwargs in ({"in_chans": 0}, {"num_classes": -1}, {"in_chans": True}):
        with pytest.raises(ValueError, match="in_chans|num_classes"):
            repmlp.create_model(NAME, **KWARGS, **kwargs)
    assert repmlp.create_model(NAME, **KWARGS, num_classes=0).num_classes == 0  # timm's "no head"


# ------------------------------- H6 (issue 46): resumed states and environment values get the command line's checks
@functools.cache
def _train_actions() -> dict[str, object]:
    """``repmlp train``'s argparse actions by destination (the real parser of the CLI)."""
    import argparse

    from repmlp.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices["train"]._actions}


def _state_refuses(name: str, value: object) -> bool:
    """Whether a training state whose config holds ``value`` for ``name`` is refused (one CheckpointError
    naming the field), the rest of the config being a valid run's."""
    from repmlp.io.model_file import CheckpointError
    from repmlp.tasks.classification import TrainConfig

    try:
        TrainConfig.from_dict({**TrainConfig().to_dict(), name: value}).validate("ckpt.safetensors")
    except CheckpointError as exc:
        assert str(exc).startswith("ckpt.safetensors: config field") and repr(name) in str(exc), str(exc)
        return True
    return False


def _argv_refuses(action, value: object) -> bool:  # noqa: ANN001 - an argparse action
    import argparse

    try:
        action.type(repr(value) if isinstance(value, float) else str(value))
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        return True
    return False


def _same_verdicts(actions: dict, names: set[str], values: list[object]) -> None:
    for name in names:
        for value in values:
            argv, state = _argv_refuses(actions[name], value), _state_refuses(name, value)
            if name == "min_lr":  # the config narrows it further: at most --lr
                assert state or not argv, (name, value, "the command line refuses it, a state does not")
            else:
                assert argv == state, (name, value, f"command line refuses: {argv}, state refuses: {state}")


@SETTINGS
@given(value=st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True)))
def test_resumed_config_values_get_the_command_lines_checks(value):
    """Every typed option of ``repmlp train`` refuses the same values on the command line and from a resumed
    state's config (both from the one table, repmlp.tasks.limits.OPTIONS): at and around every bound, and
    drawn values; a choice option takes the same choices; no typed option escapes the table."""
    from repmlp.tasks.classification import TrainConfig
    from repmlp.tasks.config import CHOICES
    from repmlp.tasks.limits import OPTIONS

    actions = _train_actions()
    fields = {f for f in TrainConfig().to_dict() if f in actions}
    # --model and --model-arg are names and options a resumed state checks by building its model.
    typed = {f for f in fields if actions[f].type is not None and f not in ("model", "model_args")}
    assert typed <= set(OPTIONS) and len(typed) > 15, typed - set(OPTIONS)
    for name in fields & set(CHOICES):
        assert set(actions[name].choices) == set(CHOICES[name]), name
    if value == 0 and not isinstance(value, float):  # once: the bounds themselves
        probes: list[object] = [0.5, 0.999, 1.5, 1e-300, 1e300, 2**64, float("nan"), float("inf"), -0.0]
        for name in typed:
            for bound in (OPTIONS[name].lo, OPTIONS[name].hi):
                probes += [bound - 1, bound, bound + 1, float(bound), bound * (1 + 1e-9) + 1e-12]
        _same_verdicts(actions, typed, probes)
    _same_verdicts(actions, typed, [value])


def _h6_edit(path: str, value: object) -> Callable[[dict], None]:
    """An edit of the state at the dotted ``path`` (config.x, config.eval_preprocessing.y, optimizer...)."""

    def edit(state: dict) -> None:
        *parents, last = path.split(".")
        node = state
        for key in parents:  # list indices and optimizer state ids are integers
            node = node[int(key)] if isinstance(node, list) or key.isdigit() else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        elif value is _DROP:
            node.pop(last)
        else:
            node[last] = value

    return edit


_DROP = object()


def _rng_word(state: dict, kind: str, at: tuple[int, ...]) -> None:
    """Set the word at index path ``at`` of rank 0's ``kind`` RNG state (nested tuples) to 2**70."""

    def put(node: tuple, at: tuple[int, ...]) -> tuple:
        i = at[0]
        return (*node[:i], 2**70 if len(at) == 1 else put(node[i], at[1:]), *node[i + 1 :])

    state["rng"]["0"][kind] = put(state["rng"]["0"][kind], at)


_H6_EDITS: dict[str, tuple[Callable[[dict], None], str]] = {
    # a fork storm, a benchmark batch of 4M images, a resize to 10,000x the crop, inputs / 1e-300
    "workers 1000000": (_h6_edit("config.workers", 1_000_000), "--workers must be in 0..256"),
    "bench_batch_size 2**22": (_h6_edit("config.bench_batch_size", 2**22), "--bench-batch-size must be in"),
    "crop_pct 1e-4": (
        _h6_edit("config.eval_preprocessing", {"crop_pct": 1e-4, "mean": [0.5], "std": [0.5]}),
        "crop_pct",
    ),
    "std 1e-300": (
        _h6_edit("config.eval_preprocessing", {"mean": [0.5], "std": [1e-300]}),
        "std' must be 1 to 4 numbers in [0.0001, 10000]",
    ),
    "no mean/std": (_h6_edit("config.eval_preprocessing", {"crop_pct": 0.9}), "mean and std"),
    "config std alone": (_h6_edit("config.std", [0.5]), "both mean and std"),
    # the optimizer state, checked against this run's optimizer before it is loaded
    "momentum text": (_h6_edit("optimizer.param_groups.0.momentum", "x"), "momentum is 'x'"),
    "weight_decay 1e300": (_h6_edit("optimizer.param_groups.0.weight_decay", 1e300), "weight_decay"),
    "maximize": (_h6_edit("optimizer.param_groups.0.maximize", True), "maximize is True"),
    "nesterov off": (_h6_edit("optimizer.param_groups.0.nesterov", False), "nesterov is False"),
    "lr nan": (_h6_edit("optimizer.param_groups.1.lr", float("nan")), "lr is nan"),
    "unknown setting": (_h6_edit("optimizer.param_groups.0.bogus", 1), "unknown setting"),
    "duplicated id": (_h6_edit("optimizer.param_groups.0.params.1", 0), "params is [0, 0, 2"),
    "buffer shape": (_h6_edit("optimizer.state.0.momentum_buffer", torch.zeros(3)), "of shape (3,)"),
    "buffer dtype": (
        _h6_edit("optimizer.state.0.momentum_buffer", torch.zeros(4, 1, 1, 1, dtype=torch.int64)),
        "torch.int64",
    ),
    "buffer text": (_h6_edit("optimizer.state.0.momentum_buffer", "x"), "not a tensor"),
    "buffer nan": (
        _h6_edit("optimizer.state.0.momentum_buffer", torch.full((4, 1, 1, 1), float("nan"))),
        "NaN/inf",
    ),
    "history without epoch_s": (_h6_edit("history.0.epoch_s", _DROP), "no number for epoch_s"),
    # RNG words beyond the C integers the generators keep (python's first key word, numpy's position)
    "unknown config key": (_h6_edit("config.model_kwargs", {"widths": [4, 8]}), "'model_kwargs': no option"),
    "python rng 2**70": (lambda s: _rng_word(s, "python", (1, 0)), "does not fit this run"),
    "numpy rng 2**70": (lambda s: _rng_word(s, "numpy", (2,)), "does not fit this run"),
}


def test_h6_edited_states_are_one_line_and_change_nothing(interrupted):
    """Each edited field of a resumed state (its config, its optimizer, its history) is refused with one
    line naming the file and what does not fit, before anything is loaded into the run or written; then
    the untouched state still resumes past all of these checks."""
    path = interrupted / "checkpoint.safetensors"
    original = path.read_bytes()
    for case, (change, fragment) in _H6_EDITS.items():
        state = load_state(path)
        change(state)
        save_state(path, state)
        before = hashes(interrupted)
        line = assert_one_line(cli("train", "--output", interrupted, "--resume", "--workers", "0"), fragment)
        assert str(path) in line, (case, line)
        assert hashes(interrupted) == before, case
        path.write_bytes(original)


def test_h6_environment_batches_and_task_models_are_one_line(world, tmp_path, monkeypatch):
    """Bad torchrun variables are one line naming the variable; a BatchNorm batch of one example and another
    task's model are refused before training, nothing written."""
    out = tmp_path / "run"
    train = ["train", "--data-dir", world["fm"], "--model", NAME, "--model-arg", "widths=[4,8]", "--model-arg",
             "kernel_sizes=[3]", "--epochs", 1, "--val-limit", 8, "--workers", 0, "--output", out]  # fmt: skip
    cases = [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc': expected an integer in 1.."),
        ({"WORLD_SIZE": "2"}, "RANK is not set"),
        ({"WORLD_SIZE": "2", "RANK": "x"}, "RANK='x': expected an integer in 0..1"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK='2': expected an integer in 0..1"),
        ({"WORLD_SIZE": "2", "RANK": "1"}, "MASTER_ADDR is not set"),
        ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "localhost"}, "MASTER_PORT is not set"),
    ]
    for env, fragment in cases:
        with monkeypatch.context() as m:
            for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                m.delenv(key, raising=False)
            for key, value in env.items():
                m.setenv(key, value)
            assert_one_line(cli(*train), fragment)
    for extra, fragment in [
        (["--batch-size", 1, "--train-limit", 8], "--batch-size 1 leaves 1"),
        (["--batch-size", 8, "--train-limit", 1], "1 training example"),
    ]:
        assert_one_line(cli(*train, *extra), "BatchNorm needs at least 2 examples per batch", fragment)
    seg = ["train", "--data-dir", world["fm"], "--model", "pspnet_res50", "--model-arg", "widths=[64,128,256,512]",
           "--model-arg", "layers=[1,1,1,1]", "--model-arg", "head_channels=16", "--model-arg", "aux_channels=16",
           "--train-limit", 8, "--val-limit", 8, "--workers", 0, "--output", out]  # fmt: skip
    assert_one_line(cli(*seg), "is not an image classifier", "--task seg")
    assert not out.exists()


# ------------------------------------------- third round (issue 51): failed writes, aborts, cut values
def _export(model: Path, out: Path, fmt: str) -> list[object]:
    suffix = {"onnx": "onnx", "torchscript": "pt", "exported-program": "pt2"}[fmt]
    return ["export", "--checkpoint", model, "--format", fmt, "--output", out / f"x.{suffix}"]


WRITERS: dict[str, Callable[[Path, Path], list[object]]] = {
    "convert": lambda model, out: ["convert", "--checkpoint", model, "--output", out / "d.safetensors"],
    **{fmt: functools.partial(_export, fmt=fmt) for fmt in ("onnx", "torchscript", "exported-program")},
}


@pytest.mark.parametrize("writer", [w for w in WRITERS if w != "onnx"])
def test_a_write_that_fails_is_one_line_naming_the_users_path(world, tmp_path, monkeypatch, writer):
    """A full disk (every file write raises ENOSPC): one line naming the output, exit 2, no temporary file
    (torch's own file writer aborted the process: the exporters serialise in memory first)."""

    def full(self: Path, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    argv = WRITERS[writer](world["model"], tmp_path)
    monkeypatch.setattr(Path, "write_bytes", full)
    line = assert_one_line(cli(*argv), f"cannot write {argv[-1]}: {os.strerror(errno.ENOSPC)}")
    assert ".tmp" not in line and list(tmp_path.iterdir()) == []


@pytest.fixture
def mount(tmp_path) -> Iterator[Callable[[str, str], Path]]:
    """``mount(name, options)``: a small tmpfs at ``tmp_path/name``; skips where this process cannot mount."""
    mounted: list[Path] = []

    def make(name: str, options: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        if (
            shutil.which("mount") is None
            or subprocess.run(
                ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True
            ).returncode
        ):
            pytest.skip("cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN)")
        mounted.append(folder)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=False)


# Each command line of argv[1] (JSON) through repmlp.cli.main, one after the other in this one process; prints
# each one's exit status and stderr (JSON). A writer that aborts the process (torch's own file writer did on a
# full disk) ends it before the summary.
WRITERS_IN_ONE_PROCESS = """
import contextlib, io, json, sys
from repmlp.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        results.append((main(argv), err.getvalue()))
print(json.dumps(results))
"""


@pytest.mark.slow  # mounts two tmpfs and starts a process that imports torch
def test_full_disks_and_read_only_folders_are_one_line(world, mount):
    """Each writer on a full tmpfs (in a process of their own: torch's file writer aborted it) and a
    read-only one."""
    full, read_only = mount("full", "size=256k"), mount("ro", "ro,size=64k")
    with contextlib.suppress(OSError):  # fill it: every later write fails
        with open(full / "filler", "wb") as f:
            while True:
                f.write(bytes(4096))
                f.flush()
    argvs = [[str(a) for a in writer(world["model"], full)] for writer in WRITERS.values()]
    res = subprocess.run([sys.executable, "-c", WRITERS_IN_ONE_PROCESS, json.dumps(argvs)], capture_output=True,
                         text=True, env=subprocess_env(), timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.splitlines()[-1])
    assert len(results) == len(WRITERS)
    for argv, (status, err) in zip(argvs, results, strict=True):
        assert_one_line(subprocess.CompletedProcess(argv, status, "", err),
                        f"cannot write {argv[-1]}: {os.strerror(errno.ENOSPC)}")  # fmt: skip
    assert sorted(p.name for p in full.iterdir()) == ["filler"]
    for writer in WRITERS.values():
        argv = writer(world["model"], read_only)
        assert_one_line(cli(*argv), f"cannot write {argv[-1]}: {os.strerror(errno.EROFS)}")


def test_long_names_are_written_or_refused_naming_them(world, tmp_path):
    """A name of 250 characters fits the file system (its temporary folder's name must too); one of 272 does
    not: one line naming it, exit 2."""
    out = tmp_path / ("n" * 245 + ".pt")
    assert (
        cli("export", "--checkpoint", world["model"], "--format", "torchscript", "--output", out).returncode
        == 0
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    long = tmp_path / ("n" * 272 + ".safetensors")
    assert_one_line(cli("convert", "--checkpoint", world["model"], "--output", long), str(long), "too long")


def test_an_environment_value_of_any_length_is_cut_in_the_error_line(world, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "7" * 100_000)
    line = assert_one_line(cli("train", "--data-dir", world["fm"], "--output", tmp_path / "r"), "WORLD_SIZE=")
    assert len(line) < 300, len(line)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "int64", "int8", "bool"])
def test_weights_in_a_dtype_no_weight_has_are_refused_when_read(world, tmp_path, dtype):
    """float8 weights (torch has no arithmetic for them), integer or boolean weights: one line naming the
    file and the dtype, in every command that reads a model file."""
    weights = load_state(world["run"] / "checkpoint.safetensors")["model"]
    cast = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in weights.items()}
    path = tmp_path / f"{dtype}.safetensors"
    save_model(path, _Weights(cast), name=NAME, model_kwargs=KWARGS, form="train",
               extra={"input_size": [1, 28, 28]}, check=False)  # fmt: skip
    for argv in (["predict", "--checkpoint", path, world["image"]], ["convert", "--checkpoint", path]):
        assert_one_line(cli(*argv), path.name, f"torch.{dtype}", "in a dtype no weight has")


def test_ctrl_c_in_any_phase_of_a_command_is_one_line(world, tmp_path, monkeypatch):
    """Ctrl-C while a command imports its modules (seconds) or while it predicts a folder: one line, 130."""
    import importlib

    import repmlp.commands.predict

    real = importlib.import_module

    def interrupted_import(name: str, *args: object) -> object:
        if name.startswith("repmlp.commands."):
            raise KeyboardInterrupt
        return real(name, *args)

    folder = make_image_folder(tmp_path / "images", classes=2, per_class=2, size=28)
    with monkeypatch.context() as m:
        m.setattr(importlib, "import_module", interrupted_import)
        res = cli("predict", "--checkpoint", world["model"], folder)
    assert res.returncode == 130 and res.stderr.strip() == "repmlp: interrupted by SIGINT", res.stderr

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(repmlp.commands.predict, "predict_paths", interrupted)
    res = cli("predict", "--checkpoint", world["model"], folder)
    assert res.returncode == 130 and res.stderr.strip() == "repmlp: interrupted by SIGINT", res.stderr


def test_a_process_whose_peers_never_come_says_so_and_stops(world, tmp_path, monkeypatch, caplog):
    """WORLD_SIZE=2 with no second process: one line saying what it waits for, then one error line."""
    port = lonely_process(monkeypatch, REPMLP_DIST_TIMEOUT="2")
    res = cli("train", "--data-dir", world["fm"], "--epochs", 1, "--workers", 0, "--output", tmp_path / "r")
    assert f"waiting for the other 1 at 127.0.0.1:{port}, timeout 2 s" in res.stderr, res.stderr
    assert_one_line(res, "did not all join", "within 2 s", "REPMLP_DIST_TIMEOUT")


def test_a_run_folder_named_in_bytes_that_are_not_utf8_is_refused_before_training(world, tmp_path):
    """``--output $'runs/x-\\xff\\xfe'`` (the bytes reach Python as surrogate escapes): refused at once, as the
    model files' metadata and the report hold the name; nothing written."""
    out = tmp_path / os.fsdecode(b"x-\xff\xfe")
    res = cli("train", "--data-dir", world["fm"], "--epochs", 1, "--workers", 0, "--output", out)
    assert_one_line(res, "is not valid UTF-8", "x-\\udcff\\udcfe")
    assert list(tmp_path.iterdir()) == []
