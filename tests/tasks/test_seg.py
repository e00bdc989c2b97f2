"""Semantic segmentation: PSPNet models (paper's Table seg counts), Cityscapes data, backbone weights,
sliding-window inference and the train/eval pipeline end to end."""

import json
import subprocess
import sys

import pytest
import torch

from repmlp import reparameterize_model
from repmlp.bench.counts import profile_model
from repmlp.cli import main as cli_main
from repmlp.data.cityscapes import CityscapesSegmentation, random_scale_crop_flip
from repmlp.errors import UserError
from repmlp.io.model_file import load_model, read_metadata, save_model
from repmlp.models import create_model
from repmlp.tasks.segmentation import load_backbone_weights, poly_lr, sliding_window_logits
from repmlp_testdata import (
    SEG_TINY,
    assert_diverged_weights_are_clear_errors,
    assert_kill_and_resume_is_bitwise,
    make_cityscapes,
    model_arg_options,
    run_cli,
    subprocess_env,
    user_error_line,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "name, params, macs", [("pspnet_res50", 46.56, 350004), ("pspnet_repmlp_res50", 175.41, 342696)]
)
def test_counts_match_paper(name, params, macs):
    p, m = profile_model(name)  # 713x713, 19 classes, converted model (no auxiliary head)
    assert abs(p / 1e6 - params) / params < 0.01, p
    assert abs(m / 1e6 - macs) / macs < 0.01, m


def test_backbone_set_up_as_the_paper():
    with torch.device("meta"):
        res = create_model("pspnet_res50")
        rep = create_model("pspnet_repmlp_res50")
    x = torch.randn(1, 3, 713, 713, device="meta")
    for model in (res, rep):  # timm's features: c2..c5 maps and their feature_info
        assert [tuple(c.shape[2:]) for c in model.backbone(x)] == [(179, 179)] + [(90, 90)] * 3
        assert model.backbone.feature_info.channels() == [256, 512, 1024, 2048]
    assert res.backbone.layer3[1].conv2.conv.dilation == (2, 2) and res.backbone.layer4[
        1
    ].conv2.conv.dilation == (4, 4)
    assert rep.backbone.layer4[1].conv2.conv.dilation == (2, 2)
    # c4: first block kept as a plain (now stride-1, undilated) bottleneck, the other five RepMLP.
    kinds = [type(b).__name__ for b in rep.backbone.layer3]
    assert kinds == ["Bottleneck"] + ["RepMLPBottleneck"] * 5
    assert rep.backbone.layer3[0].conv2.conv.stride == (1, 1) and rep.backbone.layer3[
        0
    ].conv2.conv.dilation == (1, 1)
    c3, c4 = rep.backbone.layer2[1].repmlp, rep.backbone.layer3[1].repmlp
    assert c3.parts == (9, 9) and c4.parts == (9, 9) and c3.groups == 4 and c4.groups == 8
    # FC1 output reduced 4x in c3, 8x in c4.
    assert c3.global_perceptron.fc1.out_features * 4 == c3.global_perceptron.fc1.in_features
    assert c4.global_perceptron.fc1.out_features * 8 == c4.global_perceptron.fc1.in_features
    with torch.device("meta"):  # only the structure matters
        assert (
            rep.aux_head is not None
            and create_model("pspnet_res50", deploy=True, img_size=64).aux_head is None
        )


def test_small_pspnet_trains_outputs_and_converts_exactly():
    torch.manual_seed(0)
    model = create_model("pspnet_repmlp_res50", img_size=64, num_classes=5, **SEG_TINY).double()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    main, aux = model.train()(x)
    assert main.shape == aux.shape == (2, 5, 64, 64)
    model.eval()
    ref = model(x)
    deployed = reparameterize_model(model)
    assert deployed.aux_head is None
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in deployed.modules())
    torch.testing.assert_close(deployed(x), ref, rtol=1e-9, atol=1e-9)
    direct = create_model("pspnet_repmlp_res50", img_size=64, num_classes=5, deploy=True, **SEG_TINY).double()
    direct.load_state_dict(deployed.state_dict(), strict=True)
    torch.testing.assert_close(direct.eval()(x), ref, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="64x64"):
        model(torch.randn(1, 3, 96, 96, dtype=torch.float64))


