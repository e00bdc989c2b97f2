"""The one "convert, reload, compare in full float32" check (``repmlp.deploy.conversion``) that ``repmlp
convert``, every training run's end and the speed tables share: it passes an exact conversion, measures a
wrong one (so callers can fail on it), writes and reloads the deployed file, and falls back to unfolded
BatchNorms when the registered ``deploy=True`` model keeps them."""

from __future__ import annotations

import pytest
import torch

import repmlp
import repmlp.nn.convert as convert_module
from repmlp.deploy.conversion import CONVERSION_RTOL, DeployedFile, compare_outputs, convert_and_check
from repmlp.errors import UserError
from repmlp.io.model_file import CheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "repmlp_fmnist"
KWARGS = {"widths": [4, 8], "kernel_sizes": [1, 3]}


def trained(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = repmlp.create_model(NAME, **KWARGS)
    for m in model.modules():  # statistics that make folding them a real change
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.3, 0.3)
            m.running_var.uniform_(0.5, 2.0)
    return model.eval()


def inputs(n: int = 4) -> torch.Tensor:
    return torch.randn(n, 1, 28, 28, generator=torch.Generator().manual_seed(1))


def test_compare_outputs_measures_difference_scale_and_flips():
    ref = torch.tensor([[1.0, 2.0, 0.0], [3.0, 1.0, -4.0]])
    out = torch.tensor([[1.0, 2.0, 0.0], [3.0, 3.5, -4.0]])  # the second image's top class changes
    diff = compare_outputs(ref, out)
    assert diff.max_abs_diff == 2.5 and diff.max_reference == 4.0 and diff.changed_predictions == 1
    assert diff.max_rel_diff == 2.5 / 4.0
    assert diff.as_dict() == {"max_abs_diff": 2.5, "max_rel_diff": 0.625, "changed_predictions": 1}
    nan = compare_outputs(ref, torch.full_like(ref, float("nan")))
    assert not nan.max_rel_diff <= CONVERSION_RTOL  # NaN outputs are never within a tolerance


def test_an_exact_conversion_passes_and_the_model_is_untouched():
    model = trained()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = inputs()
    check = convert_and_check(model, x)
    assert check.diff.max_rel_diff <= CONVERSION_RTOL and check.seconds >= 0
    assert check.reference.shape == check.outputs.shape == (4, 10)
    blocks = [m for m in check.deployed.modules() if isinstance(m, repmlp.RepMLPBlock)]
    assert blocks and all(b.deploy for b in blocks)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert any(isinstance(m, repmlp.RepMLPBlock) and not m.deploy for m in model.modules())


def test_a_wrong_conversion_is_measured(monkeypatch):
    """The check can fail: a conversion that scales one weight shows far above the tolerance."""
    real = convert_module.reparameterize_model

    def broken(model, **kwargs):
        deployed = real(model, **kwargs)
        with torch.no_grad():
            [p for p in deployed.parameters() if p.dim() > 1][-1].mul_(1.5)  # the classifier's weight
        return deployed

    monkeypatch.setattr(convert_module, "reparameterize_model", broken)
    check = convert_and_check(trained(), inputs())
    assert check.diff.max_rel_diff > 100 * CONVERSION_RTOL  # 0.09 here


def test_a_written_file_is_reloaded_and_compared(tmp_path):
    """With a file, the check runs the deployed model loaded back from it (``deploy=True``, strict), on
    the device asked for; a function of the model gives the outputs (e.g. a whole validation set)."""
    path = tmp_path / "deploy.safetensors"
    x = inputs(6)
    seen = []

    def run(model: torch.nn.Module) -> torch.Tensor:
        seen.append(model)
        return model(x)

    model = trained()
    check = convert_and_check(
        model, run, file=DeployedFile(path, NAME, KWARGS, {"dataset": "x"}), device="cpu"
    )
    assert seen[0] is model and seen[1] is check.deployed
    meta = check.deployed.metadata  # loaded from the file
    extra = {"dataset": "x", "input_size": [1, 28, 28]}  # save_model records the size the model is built for
    assert (meta.path, meta.form, meta.name, meta.extra) == (str(path), "deploy", NAME, extra)
    assert check.diff.max_rel_diff <= CONVERSION_RTOL and check.outputs.shape == (6, 10)
    assert torch.equal(repmlp.load_model(path, form="deploy")(x), check.outputs)


def test_batchnorms_the_deploy_model_keeps_are_written_unfolded(tmp_path, monkeypatch):
    """A file that does not load into the ``deploy=True`` model with every BN folded is written again
    without folding; one that loads in neither way is one error naming the model."""
    import repmlp.io.model_file as model_file

    real_load, real_convert = model_file.load_model, convert_module.reparameterize_model
    folds = []

    def convert(model, **kwargs):
        folds.append(kwargs.get("fuse_bn", True))
        return real_convert(model, **kwargs)

    def load_unfolded_only(path, **kwargs):
        if folds[-1]:
            raise CheckpointError(f"{path} does not fit {NAME} (deploy form): missing: bn.weight")
        return real_load(path, **kwargs)

    monkeypatch.setattr(convert_module, "reparameterize_model", convert)
    monkeypatch.setattr(model_file, "load_model", load_unfolded_only)
    file = DeployedFile(tmp_path / "d.safetensors", NAME, KWARGS)
    check = convert_and_check(trained(), inputs(), file=file)
    assert folds == [True, False] and check.diff.max_rel_diff <= CONVERSION_RTOL

    def never(path, **kwargs):
        raise CheckpointError(f"{path} does not fit")

    monkeypatch.setattr(model_file, "load_model", never)
    with pytest.raises(UserError, match=rf"the deployed {NAME} does not load into create_model\('{NAME}'"):
        convert_and_check(trained(), inputs(), file=file)
