"""``repmlp import``: RepMLPNet checkpoints in the authors' and mmpretrain's key layouts, written as those
projects publish them (``torch.save`` of a dict), imported and compared output for output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_repmlpnet import randomize
from torch import Tensor

from repmlp import create_model
from repmlp.io.importer import WeightsImportError, import_checkpoint
from repmlp.io.model_file import load_model, read_metadata
from repmlp.models.repmlpnet import RepMLPNetBlock
from repmlp_testdata import run_cli, subprocess_env, user_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "repmlpnet_b224"
ARCH = dict(img_size=48, patch_size=2, channels=[8, 16, 16, 32], depths=[1, 1, 2, 1], sharesets=[2, 4, 4, 8])
MODEL_ARGS = [f"{k}={json.dumps(v)}" for k, v in ARCH.items()]
KERNELS = (1, 3)


def ours(num_classes: int = 5) -> torch.nn.Module:
    torch.manual_seed(0)
    return randomize(create_model(NAME, num_classes=num_classes, **ARCH), seed=3).float().eval()


def _rename(sd: dict[str, Tensor], rules: list[tuple[str, object]]) -> dict[str, Tensor]:
    out = {}
    for key, value in sd.items():
        for pattern, repl in rules:
            m = re.fullmatch(pattern, key)
            if m:
                new = repl(m) if callable(repl) else m.expand(repl)
                if new.endswith("repmlp_block.fc3.weight"):
                    value = value.reshape(*value.shape, 1, 1)
                out[new] = value.clone()
                break
        else:
            raise AssertionError(f"test mapping misses {key}")
    return out


_BLOCK = r"stages\.(\d+)\.blocks\.(\d+)\."


def to_authors(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our names -> the authors' repmlpnet.py names (conv_embedding, prebn1, repconvK, embeds, head_norm)."""
    return _rename(
        sd,
        [
            (r"stem\.(.+)", r"conv_embedding.\1"),
            (r"stages\.(\d+)\.downsample\.(.+)", lambda m: f"embeds.{int(m[1]) - 1}.{m[2]}"),
            (_BLOCK + r"norm([12])\.(.+)", r"stages.\1.\2.prebn\3.\4"),
            (
                _BLOCK + r"repmlp\.local\.branches\.(\d+)\.(.+)",
                lambda m: f"stages.{m[1]}.{m[2]}.repmlp_block.repconv{KERNELS[int(m[3])]}.{m[4]}",
            ),  # noqa: E501
            (_BLOCK + r"repmlp\.(.+)", r"stages.\1.\2.repmlp_block.\3"),
            (_BLOCK + r"ffn\.fc([12])\.(.+)", r"stages.\1.\2.ffn_block.ffn_fc\3.\4"),
            (r"norm\.(.+)", r"head_norm.\1"),
            (r"head\.(.+)", r"head.\1"),
        ],
    )


def to_mmpretrain(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our names -> mmpretrain's RepMLPNet backbone + LinearClsHead names."""
    return _rename(
        sd,
        [
            (r"stem\.conv\.(.+)", r"backbone.patch_embed.projection.\1"),
            (r"stem\.bn\.(.+)", r"backbone.patch_embed.norm.\1"),
            (
                r"stages\.(\d+)\.downsample\.(.+)",
                lambda m: f"backbone.downsample_layers.{int(m[1]) - 1}.{m[2]}",
            ),
            (_BLOCK + r"norm([12])\.(.+)", r"backbone.stages.\1.\2.norm\3.\4"),
            (_BLOCK + r"repmlp\.gp\.fc([12])\.(.+)", r"backbone.stages.\1.\2.repmlp_block.gp.conv\3.conv.\4"),
            (
                _BLOCK + r"repmlp\.local\.branches\.(\d+)\.(.+)",
                lambda m: f"backbone.stages.{m[1]}.{m[2]}.repmlp_block.repconv{KERNELS[int(m[3])]}.{m[4]}",
            ),  # noqa: E501
            (_BLOCK + r"repmlp\.(.+)", r"backbone.stages.\1.\2.repmlp_block.\3"),
            (_BLOCK + r"ffn\.fc([12])\.(.+)", r"backbone.stages.\1.\2.ffn_block.ffn_fc\3.\4"),
            (r"norm\.(.+)", r"backbone.final_norm.\1"),
            (r"head\.(.+)", r"head.fc.\1"),
        ],
    )


def injected(model: torch.nn.Module) -> dict[str, Tensor]:
    """The authors' locality_injection(): only the RepMLP blocks convert; conv+BN pairs stay."""
    import copy

    m = copy.deepcopy(model)
    for block in m.modules():
        if isinstance(block, RepMLPNetBlock):
            block.reparameterize()
    return m.state_dict()


def _x() -> Tensor:
    return torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(1))


