"""The ``repmlp`` command line: ``repmlp <command> [options]`` (``python -m repmlp`` is the same program).

Each command lives in its own module under :mod:`repmlp.commands` exposing ``add_parser(subparsers)``
(which calls ``set_defaults(func=run)``) and ``run(args) -> int``; this module only collects them. A
:class:`repmlp.errors.UserError` raised anywhere becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys

from repmlp.commands._parser import ArgumentParser
from repmlp.errors import UserError

# Command modules under repmlp.commands, in --help order. Add a command by adding its module name here.
COMMANDS: list[str] = [
    "train",
    "eval",
    "predict",
    "convert",
    "import_",
    "export",
    "bench",
    "viz",
    "tables",
    "study",
    "selfcheck",
]

log = logging.getLogger("repmlp")


def build_parser() -> argparse.ArgumentParser:
    """The full parser: global options plus one sub-parser per module in :data:`COMMANDS`."""
    from repmlp._version import __version__

    parser = ArgumentParser(
        prog="repmlp",
        description="RepMLP: train, evaluate, convert, export, benchmark and visualise RepMLP models.",
    )
    parser.add_argument("--version", action="version", version=f"repmlp {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="<command>", parser_class=ArgumentParser
    )
    for name in COMMANDS:
        importlib.import_module(f".commands.{name}", __package__).add_parser(sub)
    return parser


def _setup_logging(verbose: bool, quiet: bool) -> tuple[list[logging.Handler], int, bool]:
    """Route repmlp's log records to stderr; returns the previous set-up for :func:`_restore_logging`."""
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("repmlp")
    previous = (list(root.handlers), root.level, root.propagate)
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    return previous


def _restore_logging(previous: tuple[list[logging.Handler], int, bool]) -> None:
    # main() may run inside another program (tests, notebooks): leave its logging as it was.
    root = logging.getLogger("repmlp")
    root.handlers[:], root.level, root.propagate = previous


def _one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line (a DataLoader worker wraps errors in a traceback text)."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else type(exc).__name__
    last = lines[-1]
    for prefix in ("repmlp.errors.UserError: ", "repmlp.io.model_file.CheckpointError: ", "UserError: "):
        if last.startswith(prefix):
            return last[len(prefix) :]
    return last


def out_of_memory(exc: BaseException | None) -> BaseException | None:
    """The ``MemoryError`` or ``torch.OutOfMemoryError`` in ``exc``'s chain of causes, else ``None``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        # The CPU allocator's failure is a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory").
        if (
            isinstance(exc, MemoryError)
            or type(exc).__name__ == "OutOfMemoryError"
            or (isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))
        ):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def out_of_memory_message(exc: BaseException, args: argparse.Namespace) -> str:
    """One line for an out-of-memory error of ``args.command``: the batch size it ran and what to try."""
    text = str(exc)
    where = "CUDA" if "CUDA" in text else "MPS" if "MPS" in text else "the device" if text else "the process"
    if not hasattr(args, "batch_size"):  # convert, export, viz: no batch to make smaller
        size = getattr(args, "img_size", None)
        hint = f"a smaller --img-size than {size}" if size else "another --device"
        return f"{where} out of memory in `repmlp {args.command}`; try {hint}"
    batch = getattr(args, "batch_size", None)
    at = f"--batch-size {batch}" if batch else "the default --batch-size"
    smaller = f"--batch-size {max(1, batch // 2)}" if batch and batch > 1 else "a smaller --batch-size"
    line = f"{where} out of memory in `repmlp {args.command}` at {at}; try {smaller}"
    if args.command == "train":
        # The checkpoint files are written atomically: the last one written before the error is whole.
        line += (
            " in a new --output (the run's last checkpoint is intact: --resume continues it with the "
            "same options once memory is free)"
        )
    else:
        line += " or another --device"
    return line


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the process exit status (0 success, 2 user error, 128 + N stopped by
    signal N: 130 Ctrl-C, 143 SIGTERM)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        # Only commands that hand options on to another parser (train/eval --task face|seg) take extras.
        if extra and not getattr(args, "accepts_extra", lambda a: False)(args):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    args.argv, args.extra = argv, extra
    previous_logging = _setup_logging(args.verbose, args.quiet)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        log.debug("user error", exc_info=True)
        print(f"repmlp: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        # A training run stopped by SIGINT/SIGTERM (repmlp.engine.loop.RunInterrupted) says which signal and
        # where its checkpoint is. Exit 128 + the signal's number, the shell's convention: 130 for Ctrl-C,
        # 143 for SIGTERM.
        message = str(exc).strip()
        print(f"repmlp: {message}" if message else "repmlp: interrupted", file=sys.stderr)
        return 128 + int(getattr(exc, "signum", signal.SIGINT))
    except (MemoryError, RuntimeError) as exc:
        # torch.OutOfMemoryError (CUDA, MPS) is a RuntimeError, possibly wrapped by torch.compile; any
        # other RuntimeError is a bug and keeps its traceback.
        oom = out_of_memory(exc)
        if oom is None:
            raise
        log.debug("out of memory", exc_info=True)
        print(f"repmlp: error: {out_of_memory_message(oom, args)}", file=sys.stderr)
        return 2
    except OSError as exc:
        # Disk full, permission denied, ...: the user's environment, not a bug in repmlp.
        where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
        print(f"repmlp: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    finally:
        _restore_logging(previous_logging)


if __name__ == "__main__":
    sys.exit(main())
