"""Training and evaluation pipelines of the paper's other tasks, dispatched by ``repmlp train/eval --task``.

- :mod:`repmlp.tasks.face`: face recognition (paper Sec. 4.3).
- :mod:`repmlp.tasks.seg`: semantic segmentation (paper Sec. 4.4).

Each module exposes ``add_train_arguments(parser)``, ``add_eval_arguments(parser)``, ``train(args) -> int``
and ``evaluate(args) -> int``. Image classification lives in :mod:`repmlp.train`.
"""

TASKS = ("face", "seg")