# ------------------------------------------------------------------------------- backbone weights
def test_backbone_weights_inherited_except_fc1_fc2(tmp_path):
    torch.manual_seed(0)
    small = {"widths": [32, 64, 128, 256], "partition": 4, "kernel_sizes": [1, 3]}
    # ImageNet-style classifier at 128x128: c3 16x16 (4x4 partitions), c4 8x8 (2x2), as at 320 in the paper.
    cls = create_model("repmlp_res50_g4_8", img_size=128, num_classes=10, **small)
    for p in cls.parameters():
        p.data.normal_()
    path = tmp_path / "backbone.safetensors"
    kwargs = {"img_size": 128, "num_classes": 10, **small}
    save_model(path, cls, name="repmlp_res50_g4_8", model_kwargs=kwargs, form="train")
    seg = create_model("pspnet_repmlp_res50", img_size=96, **small)  # c3, c4 at 12x12: 3x3 partitions
    before = {k: v.clone() for k, v in seg.backbone.state_dict().items()}
    report = load_backbone_weights(seg, str(path))
    source = cls.state_dict()
    after = seg.backbone.state_dict()
    assert report["reinitialised"] and all(".global_perceptron.fc" in k for k in report["reinitialised"])
    assert report["ignored"] == ["fc.bias", "fc.weight"]
    for k, v in after.items():
        if k in report["reinitialised"]:
            assert torch.equal(v, before[k])  # fresh initialisation kept
        else:
            assert torch.equal(v, source[k]), k
    assert len(report["loaded"]) + len(report["reinitialised"]) == len(after)

    # A backbone of another architecture: every difference is listed.
    res = create_model("repmlp_res50", stages=(), img_size=64, num_classes=10, widths=small["widths"])
    bad = tmp_path / "resnet.safetensors"
    # (Its metadata describes it fully: a model file's metadata is checked against its tensors.)
    res_kwargs = {"stages": [], "widths": small["widths"], "img_size": 64, "num_classes": 10}
    save_model(bad, res, name="repmlp_res50", model_kwargs=res_kwargs, form="train")
    with pytest.raises(
        UserError, match=r"\(from repmlp_res50\) does not fit the backbone: \d+ missing from the file: "
    ):
        load_backbone_weights(seg, str(bad))
    with pytest.raises(UserError, match="not found"):
        load_backbone_weights(seg, str(tmp_path / "nope.safetensors"))


# ---------------------------------------------------------------------------------- inference
def test_sliding_window_equals_whole_image_for_a_pointwise_model():
    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 4, 1)
    image = torch.randn(2, 3, 50, 77)
    with torch.no_grad():
        whole = model(image)
    for crop in [(16, 16), (24, 40), (50, 77), (64, 96)]:
        torch.testing.assert_close(sliding_window_logits(model, image, crop, 4), whole)


def test_poly_lr_and_augmentation():
    assert poly_lr(0.01, 0, 100) == 0.01 and poly_lr(0.01, 100, 100) == 0.0
    assert poly_lr(0.01, 50, 100) == pytest.approx(0.01 * 0.5**0.9)
    image = torch.arange(3 * 20 * 30, dtype=torch.float32).reshape(3, 20, 30)
    label = torch.randint(0, 19, (20, 30))
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        x, y = random_scale_crop_flip(image, label, (32, 24), (0.5, 2.0), generator=g)
        assert x.shape == (3, 32, 24) and y.shape == (32, 24)
        valid = y[y != 255]
        assert valid.numel() > 0 and bool(((valid >= 0) & (valid < 19)).all())  # nearest: no new labels


