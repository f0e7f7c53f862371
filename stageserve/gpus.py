"""Which GPUs this machine has, and one worker per GPU (`--workers auto`).

Counting asks nvidia-ml-py first (it needs only the driver, and creates no
CUDA context in the launcher), then torch where installed; without either,
or without a driver, there is no GPU. CUDA_VISIBLE_DEVICES limits the
count as it limits what the workers can see.
"""

from __future__ import annotations

import argparse
import os

AUTO = "auto"


def gpu_count() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    limit = None
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip()]
        limit = 0 if not ids or ids[0].strip() == "-1" else len(ids)
    found = _nvml_count()
    if found is None:
        found = _torch_count()
    return found if limit is None else min(found, limit)


def _nvml_count() -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver: no GPU (NVMLError_LibraryNotFound, ...)
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


def _torch_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def worker_devices(workers: int | str, device: str, gpus: int, per_device: int = 1) -> list[str]:
    """The --device of each worker to start.

    `workers` N: N workers on `device`. `auto`: `per_device` workers per GPU,
    on cuda:0 first, when `device` leaves the choice open (auto) and there
    are GPUs; else `per_device` workers on `device`. Several workers on one
    GPU are for a model whose one worker process binds on its core before the
    GPU is busy (on the H100 the ONNX Runtime worker spent ~238 us of CPU per
    request, mostly waiting in CUDA's synchronize: docs/benchmarks.md).
    """
    if per_device < 1:
        raise ValueError(f"--workers-per-device must be >= 1, got {per_device}")
    if workers != AUTO:
        count = int(workers)
        if count < 1:
            raise ValueError(f"--workers must be >= 1 or '{AUTO}', got {workers}")
        if per_device != 1:
            raise ValueError(f"--workers-per-device needs --workers {AUTO}, got --workers {count}")
        return [device] * count
    if device == AUTO and gpus > 0:
        return [f"cuda:{i}" for i in range(gpus) for _ in range(per_device)]
    return [device] * per_device


def parse_count(text: str, noun: str) -> int | str:
    """A process-count flag's value (--workers, --gateways, --schedulers): a
    positive count or 'auto'; `noun` names one process in the error."""
    if text == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or '{AUTO}', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 {noun}, got {value}")
    return value


def parse_workers(text: str) -> int | str:
    """argparse type of --workers: a positive count or 'auto'."""
    return parse_count(text, "worker")


def parse_per_device(text: str) -> int:
    """argparse type of --workers-per-device: a positive count."""
    value = parse_count(text, "worker per device")
    if value == AUTO:
        raise argparse.ArgumentTypeError("expected a number of workers per device, got 'auto'")
    return int(value)
