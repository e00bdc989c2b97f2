"""``repmlp.data.png``: plain PNGs decoded in batches give Pillow's pixels, and anything else is left to
Pillow (``None``), never decoded differently.

The files are written here byte by byte, with every row filter PNG has (none, Sub, Up, Average, Paeth)
in every row position, including the first (where Up, Average and Paeth read an all-zero row above),
and with the ancillary chunks that change no pixel; Pillow's own encoder writes more. Corrupted copies
(bits flipped, cut short, data appended) must give ``None`` or Pillow's pixels, and ``None`` wherever
Pillow cannot read the file.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, PngImagePlugin

from repmlp.data.png import png_scanlines, unfilter


def _paeth(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    p = a + b - c
    pa, pb, pc = np.abs(p - a), np.abs(p - b), np.abs(p - c)
    return np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, c))


def _filtered(image: np.ndarray, filters: list[int]) -> bytes:
    """PNG scanlines of ``image`` (H, W, C) uint8, row ``i`` with filter ``filters[i]`` (the encoder side)."""
    h, w, c = image.shape
    rows = image.reshape(h, w * c).astype(np.int64)
    out = bytearray()
    for i, kind in enumerate(filters):
        x = rows[i]
        up = rows[i - 1] if i else np.zeros_like(x)
        left = np.concatenate([np.zeros(c, np.int64), x[:-c]])
        upleft = np.concatenate([np.zeros(c, np.int64), up[:-c]])
        pred = [np.zeros_like(x), left, up, (left + up) // 2, _paeth(left, up, upleft)][kind]
        out += bytes([kind]) + ((x - pred) % 256).astype(np.uint8).tobytes()
    return bytes(out)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def write_png(image: np.ndarray, filters: list[int], *, ancillary: bool = False, split: int = 1) -> bytes:
    """A PNG file's bytes: ``image`` (H, W, 1|3), the given row filters, IDAT in ``split`` chunks."""
    h, w, c = image.shape
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 0 if c == 1 else 2, 0, 0, 0)
    data = zlib.compress(_filtered(image, filters), 6)
    step = -(-len(data) // split)
    idat = b"".join(_chunk(b"IDAT", data[i : i + step]) for i in range(0, len(data), step))
    extra = _chunk(b"gAMA", struct.pack(">I", 45455)) + _chunk(b"tEXt", b"Comment\x00made by a test")
    text_after = _chunk(b"tEXt", b"After\x00the image data")
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + (extra if ancillary else b"") + idat
            + (text_after if ancillary else b"") + _chunk(b"IEND", b""))  # fmt: skip


def pillow_pixels(data: bytes, channels: int) -> np.ndarray | None:
    """What ``Image.open`` decodes (``None`` where it refuses the file)."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            if im.mode != ("L" if channels == 1 else "RGB"):
                return None
            return np.asarray(im).reshape(im.size[1], im.size[0], channels)
    except Exception:  # noqa: BLE001 - any refusal
        return None


def _decode(tmp_path, datas: list[bytes], channels: int, size: int) -> list[np.ndarray | None]:
    raws = []
    for i, data in enumerate(datas):
        path = tmp_path / f"{i}.png"
        path.write_bytes(data)
        raws.append(png_scanlines(str(path), channels, size))
    plain = [r for r in raws if r is not None]
    pixels = iter(unfilter(plain, channels, size)) if plain else iter(())
    return [None if r is None else next(pixels) for r in raws]


IMAGES = st.tuples(st.sampled_from([1, 3]), st.integers(1, 9), st.integers(0, 2**32 - 1), st.booleans())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.lists(IMAGES, min_size=1, max_size=6), size=st.sampled_from([5, 28]), data=st.data())
def test_batches_of_plain_pngs_decode_to_pillows_pixels(tmp_path, spec, size, data):
    """Every filter in every row (first rows included), IDAT split into chunks, ancillary chunks before
    and after the image data: the batch decode equals ``Image.open`` file by file."""
    for channels in (1, 3):
        images, files = [], []
        for c, split, seed, ancillary in spec:
            if c != channels:
                continue
            rng = np.random.default_rng(seed)
            image = rng.integers(0, 256, (size, size, channels), dtype=np.uint8)
            if seed % 2:  # smooth content too, where the predictors are near the pixels
                image = np.cumsum(image // 64, axis=1, dtype=np.uint8)
            filters = data.draw(st.lists(st.integers(0, 4), min_size=size, max_size=size))
            images.append(image)
            files.append(write_png(image, filters, ancillary=ancillary, split=split))
        for image, file, got in zip(images, files, _decode(tmp_path, files, channels, size), strict=True):
            assert got is not None
            np.testing.assert_array_equal(got, image)
            np.testing.assert_array_equal(got, pillow_pixels(file, channels))


def test_pillow_written_files_decode_to_the_same_pixels(tmp_path):
    """Pillow's encoder (its own filter choice, compression levels, text, dpi and transparency chunks)."""
    rng = np.random.default_rng(0)
    files, expected = [], []
    for i in range(12):
        channels = 1 if i % 2 else 3
        image = rng.integers(0, 256, (28, 28, channels), dtype=np.uint8)
        info = PngImagePlugin.PngInfo()
        info.add_text("k", "v")
        buf = io.BytesIO()
        kwargs = {"compress_level": i % 10, "pnginfo": info, "dpi": (72, 72)}
        if i % 3 == 0:
            kwargs["transparency"] = 7 if channels == 1 else (1, 2, 3)
        Image.fromarray(image[..., 0] if channels == 1 else image).save(buf, "PNG", **kwargs)
        files.append(buf.getvalue())
        expected.append(image)
    for channels in (1, 3):
        mine = [(f, e) for f, e in zip(files, expected, strict=True) if e.shape[-1] == channels]
        got = _decode(tmp_path, [f for f, _ in mine], channels, 28)
        for (_, image), pixels in zip(mine, got, strict=True):
            np.testing.assert_array_equal(pixels, image)


