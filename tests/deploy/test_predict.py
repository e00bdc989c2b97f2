"""``repmlp predict``, ``repmlp.load_model`` and ``repmlp.Predictor`` on real image files.

The images are Fashion-MNIST's own test images (Debian's package; generated ones where it is missing)
written by the tests as files of several formats and modes, plus files the tests corrupt. The model is a
tiny ``repmlp_fmnist`` with random weights and BatchNorm statistics: predictions need not be right, only
the same as ``repmlp eval``'s on the same images.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import repmlp
from repmlp import cli
from repmlp.data.fashion_mnist import CLASSES, DEBIAN_DIR, load_fashion_mnist
from repmlp.io.model_file import save_model
from repmlp_testdata import make_fashion_mnist, make_image_folder, subprocess_env, user_error_line

NAME = "repmlp_fmnist"
KWARGS = {"widths": [4, 8], "kernel_sizes": [1, 3, 5]}
N_IMAGES = 96  # test images written as PNG files


def tiny_model(seed: int = 0, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = repmlp.create_model(NAME, **{**KWARGS, **kwargs})
    for m in model.modules():  # BatchNorm statistics that make the outputs differ between images
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.3, 0.3)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 2.0)
    return model.eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory, one_thread) -> dict[str, Path]:
    """Model files of every form and precision, and the test images as lossless PNGs ``NNNN_label.png``."""
    from repmlp import reparameterize_model, to_precision

    root = tmp_path_factory.mktemp("predict")
    data_dir = DEBIAN_DIR if DEBIAN_DIR.is_dir() else make_fashion_mnist(root / "fmnist", n_test=N_IMAGES)
    images, labels = load_fashion_mnist(Path(data_dir) if DEBIAN_DIR.is_dir() else data_dir, train=False)
    folder = root / "images"
    folder.mkdir()
    for i in range(N_IMAGES):
        Image.fromarray(images[i, 0]).save(folder / f"{i:04d}_{labels[i]}.png")
    model = tiny_model()
    extra = {"dataset": "fashion-mnist", "data_dir": str(data_dir), "classes": CLASSES}
    out = {"images": folder, "data_dir": Path(data_dir), "root": root}
    save = dict(name=NAME, model_kwargs=KWARGS, extra=extra)
    save_model(root / "model.safetensors", model, form="train", **save)
    deployed = reparameterize_model(model)
    save_model(root / "deploy.safetensors", deployed, form="deploy", **save)
    save_model(
        root / "bf16.safetensors", to_precision(deployed, "bf16"), form="deploy", precision="bf16", **save
    )
    out.update({k: root / f"{k}.safetensors" for k in ("model", "deploy", "bf16")})
    return out


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    status = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_predict_equals_eval_on_the_data_sets_test_images(files, capsys, tmp_path):
    """Same images as files: the same top-1 accuracy as ``repmlp eval``, and the same probabilities as the
    evaluation loader's logits (so the preprocessing is the evaluation transform)."""
    from repmlp.data import DataConfig, build_data
    from repmlp.tasks.classification_report import predict as eval_logits

    status, out, _ = run_cli(
        capsys, "eval", "--checkpoint", files["model"], "--val-limit", N_IMAGES, "--json"
    )
    assert status == 0
    top1 = json.loads(out)["top1"]
    csv_path = tmp_path / "pred.csv"
    status, _, err = run_cli(capsys, "predict", "--checkpoint", files["model"], files["images"],
                             "--output", csv_path, "--workers", 0, "--batch-size", 40)  # fmt: skip
    assert status == 0, err
    rows = read_csv(csv_path)
    assert [Path(r["path"]).name for r in rows] == sorted(p.name for p in files["images"].iterdir())
    truth = [int(Path(r["path"]).stem.split("_")[1]) for r in rows]
    assert 100 * np.mean([int(r["index_1"]) == t for r, t in zip(rows, truth, strict=True)]) == top1
    assert list(rows[0]) == ["path"] + [f"{c}_{i}" for i in range(1, 6) for c in ("label", "prob", "index")]
    assert rows[0]["label_1"] == CLASSES[int(rows[0]["index_1"])]

    data = build_data(DataConfig(data_dir=str(files["data_dir"]), need_train=False, val_limit=N_IMAGES))
    logits, _ = eval_logits(repmlp.load_model(files["model"]), data.val, torch.device("cpu"))
    probs = torch.softmax(logits, 1)
    got = torch.tensor([[float(r[f"prob_{k}"]) for k in range(1, 6)] for r in rows])
    idx = torch.tensor([[int(r[f"index_{k}"]) for k in range(1, 6)] for r in rows])
    assert torch.equal(idx[:, 0], logits.argmax(1))
    torch.testing.assert_close(got, probs.gather(1, idx), rtol=1e-5, atol=1e-6)


