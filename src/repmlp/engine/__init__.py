"""The one training loop of every task (classification, face recognition, segmentation); it knows no task.

A task hands :func:`train_loop` its module (prepared by :func:`prepare_module`), an optimizer, its loader,
:class:`LoopOptions` and :class:`LoopHooks`: the step (forward and loss of one batch, plus statistics to sum
up), an optional end-of-epoch callback (classification evaluates there and returns its metrics row) and the
learning rate of every parameter group as a pure function of the step (so the "scheduler state" is the
step). A run counts epochs (classification) or iterations (face, segmentation). The engine runs the
processes (torchrun/DDP, only rank 0 writes), turns BatchNorms into ``SyncBatchNorm`` for multi-GPU runs,
runs AMP, writes ``checkpoint.safetensors`` every ``ckpt_every`` steps, after every epoch of an epoch-counted
run and at the end, continues a killed run bitwise with ``resume`` (model, optimizer, gradient scaler,
every process's python/numpy/torch/CUDA RNG states, position in the epoch's data order, the history and
the epoch's sums are restored; options that change the maths must be repeated, ``runtime_keys`` may
change), refuses to overwrite a finished run, shows a progress bar with the task's statistics, writes
``metrics.csv`` and checks that DDP replicas end identical. :func:`write_run_report` writes ``curves.png``
and ``report.md`` for tasks that log a loss (with the task's own report section).

The package's modules: :mod:`.devices` (device, hardware line, AMP, compile choices), :mod:`.processes`
(torchrun/DDP), :mod:`.state` (resumable runs: folder, options, RNG states, hashes), :mod:`.loop` (the
loop) and :mod:`.report` (metrics.csv, curves and report of a loss log). Their public names are
importable from :mod:`repmlp.engine`.

May import :mod:`repmlp.models`, :mod:`repmlp.data`, :mod:`repmlp.nn` and :mod:`repmlp.errors`; never
:mod:`repmlp.deploy` (training knows no deployment) nor anything above.
"""

from repmlp.engine.devices import (
    amp_dtype,
    cpu_name,
    hardware_summary,
    keep_freed_memory,
    resolve_compile,
    resolve_cuda_graphs,
    resolve_device,
)
from repmlp.engine.loop import (
    GraphedModule,
    LoopHooks,
    LoopOptions,
    LoopResult,
    Position,
    graph_module,
    loss_step,
    optimizer_step,
    progress,
    train_loop,
)
from repmlp.engine.processes import (
    DistInfo,
    all_reduce_sum,
    cleanup_distributed,
    prepare_module,
    run_in_processes,
    setup_distributed,
    unwrap,
)
from repmlp.engine.report import LOSS_FIELDS, write_metrics_csv, write_run_report
from repmlp.engine.state import (
    METRICS_FILE,
    REPORT_FILE,
    STATE_FILE,
    broadcast_buffers,
    check_output,
    check_resumable,
    gather_object,
    option_flag,
    replica_hashes,
    rng_state,
    set_rng_state,
    state_hash,
)

__all__ = [
    "GraphedModule",
    "DistInfo",
    "LOSS_FIELDS",
    "LoopHooks",
    "LoopOptions",
    "LoopResult",
    "METRICS_FILE",
    "Position",
    "REPORT_FILE",
    "graph_module",
    "STATE_FILE",
    "all_reduce_sum",
    "amp_dtype",
    "broadcast_buffers",
    "check_output",
    "check_resumable",
    "cleanup_distributed",
    "cpu_name",
    "gather_object",
    "hardware_summary",
    "keep_freed_memory",
    "resolve_compile",
    "resolve_cuda_graphs",
    "loss_step",
    "optimizer_step",
    "option_flag",
    "prepare_module",
    "progress",
    "replica_hashes",
    "resolve_device",
    "rng_state",
    "run_in_processes",
    "set_rng_state",
    "setup_distributed",
    "state_hash",
    "train_loop",
    "unwrap",
    "write_metrics_csv",
    "write_run_report",
]
