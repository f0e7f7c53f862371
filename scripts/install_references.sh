#!/usr/bin/env bash
# Install the reference servers bench.compare measures StageServe against, each
# in its own virtualenv (both gitignored: .venv*/):
#
#   .venv-triton    the real tritonserver 2.51 (+ its Python backend) from the
#                   PyPI wheel nvidia-pytriton==0.7.0, started directly (not via
#                   pytriton's Python API), and the numpy + onnxruntime its
#                   Python-backend models import.
#   .venv-mlserver  MLServer 1.7 + onnxruntime.
#
# and, unless SKIP_PERF_ANALYZER=1, perf_analyzer (scripts/install_perf_analyzer.sh).
#
# The recipe that makes the wheel's tritonserver run on a CPU-only machine:
#   * LD_LIBRARY_PATH=site-packages/nvidia_pytriton.libs (libtritonserver,
#     libcudart, ... bundled by the wheel; pytriton itself sets it the same way).
#     CUDA is never used: "CUDA driver version is insufficient" and
#     "CudaDriverHelper has not been initialized" at start are expected.
#   * --backend-directory DIR where DIR/python/ holds libtriton_python.so,
#     triton_python_backend_utils.py and triton_python_backend_stub for the
#     venv's Python (pytriton/tritonserver/python_backend_stubs/3.11/); made
#     here as symlinks in .venv-triton/backends/python/.
#   * The stub links the SYSTEM libpython3.11.so.1.0 (Debian 3.11.2) and takes
#     sys.prefix from the `python3` first on PATH. So the venv is made from
#     Debian's /usr/bin/python3.11 and its bin/ goes first on PATH, with no
#     PYTHONHOME/PYTHONPATH: then stdlib and libpython match. (A venv made from
#     pyenv's 3.11.7 pairs pyenv's 3.11.7 stdlib with Debian's 3.11.2 libpython:
#     simple models load, but anything reaching multiprocessing's resource
#     tracker fails with "'_thread.RLock' object has no attribute
#     '_recursion_count'". The smoke start below checks exactly that.)
#   * numpy < 2: the stub's pybind11 predates NumPy 2; with numpy 2.x the
#     models load but every output tensor comes back EMPTY (0 bytes).
#   * MLServer: uvloop < 0.22, or parallel_workers > 0 dies at start
#     ("There is no current event loop in thread 'MainThread'").
#
# Usage: scripts/install_references.sh [triton] [mlserver]   (default: both)
#   TRITON_VENV / MLSERVER_VENV   venv paths, relative to the repo root
#   TRITON_PYTHON                 default /usr/bin/python3.11 (needs libpython3.11 + venv)
#   MLSERVER_PYTHON               default python3
#   PYTRITON_VERSION (0.7.0), MLSERVER_VERSION (1.7.1), ORT_VERSION (default:
#   the main environment's onnxruntime, so every server runs the same ORT)
#
# Idempotent: a second run only re-checks (a few seconds, including a
# tritonserver smoke start).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
abspath() { case "$1" in /*) echo "$1" ;; *) echo "$REPO_ROOT/$1" ;; esac; }
TRITON_VENV="$(abspath "${TRITON_VENV:-.venv-triton}")"
MLSERVER_VENV="$(abspath "${MLSERVER_VENV:-.venv-mlserver}")"
TRITON_PYTHON="${TRITON_PYTHON:-/usr/bin/python3.11}"
MLSERVER_PYTHON="${MLSERVER_PYTHON:-python3}"
PYTRITON_VERSION="${PYTRITON_VERSION:-0.7.0}"
MLSERVER_VERSION="${MLSERVER_VERSION:-1.7.1}"

log() { echo "[install_references] $*" >&2; }
# pip, minus the warnings a pip.conf with missing local index directories prints per package.
pip_install() {
  local out rc=0
  out="$("$1/bin/python" -m pip install -q --disable-pip-version-check "${@:2}" 2>&1)" || rc=$?
  printf '%s\n' "$out" | grep -v -e "is neither a file nor a directory" -e '^$' >&2 || true
  return "$rc"
}

if [ -z "${ORT_VERSION:-}" ]; then
  main_py="python3"
  [ -x "$REPO_ROOT/.venv/bin/python" ] && main_py="$REPO_ROOT/.venv/bin/python"
  ORT_VERSION="$("$main_py" -c 'import onnxruntime; print(onnxruntime.__version__)' 2>/dev/null || true)"
fi
ORT_SPEC="onnxruntime${ORT_VERSION:+==$ORT_VERSION}"

want_triton=0 want_mlserver=0
[ $# -eq 0 ] && set -- triton mlserver
for arg in "$@"; do
  case "$arg" in
    triton) want_triton=1 ;;
    mlserver) want_mlserver=1 ;;
    *) log "unknown argument $arg (expected: triton, mlserver)"; exit 2 ;;
  esac
done

# ----------------------------------------------------------------------- Triton
triton_site() { ls -d "$TRITON_VENV"/lib/python3*/site-packages 2>/dev/null | head -n1; }

triton_smoke() {
  # Start tritonserver on a one-model repository (a Python-backend model that
  # imports numpy and onnxruntime) with no endpoints; wait for the load result.
  local site="$1" backends="$2" tmp rc=1 pid i
  tmp="$(mktemp -d)"
  mkdir -p "$tmp/repo/smoke/1"
  cat >"$tmp/repo/smoke/config.pbtxt" <<'EOF'
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
EOF
  cat >"$tmp/repo/smoke/1/model.py" <<'EOF'
from multiprocessing import resource_tracker
import numpy as np
import onnxruntime  # noqa: F401
import triton_python_backend_utils as pb_utils
assert int(np.__version__.split(".")[0]) < 2, np.__version__
resource_tracker.ensure_running()  # stdlib and libpython must be the same Python
class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0",
                pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]) for r in requests]