def test_every_model_file_form_and_precision_predicts(files):
    """Training-time, deployed, bf16 and int8 files load with their metadata and agree on the images."""
    paths = sorted(str(p) for p in files["images"].iterdir())[:16]
    tops = {}
    for kind in ("model", "deploy", "bf16"):
        model = repmlp.load_model(files[kind])
        meta = model.metadata
        assert (meta.name, meta.classes, meta.num_classes, meta.input_size) == (
            NAME,
            CLASSES,
            10,
            (1, 28, 28),
        )
        assert meta.form == ("train" if kind == "model" else "deploy") and not model.training
        assert meta.precision == ("bf16" if kind == "bf16" else "fp32")
        tops[kind] = [r.top_k for r in repmlp.Predictor(model, top_k=3).predict_files(paths, workers=0)]
    assert [t[0].index for t in tops["model"]] == [t[0].index for t in tops["deploy"]]
    for a, b in zip(tops["model"], tops["deploy"], strict=True):
        assert abs(a[0].probability - b[0].probability) < 1e-4
    agree = np.mean([a[0].index == b[0].index for a, b in zip(tops["model"], tops["bf16"], strict=True)])
    assert agree >= 0.75  # bf16 rounding may flip a near tie, not most images


def test_int8_file_predicts(files, tmp_path):
    pytest.importorskip("onnxruntime")
    from repmlp.deploy.precision import quantize_int8

    deployed = repmlp.load_model(files["deploy"])
    x = torch.stack([repmlp.Predictor(deployed).preprocess(Image.open(p)) for p in
                     sorted(files["images"].iterdir())[:32]])  # fmt: skip
    save_model(
        tmp_path / "int8.safetensors",
        quantize_int8(deployed, (1, 28, 28), [x]),
        name=NAME,
        model_kwargs=KWARGS,
        form="deploy",
        precision="int8",
        extra={**deployed.metadata.extra, "input_size": [1, 28, 28]},
    )
    predictor = repmlp.Predictor(tmp_path / "int8.safetensors", top_k=2)
    assert predictor.metadata.precision == "int8" and predictor.labels == CLASSES
    ref = repmlp.Predictor(deployed, top_k=1).predict(x)
    got = predictor.predict(x)
    assert len(got) == 32 and all(len(t) == 2 for t in got)
    assert np.mean([a[0].index == b[0].index for a, b in zip(ref, got, strict=True)]) >= 0.75


def _write_formats(image: np.ndarray, folder: Path) -> dict[str, Path]:
    """One 28x28 grey image in many formats and modes; the lossless ones hold exactly its grey values."""
    folder.mkdir()
    grey = Image.fromarray(image)
    rgb = grey.convert("RGB")
    alpha = Image.fromarray(np.full_like(image, 200))
    made = {
        "png_L": (grey, "a.png"),
        "png_I16": (Image.fromarray(image.astype(np.uint16) * 257), "b.png"),
        "png_LA": (Image.merge("LA", (grey, alpha)), "c.png"),
        "webp_RGBA": (Image.merge("RGBA", (*rgb.split(), alpha)), "d.webp"),
        "bmp_RGB": (rgb, "e.bmp"),
        "tiff_L": (grey, "f.tiff"),
        "gif_P": (grey.convert("P"), "g.gif"),
        "png_P": (rgb.quantize(256), "h.png"),
        "jpeg_RGB": (rgb, "i.jpg"),
        "tiff_CMYK": (rgb.convert("CMYK"), "j.tif"),
    }
    out = {}
    for key, (img, name) in made.items():
        img.save(folder / name, **({"lossless": True} if name.endswith(".webp") else {}))
        out[key] = folder / name
    return out


