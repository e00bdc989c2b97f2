"""``import repmlp`` registers every model with timm, in any import order (issue 63): timm users write
``import repmlp, timm; timm.create_model(name)``. The orders run in a child interpreter, each on freshly
imported modules."""

from __future__ import annotations

import subprocess
import sys

import pytest
import timm

import repmlp
from repmlp.models.registry import OUTSIDE_TIMM
from repmlp_testdata import subprocess_env

# Every model of ours timm builds (this process imported repmlp; the child checks it gets the same names).
TIMM_NAMES = sorted(set(repmlp.list_models()) - set(OUTSIDE_TIMM))

# The child: after the imports, timm builds every name (on the meta device: shapes only), the models outside
# timm's classifier contract stay out of timm's registry but are repmlp's, and model files of every
# precision load.
CHILD = """
import sys
IMPORTS
import repmlp, timm, torch
names = sys.argv[1].split(",")
ours = sorted(n for n in timm.list_models() if timm.models.model_entrypoint(n).__module__.startswith("repmlp."))
assert ours == names, (ours, names)
with torch.device("meta"):
    for name in names:
        assert timm.create_model(name).pretrained_cfg["architecture"] == name
outside = set(repmlp.list_models()) - set(names)
assert outside == set(sys.argv[2].split(",")) and not outside & set(timm.list_models()), outside
assert set(repmlp.__all__) <= set(dir(repmlp))
from repmlp.io.model_file import PRECISION_LOADERS  # the reduced precisions' loaders: registered too
assert set(PRECISION_LOADERS) == {"bf16", "fp16", "int8"}, PRECISION_LOADERS
print(len(names))
"""


def test_every_name_is_ours() -> None:
    assert len(TIMM_NAMES) >= 20 and {"repmlp_res50_light", "repmlp_cifar"} <= set(TIMM_NAMES)
    assert {"pspnet_res50", "repmlp1d_fmnist"} <= set(OUTSIDE_TIMM)
    assert set(TIMM_NAMES) <= set(timm.list_models())


# The import orders, run one after the other in one interpreter (one start-up of torch instead of three):
# the first with nothing imported before it; before each other, every repmlp and timm module is dropped from
# sys.modules, so each order imports and registers them afresh (torch, already imported, is what the last
# order imports first anyway).
ORDERS = ["import repmlp, timm", "import timm, repmlp", "import torch, repmlp, timm"]
RUNNER = """
import sys
for imports in sys.argv[3:]:
    for name in [m for m in sys.modules if m.partition(".")[0] in ("repmlp", "timm")]:
        del sys.modules[name]
    exec(compile(CHILD.replace("IMPORTS", imports), imports, "exec"), {"__name__": "__main__"})
"""


@pytest.mark.slow  # an interpreter that imports torch, timm and repmlp three times (~10 s on 2 cores)
def test_import_repmlp_registers_every_model_with_timm() -> None:
    """``timm.create_model`` of every registered name works right after ``import repmlp``, whatever was
    imported before it (nothing, torch, or timm itself)."""
    code = f"CHILD = {CHILD!r}\n{RUNNER}"
    args = [sys.executable, "-c", code, ",".join(TIMM_NAMES), ",".join(sorted(OUTSIDE_TIMM)), *ORDERS]
    res = subprocess.run(args, capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(len(TIMM_NAMES))] * len(ORDERS)  # every order ran to its end
