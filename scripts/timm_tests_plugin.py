"""pytest plugin for timm's own ``tests/models/test_models.py`` (``scripts/timm_model_tests.sh``).

Loaded with ``-p`` before the test module is collected: importing repmlp registers its models with timm,
so timm's ``list_models()`` parametrizations include them; collection then keeps only the tests whose
``model_name`` is one of them.
"""

from __future__ import annotations

import pytest
import timm

import repmlp  # noqa: F401  (registers the models with timm)

# Every repmlp model in timm's registry keeps timm's classifier contract: those outside it (the PSPNets, the
# sequence models) are not registered with timm (docs/models.md).
REPMLP_TIMM_MODELS = frozenset(
    n for n in timm.list_models() if timm.models.model_entrypoint(n).__module__.startswith("repmlp.")
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the tests parametrized over one of repmlp's timm models; deselect the rest."""
    keep, drop = [], []
    for item in items:
        spec = getattr(item, "callspec", None)
        name = spec.params.get("model_name") if spec is not None else None
        (keep if name in REPMLP_TIMM_MODELS else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep
