"""Face recognition: models (paper's Table face counts), data, and the train/eval pipeline end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from repmlp import reparameterize_model
from repmlp.cli import main as cli_main
from repmlp.data.face import FaceFolder, read_pairs
from repmlp.errors import UserError
from repmlp.models import create_model
from repmlp.profile import profile_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny models on a shared 2-core machine: intra-op threads only add contention (measured 50x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY = {"widths": [16, 32, 64, 128], "embedding_dim": 32, "partition": 4, "kernel_sizes": [1, 3], "groups": 2}


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
        ("repmlp_face_resnet", {**TINY, "embedding_dim": 24}, 64),
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

    small = {k: TINY[k] for k in ("widths", "groups")}
    model = timm.create_model("repmlp_face_resnet", num_classes=64, img_size=64, **small)
    assert model.embedding_dim == 64
    with pytest.raises(ValueError, match="64x64"):
        model.eval()(torch.randn(1, 3, 96, 96))


# ------------------------------------------------------------------------------------------- data
def _make_faces(root: Path, identities: int, per_id: int, size: int = 32, seed: int = 0, prefix: str = "id"):
    """Synthetic aligned 'faces': each identity a fixed random pattern, each image that plus noise."""
    rng = np.random.default_rng(seed + 1000)  # noise; the identity patterns depend on (seed, i) only
    for i in range(identities):
        base = np.random.default_rng([seed, i]).uniform(0, 255, (size // 4, size // 4, 3))
        base = np.kron(base, np.ones((4, 4, 1)))
        folder = root / f"{prefix}{i:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        for j in range(per_id):
            img = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(folder / f"{j:03d}.png")


def test_face_folder_and_clear_errors(tmp_path):
    _make_faces(tmp_path / "ok", 3, 2)
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
    _make_faces(root / "train", 4, 8, seed=1)
    # Evaluation identities are the training ones (images re-drawn), plus distractor identities.
    _make_faces(root / "probe", 4, 2, seed=1)
    _make_faces(root / "gallery", 4, 1, seed=1)
    _make_faces(root / "gallery", 3, 1, seed=7, prefix="distractor")
    lines = []
    for a in range(4):
        lines.append(f"train/id{a:02d}/000.png train/id{a:02d}/001.png 1")
        lines.append(f"train/id{a:02d}/002.png train/id{(a + 1) % 4:02d}/003.png 0")
    (root / "pairs.txt").write_text("\n".join(lines) + "\n")
    return root


TRAIN_ARGS = [
    "--model", "repmlp_face_resnet", "--model-kwargs", json.dumps(TINY), "--img-size", "32",
    "--batch-size", "16", "--iterations", "24", "--lr-steps", "18", "--lr", "0.05",
    "--am-scale", "16", "--device", "cpu", "--workers", "0", "--log-interval", "4",
]  # fmt: skip


@pytest.fixture(scope="module")
def trained_face(face_data):
    out = face_data / "run"
    rc = cli_main(
        ["train", "--task", "face", "--data", str(face_data / "train"), "--output", str(out), *TRAIN_ARGS]
    )
    assert rc == 0
    return out


def test_face_training_loss_falls(trained_face):
    history = json.loads((trained_face / "train_log.json").read_text())["history"]
    assert len(history) == 6 and history[-1]["lr"] == pytest.approx(0.005)
    assert history[-1]["loss"] < 0.7 * history[0]["loss"]


def test_face_eval_converted_model_gives_same_metrics(face_data, trained_face, capsys):
    out_json = face_data / "metrics.json"
    rc = cli_main([
        "eval", "--task", "face", "--checkpoint", str(trained_face / "model.safetensors"),
        "--pairs", str(face_data / "pairs.txt"), "--folds", "2", "--probe", str(face_data / "probe"),
        "--gallery", str(face_data / "gallery"), "--check-conversion", "--device", "cpu", "--workers", "0",
        "--output-json", str(out_json),
    ])  # fmt: skip
    assert rc == 0
    m = json.loads(out_json.read_text())
    assert m["probes"] == 8 and m["gallery"] == 7 and m["distractors"] == 3 and m["verification_pairs"] == 8
    for key in ("verification_accuracy", "rank1_identification"):
        assert m[key] == m["train_form"][key]
        assert 0.0 <= m[key] <= 1.0
    # The identities are easy: the trained embedding identifies most probes among the distractors.
    assert m["rank1_identification"] >= 0.75
    assert "rank1_identification" in capsys.readouterr().out
    # The deployed file evaluates to the same numbers.
    rc = cli_main([
        "eval", "--task", "face", "--checkpoint", str(trained_face / "deploy.safetensors"),
        "--probe", str(face_data / "probe"), "--gallery", str(face_data / "gallery"), "--device", "cpu",
        "--workers", "0", "--output-json", str(out_json),
    ])  # fmt: skip
    assert rc == 0 and json.loads(out_json.read_text())["rank1_identification"] == m["rank1_identification"]


def test_face_cli_errors_are_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "repmlp", "train", "--task", "face", "--data", str(tmp_path / "nope"),
         "--output", str(tmp_path / "o"), "--device", "cpu"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("repmlp: error:") and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_face_training_with_torchrun(face_data, tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"),
        "OMP_NUM_THREADS": "1",
    }
    args = [a if a != "24" else "8" for a in TRAIN_ARGS]
    args[args.index("--lr-steps") + 1] = "6"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
         "-m", "repmlp", "train", "--task", "face", "--data", str(face_data / "train"),
         "--output", str(tmp_path / "ddp"), *args],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    history = json.loads((tmp_path / "ddp" / "train_log.json").read_text())["history"]
    assert history[-1]["iteration"] == 8
    assert (tmp_path / "ddp" / "deploy.safetensors").is_file()
