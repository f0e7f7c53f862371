"""Triton's dynamic batcher queue semantics, seen through tritonclient.grpc.

priority_levels / default_priority_level, ModelQueuePolicy (timeout_action
REJECT|DELAY, default_timeout_microseconds, allow_timeout_override,
max_queue_size), preserve_ordering and batching of same-shape requests only.

One stack (explicit model control, every model loaded) serves identity models
configured for one test each. A model with the `execute_delay_ms` parameter
sleeps that long per execution in the worker; with max_batch_size 1 and one
instance, a first "blocker" request keeps the instance busy while the test
queues others behind it, so what is queued is deterministic. The
preserve_ordering test uses a two-instance Python model that sleeps on a
marked request instead, so which answer is late does not depend on the
machine's load. Timing assertions are tolerances well inside those delays,
never tight timings.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from stageserve.net import free_port
from stageserve_tools.examples import python_config_text, write_identity, write_python_model
from tests.integration.helpers import (
    RPC_TIMEOUT_S,
    expect_error,
    expect_raw_error,
    model_grants,
    model_stats,
    queued_requests,
    raw_infer,
    raw_request,
    sole_request_in_a_batch,
    stack_retrying,
    tensor_input,
)
from tests.stack import RunningStack, wait_until

UNAVAILABLE = "StatusCode.UNAVAILABLE"
INVALID = "StatusCode.INVALID_ARGUMENT"

# name: (max_batch_size, instances, dynamic_batching body, execute_delay_ms)
MODELS: dict[str, tuple[int, int, str, int]] = {
    "prio": (1, 1, "priority_levels: 2\n  default_priority_level: 2", 500),
    "bounded": (1, 1, "default_queue_policy { max_queue_size: 2 }", 500),
    "reject": (1, 1, "default_queue_policy { default_timeout_microseconds: 200000 }", 1000),
    "override_on": (1, 1, "default_queue_policy { allow_timeout_override: true }", 800),
    "override_off": (1, 1, "default_queue_policy { allow_timeout_override: false }", 500),
    "override_cap": (
        1,
        1,
        "default_queue_policy {\n"
        "    default_timeout_microseconds: 300000\n"
        "    allow_timeout_override: true\n  }",
        800,
    ),
    "delayed": (
        2,
        1,
        "default_queue_policy {\n"
        "    timeout_action: DELAY\n"
        "    default_timeout_microseconds: 10000000\n"
        "    allow_timeout_override: true\n  }",
        600,
    ),
    "ordered": (8, 2, "preserve_ordering: true", 0),
    "unordered": (8, 2, "", 0),
    # six requests queue one by one behind the blocker (_send_queued)
    "shapes": (8, 1, "", 1000),
    "reloaded": (8, 1, "", 0),
}


# A Python model that sleeps SLOW_S on a request whose first value is
# negative: with two instances, a marked request dispatched first is answered
# after unmarked ones dispatched later, whatever the machine's load.
SLOW_S = 1.0
SLOW_WHEN_MARKED_SOURCE = f"""\
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if x.size and x.flat[0] < 0:
                time.sleep({SLOW_S})
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return responses
"""
# name: dynamic_batching body
SLOW_WHEN_MARKED: dict[str, str] = {"py_ordered": "preserve_ordering: true", "py_unordered": ""}


def _write_slow_when_marked(root: Path, name: str, body: str) -> None:
    config = python_config_text(
        name,
        [("INPUT0", "FP32", (-1,))],
        [("OUTPUT0", "FP32", (-1,))],
        max_batch_size=8,
        dynamic_batching=True,
        instance_count=2,
    )
    write_python_model(root, name, SLOW_WHEN_MARKED_SOURCE, config)
    _set_dynamic_batching(root, name, body)


def _config_path(root: Path, name: str) -> Path:
    return root / name / "config.pbtxt"


def _set_dynamic_batching(root: Path, name: str, body: str) -> None:
    path = _config_path(root, name)
    text, n = re.subn(
        r"dynamic_batching \{.*?\n\}",
        lambda _: "dynamic_batching {\n  " + body + "\n}",
        path.read_text(),
        flags=re.S,
    )
    assert n == 1, text
    path.write_text(text)


def _write_repository(root: Path) -> None:
    for name, (max_batch, instances, body, delay_ms) in MODELS.items():
        write_identity(
            root, name, "FP32", dims=[-1], max_batch_size=max_batch, instance_count=instances
        )
        _set_dynamic_batching(root, name, body)
        if delay_ms:
            path = _config_path(root, name)
            param = f'key: "execute_delay_ms" value {{ string_value: "{delay_ms}" }}'
            path.write_text(path.read_text() + f"parameters {{ {param} }}\n")
    for name, body in SLOW_WHEN_MARKED.items():
        _write_slow_when_marked(root, name, body)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("queue_policies")
    _write_repository(root)
    return root


@pytest.fixture(scope="module")
def metrics_port() -> int:
    """The gateway's Triton /metrics."""
    return free_port()


