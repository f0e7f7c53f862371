"""Prometheus metrics move exactly as Triton's semantics say, and agree with ModelStatistics."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from stageserve.launcher import Stack, start_services
from stageserve.net import free_port
from stageserve_tools.examples import write_simple


class MetricsStack:
    def __init__(self, stack: Stack, services, gateway_metrics: int) -> None:
        self.stack = stack
        self.services = services
        self.url = services.gateway.address
        self.ports = {c.name: c.metrics_port for c in stack.children if c.metrics_port}
        self.ports["gateway"] = gateway_metrics


@pytest.fixture(scope="module")
def mstack(example_repository: Path) -> Iterator[MetricsStack]:
    stack = Stack()
    port = free_port()
    try:
        services = start_services(
            stack, example_repository, device="cpu", metrics_port=port, stage_metrics=True
        )
        yield MetricsStack(stack, services, port)
    finally:
        stack.stop()


def scrape(port: int) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
            if family.type == "counter" and s.name == family.name + "_total":
                # Triton's counters carry no _total; the parser adds it.
                samples.setdefault(family.name, []).append(s)
    return samples


def value(samples: dict[str, list], name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples.get(name, [])
        if all(s.labels.get(k) == v for k, v in labels.items())
    )


def simple_inputs(batch: int) -> list[grpcclient.InferInput]:
    a = np.ones((batch, 16), dtype=np.int32)
    ins = []
    for name in ("INPUT0", "INPUT1"):
        i = grpcclient.InferInput(name, [batch, 16], "INT32")
        i.set_data_from_numpy(a)
        ins.append(i)
    return ins


def test_every_service_serves_parseable_metrics(mstack: MetricsStack) -> None:
    assert {"gateway", "scheduler", "ratelimiter", "worker-0"} <= set(mstack.ports)
    for name, port in mstack.ports.items():
        samples = scrape(port)
        assert "process_cpu_seconds_total" in samples, name
        assert "nv_cpu_utilization" in samples and "nv_cpu_memory_total_bytes" in samples, name


def test_every_stage_reports_its_event_loop_lag(mstack: MetricsStack) -> None:
    """Each stage's loop-lag probe (stageserve/loop_lag.py) wakes every 50 ms
    once the stage is ready: its histogram has counts, and an idle stage's
    loop is not seconds late."""
    for name, port in mstack.ports.items():
        samples = scrape(port)
        count = value(samples, "stageserve_event_loop_lag_seconds_count")
        assert count >= 1, name
        under_5s = value(samples, "stageserve_event_loop_lag_seconds_bucket", le="5.0")
        assert under_5s == count, name


def test_triton_counters_follow_triton_semantics(mstack: MetricsStack) -> None:
    client = grpcclient.InferenceServerClient(mstack.url)
    before = scrape(mstack.ports["gateway"])
    labels = {"model": "simple", "version": "1"}
    for _ in range(5):
        client.infer("simple", simple_inputs(1))
    client.infer("simple", simple_inputs(4))
    bad = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 16), np.float32))
    for _ in range(2):
        with pytest.raises(InferenceServerException):
            client.infer("simple", [bad, simple_inputs(1)[1]])
    after = scrape(mstack.ports["gateway"])

    def delta(name: str, **extra: str) -> float:
        return value(after, name, **labels, **extra) - value(before, name, **labels, **extra)

    assert delta("nv_inference_request_success") == 6
    assert delta("nv_inference_count") == 9  # a batch of 4 counts 4
    assert delta("nv_inference_exec_count") == 6  # sequential: one execution each
    # refused by validation before scheduling: no failure in Triton 2.51 either
    assert delta("nv_inference_request_failure", reason="OTHER") == 0
    for name in (
        "nv_inference_request_duration_us",
        "nv_inference_queue_duration_us",
        "nv_inference_compute_infer_duration_us",
    ):
        assert delta(name) > 0, name
    assert delta("stageserve_request_duration_seconds_count", phase="request") == 6


def test_metrics_agree_with_model_statistics(mstack: MetricsStack) -> None:
    client = grpcclient.InferenceServerClient(mstack.url)
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)

    def one(_: int) -> None:
        c = grpcclient.InferenceServerClient(mstack.url)
        i = grpcclient.InferInput("INPUT0", [1, 256], "FP32")
        i.set_data_from_numpy(x)
        c.infer("mlp", [i])

    with ThreadPoolExecutor(24) as pool:
        list(pool.map(one, range(240)))
    stats = client.get_inference_statistics("mlp").model_stats[0]
    gw = scrape(mstack.ports["gateway"])
    labels = {"model": "mlp", "version": "1"}
    assert value(gw, "nv_inference_count", **labels) == stats.inference_count
    assert value(gw, "nv_inference_exec_count", **labels) == stats.execution_count
    assert stats.execution_count < stats.inference_count  # batches formed
    assert value(gw, "nv_inference_request_success", **labels) == (
        stats.inference_stats.success.count
    )
    # Durations: metrics hold whole microseconds per request, statistics ns.
    for name, stat in (
        ("nv_inference_request_duration_us", stats.inference_stats.success),
        ("nv_inference_queue_duration_us", stats.inference_stats.queue),
        ("nv_inference_compute_infer_duration_us", stats.inference_stats.compute_infer),
    ):
        us = value(gw, name, **labels)
        assert stat.ns / 1000 - stat.count <= us <= stat.ns / 1000, name
    assert sum(b.compute_infer.count for b in stats.batch_stats) == stats.execution_count

    sched = scrape(mstack.ports["scheduler"])
    assert value(sched, "stageserve_scheduler_batch_size_count", **labels) == stats.execution_count
    assert value(sched, "stageserve_scheduler_batch_size_sum", **labels) == stats.inference_count
    assert value(sched, "nv_inference_pending_request_count", **labels) == 0

    worker = scrape(mstack.ports["worker-0"])
    executions = value(
        worker, "stageserve_worker_compute_seconds_count", model="mlp", phase="infer"
    )
    assert executions == stats.execution_count
    # The model instance is `model_instance` at the source: `instance` is Prometheus'.
    compute = worker["stageserve_worker_compute_seconds_count"]
    assert all(s.labels.get("model_instance") and "instance" not in s.labels for s in compute)
    rl = scrape(mstack.ports["ratelimiter"])
    assert value(rl, "stageserve_ratelimiter_grants_total", **labels) >= 1


def test_scheduler_queue_stats_rpc(mstack: MetricsStack) -> None:
    """The scheduler's own QueueStats RPC lists each model version it queued for."""
    import grpc

    from stageserve.generated import stageserve_pb2 as pb
    from stageserve.generated import stageserve_pb2_grpc as pb_grpc

    client = grpcclient.InferenceServerClient(mstack.url)
    client.infer("simple", simple_inputs(1))
    with grpc.insecure_channel(mstack.services.scheduler.address) as channel:
        stats = pb_grpc.SchedulerStub(channel).QueueStats(pb.QueueStatsRequest(), timeout=10)
    by_model = {(m.model, m.version): m for m in stats.models}
    assert ("simple", 1) in by_model
    assert by_model[("simple", 1)].pending == 0