# ------------------------------------------------------------------------------------- pipeline
@pytest.fixture(scope="module")
def city(tmp_path_factory):
    root = tmp_path_factory.mktemp("cityscapes")
    make_cityscapes(root, "train", 6, (64, 96), seed=0)
    make_cityscapes(root, "val", 3, (80, 112), seed=1)  # larger than the 64 crop: sliding window
    return root


def test_cityscapes_layout_and_errors(city, tmp_path):
    ds = CityscapesSegmentation(city, "val")
    x, y = ds[0]
    assert x.shape == (3, 80, 112) and y.shape == (80, 112) and set(y.unique().tolist()) <= {0, 10, 13, 255}
    crops = CityscapesSegmentation(city, "train", crop_size=48)
    assert crops[0][0].shape == (3, 48, 48)
    with pytest.raises(UserError, match="not a Cityscapes folder"):
        CityscapesSegmentation(tmp_path, "train")
    broken = tmp_path / "broken"
    make_cityscapes(broken, "train", 2, (32, 48), seed=3)
    next((broken / "gtFine" / "train").rglob("*.png")).unlink()
    with pytest.raises(UserError, match="1 of 2 images .* no train-id label map"):
        CityscapesSegmentation(broken, "train")


TRAIN_ARGS = [
    "--model", "pspnet_repmlp_res50", *model_arg_options(SEG_TINY), "--crop-size", "64",
    "--batch-size", "2", "--epochs", "4", "--lr", "0.01", "--device", "cpu", "--workers", "0",
    "--log-interval", "3",
]  # fmt: skip


@pytest.fixture(scope="module")
def trained_seg(city):
    out = city / "run"
    assert (
        cli_main(["train", "--task", "seg", "--data-dir", str(city), "--output", str(out), *TRAIN_ARGS]) == 0
    )
    return out


def test_seg_batch_of_one_is_a_clear_error(city, capsys):
    args = list(TRAIN_ARGS)
    args[args.index("--batch-size") + 1] = "1"
    assert (
        cli_main(["train", "--task", "seg", "--data-dir", str(city), "--output", str(city / "b1"), *args])
        == 2
    )
    assert "BatchNorm needs at least 2 examples per batch" in capsys.readouterr().err


@pytest.mark.slow  # a killed training process
def test_seg_kill_and_resume_gives_the_same_weights(city, tmp_path):
    args = [
        "train",
        "--task",
        "seg",
        "--data-dir",
        str(city),
        *TRAIN_ARGS,
        "--iterations",
        "5",
        "--ckpt-every",
        "2",
    ]
    assert_kill_and_resume_is_bitwise(args, tmp_path, stop=3)


@pytest.mark.parametrize(
    "option, message",
    [
        (["--momentum", "1.5"], "--momentum: must be in [0, 1), got 1.5"),
        (["--aux-weight", "-1"], "--aux-weight: must be in [0, 1e+06], got -1"),
        (["--weight-decay", "-0.1"], "--weight-decay: must be in [0, 1e+06], got -0.1"),
        (["--train-limit", "1"], "1 training image(s) are fewer than --batch-size 2"),
    ],
)
def test_seg_bad_options_are_one_line(city, tmp_path, capsys, option, message):
    args = ["train", "--task", "seg", "--data-dir", str(city), "--output", str(tmp_path / "o"), *TRAIN_ARGS]
    assert cli_main([*args, *option]) == 2
    assert message in user_error_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def test_seg_training_loss_falls(trained_seg):
    history = json.loads((trained_seg / "train_log.json").read_text())["history"]
    assert history[-1]["iteration"] == 12 and history[-1]["lr"] < 0.01
    assert history[-1]["loss"] < history[0]["loss"]  # measured about 0.4x: a wide margin
    # Each logged lr is the poly lr of the step it was used for (iterations count from 1).
    for entry in history:
        assert entry["lr"] == pytest.approx(poly_lr(0.01, entry["iteration"] - 1, 12, 0.9), rel=1e-12)


