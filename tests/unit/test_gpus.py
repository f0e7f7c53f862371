"""One worker per GPU (stageserve.gpus) and the nv_gpu_* readings
(stageserve.telemetry); the GPU-only checks are marked gpu and skip here."""

from __future__ import annotations

import argparse

import pytest

from stageserve.gpus import gpu_count, parse_per_device, parse_workers, worker_devices
from stageserve.telemetry import TritonMetrics, gpu_readings, update_system_metrics


@pytest.mark.parametrize(
    "workers,device,gpus,expected",
    [
        ("auto", "auto", 4, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
        ("auto", "auto", 0, ["auto"]),
        ("auto", "cpu", 2, ["cpu"]),
        ("auto", "cuda:1", 2, ["cuda:1"]),
        (3, "cpu", 8, ["cpu", "cpu", "cpu"]),
        (2, "auto", 2, ["auto", "auto"]),
    ],
)
def test_worker_devices(workers, device, gpus, expected) -> None:
    assert worker_devices(workers, device, gpus) == expected


@pytest.mark.parametrize(
    "workers,device,gpus,per_device,expected",
    [
        ("auto", "auto", 2, 2, ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]),
        ("auto", "auto", 0, 3, ["auto", "auto", "auto"]),
        ("auto", "cpu", 2, 2, ["cpu", "cpu"]),
        ("auto", "cuda:1", 4, 2, ["cuda:1", "cuda:1"]),
    ],
)
def test_workers_per_device(workers, device, gpus, per_device, expected) -> None:
    assert worker_devices(workers, device, gpus, per_device) == expected


def test_workers_per_device_needs_auto_and_a_positive_count() -> None:
    with pytest.raises(ValueError, match="needs --workers auto"):
        worker_devices(3, "cpu", 0, 2)
    with pytest.raises(ValueError, match="must be >= 1"):
        worker_devices("auto", "cpu", 0, 0)
    assert parse_per_device("2") == 2
    for bad in ("0", "auto", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_per_device(bad)


def test_parse_workers() -> None:
    assert parse_workers("auto") == "auto" and parse_workers("3") == 3
    for bad in ("0", "-1", "many"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_workers(bad)


def test_cuda_visible_devices_limits_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert gpu_count() == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_count() == 0


def test_worker_device_auto_follows_the_gpu_count() -> None:
    from services.worker.service import detect_gpu

    assert detect_gpu("cpu") is None and detect_gpu("cuda:3") == 3
    assert detect_gpu("auto") == (0 if gpu_count() else None)


def test_without_a_gpu_no_gpu_family_is_set() -> None:
    if gpu_readings():
        pytest.skip("this machine has a GPU")
    metrics = TritonMetrics()
    update_system_metrics(metrics)
    text = metrics.render()
    assert "nv_cpu_utilization" in text and "nv_gpu_utilization{" not in text


@pytest.mark.gpu
def test_gpu_readings_and_families() -> None:
    readings = gpu_readings()
    if not readings:
        pytest.skip("no GPU (or no NVIDIA driver / nvidia-ml-py)")
    assert len(readings) == gpu_count()
    for r in readings:
        assert r.uuid.startswith("GPU-") and r.memory_total > 0
        assert 0.0 <= r.utilization <= 1.0 and r.memory_used <= r.memory_total