def _same(a: Tensor, b: Tensor, tol: float) -> bool:
    return ((a - b).abs().max() / b.abs().max()).item() < tol


@pytest.mark.parametrize(
    "wrap, layout_fn, form",
    [
        (lambda sd: sd, to_authors, "train"),
        (lambda sd: {"model": {f"module.{k}": v for k, v in sd.items()}}, to_authors, "train"),
        (lambda sd: {"model": {f"module.{k}": v for k, v in sd.items()}}, to_authors, "deploy"),
        (
            lambda sd: {"meta": {"epoch": 300, "CLASSES": ["a", "b"]}, "state_dict": sd},
            to_mmpretrain,
            "train",
        ),
        (lambda sd: {"state_dict": sd}, to_mmpretrain, "deploy"),
    ],
    ids=[
        "authors-train",
        "authors-ddp-nested",
        "authors-injected",
        "mmpretrain-train",
        "mmpretrain-injected",
    ],
)
def test_import_round_trip(tmp_path, wrap, layout_fn, form):
    model = ours()
    sd = model.state_dict() if form == "train" else injected(model)
    path = tmp_path / "released.pth"
    torch.save(wrap(layout_fn(sd)), path)
    res = import_checkpoint(path, NAME, dict(ARCH))
    assert res["form"] == form and res["model_kwargs"]["num_classes"] == 5
    with torch.no_grad():
        ref, out = model(_x()), res["model"](_x())
    assert _same(out, ref, 1e-5 if form == "deploy" else 1e-7)


def _cli(*args: str, cwd: Path, process: bool = False):
    """``repmlp *args`` run in ``cwd``: a ``python -m repmlp`` process if ``process``, else
    :func:`repmlp.cli.main` in this process (the working directory changed for the call)."""
    if process:
        return subprocess.run(
            [sys.executable, "-m", "repmlp", *args],
            capture_output=True,
            text=True,
            env=subprocess_env(),
            cwd=cwd,
        )
    before = os.getcwd()
    os.chdir(cwd)
    try:
        return run_cli(*args)
    finally:
        os.chdir(before)


