"""Fixtures shared by the test modules, and the skip of the CUDA tier on machines without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

# Where the tests marked `cuda` run: a CUDA device; REPMLP_CUDA_TIER_DEVICE=cpu runs their logic on the
# CPU instead (a development aid for machines without a GPU: slow, and no CUDA-specific code is reached).
CUDA_TIER_DEVICE = os.environ.get("REPMLP_CUDA_TIER_DEVICE", "cuda")


# REPMLP_TEST_SHARD=K/N keeps every Nth selected test, from the Kth (0-based): benchmarks/pytest_shards.sh
# runs N such processes side by side, which is how benchmarks/gpu_check.sh runs the CUDA tier on a GPU
# machine (many cores, one GPU, no pytest-xdist).
TEST_SHARD = os.environ.get("REPMLP_TEST_SHARD", "")


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` -> ``(K, N)`` with ``0 <= K < N``; anything else is a usage error naming the variable."""
    k, sep, n = text.partition("/")
    if sep and k.isdigit() and n.isdigit() and 0 <= int(k) < int(n):
        return int(k), int(n)
    raise pytest.UsageError(f"REPMLP_TEST_SHARD must be K/N with 0 <= K < N, got {text!r}")


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` have deselected theirs, so the shards split what is left
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep this process's shard of the tests (``REPMLP_TEST_SHARD``), and skip the tests marked ``cuda``
    where there is no CUDA device (and no CPU run of them was asked)."""
    if TEST_SHARD:
        k, n = parse_shard(TEST_SHARD)
        config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % n != k])
        items[:] = items[k::n]
    if CUDA_TIER_DEVICE != "cuda" or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tiny models: on a shared 2-core machine more threads only add
    contention (measured 50x slower), and one thread fixes the reduction order for bitwise comparisons."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
