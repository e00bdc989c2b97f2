"""One fault injected into repmlp's training loop, in every Python process started with this folder first on
``PYTHONPATH`` (torchrun's agent, the processes it starts, ``python -m repmlp``): the tests' simulated crashes,
kills and divergences, so that the package holds no option for them.

With ``FAULT_STEP`` set, after that step (``_Loop.after_step``, its checkpoint written) on rank ``FAULT_RANK``
(default: every rank), ``FAULT_SIGNAL`` happens: ``EXIT`` (the default) a crash without cleanup, exit
status 3; ``NAN`` the next step's loss becomes NaN; a signal's name (``SIGKILL``, ``SIGTERM``) that signal
to this process, to its parent (torchrun's agent) as well with ``FAULT_AGENT``, or to the DataLoader's
worker processes instead with ``FAULT_WORKERS``. With ``FAULT_ONCE``, a marker file ``FAULT_ONCE.<rank>``
keeps the fault to the first run (a restarted or rerun command then trains on).
"""

import os

_rank = os.environ.get("RANK", "0")
_once = os.environ["FAULT_ONCE"] + "." + _rank if os.environ.get("FAULT_ONCE") else None
if (
    os.environ.get("FAULT_STEP")
    and os.environ.get("FAULT_RANK", _rank) == _rank
    and not (_once and os.path.exists(_once))
):
    import dataclasses
    import logging
    import signal

    from repmlp.engine import loop

    _after_step, _name = loop._Loop.after_step, os.environ.get("FAULT_SIGNAL", "EXIT")

    def _nan_loss(step):
        def stepped(*args):
            loss, stats = step(*args)
            return loss * float("nan"), stats

        return stepped

    def _faulty_after_step(self, lr):
        _after_step(self, lr)
        if self.pos.step != int(os.environ["FAULT_STEP"]):
            return
        if _once:
            open(_once, "w").close()
        if _name == "EXIT":
            self.bar.close()
            logging.shutdown()
            os._exit(3)
        if _name == "NAN":
            self.hooks = dataclasses.replace(self.hooks, step=_nan_loss(self.hooks.step))
            return
        signum = signal.Signals[_name]
        if os.environ.get("FAULT_AGENT"):
            os.kill(os.getppid(), signum)
        if os.environ.get("FAULT_WORKERS"):
            for pid in open(f"/proc/self/task/{os.getpid()}/children").read().split():
                os.kill(int(pid), signum)
        else:
            os.kill(os.getpid(), signum)

    loop._Loop.after_step = _faulty_after_step
