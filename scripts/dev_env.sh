#!/usr/bin/env bash
# Create (or refresh) the project virtualenv at .venv with StageServe and its
# test dependencies. Sourced by scripts/up.sh and scripts/test.sh; fast when
# nothing changed (re-installs only when pyproject.toml is newer than the stamp).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${STAGESERVE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.stageserve-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # torch: the optional extra for PyTorch models; both README commands serve them
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT[test,torch]"
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