@pytest.fixture(scope="module")
def qstack(repo: Path, metrics_port: int) -> Iterator[RunningStack]:
    with stack_retrying(
        repo,
        control_mode="explicit",
        load_models=("*",),
        metrics_port=metrics_port,
        stage_metrics=True,  # the scheduler's queue depth: _send_queued
    ) as s:
        c = s.client()
        # One request first: on a fresh gateway, concurrent first requests can
        # each open a scheduler stream and reach the scheduler out of order
        # (SchedulerLink._ensure_stream). Then touch every model once (queue
        # created, instance warm) so no test pays first-request costs.
        c.infer("unordered", [_input(np.zeros((1, 4), np.float32))], client_timeout=RPC_TIMEOUT_S)
        warm = [Calls(c, name) for name in [*MODELS, *SLOW_WHEN_MARKED]]
        for calls in warm:
            calls.send("warm-up")
        for calls in warm:
            calls.wait()
            calls.outcomes[0].ok()
        yield s


# ----------------------------------------------------------------- helpers


def _input(data: np.ndarray) -> grpcclient.InferInput:
    return tensor_input("INPUT0", data, "FP32")


@dataclass
class Outcome:
    tag: str
    data: np.ndarray
    sent: float
    done: float | None = None
    result: grpcclient.InferResult | None = None
    error: InferenceServerException | None = None
    finished: threading.Event = field(default_factory=threading.Event)

    @property
    def done_at(self) -> float:
        """When it was answered; it must have been."""
        assert self.done is not None, f"{self.tag}: no answer"
        return self.done

    @property
    def elapsed(self) -> float:
        return self.done_at - self.sent

    def ok(self) -> None:
        """It succeeded and got its own data back."""
        assert self.error is None, f"{self.tag}: {self.error}"
        assert self.result is not None
        np.testing.assert_array_equal(self.result.as_numpy("OUTPUT0"), self.data)

    def rejected(self, *fragments: str) -> str:
        """It failed with UNAVAILABLE; returns the message."""
        assert self.error is not None, f"{self.tag} succeeded"
        assert self.error.status() == UNAVAILABLE, f"{self.tag}: {self.error}"
        message = self.error.message() or ""
        for fragment in fragments:
            assert fragment.lower() in message.lower(), (fragment, message)
        return message


