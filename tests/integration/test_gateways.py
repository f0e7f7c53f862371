"""`stageserve up --gateways 2 --schedulers 2`: two gateway processes on one
gRPC and one HTTP port, two schedulers sharing the models.

Both bind with SO_REUSEPORT and the kernel spreads new connections over them,
so each test opens many connections (a client per request) and reads each
gateway's own /metrics (nv_inference_request_success counts what that
process answered) to see both took some. kill -9 of one gateway: the other
answers every new connection, no client waits past its timeout, and the
supervisor brings the killed one back on the same ports, where it takes
connections again. Every ready model's queues are owned by exactly one of
the two schedulers (each scheduler's stageserve_scheduler_shard_owned).
"""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from stageserve.net import free_port
from stageserve_tools.examples import python_config_text, write_python_model
from tests.integration.up_process import UpProcess
from tests.procs import alive
from tests.stack import wait_until

#: New connections per check. Two listeners each get a connection with
#: probability 1/2 (the kernel hashes the 4-tuple): all N on one is 2**(1-N).
CONNECTIONS = 24
CLIENT_TIMEOUT_S = 10.0
#: A gRPC channel of its own connection. By default grpc core pools
#: subchannels process-wide: a channel opened right after another one to the
#: same address closed reuses its connection (7 distinct connections for 30
#: channels in a row, measured here), which then lands on the same gateway,
#: or on one killed since (UNAVAILABLE "Connection reset by peer").
NEW_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


@pytest.fixture(scope="module")
def up(example_repository: Path) -> Iterator[UpProcess]:
    with UpProcess(
        example_repository,
        ["--gateways", "2", "--schedulers", "2", "--metrics-port", str(free_port())],
    ) as running:
        info = running.wait(240)
        assert info is not None, "".join(running.err[-40:])
        yield running


def _info(up: UpProcess) -> dict:
    info = up.info()
    assert info is not None
    return info


def _success(metrics_port: int, model: str = "simple") -> float:
    """nv_inference_request_success of `model` on one gateway's /metrics."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=CLIENT_TIMEOUT_S) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("nv_inference_request_success{") and f'model="{model}"' in line
    )


def _owned(metrics_port: int) -> set[str]:
    """The models whose queues one scheduler owns (its /metrics)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=CLIENT_TIMEOUT_S) as r:
        text = r.read().decode()
    prefix = "stageserve_scheduler_shard_owned{"
    return {
        line.split('model="', 1)[1].split('"', 1)[0]
        for line in text.splitlines()
        if line.startswith(prefix) and float(line.rsplit(" ", 1)[1]) == 1
    }


def _counts(up: UpProcess) -> list[float]:
    return [_success(g["metrics_port"]) for g in _info(up)["gateways"]]


_A = np.arange(16, dtype=np.int32).reshape(1, 16)


def _grpc_simple(url: str) -> None:
    """One request on a connection of its own; raises on an error or a wrong answer."""
    inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(_A)
    with grpcclient.InferenceServerClient(url, channel_args=NEW_CONNECTION) as client:
        result = client.infer("simple", inputs, client_timeout=CLIENT_TIMEOUT_S)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * _A)


def _http_simple(url: str) -> None:
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(_A)
    client = httpclient.InferenceServerClient(
        url, connection_timeout=CLIENT_TIMEOUT_S, network_timeout=CLIENT_TIMEOUT_S
    )
    try:
        result = client.infer("simple", inputs)
    finally:
        client.close()
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * _A)


def test_the_stack_announces_two_gateways_on_one_port(up: UpProcess) -> None:
    info = _info(up)
    gateways = info["gateways"]
    assert [g["name"] for g in gateways] == ["gateway", "gateway-1"]
    assert {g["grpc"] for g in gateways} == {info["grpc"]}
    assert {g["http"] for g in gateways} == {info["http"]}
    ports = [g["metrics_port"] for g in gateways]
    assert len(set(ports)) == 2 and all(ports)
    assert info["metrics_ports"]["gateway"] == ports[0]
    assert info["metrics_ports"]["gateway-1"] == ports[1]
    assert info["pids"]["gateway"] != info["pids"]["gateway-1"]
    # The startup loads ran in the first gateway; the second adopted them.
    assert up.events("model not loaded") == []


@pytest.mark.parametrize("front", ["grpc", "http"])
def test_the_example_repository_serves_through_the_one_port(up: UpProcess, front: str) -> None:
    info = _info(up)
    url = info[front]
    index_names = set()
    for _ in range(4):  # a few connections: each gateway answers with the whole repository
        if front == "grpc":
            with grpcclient.InferenceServerClient(url, channel_args=NEW_CONNECTION) as c:
                index = c.get_model_repository_index(as_json=True)["models"]
                ready = [m for m in index if c.is_model_ready(m["name"])]
        else:
            c = httpclient.InferenceServerClient(url)
            try:
                index = c.get_model_repository_index()
                ready = [m for m in index if c.is_model_ready(m["name"])]
            finally:
                c.close()
        names = {m["name"] for m in index}
        assert {m["name"] for m in ready} == {m["name"] for m in index if m.get("state") == "READY"}
        assert "simple" in names and len(ready) >= 5
        index_names.add(frozenset(names))
    assert len(index_names) == 1


