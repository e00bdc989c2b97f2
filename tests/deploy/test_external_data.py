"""Files a writer puts beside its output (ONNX external data, for graphs over 2 GB) replace nothing of the
user's without ``--force``: ``staged()`` refuses an existing one before it moves anything."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import repmlp
from repmlp.errors import UserError
from repmlp.io.model_file import save_model, staged
from repmlp_testdata import run_cli, user_error_line

pytestmark = pytest.mark.usefixtures("one_thread")


def write_with_data(tmp: Path, data: bytes) -> None:
    """A writer of ``tmp`` and, beside it, its external data (as an ONNX exporter writes a large graph)."""
    tmp.write_bytes(b"graph")
    tmp.with_name(tmp.name + ".data").write_bytes(data)


def test_staged_moves_an_extra_file_over_an_existing_one_only_with_force(tmp_path):
    out, data = tmp_path / "m.onnx", tmp_path / "m.onnx.data"
    data.write_bytes(b"mine")
    with pytest.raises(UserError, match=r"m\.onnx\.data, a file written with it, exists already"):
        with staged(out) as tmp:
            write_with_data(tmp, b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx.data"] and data.read_bytes() == b"mine"
    with staged(out, force=True) as tmp:
        write_with_data(tmp, b"new")
    assert (out.read_bytes(), data.read_bytes()) == (b"graph", b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]  # no staging folder left


def test_export_keeps_the_users_file_named_as_its_external_data_without_force(tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    kwargs = {"widths": [4, 8], "kernel_sizes": [3]}
    model = tmp_path / "m.safetensors"
    save_model(model, repmlp.create_model("repmlp_fmnist", **kwargs).eval(), name="repmlp_fmnist",
               model_kwargs=kwargs, form="train", extra={"dataset": "fashion-mnist"})  # fmt: skip
    save = torch.onnx.ONNXProgram.save

    def save_with_data(self, destination, **kw):  # a graph over 2 GB: its weights go to a file beside it
        save(self, destination, **kw)
        Path(str(destination) + ".data").write_bytes(b"new")

    monkeypatch.setattr(torch.onnx.ONNXProgram, "save", save_with_data)
    data = tmp_path / "m.onnx.data"
    data.write_bytes(b"mine")
    refused = run_cli("export", "--checkpoint", model)
    assert refused.returncode == 2, refused.stderr
    assert f"{data}, a file written with it, exists already: add --force" in user_error_line(refused.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx.data", "m.safetensors"]
    assert data.read_bytes() == b"mine"
    forced = run_cli("export", "--checkpoint", model, "--force")
    assert forced.returncode == 0, forced.stderr
    assert data.read_bytes() == b"new" and (tmp_path / "m.onnx").stat().st_size > 0