INFLIGHT = "stageserve_gateway_inflight_requests"


def test_inflight_gauge_counts_requests_being_served(tmp_path: Path) -> None:
    """stageserve_gateway_inflight_requests is read from the gateway's own count
    at scrape time: 3 slow requests in flight read 3, and 0 once answered."""
    write_simple(tmp_path, "slow_simple", max_batch_size=0)
    with (tmp_path / "slow_simple" / "config.pbtxt").open("a") as config:
        config.write('parameters { key: "execute_delay_ms" value { string_value: "800" } }\n')
    stack = Stack()
    port = free_port()
    try:
        services = start_services(stack, tmp_path, device="cpu", metrics_port=port)
        url = services.gateway.address
        client = grpcclient.InferenceServerClient(url)
        inputs = simple_inputs(1)  # this model's dims are [1, 16] (no batching)
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(client.infer, "slow_simple", inputs) for _ in range(3)]
            deadline = time.monotonic() + 10
            seen = 0.0
            while time.monotonic() < deadline and seen < 3:
                seen = value(scrape(port), INFLIGHT, model="slow_simple")
                time.sleep(0.05)
            for f in futures:
                f.result(timeout=30)
        assert seen == 3
        assert value(scrape(port), INFLIGHT, model="slow_simple") == 0
        client.close()
    finally:
        stack.stop()
