"""Checkpoints: safetensors round trips, atomic writes, clear errors for every kind of bad file."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import repmlp
from repmlp.errors import UserError
from repmlp.io.model_file import CheckpointError, atomic_write_bytes, load_model, read_metadata, save_model
from repmlp.io.state import load_state, save_state

TINY = {"num_classes": 10, "in_chans": 1, "img_size": 28, "widths": [4, 4, 4]}


def _tiny(deploy: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = repmlp.create_model("repmlp_fmnist", deploy=deploy, **TINY)
    # Non-trivial BN statistics, so a converted model differs from a fresh one.
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    return model.eval()


def test_model_round_trip_both_forms(tmp_path):
    model = _tiny()
    save_model(
        tmp_path / "m.safetensors",
        model,
        name="repmlp_fmnist",
        model_kwargs=TINY,
        form="train",
        extra={"dataset": "x"},
    )
    loaded = load_model(tmp_path / "m.safetensors")
    meta = loaded.metadata
    assert meta.form == "train" and meta.name == "repmlp_fmnist"
    assert meta.extra == {"dataset": "x", "input_size": [1, 28, 28]}  # a model built for one size: recorded
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
        deployed = repmlp.reparameterize_model(model)
        save_model(
            tmp_path / "d.safetensors", deployed, name="repmlp_fmnist", model_kwargs=TINY, form="deploy"
        )
        dep = load_model(tmp_path / "d.safetensors", form="deploy")
        assert dep.metadata.form == "deploy"
        torch.testing.assert_close(dep(x), model(x), rtol=1e-4, atol=1e-5)
    assert read_metadata(tmp_path / "d.safetensors")["format"] == "repmlp"


def test_a_loaded_model_carries_its_files_metadata(tmp_path):
    """``load_model`` (also ``repmlp.load_model`` and ``repmlp.io.load_model``) returns the model with
    ``metadata``: what the file records, completed from the model where the file says nothing."""
    import repmlp.io

    assert repmlp.load_model is load_model and repmlp.io.load_model is load_model
    assert repmlp.save_model is save_model and repmlp.io.save_model is save_model
    assert repmlp.ModelMetadata is repmlp.io.ModelMetadata
    classes = [f"c{i}" for i in range(10)]
    extra = {"dataset": "fashion-mnist", "classes": classes, "task": "cls"}
    path = tmp_path / "m.safetensors"
    save_model(path, _tiny(), name="repmlp_fmnist", model_kwargs=TINY, form="train", extra=extra)
    meta = load_model(path).metadata
    assert isinstance(meta, repmlp.ModelMetadata)
    assert (meta.name, meta.form, meta.precision, meta.path) == ("repmlp_fmnist", "train", "fp32", str(path))
    assert (meta.num_classes, meta.input_size, meta.classes) == (10, (1, 28, 28), classes)
    assert meta.model_kwargs == TINY and meta.extra == {**extra, "input_size": [1, 28, 28]}
    # Not recorded: the data set's (Fashion-MNIST's one-channel normalisation, the image resized to 28x28).
    pre = dict(crop_pct=1.0, crop_mode="squash", interpolation="bilinear", mean=[0.286], std=[0.353])
    want = {"dataset": "fashion-mnist", "input_size": [1, 28, 28], "eval_preprocessing": pre}
    assert meta.preprocessing == want
    assert meta.input_size_at(None) == (1, 28, 28) and meta.input_size_at(32) == (1, 32, 32)
    # Nothing given: the class count and input size are the model's; save_model records its timm config's
    # preprocessing (the file says what it wants).
    bare = {k: v for k, v in TINY.items() if k not in ("num_classes", "img_size")}
    save_model(path, _tiny(deploy=True), name="repmlp_fmnist", model_kwargs=bare, form="deploy")
    meta = load_model(path, form="deploy").metadata
    assert (meta.form, meta.num_classes, meta.input_size, meta.classes) == ("deploy", 10, (1, 28, 28), None)
    own = {**pre, "crop_mode": "center"}  # repmlp_fmnist's timm config: crop_pct 1, Fashion-MNIST's mean, std
    assert meta.extra == {"eval_preprocessing": own, "input_size": [1, 28, 28]}
    assert meta.preprocessing["eval_preprocessing"] == own
    # A face or segmentation model loads like any other (prediction, not loading, wants a classifier).
    save_model(path, _tiny(), name="repmlp_fmnist", model_kwargs=TINY, form="train", extra={"task": "face"})
    assert load_model(path).metadata.extra["task"] == "face"


def test_wrong_form_and_other_model_are_clear_errors(tmp_path):
    path = tmp_path / "m.safetensors"
    save_model(path, _tiny(), name="repmlp_fmnist", model_kwargs=TINY, form="train")
    with pytest.raises(CheckpointError, match="'train' form.*expected the 'deploy'"):
        load_model(path, form="deploy")
    # Weights of another architecture under this name (save_model refuses to write them): load names it.
    other = repmlp.create_model("repmlp_fmnist", **{**TINY, "widths": [4, 8, 8]})
    with pytest.raises(CheckpointError, match="does not fit repmlp_fmnist.*with other shapes"):
        save_model(path, other, name="repmlp_fmnist", model_kwargs=TINY, form="train")
    for model, meta in ((other, {}), (_tiny(), {"model": "no_such_model_xyz", "model_kwargs": "{}"})):
        rewrite(path, model.state_dict(), **meta)
        with pytest.raises(CheckpointError, match="does not fit repmlp_fmnist.*with other shapes|"
                           "field 'model' names no model .*no_such_model_xyz"):  # fmt: skip
            load_model(path)


def rewrite(path, tensors, **meta) -> None:
    """``path`` (a model file) with ``tensors`` and metadata fields changed: a file ``save_model`` refuses to
    write, as an edited or damaged one would be."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={**read_metadata(path), **meta})


