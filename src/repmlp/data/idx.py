"""IDX files (the MNIST / Fashion-MNIST format), plain or gzip-compressed, read with numpy only.

A damaged file is one line naming it: a gzip stream that is corrupt or cut short, a header whose
dimensions the data does not hold (or that claims more than :data:`MAX_BYTES`), data left over after
them. Compressed files are inflated no further than the header allows, so a small file that inflates to
gigabytes (a decompression bomb) is refused after reading what the header promised.
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
# The largest data an IDX file may hold (Fashion-MNIST's training images: 47 MB).
MAX_BYTES = 4 << 30


def _open(path: Path):  # noqa: ANN202 - a binary file object
    kind = not_regular(path)
    if kind is not None:
        raise InputError(f"cannot read {path}: it is {kind}, not a regular file")
    raw = open(path, "rb")  # noqa: SIM115 - returned to the caller, closed there
    return gzip.GzipFile(fileobj=raw, mode="rb") if path.suffix == ".gz" else raw


def _read_exactly(f, n: int, path: Path, what: str) -> bytes:  # noqa: ANN001 - a binary file object
    data = f.read(n)
    if len(data) != n:
        raise UserError(f"{path} is truncated or malformed ({len(data)} {what} bytes, the header says {n})")
    return data


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (``.gz`` or not) into an array of shape ``dims`` from its header.

    Raises :class:`UserError` for a file that is not IDX, is truncated or corrupt, or is too large.
    """
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
            if need > MAX_BYTES:
                shape = "x".join(map(str, dims))
                raise UserError(
                    f"{path}: its header claims a {shape} array ({need} bytes), more than the limit"
                )
            data = _read_exactly(f, need, path, "data")
            if f.read(1):
                raise UserError(f"{path} is malformed (data beyond the {need} bytes its header gives)")
    except (OSError, EOFError, zlib.error) as exc:
        # gzip.BadGzipFile is an OSError; a corrupt deflate stream is a zlib.error; a cut one EOFError.
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise UserError(f"cannot read {path}: {reason} (corrupt or truncated?)") from None
    return np.frombuffer(data, dtype).reshape(dims).astype(dtype.newbyteorder("="))
