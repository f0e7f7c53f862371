"""Log settings (LogSettings RPC, GET/POST /v2/logging) on a stack whose stages
each log to their own --log-file: the answers are Triton 2.51's
(bench/log_settings_diff.py's record), and a change made through the gateway
reaches the scheduler, the worker and a Python model's stub process, which
emit (or stop emitting) their verbose lines; a stage killed and started again
logs under the stack's settings from its start."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from bench.log_settings_diff import (
    Endpoints,
    differences,
    load_record,
    run,
    triton_endpoints,
)
from bench.references import ReferenceNotInstalled, find_triton, stop_process
from stageserve.launcher import Child, Stack, spawn_service
from stageserve_tools.examples import python_config_text, write_python_model
from tests.stack import wait_until

MODEL = "py_log"
# A Python model whose instance runs in its own stub process, logging one
# verbose line per execute through Triton's pb_utils.Logger.
SOURCE = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        pb_utils.Logger.log_verbose("model verbose line")
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]
            )
            for r in requests
        ]
"""
PROCESS = '\nparameters { key: "STAGESERVE_INSTANCE_PROCESS" value { string_value: "true" } }\n'
STAGES = ("ratelimiter", "scheduler", "worker", "gateway")
# Each stage's verbose line for one request (the stub logs into its worker's file).
VERBOSE_LINES = {
    "scheduler": ("scheduler", "batch formed"),
    "worker": ("worker", "executing batch"),
    "stub": ("worker-stub", "model verbose line"),
}


@dataclass
class LogStack:
    stack: Stack
    children: dict[str, Child]
    logs: Path

    @property
    def ends(self) -> Endpoints:
        gateway = self.children["gateway"]
        return Endpoints(gateway.address, gateway.http_address)

    def log_file(self, stage: str) -> Path:
        return self.logs / f"{stage}.log"

    def offsets(self) -> dict[str, int]:
        return {s: self.log_file(s).stat().st_size for s in STAGES}

    def lines(self, stage: str, since: dict[str, int]) -> list[str]:
        with self.log_file(stage).open("rb") as f:
            f.seek(since[stage])
            return f.read().decode().splitlines()

    def entries(self, stage: str, since: dict[str, int]) -> list[dict]:
        return [json.loads(line) for line in self.lines(stage, since) if line.startswith("{")]


def _start(stack: Stack, repository: Path, logs: Path) -> dict[str, Child]:
    redis_url = stack.start_redis()
    common = ["--listen", "127.0.0.1:0", "--redis-url", redis_url]

    def log_to(stage: str) -> list[str]:
        return ["--log-file", str(logs / f"{stage}.log")]

    rl = stack.start_service("ratelimiter", ["ratelimiter", *common, *log_to("ratelimiter")])
    peers = ["--ratelimiter", rl.address]
    sched = stack.start_service("scheduler", ["scheduler", *common, *peers, *log_to("scheduler")])
    peers += ["--scheduler", sched.address]
    worker = stack.start_service(
        "worker-0", ["worker", *common, *peers, "--device", "cpu", *log_to("worker")]
    )
    gateway_args = ["gateway", *common, *peers, "--model-repository", str(repository)]
    gateway_args += ["--model-control-mode", "explicit", "--load-model", MODEL]
    gateway_args += ["--http-address", "127.0.0.1", "--http-port", "0", *log_to("gateway")]
    gateway = stack.start_service("gateway", gateway_args)
    return {"ratelimiter": rl, "scheduler": sched, "worker": worker, "gateway": gateway}


@pytest.fixture(scope="module")
def log_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LogStack]:
    root = tmp_path_factory.mktemp("log_settings")
    repository, logs = root / "repo", root / "logs"
    logs.mkdir()
    config = python_config_text(
        MODEL, [("IN", "FP32", (2,))], [("OUT", "FP32", (2,))], max_batch_size=4
    )
    write_python_model(repository, MODEL, SOURCE, config + PROCESS)
    stack = Stack()
    try:
        yield LogStack(stack, _start(stack, repository, logs), logs)
    finally:
        stack.stop()


def _infer(url: str) -> None:
    with grpcclient.InferenceServerClient(url) as client:
        inp = grpcclient.InferInput("IN", [1, 2], "FP32")
        inp.set_data_from_numpy(np.ones((1, 2), np.float32))
        client.infer(MODEL, [inp])