def _rejected_count(metrics_port: int, model: str) -> float:
    """nv_inference_request_failure{reason="REJECTED"} for `model`."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for line in text.splitlines():
        if (
            line.startswith("nv_inference_request_failure{")
            and f'model="{model}"' in line
            and 'reason="REJECTED"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class Calls:
    """Concurrent async_infer calls to one model, with completion times."""

    def __init__(self, client: grpcclient.InferenceServerClient, model: str) -> None:
        self.client = client
        self.model = model
        self.outcomes: list[Outcome] = []

    def send(self, tag: str, shape=(1, 4), **kwargs) -> Outcome:
        value = float(len(self.outcomes) + 1)
        data = np.full(shape, value, np.float32)
        outcome = Outcome(tag, data, time.monotonic())

        def callback(result, error) -> None:
            outcome.done = time.monotonic()
            outcome.result, outcome.error = result, error
            outcome.finished.set()

        self.outcomes.append(outcome)
        self.client.async_infer(
            self.model,
            [_input(data)],
            callback=callback,
            client_timeout=RPC_TIMEOUT_S,
            **kwargs,
        )
        return outcome

    def wait(self) -> None:
        for o in self.outcomes:
            assert o.finished.wait(RPC_TIMEOUT_S + 5), f"{o.tag}: no answer"

    def completion_order(self) -> list[str]:
        return [o.tag for o in sorted(self.outcomes, key=lambda o: o.done_at)]


def _send_queued(qstack: RunningStack, calls: Calls, tag: str, **kwargs) -> Outcome:
    """Send one more request behind a blocker and return once the scheduler
    queued it: requests sent this way reach the queue in the order sent,
    however loaded the machine (a fixed gap between sends is no such bound)."""
    depth = queued_requests(qstack, calls.model)
    outcome = calls.send(tag, **kwargs)
    model = calls.model
    queued = wait_until(lambda: queued_requests(qstack, model) == depth + 1, RPC_TIMEOUT_S, 0.005)
    assert queued, f"{tag}: not queued behind the blocker (did the blocker finish first?)"
    return outcome


def _blocked(qstack: RunningStack, model: str) -> tuple[grpcclient.InferenceServerClient, Calls]:
    """A client and a Calls whose first request ("blocker") is executing."""
    c = qstack.client()
    calls = Calls(c, model)
    assert wait_until(lambda: model_grants(qstack, model) == 0, RPC_TIMEOUT_S)
    calls.send("blocker")
    _executing(qstack, model)
    return c, calls


def _executing(qstack: RunningStack, model: str) -> None:
    """The one request sent to `model` holds its instance: it has left the
    queue in a batch (a loaded machine may take longer than any fixed sleep
    to get it there)."""
    assert wait_until(lambda: sole_request_in_a_batch(qstack, model), RPC_TIMEOUT_S, 0.005)


def _fail_count(c: grpcclient.InferenceServerClient, model: str) -> int:
    return model_stats(c, model).inference_stats.fail.count


def _success_count(c: grpcclient.InferenceServerClient, model: str) -> int:
    return model_stats(c, model).inference_stats.success.count


# ------------------------------------------------------------------ priority


def test_high_priority_request_overtakes_queued_low_priority_ones(qstack: RunningStack) -> None:
    _, calls = _blocked(qstack, "prio")
    # priority 2 is the default level; 0 and out-of-range (9 > 2 levels) mean it too
    for tag, priority in (("low-2", 2), ("low-0", 0), ("low-9", 9)):
        _send_queued(qstack, calls, tag, priority=priority)
    calls.send("high", priority=1)
    calls.wait()
    for o in calls.outcomes:
        o.ok()
    # it ran right after the blocker, not behind the three low ones
    assert calls.completion_order() == ["blocker", "high", "low-2", "low-0", "low-9"]


# ------------------------------------------------------------------ max_queue_size


def test_max_queue_size_rejects_overflow_with_unavailable(qstack: RunningStack) -> None:
    c = qstack.client()
    fails0, successes0 = _fail_count(c, "bounded"), _success_count(c, "bounded")
    _, calls = _blocked(qstack, "bounded")
    blocker = calls.outcomes[0]
    for k in range(6):
        calls.send(f"q{k}")
    calls.wait()
    blocker.ok()
    queued = calls.outcomes[1:]
    rejected = [o for o in queued if o.error is not None]
    accepted = [o for o in queued if o.error is None]
    assert len(accepted) == 2 and len(rejected) == 4, [(o.tag, o.error) for o in queued]
    for o in accepted:
        o.ok()
    for o in rejected:
        message = o.rejected("Exceeds maximum queue size")
        assert "full" in message, message
        assert "bounded" in message, message
        # answered at once, not after the blocker finished
        assert o.done_at < blocker.done_at, (o.tag, o.elapsed)
    # the model still serves
    r = c.infer("bounded", [_input(np.ones((1, 3), np.float32))], client_timeout=RPC_TIMEOUT_S)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.ones((1, 3), np.float32))
    assert _fail_count(c, "bounded") - fails0 == 4
    assert _success_count(c, "bounded") - successes0 == 4


# ------------------------------------------------------------------ timeouts


def test_timeout_reject_answers_at_the_deadline_not_after_the_execution(
    qstack: RunningStack, metrics_port: int
) -> None:
    c = qstack.client()
    fails0, rejected0 = _fail_count(c, "reject"), _rejected_count(metrics_port, "reject")
    _, calls = _blocked(qstack, "reject")
    blocker = calls.outcomes[0]
    victim = calls.send("victim")
    calls.wait()
    # the blocker ran for 1 s, longer than the 200 ms queue timeout: the timeout
    # bounds the time in the queue only
    blocker.ok()
    assert victim.rejected("timeout").startswith("Request timeout expired")  # Triton's text
    # not before its 200 ms, and before the blocker's execution ended (it
    # had ~850 ms to run): no upper bound in seconds, which load stretches
    assert victim.elapsed >= 0.195, victim.elapsed
    assert victim.done_at < blocker.done_at
    assert _fail_count(c, "reject") - fails0 == 1
    # Counted as Triton 2.51 counts a queue timeout (checked against it).
    assert _rejected_count(metrics_port, "reject") - rejected0 == 1


def test_timeout_override_without_default_timeout_is_ignored(qstack: RunningStack) -> None:
    # As in Triton's core: a request may shorten a default timeout, but with
    # no default there is nothing to shorten, so its timeout is ignored.
    _, calls = _blocked(qstack, "override_on")
    blocker = calls.outcomes[0]
    timed = _send_queued(qstack, calls, "timed", timeout=200_000)  # microseconds
    patient = calls.send("patient")
    calls.wait()
    blocker.ok()
    timed.ok()
    patient.ok()
    assert timed.done_at > blocker.done_at and patient.done_at > blocker.done_at


def test_timeout_override_is_ignored_when_not_allowed(qstack: RunningStack) -> None:
    _, calls = _blocked(qstack, "override_off")
    blocker = calls.outcomes[0]
    timed = calls.send("timed", timeout=100_000)
    calls.wait()
    blocker.ok()
    timed.ok()
    # it waited for the blocker (500 ms), far past its 100 ms
    assert timed.elapsed > 0.3, timed.elapsed
    assert calls.completion_order() == ["blocker", "timed"]


def test_timeout_override_can_shorten_but_not_extend_the_default(qstack: RunningStack) -> None:
    _, calls = _blocked(qstack, "override_cap")  # default 300 ms, blocker runs 800 ms
    blocker = calls.outcomes[0]
    short = calls.send("short", timeout=100_000)
    long = calls.send("long", timeout=10_000_000)
    calls.wait()
    blocker.ok()
    short.rejected("timeout")
    long.rejected("timeout")
    assert short.elapsed >= 0.095, short.elapsed
    assert long.elapsed >= 0.295, long.elapsed
    # short's 100 ms ended first; long got the 300 ms default, not its 10 s
    # (it ended while the 800 ms blocker still ran)
    assert short.done_at < long.done_at < blocker.done_at


def test_timeout_delay_puts_expired_requests_behind_live_ones(qstack: RunningStack) -> None:
    # max_batch_size 2, blocker 600 ms; default timeout 10 s, overridable
    _, calls = _blocked(qstack, "delayed")
    blocker = calls.outcomes[0]
    expired = [_send_queued(qstack, calls, f"expired-{k}", timeout=30_000) for k in (1, 2)]
    time.sleep(0.08)  # both queued, and past their 30 ms now
    live = [calls.send("live-1"), calls.send("live-2")]
    calls.wait()
    for o in calls.outcomes:
        o.ok()  # DELAY never rejects
    assert all(o.done_at > blocker.done_at for o in expired + live)
    # the live ones (queued later) ran first, the expired ones after them
    assert max(o.done_at for o in live) < min(o.done_at for o in expired), calls.completion_order()


# ------------------------------------------------------------------ preserve_ordering


def _stream(
    c: grpcclient.InferenceServerClient,
    model: str,
    arrays: list[np.ndarray],
    after_first: Callable[[], None] | None = None,
) -> list[str]:
    """Send arrays on one stream concurrently; the request ids in answer order.
    `after_first` runs between the first send and the rest."""
    answers: list[tuple[grpcclient.InferResult | None, InferenceServerException | None]] = []
    done = threading.Event()

    def callback(result, error) -> None:
        answers.append((result, error))
        if len(answers) == len(arrays):
            done.set()

    c.start_stream(callback=callback)
    try:
        for i, a in enumerate(arrays):
            c.async_stream_infer(model, [_input(a)], request_id=str(i))
            if i == 0 and after_first is not None:
                after_first()
        assert done.wait(RPC_TIMEOUT_S), f"{len(answers)} of {len(arrays)} answers"
        got = answers[: len(arrays)]
    finally:
        # every request answered: close the stream politely; else cancel them
        c.stop_stream(cancel_requests=not done.is_set())
    ids = []
    for result, error in got:
        assert error is None, error
        assert result is not None
        rid = result.get_response().id
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), arrays[int(rid)])
        ids.append(rid)
    return ids


def _slow_then_fast() -> list[np.ndarray]:
    # The first request is marked: it sleeps on one instance while the others
    # run on the second.
    return [np.full((1, 4), -1.0, np.float32)] + [
        np.full((1, 4), float(k), np.float32) for k in range(1, 5)
    ]


def test_preserve_ordering_releases_responses_in_dispatch_order(qstack: RunningStack) -> None:
    c = qstack.client()
    arrays = _slow_then_fast()

    def stream(model: str) -> list[str]:
        assert wait_until(lambda: model_grants(qstack, model) == 0, RPC_TIMEOUT_S)
        # the rest are sent once the first runs, so they cannot join its batch
        return _stream(c, model, arrays, after_first=lambda: _executing(qstack, model))

    # premise: without preserve_ordering the later requests finish first
    unordered = stream("py_unordered")
    assert unordered[-1] == "0", unordered
    ordered = stream("py_ordered")
    assert ordered == [str(i) for i in range(len(arrays))]


def test_preserve_ordering_stream_of_concurrent_requests(qstack: RunningStack) -> None:
    c = qstack.client()
    arrays = [np.full((1, 1 + k % 3), float(k), np.float32) for k in range(16)]
    assert _stream(c, "ordered", arrays) == [str(i) for i in range(16)]


# ------------------------------------------------------------------ shapes


def _batch_counts(stats) -> Counter:
    return Counter({b.batch_size: b.compute_infer.count for b in stats.batch_stats})


def test_requests_of_different_shapes_never_share_a_batch(qstack: RunningStack) -> None:
    c = qstack.client()
    before = model_stats(c, "shapes")
    calls = Calls(c, "shapes")
    assert wait_until(lambda: model_grants(qstack, "shapes") == 0, RPC_TIMEOUT_S)
    calls.send("blocker", shape=(1, 2))
    _executing(qstack, "shapes")
    for tag, width in (("a1", 4), ("a2", 4), ("a3", 4), ("b1", 6), ("b2", 6), ("a4", 4)):
        _send_queued(qstack, calls, tag, shape=(1, width))
    calls.wait()
    for o in calls.outcomes:
        o.ok()  # every request got its own data and shape back
    after = model_stats(c, "shapes")
    assert after.inference_count - before.inference_count == 7
    # blocker, [a1 a2 a3], [b1 b2], [a4]: a batch ends at the first other shape
    assert after.execution_count - before.execution_count == 4
    assert _batch_counts(after) - _batch_counts(before) == Counter({1: 2, 3: 1, 2: 1})
    done = {o.tag: o.done_at for o in calls.outcomes}
    # the batches ran one after another (1 s each): [a1 a2 a3] first
    assert max(done["a1"], done["a2"], done["a3"]) < done["b1"] < done["a4"]


# ------------------------------------------------------------------ parameters


@pytest.mark.parametrize(
    ("name", "kind", "value"),
    [
        ("priority", "string_param", "high"),
        ("priority", "bool_param", True),
        ("priority", "double_param", 1.0),
        ("timeout", "string_param", "100"),
        ("timeout", "bool_param", True),
        ("timeout", "double_param", 0.5),
    ],
)
def test_wrong_type_priority_or_timeout_is_invalid_argument(
    qstack: RunningStack, name: str, kind: str, value
) -> None:
    request = raw_request("prio", [("INPUT0", "FP32", [1, 4])])
    request.raw_input_contents.append(np.ones((1, 4), np.float32).tobytes())
    setattr(request.parameters[name], kind, value)
    expect_raw_error(qstack.url, request, grpc.StatusCode.INVALID_ARGUMENT, (name,))


def test_integer_priority_and_timeout_parameters_are_accepted(qstack: RunningStack) -> None:
    request = raw_request("unordered", [("INPUT0", "FP32", [1, 4])])
    request.raw_input_contents.append(np.ones((1, 4), np.float32).tobytes())
    request.parameters["priority"].int64_param = 3  # no priority levels: ignored
    request.parameters["timeout"].uint64_param = 5_000_000
    response = raw_infer(qstack.url, request)
    assert response.outputs[0].name == "OUTPUT0"
    # tritonclient's own way (uint64 priority, int64 timeout)
    c = qstack.client()
    r = c.infer(
        "prio",
        [_input(np.ones((1, 2), np.float32))],
        priority=1,
        timeout=5_000_000,
        client_timeout=RPC_TIMEOUT_S,
    )
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.ones((1, 2), np.float32))
    # "timeout" is not reserved in tritonclient's `parameters`: a string goes out as is
    expect_error(
        c.infer,
        "prio",
        [_input(np.ones((1, 2), np.float32))],
        status=INVALID,
        contains=("timeout",),
        parameters={"timeout": "100"},
        client_timeout=RPC_TIMEOUT_S,
    )


# ------------------------------------------------------------------ reload


def test_reload_turning_preserve_ordering_on_keeps_answering(
    qstack: RunningStack, repo: Path
) -> None:
    """Served without preserve_ordering, reloaded (explicit load_model) with it on:
    the next request must still be answered (observed: DEADLINE_EXCEEDED)."""
    c = qstack.client()
    x = np.ones((1, 4), np.float32)
    for _ in range(3):
        c.infer("reloaded", [_input(x)], client_timeout=RPC_TIMEOUT_S)
    _set_dynamic_batching(repo, "reloaded", "preserve_ordering: true")
    c.load_model("reloaded", client_timeout=RPC_TIMEOUT_S)
    r = c.infer("reloaded", [_input(x)], client_timeout=RPC_TIMEOUT_S)  # a hang fails it
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), x)