def test_each_ready_model_is_owned_by_exactly_one_of_two_schedulers(up: UpProcess) -> None:
    ports = _info(up)["metrics_ports"]
    with grpcclient.InferenceServerClient(_info(up)["grpc"]) as c:
        index = c.get_model_repository_index(as_json=True)["models"]
    ready = {m["name"] for m in index if m.get("state") == "READY"}

    def split() -> tuple[set[str], set[str]]:
        return _owned(ports["scheduler"]), _owned(ports["scheduler-1"])

    # owners take their models within a heartbeat or two of the map changing
    assert wait_until(lambda: ready <= set.union(*split()), 10), (ready, split())
    first, second = split()
    assert not first & second, (first, second)
    assert first and second, (first, second)  # ~half each: rendezvous hashing


@pytest.mark.parametrize("front", ["grpc", "http"])
def test_new_connections_land_on_both_gateways(up: UpProcess, front: str) -> None:
    before = _counts(up)
    call = _grpc_simple if front == "grpc" else _http_simple
    for _ in range(CONNECTIONS):
        call(_info(up)[front])
    after = _counts(up)
    deltas = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(deltas) == CONNECTIONS
    assert all(d > 0 for d in deltas), f"{front}: per gateway {deltas}"


def _restarted(up: UpProcess, stage: str) -> list[dict]:
    return [e for e in up.logs("stage restarted") if e.get("stage") == stage]


def test_kill_9_of_one_gateway_the_other_serves_and_it_comes_back(up: UpProcess) -> None:
    info = _info(up)
    victim = next(g for g in info["gateways"] if g["name"] == "gateway-1")
    survivor = next(g for g in info["gateways"] if g["name"] == "gateway")
    restarted_before = len(_restarted(up, "gateway-1"))
    os.kill(victim["pid"], signal.SIGKILL)
    assert wait_until(lambda: not alive(victim["pid"]), 10)
    # Until it is back, every new connection reaches the survivor; none hangs
    # (each call has its timeout and its time is bounded here too).
    answered_by_survivor = _success(survivor["metrics_port"])
    calls = 0
    while len(_restarted(up, "gateway-1")) == restarted_before and calls < CONNECTIONS:
        for call, url in ((_grpc_simple, info["grpc"]), (_http_simple, info["http"])):
            started = time.monotonic()
            call(url)
            assert time.monotonic() - started < CLIENT_TIMEOUT_S
            calls += 1
    assert calls > 0
    assert wait_until(lambda: len(_restarted(up, "gateway-1")) > restarted_before, 60), (
        "gateway-1 not restarted; log tail:\n" + "".join(up.err[-20:])
    )
    back = _restarted(up, "gateway-1")[-1]
    assert back["pid"] != victim["pid"] and alive(back["pid"])
    assert back["address"] == info["grpc"]  # on the port it shared
    assert _success(survivor["metrics_port"]) >= answered_by_survivor + 1
    # The new process takes its share of new connections again, on both
    # fronts, on its metrics port of before (a fresh process: counts from 0).
    for front, call in (("grpc", _grpc_simple), ("http", _http_simple)):
        before = _success(victim["metrics_port"])
        for _ in range(CONNECTIONS):
            call(info[front])
        assert _success(victim["metrics_port"]) > before, front
    assert up.proc.poll() is None


def test_http_health_answers_on_the_shared_port(up: UpProcess) -> None:
    url = f"http://{_info(up)['http']}/v2/health/ready"
    for _ in range(8):
        try:
            with urllib.request.urlopen(url, timeout=CLIENT_TIMEOUT_S) as r:
                assert r.status == 200
        except urllib.error.URLError as exc:  # pragma: no cover - the assertion's message
            pytest.fail(f"{url}: {exc}")


#: The slow model's initialize: how long its gateway's startup load takes at least.
SLOW_INIT_S = 3.0

_SLOW_SOURCE = f"""\
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        time.sleep({SLOW_INIT_S})

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return responses
"""


def _live_not_ready(url: str) -> bool | None:
    """None: no connection; True: a server answered live but not ready."""
    try:
        with grpcclient.InferenceServerClient(url, channel_args=NEW_CONNECTION) as c:
            live = c.is_server_live(client_timeout=1)
            return bool(live) and not c.is_server_ready(client_timeout=1)
    except Exception:  # noqa: BLE001 - refused, reset, timed out: no server answered
        return None


def test_a_port_sharing_gateway_takes_connections_only_once_loaded(tmp_path: Path) -> None:
    """Alone, a gateway serves health while its startup models load (ServerLive
    true, ServerReady false); one that shares its port (--gateways 2) opens it
    only once they are loaded, so a connection the kernel gives it never finds
    models it has not loaded. (With --gateways 1 the same probe does see the
    live-not-ready gateway.)"""
    write_python_model(
        tmp_path,
        "slow",
        _SLOW_SOURCE,
        python_config_text(
            "slow", [("INPUT0", "FP32", (4,))], [("OUTPUT0", "FP32", (4,))], max_batch_size=8
        ),
    )
    port = free_port()
    with UpProcess(tmp_path, ["--gateways", "2", "--grpc-port", str(port)]) as running:
        answered_unready = False
        deadline = time.monotonic() + 120
        while running.info() is None and running.proc.poll() is None:
            assert time.monotonic() < deadline, "stageserve up did not start"
            answered_unready = answered_unready or bool(_live_not_ready(f"127.0.0.1:{port}"))
            time.sleep(0.05)
        assert running.info() is not None, "".join(running.err[-20:])
        assert _live_not_ready(f"127.0.0.1:{port}") is False  # now open, and ready
    assert not answered_unready
