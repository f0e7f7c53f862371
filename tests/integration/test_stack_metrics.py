"""`stageserve up --gateways 2 --metrics-port P`: P serves the whole stack's
Triton metrics, merged by the `up` process from each gateway's own port.

K requests spread over both gateways (a connection each), then P shows
`nv_inference_request_success` = K for the model, and each gateway's own
port its share, the shares adding up to K. A gateway that does not answer
(SIGSTOP: alive, silent) is held at its last counts, and the scrape still
answers; one killed and restarted (back at 0) has its count carried over:
the stack's counters never go down.
A --metrics-port another process holds ends `up` with tritonserver's line.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stageserve.metrics_merge import parse
from stageserve.telemetry import TRITON_FAMILIES, model_labels
from stageserve_tools.examples import write_simple
from tests.integration.test_gateways import _grpc_simple  # one request, a connection of its own
from tests.integration.up_process import UpProcess, json_line, scrape_metrics, up_with_gateways
from tests.stack import wait_until

K = 24  # requests, each on a connection of its own: all on one gateway is 2**-23
SIMPLE = model_labels("simple", 1)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UpProcess, int]]:
    repository = tmp_path_factory.mktemp("stack_metrics")
    write_simple(repository, "simple", max_batch_size=8)
    with up_with_gateways(repository) as running:
        yield running


def _success(port: int) -> float:
    return parse(scrape_metrics(port)).get("nv_inference_request_success", {}).get(SIMPLE, 0.0)


def test_the_metrics_port_serves_the_stacks_total_and_each_gateway_its_share(
    up: tuple[UpProcess, int],
) -> None:
    running, port = up
    own = running.gateway_metrics_ports()
    assert len(set(own)) == 2 and port not in own  # each gateway has a port of its own
    for _ in range(K):
        _grpc_simple(running.grpc_url())

    # Counters move as each answer is recorded: poll until the totals are in.
    assert wait_until(lambda: _success(port) == K, 5), (_success(port), K)
    shares = [_success(p) for p in own]
    assert all(shares), shares  # both gateways answered some
    assert sum(shares) == K, shares

    text = scrape_metrics(port)
    samples = parse(text)
    assert samples["nv_inference_count"][SIMPLE] == K  # batch 1 each
    assert samples["nv_inference_exec_count"][SIMPLE] <= K
    for name in samples:
        kind, help_text = TRITON_FAMILIES[name]
        assert text.count(f"# HELP {name} ") == 1
        assert f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n" in text
    assert "stageserve_" not in text  # StageServe's own families stay on each stage's port
    # The host's memory once, not once per gateway
    total = samples["nv_cpu_memory_total_bytes"][()]
    assert total == parse(scrape_metrics(own[0]))["nv_cpu_memory_total_bytes"][()]


def test_a_gateway_that_does_not_answer_is_held_at_its_last_counts(
    up: tuple[UpProcess, int],
) -> None:
    running, port = up
    _spread(running)
    pid = _gateway(running, "gateway-1")["pid"]
    total = _success(port)
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        held = _success(port)
        assert time.monotonic() - start < 4  # its fetch timed out, the answer came
        # its counters are in the total as last read: the total never goes down
        assert held == total
    finally:
        os.kill(pid, signal.SIGCONT)
    assert wait_until(lambda: _success(port) == total, 5)


def test_the_total_goes_on_across_a_gateways_restart(up: tuple[UpProcess, int]) -> None:
    """A gateway killed and restarted comes back at 0; the stack's counter
    carries its count over, so it never goes down (Prometheus would read a
    reset and count the whole total again in rate())."""
    running, port = up
    victim = _gateway(running, "gateway-1")
    restarts = len(_restarts(running))
    _spread(running)
    total = _success(port)
    os.kill(victim["pid"], signal.SIGKILL)
    seen = [total]

    def back() -> bool:
        seen.append(_success(port))
        return len(_restarts(running)) > restarts

    assert wait_until(back, 60, 0.1), "gateway-1 not restarted:\n" + "".join(running.err[-20:])
    assert wait_until(lambda: _answers(victim["metrics_port"]), 30)
    seen.append(_success(port))
    assert all(v == total for v in seen), seen
    assert _success(victim["metrics_port"]) < total  # it did restart at 0
    for _ in range(K):
        _grpc_simple(running.grpc_url())
    assert wait_until(lambda: _success(port) == total + K, 5), (_success(port), total + K)


def _spread(running: UpProcess) -> None:
    """K more requests, some answered by each gateway."""
    before = [_success(p) for p in running.gateway_metrics_ports()]
    for _ in range(K):
        _grpc_simple(running.grpc_url())

    def grew() -> bool:
        after = [_success(p) for p in running.gateway_metrics_ports()]
        return all(a > b for a, b in zip(after, before, strict=True))

    assert wait_until(grew, 5), before


def _gateway(running: UpProcess, name: str) -> dict:
    info = running.info()
    assert info is not None
    return next(g for g in info["gateways"] if g["name"] == name)


def _restarts(running: UpProcess) -> list[dict]:
    return [e for e in running.logs("stage restarted") if e.get("stage") == "gateway-1"]


def _answers(metrics_port: int) -> bool:
    try:
        scrape_metrics(metrics_port)
    except OSError:
        return False
    return True


def test_a_taken_metrics_port_ends_up_with_tritons_line(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        held = holder.getsockname()[1]
        with UpProcess(tmp_path, ["--gateways", "2", "--metrics-port", str(held)]) as running:
            assert running.wait(120) is None, "stageserve up served on a port it cannot hold"
            assert running.proc.returncode == 1
    line = f"failed to start Metrics service: Unavailable - Socket '0.0.0.0:{held}' already in use"
    assert [e for e in map(json_line, running.err) if e.get("msg") == line], running.err[-20:]
    (failed,) = running.events("startup failed", "err")
    assert failed["error"] == line
    assert "Traceback" not in "".join(running.out + running.err)
