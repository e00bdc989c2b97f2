"""A newcomer's own images, start to finish (issue #42): an image folder -> train or fine-tune -> eval ->
convert (fp32, bf16, int8) -> export -> predict, for a one-channel and a three-channel model.

Tiny models on generated PNG folders (a few images a class), through the real entry point: in this
process (:func:`run_cli`) except one ``predict`` in a real ``python -m repmlp`` process. Each step checks
what the issue found broken: the model's own input size and channels on a folder (not the ``imagenet``
preset's 224x224 RGB), the ``--init`` file's recipe with a batch fitted to the folder, every command
reading the folder as ``eval`` does (int8 calibration and the conversion check on the run's own images),
and the deployed file's refusal naming the file to convert.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import repmlp
from repmlp.data import model_data_config
from repmlp.io.model_file import save_model
from repmlp.tasks.classification import resolve_config
from repmlp_testdata import make_image_folder, run_cli, subprocess_env, user_error_line

# Whole workflows, several trainings each, and a predict process (the suite's slow tier).
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

TINY = ["--model-arg", "widths=[4,8]", "--model-arg", "kernel_sizes=[3]"]
QUICK = ["--epochs", "1", "--no-bench", "--no-export", "--workers", "0"]


def grey_folder(root: Path, classes: int = 3, per_class: int = 6, size: int = 28) -> Path:
    """``root/{train,val}/<class>/*.png``: greyscale (mode ``L``) PNGs, like Fashion-MNIST saved as files."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", per_class), ("val", per_class // 2)):
        for c in range(classes):
            folder = root / split / f"c{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                arr = rng.integers(0, 60, (size, size), dtype=np.uint8)
                arr[4 * c + 2 : 4 * c + 6] = 240  # a band per class
                Image.fromarray(arr, "L").save(folder / f"{i}.png")
    return root


def main_job_file(path: Path) -> Path:
    """Like the main job's model.safetensors: repmlp_fmnist_patch2 (small widths), 1x28x28, Fashion-MNIST."""
    kwargs = {"widths": [4, 8], "img_size": 28, "in_chans": 1, "num_classes": 10}
    torch.manual_seed(0)
    model = repmlp.create_model("repmlp_fmnist_patch2", **kwargs).eval()
    extra = {"dataset": "fashion-mnist", "data_dir": None, "input_size": [1, 28, 28],
             "classes": [f"f{i}" for i in range(10)]}  # fmt: skip
    save_model(path, model, name="repmlp_fmnist_patch2", model_kwargs=kwargs, form="train", extra=extra)
    return path


def params(name: str, **kwargs) -> str:
    """The parameter count of the training log line ("(0.01M params)") of ``name`` built with ``kwargs``."""
    return f"{sum(p.numel() for p in repmlp.create_model(name, **kwargs).parameters()) / 1e6:.2f}M params"


def ok(*args: object):
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    return res


def convert_eval_export_predict(run: Path, folder: Path, channels: int) -> None:
    """The rest of the workflow for the run's ``model.safetensors``: every command reads the run's own
    folder in the model's channels (the conversion check and int8 calibration too)."""
    model = run / "model.safetensors"
    n_val = len(list((folder / "val").glob("*/*.png")))
    scored = json.loads(ok("eval", "--checkpoint", model, "--json", "--workers", 0).stdout)
    assert (scored["dataset"], scored["n"]) == ("imagefolder", n_val)
    # Item 2: the check runs on the run's own validation images (recorded, or named), not random inputs.
    for extra in ([], ["--dataset", "imagefolder", "--data-dir", folder]):
        res = ok("convert", "--checkpoint", model, *extra, "--force")  # over the run's deploy.safetensors
        assert "imagefolder validation images" in res.stdout and "random" not in res.stdout + res.stderr
    # Item 1: int8 calibrates on the folder's images read in the model's channels (was an onnxruntime crash).
    for precision in ("bf16", "int8"):
        out = run / f"deploy-{precision}.safetensors"
        res = ok("convert", "--checkpoint", model, "--precision", precision, "--output", out)
        assert f"{precision}: max abs logit change" in res.stdout and "imagefolder validation" in res.stdout
    # Item 7: a deployed file names the training-time file to convert instead.
    res = run_cli("convert", "--checkpoint", run / "deploy.safetensors", "--precision", "int8")
    line = user_error_line(res.stderr)
    assert res.returncode == 2 and f"--checkpoint {model}" in line, line
    ok("export", "--checkpoint", run / "deploy.safetensors", "--output", run / "deploy.onnx")
    assert (run / "deploy.onnx").stat().st_size > 0
    # predict (on the int8 file) sees the pixels eval sees: the same top-1.
    int8 = run / "deploy-int8.safetensors"
    int8_top1 = json.loads(ok("eval", "--checkpoint", int8, "--json", "--workers", 0).stdout)["top1"]
    argv = ["predict", "--checkpoint", int8, folder / "val", "--json", "--top-k", 1, "--workers", 0]
    # the real program once: python -m repmlp
    res = subprocess.run([sys.executable, "-m", "repmlp", *map(str, argv)], capture_output=True, text=True,
                         timeout=300, env=subprocess_env())  # fmt: skip
    assert res.returncode == 0, res.stderr
    records = json.loads(res.stdout)
    hits = [r["top_k"][0]["label"] == Path(r["path"]).parent.name for r in records]
    assert len(records) == n_val
    assert 100 * np.mean(hits) == pytest.approx(int8_top1)
    assert repmlp.load_model(int8).metadata.input_size[0] == channels


