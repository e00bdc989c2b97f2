"""``repmlp convert / export / bench / viz / tables`` through the real entry point, and their library code.

A tiny ``repmlp_fmnist`` (two stages of 4 and 8 channels, 7x7 partitions, K=1,3,5) saved with
``repmlp.io.model_file.save_model`` stands in for a trained run, so no test depends on training.
The commands run through ``repmlp.cli.main`` in this process (the function the console script runs,
which returns the exit status), to keep the suite fast on two cores; the ONNX/TorchScript export runs as a
real ``python -m repmlp`` process, end to end.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import repmlp
from repmlp import cli
from repmlp.io.model_file import load_model, save_model
from repmlp_testdata import make_fashion_mnist, run_cli, subprocess_env, user_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "repmlp_fmnist"
KWARGS = {"widths": [4, 8], "kernel_sizes": [1, 3, 5]}
INPUT = (1, 28, 28)


def repmlp_process(*args: object, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m repmlp ARGS`` (the console script's program) of this checkout, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "repmlp", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(),
    )


repmlp_cli = run_cli  # ``repmlp ARGS`` through repmlp.cli.main in this process, output captured


def assert_user_error(res, *fragments: str) -> None:
    """Exit status 2, one ``repmlp: error:`` line ending stderr (after any progress logs), no traceback."""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert lines and lines[-1].startswith("repmlp: error: "), res.stderr
    assert sum("error" in ln.lower() for ln in lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """The test model with non-trivial BatchNorm statistics (so conversion has something to fold)."""
    torch.manual_seed(seed)
    model = repmlp.create_model(NAME, **KWARGS)
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.3, 0.3)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 2.0)
            m.bias.data.uniform_(-0.3, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run folder: ``model.safetensors`` (training-time) whose metadata names a generated Fashion-MNIST."""
    root = tmp_path_factory.mktemp("run")
    data = make_fashion_mnist(root / "fmnist", n_train=16, n_test=40)
    save_model(
        root / "model.safetensors",
        tiny_model(),
        name=NAME,
        model_kwargs=KWARGS,
        form="train",
        extra={"dataset": "fashion-mnist", "data_dir": str(data)},
    )
    return root


@pytest.fixture(scope="module")
def deployed(run_dir) -> Path:
    """``repmlp convert`` of the run (also the convert test itself)."""
    res = repmlp_cli("convert", "--checkpoint", run_dir / "model.safetensors", "--num-examples", 32)
    assert res.returncode == 0, res.stderr
    # Real inputs: the run's (generated) validation set, found through the checkpoint's metadata.
    assert "32 fashion-mnist validation images" in res.stdout, res.stdout
    err = float(re.search(r"max abs error deployed vs training-time: (\S+)", res.stdout).group(1))
    assert err < 1e-4
    return run_dir / "deploy.safetensors"


def fmnist_batch(run_dir: Path, n: int = 8) -> torch.Tensor:
    from repmlp.data import DataConfig, build_data

    data = build_data(
        DataConfig(data_dir=str(run_dir / "fmnist"), need_train=False, eval_batch_size=n, workers=0)
    )
    return next(iter(data.val.batches(0)))[0]


def test_convert_writes_a_checkpoint_that_a_deploy_model_loads(run_dir, deployed):
    model = load_model(deployed, form="deploy")  # create_model(NAME, deploy=True) + strict load
    assert model.metadata.name == NAME and model.metadata.model_kwargs == KWARGS
    assert model.metadata.extra["dataset"] == "fashion-mnist"  # the run's metadata travels with it
    blocks = [m for m in model.modules() if isinstance(m, repmlp.RepMLPBlock)]
    assert blocks and all(b.deploy and b.local_perceptron is None for b in blocks)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    train = load_model(run_dir / "model.safetensors", form="train")
    x = fmnist_batch(run_dir)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), train(x), rtol=1e-4, atol=1e-5)


