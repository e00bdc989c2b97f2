"""The paper's tasks, each a peer over :mod:`repmlp.engine`, dispatched by ``repmlp train/eval --task``.

- :mod:`repmlp.tasks.classification`: image classification (paper Sec. 4.1-4.2), ``--task cls``; the end of
  its run (conversion check, benchmark, export, report) in :mod:`repmlp.tasks.classification_report`.
- :mod:`repmlp.tasks.face`: face recognition (paper Sec. 4.3), ``--task face``.
- :mod:`repmlp.tasks.segmentation`: semantic segmentation (paper Sec. 4.4), ``--task seg``.

Every task module has the same shape: ``TrainConfig`` and ``EvalConfig`` (dataclasses of one style,
:mod:`repmlp.tasks.config`, checked against the one table of option ranges, :mod:`repmlp.tasks.limits`),
``train(TrainConfig) -> result`` (``result.ok``: the run's checks passed) and ``evaluate(EvalConfig) -> int``.
The study (:mod:`repmlp.tasks.study`) trains classification runs. May import every folder but
:mod:`repmlp.commands` and the CLI.
"""

# The ``--task`` name -> the module under ``repmlp.tasks`` (short names on the command line, full ones in code).
TASK_MODULES = {"cls": "classification", "face": "face", "seg": "segmentation"}
