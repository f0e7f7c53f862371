#!/usr/bin/env bash
# One command: install (first run only) and start the whole stack.
#   scripts/up.sh                              # example repository, embedded Redis
#   scripts/up.sh --model-repository DIR ...   # any tritonserver-style flags
# Give REDIS_URL (or --redis-url) to use an existing Redis instead.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/dev_env.sh"
cd "$ROOT"
exec stageserve up "$@"
