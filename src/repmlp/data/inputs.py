"""Reading what a user hands the program: regular files only, each folder once, bounded reads and decodes.

A user's file may be a FIFO that blocks a reader forever, ``/dev/zero``, a socket, a folder whose symlinks
loop, gigabytes, an image whose header claims 40000x40000 pixels. The readers build on these functions;
problems are :class:`InputError` with a one-line reason.
"""

from __future__ import annotations

import fnmatch
import glob
import io
import os
import re
import stat
import warnings
from collections.abc import Iterator, Sequence

from PIL import Image

from repmlp.errors import UserError

__all__ = ["InputError", "MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "not_regular", "read_file", "read_bytes", "read_text",
           "walk_files", "expand_glob", "open_image"]  # fmt: skip

MAX_IMAGE_BYTES = 256 << 20  # an image file larger than this is not decoded
MAX_IMAGE_PIXELS = 89_478_485  # Pillow's own decompression-bomb limit (0.25 GB of RGB pixels)


class InputError(UserError, ValueError):
    """A file that cannot be read as what it should be (special file, too large, not decodable)."""


_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)


def _kind(mode: int) -> str | None:
    return next((name for test, name in _KINDS if test(mode)), None if stat.S_ISREG(mode) else "not a file")


def not_regular(path: str | os.PathLike) -> str | None:
    """``None`` for a regular file (symlinks followed), else what ``path`` is (``"a FIFO (named pipe)"``,
    ``"a folder"``, ``"missing"``, ...), from ``stat`` alone."""
    try:
        return _kind(os.stat(path).st_mode)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:  # a symlink loop (ELOOP), a name too long, no permission on a parent
        return f"unreadable ({exc.strerror or exc})"


