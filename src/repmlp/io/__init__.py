"""Files: model files (:mod:`.model_file`), training states (:mod:`.state`), released weights (:mod:`.importer`).
Above the models (a file names the model to build); the models never read files."""

from repmlp.io.model_file import CheckpointError, ModelMetadata, load_model, save_model
from repmlp.io.state import load_state, save_state

__all__ = ["save_model", "load_model", "ModelMetadata", "CheckpointError", "save_state", "load_state"]
