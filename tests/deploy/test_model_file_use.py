"""Model files and models put to use (``repmlp eval``, ``predict``, ``export``, :class:`repmlp.Predictor`): a
fixed-size model's file on an image folder, sizes bounded together, a normalisation that does not fit the
model's channels, the caller's module left as it was, devices this machine lacks, a bf16 file's export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import repmlp
from repmlp.errors import UserError
from repmlp.io.model_file import CheckpointError, load_model, read_metadata, save_model
from repmlp_testdata import make_image_folder, run_cli, user_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

NAME, KWARGS = "repmlp_cifar", {"widths": [4, 8, 16], "num_classes": 3}  # built for 32x32, no img_size given


@pytest.fixture(scope="module")
def cifar(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """A tiny ``repmlp_cifar`` and its ``save_model`` file (options without ``img_size``)."""
    torch.manual_seed(0)
    model = repmlp.create_model(NAME, **KWARGS).eval()
    path = tmp_path_factory.mktemp("cifar") / "model.safetensors"
    save_model(path, model, name=NAME, model_kwargs=KWARGS, form="train")
    return model, path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("images"), classes=3, per_class=2, size=40)


def test_eval_of_a_fixed_size_models_file_on_an_image_folder(cifar, folder, tmp_path):
    """The file records the input size the model is built for: eval reads the folder's images at 32x32; a file
    saved before files recorded it (no ``input_size``) is read at the size its model is built for."""
    model, path = cifar
    assert json.loads(read_metadata(path)["extra"])["input_size"] == [3, 32, 32]
    meta = read_metadata(path)
    old = tmp_path / "old.safetensors"
    extra = {k: v for k, v in json.loads(meta["extra"]).items() if k != "input_size"}
    save_file(model.state_dict(), str(old), metadata={**meta, "extra": json.dumps(extra)})
    for file in (path, old):
        res = run_cli("eval", "--checkpoint", file, "--dataset", "imagefolder", "--data-dir", folder, "--json",
                      "--workers", 0)  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["n"] == 6


def test_input_size_and_crop_are_bounded_together(tmp_path):
    """Each within its bounds, together a resize to 81920 pixels a side (27 GB for one small image): refused
    when saved, and when a file that holds them (edited) is loaded."""
    model = repmlp.create_model("test_efficientnet", num_classes=2).eval()  # takes any input size
    save = dict(name="test_efficientnet", model_kwargs={"num_classes": 2}, form="train")
    path = tmp_path / "m.safetensors"
    both = {"input_size": [3, 4096, 4096], "eval_preprocessing": {"crop_pct": 0.05}}
    message = "crop_pct' 0.05 of a 4096x4096 input resizes every image to 81920 pixels a side, more than"
    with pytest.raises(CheckpointError, match=message):
        save_model(path, model, extra=both, **save)
    save_model(path, model, extra=both, check=False, **save)  # as an edited file would hold them
    image = tmp_path / "a.png"
    Image.new("RGB", (40, 30)).save(image)
    res = run_cli("predict", "--checkpoint", path, image)
    assert res.returncode == 2 and message in user_error_line(res.stderr)
    for extra in ({**both, "input_size": [3, 32, 32]}, {**both, "eval_preprocessing": {"crop_pct": 0.875}}):
        save_model(path, model, extra=extra, **save)  # either alone is fine


def test_a_normalisation_that_does_not_fit_the_channels_is_refused(cifar, folder, tmp_path):
    """A mean or std of 2 or 4 values for a 3-channel model: one line where the preprocessing is read (save,
    eval, predict), not values cut or repeated."""
    model, _ = cifar
    image = next(folder.glob("val/*/*.png"))
    for key, values in (("mean", [0.5, 0.5]), ("std", [0.25] * 4)):
        extra = {"eval_preprocessing": {"mean": [0.5], "std": [0.25], key: values}}
        path = tmp_path / f"{key}.safetensors"
        message = f"eval_preprocessing.{key}' holds {len(values)} values for a 3-channel model"
        with pytest.raises(CheckpointError, match=message):
            save_model(path, model, name=NAME, model_kwargs=KWARGS, form="train", extra=extra)
        save_model(path, model, name=NAME, model_kwargs=KWARGS, form="train", extra=extra, check=False)
        for argv in (["predict", image], ["eval", "--dataset", "imagefolder", "--data-dir", folder]):
            res = run_cli(argv[0], "--checkpoint", path, *argv[1:])
            assert res.returncode == 2 and message in user_error_line(res.stderr), argv
    for values in ([0.5], [0.5, 0.4, 0.3]):  # one value for every channel, or one per channel
        extra = {"eval_preprocessing": {"mean": values, "std": values}}
        save_model(
            tmp_path / "ok.safetensors", model, name=NAME, model_kwargs=KWARGS, form="train", extra=extra
        )


def test_predictor_leaves_the_callers_module_as_it_was():
    """Predictor works on its own copy: the caller's module keeps its mode, dtype, layout and attributes; a
    float64 model gets its batch in float64."""
    torch.manual_seed(0)
    model = repmlp.create_model(NAME, **KWARGS).double().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    predictor = repmlp.Predictor(model, top_k=2)
    x = torch.randn(2, 3, 32, 32)
    got = predictor.predict(x)
    assert model.training and not hasattr(model, "metadata")
    assert all(p.dtype == torch.float64 and p.is_contiguous() for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        want = torch.softmax(model.eval()(x.double()), 1).topk(2)
    assert [[p.index for p in top] for top in got] == want.indices.tolist()
    torch.testing.assert_close([p.probability for p in got[0]], want.values[0].tolist())


def test_a_device_this_machine_lacks_is_one_clear_error(cifar):
    model, path = cifar
    with pytest.raises(UserError, match="^device: unknown device 'nosuch' "):
        load_model(path, device="nosuch")
    missing = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    for source in (path, model):
        with pytest.raises(UserError, match=f"^device {missing}: (CUDA is not available|this machine has)"):
            repmlp.Predictor(source, device=missing)


def test_export_of_a_bf16_file_is_named_for_its_float32_weights(cifar, tmp_path):
    """ONNX Runtime's CPU provider runs no bf16 graph: the export holds float32 weights, and its default name
    and the command's line say so."""
    onnx = pytest.importorskip("onnx")
    model, _ = cifar
    src = tmp_path / "deploy-bf16.safetensors"
    reduced = repmlp.to_precision(repmlp.reparameterize_model(model), "bf16")
    save_model(src, reduced, name=NAME, model_kwargs=KWARGS, form="deploy", precision="bf16")
    res = run_cli("export", "--checkpoint", src, "--no-check")
    assert res.returncode == 0, res.stderr
    out = tmp_path / "deploy-bf16-as-fp32.onnx"
    assert f"wrote {out} " in res.stdout and "float32 weights of the bf16 file's values" in res.stdout
    assert not (tmp_path / "deploy-bf16.onnx").exists()
    types = {w.data_type for w in onnx.load(str(out)).graph.initializer}
    assert onnx.TensorProto.FLOAT in types and onnx.TensorProto.BFLOAT16 not in types