def test_formats_and_modes(files, tmp_path):
    """Every format and mode becomes the one-channel input; lossless grey files predict identically."""
    image = np.asarray(Image.open(sorted(files["images"].iterdir())[0]))
    paths = _write_formats(image, tmp_path / "formats")
    assert Image.open(paths["png_I16"]).mode.startswith("I")  # really a 16-bit file
    assert Image.open(paths["tiff_CMYK"]).mode == "CMYK" and Image.open(paths["gif_P"]).mode == "P"
    predictor = repmlp.Predictor(files["model"], top_k=10)
    results = {k: r for k, r in zip(paths, predictor.predict_files(list(map(str, paths.values())), workers=0),
                                    strict=True)}  # fmt: skip
    assert all(r.error is None for r in results.values()), results
    exact = ("png_L", "png_I16", "png_LA", "webp_RGBA", "bmp_RGB", "tiff_L")
    for key in exact:
        assert results[key].top_k == results["png_L"].top_k, key
    for key in ("gif_P", "png_P", "jpeg_RGB", "tiff_CMYK"):  # near-lossless: close, not equal
        assert abs(results[key].top_k[0].probability - results["png_L"].top_k[0].probability) < 0.05, key


def test_worker_processes_give_the_same_results(files, tmp_path):
    """Decoding in DataLoader worker processes (batches ahead of the model) and in this process give the
    same results in the same order, bad files included."""
    paths = [str(p) for p in sorted(files["images"].iterdir())[:10]]
    (tmp_path / "bad.png").write_bytes(Path(paths[0]).read_bytes()[:70])
    paths.insert(3, str(tmp_path / "bad.png"))
    predictor = repmlp.Predictor(files["deploy"], top_k=3)
    here = list(predictor.predict_files(paths, batch_size=4, workers=0))
    ahead = list(predictor.predict_files(paths, batch_size=4, workers=2))
    assert here == ahead
    assert [r.error is None for r in here] == [p != str(tmp_path / "bad.png") for p in paths]


def test_python_api_inputs_and_labels(files, tmp_path):
    predictor = repmlp.Predictor(files["deploy"], top_k=3, labels=[f"c{i}" for i in range(10)])
    path = sorted(files["images"].iterdir())[0]
    by_path = predictor.predict(path)
    by_pil = predictor.predict([Image.open(path), str(path)])
    x = predictor.preprocess(Image.open(path))
    assert x.shape == (1, 28, 28)
    by_tensor = predictor.predict(x[None])
    # One image alone and in a batch of two: the same classes and the same probabilities up to float
    # rounding (the CPU's matmul kernels may block a batch of one differently: last bits on AVX2 machines).
    for other in (by_pil[0], by_pil[1], by_tensor[0]):
        assert [(p.label, p.index) for p in other] == [(p.label, p.index) for p in by_path[0]]
        torch.testing.assert_close([p.probability for p in other], [p.probability for p in by_path[0]])
    assert by_pil[0] == by_pil[1]  # the same image twice in one batch
    label, index, probability = by_path[0][0]
    assert label == f"c{index}" and 0 < probability <= 1
    assert [p.probability for p in by_path[0]] == sorted((p.probability for p in by_path[0]), reverse=True)
    with pytest.raises(repmlp.errors.UserError, match="cannot read image"):
        predictor.predict(tmp_path / "missing.png")
    # Tensors it cannot take: one ValueError saying what it takes, whatever is wrong.
    nan = x[None].clone()
    nan[0, 0, 0, 0] = float("nan")
    bad = [nan, x[None][:0], (x * 255).to(torch.uint8), torch.empty(1, 1, 28, 28, device="meta"), x[None].double(),
           torch.zeros(2, 3, 28, 28), torch.zeros(28, 28)]  # fmt: skip
    for t in bad:
        with pytest.raises(ValueError, match=r"predict takes a finite float32 batch \(N, 1, H, W\)"):
            predictor.predict(t)


