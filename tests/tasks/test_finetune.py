"""Fine-tuning from a model file: ``repmlp train --init`` (classification, face, segmentation) and timm's
``pretrained=True, pretrained_cfg_overlay=dict(file=...)`` / ``checkpoint_path=``.

Runs are tiny (a 4/8-channel ``repmlp_fmnist`` on image folders of 28x28 crops, a few steps) and go
through ``repmlp.cli.main`` in-process; the kill-and-resume check's crash is an exception raised after a
step (the training loop patched), so that it needs no subprocess.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file

import repmlp
from repmlp import cli
from repmlp.engine import loop
from repmlp.io.model_file import CheckpointError, save_model
from repmlp.io.state import save_state
from repmlp.models import build_model
from repmlp.tasks.finetune import head_prefixes, init_from_file
from repmlp.tasks.recipes import PRESETS
from repmlp_testdata import make_cifar10, make_image_folder, user_error_line

TINY = ["--model-arg", "widths=[4,8]", "--model-arg", "kernel_sizes=[3]"]
RUN = ["--img-size", "28", "--batch-size", "8", "--no-export", "--no-bench", "--workers", "0", "--lr", "0.05"]


def train(capsys, *argv) -> tuple[int, str]:
    status = cli.main(["train", "--dataset", "imagefolder", *map(str, argv)])
    return status, capsys.readouterr().err


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, one_thread) -> dict[str, Path]:
    """A 3-class run (the "other data"), and a 2-class image folder to fine-tune on."""
    root = tmp_path_factory.mktemp("finetune")
    src = make_image_folder(root / "three", classes=3, per_class=8, size=32)
    dst = make_image_folder(root / "two", classes=2, per_class=8, size=32, seed=1)
    status = cli.main(["-q", "train", "--dataset", "imagefolder", "--data-dir", str(src), "--model",
                       "repmlp_fmnist", *TINY, "--model-arg", "in_chans=3", *RUN, "--epochs", "1", "--output",
                       str(root / "a")])  # fmt: skip
    assert status == 0
    return {
        "root": root,
        "dst": dst,
        "model": root / "a" / "model.safetensors",
        "deploy": root / "a" / "deploy.safetensors",
    }


class Killed(BaseException):
    """A simulated crash (after a step, see the kill-and-resume test)."""


def test_init_finetunes_reports_and_resumes_bitwise(pretrained, capsys, monkeypatch, tmp_path):
    """Without --model the file's model and options are used; the 3-class head is re-initialised for 2
    classes; report.md names the file, its sha256 and the re-initialised keys; a killed run resumes to
    the same weights bitwise."""
    init = pretrained["model"]
    args = ["--data-dir", pretrained["dst"], "--init", init, *RUN, "--epochs", "2", "--ckpt-every", "1"]
    status, err = train(capsys, *args, "--output", tmp_path / "full")
    assert status == 0, err
    assert "re-initialised: head.weight, head.bias" in err
    report = (tmp_path / "full" / "report.md").read_text()
    sha = hashlib.sha256(init.read_bytes()).hexdigest()
    assert f"`{init}` (repmlp_fmnist, sha256 `{sha}`)" in report and "`head.weight`, `head.bias`" in report
    model = repmlp.load_model(tmp_path / "full" / "model.safetensors")
    assert model.metadata.model_kwargs["widths"] == [4, 8] and model.metadata.num_classes == 2

    after_step = loop._Loop.after_step

    def crash_after_step_3(self: loop._Loop, lr: float) -> None:
        after_step(self, lr)
        if self.pos.step == 3:
            raise Killed

    monkeypatch.setattr(loop._Loop, "after_step", crash_after_step_3)
    with pytest.raises(Killed):
        train(capsys, *args, "--output", tmp_path / "cut")
    monkeypatch.undo()
    assert not (tmp_path / "cut" / "model.safetensors").exists()
    status, err = train(capsys, *args, "--output", tmp_path / "cut", "--resume")
    assert status == 0 and "resuming" in err
    a, b = (load_file(tmp_path / run / "model.safetensors") for run in ("full", "cut"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert f"sha256 `{sha}`" in (tmp_path / "cut" / "report.md").read_text()


def test_init_loads_every_fitting_weight(pretrained):
    file = load_file(pretrained["model"])
    same = repmlp.create_model("repmlp_fmnist", widths=[4, 8], kernel_sizes=[3], in_chans=3, num_classes=3)
    report = init_from_file(same, pretrained["model"])
    assert report.reinitialised == [] and report.loaded == len(file)  # the head fits: loaded too
    assert all(torch.equal(v, file[k]) for k, v in same.state_dict().items())
    torch.manual_seed(0)
    other = repmlp.create_model("repmlp_fmnist", widths=[4, 8], kernel_sizes=[3], in_chans=3, num_classes=5)
    fresh = {k: v.clone() for k, v in other.state_dict().items()}
    report = init_from_file(other, pretrained["model"])
    assert report.reinitialised == ["head.weight", "head.bias"] and report.ignored == [
        "head.bias",
        "head.weight",
    ]
    for k, v in other.state_dict().items():
        assert torch.equal(v, fresh[k] if k.startswith("head.") else file[k]), k


def test_init_errors_are_one_line(pretrained, capsys, tmp_path):
    state = tmp_path / "state.safetensors"
    save_state(state, {"step": 1})
    cases = [
        ([pretrained["deploy"]], ["Local Perceptron", "model.safetensors"]),
        ([state], ["training state"]),
        ([tmp_path / "none.safetensors"], ["not found"]),
        # Another model: its keys are named (missing ones and mis-shaped ones).
        ([pretrained["model"], "--model", "repmlp_fmnist", "--model-arg", "kernel_sizes=[3,5]",
          "--model-arg", "widths=[4,8]"], ["missing from the file", "local_perceptron"]),
        ([pretrained["model"], "--model", "repmlp_fmnist", "--model-arg", "kernel_sizes=[3]",
          "--model-arg", "widths=[4,16]"], ["with other shapes"]),
    ]  # fmt: skip
    for argv, fragments in cases:
        status, err = train(
            capsys, "--data-dir", pretrained["dst"], *RUN, "--output", tmp_path / "o", "--init", *argv
        )
        line = user_error_line(err)
        assert status == 2 and all(f in line for f in fragments), (argv, line)
        assert not (tmp_path / "o" / "checkpoint.safetensors").exists()


def test_face_init_loads_the_trunk_and_starts_the_embedding_head_fresh(tmp_path):
    small = dict(img_size=32, layers=[1, 1, 1, 1], widths=[8, 8, 16, 16], stem_channels=8)
    cls = repmlp.create_model("face_resnet", num_classes=10, **small)  # a classifier of the architecture
    save_model(tmp_path / "cls.safetensors", cls, name="face_resnet", model_kwargs={"num_classes": 10, **small},
               form="train")  # fmt: skip
    face = repmlp.create_model("face_resnet", num_classes=16, **small)
    head = face.head.state_dict()
    report = init_from_file(face, tmp_path / "cls.safetensors", fresh_head=True,
                            head=head_prefixes(face, embedding_head=True))  # fmt: skip
    assert report.reinitialised and all(k.startswith("head.") for k in report.reinitialised)
    for k, v in face.state_dict().items():
        ref = head[k[len("head.") :]] if k.startswith("head.") else cls.state_dict()[k]
        assert torch.equal(v, ref), k


def _task_args(task: str, argv: list[str]) -> argparse.Namespace:
    from repmlp.cli import ArgumentParser
    from repmlp.commands.task_options import TASK_OPTIONS

    parser = ArgumentParser()
    TASK_OPTIONS[task]["train"](parser)
    return parser.parse_args(["--data-dir", "d", "--output", "o", *argv])


def test_init_is_a_flag_of_every_task():
    assert _task_args("face", ["--init", "f.safetensors"]).init == "f.safetensors"
    assert _task_args("seg", ["--init", "f.safetensors"]).init == "f.safetensors"
    assert _task_args("seg", ["--backbone-weights", "b.safetensors"]).init == "b.safetensors"
    assert (
        cli.build_parser().parse_known_args(["train", "--init", "f.safetensors"])[0].init == "f.safetensors"
    )


def test_timm_loads_repmlp_files(pretrained):
    """``pretrained=True`` with ``pretrained_cfg_overlay=dict(file=...)`` (the file's own options, or a new
    ``num_classes`` whose head starts fresh) and ``checkpoint_path=``; deployed files with ``deploy=True``."""
    ref = repmlp.load_model(pretrained["model"])
    x = torch.randn(2, 3, 28, 28)
    overlay = dict(file=str(pretrained["model"]))
    model = timm.create_model("repmlp_fmnist", pretrained=True, pretrained_cfg_overlay=overlay).eval()
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    five = timm.create_model("repmlp_fmnist", pretrained=True, pretrained_cfg_overlay=overlay, num_classes=5)
    assert five.num_classes == 5 and five.get_classifier().out_features == 5
    assert torch.equal(five.stem.conv.weight, ref.stem.conv.weight)
    kwargs = dict(widths=[4, 8], kernel_sizes=[3], in_chans=3, num_classes=3, img_size=28)
    by_path = timm.create_model("repmlp_fmnist", checkpoint_path=str(pretrained["model"]), **kwargs).eval()
    torch.testing.assert_close(by_path(x), ref(x), rtol=0, atol=0)
    dep_overlay = dict(file=str(pretrained["deploy"]))
    deployed = timm.create_model(
        "repmlp_fmnist", pretrained=True, pretrained_cfg_overlay=dep_overlay, deploy=True
    )
    torch.testing.assert_close(deployed.eval()(x), ref(x), rtol=1e-4, atol=1e-5)
    with pytest.raises(CheckpointError, match="deploy=True"):
        timm.create_model("repmlp_fmnist", pretrained=True, pretrained_cfg_overlay=dep_overlay)
    with pytest.raises(ValueError, match="no pretrained weights"):
        timm.create_model("repmlp_fmnist", pretrained=True)
    assert not timm.models.get_pretrained_cfg("repmlp_fmnist").url  # still no download URL


def test_the_docs_checkpoint_path_line_loads_the_main_jobs_file(tmp_path, monkeypatch):
    """docs/using.md's ``checkpoint_path=`` line, run as written beside a file like the main job's (its model,
    built as ``repmlp train`` builds it), loads that file."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "using.md").read_text()
    line = re.search(
        r'^timm\.create_model\("(\w+)", checkpoint_path="runs/X/model\.safetensors"\)', docs, re.M
    )
    assert line and line[1] == PRESETS["fmnist"].model, "docs/using.md: the checkpoint_path= line"
    model, kwargs = build_model(line[1], num_classes=10, in_chans=1, img_size=28)
    (tmp_path / "runs" / "X").mkdir(parents=True)
    save_model(tmp_path / "runs/X/model.safetensors", model, name=line[1], model_kwargs=kwargs, form="train")
    monkeypatch.chdir(tmp_path)
    loaded = eval(line[0], {"timm": timm})
    want = model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())


