#!/usr/bin/env bash
# One command: install everything the tests need (virtualenv, perf_analyzer,
# real Triton 2.51 as the referee: the tests that diff StageServe against it
# run, ~10 s to install from the nvidia-pytriton wheel) and run the whole
# suite: lint, type check, import-layer contracts, deployment-file validation,
# unit and integration tests.
#   scripts/test.sh [pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/dev_env.sh"
cd "$ROOT"
bash scripts/install_perf_analyzer.sh >/dev/null
SKIP_PERF_ANALYZER=1 bash scripts/install_references.sh triton 2>&1 | tail -n 2
ruff check .
mypy
lint-imports
bash scripts/validate_deploy.sh
# Two test processes, one test file at a time each (module fixtures stay
# shared); STAGESERVE_TEST_PROCESSES=0 runs the suite in this process.
python -m pytest -n "${STAGESERVE_TEST_PROCESSES:-2}" --dist loadfile "$@"
