"""Speed passes: faster versions of the models' modules, applied to a model explicitly, outside the paper's modules.

The models compute one way (:mod:`repmlp.nn`, :mod:`repmlp.models`). The passes here change, in place and
reversibly, the class of the modules they have a faster version of: :func:`fast_training` (applied by the
engine at a run's start unless ``--no-fast-training``), :func:`fast_inference` (applied for prediction,
evaluation and benchmarks), :func:`onnx_form` (applied by the ONNX export) and :func:`plain` (back to the
plain modules). Each pass says what it changes: which modules' hooks stop firing, and where bits may differ
from the plain model.

May import :mod:`repmlp.models`, :mod:`repmlp.nn` and :mod:`repmlp.errors`.
"""

from repmlp.speed.passes import fast_inference, fast_training, onnx_form, plain

__all__ = ["fast_training", "fast_inference", "onnx_form", "plain"]
