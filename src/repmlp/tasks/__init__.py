"""The paper's tasks, each a peer over :mod:`repmlp.engine`, dispatched by ``repmlp train/eval --task``.

- :mod:`repmlp.tasks.classification`: image classification (paper Sec. 4.1-4.2), ``--task cls``; the end of
  its run (conversion check, benchmark, export, report) in :mod:`repmlp.tasks.classification_report`.
- :mod:`repmlp.tasks.face`: face recognition (paper Sec. 4.3), ``--task face``.
- :mod:`repmlp.tasks.segmentation`: semantic segmentation (paper Sec. 4.4), ``--task seg``.

Every task takes typed configs (dataclasses the commands build from the parsed options) and exposes
``evaluate(config) -> int`` (``repmlp eval``) and its training entry: ``train(FaceTrainConfig |
SegTrainConfig) -> int``, classification's ``run_training(TrainConfig)``. The face and segmentation
options are defined in :mod:`repmlp.commands.task_options`.
The study (:mod:`repmlp.tasks.study`) trains classification runs; each task's report is its own module.
The tasks' losses (:mod:`.losses`), metrics (:mod:`.metrics`), recipes (:mod:`.recipes`) and fine-tuning
from a model file (:mod:`.finetune`) live here too.

May import every room but :mod:`repmlp.commands` and the CLI.
"""

# The ``--task`` name -> the module under ``repmlp.tasks`` (short names on the command line, full ones in code).
TASK_MODULES = {"cls": "classification", "face": "face", "seg": "segmentation"}
