"""IDX files (the MNIST / Fashion-MNIST format), plain or gzip-compressed, read with numpy only.

A damaged file is one line naming it. What a small file may make the reader allocate is bounded before
anything is allocated: a plain file's size must be exactly what its header implies (``fstat``); a gzip file
may not claim more than :data:`MAX_RATIO` times its own size (a decompression bomb) and is inflated in
chunks no further than the header allows.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from pathlib import Path

import numpy as np

from repmlp.data.inputs import InputError, not_regular
from repmlp.errors import UserError

__all__ = ["read_idx", "MAX_BYTES"]

# IDX type codes (third magic byte) -> big-endian numpy dtypes.
_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
# The largest data an IDX file may hold (far above Fashion-MNIST's).
MAX_BYTES = 4 << 30
# A gzip file may inflate to at most this many times its size, or to _SMALL bytes (a few blank images
# compress far better than real ones: a small file is allowed any ratio).
MAX_RATIO = 64
_SMALL = 64 << 20
_CHUNK = 16 << 20


def _open(path: Path):  # noqa: ANN202 - a binary file object
    kind = not_regular(path)
    if kind is not None:
        raise InputError(f"cannot read {path}: it is {kind}, not a regular file")
    raw = open(path, "rb")  # noqa: SIM115 - returned to the caller, closed there
    return gzip.GzipFile(fileobj=raw, mode="rb") if path.suffix == ".gz" else raw


def _read_exactly(f, n: int, path: Path, what: str) -> bytearray:  # noqa: ANN001 - a binary file object
    """``n`` bytes of ``f`` in chunks: memory grows with the data there, not with what the header claims."""
    data = bytearray()
    while len(data) < n:
        chunk = f.read(min(_CHUNK, n - len(data)))
        if not chunk:
            raise UserError(
                f"{path} is truncated or malformed ({len(data)} {what} bytes, the header says {n})"
            )
        data += chunk
    return data


def _check_size(path: Path, f, header: int, need: int, shape: str) -> None:  # noqa: ANN001 - file object
    """Refuse a header whose ``need`` data bytes the file cannot hold (a plain file of another size, a gzip
    file that would inflate more than :data:`MAX_RATIO` times), before reading the data."""
    size = os.fstat((f.fileobj if isinstance(f, gzip.GzipFile) else f).fileno()).st_size
    if not isinstance(f, gzip.GzipFile):
        if size != header + need:
            raise UserError(
                f"{path} is truncated or malformed: its header claims a {shape} array ({need} bytes), "
                f"the file holds {size - header} bytes of data"
            )
    elif need > max(_SMALL, MAX_RATIO * size):
        raise UserError(
            f"{path}: its header claims a {shape} array ({need} bytes), more than {MAX_RATIO} times the "
            f"{size}-byte compressed file (a decompression bomb?)"
        )


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """An IDX file (``.gz`` or not) as an array of its header's shape; :class:`UserError` for a file that
    is not IDX, is truncated or corrupt, or too large."""
    path = Path(path)
    try:
        with _open(path) as f:
            magic = f.read(4)
            if len(magic) < 4 or magic[0] != 0 or magic[1] != 0 or magic[2] not in _DTYPES:
                raise UserError(f"{path} is not an IDX file (bad magic number)")
            ndim = magic[3]
            if ndim == 0:
                raise UserError(f"{path} is not an IDX file (bad header: no dimensions)")
            dims = tuple(int(d) for d in np.frombuffer(_read_exactly(f, 4 * ndim, path, "header"), ">u4"))
            dtype = np.dtype(_DTYPES[magic[2]])
            need = math.prod(dims) * dtype.itemsize
            shape = "x".join(map(str, dims))
            if need > MAX_BYTES:
                raise UserError(
                    f"{path}: its header claims a {shape} array ({need} bytes), more than the limit"
                )
            _check_size(path, f, 4 + 4 * ndim, need, shape)
            data = _read_exactly(f, need, path, "data")
            if f.read(1):
                raise UserError(f"{path} is malformed (data beyond the {need} bytes its header gives)")
    except (OSError, EOFError, zlib.error) as exc:
        # gzip.BadGzipFile is an OSError; a corrupt deflate stream is a zlib.error; a cut one EOFError.
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise UserError(f"cannot read {path}: {reason} (corrupt or truncated?)") from None
    # uint8 data is used as read (no copy); wider types become native byte order.
    return np.frombuffer(data, dtype).reshape(dims).astype(dtype.newbyteorder("="), copy=False)
