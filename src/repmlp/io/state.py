"""Training states: nested dicts, lists, tuples, numbers, texts, tensors and arrays (a run's model, optimizer,
RNG states, data position) in one safetensors file, written atomically and read without unpickling: the
tensors in its body, the rest a JSON tree in its metadata."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from safetensors.torch import save as st_save
from torch import Tensor

from repmlp.io.model_file import STATE_FORMAT, CheckpointError, atomic_write_bytes, cpu_tensors, read_tensors

__all__ = ["save_state", "load_state"]


def _encode(obj: Any, tensors: dict[str, Tensor], prefix: str) -> Any:
    """JSON tree for ``obj``; tensors and arrays are moved into ``tensors`` and referenced by key."""
    if isinstance(obj, (Tensor, np.ndarray)):
        key = f"t{len(tensors)}:{prefix}"
        tensors[key] = obj if isinstance(obj, Tensor) else torch.from_numpy(np.ascontiguousarray(obj))
        return {"__tensor__" if isinstance(obj, Tensor) else "__ndarray__": key}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, float) and not np.isfinite(obj):
        return {"__float__": repr(obj)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (tuple, list)):
        items = [_encode(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, f"{prefix}.{k}") for k, v in obj.items()}
        # Other keys (optimizer state is keyed by parameter index) keep their type.
        return {"__items__": [[_encode(k, tensors, prefix), _encode(v, tensors, f"{prefix}.{k}")]
                              for k, v in obj.items()]}  # fmt: skip
    raise TypeError(f"cannot store {type(obj).__name__} at {prefix or '<root>'} in a training state")


def _decode(obj: Any, tensors: dict[str, Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return tensors[obj["__ndarray__"]].numpy()
    if "__float__" in obj:
        return float(obj["__float__"])
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def save_state(path: str | os.PathLike, state: Mapping[str, Any]) -> None:
    """Save a nested training state (see the module docstring) to one safetensors file, atomically."""
    tensors: dict[str, Tensor] = {}
    tree = _encode(dict(state), tensors, "")
    metadata = {"format": STATE_FORMAT, "state": json.dumps(tree, allow_nan=False)}
    atomic_write_bytes(path, st_save(cpu_tensors(tensors), metadata=metadata))


def load_state(path: str | os.PathLike) -> dict[str, Any]:
    """Inverse of :func:`save_state` (tensors on the CPU); a :class:`CheckpointError` for any other file."""
    tensors, meta = read_tensors(path)
    if meta.get("format") != STATE_FORMAT or "state" not in meta:
        raise CheckpointError(
            f"{path} is not a repmlp training state (metadata format={meta.get('format')!r})"
        )
    try:
        state = _decode(json.loads(meta["state"]), tensors)
    except RecursionError:  # JSON nested deeper than Python recurses: no state repmlp writes
        raise CheckpointError(f"{path} has a malformed training state (nested too deep)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} has a malformed training state ({exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} has a malformed training state (root is not a mapping)")
    return state
