"""Face recognition: models (paper's Table face counts), data, and the train/eval pipeline end to end."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import repmlp.nn.convert
from repmlp import reparameterize_model
from repmlp.bench.counts import profile_model
from repmlp.cli import main as cli_main
from repmlp.data.face import FaceFolder, read_pairs
from repmlp.errors import UserError
from repmlp.io.model_file import load_model, read_metadata, save_model
from repmlp.models import create_model
from repmlp_testdata import (
    FACE_TINY,
    assert_diverged_weights_are_clear_errors,
    assert_kill_and_resume_is_bitwise,
    make_faces,
    model_arg_options,
    run_cli,
    subprocess_env,
    user_error_line,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _close(ours: float, paper: float, tol: float = 0.01) -> bool:
    return abs(ours - paper) / paper <= tol


@pytest.mark.parametrize(
    "name, params, macs",
    [("mobilefacenet", 0.98, 162), ("face_resnet", 40.35, 1050)],
)
def test_counts_match_paper(name, params, macs):
    p, m = profile_model(name)
    assert _close(p / 1e6, params), p
    if macs is not None:
        assert _close(m / 1e6, macs), m


def test_face_resnet_stems():
    # The paper's counts need the deep 3x3 stem (docs/models.md); ResNet-50's 7x7 stem stays an option.
    deep = create_model("face_resnet").trunk.stem
    assert [c.conv.out_channels for c in deep.convs] == [32, 32, 64]
    assert all(c.conv.kernel_size == (3, 3) for c in deep.convs) and deep.convs[0].conv.stride == (2, 2)
    assert create_model("face_resnet", stem="resnet").trunk.stem.conv.conv.kernel_size == (7, 7)
    with pytest.raises(ValueError, match="stem"):
        create_model("face_resnet", stem="7x7")


def test_repmlp_face_resnet_structure():
    model = create_model("repmlp_face_resnet")
    kinds = [[type(b).__name__ for b in s] for s in model.trunk.stages]
    # The paper: "the last two bottlenecks of c2 and the last blocks of c3, c4".
    assert kinds == [
        ["Bottleneck", "RepMLPBottleneck", "RepMLPBottleneck"],
        ["Bottleneck", "RepMLPBottleneck"],
        ["Bottleneck", "RepMLPBottleneck"],
        ["Bottleneck", "Bottleneck"],
    ]
    rep = model.trunk.layer1[1].repmlp
    assert rep.partition == (6, 6) and rep.groups == 4 and rep.resolution == (24, 24)
    assert model.trunk.stage_resolutions == [(24, 24), (12, 12), (6, 6), (3, 3)]


@pytest.mark.parametrize(
    "name, kwargs, size",
    [
        ("mobilefacenet", {"width": 16, "embedding_dim": 24}, 32),
        ("face_resnet", {"widths": [16, 32, 64, 128], "embedding_dim": 24}, 32),
        ("repmlp_face_resnet", {**FACE_TINY, "embedding_dim": 24}, 64),
        ("face_resnet", {"widths": [16, 32, 64, 128], "embedding_dim": 24, "stem": "resnet"}, 32),
    ],
)
def test_models_embed_and_convert_exactly(name, kwargs, size):
    torch.manual_seed(0)
    model = create_model(name, img_size=size, **kwargs).double()
    model.train()
    for _ in range(2):  # non-trivial BatchNorm statistics
        model(torch.randn(8, 3, size, size, dtype=torch.float64))
    model.eval()
    x = torch.randn(3, 3, size, size, dtype=torch.float64)
    ref = model(x)
    assert ref.shape == (3, 24)
    deployed = reparameterize_model(model)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in deployed.modules())
    torch.testing.assert_close(deployed(x), ref, rtol=1e-9, atol=1e-9)
    # The converted state dict loads strictly into the deploy-form structure.
    direct = create_model(name, img_size=size, deploy=True, **kwargs).double()
    direct.load_state_dict(deployed.state_dict(), strict=True)
    torch.testing.assert_close(direct.eval()(x), ref, rtol=1e-9, atol=1e-9)


def test_timm_num_classes_is_embedding_width_and_wrong_size_is_clear():
    import timm

    small = {k: FACE_TINY[k] for k in ("widths", "groups")}
    model = timm.create_model("repmlp_face_resnet", num_classes=64, img_size=64, **small)
    assert model.embedding_dim == 64
    with pytest.raises(ValueError, match="64x64"):
        model.eval()(torch.randn(1, 3, 96, 96))


# ------------------------------------------------------------------------------------------- data
def test_face_folder_and_clear_errors(tmp_path):
    make_faces(tmp_path / "ok", 3, 2)
    ds = FaceFolder(tmp_path / "ok", size=32)
    assert ds.classes == ["id00", "id01", "id02"] and len(ds) == 6
    x, y = ds[3]
    assert x.shape == (3, 32, 32) and y == 1 and -1 <= x.min() and x.max() <= 1
    with pytest.raises(UserError, match="does not exist"):
        FaceFolder(tmp_path / "missing")
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(flat / "a.png")
    with pytest.raises(UserError, match="no identity sub-folders"):
        FaceFolder(flat)
    (tmp_path / "empty" / "x").mkdir(parents=True)
    with pytest.raises(UserError, match="holds images"):
        FaceFolder(tmp_path / "empty")
    with pytest.raises(UserError, match="not a folder"):
        FaceFolder(flat / "a.png")


def test_read_pairs_lfw_and_plain_formats(tmp_path):
    for name in ("Ann", "Bob"):
        (tmp_path / name).mkdir()
        for k in (1, 2):
            Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / name / f"{name}_{k:04d}.jpg")
    (tmp_path / "pairs.txt").write_text("1 1\nAnn 1 2\nAnn 1 Bob 2\n")
    pairs = read_pairs(tmp_path / "pairs.txt", tmp_path)
    assert pairs.folds == 1 and pairs.same == [True, False]
    assert pairs.second[1] == tmp_path / "Bob" / "Bob_0002.jpg"
    (tmp_path / "plain.txt").write_text("Ann/Ann_0001.jpg Bob/Bob_0001.jpg 0\n")
    assert read_pairs(tmp_path / "plain.txt", tmp_path).same == [False]
    (tmp_path / "bad.txt").write_text("Ann/Ann_0001.jpg Bob/Bob_0009.jpg 1\n")
    with pytest.raises(UserError, match="does not exist"):
        read_pairs(tmp_path / "bad.txt", tmp_path)


# ------------------------------------------------------------------------------------- pipeline
@pytest.fixture(scope="module")
def face_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("faces")
    make_faces(root / "train", 4, 8, seed=1)
    # Evaluation identities are the training ones (images re-drawn), plus distractor identities.
    make_faces(root / "probe", 4, 2, seed=1)
    make_faces(root / "gallery", 4, 1, seed=1)
    make_faces(root / "gallery", 3, 1, seed=7, prefix="distractor")
    lines = []
    for a in range(4):
        lines.append(f"train/id{a:02d}/000.png train/id{a:02d}/001.png 1")
        lines.append(f"train/id{a:02d}/002.png train/id{(a + 1) % 4:02d}/003.png 0")
    (root / "pairs.txt").write_text("\n".join(lines) + "\n")
    return root


TRAIN_ARGS = [
    "--model", "repmlp_face_resnet", *model_arg_options(FACE_TINY), "--img-size", "32",
    "--batch-size", "16", "--iterations", "24", "--lr-steps", "18", "--lr", "0.05",
    "--am-scale", "16", "--device", "cpu", "--workers", "0", "--log-interval", "4",
]  # fmt: skip


@pytest.fixture(scope="module")
def trained_face(face_data):
    out = face_data / "run"
    rc = cli_main(
        ["train", "--task", "face", "--data-dir", str(face_data / "train"), "--output", str(out), *TRAIN_ARGS]
    )
    assert rc == 0
    return out


def test_face_training_loss_falls(trained_face):
    history = json.loads((trained_face / "train_log.json").read_text())["history"]
    assert len(history) == 6 and history[-1]["lr"] == pytest.approx(0.005)
    assert history[-1]["loss"] < history[0]["loss"]  # measured about 0.05x: a wide margin


@pytest.mark.slow  # a killed training process
def test_face_kill_and_resume_gives_the_same_weights(face_data, tmp_path):
    """Killed and continued with ``--resume auto`` (segmentation's test: plain ``--resume``)."""
    args = ["train", "--task", "face", "--data-dir", str(face_data / "train"), *TRAIN_ARGS]
    args[args.index("--iterations") + 1] = "7"
    args[args.index("--lr-steps") + 1] = "5"  # the resumed run crosses an LR step
    assert_kill_and_resume_is_bitwise([*args, "--ckpt-every", "3"], tmp_path, stop=4, auto=True)


@pytest.mark.parametrize(
    "option, message",
    [
        (["--momentum", "1.5"], "--momentum: must be in [0, 1), got 1.5"),
        (["--head-weight-decay", "-1"], "--head-weight-decay: must be in [0, 1e+06], got -1"),
        (["--weight-decay", "-1"], "--weight-decay: must be in [0, 1e+06], got -1"),
        (["--lr-steps", "30"], "--lr-steps 30 is past --iterations 24"),
    ],
)
def test_face_bad_options_are_one_line(face_data, tmp_path, capsys, option, message):
    args = [
        "train",
        "--task",
        "face",
        "--data-dir",
        str(face_data / "train"),
        "--output",
        str(tmp_path / "o"),
    ]
    assert cli_main([*args, *TRAIN_ARGS, *option]) == 2
    assert message in user_error_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def test_face_eval_converted_model_gives_same_metrics(face_data, trained_face, capsys):
    """The metrics ``repmlp eval --task face`` reports are those of the model's own embeddings (rank-1
    recomputed here by brute force, for each form), whatever the few training steps made of them."""
    out_json = face_data / "metrics.json"
    rc = cli_main([
        "eval", "--task", "face", "--checkpoint", str(trained_face / "model.safetensors"),
        "--pairs", str(face_data / "pairs.txt"), "--folds", "2", "--probe", str(face_data / "probe"),
        "--gallery", str(face_data / "gallery"), "--check-conversion", "--device", "cpu", "--workers", "0",
        "--batch-size", "8", "--output-json", str(out_json),
    ])  # fmt: skip
    assert rc == 0
    m = json.loads(out_json.read_text())
    assert m["probes"] == 8 and m["gallery"] == 7 and m["distractors"] == 3 and m["verification_pairs"] == 8
    # Verification picks a threshold between neighbouring pair scores: a float32 rounding difference
    # between the forms may move it past a near-tie, so compare the embeddings themselves, and allow
    # the accuracy one pair of a fold (4 pairs per fold here).
    assert abs(m["verification_accuracy"] - m["training_time"]["verification_accuracy"]) <= 0.25
    trained = load_model(trained_face / "model.safetensors").eval()
    deployed = reparameterize_model(trained)
    kw = dict(img_size=int(trained.img_size), batch_size=8, device=torch.device("cpu"))
    from repmlp.tasks.face import embed_images

    probes = sorted((face_data / "probe").rglob("*.png"))
    gallery = sorted((face_data / "gallery").rglob("*.png"))
    assert len(probes) == 8 and len(gallery) == 7
    torch.testing.assert_close(embed_images(deployed, probes, **kw), embed_images(trained, probes, **kw),
                               atol=1e-5, rtol=0)  # fmt: skip

    def rank1(model: torch.nn.Module) -> float:
        # Cosine similarity of the float64 unit vectors, as the metric: after so few steps the embeddings
        # are nearly parallel (similarities within rounding of 1), so any other arithmetic breaks near-ties
        # differently.
        p, g = (F.normalize(embed_images(model, f, **kw).double(), dim=1) for f in (probes, gallery))
        similarity = p @ g.T
        nearest = similarity.argmax(1).tolist()
        return sum(
            gallery[j].parent.name == p.parent.name for p, j in zip(probes, nearest, strict=True)
        ) / len(probes)

    assert m["rank1_identification"] == rank1(deployed)
    assert m["training_time"]["rank1_identification"] == rank1(trained)
    assert "rank1_identification" in capsys.readouterr().out
    # The deployed file evaluates to the same numbers; --json prints them, as for classification.
    rc = cli_main([
        "eval", "--task", "face", "--checkpoint", str(trained_face / "deploy.safetensors"),
        "--probe", str(face_data / "probe"), "--gallery", str(face_data / "gallery"), "--device", "cpu",
        "--workers", "0", "--batch-size", "8", "--json",
    ])  # fmt: skip
    assert (
        rc == 0 and json.loads(capsys.readouterr().out)["rank1_identification"] == m["rank1_identification"]
    )


def test_face_cli_errors_are_one_line(tmp_path):
    proc = run_cli(
        "train",
        "--task",
        "face",
        "--data-dir",
        tmp_path / "nope",
        "--output",
        tmp_path / "o",
        "--device",
        "cpu",
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("repmlp: error:") and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_face_training_with_torchrun(face_data, tmp_path):
    env = subprocess_env()
    args = [a if a != "24" else "8" for a in TRAIN_ARGS]
    args[args.index("--lr-steps") + 1] = "6"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
         "-m", "repmlp", "train", "--task", "face", "--data-dir", str(face_data / "train"),
         "--output", str(tmp_path / "ddp"), *args],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    history = json.loads((tmp_path / "ddp" / "train_log.json").read_text())["history"]
    assert history[-1]["iteration"] == 8
    assert (tmp_path / "ddp" / "deploy.safetensors").is_file()


# ------------------------------------------------------------------------------ clear user errors
def test_mobilefacenet_checks_its_input_size():
    model = create_model("mobilefacenet", img_size=32, width=16).eval()
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 128)
    # Fed 96x96 faces, the GDConv would no longer reduce the map to 1x1: a 3200-d "embedding".
    with pytest.raises(ValueError, match=r"img_size=32 takes \(N, 3, 32, 32\).*build it with img_size=96"):
        model(torch.randn(1, 3, 96, 96))
    with pytest.raises(ValueError, match="img_size=32"):
        model(torch.randn(1, 1, 32, 32))


