"""Putting a converted model to use: :mod:`.precision` (fp32, bf16, fp16, int8), :mod:`.export` (ONNX,
TorchScript, ``torch.export``, each checked against PyTorch), :mod:`.runtimes` (ONNX Runtime, OpenVINO),
:mod:`.gpu` (the fast inference paths on a GPU), :mod:`.conversion` (convert, reload and compare in full
float32) and :mod:`.predict` (:class:`~repmlp.deploy.predict.Predictor`, what ``repmlp predict`` runs).

Never imports :mod:`repmlp.engine`: a deployed model needs no training loop, and training no deployment.
"""
