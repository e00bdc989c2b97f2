"""Hints that point the right way and reports that do not mislead (issue #42): did-you-mean for mistyped
options and choices, the model file given without ``--checkpoint``, the download message, and the speed
caveat that ``report.md`` carries as the log does."""

from __future__ import annotations

import logging

import pytest
import torch

from repmlp_testdata import run_cli, user_error_line


def _error(*args: object) -> str:
    """The one error line of ``repmlp *args`` (exit status 2)."""
    result = run_cli(*args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    return user_error_line(result.stderr)


def test_a_mistyped_option_or_choice_gets_the_closest_one_of_its_own_command():
    line = _error("train", "--epoch", "1")
    assert "unrecognized arguments: --epoch 1; did you mean --epochs?" in line
    assert line.endswith("(see 'repmlp train --help')")  # the command's help, not the top level's
    # Every command's parser, also a task's own (eval --task face) and a mutually exclusive group's command.
    assert "did you mean --repeats?" in _error("bench", "--model", "repmlp_fmnist", "--repeat", "3")
    line = _error("eval", "--task", "face", "--checkpoint", "x.safetensors", "--pair", "p.txt")
    assert "did you mean --pairs?" in line and "(see 'repmlp eval --task face --help')" in line
    # A typo that leaves a required option missing is named too (argparse reports the missing one first).
    assert "did you mean --checkpoint?" in _error("predict", "--chekpoint", "m.safetensors", "a.png")
    assert "did you mean --epochs for --epoch, --lr for --lrr?" in _error("train", "--epoch=1", "--lrr", "3")
    assert "did you mean train?" in _error("trian")
    assert "did you mean cifar10?" in _error("train", "--dataset", "cifar")
    # Nothing close: no guess ("eval" has no --epochs).
    assert "did you mean" not in _error("eval", "--epochs", "2")


def test_a_mistyped_model_name_gets_the_closest_names_of_every_registry():
    """Close names are the command line's (``repmlp.create_model`` only says the name is unknown): repmlp's,
    timm's and torchvision's, each once, for every command that takes ``--model``, before any work."""
    line = _error("bench", "--model", "repmlp_res5O")
    assert "argument --model: unknown model 'repmlp_res5O'" in line and "did you mean: repmlp_res50" in line
    assert "did you mean: resnet18" in _error("train", "--model", "torchvision:resnet1")
    assert "did you mean" not in _error("import", "x.pth", "--model", "zzzzqqqq", "--output", "y.safetensors")


def test_a_model_file_given_without_checkpoint_says_how_to_give_it():
    hint = "give the model file with --checkpoint: --checkpoint runs/X/deploy.safetensors"
    for command in ("eval", "convert", "export", "bench"):
        assert hint in _error(command, "runs/X/deploy.safetensors"), command
    # predict's positional arguments are images: the hint only where --checkpoint is what is missing.
    assert hint in _error("predict", "shoe.png", "runs/X/deploy.safetensors")
    assert "give the model file" not in _error("predict", "--checkpoint", "runs/X/deploy.safetensors")


def test_the_data_messages_send_nowhere_already_tried(tmp_path, monkeypatch):
    import torchvision.datasets

    def offline(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", offline)
    empty = tmp_path / "empty"
    common = ("--epochs", "1", "--output", tmp_path / "run")
    line = _error("train", "--data-dir", empty, "--download", *common)
    assert "download into" in line and "network unreachable" in line and "--download" not in line
    # Without --download, adding it is still one of the ways offered.
    assert "add --download" in _error("train", "--data-dir", empty, *common)
    line = _error("train", "--dataset", "cifar10", "--download", *common)
    assert "needs --data-dir" in line and "--download fetches Fashion-MNIST only" in line
    assert not (tmp_path / "run").exists()


def _rows(train_times: list[float], deploy_times: list[float], monkeypatch, caplog):
    """Benchmark rows of a tiny model whose pass times are ``train_times`` / ``deploy_times`` (seconds)."""
    import repmlp
    from repmlp.bench import throughput

    monkeypatch.setattr(
        throughput,
        "time_rounds",
        lambda fns, *a, **k: dict(zip(fns, [train_times, deploy_times], strict=True)),
    )
    model = repmlp.create_model("repmlp_fmnist", widths=[4, 8], kernel_sizes=[3])
    with caplog.at_level(logging.WARNING, logger="repmlp"):
        return throughput.benchmark({"tiny": model}, (1, 28, 28), 8, repeats=4)


@pytest.mark.parametrize(
    ("train_times", "deploy_times", "sign"),
    [
        (
            [0.010] * 4,
            [0.020, 0.021, 0.019, 0.020],
            "the deployed form measured slower",
        ),  # load reversed them
        ([0.010, 0.030, 0.010, 0.030], [0.005, 0.015, 0.005, 0.015], "timings vary by up to"),
        ([0.010] * 4, [0.007] * 4, None),  # steady, deployed faster: no caveat
    ],
)
def test_the_report_carries_the_speed_caveat_the_log_gives(
    train_times, deploy_times, sign, monkeypatch, caplog
):
    from repmlp.bench.throughput import render_markdown, timing_caveat
    from repmlp.tasks.classification_report import _speed_lines

    with torch.no_grad():
        rows = _rows(train_times, deploy_times, monkeypatch, caplog)
    section = "\n".join(_speed_lines((rows, render_markdown(rows))))
    assert "interleaved rounds" in section and render_markdown(rows) in section
    caveat = timing_caveat(rows)
    if sign is None:
        assert caveat is None and "Caveat" not in section and not caplog.records
        return
    assert sign in caveat and "rerun `repmlp bench`" in caveat
    assert section.count(f"**Caveat:** {caveat}.") == 1  # in report.md, once ...
    assert f"**Caveat:** {caveat}." in render_markdown(rows)  # ... in repmlp bench's table (--output) ...
    assert [r.getMessage() for r in caplog.records] == [caveat]  # ... in the same words as on the terminal


def test_out_of_memory_hints_name_only_options_the_command_has():
    """``convert`` has no --batch-size: its out-of-memory line suggests a smaller --img-size instead."""
    import argparse

    from repmlp.cli import out_of_memory_message

    line = out_of_memory_message(MemoryError(), argparse.Namespace(command="convert", img_size=4096))
    assert "--batch-size" not in line and "a smaller --img-size than 4096" in line
    line = out_of_memory_message(MemoryError(), argparse.Namespace(command="train", batch_size=64))
    assert "at --batch-size 64; try --batch-size 32" in line
