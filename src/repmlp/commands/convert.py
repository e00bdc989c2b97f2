"""``repmlp convert``: training-time checkpoint -> deployed checkpoint (paper Sec. 3.4), verified.

Every RepMLP block becomes FC1, FC2 and FC3 (Local Perceptron and BatchNorms merged in), every conv-BN
pair one conv. The deployed file is written only after it has been loaded back into a freshly built
``deploy=True`` model and that model's outputs matched the training-time model's on real inputs: a
batch of the run's validation data when the checkpoint names its data set (or ``--dataset`` is given),
otherwise random inputs.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import UserError
from ._common import checkpoint_input_size, int_at_least, load_checkpoint, positive_float

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from ..cli import HelpFormatter
    from ..deploy import PRECISIONS

    p = subparsers.add_parser(
        "convert",
        help="convert a training-time checkpoint into the deployed (inference) form, verified",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--checkpoint", required=True, type=Path, help="training-time checkpoint (.safetensors)")
    p.add_argument(
        "--output",
        type=Path,
        default=None,
        help="deployed checkpoint to write (default: deploy.safetensors next to model.safetensors, "
        "else <name>-deploy.safetensors)",
    )
    p.add_argument(
        "--dataset", default=None, help="data set for the check inputs (default: the one the run recorded)"
    )
    p.add_argument("--data-dir", default=None, help="its folder (default: the one the run recorded)")
    p.add_argument("--num-examples", type=int_at_least(1), default=64, help="examples in the check batch")
    p.add_argument("--img-size", type=int_at_least(1), default=None, help="input size (default: the run's)")
    p.add_argument(
        "--tolerance",
        type=positive_float,
        default=1e-4,
        help="max allowed |deployed - training-time| relative to max(1, max |output|)",
    )
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="precision of the deployed file; int8 is post-training static quantization with onnxruntime, "
        "calibrated on the run's training images (see repmlp.deploy)",
    )
    p.add_argument(
        "--calibration-examples",
        type=int_at_least(1),
        default=512,
        help="training images that calibrate int8 activation ranges",
    )
    p.set_defaults(func=run)
    return p


def default_output(checkpoint: Path) -> Path:
    if checkpoint.name == "model.safetensors":
        return checkpoint.with_name("deploy.safetensors")
    return checkpoint.with_name(f"{checkpoint.stem}-deploy.safetensors")


def check_inputs(
    info: dict[str, Any],
    input_size: tuple[int, int, int],
    n: int,
    *,
    dataset: str | None = None,
    data_dir: str | None = None,
) -> tuple[Tensor, str]:
    """``(n, C, H, W)`` inputs for the equivalence check and a description of where they come from.

    Real validation images when a data set is known (``dataset`` or the checkpoint's ``extra["dataset"]``)
    and loadable at ``input_size``; else standard-normal noise (seeded). A data set the user named
    explicitly that cannot be loaded is a :class:`UserError`; one only recorded in the file falls back to
    noise with a warning (the data may live on another machine).
    """
    extra = info.get("extra") or {}
    name = dataset or extra.get("dataset")
    folder = data_dir or extra.get("data_dir")
    if name:
        from ..data import DataConfig, build_data

        try:
            data = build_data(
                DataConfig(
                    dataset=name,
                    data_dir=folder,
                    need_train=False,
                    val_limit=n,
                    eval_batch_size=n,
                    img_size=input_size[1],
                    workers=0,
                )
            )
            x, _ = next(iter(data.val.batches(0)))
            if tuple(x.shape[1:]) != tuple(input_size):
                raise UserError(f"its images are {tuple(x.shape[1:])}, the model takes {tuple(input_size)}")
            return x.float(), f"{len(x)} {name} validation images"
        except UserError as exc:
            if dataset:
                msg = str(exc)
                raise UserError(
                    msg if msg.startswith("--dataset") else f"--dataset {dataset}: {msg}"
                ) from None
            log.warning("cannot load the run's data set %s (%s); checking on random inputs", name, exc)
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, *input_size, generator=gen), f"{n} random inputs (no data set known)"


def _max_error(reference: nn.Module, candidate: nn.Module, x: Tensor) -> tuple[float, float]:
    """Max abs difference of the two models' outputs on ``x``, and the max abs reference output."""
    with torch.inference_mode():
        ref, out = reference(x), candidate(x)
    if isinstance(ref, (tuple, list)):
        ref, out = ref[0], out[0]
    return (ref.double() - out.double()).abs().max().item(), ref.abs().max().item()


def calibration_batches(
    info: dict[str, Any],
    input_size: tuple[int, int, int],
    n: int,
    *,
    dataset: str | None = None,
    data_dir: str | None = None,
) -> list[Tensor]:
    """The first ``n`` training images of the run's data set (or ``dataset``) in batches of <= 64.

    No data set known, or one that cannot be loaded, is a :class:`UserError`: int8 ranges calibrated
    on noise would be wrong for real images.
    """
    from ..data import DataConfig, build_data

    extra = info.get("extra") or {}
    name = dataset or extra.get("dataset")
    if not name:
        raise UserError(
            "--precision int8 needs calibration data: the checkpoint names no data set; pass --dataset "
            "(and --data-dir) of the training data"
        )
    try:
        data = build_data(
            DataConfig(
                dataset=name,
                data_dir=data_dir or extra.get("data_dir"),
                train_limit=n,
                batch_size=min(n, 64),
                img_size=input_size[1],
                workers=0,
            )
        )
    except UserError as exc:
        raise UserError(f"--precision int8: cannot load calibration data ({exc})") from None
    return [x.float() for x, _ in data.train.batches(0)]


def _reduce_precision(
    deployed: nn.Module, precision: str, x: Tensor, calibration: list[Tensor] | None
) -> tuple[nn.Module, float, float]:
    """``deployed`` (float32, verified) in ``precision``; its max abs logit change and changed-argmax share."""
    from ..deploy import native_support, to_precision

    reason = native_support(precision)
    if reason:
        log.warning("%s", reason)
    with torch.inference_mode():
        ref = deployed(x).float()
    try:
        reduced = to_precision(copy.deepcopy(deployed), precision, calibration, input_size=tuple(x.shape[1:]))
        with torch.inference_mode():
            out = reduced(x).float()
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"--precision {precision}: this machine cannot run the model in {precision} ({first})"
        ) from None
    if not torch.isfinite(out).all():
        raise UserError(f"--precision {precision}: the model's outputs overflow in {precision}")
    err = (out - ref).abs().max().item()
    changed = (out.argmax(1) != ref.argmax(1)).float().mean().item() if out.dim() == 2 else float("nan")
    return reduced, err, changed