def test_convert_keeps_existing_output_when_the_check_fails(run_dir, tmp_path, capsys):
    out = tmp_path / "deploy.safetensors"
    save_model(out, repmlp.reparameterize_model(tiny_model(1)), name=NAME, model_kwargs=KWARGS, form="deploy",
               extra={"previous": True})  # fmt: skip
    previous = out.read_bytes()
    # Without --force an existing file is refused before any work.
    argv = ["convert", "--checkpoint", str(run_dir / "model.safetensors"), "--output", str(out)]
    assert cli.main(argv) == 2
    assert "already exists: add --force" in capsys.readouterr().err
    # No float32 conversion is exact to 1e-30: the check fails after the file was staged.
    assert cli.main([*argv, "--force", "--tolerance", "1e-30"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert "differs from the training-time model" in err and "not written" in err
    assert out.read_bytes() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deploy.safetensors"]  # no temp file left


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")
@pytest.mark.slow
def test_export_onnx_and_torchscript_match_pytorch(run_dir, tmp_path):
    import onnxruntime as ort

    # From the training-time checkpoint: export converts first, so the graph is the deployed one.
    res = repmlp_process(
        "export",
        "--checkpoint",
        run_dir / "model.safetensors",
        "--format",
        "both",
        "--output",
        tmp_path / "m",
    )
    assert res.returncode == 0, res.stderr
    assert "onnxruntime vs PyTorch max diff" in res.stdout
    train = load_model(run_dir / "model.safetensors")
    x = fmnist_batch(run_dir, n=5)  # a batch size the exporter never saw
    with torch.inference_mode():
        ref = train(x)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-4, atol=1e-5)
    ops = {node.op_type for node in __import__("onnx").load(str(tmp_path / "m.onnx")).graph.node}
    assert "BatchNormalization" not in ops and "Conv" in ops  # deployed: BN folded (1x1 convs remain)
    scripted = torch.jit.load(str(tmp_path / "m.pt"))
    with torch.inference_mode():
        torch.testing.assert_close(scripted(x), ref, rtol=1e-4, atol=1e-5)


def test_bench_table_for_checkpoint_and_models(run_dir, capsys):
    res = repmlp_cli(
        "bench",
        "--checkpoint",
        run_dir / "model.safetensors",
        "--batch-size",
        4,
        "--warmup",
        1,
        "--repeats",
        2,
    )
    assert res.returncode == 0, res.stderr
    rows = [ln.split("|")[1:-1] for ln in res.stdout.splitlines() if ln.startswith(f"| {NAME} ")]
    assert [r[1].strip() for r in rows] == ["train", "deploy"]
    params = [float(r[3]) for r in rows]
    speed = [float(r[6]) for r in rows]
    assert params[1] < params[0] and all(s > 0 for s in speed)
    assert rows[1][7].strip().endswith("%")  # spread of the pass times
    assert rows[1][8].strip().endswith("x")  # deployed speed relative to training-time
    assert "1x28x28" in res.stdout and "Batch 4" in res.stdout

    # Registered names side by side (repmlp's and timm's), one input size for both (in-process: faster).
    status = cli.main([
        "bench", "--model", NAME, "resnet18", "--in-chans", "1", "--img-size", "28", "--batch-size", "2",
        "--warmup", "0", "--repeats", "1", "--forms", "deploy",
    ])  # fmt: skip
    assert status == 0
    names = [ln.split("|")[1].strip() for ln in capsys.readouterr().out.splitlines() if "| deploy |" in ln]
    assert names == [NAME, "resnet18"]


def test_benchmark_function_rows():
    from repmlp.bench.throughput import benchmark, render_markdown

    rows = benchmark({"tiny": tiny_model()}, INPUT, 2, device="cpu", warmup=0, repeats=2)
    assert [(r.model, r.form) for r in rows] == [("tiny", "train"), ("tiny", "deploy")]
    train, deploy = rows
    assert (train.params, train.macs) == repmlp.profile(tiny_model(), INPUT)
    assert deploy.macs < train.macs and deploy.throughput > 0
    table = render_markdown(rows, note="note line")
    assert table.count("\n| tiny |") == 2 and table.endswith("note line")
    assert "| Params (M) | MACs (M) |" in table  # multiply-accumulates, named so


def test_viz_writes_the_fc3_figure(run_dir, tmp_path):
    out = tmp_path / "fc3.png"
    res = repmlp_cli(
        "viz", "--checkpoint", run_dir / "model.safetensors", "--block", "stages.1.1.0",
        "--out-channel", 5, "--point", 2, 4, "--output", out,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "W[5, 2, 4, 0, :, :]" in res.stdout
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    import matplotlib.image

    image = matplotlib.image.imread(str(out))
    assert image.shape[0] > 300 and image.shape[1] > 600 and image[..., :3].std() > 0.05  # two panels, drawn


def test_viz_writes_beside_the_checkpoint_and_replaces_only_with_force(run_dir, tmp_path, monkeypatch):
    """Without --output the figure goes beside the checkpoint (not into the current folder); a second one is
    refused without --force."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(run_dir / "model.safetensors", run / "model.safetensors")
    monkeypatch.chdir(tmp_path)
    argv = ["viz", "--checkpoint", run / "model.safetensors", "--block", "stages.1.1.0"]
    assert repmlp_cli(*argv).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert (run / "model-fc3.png").read_bytes()[:4] == b"\x89PNG"
    res = repmlp_cli(*argv)
    assert res.returncode == 2 and "model-fc3.png already exists" in user_error_line(res.stderr), res.stderr
    assert repmlp_cli(*argv, "--force").returncode == 0


@torch.no_grad()
def test_sample_fc3_picks_the_papers_entry_and_normalises_by_the_minimum():
    from repmlp.bench.viz import fc3_log_weights, sample_fc3

    model = tiny_model()
    block = model.get_submodule("stages.1.1.0")  # C = O = 8, g = 2, 7x7 partition, K = 1, 3, 5
    h, w = block.partition
    o, (y, x), c = 5, (2, 4), 3
    s = sample_fc3(model, block_name="stages.1.1.0", out_channel=o, point=(y, x), in_channel=c)
    # Row o*h*w + y*w + x of FC3, columns of in-group channel c: W(O, h, w, C/g, h, w)[o, y, x, c].
    raw = block.partition_perceptron.fc3.weight[o * h * w + y * w + x, c * h * w : (c + 1) * h * w].reshape(
        h, w
    )
    expected = torch.log(raw.abs() / raw.abs().min()).double().numpy()
    np.testing.assert_allclose(s.train, expected, rtol=1e-6, atol=1e-9)
    assert s.train.min() == 0 and s.merged.min() == 0
    assert s.input_channel == 4 + c  # output channel 5 is in group 1 (channels 4..7)
    # Merging adds the Local Perceptron only inside the largest kernel (5x5) around the point.
    merged = block.merged_fc3()[0][o * h * w + y * w + x, c * h * w : (c + 1) * h * w].reshape(h, w)
    inside = torch.zeros(h, w, dtype=torch.bool)
    inside[max(y - 2, 0) : y + 3, max(x - 2, 0) : x + 3] = True
    bn = block.partition_perceptron.bn
    scale = (bn.weight / torch.sqrt(bn.running_var + bn.eps))[o * h * w + y * w + x]
    torch.testing.assert_close(merged[~inside], (raw * scale)[~inside])
    assert not torch.allclose(merged[inside], (raw * scale)[inside])
    np.testing.assert_allclose(
        fc3_log_weights(torch.tensor([[2.0, -4.0], [0.0, 8.0]])), np.log([[1, 2], [1, 4]])
    )


def test_export_of_a_runs_model_does_not_duplicate_its_deploy_onnx(run_dir, tmp_path):
    """A run's model.safetensors exports to deploy.onnx: beside the run's own it is refused, not duplicated."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(run_dir / "model.safetensors", run / "model.safetensors")
    (run / "deploy.onnx").write_bytes(b"the run's")
    res = repmlp_cli("export", "--checkpoint", run / "model.safetensors")
    assert res.returncode == 2 and "deploy.onnx already exists" in user_error_line(res.stderr), res.stderr
    assert sorted(p.name for p in run.iterdir()) == ["deploy.onnx", "model.safetensors"]


@pytest.mark.slow
def test_export_exported_program_pt2(run_dir, tmp_path):
    """``--format exported-program`` writes a ``torch.export`` program: loadable, dynamic batch, deployed."""
    out = tmp_path / "m.pt2"
    res = repmlp_cli("export", "--checkpoint", run_dir / "model.safetensors", "--format", "exported-program")
    assert res.returncode == 0, res.stderr
    default = run_dir / "deploy.pt2"  # the deployed model, named as the run's deploy.onnx
    assert "torch.export.load vs PyTorch max diff" in res.stdout and default.is_file()
    assert not (run_dir / "model.pt2").exists()
    default.replace(out)
    train = load_model(run_dir / "model.safetensors")
    x = fmnist_batch(run_dir, n=5)  # a batch size the exporter never saw
    program = torch.export.load(str(out))
    with torch.inference_mode():
        torch.testing.assert_close(program.module()(x), train(x), rtol=1e-4, atol=1e-5)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("batch_norm" in t for t in targets), targets  # deployed: BN folded


def test_failed_onnx_export_keeps_the_earlier_file(tmp_path):
    from repmlp.deploy.export import ExportError, export_onnx

    # (The successful export and its onnxruntime check run in the export command's test.)
    model = repmlp.reparameterize_model(tiny_model())
    path = tmp_path / "m.onnx"
    path.write_bytes(b"an earlier export")
    with pytest.raises(ExportError):  # an input the model rejects: the earlier file stays
        export_onnx(model, path, (1, 20, 20))
    assert path.read_bytes() == b"an earlier export"
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


@pytest.mark.slow  # builds and profiles every model of the paper (~20 s on 2 busy cores)
def test_tables_command():
    res = repmlp_cli("tables")
    assert res.returncode == 0, res.stderr
    assert "| Pure MLP | `repmlp_cifar` |" in res.stdout
    assert sum(ln.startswith("| ") for ln in res.stdout.splitlines()) > 20
    # docs/models.md quotes this output: it must stay what the command prints now.
    docs = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
    assert res.stdout.strip() in docs, "docs/models.md is stale: paste the output of `repmlp -q tables`"


def test_help_of_each_command(capsys):
    for command in ("convert", "export", "bench", "viz", "tables", "predict", "import"):
        with pytest.raises(SystemExit) as exc:
            cli.build_parser().parse_args([command, "--help"])
        assert exc.value.code == 0
        assert "--force" in capsys.readouterr().out  # every command with an --output file takes it


# --------------------------------------------------------------------------------------- bad inputs
@pytest.fixture(scope="module")
def bad_files(run_dir) -> dict[str, Path]:
    good = (run_dir / "model.safetensors").read_bytes()
    files = {
        "truncated": good[: len(good) // 2],
        "corrupted": bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)),
    }
    paths = {}
    for name, data in files.items():
        paths[name] = run_dir / f"{name}.safetensors"
        paths[name].write_bytes(data)
    # Another model's name over these weights: rebuilding repmlp_cifar(**KWARGS) cannot take them.
    paths["other-model"] = run_dir / "other.safetensors"
    save_model(paths["other-model"], tiny_model(), name="repmlp_cifar", model_kwargs=KWARGS, form="train",
               check=False)  # fmt: skip
    return paths


def test_truncated_checkpoint_leaves_existing_output_alone(bad_files, tmp_path):
    out = tmp_path / "deploy.safetensors"
    out.write_bytes(b"keep me")
    res = repmlp_cli("convert", "--checkpoint", bad_files["truncated"], "--output", out, "--force")
    assert_user_error(res, "truncated")
    assert out.read_bytes() == b"keep me"


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["viz", "--checkpoint", "{corrupted}"], ["not a safetensors file"]),
        (["export", "--checkpoint", "{other_model}"], ["repmlp_cifar"]),
        (["bench", "--model", "no_such_model_xyz"], ["unknown model 'no_such_model_xyz'"]),
        (["viz", "--checkpoint", "{model}", "--point", "99", "0"], ["point must lie in the 7x7 partition"]),
        (["bench", "--checkpoint", "{truncated}"], ["truncated"]),
        (["convert", "--checkpoint", "{deploy}"], ["already a deployed checkpoint"]),
        (["viz", "--checkpoint", "{deploy}"], ["deployed form", "training-time checkpoint"]),
        (["viz", "--checkpoint", "{model}", "--block", "nope"], ["no RepMLP block named 'nope'"]),
        (["viz", "--checkpoint", "{model}", "--out-channel", "8"], ["out_channel must be in 0..3"]),
        (["convert", "--checkpoint", "{model}", "--dataset", "cifar10", "--force"], ["--dataset cifar10"]),
        (["export", "--checkpoint", "{model}", "--img-size", "20"], ["does not take 1x20x20 inputs"]),
        (["bench", "--model", NAME, "--batch-size", "0"], ["--batch-size: must be in 1..1048576, got 0"]),
        (["bench", "--checkpoint", "{model}", "--repeats", "x"], ["--repeats: expected an integer"]),
        (["bench", "--checkpoint", "{model}", "--device", "cuda:7"], ["--device cuda:7"]),
        (["export", "--checkpoint", "{model}", "--format", "tflite"], ["invalid choice"]),
        (["convert", "--checkpoint", "{missing}"], ["checkpoint not found"]),
        (["viz", "--checkpoint", "{model}", "--output", "{model}"], ["would overwrite the checkpoint"]),
        (["bench", "--checkpoint", "{model}", "--output", "{deploy}"], ["already exists", "--force"]),
    ],
)
def test_bad_inputs_in_process(argv, fragments, run_dir, bad_files, deployed, capsys):
    paths = {
        "model": run_dir / "model.safetensors",
        "deploy": deployed,
        "missing": run_dir / "missing.safetensors",
        **{k.replace("-", "_"): v for k, v in bad_files.items()},
    }
    status = cli.main([a.format(**paths) for a in argv])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert status == 2 and lines and lines[-1].startswith("repmlp: error: "), err
    assert sum("error" in ln.lower() for ln in lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]


