#!/usr/bin/env bash
# timm's own model tests (tests/models/test_models.py of the installed timm's source distribution) on every model
# this package registers with timm. Fetches the sdist once with pip (network), then runs its tests with a
# pytest plugin (scripts/timm_tests_plugin.py) that imports repmlp, so that timm's registry holds its
# models, and keeps only the tests parametrized over those. Extra arguments go to pytest, e.g.
#   bash scripts/timm_model_tests.sh -k "forward_fx or forward_features"
# Not part of the suite: it runs every model at its full size (about 35 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
version=$($PY -c 'import timm; print(timm.__version__)')
dir=${TIMM_SDIST_DIR:-${TMPDIR:-/tmp}/timm-sdist}
if ! ls "$dir/timm-$version"/tests/{models/,}test_models.py >/dev/null 2>&1; then
  mkdir -p "$dir"
  $PY -m pip download -q "timm==$version" --no-binary :all: --no-deps -d "$dir"
  tar -xzf "$dir/timm-$version.tar.gz" -C "$dir"
fi
export PYTHONPATH="$PWD/src:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
cd "$dir/timm-$version"
tests=$(ls tests/{models/,}test_models.py 2>/dev/null | head -1)  # timm moved it from tests/models/ to tests/
exec "$PY" -m pytest -p timm_tests_plugin -p no:cacheprovider "$tests" -q -rfEs "$@"
