#!/usr/bin/env bash
# One-time set-up on a fresh Debian machine; idempotent, so it is cheap to run before every command.
# Installs Debian's Fashion-MNIST (the embedded default data set) and this package with its dev tools
# into the current python3 (set PYTHON=... to choose another interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"

apt_install() {
  command -v apt-get >/dev/null 2>&1 || return 1
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1 && return 0
  $SUDO apt-get update -q >/dev/null 2>&1 || true
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1
}

if [ ! -d /usr/share/datasets/fashion-mnist ]; then
  apt_install dataset-fashion-mnist || echo "setup: dataset-fashion-mnist not installed (training falls back to torchvision's downloader)" >&2
fi
if ! $PY -m pip --version >/dev/null 2>&1; then
  apt_install python3-pip python3-venv || { echo "setup: $PY has no pip and apt-get could not install it" >&2; exit 1; }
fi
# Debian's system Python refuses pip installs (PEP 668) unless told otherwise; a venv or pyenv ignores this.
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
log=$(mktemp)
if ! $PY -m pip install -q -e ".[dev]" >"$log" 2>&1; then
  cat "$log" >&2; rm -f "$log"; echo "setup: pip install failed" >&2; exit 1
fi
rm -f "$log"
# The editable install must point at this checkout, not at another clone installed earlier.
$PY - <<'PYEOF' || { echo "setup: repmlp does not import from this checkout" >&2; exit 1; }
import pathlib, repmlp
assert pathlib.Path(repmlp.__file__).resolve().is_relative_to(pathlib.Path("src").resolve()), repmlp.__file__
PYEOF
