"""``repmlp.engine.train_loop`` in-process with a toy task: the hooks every task plugs in, checkpoints and
resuming bitwise from a mid-epoch checkpoint, and the resume rules (runtime keys may change, others not).

The subprocess kill-and-resume tests of the three tasks (a process that crashes after a step: ``tests/faults``)
are in test_train.py, test_face.py and test_seg.py; these check the same machinery without a process per run.
"""

from __future__ import annotations

import platform
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import repmlp
from repmlp.engine import (
    DistInfo,
    LoopHooks,
    LoopOptions,
    Position,
    check_output,
    check_resumable,
    prepare_module,
    state_hash,
    train_loop,
)
from repmlp.engine.forms import DenseLocalPerceptron
from repmlp.errors import UserError
from repmlp.io.state import load_state
from repmlp_testdata import subprocess_env

pytestmark = pytest.mark.usefixtures("one_thread")


class ToyLoader:
    """4 batches of 3 samples an epoch, a fresh order each epoch (like the project's loaders)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(12, 5, generator=gen), torch.randint(0, 3, (12,), generator=gen)

    def __len__(self) -> int:
        return 4

    def batches(self, epoch: int, start: int = 0):
        order = torch.randperm(12, generator=torch.Generator().manual_seed(epoch))
        for b in range(start, 4):
            idx = order[3 * b : 3 * b + 3]
            yield self.x[idx], self.y[idx]


class ToyTask:
    """A classifier whose step draws from the torch, numpy and python RNGs (as dropout, augmentation and
    mixup do), so only a resume that restores all three continues bitwise."""

    def __init__(self, keep: Path | None = None, keep_at: int = 0) -> None:
        self.mode = ""  # the loop's LoopResult.mode, set by run()
        self.epochs_seen: list[tuple[int, int, float]] = []
        self.keep, self.keep_at = keep, keep_at

    def step(self, net: nn.Module, x: torch.Tensor, y: torch.Tensor, pos: Position):
        if self.keep is not None and pos.step == self.keep_at:  # the checkpoint of step keep_at
            shutil.copy(self.keep.parent / "checkpoint.safetensors", self.keep)
        noise = torch.randn_like(x) * float(np.random.uniform(0, 0.1)) * random.random()
        logits = net(nn.functional.dropout(x + noise, 0.2))
        loss = nn.functional.cross_entropy(logits, y)
        return loss, {"loss": loss.item() * len(y), "hits": float((logits.argmax(1) == y).sum()), "n": len(y)}

    def end_epoch(self, pos: Position) -> dict:
        self.epochs_seen.append((pos.epoch, pos.step, pos.epoch_acc["n"]))
        return {"epoch": pos.epoch + 1, "step": pos.step, "loss": pos.epoch_acc["loss"] / pos.epoch_acc["n"]}


def run(out: Path, task: ToyTask, state=None, **options) -> tuple[nn.Module, list]:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    net = nn.Linear(5, 3)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    opts = LoopOptions(
        output=out,
        config={"lr": 0.1, "device": "cpu"},
        lr_at=lambda step: [0.1 / (1 + step)],
        runtime_keys=("device",),
        metric_fields=("epoch", "step", "loss"),
        **options,
    )
    result = train_loop(
        net, optimizer, ToyLoader(), opts, DistInfo(), state, LoopHooks(task.step, task.end_epoch)
    )
    task.mode = result.mode
    return net, result.history


def test_epoch_counted_run_calls_the_hooks_and_resumes_bitwise_mid_epoch(tmp_path):
    full_task = ToyTask()
    full, history = run(tmp_path / "full", full_task, epochs=3, ckpt_every=3)
    # end_epoch saw each epoch's sums before the position moved on; its rows are the history.
    assert full_task.epochs_seen == [(0, 4, 12.0), (1, 8, 12.0), (2, 12, 12.0)]
    assert [row["step"] for row in history] == [4, 8, 12]
    assert (tmp_path / "full" / "metrics.csv").read_text().splitlines()[0] == "epoch,step,loss"
    state = load_state(tmp_path / "full" / "checkpoint.safetensors")
    assert (state["epoch"], state["batch"], state["step"]) == (3, 0, 12)
    assert set(state["rng"]["0"]) == {"python", "numpy", "torch"}

    # The same run again, keeping the checkpoint of step 6 (epoch 2, batch 2), then resumed from it.
    (tmp_path / "cut").mkdir()
    kept = tmp_path / "cut" / "kept.safetensors"
    run(tmp_path / "cut", ToyTask(keep=kept, keep_at=6), epochs=3, ckpt_every=3)
    state = load_state(kept)
    assert (state["epoch"], state["batch"], state["step"]) == (1, 2, 6)
    resumed_task = ToyTask()
    resumed, resumed_history = run(tmp_path / "resumed", resumed_task, state=state, epochs=3, ckpt_every=3)
    assert resumed_task.epochs_seen == full_task.epochs_seen[1:]  # the sums of epoch 2 came back too
    assert state_hash(resumed) == state_hash(full)
    assert resumed_history == history


@pytest.mark.slow  # torch.compile
def test_compiled_steps_and_a_failed_compilation_that_falls_back_to_eager(tmp_path, monkeypatch, caplog):
    eager_task, compiled_task, fallback_task = ToyTask(), ToyTask(), ToyTask()
    eager, eager_history = run(tmp_path / "eager", eager_task, epochs=2)
    compiled, history = run(tmp_path / "compiled", compiled_task, epochs=2, compile=True)
    assert (eager_task.mode, compiled_task.mode) == ("eager", "compiled")
    for a, b in zip(history, eager_history, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)

    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    monkeypatch.setattr(inductor_config.cpp, "cxx", ("/nonexistent/c++",))
    with caplog.at_level("WARNING", logger="repmlp.engine.loop"):
        fallback, fallback_history = run(tmp_path / "fallback", fallback_task, epochs=2, compile=True)
    torch._dynamo.reset()
    assert fallback_task.mode == "eager (compilation failed)"
    assert [r.message for r in caplog.records if "torch.compile failed" in r.message] != []
    assert len([r for r in caplog.records if "torch.compile failed" in r.message]) == 1
    assert state_hash(fallback) == state_hash(eager) and fallback_history == eager_history


def test_prepare_module_hands_the_loop_the_training_form_unless_turned_off() -> None:
    """``prepare_module`` (every task's run; ``repmlp train --no-fast-training`` is ``form=False``) hands the
    loop the model's training form (:func:`repmlp.engine.forms.training_form`): a new tree holding the model's
    own parameters, the model's modules keeping their classes; with ``form=False``, or where no form applies,
    the model itself."""
    narrow = repmlp.create_model("repmlp_cifar", width_multiplier=0.25)
    classes = [type(m) for m in narrow.modules()]
    net = prepare_module(narrow, DistInfo())
    assert net is not narrow and any(isinstance(m, DenseLocalPerceptron) for m in net.modules())
    assert [type(m) for m in narrow.modules()] == classes
    assert list(net.state_dict(keep_vars=True)) == list(narrow.state_dict(keep_vars=True))
    assert all(a is b for a, b in zip(net.parameters(), narrow.parameters(), strict=True))
    assert prepare_module(narrow, DistInfo(), form=False) is narrow
    toy = nn.Linear(5, 3)
    assert prepare_module(toy, DistInfo()) is toy


# Thirty rounds of a 64 MiB and a 32 MiB tensor (above glibc's largest mapping threshold), written then freed;
# prints each round's minor page faults, after keep_freed_memory() when asked.
_FAULTS = """
import resource, sys, torch
from repmlp.engine import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
faults = []
for _ in range(30):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a, b = torch.empty(16 << 20).fill_(1.0), torch.empty(8 << 20).fill_(2.0)
    del a, b
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


@pytest.mark.slow  # two processes that fault hundreds of MB in
def test_keep_freed_memory_stops_large_buffers_faulting_in_again():
    """With glibc's defaults every round maps the two tensors afresh and faults all their pages in; after
    keep_freed_memory() (both mallopt settings taken) the rounds reuse the heap's pages once it has grown (a
    round may still grow it where another allocation landed in the freed space: the median round)."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("a glibc setting")
    pages = (24 << 20) * 4 // 4096
    faults = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True,
                             env=subprocess_env(), timeout=120, check=True)  # fmt: skip
        faults[mode] = [int(v) for v in out.stdout.split()]
    assert min(faults["default"]) >= pages // 2
    assert statistics.median(faults["keep"][10:]) < pages // 20


def test_iteration_counted_run_logs_the_loss_and_may_end_inside_an_epoch(tmp_path):
    task = ToyTask()
    _, history = run(tmp_path / "it", task, iterations=6, log_interval=2)
    assert task.epochs_seen == [(0, 4, 12.0)]  # epoch 2 is cut at batch 2: no end of epoch
    assert [row["iteration"] for row in history if "iteration" in row] == [2, 4, 6]
    assert all({"loss", "hits", "lr", "seconds"} <= set(row) for row in history if "iteration" in row)
    state = load_state(tmp_path / "it" / "checkpoint.safetensors")
    assert (state["epoch"], state["batch"], state["step"]) == (1, 2, 6)
    with pytest.raises(UserError, match="already holds a run"):
        check_output(tmp_path / "it", resume=False, procs=DistInfo())


def test_resume_rules_runtime_keys_may_change_the_others_not(tmp_path):
    saved = {"lr": 0.1, "device": "cuda", "seed": 0}
    # All keys compared (face, segmentation): a runtime key may differ and the given value wins.
    assert check_resumable(saved, {"lr": 0.1, "device": "cpu", "seed": 0}, tmp_path, runtime=("device",)) == {
        "lr": 0.1,
        "device": "cpu",
        "seed": 0,
    }
    with pytest.raises(UserError, match=r"cannot resume .*--lr 0.1, not 0.2; --seed 0, not 1"):
        check_resumable(saved, {"lr": 0.2, "device": "cpu", "seed": 1}, tmp_path, runtime=("device",))
    # Only the given keys compared (classification): the others keep their saved values.
    merged = check_resumable(saved, {"lr": 0.2, "device": "cpu", "seed": 0}, tmp_path, runtime=("device",),
                             given={"device"})  # fmt: skip
    assert merged == saved | {"device": "cpu"}
    # The engine applies the rules when it resumes.
    run(tmp_path / "run", ToyTask(), epochs=1)
    state = load_state(tmp_path / "run" / "checkpoint.safetensors")
    state["config"]["lr"] = 0.5
    with pytest.raises(UserError, match="--lr 0.5, not 0.1"):
        run(tmp_path / "run", ToyTask(), state=state, epochs=1)


def test_build_model_passes_img_size_only_to_models_built_for_one_size():
    from repmlp.models import build_model, takes_img_size

    assert takes_img_size("repmlp_fmnist") and takes_img_size("repmlp:repmlp_cifar")
    assert takes_img_size("vit_tiny_patch16_224")  # timm's config: fixed_input_size
    assert not takes_img_size("resnet18") and not takes_img_size("torchvision:resnet18")
    _, used = build_model("resnet18", num_classes=3, img_size=64)  # a CNN takes any size: not passed
    assert used == {"num_classes": 3}
    _, used = build_model("repmlp_fmnist", {"widths": [4, 8]}, num_classes=10, img_size=28)
    assert used["img_size"] == 28


def test_build_model_errors_are_user_errors_and_bugs_keep_their_traceback(monkeypatch):
    import repmlp.models as models
    from repmlp.models import build_model

    with pytest.raises(UserError, match="cannot build model 'no_such_model'"):
        build_model("no_such_model")
    with pytest.raises(UserError, match="cannot build model 'repmlp_fmnist'"):
        build_model("repmlp_fmnist", {"no_such_option": 1})

    def broken(name, **kwargs):
        raise AttributeError("a bug in a model's constructor")

    monkeypatch.setattr(models, "create_model", broken)
    with pytest.raises(AttributeError, match="a bug"):  # not turned into a one-line UserError
        build_model("repmlp_fmnist")


def test_resolve_device_names_every_device_it_accepts():
    from repmlp.engine import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match="use cpu, cuda, cuda:N, mps or auto"):
        resolve_device("gpu0")
    if not torch.backends.mps.is_available():
        with pytest.raises(UserError, match="MPS is not available"):
            resolve_device("mps")