def _changed_to(s: LogStack, stage: str, since: dict[str, int], service: str, level: int) -> bool:
    return any(
        e["service"] == service
        and e["msg"] == "log settings changed"
        and e["settings"]["log_verbose_level"] == level
        for e in s.entries(stage, since)
    )


def _wait_followed(s: LogStack, since: dict[str, int], level: int) -> None:
    """Until every stage (and the stub) says it logs at `level` now."""
    for stage, service in (
        ("ratelimiter", "ratelimiter"),
        ("scheduler", "scheduler"),
        ("worker", "worker"),
        ("worker", "worker-stub"),
        ("gateway", "gateway"),
    ):

        def followed(stage: str = stage, service: str = service) -> bool:
            return _changed_to(s, stage, since, service, level)

        assert wait_until(followed, 20), (
            f"{service} did not follow log_verbose_level {level}: {s.lines(stage, since)[-5:]}"
        )


def _verbose_seen(s: LogStack, since: dict[str, int]) -> dict[str, bool]:
    seen = {}
    for name, (service, message) in VERBOSE_LINES.items():
        stage = "scheduler" if name == "scheduler" else "worker"
        seen[name] = any(
            e["service"] == service and e["msg"] == message and e["level"] == "debug"
            for e in s.entries(stage, since)
        )
    return seen


def test_answers_are_triton_2_51s_on_both_fronts(log_stack: LogStack) -> None:
    record = load_record()
    gateway_log = str(log_stack.log_file("gateway"))
    diff = differences(record, run(log_stack.ends), gateway_log)
    assert not diff, "\n".join(diff)


def test_triton_still_answers_as_recorded(tmp_path: Path) -> None:
    try:
        find_triton()
    except ReferenceNotInstalled as exc:
        pytest.skip(str(exc))
    proc, ends = triton_endpoints(tmp_path)
    try:
        observed = run(ends)
    finally:
        stop_process(proc)
    assert differences(load_record(), observed) == []


def test_every_stage_follows_the_verbose_level(log_stack: LogStack) -> None:
    s = log_stack
    _infer(s.ends.grpc_url)  # the stub is up: it follows from here
    since = s.offsets()
    with httpclient.InferenceServerClient(s.ends.http_url) as client:
        answer = client.update_log_settings({"log_verbose_level": 1})
    assert answer["log_verbose_level"] == 1
    _wait_followed(s, since, 1)
    _infer(s.ends.grpc_url)
    assert _verbose_seen(s, since) == {"scheduler": True, "worker": True, "stub": True}

    since = s.offsets()
    with grpcclient.InferenceServerClient(s.ends.grpc_url) as client:
        client.update_log_settings({"log_verbose_level": 0})
    _wait_followed(s, since, 0)
    _infer(s.ends.grpc_url)
    assert _verbose_seen(s, since) == {"scheduler": False, "worker": False, "stub": False}


def test_a_restarted_stage_logs_under_the_stacks_settings_from_its_start(
    log_stack: LogStack,
) -> None:
    s = log_stack
    with grpcclient.InferenceServerClient(s.ends.grpc_url) as client:
        client.update_log_settings({"log_verbose_level": 1, "log_format": "ISO8601"})
    scheduler = s.children["scheduler"]
    scheduler.proc.send_signal(signal.SIGKILL)
    scheduler.proc.wait(10)
    since = s.offsets()
    # started again as the supervisor does: its own flags say verbose 0, default format
    spawn_service(scheduler, scheduler.restart_cmd())
    assert scheduler.ready.wait(60), "the scheduler did not start again"

    def served() -> bool:
        try:
            _infer(s.ends.grpc_url)
        except InferenceServerException:
            return False
        return True

    try:
        assert wait_until(served, 30), "no answer through the restarted scheduler"
        lines = s.lines("scheduler", since)
        assert lines and not any(line.startswith("{") for line in lines), lines[:3]
        pid = scheduler.proc.pid
        assert any(f" V {pid} scheduler " in line and "batch formed" in line for line in lines)
    finally:
        with grpcclient.InferenceServerClient(s.ends.grpc_url) as client:
            client.update_log_settings({"log_verbose_level": 0, "log_format": "default"})
