"""The paper's tasks over :mod:`repmlp.engine`, dispatched by ``repmlp train/eval --task``: classification
(Sec. 4.1-4.2, ``cls``; the end of its run in :mod:`.classification_report`), face recognition (Sec. 4.3,
``face``) and semantic segmentation (Sec. 4.4, ``seg``); the study (:mod:`.study`) trains classification runs.

Every task module has the same shape: ``TrainConfig`` and ``EvalConfig`` (:mod:`.config`, checked against the
option ranges of :mod:`.limits`), ``train(TrainConfig) -> result`` (``result.ok``: the run's checks passed) and
``evaluate(EvalConfig) -> int``. May import every folder but :mod:`repmlp.commands` and the CLI.
"""

# The ``--task`` name -> the module under ``repmlp.tasks`` (short names on the command line, full ones in code).
TASK_MODULES = {"cls": "classification", "face": "face", "seg": "segmentation"}