def _size_text(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"


def read_file(path: str | os.PathLike, limit: int) -> bytes:
    """:func:`read_bytes` with the reason alone in its :class:`InputError` (callers name the file); without a
    Python file object, whose set-up costs more than reading a small file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise InputError(str(exc.strerror or exc)) from None
    try:
        info = os.fstat(fd)
        if (kind := _kind(info.st_mode)) is not None:
            raise InputError(f"{kind}, not a regular file")
        if info.st_size > limit:
            raise InputError(f"{_size_text(info.st_size)}, more than the {_size_text(limit)} limit")
        parts, total = [], 0
        while total <= limit and (chunk := os.read(fd, min(limit + 1 - total, info.st_size + (1 << 16)))):
            parts.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise InputError(str(exc.strerror or exc)) from None
    finally:
        os.close(fd)
    if total > limit:  # the file grew after fstat
        raise InputError(f"more than the {_size_text(limit)} limit")
    return b"".join(parts)


def read_bytes(path: str | os.PathLike, limit: int, what: str = "file") -> bytes:
    """The regular file ``path``'s contents, at most ``limit`` bytes, else :class:`InputError` naming ``what``
    and the file; opened ``O_NONBLOCK`` (a FIFO does not block) and checked with ``fstat`` once open."""
    try:
        return read_file(path, limit)
    except InputError as exc:
        raise InputError(f"cannot read {what} {path}: {exc}") from None


def read_text(path: str | os.PathLike, limit: int, what: str = "file") -> str:
    """:func:`read_bytes` decoded as UTF-8 (a BOM is dropped); undecodable text is an :class:`InputError`."""
    try:
        return read_bytes(path, limit, what).decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} {path} is not UTF-8 text (byte {exc.start})") from None


def _identity(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def walk_files(root: str | os.PathLike,
               suffixes: Sequence[str] | None = None) -> tuple[list[str], list[tuple[str, str]]]:  # fmt: skip
    """``(files, skipped)``: the regular files under ``root`` with a suffix in ``suffixes`` (``None``: all),
    recursively, sorted, each real folder once (symlink loops end), hidden entries left out; ``skipped``:
    ``(path, reason)`` of special files and of folders that cannot be listed."""
    wanted = None if suffixes is None else {s.lower() for s in suffixes}
    files: list[str] = []
    skipped: list[tuple[str, str]] = []
    seen: set[tuple[int, int]] = set()
    pending = [str(root)]
    while pending:
        folder = pending.pop()
        ident = _identity(folder)
        if ident is None or ident in seen:
            continue
        seen.add(ident)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            skipped.append((folder, f"cannot list the folder ({exc.strerror or exc})"))
            continue
        for entry in entries:
            if entry.name.startswith("."):
                continue
            kind = not_regular(entry.path)
            if kind == "a folder":
                pending.append(entry.path)
            elif wanted is not None and os.path.splitext(entry.name)[1].lower() not in wanted:
                continue
            elif kind is None:
                files.append(entry.path)
            else:
                skipped.append((entry.path, f"{kind}, not a regular file"))
    return sorted(files), skipped


def _components(pattern: str) -> tuple[str, list[str]]:
    """The pattern's fixed leading folder and its remaining components."""
    parts = pattern.split(os.sep)
    fixed: list[str] = []
    while parts and not glob.has_magic(parts[0]):
        fixed.append(parts.pop(0))
    if not parts:  # no magic at all: the path itself
        return pattern, []
    base = os.sep.join(fixed) if fixed else ""
    return (base if base or not pattern.startswith(os.sep) else os.sep), parts


def expand_glob(pattern: str) -> list[str]:
    """A glob pattern's matches, sorted, as ``glob.glob(pattern, recursive=True)`` gives them, but ``**``
    follows each real folder once (a symlink loop ends); hidden names match only a ``.`` component."""
    base, parts = _components(pattern)
    if not parts:
        return [pattern] if os.path.lexists(pattern) else []
    found: dict[str, None] = {}
    visited: set[tuple[tuple[int, int], int]] = set()

    def entries(folder: str) -> list[os.DirEntry]:
        try:
            return sorted(os.scandir(folder or "."), key=lambda e: e.name)
        except OSError:
            return []

    def join(folder: str, name: str) -> str:
        return os.path.join(folder, name) if folder else name

    def walk(folder: str, i: int) -> Iterator[str]:
        if i == len(parts):
            yield folder
            return
        part = parts[i]
        if part == "**":
            ident = _identity(folder or ".")
            if ident is None or (ident, i) in visited:
                return
            visited.add((ident, i))
            yield from walk(folder, i + 1)  # zero folders
            for entry in entries(folder):
                if not entry.name.startswith(".") and not_regular(entry.path) == "a folder":
                    yield from walk(join(folder, entry.name), i)
            return
        if not glob.has_magic(part):
            path = join(folder, part)
            if os.path.lexists(path) and (i + 1 == len(parts) or os.path.isdir(path)):
                yield from walk(path, i + 1)
            return
        for entry in entries(folder):
            if entry.name.startswith(".") and not part.startswith("."):
                continue
            if fnmatch.fnmatchcase(entry.name, part) and (i + 1 == len(parts) or os.path.isdir(entry.path)):
                yield from walk(join(folder, entry.name), i + 1)

    for path in walk(base, 0):
        if path:
            found[path] = None
    return sorted(found)


def open_image(path: str | os.PathLike, *, max_bytes: int = MAX_IMAGE_BYTES,
               max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:  # fmt: skip
    """The decoded Pillow image of a regular file (a GIF's first frame); an :class:`InputError` with the
    reason alone for a special file, one over ``max_bytes``, an image over ``max_pixels`` (from the header)
    or one Pillow cannot decode. The caller names the file and closes the image."""
    data = read_file(path, max_bytes)
    if not data:  # Pillow would say "cannot identify image file": the reason is simpler
        raise InputError("the file is empty")
    try:
        with warnings.catch_warnings():
            # Pillow warns (and at twice its limit raises) for large images; the bound here is checked first.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            width, height = img.size
            if width * height > max_pixels:
                img.close()
                raise InputError(
                    f"the image claims {width}x{height} pixels, more than the {max_pixels}-pixel limit "
                    "(a decompression bomb?)"
                )
            img.load()
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - every decoder error means the same thing: not a usable image
        text = str(exc).strip().splitlines()
        # Pillow names the in-memory buffer it read ("<_io.BytesIO object at 0x...>"): name the file instead.
        name = os.fspath(path)
        message = re.sub(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>", lambda _: name, text[0]) if text else ""
        raise InputError(f"{type(exc).__name__}: {message}" if message else type(exc).__name__) from None
    return img
