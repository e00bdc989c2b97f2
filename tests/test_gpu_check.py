"""``benchmarks/gpu_check.sh``, the prepared script for a lent GPU, tried on the CPU: its dry run lists every
step with its command and time limit within the 8-minute budget, and a quick CPU run of one step writes
its files and ends with the summary."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import parse_shard
from repmlp_testdata import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
SHARDS = ROOT / "benchmarks" / "pytest_shards.sh"


def gpu_check(*args: object, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          env=subprocess_env(**env), timeout=600)  # fmt: skip


def test_dry_run_lists_every_step_within_the_budget_and_runs_nothing(tmp_path):
    data = tmp_path / "fmnist"
    data.mkdir()
    res = gpu_check("--dry-run", "--out", tmp_path / "out", REPMLP_FMNIST_DIR=str(data))
    assert res.returncode == 0, res.stderr
    steps = {m[0]: (int(m[1]), m[2]) for m in re.findall(r"^(\w+) +timeout +(\d+)s: (.*)$", res.stdout, re.M)}
    assert {"main", "tier", "tables"} <= set(steps)
    assert steps["main"][1].endswith(
        f"-m repmlp train --device cuda --data-dir {data} --output {tmp_path}/out/main-job"
    )
    assert steps["tier"][1].startswith(
        f"bash benchmarks/pytest_shards.sh 8 {tmp_path}/out/tier -m cuda tests "
    )
    assert "-m repmlp tables --speed --device cuda --precision fp32 fp16 --output" in steps["tables"][1]
    assert "benchmarks/bench_gpu.py --device cuda --phase train --graphs-only" in steps["bench"][1]
    assert list(steps) == ["main", "bench", "tier", "tables"]  # by what a short lease needs most
    # Each step has its own limit, and the script caps them all by a budget under 8 minutes.
    assert all(0 < cap <= 240 for cap, _ in steps.values())
    budget = int(re.search(r"^BUDGET=\$\{GPU_CHECK_BUDGET:-(\d+)\}", SCRIPT.read_text(), re.M).group(1))
    assert budget <= 8 * 60
    assert not (tmp_path / "out").exists()
    # The image-folder pipeline and torchrun's stop-and-resume run when named.
    res = gpu_check(
        "--dry-run", "--only", "data,torchrun", "--out", tmp_path / "out", REPMLP_FMNIST_DIR=str(data)
    )
    steps = {m[0]: m[2] for m in re.findall(r"^(\w+) +timeout +(\d+)s: (.*)$", res.stdout, re.M)}
    assert list(steps) == ["data", "torchrun"]
    assert "scripts/make_image_folder.py" in steps["data"] and "--gpu-decode" in steps["data"]
    assert "torch.distributed.run --standalone --nproc_per_node 1 -m repmlp train" in steps["torchrun"]
    assert "FAULT_STEP=7" in steps["torchrun"] and "--resume" in steps["torchrun"]


def test_bad_arguments_are_refused():
    res = gpu_check("--device", "tpu", "--dry-run")
    assert res.returncode == 2 and "--device cuda or cpu" in res.stderr
    res = gpu_check("--frobnicate")
    assert res.returncode == 2 and "unknown argument --frobnicate" in res.stderr


@pytest.mark.slow  # a real step: the speed tables' face rows on the CPU (~20 s)
def test_a_quick_cpu_run_writes_its_folder_and_ends_with_the_summary(tmp_path):
    out = tmp_path / "out"
    res = gpu_check("--device", "cpu", "--quick", "--only", "tables", "--out", out)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for name in ("environment.txt", "tables.log", "speed-tables.md", "summary.md"):
        assert (out / name).is_file(), name
    summary = (out / "summary.md").read_text()
    assert res.stdout.endswith(summary)  # printed last
    assert re.search(r"^\| tables \| ok \| \d+ \|$", summary, re.M)
    assert "| RepMLP-FaceRes | `repmlp_face_resnet` | 96 | 1 |" in summary
    assert "torch " in (out / "environment.txt").read_text()


def pytest_shards(n: object, prefix: Path, *args: object) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SHARDS), str(n), str(prefix), "-p", "no:cacheprovider", *map(str, args)],
                          capture_output=True, text=True, env=subprocess_env(PYTHON=sys.executable), cwd=ROOT,
                          timeout=300)  # fmt: skip


# Two cheap tests (no model built): the shards' test processes cost their start-up (pytest, torch) only.
TWO_TESTS = [
    "tests/test_docs.py::test_the_docs_show_names",
    "tests/test_docs.py::test_a_name_that_does_not_resolve_is_caught",
]


@pytest.mark.slow  # three pytest processes that import torch
def test_shards_split_the_selected_tests_between_processes(tmp_path):
    # The tier's way on a GPU machine, on two tests: one shard more than tests, so one shard is left with none.
    n = len(TWO_TESTS) + 1
    res = pytest_shards(n, tmp_path / "s", "-v", *TWO_TESTS)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    ran = [re.findall(r"^(tests/\S+) PASSED", (tmp_path / f"s-{k}.log").read_text(), re.M) for k in range(n)]
    assert sorted(len(r) for r in ran) == [0] + [1] * (n - 1)  # disjoint, one test each ...
    assert sorted(sum(ran, [])) == sorted(TWO_TESTS)  # ... all of them
    assert all((tmp_path / f"s-{k}.xml").is_file() for k in range(n))
    assert [line for line in res.stdout.splitlines() if line.startswith("== shard")] == [
        f"== shard {k}/{n} ({tmp_path}/s-{k}.log)" for k in range(n)
    ]


@pytest.mark.slow  # a pytest process that imports torch
def test_a_failing_shard_fails_the_run_and_bad_shards_are_refused(tmp_path):
    res = pytest_shards(1, tmp_path / "s", "tests/no_such_file.py")
    assert res.returncode == 4  # pytest's usage error, passed on
    assert pytest_shards("0", tmp_path / "s").returncode == 2
    # tests/conftest.py's hook reads REPMLP_TEST_SHARD with parse_shard (the test above runs the hook).
    with pytest.raises(pytest.UsageError, match=re.escape("must be K/N with 0 <= K < N, got '3/3'")):
        parse_shard("3/3")