def run(args: argparse.Namespace) -> int:
    from .. import reparameterize_model
    from ..checkpoint import load_model, save_model
    from ..files import CheckpointError

    output = args.output or default_output(args.checkpoint)
    if output.exists() and output.resolve() == args.checkpoint.resolve():
        raise UserError(f"--output {output} would overwrite the checkpoint being converted")
    if output.is_dir():
        raise UserError(f"--output {output} is a folder")
    model, info = load_checkpoint(args.checkpoint)
    if info["form"] != "train":
        raise UserError(f"{args.checkpoint} is already a deployed checkpoint of {info['model']}")
    input_size = checkpoint_input_size(model, info, args.img_size)
    x, source = check_inputs(
        info, input_size, args.num_examples, dataset=args.dataset, data_dir=args.data_dir
    )
    calibration = None
    if args.precision == "int8":
        calibration = calibration_batches(
            info, input_size, args.calibration_examples, dataset=args.dataset, data_dir=args.data_dir
        )

    extra = dict(info.get("extra") or {})
    extra["converted_from"] = str(args.checkpoint)
    output.parent.mkdir(parents=True, exist_ok=True)
    # Stage in the output's folder; the real name appears only once the file has passed the check.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        # Fold every BN (smallest, fastest model) unless the registered deploy=True model keeps some
        # (e.g. timm models that know nothing of deploy=): the file must load into that model.
        for fuse_bn in (True, False):
            deployed = reparameterize_model(model, fuse_bn=fuse_bn)
            save_model(
                tmp,
                deployed,
                name=info["model"],
                model_kwargs=info["model_kwargs"],
                form="deploy",
                extra=extra,
            )
            try:
                reloaded, _ = load_model(tmp, form="deploy")
                break
            except CheckpointError as exc:
                if not fuse_bn:
                    raise UserError(
                        f"the deployed {info['model']} does not load into create_model({info['model']!r}, "
                        f"deploy=True): {exc}"
                    ) from None
                log.info(
                    "deploy=True %s keeps some BatchNorms; converting without folding them", info["model"]
                )
        err, largest = _max_error(model, reloaded, x)
        allowed = args.tolerance * max(1.0, largest)
        if not err <= allowed:
            raise UserError(
                f"deployed model differs from the training-time model by {err:.3g} on {source} "
                f"(allowed {allowed:.3g}); {output} not written"
            )
        if args.precision != "fp32":
            reduced, p_err, changed = _reduce_precision(reloaded, args.precision, x, calibration)
            # An int8 graph has no registry config left to tell its input size: record it.
            extra.setdefault("input_size", list(input_size))
            save_model(
                tmp,
                reduced,
                name=info["model"],
                model_kwargs=info["model_kwargs"],
                form="deploy",
                extra=extra,
                precision=args.precision,
            )
            load_model(tmp, form="deploy")  # the file must load back
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    n_train = sum(p.numel() for p in model.parameters())
    n_deploy = sum(p.numel() for p in reloaded.parameters())
    print(
        f"wrote {output} ({info['model']}, deployed form, {args.precision}, {n_deploy / 1e6:.3f}M params; "
        f"training-time {n_train / 1e6:.3f}M)"
    )
    print(f"max abs error deployed vs training-time: {err:.3e} (max |output| {largest:.3g}) on {source}")
    if args.precision != "fp32":
        print(
            f"{args.precision}: max abs logit change vs float32 deployed {p_err:.3e}, "
            f"{100 * changed:.2f}% of predictions changed on {source}; file {output.stat().st_size} bytes"
        )
    return 0
