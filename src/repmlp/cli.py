"""The ``repmlp`` command line: ``repmlp <command> [options]`` (``python -m repmlp`` is the same program).

Each command is a module under :mod:`repmlp.commands` with ``add_arguments(parser)`` and ``run(args) -> int``;
this module builds the parser and runs the command asked for. A :class:`repmlp.errors.UserError` raised
anywhere becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import threading

from repmlp._version import __version__
from repmlp.commands._parser import ArgumentParser, HelpFormatter
from repmlp.errors import RunFinished, UserError

RESULTS = "repmlp.results"  # the logger of what a command reports as its result (stdout), see _setup_logging

# The commands in --help order: name -> (its module under repmlp.commands, its help line). The help lines are
# here, not in the modules, so that `repmlp --help` and `repmlp --version` import no command module (their
# tasks, data pipelines and report writers: start-up time; `import repmlp` costs torch and timm already).
# A run, or a command's --help, imports the one command it runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "train a model (default: the 5-minute Fashion-MNIST job)"),
    "eval": ("eval", "top-1/top-5 accuracy of a checkpoint"),
    "predict": ("predict", "classify your own images with a model file"),
    "convert": ("convert", "convert a training-time checkpoint into the deployed (inference) form, verified"),
    "import": (
        "import_",
        "import a released RepMLP-Res50 / RepMLPNet checkpoint (.pth) as a repmlp model file",
    ),
    "export": (
        "export",
        "export a checkpoint's deployed model to ONNX / TorchScript / .pt2, checked against PyTorch",
    ),
    "bench": (
        "bench",
        "throughput, params and FLOPs of training-time vs deployed models, as a Markdown table",
    ),
    "viz": ("viz", "plot the paper's FC3 weight figure (before / after merging the Local Perceptron)"),
    "tables": ("tables", "print the paper's model tables (params, FLOPs), or with --speed its speed tables"),
    "study": ("study", "reproduce the paper's studies (ablation: Table 1)"),
    "selfcheck": ("selfcheck", "build a RepMLP block, convert it, print the error and speed-up"),
    "launch": ("launch", "run a command in several processes or on several machines (torchrun)"),
}

log = logging.getLogger("repmlp")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser: the global options and a sub-parser per command, with the options of ``command`` (of every
    command when ``None``); the others' modules are not imported (start-up time, see :data:`COMMANDS`)."""
    parser = ArgumentParser(prog="repmlp", description="RepMLP: train, evaluate, convert, export, benchmark and "
                            "visualise RepMLP models.")  # fmt: skip
    parser.add_argument("--version", action="version", version=f"repmlp {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="<command>", parser_class=ArgumentParser
    )
    for name, (module_name, help) in COMMANDS.items():
        if command is not None and name != command:
            sub.add_parser(name, help=help)
            continue
        module = importlib.import_module(f"repmlp.commands.{module_name}")
        # train and eval print the help of the --task given: their own -h.
        p = sub.add_parser(name, help=help, description=module.__doc__, formatter_class=HelpFormatter,
                           add_help=not getattr(module, "OWN_HELP", False))  # fmt: skip
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


def _setup_logging(verbose: bool, quiet: bool) -> tuple[list[logging.Handler], int, bool]:
    """Route repmlp's log records to stderr, except the results (``repmlp.results``: final metrics, conversion
    check, run folder), which go to stdout as a command's output does (``repmlp train > out.txt`` keeps them);
    returns the previous set-up for :func:`_restore_logging`."""
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    handlers = [logging.StreamHandler(sys.stderr), logging.StreamHandler(sys.stdout)]
    handlers[0].addFilter(lambda record: not record.name.startswith(RESULTS))
    handlers[1].addFilter(lambda record: record.name.startswith(RESULTS))
    for handler in handlers:
        handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("repmlp")
    previous = (list(root.handlers), root.level, root.propagate)
    root.handlers[:] = handlers
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
    # SIGTERM (``kill``, a batch system's time limit) stops any command as Ctrl-C does, at any point (the imports
    # take seconds); a handler is set from the main thread only (main() may run in another program's thread).
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt as exc:
        # A training run's (repmlp.engine.loop.RunInterrupted) says where its checkpoint is. Exit 128 + the
        # signal's number, the shell's convention: 130 for Ctrl-C, 143 for SIGTERM.
        signum = int(getattr(exc, "signum", signal.SIGINT))
        message = str(exc).strip() or f"interrupted by {signal.Signals(signum).name}"
        if not getattr(exc, "quiet", False):
            print(f"repmlp: {message}", file=sys.stderr)
        return 128 + signum
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _interrupt(signum: int, frame: object) -> None:
    """The SIGTERM handler of a command: a ``KeyboardInterrupt`` that carries the signal's number."""
    raise type("Interrupted", (KeyboardInterrupt,), {"signum": signum})()


def _main(argv: list[str]) -> int:
    # The command is the first word that is no option (the global options take no value).
    parser = build_parser(next((a for a in argv if not a.startswith("-")), ""))
    try:
        args, extra = parser.parse_known_args(argv)
        # Only commands that hand options on to another parser (train/eval --task face|seg) take extras.
        if extra and not getattr(args, "accepts_extra", lambda a: False)(args):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    args.argv, args.extra, args.commands = argv, extra, tuple(COMMANDS)  # launch checks the command it runs
    previous_logging = _setup_logging(args.verbose, args.quiet)
    from repmlp.engine import keep_freed_memory  # here: its command's module has imported torch already

    keep_freed_memory()  # every command is an application: no large buffer faulted in again (docs/benchmarks.md)
    try:
        return int(args.func(args) or 0)
    except RunFinished as exc:  # nothing left to do: a success (said once: by process 0 under torchrun)
        if str(exc):
            print(f"repmlp: {exc}")
        return 0
    except UserError as exc:
        log.debug("user error", exc_info=True)
        print(f"repmlp: error: {_one_line(exc)}", file=sys.stderr)
        return 2
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
        return 2
    finally:
        _restore_logging(previous_logging)


if __name__ == "__main__":
    sys.exit(main())
