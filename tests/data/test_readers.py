"""Data files that are small but hostile (issue 46): each reader refuses them at once, in one line naming
the file, before allocating what they ask for.

CIFAR-10 batches are pickles: a 328-byte one whose dict key is a tuple nested 64 levels (each level the
previous one twice, through memo references) took the unpickler 2**64 hashing steps, without returning or
answering a signal; one whose labels are lists of shared lists asked numpy for gigabytes. IDX files have a
header that may claim millions of images, or labels of a type (int8, float) that can be -1 or NaN. A face
pairs file may hold 5000-digit numbers. Each file is written here byte by byte and read under a time and
a memory limit (``test_hostile_input``'s guards).
"""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from repmlp.data import cifar
from repmlp.data.face import read_pairs
from repmlp.data.fashion_mnist import load_fashion_mnist, read_idx
from repmlp.errors import UserError
from repmlp_testdata import make_cifar10, make_fashion_mnist, run_cli
from test_hostile_input import assert_one_line, memory_limit, time_limit

pytestmark = pytest.mark.usefixtures("one_thread")

N = 4  # examples per hand-made batch


def refused(read, path: Path, *fragments: str, seconds: float = 10) -> str:
    """``read(path)`` must raise a one-line :class:`UserError` naming ``path`` (and ``fragments``) within
    ``seconds`` and the memory limit; returns its message."""
    with time_limit(seconds), memory_limit(1 << 30), pytest.raises(UserError) as info:
        read(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    assert all(f in message for f in fragments), (fragments, message)
    assert len(message) < 600, message
    return message


# --------------------------------------------------------------------------------------------- CIFAR
def nested_key(levels: int = 64, memo: bool = True) -> bytes:
    """A pickled dict whose one key is a tuple nested ``levels`` deep, each level holding the previous one
    twice (a memo reference, or DUP): its hash takes 2**levels steps."""
    ops = b"\x80\x02}" + b"K\x00"  # PROTO 2, EMPTY_DICT, BININT1 0
    for i in range(levels):  # BINPUT i, BINGET i (or DUP), TUPLE2
        ops += (b"q" + bytes([i]) + b"h" + bytes([i]) if memo else b"2") + b"\x86"
    return ops + b"Ns."  # value None, SETITEM, STOP


def batch(protocol: int = 2, **values: object) -> bytes:
    """A pickled batch of ``N`` examples as torchvision's files hold it, with ``values`` replaced."""
    content = {"batch_label": b"b", "labels": [1, 2, 3, 4], "data": np.zeros((N, 3072), np.uint8),
               "filenames": [b"a.png"] * N, **values}  # fmt: skip
    return pickle.dumps({k.encode(): v for k, v in content.items()}, protocol=protocol)


def shared_lists(levels: int) -> list:
    """A list of two references to a list of two references to ... (2**levels ints, a few bytes each level)."""
    x: list = [0]
    for _ in range(levels):
        x = [x, x]
    return x


def call(module: str, name: str, args: bytes) -> bytes:
    """Protocol-2 ops that call ``module.name`` with the (already pickled) argument ops ``args``."""
    return b"c" + f"{module}\n{name}\n".encode() + b"(" + args + b"tR"


# name -> (the file's bytes, a fragment of the error)
CIFAR_CASES = {
    "64-level shared tuple key": (nested_key(), "shared tuple"),
    "64-level DUP tuple key": (nested_key(memo=False), "opcode b'2'"),
    "tuple key": (pickle.dumps({(1, 2): 0}, protocol=2), "dict key of type tuple"),
    "frozenset key": (pickle.dumps({frozenset({1}): 0}, protocol=4), "opcode"),
    "unknown key": (batch(evil=1), "unexpected key b'evil'"),
    "labels of shared lists (8 GB)": (batch(labels=[shared_lists(28)] * N), "shared list"),
    "nested labels": (batch(labels=[[0], [1], [2], [3]]), "list nested in a list"),
    "float labels": (batch(labels=[0.0, 1.5, 2.0, 3.0]), "label 0 is 0.0, a float"),
    "bool labels": (batch(labels=[1, True, 2, 3]), "label 1 is True, a bool"),
    "label 10": (batch(labels=[0, 1, 10, 2]), "label 2 is 10, outside 0..9"),
    "label 10**30": (batch(labels=[0, 1, 2, 10**30]), "outside 0..9"),
    "float label array": (batch(labels=np.arange(N, dtype=np.float32)), "float32 array"),
    "too few labels": (batch(labels=[1, 2]), "2 labels for 4 images"),
    "labels a dict": (batch(labels={"labels": 1}), "dict nested in a dict"),
    "os.system": (b"\x80\x02" + call("os", "system", b"U\x04true") + b".", "refusing to load os.system"),
    "ndarray((10**10,))": (
        b"\x80\x02" + call("numpy", "ndarray", b"\x8a\x05\x00\xe4\x0bT\x02\x85") + b".",
        "refusing to call ndarray",
    ),
    "_reconstruct (10**10,)": (
        b"\x80\x02"
        + call(
            "numpy.core.multiarray", "_reconstruct", b"cnumpy\nndarray\n\x8a\x05\x00\xe4\x0bT\x02\x85U\x01b"
        )
        + b".",
        "unexpected arguments",
    ),  # fmt: skip
    "object array": (batch(data=np.zeros((N, 3072), object)), "refusing numpy dtype"),
    "int16 data": (batch(data=np.zeros((N, 3072), np.int16)), "'data' is not a uint8"),
    "not a pickle": (b"hello\n", "not a CIFAR-10 batch"),
}


@pytest.mark.parametrize("protocol", [2, 5])
def test_cifar_batches_in_torchvisions_layout_load(tmp_path, protocol):
    """What the checks let through: torchvision's structure, from protocol 2 (its files) to 5, and labels
    as a list or an integer array."""
    make_cifar10(tmp_path, per_batch=N)
    folder = tmp_path / "cifar-10-batches-py"
    (folder / "test_batch").write_bytes(batch(protocol, labels=np.array([9, 0, 1, 2], np.int64)))
    images, labels = cifar.load_cifar10(tmp_path, train=False)
    assert images.shape == (N, 3, 32, 32) and images.dtype == np.uint8
    assert labels.tolist() == [9, 0, 1, 2] and labels.dtype == np.int64
    images, labels = cifar.load_cifar10(tmp_path, train=True)
    assert images.shape == (5 * N, 3, 32, 32) and labels.shape == (5 * N,)


def test_hostile_cifar_batches_are_refused_at_once(tmp_path, monkeypatch):
    for name, (raw, fragment) in CIFAR_CASES.items():
        path = tmp_path / name
        path.write_bytes(raw)
        try:
            refused(cifar._load_batch, path, fragment, seconds=5)
        except BaseException as exc:  # name the case (a Hang, a wrong message)
            raise AssertionError(f"case {name!r}: {exc!r}") from exc
    assert len(nested_key()) < 400
    # The opcode budget bounds time and memory (each opcode makes at most one object): a small budget
    # here, so the file stays small.
    monkeypatch.setattr(cifar, "_MAX_OPS", 1000)
    (tmp_path / "many").write_bytes(b"\x80\x02]" + b"N" * 2000 + b".")
    refused(cifar._load_batch, tmp_path / "many", "more than 1000 pickle opcodes")


def test_hostile_cifar_batch_is_one_line_from_the_cli(tmp_path):
    make_cifar10(tmp_path, per_batch=N)
    bad = tmp_path / "cifar-10-batches-py" / "data_batch_1"
    bad.write_bytes(nested_key())
    argv = ["train", "--dataset", "cifar10", "--data-dir", tmp_path, "--model", "repmlp_cifar",
            "--model-arg", "widths=[4,8]", "--epochs", "1", "--no-bench", "--no-export", "--output",
            tmp_path / "run"]  # fmt: skip
    with time_limit(60), memory_limit():
        res = run_cli(*argv)
    assert_one_line(res, str(bad), "shared tuple")
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------- IDX
def idx(dtype: str, dims: tuple[int, ...], data: bytes, compress: bool = True) -> bytes:
    """An IDX file: type byte of ``dtype`` (an IDX type: >u1 >i1 >i2 >i4 >f4 >f8), header ``dims``."""
    code = {">u1": 8, ">i1": 9, ">i2": 11, ">i4": 12, ">f4": 13, ">f8": 14}[dtype]
    raw = bytes([0, 0, code, len(dims)]) + struct.pack(f">{len(dims)}I", *dims) + data
    return gzip.compress(raw) if compress else raw


def labels_file(values: list[float], dtype: str) -> bytes:
    return idx(dtype, (len(values),), np.array(values, dtype).tobytes())


# name -> (file name, bytes, fragment): each replaces one file of a 16-example Fashion-MNIST test split.
FM_CASES = {
    "5,000,000 images of zeros": (
        "t10k-images-idx3-ubyte.gz", idx(">u1", (5_000_000, 28, 28), bytes(2 << 20)), "decompression bomb"
    ),  # the file inflated to 3.9 GB; this one would to 2 MB, its header claims 3.9 GB
    "plain file claiming 3.9 GB": (
        "t10k-images-idx3-ubyte", idx(">u1", (5_000_000, 28, 28), bytes(784), compress=False),
        "the file holds 784 bytes of data",
    ),
    "int8 label -1": ("t10k-labels-idx1-ubyte.gz", labels_file([0, 1, -1] + [2] * 13, ">i1"), "label 2 is -1"),
    "int32 label 10": ("t10k-labels-idx1-ubyte.gz", labels_file([0] * 15 + [10], ">i4"), "label 15 is 10"),
    "float labels": ("t10k-labels-idx1-ubyte.gz", labels_file([0.5] * 16, ">f4"), "float32 labels"),
    "NaN labels": ("t10k-labels-idx1-ubyte.gz", labels_file([float("nan")] * 16, ">f8"), "float64 labels"),
    "int32 pixels": (
        "t10k-images-idx3-ubyte.gz", idx(">i4", (16, 28, 28), bytes(16 * 784 * 4)), "int32 values"
    ),
}  # fmt: skip


def test_hostile_idx_files_are_refused_before_allocating(tmp_path):
    for name, (file, raw, fragment) in FM_CASES.items():
        folder = make_fashion_mnist(tmp_path / name, n_train=4, n_test=16)
        (folder / (file.removesuffix(".gz") + ".gz")).unlink()  # the reader prefers .gz
        (folder / file).write_bytes(raw)
        try:
            refused(lambda _, d=folder: load_fashion_mnist(d, train=False), folder / file, fragment)
        except BaseException as exc:
            raise AssertionError(f"case {name!r}: {exc!r}") from exc
    # Cut short or too long, found while reading (plain files from their size, before reading).
    (tmp_path / "short.gz").write_bytes(idx(">u1", (1000, 28, 28), bytes(100)))
    refused(read_idx, tmp_path / "short.gz", "100 data bytes, the header says 784000")
    (tmp_path / "long").write_bytes(idx(">u1", (2,), bytes(3), compress=False))
    refused(read_idx, tmp_path / "long", "claims a 2 array (2 bytes), the file holds 3 bytes")
    # What the checks let through: integer labels of any IDX integer type, read in native byte order.
    (tmp_path / "ok.gz").write_bytes(labels_file([9, 0, 300], ">i2"))
    assert read_idx(tmp_path / "ok.gz").tolist() == [9, 0, 300]


def test_hostile_idx_labels_are_one_line_from_the_cli(tmp_path):
    folder = make_fashion_mnist(tmp_path / "fm", n_train=8, n_test=8)
    (folder / "train-labels-idx1-ubyte.gz").write_bytes(labels_file([0, 1, 2, -1, 0, 1, 2, 3], ">i1"))
    argv = ["train", "--data-dir", folder, "--model", "repmlp_fmnist", "--model-arg", "widths=[4,8]",
            "--model-arg", "kernel_sizes=[3]", "--epochs", "1", "--no-bench", "--no-export", "--output",
            tmp_path / "run"]  # fmt: skip
    with time_limit(60), memory_limit():
        res = run_cli(*argv)
    assert_one_line(res, "train-labels-idx1-ubyte.gz: label 3 is -1")


# ---------------------------------------------------------------------------------------- face pairs
def test_face_pairs_with_huge_numbers_are_one_line(tmp_path):
    (tmp_path / "Ann").mkdir()
    (tmp_path / "Ann" / "Ann_0001.png").write_bytes(b"")
    big = "9" * 5000  # int() of it raises ValueError (Python 3.11's limit of 4300 digits)
    cases = {
        "header": (f"{big} 300\nAnn 1 1\n", ":1: the number of folds '99999"),
        "image number": (f"1 1\nAnn 1 {big}\n", ":2: image number '99999"),
        "unicode digit": ("1 1\nAnn 1 \u00b2\n", ":2: image number '\u00b2'"),
        "negative": ("1 1\nAnn -1 1\n", ":2: image number '-1'"),
        "long name": (f"1 1\n{'A' * 5000} 1 1\n", ":2: names AAAA"),
        "long line": (f"{'x' * 100000}\n", ":1: cannot parse 'xxxx"),
    }
    for name, (text, fragment) in cases.items():
        path = tmp_path / f"{name}.txt"
        path.write_text(text)
        refused(lambda p: read_pairs(p, tmp_path), path, fragment)
    (tmp_path / "ok.txt").write_text("1 1\nAnn 1 1\n")
    assert read_pairs(tmp_path / "ok.txt", tmp_path).folds == 1


# ---------------------------------------------------------------------------------------- Cityscapes
def test_cityscapes_label_maps_are_read_as_stored(tmp_path):
    """A label map's values as stored: a 16-bit map's 300 is not clipped to 255 (the ignore label), an
    RGB map is not turned into luminance; both are refused naming the file. 8-bit and palette maps load."""
    from PIL import Image

    from repmlp.data.cityscapes import CityscapesSegmentation

    image = tmp_path / "leftImg8bit" / "val" / "c" / "x_leftImg8bit.png"
    label = tmp_path / "gtFine" / "val" / "c" / "x_gtFine_labelTrainIds.png"
    for d in (image.parent, label.parent):
        d.mkdir(parents=True)
    Image.fromarray(np.zeros((4, 6, 3), np.uint8)).save(image)
    values = np.full((4, 6), 3, np.uint16)
    values[0, 0] = 300
    cases = {
        "16-bit": (Image.fromarray(values), "holds label 300"),
        "RGB": (Image.fromarray(np.zeros((4, 6, 3), np.uint8)), "RGB image, not a label map"),
    }
    for img, fragment in cases.values():
        img.save(label)
        refused(lambda _: CityscapesSegmentation(tmp_path, "val")[0], label, fragment)
    palette = Image.fromarray(np.full((4, 6), 18, np.uint8)).convert("P")
    for img in (Image.fromarray(np.full((4, 6), 18, np.uint8)), palette):
        img.save(label)
        assert CityscapesSegmentation(tmp_path, "val")[0][1].unique().tolist() == [18]
