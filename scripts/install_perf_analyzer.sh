#!/usr/bin/env bash
# Install NVIDIA's perf_analyzer load generator into its own virtualenv.
#
# perf_analyzer is a C++ binary shipped inside the manylinux wheel of
# tritonclient (tritonclient-X.data/data/bin/perf_analyzer). It links against
#   libb64.so.0d     -> Debian package libb64-0d
#   libcudart.so.12  -> PyPI package nvidia-cuda-runtime-cu12 (found via LD_LIBRARY_PATH)
# even on a CPU-only machine. The venv is kept apart from the main environment,
# which pins a different tritonclient.
#
# Only the binary is needed, so tritonclient is installed with --no-deps (its
# Python deps -- numpy<2, protobuf<5, ... -- are not used by the binary).
#
# Usage: scripts/install_perf_analyzer.sh
#   PERF_VENV      venv path, relative to the repo root (default .venv-perf)
#   PYTHON         interpreter used to create the venv (default python3)
#   TRITONCLIENT_VERSION / CUDART_VERSION override the pinned versions.
#
# Idempotent: a second run only re-checks the binary (well under a second).
# Prints the perf_analyzer path on its last stdout line.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PERF_VENV="${PERF_VENV:-.venv-perf}"
case "$PERF_VENV" in
  /*) VENV="$PERF_VENV" ;;
  *) VENV="$REPO_ROOT/$PERF_VENV" ;;
esac
PYTHON="${PYTHON:-python3}"
TRITONCLIENT_VERSION="${TRITONCLIENT_VERSION:-2.50.0}"
# Triton 24.09 (client 2.50.0) is built against CUDA 12.6; any 12.x cudart works.
CUDART_VERSION="${CUDART_VERSION:-12.6.77}"

PA_BIN="$VENV/bin/perf_analyzer"

log() { echo "[install_perf_analyzer] $*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    log "need root (or sudo) to run: $*"
    return 1
  fi
}

have_libb64() {
  ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d' \
    || dpkg-query -W -f='${Status}' libb64-0d 2>/dev/null | grep -q 'install ok installed'
}

install_libb64() {
  if have_libb64; then
    return 0
  fi
  log "installing libb64-0d (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  # Try the existing package lists first; refresh them only if that fails.
  if ! as_root apt-get install -y -q --no-install-recommends libb64-0d >/dev/null 2>&1; then
    log "apt-get install failed with current lists; running apt-get update"
    as_root apt-get update -q >/dev/null
    as_root apt-get install -y -q --no-install-recommends libb64-0d >/dev/null
  fi
  have_libb64 || { log "libb64.so.0d still missing after install"; return 1; }
}

# Directory holding libcudart.so.12 inside the venv (empty if absent).
cudart_dir() {
  local d
  for d in "$VENV"/lib/python3*/site-packages/nvidia/cuda_runtime/lib; do
    if [ -e "$d/libcudart.so.12" ]; then
      echo "$d"
      return 0
    fi
  done
  return 0
}

run_pa() {
  local libdir
  libdir="$(cudart_dir)"
  [ -n "$libdir" ] || return 1
  LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$PA_BIN" "$@"
}

verify() {
  # perf_analyzer --version exits 0 and prints e.g. "perf_analyzer 2.50.0" (or similar).
  [ -x "$PA_BIN" ] || return 1
  have_libb64 || return 1
  run_pa --version >/dev/null 2>&1 || run_pa --help >/dev/null 2>&1
}

# ---- fast path ---------------------------------------------------------------
if verify; then
  log "already installed (venv $VENV)"
  echo "$PA_BIN"
  exit 0
fi

# ---- install -----------------------------------------------------------------
install_libb64

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PYTHON" -m venv "$VENV"
fi

if [ ! -x "$PA_BIN" ] || [ -z "$(cudart_dir)" ]; then
  log "installing tritonclient==$TRITONCLIENT_VERSION (binary only) and nvidia-cuda-runtime-cu12==$CUDART_VERSION"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    "tritonclient==$TRITONCLIENT_VERSION" \
    "nvidia-cuda-runtime-cu12==$CUDART_VERSION"
fi

if ! verify; then
  log "perf_analyzer does not run; ldd output:"
  LD_LIBRARY_PATH="$(cudart_dir)" ldd "$PA_BIN" >&2 || true
  run_pa --version >&2 || true
  exit 1
fi

log "perf_analyzer OK; run it with LD_LIBRARY_PATH=$(cudart_dir)"
echo "$PA_BIN"
