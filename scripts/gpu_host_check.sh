#!/usr/bin/env bash
# The GPU-host check, in two halves that each fit one 10-minute device command:
#   bash scripts/gpu_host_check.sh BUNDLE tests   # install, the GPU-marked tests, ORT figures
#   bash scripts/gpu_host_check.sh BUNDLE bench   # TorchScript, the scaled-out stack, bench.scale
# BUNDLE holds the small wheels (whl/), the last onnxruntime-gpu part (part4) and the
# wheel's file name (wheel_name); parts 0-3 were copied to /tmp/gpu-parts by earlier
# transfers (docs/gpu.md "Measuring on a GPU host"; ../shared/gpu-host/ builds the bundle).
# Each half installs what is missing (the host keeps /tmp while it stays warm). Results go
# to $OUT (the device tool's output folder), one file per step, most important step first.
set -u
B=$(cd "$1" && pwd); HALF=${2:-tests}; O=${OUT:-/tmp/gpu-out}; mkdir -p "$O"; t0=$(date +%s)
el() { echo "[t+$(( $(date +%s)-t0 ))s] $*" | tee -a "$O/steps.txt"; }
export PYTHONUNBUFFERED=1
if [ ! -f /tmp/site/.installed ]; then
  el install
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    $(ls "$B"/whl/*.whl | grep -v nvidia_cuda) 2>&1 | tail -2
  rm -rf /tmp/pa && mkdir -p /tmp/pa/bin /tmp/pa/lib/python3.12/site-packages /tmp/pa/x
  ( cd /tmp/pa && python3 -m zipfile -e "$B"/whl/tritonclient-2.50.0-*.whl x \
    && cp x/tritonclient-2.50.0.data/data/bin/perf_analyzer bin/ && chmod +x bin/perf_analyzer \
    && mv x/tritonclient-2.50.0.dist-info lib/python3.12/site-packages/ && rm -rf x \
    && python3 -m zipfile -e "$B"/whl/nvidia_cuda_runtime*.whl lib/python3.12/site-packages/ )
  dpkg -x "$B"/whl/libb64*.deb /tmp/b64
  ls -l /tmp/gpu-parts/ | tee -a "$O/steps.txt"
  W=/tmp/$(cat "$B/wheel_name")
  cat /tmp/gpu-parts/part0 /tmp/gpu-parts/part1 /tmp/gpu-parts/part2 /tmp/gpu-parts/part3 \
    "$B/part4" > "$W" \
    && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$W" 2>&1 \
    | tail -2 && touch /tmp/site/.installed
fi
NV=$(python3 -c "import glob,nvidia; print(':'.join(sorted({d for p in nvidia.__path__ for d in glob.glob(p+'/*/lib')})))" 2>/dev/null)
export LD_LIBRARY_PATH=/tmp/b64/usr/lib/x86_64-linux-gnu:$NV:${LD_LIBRARY_PATH:-}
export PERF_VENV=/tmp/pa PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nvidia-smi -L | tee -a "$O/steps.txt"; nproc
python3 -c "import torch, onnxruntime as o; print('torch', torch.__version__, torch.cuda.is_available(), '| ort', o.__version__, o.get_available_providers())" 2>&1 | tee -a "$O/steps.txt"
git log --oneline -1 2>/dev/null | tee -a "$O/steps.txt"
G="python3 -m bench.gpu --device cuda:0 --seconds 3 --measurement-ms 2500 --stability-pct 40"
run() {  # run NAME SECONDS COMMAND...: the output in $O/NAME.txt, its tail here
  local name=$1 secs=$2; shift 2; el "$name"
  timeout "$secs" "$@" > "$O/$name.txt" 2>&1; echo "exit $?" >> "$O/$name.txt"
  grep -v '^{"ts"' "$O/$name.txt" | grep -v pkg_resources | tail -12
}
if [ "$HALF" = tests ]; then
  # Named files only: other unit modules import packages the host lacks (opentelemetry).
  run gputests 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rs --tb=short \
    tests/unit/test_cuda_sync.py tests/unit/test_onnx_backend.py tests/unit/test_torch_backend.py \
    tests/unit/test_gpus.py tests/unit/test_onnx_options.py tests/unit/test_numeric_policy.py \
    tests/unit/test_cuda_ipc.py \
    $(ls tests/integration/test_gpu_*.py tests/integration/test_cuda_shared_memory*.py 2>/dev/null)
  # The defaults (ORT: one padded shape, EXHAUSTIVE; TF32 on), then the worker not spinning
  # (blocking sync; yield is the next to try if blocking costs throughput).
  run onnx 110 $G --backend onnx --variant 'heuristic:cudnn_conv_algo_search=1'
  STAGESERVE_WORKER_CUDA_SYNC=blocking run onnx_blocking 90 $G --backend onnx
else
  run torch 100 $G --backend torch --variant 'fp32:allow_tf32=false'
  STAGESERVE_WORKER_CUDA_SYNC=blocking run torch_blocking 80 $G --backend torch
  # The front scaled out (issue 26): 4 gateways, 2 schedulers, 2 workers on the one GPU.
  run torch_scaled 90 $G --backend torch --gateways 4 --schedulers 2 --workers 2
  run onnx_scaled 90 $G --backend onnx --gateways 4 --schedulers 2 --workers 2
  # Issue 26's headline: identity at c=256 with the auto counts of 16 cores.
  run scale 120 python3 -m bench.scale --models identity --concurrency 256 \
    --measurement-ms 2500 --max-trials 4
fi
el end