EOF
  env -u PYTHONHOME -u PYTHONPATH -u VIRTUAL_ENV \
    PATH="$TRITON_VENV/bin:$PATH" \
    LD_LIBRARY_PATH="$site/nvidia_pytriton.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$site/pytriton/tritonserver/bin/tritonserver" \
    --model-repository "$tmp/repo" --backend-directory "$backends" \
    --allow-grpc false --allow-http false --allow-metrics false --allow-gpu-metrics false \
    --exit-timeout-secs 2 >"$tmp/log" 2>&1 &
  pid=$!
  for i in $(seq 1 300); do
    if grep -q "successfully loaded 'smoke'" "$tmp/log"; then rc=0; break; fi
    if grep -qE "failed to load|error: creating server" "$tmp/log" || ! kill -0 "$pid" 2>/dev/null; then
      break
    fi
    sleep 0.2
  done
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  if [ "$rc" -ne 0 ]; then
    log "tritonserver smoke start failed; its log:"
    grep -vE "^\+|^\|" "$tmp/log" | tail -n 30 >&2
  fi
  rm -rf "$tmp"
  return "$rc"
}

install_triton() {
  local site stub_dir py_ver backends t0=$SECONDS
  if [ ! -x "$TRITON_VENV/bin/python" ]; then
    [ -x "$TRITON_PYTHON" ] || { log "$TRITON_PYTHON not found (apt-get install python3.11 python3.11-venv libpython3.11)"; return 1; }
    log "creating $TRITON_VENV from $TRITON_PYTHON"
    "$TRITON_PYTHON" -m venv "$TRITON_VENV"
  fi
  py_ver="$("$TRITON_VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  if ! "$TRITON_VENV/bin/python" -c "
import importlib.metadata as md, sys
v = {d: md.version(d) for d in ('nvidia-pytriton', 'numpy', 'onnxruntime')}
assert v['nvidia-pytriton'] == '$PYTRITON_VERSION', v
assert int(v['numpy'].split('.')[0]) < 2, v
assert not '$ORT_VERSION' or v['onnxruntime'] == '$ORT_VERSION', v
" >/dev/null 2>&1; then
    log "installing nvidia-pytriton==$PYTRITON_VERSION (binary + backend only), numpy<2, $ORT_SPEC"
    pip_install "$TRITON_VENV" "numpy<2" "$ORT_SPEC"
    # --no-deps (and last, so pip does not list them as conflicts): pytriton's
    # own Python deps are for its API, which is not used.
    pip_install "$TRITON_VENV" --no-deps "nvidia-pytriton==$PYTRITON_VERSION"
  fi
  site="$(triton_site)"
  stub_dir="$site/pytriton/tritonserver/python_backend_stubs/$py_ver"
  [ -x "$stub_dir/triton_python_backend_stub" ] || { log "no Python backend stub for Python $py_ver in the wheel"; return 1; }
  if LD_LIBRARY_PATH="$site/nvidia_pytriton.libs" ldd "$stub_dir/triton_python_backend_stub" | grep -q "not found"; then
    log "the stub misses libraries (libpython$py_ver? apt-get install libpython$py_ver):"
    LD_LIBRARY_PATH="$site/nvidia_pytriton.libs" ldd "$stub_dir/triton_python_backend_stub" | grep "not found" >&2
    return 1
  fi
  backends="$TRITON_VENV/backends"
  mkdir -p "$backends/python"
  ln -sfn "$site/pytriton/tritonserver/backends/python/libtriton_python.so" "$backends/python/libtriton_python.so"
  ln -sfn "$site/pytriton/tritonserver/backends/python/triton_python_backend_utils.py" "$backends/python/triton_python_backend_utils.py"
  ln -sfn "$stub_dir/triton_python_backend_stub" "$backends/python/triton_python_backend_stub"
  triton_smoke "$site" "$backends"
  log "triton OK in $((SECONDS - t0))s: $site/pytriton/tritonserver/bin/tritonserver --backend-directory $backends"
}

# ----------------------------------------------------------------------- MLServer
install_mlserver() {
  local t0=$SECONDS
  if [ ! -x "$MLSERVER_VENV/bin/python" ]; then
    log "creating $MLSERVER_VENV from $MLSERVER_PYTHON"
    "$MLSERVER_PYTHON" -m venv "$MLSERVER_VENV"
  fi
  if ! "$MLSERVER_VENV/bin/python" -c "
import importlib.metadata as md
v = {d: md.version(d) for d in ('mlserver', 'onnxruntime', 'uvloop')}
assert v['mlserver'] == '$MLSERVER_VERSION', v
assert tuple(int(x) for x in v['uvloop'].split('.')[:2]) < (0, 22), v
assert not '$ORT_VERSION' or v['onnxruntime'] == '$ORT_VERSION', v
import mlserver, onnxruntime
" >/dev/null 2>&1; then
    log "installing mlserver==$MLSERVER_VERSION, $ORT_SPEC, uvloop<0.22"
    pip_install "$MLSERVER_VENV" "mlserver==$MLSERVER_VERSION" "$ORT_SPEC" "uvloop<0.22"
  fi
  "$MLSERVER_VENV/bin/mlserver" --version >/dev/null
  log "mlserver OK in $((SECONDS - t0))s: $("$MLSERVER_VENV/bin/mlserver" --version 2>&1 | tail -n1)"
}

[ "$want_triton" -eq 1 ] && install_triton
[ "$want_mlserver" -eq 1 ] && install_mlserver
if [ "${SKIP_PERF_ANALYZER:-0}" != "1" ]; then
  "$REPO_ROOT/scripts/install_perf_analyzer.sh" >/dev/null
fi
log "done"
