"""The sequence pure MLP (models/sequence.py): exact conversion, the row-reading adapter, shapes and input
checks, the baseline's MACs beside the RepMLP1d model's, registration with repmlp (not timm: 1-D maps)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import timm
import torch
from torch import nn

from equivalence import randomize
from repmlp import RepMLPBlock1d, create_model, list_models, reparameterize_model
from repmlp.bench.counts import profile_model
from repmlp.models.sequence import RowSequenceMLP, SequenceMLP, rows_as_sequence

NAMES = ("repmlp1d_fmnist", "conv1d_fmnist")
# The largest relative difference allowed between the two models' deployed MACs (docs/sequences.md).
MACS_RATIO_TOLERANCE = 0.10

pytestmark = pytest.mark.usefixtures("one_thread")


def _exactly_converted(model: nn.Module, fresh: nn.Module, x: torch.Tensor) -> nn.Module:
    """Convert eval-mode ``model`` (float64, random BN statistics); check that the converted model and
    ``fresh`` (its ``deploy=True`` build, loaded with the converted weights) compute what it computes."""
    randomize(model, seed=3)
    model.eval()
    deployed = reparameterize_model(model)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in deployed.modules())
    fresh.double().eval().load_state_dict(deployed.state_dict(), strict=True)
    with torch.no_grad():
        ref = model(x)
        for out in (deployed(x), fresh(x)):
            torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10 * ref.abs().max().item())
    return deployed


@pytest.mark.parametrize("name", NAMES)
def test_registered_models_convert_exactly(name: str) -> None:
    torch.manual_seed(0)
    model = create_model(name).double()
    x = torch.randn(4, 1, 28, 28, dtype=torch.float64)
    deployed = _exactly_converted(model, create_model(name, deploy=True), x)
    if name == "repmlp1d_fmnist":  # every RepMLP1d is three FC layers now: no conv, no BN left in it
        blocks = [m for m in deployed.modules() if isinstance(m, RepMLPBlock1d)]
        assert len(blocks) == 6 and all(b.deploy and b.local_perceptron is None for b in blocks)
        assert all(m.kernel_size == (1,) for m in deployed.modules() if isinstance(m, nn.Conv1d))


@pytest.mark.parametrize("length, partition", [(30, 7), (12, 12)], ids=["padded", "one-partition"])
def test_generic_sequence_model_converts_exactly(length: int, partition: int) -> None:
    """A sequence model on ``(N, C, L)``: partitions padded at the end of some stages (30 -> 35, 15 ->
    21, 7), or a first stage that is one partition (no Global Perceptron) and later ones shorter than it."""
    torch.manual_seed(1)
    kw = dict(widths=(8, 16, 16), partition=partition, groups=4, kernel_sizes=(1, 3, 5), num_classes=5)
    model = SequenceMLP(6, length, **kw).double()
    assert [b.padding for b in model.modules() if isinstance(b, RepMLPBlock1d)][::2] == (
        [(5,), (6,), (0,)] if length == 30 else [(0,), (0,), (0,)]
    )
    x = torch.randn(3, 6, length, dtype=torch.float64)
    _exactly_converted(model, SequenceMLP(6, length, deploy=True, **kw), x)


def test_rows_as_sequence_reads_rows_as_steps() -> None:
    x = torch.randn(2, 3, 5, 4)
    seq = rows_as_sequence(x)
    assert seq.shape == (2, 3 * 4, 5)
    for c, i, j in ((0, 0, 0), (1, 2, 3), (2, 4, 1)):
        torch.testing.assert_close(seq[:, c * 4 + j, i], x[:, c, i, j], rtol=0, atol=0)


def test_image_model_is_the_sequence_model_on_rows() -> None:
    """repmlp1d_fmnist on an image = the same weights in a plain SequenceMLP on the rows."""
    torch.manual_seed(2)
    image_model = create_model("repmlp1d_fmnist").eval()
    seq_model = SequenceMLP(
        28, 28, widths=(32, 64, 128), partition=7, groups=2, kernel_sizes=(1, 3, 5)
    ).eval()
    seq_model.load_state_dict(image_model.state_dict(), strict=True)
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(image_model(x), seq_model(x[:, 0].transpose(1, 2)))


@pytest.mark.parametrize("name", NAMES)
def test_shapes_and_input_checks(name: str) -> None:
    model = create_model(name, num_classes=7).eval()
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert model.forward_features(x).shape == (2, 128, 7)
        assert model(x).shape == (2, 7)
        assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (2, 128)
    for bad in ((2, 1, 32, 32), (2, 3, 28, 28), (2, 28, 28)):
        with pytest.raises(ValueError, match=r"model built for inputs \(N, 1, 28, 28\)"):
            model(torch.randn(*bad))
    padded = create_model(name, img_size=32, in_chans=3).eval()  # 32 rows of 3*32 features
    assert padded(torch.randn(1, 3, 32, 32)).shape == (1, 10)


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match="mixer"):
        SequenceMLP(4, 16, mixer="attention")
    with pytest.raises(ValueError, match="too short for 3 stages"):
        SequenceMLP(4, 3)
    with pytest.raises(ValueError, match="in_chans must be a positive int"):
        SequenceMLP(0, 16)
    with pytest.raises(ValueError, match="img_size must be a positive int"):
        RowSequenceMLP(img_size=(28, 28))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"sequences \(N, 4, 16\), got \(2, 4, 15\)"):
        SequenceMLP(4, 16)(torch.randn(2, 4, 15))


def test_baseline_macs_match_the_repmlp_model() -> None:
    """Deployed MACs (the project's profiler, on meta tensors): the conv1d baseline within the stated
    ratio of repmlp1d_fmnist; both well under repmlp_fmnist's training-time MACs."""
    _, repmlp_macs = profile_model("repmlp1d_fmnist", deploy=True)
    _, conv_macs = profile_model("conv1d_fmnist", deploy=True)
    assert abs(conv_macs / repmlp_macs - 1) <= MACS_RATIO_TOLERANCE, (conv_macs, repmlp_macs)
    _, image_macs = profile_model("repmlp_fmnist", deploy=False)
    for name in NAMES:
        assert profile_model(name, deploy=False)[1] < image_macs / 2


@pytest.mark.parametrize("name", NAMES)
def test_built_like_timms_models_but_not_registered_with_timm(name: str) -> None:
    """Outside timm's classifier contract (its feature maps are (N, C, L), docs/models.md), so not in timm's
    registry: repmlp lists it and builds it with timm's cfg and feature wrapper."""
    assert name in list_models() and not timm.list_models("*1d_fmnist")
    model = create_model(name, num_classes=3)
    assert isinstance(model, RowSequenceMLP) and model.num_classes == 3
    cfg = model.pretrained_cfg
    assert cfg["input_size"] == (1, 28, 28) and cfg["classifier"] == "head" and cfg["pool_size"] == (7,)
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 3)
    features = create_model(name, features_only=True, out_indices=(1, 2)).eval()
    with torch.no_grad():
        assert [m.shape for m in features(torch.randn(2, 1, 28, 28))] == [(2, 128, 14), (2, 128, 7)]
    with pytest.raises(ValueError, match="unknown model"):
        create_model(f"timm:{name}")


