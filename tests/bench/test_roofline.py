"""The roofline (:mod:`repmlp.bench.roofline`): its walk and accountings against a hand count and against an
independent calculation of the paper's models on an H200, and ``repmlp bench --roofline``."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from repmlp.bench.counts import profile_model
from repmlp.bench.roofline import (
    GPUS,
    Device,
    ceiling,
    deployed,
    find_device,
    measure_cpu,
    render,
    roofline,
    walk,
)
from repmlp.deploy.runtimes import missing_runtime
from repmlp.errors import UserError
from repmlp_testdata import run_cli, user_error_line

# An independent calculation on paper (not with this code) of the deployed models at batch 128, 224x224, on an
# H200 (989 TFLOP/s fp16, 67 TFLOP/s fp32, 4.8 TB/s): the roofline note of 2026-11-27 (its tables "Deployed
# (inference form), batch 128"): MACs per image, the fused ceilings in examples/s, and the unfused gigabytes of
# a batch in fp16, which leave out the partition copies its own definition of "unfused" materialises.
PAPER_H200 = {  # name -> (model, options, GMAC/image, fp16 fused ex/s, fp32 fused ex/s, fp16 unfused GB)
    "ResNet-50": ("repmlp_res50", {"stages": ()}, 4.089, 68_849, 8_131, 20.76),
    "RepMLP-Res50": ("repmlp_res50", {}, 3.891, 70_066, 8_529, 21.84),
    "Light": ("repmlp_res50_light", {}, 2.920, 77_443, 11_324, 20.49),
}


@pytest.fixture(scope="module")
def h200_walks():
    """name -> (ops of one batch of 128, MACs per image from repmlp.bench.counts)."""
    walks = {}
    for label, (name, options, *_) in PAPER_H200.items():
        model = deployed(name, (3, 224, 224), **options)
        walks[label] = walk(model, (128, 3, 224, 224)), profile_model(name, 224, **options)[1]
    return walks


def _ceiling(ops, precision: str, accounting: str = "fused") -> float:
    """Examples/s of a batch of 128 on the H200 of the table."""
    seconds = sum(t for t, _ in ceiling(ops, find_device("h200", precision), precision, accounting))
    return 128 / seconds


def test_h200_ceilings_match_an_independent_calculation(h200_walks):
    base = h200_walks["ResNet-50"][0]
    for key, (*_, gmacs, fp16, fp32, unfused_gb) in PAPER_H200.items():
        ops, counted = h200_walks[key]
        macs = sum(op.macs for op in ops) / 128
        assert macs == counted and round(macs / 1e9, 3) == gmacs  # the paper's and repmlp.bench's MACs
        for precision, expected in (("fp16", fp16), ("fp32", fp32)):
            assert _ceiling(ops, precision) == pytest.approx(expected, rel=0.01), (key, precision)
            expected_ratio = expected / PAPER_H200["ResNet-50"][3 + (precision == "fp32")]
            ratio = _ceiling(ops, precision) / _ceiling(base, precision)
            assert ratio == pytest.approx(expected_ratio, rel=0.01), (key, precision)
        # Unfused: the note's figure, which counts each block's partition copies as a pass over memory.
        unfused = ceiling(ops, find_device("h200", "fp16"), "fp16", "unfused")
        copies = sum(b for op, (_, b) in zip(ops, unfused, strict=True) if op.kind == "copy")
        assert (copies > 0) == (key != "ResNet-50")
        assert sum(b for _, b in unfused) / 1e9 == pytest.approx(unfused_gb, rel=0.005)


def test_torchvision_resnet50_is_the_baseline():
    r = roofline("torchvision:resnet50", 4, "fp16", find_device("h200", "fp16"))
    assert r.ratio("fused") == pytest.approx(1.0) and r.ratio("unfused") == pytest.approx(1.0)


def test_one_conv_and_one_linear_by_hand():
    n, c, o, k, hw, classes = 2, 3, 4, 3, 8, 5
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Conv2d(c, o, k, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(o * hw * hw, classes)
        )
    ops = walk(model, (n, c, hw, hw))
    assert [(op.kind, op.stage) for op in ops] == [("conv", "0"), ("elementwise", "1"), ("matmul", "3")]
    x, y, z = n * c * hw * hw, n * o * hw * hw, n * classes  # activations: input, conv output, logits
    conv_w, fc_w = o * c * k * k + o, classes * o * hw * hw + classes
    assert [op.macs for op in ops] == [y * c * k * k, 0, n * classes * o * hw * hw]
    gemms = [x + conv_w + y, y + fc_w + z]
    expected = {  # elements: conv, ReLU, linear
        "fused": [gemms[0], 0, gemms[1]],
        "onepass": [gemms[0] + 2 * y, 0, gemms[1] + 2 * z],  # one pass: bias + ReLU; the linear's bias
        "unfused": [gemms[0] + 2 * y, 2 * y, gemms[1] + 2 * z],  # bias and ReLU a pass each
    }
    dev = Device("t", peak=1e9, bandwidth=3e9)
    for accounting, elements in expected.items():
        costs = ceiling(ops, dev, "fp32", accounting)
        assert [b for _, b in costs] == [4 * e for e in elements]
        passes = [2 * y * (accounting != "fused"), elements[1], 2 * z * (accounting != "fused")]
        times = [
            max(2 * op.macs / 1e9, 4 * (e - p) / 3e9) + 4 * p / 3e9
            for op, e, p in zip(ops, elements, passes, strict=True)
        ]
        assert [t for t, _ in costs] == pytest.approx(times, rel=1e-12)


def test_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert find_device(torch.device("cuda:0"), "fp16") == Device(
        "NVIDIA H100 SXM", GPUS["h100"][3], GPUS["h100"][4]
    )
    dev = find_device("NVIDIA GeForce RTX 4090", "bf16")
    assert (dev.peak, dev.bandwidth) == (GPUS["rtx4090"][3], GPUS["rtx4090"][4])
    assert find_device("cuda", "tf32").peak == GPUS["h100"][2]
    assert find_device("h200", "fp32", peak=2.0).peak == 2.0
    with pytest.raises(UserError, match="not in the roofline's table"):
        find_device("NVIDIA L40S", "fp16")  # not an L4
    for precision in ("fp32", "int8"):
        cpu = measure_cpu(precision, size=64)
        assert cpu.peak > 0 and cpu.bandwidth > 0 and math.isfinite(cpu.peak + cpu.bandwidth)
    with pytest.raises(UserError, match="holds no int8 peak"):
        find_device("h200", "int8")
    assert find_device("h200", "int8", peak=1.0, bandwidth=2.0) == Device("NVIDIA H200", 1.0, 2.0)


def _ceilings(out: str) -> list[float]:
    line = next(ln for ln in out.splitlines() if ln.startswith("Ceiling ("))
    return [float(v.replace(",", "")) for v in line.split(": ")[1].split(" examples/s")[0].split(" / ")]


def test_cli_named_gpu_needs_no_gpu():
    res = run_cli("bench", "--model", "mobilefacenet", "--device", "h200", "--precision", "fp16",
                  "--batch-size", 16, "--roofline")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "| Model |" not in res.stdout  # nothing timed
    expected = roofline("mobilefacenet", 16, "fp16", find_device("h200", "fp16"), (3, 96, 96))
    assert _ceilings(res.stdout) == [round(expected.throughput(a)) for a in ("fused", "onepass", "unfused")]
    assert "NVIDIA H200 (989 TFLOP/s, 4800 GB/s" in res.stdout and "| total |" in res.stdout


def test_cli_cpu_measures_the_share():
    res = run_cli("bench", "--model", "repmlp_fmnist", "--device", "cpu", "--roofline", "--peak", 0.01,
                  "--bandwidth", 1, "--batch-size", 4, "--warmup", 0, "--repeats", 1, "--forms", "deploy")  # fmt: skip
    assert res.returncode == 0, res.stderr
    speed = float(next(ln for ln in res.stdout.splitlines() if "| deploy |" in ln).split("|")[7])
    r = roofline("repmlp_fmnist", 4, "fp32", Device("cpu", 0.01e12, 1e9), (1, 28, 28))
    roof = res.stdout[res.stdout.index("repmlp_fmnist: batch 4") :]
    assert [ln for ln in render(r).splitlines() if ln[0:1] == "|"] == [
        ln for ln in roof.splitlines() if ln[:1] == "|"
    ]
    found = re.search(
        r"Measured ([\d.,]+) examples/s: ([\d.]+)% / ([\d.]+)% / ([\d.]+)%", res.stdout
    ).groups()
    measured, *shares = (float(v.replace(",", "")) for v in found)
    assert measured == pytest.approx(speed, abs=0.51)  # the table's speed (to 0.1), to 3 digits or 1
    expected = [100 * speed / r.throughput(a) for a in ("fused", "onepass", "unfused")]
    for share, exact in zip(shares, expected, strict=True):  # each printed to 0.1, from a speed to 0.1
        assert abs(share - exact) <= 0.051 + exact * 0.051 / speed


def test_cli_refuses_a_checkpoint():
    res = run_cli("bench", "--roofline", "--checkpoint", "m.pt")
    assert res.returncode == 2 and "--roofline takes registered models" in user_error_line(res.stderr)


def test_int8_moves_one_byte_an_element():
    """int8's ceiling: the same operators as float32's, a quarter of the bytes, at int8's peak."""
    dev = Device("cpu", 1e12, 1e10)
    r8, r32 = (roofline("repmlp_fmnist", 4, p, dev, (1, 28, 28)) for p in ("int8", "fp32"))
    assert r8.parts["total"][0] == r32.parts["total"][0]  # MACs
    assert r8.parts["total"][1:4] == pytest.approx([b / 4 for b in r32.parts["total"][1:4]])


@pytest.mark.skipif(missing_runtime("onnxruntime") is not None, reason="needs onnxruntime (repmlp[export])")
@pytest.mark.slow  # quantises, exports and times an int8 model
def test_cli_int8_measures_the_share():
    res = run_cli("bench", "--model", "repmlp_fmnist", "--device", "cpu", "--roofline", "--precision", "int8",
                  "--peak", 0.04, "--bandwidth", 1, "--batch-size", 4, "--warmup", 0, "--repeats", 1)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "repmlp_fmnist: batch 4, input 1x28x28, int8 on" in res.stdout
    assert re.search(r"Measured [\d.,]+ examples/s: [\d.]+% / ", res.stdout), res.stdout
