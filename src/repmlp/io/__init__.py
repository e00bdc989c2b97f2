"""Files: model files (:mod:`.model_file`: ``save_model`` / ``load_model``, the metadata checked before
anything is built, atomic writes), training states (:mod:`.state`) and the authors' released weights
(:mod:`.importer`).

May import :mod:`repmlp.models` (a model file names the model to build), :mod:`repmlp.data`,
:mod:`repmlp.nn` and :mod:`repmlp.errors`; the models never import files.
"""

from repmlp.io.model_file import CheckpointError, ModelMetadata, load_model, save_model
from repmlp.io.state import load_state, save_state

__all__ = ["save_model", "load_model", "ModelMetadata", "CheckpointError", "save_state", "load_state"]