def test_three_channel_folder_model_matches_eval(tmp_path, capsys, one_thread):
    """An ImageFolder run's model (3 channels, resize + centre crop): predict's top-1 equals eval's."""
    data = make_image_folder(tmp_path / "folder", classes=3, per_class=6, size=40)
    classes = ["class0", "class1", "class2"]
    kwargs = {**KWARGS, "in_chans": 3, "num_classes": 3}
    save_model(tmp_path / "m.safetensors", tiny_model(1, in_chans=3, num_classes=3), name=NAME,
               model_kwargs=kwargs, form="train", extra={"dataset": "imagefolder", "data_dir": str(data),
               "classes": classes, "input_size": [3, 28, 28]})  # fmt: skip
    status, out, _ = run_cli(capsys, "eval", "--checkpoint", tmp_path / "m.safetensors", "--json",
                             "--workers", 0)  # fmt: skip
    assert status == 0
    status, out2, err = run_cli(capsys, "predict", "--checkpoint", tmp_path / "m.safetensors",
                                f"{data}/val/*/*.png", "--json", "--workers", 0, "--top-k", 2)  # fmt: skip
    assert status == 0, err
    records = json.loads(out2)
    assert len(records) == 18 and all(len(r["top_k"]) == 2 for r in records)
    hits = [r["top_k"][0]["label"] == Path(r["path"]).parent.name for r in records]
    assert 100 * np.mean(hits) == pytest.approx(json.loads(out)["top1"])