def test_eval_of_a_foreign_model_checks_its_own_input_channels(tmp_path, capsys):
    # A timm model's checkpoint need not record in_chans: the channels come from the model itself.
    data = make_fashion_mnist(tmp_path / "fm", n_train=8, n_test=8)
    model = repmlp.create_model("resnet18", num_classes=10)
    ckpt = tmp_path / "r18.safetensors"
    save_model(ckpt, model, name="resnet18", model_kwargs={"num_classes": 10}, form="train")
    status = cli.main(["eval", "--checkpoint", str(ckpt), "--data-dir", str(data)])
    err = capsys.readouterr().err
    assert status == 2 and "takes 3-channel images but fashion-mnist has 1" in err and "Traceback" not in err


def test_export_checks_report_the_difference_relative_to_the_output_scale():
    """Logits near 4.6e6 that differ by 16 in float32 agree to 3.5e-6: that is what the check bounds and
    what the command prints (an absolute 1.6e1 reads as a failure)."""
    from repmlp.deploy.export import ExportError, _check_close

    ref = torch.tensor([[4.6e6, -2.0e6], [1.0, 0.5]])
    assert _check_close("ONNX", ref + 16, ref, 1e-4) == pytest.approx(16 / 4.6e6)
    assert _check_close("ONNX", ref[1:] + 1e-5, ref[1:], 1e-4) == pytest.approx(1e-5, rel=0.01)  # scale >= 1
    with pytest.raises(ExportError, match="of the output scale"):
        _check_close("ONNX", ref + 1e3, ref, 1e-4)


@pytest.mark.parametrize("phase", ["train", "eval"])
@pytest.mark.parametrize("task", ["face", "seg"])
def test_task_help_description_is_a_whole_sentence(task, phase, capsys):
    """`repmlp train/eval --task T -h` shows the task module's first docstring line, a whole sentence."""
    import importlib

    from repmlp.tasks import TASK_MODULES

    first = importlib.import_module(f"repmlp.tasks.{TASK_MODULES[task]}").__doc__.splitlines()[0]
    assert first.endswith(".")
    assert cli.main([phase, "--task", task, "--help"]) == 0
    assert first in " ".join(capsys.readouterr().out.split())