def test_save_model_refuses_what_load_model_would(tmp_path):
    """Metadata that does not describe the weights, NaN weights, an own network: refused when saved, one line,
    nothing written."""
    path, model = tmp_path / "m.safetensors", _tiny()
    nan = _tiny()
    with torch.no_grad():
        nan.head.weight[0, 0] = float("nan")
    cases = [
        (model, {**TINY, "num_classes": 3}, {}, "does not fit repmlp_fmnist .* with other shapes"),
        (model, {**TINY, "depth": 2}, {}, "model_kwargs.depth' is not an option of repmlp_fmnist"),
        (model, TINY, {"classes": ["a", "b"]}, "extra.classes' names 2 classes, but the model has 10"),
        (
            model,
            TINY,
            {"input_size": [3, 28, 28]},
            "extra.input_size' says 3 channels, but repmlp_fmnist takes 1",
        ),
        (nan, TINY, {}, "tensor 'head.weight' holds 1 NaN or infinite value"),
    ]
    for net, kwargs, extra, message in cases:
        with pytest.raises(CheckpointError, match=message) as err:
            save_model(path, net, name="repmlp_fmnist", model_kwargs=kwargs, form="train", extra=extra)
        assert "\n" not in str(err.value) and "save_model" in str(err.value) and not path.exists()


def test_save_model_of_an_own_network_says_what_to_do_instead(tmp_path):
    """A network the user built is no model load_model can rebuild: refused when saved, saying to save its
    state dict (docs/using.md says so too)."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 4))
    with pytest.raises(CheckpointError, match=r"'Mine' is not a model .*torch\.save\(model\.state_dict\(\)"):
        save_model(tmp_path / "m.safetensors", net, name="Mine", model_kwargs={}, form="train")
    assert not (tmp_path / "m.safetensors").exists()
    assert "save_model refuses it" in (Path(__file__).parents[2] / "docs" / "using.md").read_text()


@pytest.mark.parametrize("damage", ["missing", "empty", "text", "truncated", "bad_header", "state_file"])
def test_bad_files_raise_checkpoint_error(tmp_path, damage):
    path = tmp_path / "m.safetensors"
    save_model(path, _tiny(), name="repmlp_fmnist", model_kwargs=TINY, form="train")
    data = path.read_bytes()
    if damage == "missing":
        path = tmp_path / "nope.safetensors"
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "text":
        path.write_text("hello, I am not a checkpoint\n" * 10)
    elif damage == "truncated":
        path.write_bytes(data[: len(data) - 100])
    elif damage == "bad_header":
        path.write_bytes(data[:9] + b"x" + data[10:])  # invalid JSON header
    else:
        save_state(path, {"a": torch.zeros(2)})
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    assert isinstance(err.value, UserError) and isinstance(err.value, ValueError)


def test_state_round_trip(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    random.seed(3)
    np.random.seed(4)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "history": [{"epoch": 1, "loss": 0.5, "inf": float("inf")}],
        "none": None,
    }
    save_state(tmp_path / "s.safetensors", state)
    back = load_state(tmp_path / "s.safetensors")
    # The optimizer state is keyed by int parameter ids and holds 0-d "step" tensors.
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt2.load_state_dict(back["optimizer"])
    assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    for k, v in opt.state_dict()["state"][0].items():
        torch.testing.assert_close(opt2.state_dict()["state"][0][k], v)
    random.setstate(back["python"])
    a = random.random()
    random.setstate(state["python"])
    assert a == random.random()
    np.random.set_state(back["numpy"])
    b = np.random.rand()
    np.random.set_state(state["numpy"])
    assert b == np.random.rand()
    assert torch.equal(back["torch"], state["torch"])
    assert back["history"] == state["history"] and back["none"] is None
    with pytest.raises(CheckpointError, match="not a repmlp training state"):
        save_model(tmp_path / "m.safetensors", _tiny(), name="repmlp_fmnist", model_kwargs=TINY, form="train")
        load_state(tmp_path / "m.safetensors")


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    atomic_write_bytes(path, b"old")

    def boom(fd):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "fsync", boom)
    # A user's error (a full disk, a folder in the way): one line naming the user's path, not the temp file.
    with pytest.raises(UserError, match=f"cannot write {re.escape(str(path))}: disk on fire"):
        atomic_write_bytes(path, b"new" * 1000)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]  # no temp file left behind


def test_atomic_write_gives_files_the_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "f.bin", b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "f.bin").stat().st_mode & 0o777 == 0o644


def test_recorded_normalisation_is_bounded_where_the_file_is_read():
    """A std of 1e-300 would turn every pixel into inf (every image "skipped"): the file is blamed."""
    from repmlp.io.model_file import check_field

    check_field("f", "extra.eval_preprocessing", {"mean": [0.5], "std": [0.25]})  # a real one passes
    for key, value in (("std", [1e-300]), ("std", [0.0]), ("std", [1e300]), ("mean", [-1e300])):
        with pytest.raises(CheckpointError, match=f"eval_preprocessing.{key}' must be 1 to 4 numbers in"):
            check_field("f", "extra.eval_preprocessing", {key: value})