@pytest.mark.parametrize(
    "what",
    [
        "other size",
        "other channels",
        "16-bit",
        "palette",
        "interlaced",
        "not a png",
        "empty",
        "critical chunk",
        "split image data",
    ],
)
def test_files_it_does_not_handle_are_left_to_pillow(tmp_path, what):
    image = np.arange(28 * 28, dtype=np.uint8).reshape(28, 28, 1)
    data = write_png(image, [1] * 28)
    if what == "other size":
        data = write_png(np.zeros((27, 28, 1), np.uint8), [0] * 27)
    elif what == "other channels":
        data = write_png(np.zeros((28, 28, 3), np.uint8), [0] * 28)
    elif what == "not a png":
        data = b"GIF89a" + bytes(100)
    elif what == "empty":
        data = b""
    elif what == "split image data":  # IDAT, tEXt, IDAT: not one run of IDAT chunks (Pillow refuses it)
        data = write_png(image, [1] * 28, split=2)
        end = data.index(b"IDAT") + 8 + struct.unpack_from(">I", data, data.index(b"IDAT") - 4)[0]
        data = data[:end] + _chunk(b"tEXt", b"a\x00b") + data[end:]
        assert pillow_pixels(data, 1) is None
    else:
        buf = io.BytesIO()
        img = Image.fromarray(image[..., 0])
        if what == "16-bit":
            img = Image.fromarray(image[..., 0].astype(np.uint16) * 257)
        elif what == "palette":
            img = img.convert("P")
        img.save(buf, "PNG")
        data = buf.getvalue()
        if what == "critical chunk":  # an unknown critical chunk before IEND
            data = data[:-12] + _chunk(b"ABCD", b"x") + data[-12:]
        if what == "interlaced":  # Adam7 declared in IHDR (Pillow writes no interlaced PNG)
            ihdr = struct.pack(">IIBBBBB", 28, 28, 8, 0, 0, 0, 1)
            data = data[:8] + _chunk(b"IHDR", ihdr) + data[33:]
    (tmp_path / "x.png").write_bytes(data)
    assert png_scanlines(str(tmp_path / "x.png"), 1, 28) is None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    channels=st.sampled_from([1, 3]),
    damage=st.sampled_from(["flip", "cut", "append", "swap"]),
    where=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 7),
)
def test_corrupted_files_are_none_or_pillows_pixels(tmp_path, seed, channels, damage, where, bit):
    """A damaged file never decodes to other pixels than Pillow's, and is ``None`` wherever Pillow
    refuses it (so ``repmlp predict`` skips exactly the files ``Image.open`` cannot read)."""
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (12, 12, channels), dtype=np.uint8)
    data = bytearray(write_png(image, list(rng.integers(0, 5, 12)), ancillary=bool(seed % 2), split=2))
    pos = int(where * len(data))
    if damage == "flip":
        data[pos] ^= 1 << bit
    elif damage == "cut":
        data = data[:pos]
    elif damage == "append":
        data += bytes(rng.integers(0, 256, 1 + bit * 7, dtype=np.uint8))
    else:  # two bytes exchanged
        other = int(rng.integers(0, len(data)))
        data[pos], data[other] = data[other], data[pos]
    got = _decode(tmp_path, [bytes(data)], channels, 12)[0]
    if got is not None:
        ref = pillow_pixels(bytes(data), channels)
        assert ref is not None, "decoded a file that Pillow refuses"
        np.testing.assert_array_equal(got, ref)


def test_every_single_bit_flip_is_none_or_pillows_pixels(tmp_path):
    """Each byte of a small file with ancillary chunks before and after the image data, one bit flipped
    (a CRC checked by Pillow, the zlib stream, a chunk length, IHDR, ...): Pillow's pixels or ``None``."""
    image = np.random.default_rng(1).integers(0, 256, (6, 6, 1), dtype=np.uint8)
    clean = write_png(image, [0, 1, 2, 3, 4, 4], ancillary=True, split=2)
    damaged = []
    for pos in range(len(clean)):
        data = bytearray(clean)
        data[pos] ^= 1 << (pos % 8)
        damaged.append(bytes(data))
    decoded = _decode(tmp_path, damaged, 1, 6)
    assert sum(d is None for d in decoded) > len(clean) // 2  # most flips are caught (CRC, zlib, IHDR)
    for data, got in zip(damaged, decoded, strict=True):
        if got is not None:
            ref = pillow_pixels(data, 1)
            assert ref is not None, "decoded a file that Pillow refuses"
            np.testing.assert_array_equal(got, ref)
