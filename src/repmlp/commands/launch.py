"""Run a repmlp command in several processes or on several machines: ``repmlp launch [torchrun's options]
<command> [its options]`` is ``torchrun [torchrun's options] -m repmlp <command> ...``, with the exit a
scheduler reads. Stopped by a signal (a preemption), it exits with 128 + the signal's number, as each
process does after its checkpoint (torchrun: 1 and a traceback); a rendezvous that times out (a node that
never joins) is one line naming the endpoint and the nodes it waited for.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from typing import NoReturn

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from repmlp.engine.loop import RunInterrupted
from repmlp.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("torchrun_options", nargs="*", metavar="OPTION",
                   help="torchrun's options (--nnodes, --nproc-per-node, --rdzv-backend c10d, --rdzv-endpoint, "
                   "--rdzv-id, --max-restarts, ...), then the repmlp command and its options")  # fmt: skip
    p.set_defaults(accepts_extra=lambda a: True)


def torchrun_args(argv: list[str]) -> argparse.Namespace:
    """torchrun's parsed options for ``argv`` (what follows ``launch``), running ``python -m repmlp`` with
    the command torchrun's parser took for the script and its options."""
    parser = torchrun.get_args_parser()
    parser.error = _refuse  # one line, as repmlp's own options
    options = parser.parse_args(argv)
    options.training_script_args = [options.training_script, *options.training_script_args]
    options.training_script, options.module = "repmlp", True
    return options


def _refuse(message: str) -> NoReturn:
    raise UserError(f"launch: {message} (repmlp launch [torchrun's options] <command> [its options])")


def run(args: argparse.Namespace) -> int:
    options = torchrun_args(args.argv[args.argv.index("launch") + 1 :])
    try:
        torchrun.run(options)
    except SignalException as exc:  # each process has said where its checkpoint is
        name = signal.Signals(exc.sigval).name
        raise RunInterrupted(f"launch stopped by {name}; the processes stopped with it", exc.sigval) from None
    except RendezvousTimeoutError:
        timeout = re.search(r"join_timeout=(\d+)", str(options.rdzv_conf))  # torchrun's default: 600 s
        raise UserError(
            f"the rendezvous at {torchrun.get_rdzv_endpoint(options)} timed out after "
            f"{timeout[1] if timeout else 600} s before all {options.nnodes} nodes joined: start "
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