def test_bad_files_are_skipped_and_named_end_to_end(files, tmp_path):
    """The real program: corrupted files named on stderr, one line each; the rest predicted and written
    (JSON Lines); exit status 1; no traceback."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    good = sorted(files["images"].iterdir())[:3]
    for p in good:
        (folder / p.name).write_bytes(p.read_bytes())
    Image.open(good[0]).convert("RGB").save(folder / "z_ok.jpg", quality=95)
    jpeg = (folder / "z_ok.jpg").read_bytes()
    bad = {
        "empty.png": b"",
        "text.jpg": b"hello, not an image\n",
        "truncated.jpg": jpeg[: len(jpeg) // 2],
        "truncated.png": good[1].read_bytes()[:60],
    }
    for name, data in bad.items():
        (folder / name).write_bytes(data)
    out = tmp_path / "out.jsonl"
    res = subprocess.run(
        [sys.executable, "-m", "repmlp", "predict", "--checkpoint", str(files["deploy"]), str(folder),
         str(tmp_path / "missing.png"), "--output", str(out), "--top-k", "2", "--batch-size", "3"],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    skipped = [ln for ln in res.stderr.splitlines() if ln.startswith("repmlp: skipped ")]
    assert sorted(re.match(r"repmlp: skipped (\S+):", ln).group(1) for ln in skipped) == sorted(
        [str(folder / n) for n in bad] + [str(tmp_path / "missing.png")]
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [Path(r["path"]).name for r in records] == [p.name for p in good] + ["z_ok.jpg"]
    assert all(set(r["top_k"][0]) == {"label", "index", "probability"} for r in records)
    assert len(res.stdout.splitlines()) == 1 + len(records)  # the table: a header and one row per image


def test_user_errors_are_one_line(files, tmp_path, capsys):
    image = str(sorted(files["images"].iterdir())[0])
    labels = tmp_path / "labels.txt"
    labels.write_text("a\nb\nc\n")
    state = tmp_path / "state.safetensors"
    from repmlp.io.state import save_state

    save_state(state, {"step": 1})
    out = tmp_path / "out.csv"
    cases = [
        ([tmp_path / "nothing.png"], "no input images"),
        ([tmp_path], "no input images"),
        ([image, "--checkpoint", tmp_path / "none.safetensors"], "checkpoint not found"),
        ([image, "--checkpoint", state], "training state"),
        ([image, "--labels", labels, "--output", out], "labels file"),
    ]
    for argv, fragment in cases:
        full = ["predict", "--checkpoint", files["model"], *argv]
        status, _, err = run_cli(capsys, *full)
        assert status == 2, (argv, err)
        assert fragment in user_error_line(err), (argv, err)
    assert not out.exists()
    labels.write_text("\n".join(f"name{i}" for i in range(10)) + "\n\n")
    status, out_text, _ = run_cli(
        capsys, "predict", "--checkpoint", files["model"], image, "--labels", labels
    )
    assert status == 0 and "name" in out_text.splitlines()[1]


@pytest.mark.parametrize(
    ("task", "kind"), [("face", "a face embedding model"), ("seg", "a segmentation model")]
)
def test_prediction_refuses_a_face_or_segmentation_file_that_loads(files, tmp_path, capsys, task, kind):
    """Loading is for every model file; prediction (the Python API and ``repmlp predict``) for classifiers."""
    path = tmp_path / f"{task}.safetensors"
    save_model(path, tiny_model(), name=NAME, model_kwargs=KWARGS, form="train", extra={"task": task})
    model = repmlp.load_model(path)
    assert model.metadata.extra["task"] == task
    message = f"{path} holds {kind} ({NAME}), not an image classifier"
    for source in (path, model):
        with pytest.raises(repmlp.errors.UserError, match=re.escape(message)):
            repmlp.Predictor(source)
    labels = tmp_path / "labels.txt"
    labels.write_text("a\n")  # the wrong count: the model's kind is what the error names
    image = sorted(files["images"].iterdir())[0]
    status, _, err = run_cli(capsys, "predict", "--checkpoint", path, image, "--labels", labels)
    assert status == 2 and message in user_error_line(err)


def test_help_documents_the_exit_status(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["predict", "--help"])
    text = capsys.readouterr().out
    assert "1 some inputs were skipped" in text and "2 an" in text


def test_readme_example_runs(files, tmp_path, monkeypatch):
    """The Python example of README.md, executed as it is, next to the files it names."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"<!-- predict-example -->\s*```python\n(.*?)```", readme, re.S)
    assert block, "README.md lost its predict example"
    run = tmp_path / "runs" / "X"
    run.mkdir(parents=True)
    (run / "deploy.safetensors").write_bytes(files["deploy"].read_bytes())
    (tmp_path / "shoe.png").write_bytes(sorted(files["images"].iterdir())[0].read_bytes())
    monkeypatch.chdir(tmp_path)
    exec(compile(block.group(1), "README.md", "exec"), {})


def test_imported_imagenet_models_get_imagenet_class_names():
    from repmlp.io.importer import imagenet_class_names

    names = imagenet_class_names(1000)
    assert len(names) == 1000 and names[0].startswith("tench") and names[999].startswith("toilet tissue")
    assert imagenet_class_names(5) is None


def test_predictor_of_a_plain_module_uses_its_timm_config():
    model = tiny_model()  # no file, no metadata: repmlp_fmnist's cfg (28x28, one channel, its mean/std)
    predictor = repmlp.Predictor(model, top_k=2)
    assert predictor.labels == [str(i) for i in range(10)] and predictor.input_size == (1, 28, 28)
    image = Image.fromarray(np.zeros((28, 28), np.uint8))
    assert predictor.preprocess(image).shape == (1, 28, 28) and len(predictor.predict(image)[0]) == 2
