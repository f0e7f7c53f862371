#!/usr/bin/env bash
# The GPU-host check as one device command (docs/gpu.md "Measuring on a GPU host"):
#   bash scripts/gpu_host_check.sh BUNDLE [SECONDS] [STEPS]
# BUNDLE holds the small wheels (whl/) and the onnxruntime-gpu wheel's file name
# (wheel_name); the wheel's parts (part0..part4, `split -b 52000000 -d -a 1`) were copied
# to /tmp/gpu-parts by earlier transfers, one each (the device tool sends at most 64 MiB
# per call, the checkout included), or lie in BUNDLE. It installs what is missing (the host
# keeps /tmp while it stays warm), then runs STEPS (default: all, in this order: tests scale
# onnx scaled http work seq; the py-spy runs `profile` and `scaleprof` only when named), most
# important first, each cut to the time left of SECONDS (default 590), so a step that runs
# long costs the ones after it, never the results before it.
# Results go to $OUT (the device tool's output folder, at most 8 files come back):
# steps.txt and one file per step.
# GPU_CHECK_DRY_RUN=1 skips the install (tests/integration/test_dry_gpu_host_check.py runs
# every step's command line through its parser, here, with nothing installed).
set -u
B=$(cd "$1" && pwd); LIMIT=${2:-590}; STEPS=" ${3:-tests scale onnx scaled http work seq} "; O=${OUT:-/tmp/gpu-out}; mkdir -p "$O"; t0=$(date +%s)
el() { echo "[t+$(( $(date +%s)-t0 ))s] $*" | tee -a "$O/steps.txt"; }
export PYTHONUNBUFFERED=1
if [ -z "${GPU_CHECK_DRY_RUN:-}" ] && [ ! -f /tmp/site/.installed ]; then
  el install
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    $(ls "$B"/whl/*.whl | grep -v nvidia_cuda) 2>&1 | tail -2
  rm -rf /tmp/pa && mkdir -p /tmp/pa/bin /tmp/pa/lib/python3.12/site-packages /tmp/pa/x
  ( cd /tmp/pa && python3 -m zipfile -e "$B"/whl/tritonclient-2.50.0-*.whl x \
    && cp x/tritonclient-2.50.0.data/data/bin/perf_analyzer bin/ && chmod +x bin/perf_analyzer \
    && mv x/tritonclient-2.50.0.dist-info lib/python3.12/site-packages/ && rm -rf x \
    && python3 -m zipfile -e "$B"/whl/nvidia_cuda_runtime*.whl lib/python3.12/site-packages/ )
  dpkg -x "$B"/whl/libb64*.deb /tmp/b64
  mkdir -p /tmp/gpu-parts; cp -n "$B"/part[0-9] /tmp/gpu-parts/ 2>/dev/null
  ls -l /tmp/gpu-parts/ | tee -a "$O/steps.txt"
  W=/tmp/$(cat "$B/wheel_name")
  cat /tmp/gpu-parts/part[0-9] > "$W" \
    && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$W" 2>&1 \
    | tail -2 && touch /tmp/site/.installed
fi
NV=$(python3 -c "import glob,nvidia; print(':'.join(sorted({d for p in nvidia.__path__ for d in glob.glob(p+'/*/lib')})))" 2>/dev/null)
export LD_LIBRARY_PATH=/tmp/b64/usr/lib/x86_64-linux-gnu:$NV:${LD_LIBRARY_PATH:-}
export PERF_VENV=/tmp/pa PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nvidia-smi -L | tee -a "$O/steps.txt"; nproc | tee -a "$O/steps.txt"
lscpu | grep -E "^(Model name|Thread|Core|Socket|CPU\(s\))" | tee -a "$O/steps.txt"
python3 -c "import torch, onnxruntime as o; print('torch', torch.__version__, torch.cuda.is_available(), '| ort', o.__version__, o.get_available_providers())" 2>&1 | tee -a "$O/steps.txt"
git log --oneline -1 2>/dev/null | tee -a "$O/steps.txt"
G="python3 -m bench.gpu --device cuda:0 --seconds 3 --measurement-ms 2500 --stability-pct 40"
want() { [[ "$STEPS" == *" $1 "* ]]; }
run() {  # run FILE CAP COMMAND...: appended to $O/FILE.txt, cut to the time left
  local file=$1 cap=$2 left; shift 2
  left=$(( LIMIT - ($(date +%s) - t0) - 5 ))
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 20 ]; then el "skipped (no time left): $*"; return; fi
  el "$file (${cap}s): $*"
  { echo "== $* (STAGESERVE_WORKER_CUDA_SYNC=${STAGESERVE_WORKER_CUDA_SYNC:-auto}," \
      "gRPC servers gateway/scheduler/ratelimiter/worker" \
      "${STAGESERVE_GATEWAY_GRPC_SERVER:-h2}/${STAGESERVE_SCHEDULER_GRPC_SERVER:-h2}/${STAGESERVE_RATELIMITER_GRPC_SERVER:-h2}/${STAGESERVE_WORKER_GRPC_SERVER:-h2}," \
      "stream clients gateway/scheduler" \
      "${STAGESERVE_GATEWAY_STREAM_CLIENT:-h2}/${STAGESERVE_SCHEDULER_STREAM_CLIENT:-h2}," \
      "event loop ${STAGESERVE_STACK_EVENT_LOOP:-uvloop})"
    timeout "$cap" "$@" 2>&1; echo "exit $?"; } >> "$O/$file.txt"
  grep -v '^{"ts"' "$O/$file.txt" | grep -v pkg_resources | tail -8
}
# Issue 29 and 25: the GPU-marked tests (named files only: other unit modules import
# packages the host lacks, opentelemetry).
want tests && run tests 170 python3 -m pytest -q -p no:cacheprovider -m gpu -rs --tb=short \
  tests/unit/test_cuda_sync.py tests/unit/test_onnx_backend.py tests/unit/test_torch_backend.py \
  tests/unit/test_gpus.py tests/unit/test_onnx_options.py tests/unit/test_numeric_policy.py \
  tests/unit/test_cuda_ipc.py \
  $(ls tests/integration/test_gpu_*.py tests/integration/test_cuda_shared_memory*.py 2>/dev/null)