def test_one_channel_model_from_the_main_job_to_predict(tmp_path):
    """The issue's workflow: the main job's 1-channel model fine-tuned on one's own greyscale PNGs."""
    folder = grey_folder(tmp_path / "mine")
    init = main_job_file(tmp_path / "main.safetensors")
    run = tmp_path / "ft"
    res = ok(
        "train", "--dataset", "imagefolder", "--data-dir", folder, "--init", init, *QUICK, "--output", run
    )
    # Item 5: the init file's recipe (fmnist), its input, and a batch that leaves steps in an epoch (18
    # images: 8, not the recipe's 256) with its learning rate, said in one line; the run trained with them.
    line = next(ln for ln in res.stderr.splitlines() if ln.startswith("image folder:"))
    assert "recipe fmnist (repmlp_fmnist_patch2's recipe)" in line and "input 1x28x28" in line, line
    assert "batch 8 (2 steps an epoch on 18 training images), lr 0.0354 (the recipe's 0.2 x sqrt(8/256))" in (
        line
    )
    report = (run / "report.md").read_text()
    assert "Recipe (preset `fmnist`): 1 epochs, batch 8, sgd lr 0.035355 " in report and "mixup 0," in report
    # Options given win over the fitted batch and the init file's recipe (the Python API resolves them too).
    cfg = resolve_config(dataset="imagefolder", data_dir=str(folder), init=str(init), batch_size=4, preset="cifar",
                         output=str(tmp_path / "given"))  # fmt: skip
    assert (cfg.batch_size, cfg.lr, cfg.preset, cfg.epochs, cfg.img_size, cfg.channels) == (
        4,
        0.2,
        "cifar",
        100,
        28,
        1,
    )
    # Item 4: repmlp_fmnist from scratch on the folder builds its own 1x28x28 model, not 224x224 RGB.
    res = ok("train", "--dataset", "imagefolder", "--data-dir", folder, "--model", "repmlp_fmnist", *TINY,
             *QUICK, "--output", tmp_path / "scratch")  # fmt: skip
    own = params("repmlp_fmnist", widths=[4, 8], kernel_sizes=[3], num_classes=3, in_chans=1, img_size=28)
    assert f"training repmlp_fmnist ({own}) on imagefolder" in res.stderr
    assert "recipe fmnist (the recipe for 1x28x28 inputs like repmlp_fmnist's)" in res.stderr
    # Every command reads a folder for a model file as eval does: the main job's model in its one channel,
    # at 28x28, resized (not cropped) as predict does, with Fashion-MNIST's normalisation.
    data = model_data_config(repmlp.load_model(init).metadata, "imagefolder", data_dir=str(folder))
    assert (data.channels, data.img_size, data.eval_preprocessing["crop_mode"]) == (1, 28, "squash")
    assert data.eval_preprocessing["mean"] == pytest.approx([0.2860])
    convert_eval_export_predict(run, folder, channels=1)


def test_three_channel_model_from_scratch_to_predict(tmp_path):
    """RGB images of another size: a small CIFAR model trains at its own 3x32x32 with its own recipe. (The
    rest of the workflow on an RGB folder, every precision: test_every_precision_and_command_reads_an_rgb_file_alike.)
    """
    folder = make_image_folder(tmp_path / "rgb", classes=3, per_class=4, size=36)
    run = tmp_path / "run"
    res = ok("train", "--dataset", "imagefolder", "--data-dir", folder, "--model", "repmlp_cifar",
             "--model-arg", "widths=[4,8,16]", *QUICK, "--output", run)  # fmt: skip
    own = params("repmlp_cifar", widths=[4, 8, 16], num_classes=3, img_size=32)
    assert f"training repmlp_cifar ({own}) on imagefolder" in res.stderr
    assert "recipe cifar (repmlp_cifar's recipe), input 3x32x32 (repmlp_cifar's), batch 8" in res.stderr
    assert repmlp.load_model(run / "model.safetensors").metadata.input_size == (3, 32, 32)


