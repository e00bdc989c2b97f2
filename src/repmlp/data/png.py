"""Plain PNGs decoded a batch at a time by Pillow's own PNG decoder (``repmlp predict``: for a 28x28 image
``Image.open`` spends most of its time detecting the format and parsing chunks in Python).

A *plain* PNG (8-bit grey or RGB, not interlaced, the expected size, every CRC right, ending in IEND, a zlib
stream of exactly the image's scanlines, valid row filters): :func:`png_scanlines` reads its scanlines and
:func:`unfilter` decodes a batch of them in one decoder call, the pixels ``Image.open`` gives. Any other file,
or any doubt, gives ``None``: the caller opens it with ``Image.open``.
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Sequence

import numpy as np
from PIL import Image

from repmlp.data.inputs import InputError, read_file

__all__ = ["png_scanlines", "unfilter"]

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_COLOUR_TYPE = {1: 0, 3: 2}  # channels -> PNG colour type (grey, RGB)
_CRITICAL = {1: {b"IHDR", b"IDAT", b"IEND"}, 3: {b"IHDR", b"IDAT", b"IEND", b"PLTE"}}


@functools.cache
def _head(channels: int, size: int) -> bytes:
    """The file's first 29 bytes: signature, IHDR's length and name, its fields (8 bits, not interlaced)."""
    fields = struct.pack(">IIBBBBB", size, size, 8, _COLOUR_TYPE[channels], 0, 0, 0)
    return _SIGNATURE + struct.pack(">I4s", 13, b"IHDR") + fields


_MAX_PLAIN_BYTES = 1 << 20  # a plain PNG of a data set's size is a few kB; a larger file goes the general way


def png_scanlines(path: str, channels: int, size: int) -> bytes | None:
    """The filtered scanlines of a plain ``size x size`` PNG with ``channels`` 8-bit channels, or ``None``:
    ``size`` rows of ``1 + size * channels`` bytes (a filter-type byte, then the row), as inflated."""
    if channels not in _COLOUR_TYPE:
        return None
    try:
        data = read_file(path, _MAX_PLAIN_BYTES)  # a regular file, small
    except InputError:
        return None
    if data[:29] != _head(channels, size):
        return None
    critical = _CRITICAL[channels]
    pos, idat, idat_over, ended = 8, [], False, False
    while pos + 12 <= len(data) and not ended:
        length, kind = struct.unpack_from(">I4s", data, pos)
        end = pos + 12 + length
        if (
            end > len(data)
            or zlib.crc32(data[pos + 4 : end - 4]) != struct.unpack_from(">I", data, end - 4)[0]
        ):
            return None
        if kind == b"IDAT":
            if idat_over:  # the image data must be one run of IDAT chunks
                return None
            idat.append(data[pos + 8 : end - 4])
        elif (kind == b"IHDR" and pos != 8) or (not kind[0] & 0x20 and kind not in critical):
            return None  # a second IHDR, or a critical chunk that this reader does not handle
        else:
            idat_over = bool(idat)
        ended = kind == b"IEND"
        pos = end
    stride = 1 + size * channels
    if not (ended and idat):
        return None
    inflate = zlib.decompressobj()
    try:  # inflated no further than the image needs: a small stream cannot expand to gigabytes here
        raw = inflate.decompress(b"".join(idat), size * stride + 1)
    except zlib.error:
        return None
    if not inflate.eof:  # cut short, or more data than the image holds
        return None
    if len(raw) != size * stride or max(raw[::stride]) > 4:  # 5 row filters: 0 none .. 4 Paeth
        return None
    return raw


def unfilter(scanlines: Sequence[bytes], channels: int, size: int) -> np.ndarray:
    """Scanlines of :func:`png_scanlines` (same ``channels`` and ``size``) -> ``(N, size, size, C)`` uint8.

    One decoder call: the images stacked into one tall image (an uncompressed zlib stream), each preceded by
    an all-zero unfiltered row, so its first row sees a zero row above it as in its own file (the Up, Average
    and Paeth filters read the row above); the separator rows are dropped afterwards.
    """
    n = len(scanlines)
    separator = bytes(1 + size * channels)
    stacked = b"".join(part for raw in scanlines for part in (separator, raw))
    mode = "L" if channels == 1 else "RGB"
    img = Image.frombytes(mode, (size, n * (size + 1)), zlib.compress(stacked, 0), "zip", mode)
    pixels = np.frombuffer(img.tobytes(), dtype=np.uint8).reshape(n, size + 1, size, channels)
    return pixels[:, 1:]