def test_seg_eval_sliding_window_and_converted_model_agree(city, trained_seg, capsys):
    out_json = city / "seg_metrics.json"
    rc = cli_main([
        "eval", "--task", "seg", "--checkpoint", str(trained_seg / "model.safetensors"), "--data-dir", str(city),
        "--check-conversion", "--device", "cpu", "--workers", "0", "--output-json", str(out_json),
    ])  # fmt: skip
    assert rc == 0
    m = json.loads(out_json.read_text())
    assert m["mode"] == "slide" and m["crop"] == [64, 64] and m["images"] == 3
    # The forms' logits agree to float rounding: only a pixel whose two best classes tie that closely
    # can change its prediction (none did when measured; a wide bound, not luck, is asserted).
    changed = (
        torch.tensor(m["confusion_matrix"]) - torch.tensor(m["training_time"]["confusion_matrix"])
    ).abs()
    assert changed.sum() / 2 <= 0.001 * 3 * 80 * 112
    assert m["miou"] == pytest.approx(m["training_time"]["miou"], abs=0.01)
    # Only road, sky and car occur: the other 16 classes have no IoU and are left out of the mean.
    present = {k for k, v in m["per_class_iou"].items() if v is not None}
    assert present <= {"road", "sky", "car"} | {k for k, v in m["per_class_iou"].items() if v == 0.0}
    counted = [v for v in m["per_class_iou"].values() if v is not None]
    assert m["miou"] == pytest.approx(sum(counted) / len(counted))
    assert "mIoU" in capsys.readouterr().out
    # --json prints the same metrics, as for classification.
    rc = cli_main(["eval", "--task", "seg", "--checkpoint", str(trained_seg / "deploy.safetensors"),
                   "--data-dir", str(city), "--device", "cpu", "--workers", "0", "--json"])  # fmt: skip
    assert rc == 0 and json.loads(capsys.readouterr().out)["confusion_matrix"] == m["confusion_matrix"]
    # A RepMLP model cannot predict whole 80x112 images in one pass: clear error.
    rc = cli_main(["eval", "--task", "seg", "--checkpoint", str(trained_seg / "deploy.safetensors"),
                   "--data-dir", str(city), "--mode", "whole", "--device", "cpu", "--workers", "0"])  # fmt: skip
    assert rc == 2 and "use --mode slide" in capsys.readouterr().err


