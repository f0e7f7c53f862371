"""The worker's CUDA sync mode (services/worker/cuda_sync.py): the flag values,
what is done without a GPU, and, on a GPU host, that the primary context the
backends create carries the flag set before it existed."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import pytest

from services.worker import cuda_sync
from stageserve.gpus import gpu_count
from stageserve.settings import settings_from_env


def test_modes_are_the_driver_api_flags() -> None:
    # CU_CTX_SCHED_AUTO / SPIN / YIELD / BLOCKING_SYNC in cuda.h
    assert [cuda_sync.schedule_flags(m) for m in ("auto", "spin", "yield", "blocking")] == [
        0,
        1,
        2,
        4,
    ]
    with pytest.raises(ValueError, match="auto, spin, yield, blocking"):
        cuda_sync.schedule_flags("busy")


def test_auto_or_no_device_touches_no_driver() -> None:
    def no_call() -> ctypes.CDLL | None:
        raise AssertionError("the driver was loaded")

    assert cuda_sync.apply("auto", 0, driver=no_call) == "CUDA's default"
    assert cuda_sync.apply("blocking", None, driver=no_call) == "CUDA's default"


def test_a_host_without_a_driver_is_told_not_failed() -> None:
    assert cuda_sync.apply("blocking", 0, driver=lambda: None) == (
        "not set: no libcuda.so.1 on this host"
    )


def test_a_bad_mode_fails_before_the_driver() -> None:
    with pytest.raises(ValueError):
        cuda_sync.apply("sometimes", 0, driver=lambda: None)


def test_the_worker_setting_reads_the_environment() -> None:
    settings = settings_from_env({"STAGESERVE_WORKER_CUDA_SYNC": "blocking"})
    assert settings.worker.cuda_sync == "blocking"
    assert settings_from_env({}).worker.cuda_sync == "auto"
    with pytest.raises(ValueError):
        settings_from_env({"STAGESERVE_WORKER_CUDA_SYNC": "sometimes"})


_CHILD = textwrap.dedent(
    """
    import torch
    from services.worker import cuda_sync
    print(cuda_sync.apply("blocking", 0))
    torch.zeros(1, device="cuda:0")  # the backends' context, created after the flag
    lib = cuda_sync.load_driver()
    print(cuda_sync.primary_flags(lib, 0))
    """
)


@pytest.mark.gpu
def test_on_a_gpu_the_context_the_backends_create_blocks() -> None:
    if gpu_count() == 0 or cuda_sync.load_driver() is None:
        pytest.skip("no GPU")
    # A fresh process: the flag must precede the context, as at a worker's start.
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-2] == "blocking on cuda:0"
    assert lines[-1] == "(4, True)"