# ----------------------------------------------- the main job's model, fine-tuned on one's own images
def _main_job_file(path: Path) -> Path:
    """A file like the main job's ``model.safetensors``: repmlp_fmnist_patch2 (small widths), one channel,
    28x28, trained on Fashion-MNIST (what its metadata records)."""
    kwargs = {"widths": [4, 8], "img_size": 28, "in_chans": 1, "num_classes": 10}
    torch.manual_seed(0)
    model = repmlp.create_model("repmlp_fmnist_patch2", **kwargs).eval()
    extra = {"dataset": "fashion-mnist", "data_dir": None, "classes": [f"c{i}" for i in range(10)],
             "input_size": [1, 28, 28]}  # fmt: skip
    save_model(path, model, name="repmlp_fmnist_patch2", model_kwargs=kwargs, form="train", extra=extra)
    return path


def test_main_job_model_finetunes_on_an_image_folder_of_any_mode(tmp_path, capsys, one_thread):
    """The README's line (``--dataset imagefolder --init runs/X/model.safetensors``) with the main job's
    one-channel 28x28 model: channels, size and normalisation come from the file, RGB/RGBA/16-bit images are
    converted, and --train-limit takes a seeded subset of every class, named in the report."""
    import json

    import numpy as np
    from PIL import Image

    from repmlp.io.model_file import read_metadata

    init = _main_job_file(tmp_path / "main.safetensors")
    folder = make_image_folder(tmp_path / "mine", classes=3, per_class=4, size=40)
    Image.fromarray(np.full((30, 30, 4), 200, np.uint8), "RGBA").save(
        folder / "train" / "class1" / "rgba.png"
    )
    Image.fromarray(np.full((30, 30), 40000, np.uint16)).save(folder / "train" / "class2" / "deep.png")
    out = tmp_path / "out"
    status, err = train(capsys, "--data-dir", folder, "--init", init, "--epochs", 1, "--batch-size", 4,
                        "--train-limit", 6, "--workers", 0, "--no-bench", "--no-export", "--output", out)  # fmt: skip
    assert status == 0, err
    meta = read_metadata(out / "model.safetensors")
    extra = json.loads(meta["extra"])
    assert meta["model"] == "repmlp_fmnist_patch2" and extra["input_size"] == [1, 28, 28]
    assert (
        extra["eval_preprocessing"]["mean"] == pytest.approx([0.2860]) and extra["dataset"] == "imagefolder"
    )
    report = (out / "report.md").read_text()
    assert "6 training / 12 validation examples (training: a seeded stratified subset" in report
    assert "3 of 3 classes" in report
    # The fine-tuned file evaluates and predicts on the same kind of images.
    assert cli.main(["eval", "--checkpoint", str(out / "model.safetensors"), "--workers", "0"]) == 0
    assert cli.main(["predict", "--checkpoint", str(out / "model.safetensors"),
                     str(folder / "val" / "class0" / "0.png")]) == 0  # fmt: skip
    capsys.readouterr()
    # What cannot be adapted is one line saying which option to pass.
    status, err = train(capsys, "--data-dir", folder, "--init", init, "--img-size", 32, "--epochs", 1,
                        "--output", tmp_path / "o2")  # fmt: skip
    assert status == 2 and "pass --img-size 28" in user_error_line(err)
    cifar = make_cifar10(tmp_path / "c10", per_batch=4)
    status = cli.main(["train", "--dataset", "cifar10", "--data-dir", str(cifar), "--init", str(init),
                       "--output", str(tmp_path / "o3")])  # fmt: skip
    line = user_error_line(capsys.readouterr().err)
    assert status == 2 and "takes 1-channel images but cifar10 has 3" in line and "imagefolder" in line, line


def test_stratified_subset_keeps_every_class_and_its_share():
    from repmlp.data.folder import stratified_subset

    labels = [0] * 90 + [1] * 9 + [2] * 1
    pick = stratified_subset(labels, 10, seed=0)
    assert pick == sorted(pick) and len(set(pick)) == 10
    counts = [sum(labels[i] == c for i in pick) for c in range(3)]
    assert counts[2] == 1 and counts[1] >= 1 and counts[0] >= 7  # every class, in proportion
    assert stratified_subset(labels, 10, seed=0) == pick  # seeded
    assert stratified_subset(labels, 10, seed=1) != pick
    assert stratified_subset(labels, 500, seed=0) == list(range(100))