def test_seg_backbone_weights_error_through_cli(city, tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    proc = run_cli(
        "train", "--task", "seg", "--data-dir", city, "--output", tmp_path / "o", *TRAIN_ARGS,
        "--backbone-weights", tmp_path / "junk.safetensors",
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.startswith("repmlp: error: --backbone-weights")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_seg_training_with_torchrun(city, tmp_path):
    env = subprocess_env()
    args = list(TRAIN_ARGS)
    args[args.index("--epochs") + 1] = "2"
    args[args.index("--batch-size") + 1] = "4"  # 2 per process: BatchNorm needs more than one sample
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29518",
         "-m", "repmlp", "train", "--task", "seg", "--data-dir", str(city),
         "--output", str(tmp_path / "ddp"), *args],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    history = json.loads((tmp_path / "ddp" / "train_log.json").read_text())["history"]
    assert history[-1]["iteration"] == 2  # 3 images per process, batches of 2, 2 epochs
    assert (tmp_path / "ddp" / "deploy.safetensors").is_file()


# ------------------------------------------------------------------------------ clear user errors
def _user_error(capsys) -> str:
    return user_error_line(capsys.readouterr().err)


def test_seg_eval_refuses_checkpoints_of_other_tasks(city, tmp_path, capsys):
    face = reparameterize_model(create_model("mobilefacenet", img_size=32, width=16).eval())  # deploy form
    cls = create_model("repmlp_fmnist")
    cases = [
        (cls, "repmlp_fmnist", {"dataset": "fashion-mnist"}, "holds an image classifier (repmlp_fmnist)"),
        (face, "mobilefacenet", {"task": "face"}, "holds a face embedding model (mobilefacenet)"),
        (face, "mobilefacenet", None, "holds model 'mobilefacenet'"),  # no record: the model decides
    ]
    for i, (model, name, extra, message) in enumerate(cases):
        path = tmp_path / f"other{i}.safetensors"
        kwargs = {"img_size": 32, "width": 16} if name == "mobilefacenet" else {}
        save_model(path, model, name=name, model_kwargs=kwargs, form="deploy" if i else "train", extra=extra)
        rc = cli_main(
            ["eval", "--task", "seg", "--checkpoint", str(path), "--data-dir", str(city), "--device", "cpu"]
        )
        line = _user_error(capsys)
        assert rc == 2 and message in line and "not a PSPNet segmentation model" in line


def test_seg_training_sizes_and_models(city, tmp_path, capsys):
    base = ["train", "--task", "seg", "--data-dir", str(city), "--batch-size", "2", "--epochs", "1",
            "--device", "cpu", "--workers", "0", "--output"]  # fmt: skip
    small = {"widths": [16, 32, 64, 64], "head_channels": 8, "aux_channels": 8}
    # --model-arg img_size alone sets the crop (no --crop-size): one size for data and model.
    sized = ["--model", "pspnet_res50", *model_arg_options({**small, "img_size": 48})]
    assert cli_main([*base, str(tmp_path / "ok"), *sized]) == 0
    meta = read_metadata(tmp_path / "ok" / "deploy.safetensors")
    assert json.loads(meta["extra"])["crop_size"] == 48 and json.loads(meta["model_kwargs"])["img_size"] == 48
    # Without RepMLPs the model takes whole 80x112 images in one pass.
    rc = cli_main(["eval", "--task", "seg", "--checkpoint", str(tmp_path / "ok" / "deploy.safetensors"),
                   "--data-dir", str(city), "--mode", "whole", "--device", "cpu", "--workers", "0"])  # fmt: skip
    assert rc == 0 and "(whole, crop 48)" in capsys.readouterr().out
    bad = [
        ([*sized, "--crop-size", "64"], "--model-arg img_size 48 differs from --crop-size 64"),
        (["--model", "repmlp_fmnist", "--crop-size", "64"], "model 'repmlp_fmnist' is not a PSPNet"),
    ]
    for extra, message in bad:
        assert cli_main([*base, str(tmp_path / "x"), *extra]) == 2
        assert message in _user_error(capsys)


def test_seg_eval_names_diverged_weights(city, trained_seg, tmp_path, capsys):
    model = load_model(trained_seg / "model.safetensors")
    meta = model.metadata
    common = ["--data-dir", str(city), "--val-limit", "1", "--device", "cpu", "--workers", "0"]

    def save_eval(name: str, *extra: str) -> int:
        save_model(tmp_path / name, model, name=meta.name, model_kwargs=meta.model_kwargs, form="train",
                   extra=meta.extra, check=False)  # fmt: skip
        return cli_main(["eval", "--task", "seg", "--checkpoint", str(tmp_path / name), *common, *extra])

    # NaN logits would argmax to class 0 and give a fake mIoU: overflowing outputs must be errors.
    assert_diverged_weights_are_clear_errors(model, save_eval, lambda: _user_error(capsys))


def test_seg_eval_whole_mode_error_comes_before_progress_bars(city, trained_seg, capsys):
    rc = cli_main(["eval", "--task", "seg", "--checkpoint", str(trained_seg / "deploy.safetensors"),
                   "--data-dir", str(city), "--mode", "whole", "--device", "cpu", "--workers", "0"])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err  # exactly the message: no (cleared) progress bar text before it
    assert (
        err == "repmlp: error: --mode whole: this model's RepMLPs are built for 64x64 inputs, not whole "
        "images; use --mode slide\n"
    )
