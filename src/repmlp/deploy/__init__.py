"""Putting a converted model to use: precisions, export, runtimes, GPU inference paths, prediction.

- :mod:`.precision`: a deployed model in fp32, bf16, fp16 or int8;
- :mod:`.export`: ONNX, TorchScript and ``torch.export`` files, each checked against PyTorch;
- :mod:`.runtimes`: the model run by ONNX Runtime or OpenVINO;
- :mod:`.gpu`: the fast inference paths on a GPU (CUDA graphs, fused epilogues, ``torch.compile``);
- :mod:`.conversion`: convert, reload and compare in full float32 (``repmlp convert``, every run's end);
- :mod:`.predict`: :class:`~repmlp.deploy.predict.Predictor`, what ``repmlp predict`` runs.

May import :mod:`repmlp.models`, :mod:`repmlp.data`, :mod:`repmlp.nn` and :mod:`repmlp.errors`; never
:mod:`repmlp.engine` (a deployed model needs no training loop, and training no deployment).
"""