def _user_error(capsys) -> str:
    return user_error_line(capsys.readouterr().err)


def test_face_eval_refuses_checkpoints_of_other_tasks(face_data, tmp_path, capsys):
    cls = create_model("repmlp_fmnist")
    pairs = ["--pairs", str(face_data / "pairs.txt"), "--folds", "2", "--device", "cpu", "--workers", "0"]
    cases = [
        (
            {"dataset": "fashion-mnist"},
            "holds an image classifier (repmlp_fmnist), not a face embedding model",
        ),
        ({"task": "seg"}, "holds a segmentation model (repmlp_fmnist)"),
        (None, "holds model 'repmlp_fmnist', not a face embedding model"),  # no record: the model decides
    ]
    for i, (extra, message) in enumerate(cases):
        path = tmp_path / f"other{i}.safetensors"
        save_model(path, cls, name="repmlp_fmnist", model_kwargs={}, form="train", extra=extra)
        assert cli_main(["eval", "--task", "face", "--checkpoint", str(path), *pairs]) == 2
        line = _user_error(capsys)
        assert message in line and "repmlp train --task face" in line


def test_face_training_sizes_models_and_identities(face_data, tmp_path, capsys):
    base = ["train", "--task", "face", "--data-dir", str(face_data / "train"), "--iterations", "1",
            "--batch-size", "2", "--device", "cpu", "--workers", "0"]  # fmt: skip
    small = {"width": 16, "embedding_dim": 24, "img_size": 32}
    mfn = ["--model", "mobilefacenet", *model_arg_options(small)]
    # --model-arg img_size alone sizes the data too (it used to be --img-size's 96: a crash).
    out = tmp_path / "mfn"
    assert cli_main([*base, *mfn, "--output", str(out)]) == 0
    assert json.loads(read_metadata(out / "deploy.safetensors")["model_kwargs"])["img_size"] == 32
    capsys.readouterr()
    bad = [
        ([*mfn, "--img-size", "64"], "--model-arg img_size 32 differs from --img-size 64"),
        # Face models return an embedding (N, embedding_dim); a classifier is refused, not trained.
        (
            ["--model", "repmlp_fmnist", "--img-size", "32"],
            "model 'repmlp_fmnist' is not a face embedding model",
        ),
    ]
    for extra, message in bad:
        assert cli_main([*base, *extra, "--output", str(tmp_path / "x")]) == 2
        assert message in _user_error(capsys)
    # One identity: the AM-Softmax loss would be 0 whatever the model (it used to "train" at loss 0.0000).
    make_faces(tmp_path / "one", 1, 4)
    args = [a if a != str(face_data / "train") else str(tmp_path / "one") for a in base]
    assert cli_main([*args, *mfn, "--output", str(tmp_path / "o")]) == 2
    assert "holds 1 identity; face training needs at least 2" in _user_error(capsys)
    assert not (tmp_path / "o" / "model.safetensors").exists()


