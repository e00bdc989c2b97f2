"""The one training loop of every task (:func:`train_loop`; it knows no task) and what it runs on:
:mod:`.devices` (device, hardware line, AMP, compile choices), :mod:`.processes` (torchrun/DDP, replica
hashes), :mod:`.state` (resumable runs), :mod:`.loop` (the loop, CUDA graphs of a step) and :mod:`.report`
(metrics.csv, a loss log's curves and report). Never imports :mod:`repmlp.deploy`.
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
    progress,
    train_loop,
)
from repmlp.engine.processes import (
    DistInfo,
    all_reduce_sum,
    broadcast_buffers,
    cleanup_distributed,
    prepare_module,
    restart_count,
    run_in_processes,
    setup_distributed,
    state_hash,
    unwrap,
)
from repmlp.engine.report import write_run_report
from repmlp.engine.state import METRICS_FILE, STATE_FILE, check_output, check_resumable, option_flag

__all__ = ["amp_dtype", "cpu_name", "hardware_summary", "keep_freed_memory", "resolve_compile",
           "resolve_cuda_graphs", "resolve_device", "GraphedModule", "LoopHooks", "LoopOptions", "LoopResult",
           "Position", "graph_module", "progress", "train_loop", "DistInfo", "all_reduce_sum",
           "broadcast_buffers", "cleanup_distributed", "prepare_module", "restart_count", "run_in_processes",
           "setup_distributed",
           "state_hash", "unwrap", "write_run_report", "METRICS_FILE", "STATE_FILE", "check_output",
           "check_resumable", "option_flag"]  # fmt: skip