# Issue 26's headline, right after the tests: identity at c=256 with the auto counts of
# this host; then 1, 2 and 4 gateways, the curve of throughput against the cores the stack
# uses (target: 0.7x linear up to 12 cores); then every stage on grpc.aio's gRPC server
# and client (the own HTTP/2 server costs a third of grpc.aio's CPU per unary call and
# half per stream message on 2 cores, the own client half per stream message). On the 2-core VM one gateway took 84 us and the scheduler
# 32 us per identity inference at c=256 (docs/benchmarks.md), where the H100 runs of
# 2026-11-27, on grpc.aio's front, took 500-630 and 63-86.
if want scale; then
  SC="python3 -m bench.scale --models identity --concurrency 256 --measurement-ms 2500 --max-trials 4"
  run scale 70 $SC
  for gateways in 1 2 4; do run scale 60 $SC --gateways $gateways; done
  STAGESERVE_GATEWAY_GRPC_SERVER=grpcio STAGESERVE_SCHEDULER_GRPC_SERVER=grpcio \
    STAGESERVE_RATELIMITER_GRPC_SERVER=grpcio STAGESERVE_WORKER_GRPC_SERVER=grpcio \
    STAGESERVE_GATEWAY_STREAM_CLIENT=grpcio STAGESERVE_SCHEDULER_STREAM_CLIENT=grpcio \
    run scale 70 $SC
  # every stage on asyncio's event loop instead of uvloop's (the 2-core VM: uvloop took
  # 5-10 % less gateway and 7-20 % less worker CPU per identity inference at c=256)
  STAGESERVE_STACK_EVENT_LOOP=asyncio run scale 60 $SC
fi
# Issue 25: both backends through one stack of one gateway and one scheduler; ONNX Runtime
# with the worker's CUDA wait spinning (auto) and sleeping (blocking), side by side.
if want onnx; then
  O1="--gateways 1 --schedulers 1"
  run onnx 50 $G --backend torch $O1
  run onnx 50 $G --backend onnx $O1
  STAGESERVE_WORKER_CUDA_SYNC=blocking run onnx 50 $G --backend onnx $O1
fi
# Issues 25 and 26: the front scaled out on both backends (target: 0.5x of alone). The
# gateways bind first (6 gateways: ~5.8 cores of gateway at 8,300-9,200 infer/s).
S="--gateways 8 --schedulers 2 --workers 2 --concurrency 256"
if want scaled; then
  run scaled 70 $G --backend torch $S
  run scaled 70 $G --backend onnx $S
  STAGESERVE_WORKER_CUDA_SYNC=blocking run scaled 70 $G --backend onnx $S
fi
want http && run http 70 $G --backend torch $S --protocol http
# The scheduler's (stateless and sequence batches) and the gateway's own Python work per
# request on this host's cores, in one process (~45 s): what their CPU per inference in `scale` is bounded by from below.
if want work; then
  run work 30 python3 -m bench.scheduler_work --requests 60
  run work 30 python3 -m bench.gateway_work
  run work 30 python3 -m bench.sequence_work
fi
# Issue 26's sequence target where Redis and the scheduler have cores of their own: the
# accumulator (sequence batcher, states in Redis) against simple in one stack, two rounds.
want seq && run seq 110 python3 -m bench --models accumulator simple accumulator simple \
  --concurrency 8 32 --measurement-ms 2500 --stability-pct 60 \
  --perf-arg=--sequence-length=5 --perf-arg=--input-data=zero
# Where the headline's stages spend their CPU, the model's one scheduler above all
# (py-spy, when the bundle brings it; the figures of this run include py-spy's cost).
want scaleprof && run scaleprof 80 python3 -m bench.scale --models identity --concurrency 256 \
  --measurement-ms 2500 --max-trials 4 --profile /tmp/scale-profile
# Where the scaled stack's CPU goes (py-spy, when the bundle brings it).
want profile && run profile 80 $G --backend onnx $S --profile /tmp/gpu-profile
el end
