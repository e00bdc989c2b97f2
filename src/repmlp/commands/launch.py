"""Run a repmlp command in several processes or on several machines: ``repmlp launch [torchrun's options]
<command> [its options]`` is ``torchrun [torchrun's options] -m repmlp <command> ...``, with the exit a
scheduler reads. torchrun's options are checked before any process starts: a bad one is one line and exit 2
(torchrun: a traceback). Stopped by a signal (a preemption), it exits with 128 + the signal's number, as each
process does after its checkpoint (torchrun: 1 and a traceback), and leaves the saying to the processes; a
rendezvous that times out (a node that never joins) is one line naming the endpoint and the nodes it waited
for.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import uuid
from typing import NoReturn

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from repmlp.errors import UserError, first_line

USAGE = "repmlp launch [torchrun's options] <command> [its options]"
# The most seconds (and counts) a rendezvous option may say: beyond, torch's timedelta overflows.
_MAX_WAIT = 86_400 * 365


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("torchrun_options", nargs="*", metavar="OPTION",
                   help="torchrun's options (--nnodes, --nproc-per-node, --rdzv-backend c10d, --rdzv-endpoint, "
                   "--rdzv-id, --max-restarts, ...), then the repmlp command and its options")  # fmt: skip
    p.set_defaults(accepts_extra=lambda a: True)


def torchrun_args(argv: list[str], commands: tuple[str, ...] = ()) -> argparse.Namespace:
    """torchrun's parsed options for ``argv`` (what follows ``launch``), running ``python -m repmlp`` with
    the command torchrun's parser took for the script (one of ``commands`` when given) and its options."""
    parser = torchrun.get_args_parser()
    parser.error = _refuse  # one line, as repmlp's own options
    options = parser.parse_args(argv)
    if options.no_python or options.module or options.run_path:
        _refuse(
            "it runs `python -m repmlp <command>` itself: --no-python, --module and --run-path do not apply"
        )
    if commands and options.training_script not in commands:
        _refuse(f"{options.training_script!r} is not a repmlp command ({', '.join(commands)})")
    options.training_script_args = [options.training_script, *options.training_script_args]
    options.training_script, options.module = "repmlp", True
    return options


def _refuse(message: str) -> NoReturn:
    raise UserError(f"launch: {message} ({USAGE})")


def launch_config(options: argparse.Namespace) -> tuple[LaunchConfig, str, list[str]]:
    """What :func:`torch.distributed.run.run` launches for ``options``: its configuration, program and
    arguments, every option checked first. torchrun checks some as it reads them (``config_from_args``), the
    rest only once its agent runs (the rendezvous's, the processes'); here all before any process starts, each
    refusal (torch's ValueError, AssertionError, ...) one :class:`UserError`."""
    try:
        try:
            one_machine = torchrun.parse_min_max_nnodes(options.nnodes)[1] == 1
        except ValueError:  # torch: "invalid literal for int()"
            raise ValueError(f"--nnodes {options.nnodes}: expected N or MIN:MAX nodes") from None
        if options.standalone or (options.rdzv_backend == "static" and not options.rdzv_endpoint
                                  and options.master_port is None and one_machine):  # fmt: skip
            # torchrun.run's own defaults: one machine meets at a c10d rendezvous on a free port
            options.rdzv_backend, options.rdzv_endpoint = "c10d", "localhost:0"
            options.rdzv_id = str(uuid.uuid4())
        options.master_port = 29500 if options.master_port is None else options.master_port
        backends = rendezvous_handler_registry._registry  # torch: "did you forget to call `register`?"
        if options.rdzv_backend not in backends:
            raise ValueError(
                f"--rdzv-backend {options.rdzv_backend!r}: expected one of {', '.join(sorted(backends))}"
            )
        config, program, args = torchrun.config_from_args(options)
        _check_agent(config)
    except (ValueError, TypeError, AssertionError, OverflowError, RuntimeError) as exc:
        _refuse(first_line(exc))
    return config, program, args


def _check_agent(config: LaunchConfig) -> None:
    """Raise for what torchrun's agent would refuse as it starts (torch checks the rendezvous's settings only
    as it opens the rendezvous's store, which binds or reaches its endpoint: not done twice)."""
    if config.nproc_per_node < 1:  # torch: a bare AssertionError
        raise ValueError(f"--nproc-per-node {config.nproc_per_node}: at least 1 process per node")
    if not config.monitor_interval > 0:
        raise ValueError(
            f"--monitor-interval {config.monitor_interval}: expected a positive number of seconds"
        )
    params = RendezvousParameters(config.rdzv_backend, config.rdzv_endpoint, config.run_id or "-",
                                  config.min_nodes, config.max_nodes, config.local_addr,
                                  **config.rdzv_configs)  # fmt: skip
    host, _ = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    for option, name in (("--rdzv-endpoint", host), ("--local-addr", config.local_addr)):
        try:  # torch would retry a name that does not resolve until its timeouts end (minutes)
            if name:
                socket.getaddrinfo(name, None)
        except (OSError, UnicodeError) as exc:
            raise ValueError(f"{option} {name}: the host name does not resolve ({first_line(exc)})") from None
    for key in params.config:  # the timeouts (seconds) and keep-alive settings torch reads as integers
        if key.endswith("timeout") or key.startswith("keep_alive"):
            value = params.get_as_int(key)
            if value is None or not 0 < value <= _MAX_WAIT:
                raise ValueError(
                    f"--rdzv-conf {key}={params.config[key]}: expected an integer in 1..{_MAX_WAIT}"
                )


def run(args: argparse.Namespace) -> int:
    commands = tuple(c for c in args.commands if c != "launch")  # a launch inside a launch: no
    options = torchrun_args(args.argv[args.argv.index("launch") + 1 :], commands)
    config, program, program_args = launch_config(options)
    try:
        elastic_launch(config, program)(*program_args)
    except SignalException as exc:  # each process has said where its checkpoint is: no line of our own
        return 128 + signal.Signals(exc.sigval)
    except RendezvousTimeoutError:
        raise UserError(
            f"the rendezvous at {config.rdzv_endpoint} timed out after "
            f"{config.rdzv_configs.get('join_timeout', 600)} s before all {options.nnodes} nodes joined: start "
            "the same command on every node, with the same --rdzv-endpoint and --rdzv-id (--rdzv-conf "
            "join_timeout=SECONDS sets the wait, default 600)"
        ) from None
    except ChildFailedError as exc:  # each process has said why, in its line above
        return failed_status(exc)
    return 0


def failed_status(exc: ChildFailedError) -> int:
    """The exit status of a launch whose processes failed: the first failure's (a signal's as 128 + N), so
    that a process stopped by SIGTERM makes the launch exit 143; one line lists each process's."""
    codes = {rank: f.exitcode if f.exitcode >= 0 else 128 - f.exitcode for rank, f in exc.failures.items()}
    listed = ", ".join(f"process {rank} exit {code}" for rank, code in sorted(codes.items()))
    print(f"repmlp: launch failed: {listed}", file=sys.stderr)
    root, _ = exc.get_first_failure()
    return codes[root] or 1