def test_readme_sequences_example_runs() -> None:
    """The sequences example of README.md, executed as it is."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"<!-- sequences-example -->\s*```python\n(.*?)```", readme, re.S)
    assert block, "README.md lost its sequences example"
    exec(compile(block.group(1), "README.md", "exec"), {})


def test_fc3_figure_of_a_1d_model(tmp_path) -> None:
    """A 1-D block's figure: the whole (l, l) matrix of one channel pair (output x input positions); a
    model without RepMLP blocks is a note in the run's report."""
    from repmlp.bench.viz import plot_fc3
    from repmlp.tasks.classification_report import _fc3

    model = create_model("repmlp1d_fmnist").eval()
    sample = plot_fc3(model, tmp_path / "fc3.png", point=(2,), out_channel=1)
    assert sample.one_d and sample.train.shape == sample.merged.shape == (7, 7) and sample.point == (2, 2)
    assert (tmp_path / "fc3.png").read_bytes().startswith(b"\x89PNG")
    assert sample.largest_kernel == (1, 5)  # K = 1, 3, 5
    with pytest.raises(ValueError, match="partition of 7 positions"):
        plot_fc3(model, tmp_path / "bad.png", point=(7,))
    notes: list[str] = []
    assert _fc3(None, create_model("conv1d_fmnist"), notes) is None  # type: ignore[arg-type]
    assert notes == ["FC3 figure skipped: the model has no RepMLP block"]