def test_cli_import_then_convert(tmp_path):
    model = ours()
    torch.save(to_authors(model.state_dict()), tmp_path / "RepMLPNet-train.pth")
    args = [part for arg in MODEL_ARGS for part in ("--model-arg", arg)]
    res = _cli(  # the one import run as a real process
        "import", "RepMLPNet-train.pth", "--model", NAME, "--output", "m.safetensors", *args, cwd=tmp_path,
        process=True,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "authors layout, train form" in res.stdout
    meta = read_metadata(tmp_path / "m.safetensors")
    assert meta["form"] == "train" and json.loads(meta["extra"])["eval_preprocessing"]["crop_pct"] == 0.875
    loaded = load_model(tmp_path / "m.safetensors")
    with torch.no_grad():
        assert torch.equal(loaded(_x()), model(_x()))
    res = _cli("convert", "--checkpoint", "m.safetensors", "--output", "d.safetensors", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    res = _cli("viz", "--checkpoint", "m.safetensors", "--output", "fc3.png", cwd=tmp_path)
    assert res.returncode == 0 and (tmp_path / "fc3.png").stat().st_size > 0, res.stderr
    deployed = load_model(tmp_path / "d.safetensors")
    assert deployed.metadata.form == "deploy"
    with torch.no_grad():
        assert _same(deployed(_x()), model(_x()), 1e-5)


class _RunsCode:
    """A pickled object whose loading would call os.system (what weights_only=True refuses)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_file_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "code-ran"
    sd = to_authors(ours().state_dict())
    torch.save({"model": sd, "extra": _RunsCode(marker)}, tmp_path / "evil.pth")
    res = _cli("import", "evil.pth", "--model", NAME, "--output", "out.safetensors", cwd=tmp_path)
    assert res.returncode == 2
    line = user_error_line(res.stderr)
    assert "refusing to load" in line and "could run code" in line
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()


def test_missing_unused_and_wrong_model_are_errors(tmp_path):
    sd = to_authors(ours().state_dict())
    extra = dict(sd, **{"stages.0.0.extra_layer.weight": torch.zeros(1)})
    torch.save(extra, tmp_path / "extra.pth")
    with pytest.raises(
        WeightsImportError, match=r"fit no key of the authors layout: stages\.0\.0\.extra_layer\.weight"
    ):
        import_checkpoint(tmp_path / "extra.pth", NAME, dict(ARCH))
    missing = {k: v for k, v in sd.items() if k != "stages.1.0.ffn_block.ffn_fc2.bn.weight"}
    torch.save(missing, tmp_path / "missing.pth")
    with pytest.raises(
        WeightsImportError, match=r"1 missing from the file: stages\.1\.blocks\.0\.ffn\.fc2\.bn\.weight"
    ):
        import_checkpoint(tmp_path / "missing.pth", NAME, dict(ARCH))
    torch.save(sd, tmp_path / "ok.pth")
    with pytest.raises(WeightsImportError, match=r"not a repmlpnet_b224: its channels \(8, 16, 16, 32\)"):
        import_checkpoint(tmp_path / "ok.pth", NAME)
    torch.save({"weights": [1, 2]}, tmp_path / "odd.pth")
    with pytest.raises(WeightsImportError, match="not tensors"):
        import_checkpoint(tmp_path / "odd.pth", NAME)


def test_eval_transform_is_the_published_preprocessing():
    from PIL import Image

    from repmlp.data import folder_eval_transform as eval_transform
    from repmlp.io.importer import eval_preprocessing

    pp = eval_preprocessing("repmlpnet_b224")
    assert (pp["crop_pct"], pp["crop_mode"], pp["interpolation"]) == (0.875, "squash", "bilinear")
    resize = eval_transform(224, pp).transforms[0]
    assert tuple(resize.size) == (256, 256)  # the authors' test.py: 256x256, then centre crop 224
    tf = eval_transform(256, eval_preprocessing("repmlpnet_l256"))
    assert tf.transforms[0].size in (292, [292], (292,))  # short side 256 * 256 // 224
    assert tuple(tf(Image.new("RGB", (400, 300))).shape) == (3, 256, 256)


def test_cli_eval_of_imported_model_on_an_image_folder(tmp_path):
    from repmlp_testdata import make_image_folder

    make_image_folder(tmp_path / "data", classes=3, per_class=2, size=52)
    torch.save({"state_dict": to_mmpretrain(ours(num_classes=3).state_dict())}, tmp_path / "mm.pth")
    args = [part for arg in MODEL_ARGS for part in ("--model-arg", arg)]
    res = _cli("import", "mm.pth", "--model", NAME, "--output", "m.safetensors", *args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    res = _cli(
        "eval", "--checkpoint", "m.safetensors", "--dataset", "imagefolder", "--data-dir", "data",
        "--device", "cpu", "--workers", "0", "--json", cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["n"] == 6 and out["form"] == "train"


# ------------------------------------------------------------------------------------ RepMLP-Res50
RES_ARGS = dict(widths=[64, 128, 256, 512], img_size=112)
RES_KERNELS = (1, 3, 5)


def to_authors_res50(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our ResNet names -> the authors' repmlp_resnet.py names (stage0..4, btnk_*/light_*, linear)."""
    btnk = {"conv1": "btnk_conv1", "conv2": "btnk_conv2", "conv3": "btnk_conv4", "conv4": "btnk_conv5"}
    light = {"conv1": "light_conv1", "conv2": "light_conv3"}
    rep = {
        "global_perceptron.fc1": "fc1_fc2.fc1",
        "global_perceptron.fc2": "fc1_fc2.fc2",
        "global_perceptron.bn": "avg.bn",
        "partition_perceptron.fc3": "fc3",
        "partition_perceptron.bn": "fc3_bn",
    }

    def block(m: re.Match) -> str:
        s, j, rest = m[1], m[2], m[3]
        prefix = f"layer{s}.{j}."
        kind = (
            "btnk"
            if f"{prefix}conv4.conv.weight" in sd
            else "light"
            if f"{prefix}repmlp.partition_perceptron.fc3.weight" in sd
            else ""
        )  # noqa: E501
        head, _, tail = rest.partition(".")
        if head == "downsample":
            return f"stage{s}.{j}.shortcut.{tail}"
        if head == "repmlp":
            for ours_, theirs in rep.items():
                if tail.startswith(ours_ + "."):
                    return f"stage{s}.{j}.{kind}_repmlp.{theirs}{tail[len(ours_) :]}"
            b, _, x = tail[len("local_perceptron.branches.") :].partition(".")
            return f"stage{s}.{j}.{kind}_repmlp.repconv{RES_KERNELS[int(b)]}.{x}"
        names = btnk if kind == "btnk" else light if kind == "light" else {}
        return f"stage{s}.{j}.{names.get(head, head)}.{tail}"

    out = _rename(
        sd,
        [
            (r"stem\.conv\.(.+)", r"stage0.0.\1"),
            (r"layer(\d)\.(\d+)\.(.+)", block),
            (r"fc\.(.+)", r"linear.\1"),
        ],
    )
    return {k: v.reshape(*v.shape, 1, 1) if k.endswith("_repmlp.fc3.weight") else v for k, v in out.items()}


def res50(name: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return randomize(create_model(name, num_classes=7, **RES_ARGS, **kw), seed=5).float().eval()


def _same_res(a: torch.nn.Module, b: torch.nn.Module, tol: float) -> bool:
    x = torch.randn(2, 3, 112, 112, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return _same(b(x), a(x), tol)


@pytest.mark.parametrize(
    "name, groups, form",
    [("repmlp_res50", 8, "train"), ("repmlp_res50_light", 4, "train"), ("repmlp_res50_light", 4, "deploy")],
)
def test_import_authors_res50(tmp_path, name, groups, form):
    from repmlp import reparameterize_model

    model = res50(name, groups=[8, groups, groups, 8])
    sd = model.state_dict() if form == "train" else reparameterize_model(model).state_dict()
    torch.save({"model": to_authors_res50(sd)}, tmp_path / "res50.pth")
    res = import_checkpoint(tmp_path / "res50.pth", name, dict(RES_ARGS))
    assert res["form"] == form and res["layout"] == "authors-res50"
    assert res["model_kwargs"].get("groups", [8] * 4) == [8, groups, groups, 8]  # FC3 groups from the shapes
    assert _same_res(model, res["model"], 1e-5 if form == "deploy" else 1e-7)
    other = "repmlp_res50" if name == "repmlp_res50_light" else "repmlp_res50_light"
    with pytest.raises(WeightsImportError, match=f"not a {other}"):
        import_checkpoint(tmp_path / "res50.pth", other, dict(RES_ARGS))