def colour_folder(root: Path, classes: int = 3, per_class: int = 8, size: int = 28) -> Path:
    """``root/{train,val}/<class>/*.png``: RGB images whose class is the one bright channel (noise else)."""
    from PIL import Image

    rng = np.random.default_rng(1)
    for split in ("train", "val"):
        for c in range(classes):
            (root / split / f"c{c}").mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                arr = rng.integers(0, 80, (size, size, 3), dtype=np.uint8)
                arr[..., c] += 170
                Image.fromarray(arr, "RGB").save(root / split / f"c{c}" / f"{i}.png")
    return root


def test_every_precision_and_command_reads_an_rgb_file_alike(tmp_path):
    """An RGB folder run of the main job's model (whose timm config holds Fashion-MNIST's one-channel
    normalisation): every file records the folder's preprocessing, ``eval`` and ``predict`` (CLI and
    Predictor) feed its fp32, bf16 and int8 files the same tensors, and their top-1 agree."""
    from repmlp.data import build_data, eval_preprocessing
    from repmlp.data.folder import scan_image_folder
    from repmlp.data.inputs import open_image

    folder, run = colour_folder(tmp_path / "rgb"), tmp_path / "run"
    ok("train", "--dataset", "imagefolder", "--data-dir", folder, "--model", "repmlp_fmnist_patch2",
       "--model-arg", "in_chans=3", "--model-arg", "widths=[4,8]", *QUICK, "--epochs", 3, "--output", run)  # fmt: skip
    files = {p: run / f"deploy-{p}.safetensors" for p in ("bf16", "int8")}
    for precision, path in files.items():
        ok("convert", "--checkpoint", run / "model.safetensors", "--precision", precision, "--output", path)
    files = {"train": run / "model.safetensors", "fp32": run / "deploy.safetensors", **files}
    default = eval_preprocessing(None, None, 3)  # the folder's (ImageNet's), not the model's config's
    samples, _ = scan_image_folder(folder, "val")
    top1: dict[str, list[int]] = {}
    for precision, path in files.items():
        meta = repmlp.load_model(path).metadata
        assert meta.extra["eval_preprocessing"] == meta.preprocessing["eval_preprocessing"] == default
        # eval's tensors (its loader, in file order) are predict's.
        data = build_data(model_data_config(meta, "imagefolder", workers=0, need_train=False))
        seen = torch.cat([x for x, _ in data.val.batches(0)])
        predictor = repmlp.Predictor(path, top_k=1)
        mine = torch.stack([predictor.preprocess(open_image(p)) for p, _ in samples])
        torch.testing.assert_close(mine, seen, rtol=0, atol=1e-5)
        res = json.loads(ok("predict", "--checkpoint", path, folder / "val", "--json", "--top-k", 1, "--workers",
                            0).stdout)  # fmt: skip
        top1[precision] = [r["top_k"][0]["index"] for r in res]
        assert [p[0].index for p in predictor.predict([p for p, _ in samples])] == top1[precision]
        labels = [label for _, label in samples]
        scored = json.loads(ok("eval", "--checkpoint", path, "--json", "--workers", 0).stdout)["top1"]
        assert 100 * np.mean(np.equal(top1[precision], labels)) == pytest.approx(scored)
    assert top1["train"] == top1["fp32"]  # exact conversion; reduced precisions may flip a near tie
    assert all(np.mean(np.equal(top1[p], top1["fp32"])) >= 0.9 for p in ("bf16", "int8"))


def test_a_folder_without_model_gets_one_that_fits_its_images(tmp_path):
    """No --model: small images train the small `cifar` model at their size (not repmlp_res50 at 224x224),
    large ones the paper's ImageNet model; the log says which, and --model picks another."""
    small = make_image_folder(tmp_path / "small", classes=3, per_class=4, size=40)  # 44x40 images
    res = ok("train", "--dataset", "imagefolder", "--data-dir", small, "--model-arg", "widths=[4,8,16]", *QUICK,
             "--output", tmp_path / "run")  # fmt: skip
    assert (
        "image folder: model repmlp_cifar (for 40x40 images; --model picks another), recipe cifar"
        in res.stderr
    )
    assert "input 3x40x40 (to fit the images)" in res.stderr
    assert repmlp.load_model(tmp_path / "run" / "model.safetensors").metadata.input_size == (3, 40, 40)
    large = make_image_folder(tmp_path / "large", classes=2, per_class=1, size=72)
    cfg = resolve_config(dataset="imagefolder", data_dir=str(large), output=str(tmp_path / "x"))
    assert (cfg.model, cfg.img_size, cfg.preset) == ("repmlp_res50", 224, "imagenet")
    cfg = resolve_config(dataset="imagefolder", data_dir=str(small), model="repmlp_fmnist", output="x")
    assert (cfg.model, cfg.img_size) == ("repmlp_fmnist", 28)  # --model wins
