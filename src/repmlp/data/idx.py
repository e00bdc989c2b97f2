"""IDX files (the MNIST / Fashion-MNIST format), plain or gzip-compressed, read with numpy only."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

from ..errors import UserError

__all__ = ["read_idx"]

# IDX type codes (third magic byte) -> big-endian numpy dtypes.
_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (``.gz`` or not) into an array of shape ``dims`` from its header.

    Raises :class:`UserError` for a file that is not IDX or is truncated.
    """
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise UserError(f"{path} is not an IDX file (bad magic number)")
    ndim = raw[3]
    head = 4 + 4 * ndim
    if ndim == 0 or len(raw) < head:
        raise UserError(f"{path} is not an IDX file (bad header)")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    dtype = np.dtype(_DTYPES[raw[2]])
    need = int(np.prod(dims)) * dtype.itemsize
    if len(raw) - head != need:
        raise UserError(
            f"{path} is truncated or malformed ({len(raw) - head} data bytes, header says {need})"
        )
    return np.frombuffer(raw, dtype, offset=head).reshape(dims).astype(dtype.newbyteorder("="))
