"""The paper's tasks, each a peer over :mod:`repmlp.engine`, dispatched by ``repmlp train/eval --task``.

- :mod:`repmlp.tasks.classification`: image classification (paper Sec. 4.1-4.2), ``--task cls``; the end of
  its run (conversion check, benchmark, export, report) in :mod:`repmlp.tasks.classification_report`.
- :mod:`repmlp.tasks.face`: face recognition (paper Sec. 4.3), ``--task face``.
- :mod:`repmlp.tasks.segmentation`: semantic segmentation (paper Sec. 4.4), ``--task seg``.

Face and segmentation expose ``add_train_arguments(parser)``, ``add_eval_arguments(parser)``,
``train(args) -> int`` and ``evaluate(args) -> int``; classification's options are ``repmlp train``'s own.
"""

TASKS = ("face", "seg")

# The ``--task`` name -> the module under ``repmlp.tasks`` (short names on the command line, full ones in code).
TASK_MODULES = {"cls": "classification", "face": "face", "seg": "segmentation"}