def test_face_eval_names_diverged_weights(face_data, trained_face, tmp_path, capsys, monkeypatch):
    model = load_model(trained_face / "model.safetensors")
    meta = model.metadata
    sets = ["--probe", str(face_data / "probe"), "--gallery", str(face_data / "gallery"), "--device", "cpu",
            "--workers", "0"]  # fmt: skip

    def save_eval(name: str, *extra: str) -> int:
        save_model(tmp_path / name, model, name=meta.name, model_kwargs=meta.model_kwargs, form="train",
                   extra=meta.extra, check=False)  # fmt: skip
        return cli_main(["eval", "--task", "face", "--checkpoint", str(tmp_path / name), *sets, *extra])

    assert_diverged_weights_are_clear_errors(model, save_eval, lambda: _user_error(capsys))

    # A finite training form whose conversion gives NaN is the conversion's fault, and said so.
    class Broken(torch.nn.Module):
        def forward(self, x):
            return torch.full((len(x), 32), float("nan"))

    monkeypatch.setattr(repmlp.nn.convert, "reparameterize_model", lambda m: Broken())
    rc = cli_main(["eval", "--task", "face", "--checkpoint", str(trained_face / "model.safetensors"), *sets,
                   "--check-conversion"])  # fmt: skip
    assert rc == 2 and "training form's are finite: the conversion failed" in _user_error(capsys)


def test_face_eval_set_errors_come_before_progress_bars(face_data, trained_face, capsys):
    rc = cli_main(["eval", "--task", "face", "--checkpoint", str(trained_face / "model.safetensors"),
                   "--pairs", str(face_data / "pairs.txt"), "--device", "cpu", "--workers", "0"])  # fmt: skip
    assert rc == 2
    assert capsys.readouterr().err == "repmlp: error: 8 pairs are too few for 10 folds\n"  # no bar text
