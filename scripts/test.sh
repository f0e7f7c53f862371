#!/usr/bin/env bash
# One command: install everything the tests need (virtualenv, perf_analyzer)
# and run the whole suite: lint, deployment-file validation, unit and integration tests.
#   scripts/test.sh [pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/dev_env.sh"
cd "$ROOT"
bash scripts/install_perf_analyzer.sh >/dev/null
ruff check .
bash scripts/validate_deploy.sh
python -m pytest "$@"
