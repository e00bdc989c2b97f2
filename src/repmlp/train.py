"""Compatibility name: classification training now lives in :mod:`repmlp.tasks.classification`.

Kept so that ``from repmlp.train import run_training, TrainConfig`` (scripts, other tasks) keeps working.
"""

from .tasks.classification import (
    METRIC_FIELDS,
    METRICS_FILE,
    STATE_FILE,
    DistInfo,
    TrainConfig,
    TrainResult,
    build_model,
    config_json,
    evaluate,
    lr_at,
    make_optimizer,
    option_name,
    resumed_config,
    rng_state,
    run_training,
    seed_everything,
    set_rng_state,
    setup_distributed,
    state_hash,
    topk_correct,
    write_metrics_csv,
)

__all__ = [
    "METRIC_FIELDS",
    "METRICS_FILE",
    "STATE_FILE",
    "DistInfo",
    "TrainConfig",
    "TrainResult",
    "build_model",
    "config_json",
    "evaluate",
    "lr_at",
    "make_optimizer",
    "option_name",
    "resumed_config",
    "rng_state",
    "run_training",
    "seed_everything",
    "set_rng_state",
    "setup_distributed",
    "state_hash",
    "topk_correct",
    "write_metrics_csv",
]
