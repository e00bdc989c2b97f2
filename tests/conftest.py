"""Fixtures shared by the test modules, and the skip of the CUDA tier on machines without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

# Where the tests marked `cuda` run: a CUDA device; REPMLP_CUDA_TIER_DEVICE=cpu runs their logic on the
# CPU instead (a development aid for machines without a GPU: slow, and no CUDA-specific code is reached).
CUDA_TIER_DEVICE = os.environ.get("REPMLP_CUDA_TIER_DEVICE", "cuda")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked ``cuda`` where there is no CUDA device (and no CPU run of them was asked)."""
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
