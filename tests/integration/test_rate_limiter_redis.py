"""The rate limiter's Redis going away under a running stack: typed errors,
then service again once it is back.

The rate limiter gets a Redis of its own here (the other stages keep theirs),
so only the rate limiter loses its state. Every request must go through it:
the model's instance needs a rate_limiter resource under execution_count, so
no grant is reused. While that Redis is down a client gets UNAVAILABLE with
a short message (not UNKNOWN with Python's exception text, as before); once
it is back, empty, the worker's heartbeat registers its instances again and
requests succeed.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis
from tritonclient.utils import InferenceServerException

from services.ratelimiter.errors import REDIS_UNAVAILABLE
from stageserve.generated import stageserve_pb2 as pb
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.launcher import Child, Stack, redis_answers, spawn_redis
from tests.integration.helpers import client, infer_simple
from tests.integration.test_rate_limiter import res, write_limited
from tests.stack import wait_until

#: back within: the worker heartbeats every 0.5 s; room for a loaded machine
BACK_BOUND_S = 15.0
PYTHON_TEXT = ("Traceback", "Exception", "Error ", "<class", "redis.", "Unexpected")


@dataclass
class SplitStack:
    url: str
    ratelimiter: Child
    ratelimiter_redis: Child


@pytest.fixture
def split(tmp_path: Path) -> Iterator[SplitStack]:
    write_limited(tmp_path, "limited", res("R"), delay_ms=1)
    rl_stack, stack = Stack(), Stack()
    try:
        rl_redis = rl_stack.start_redis()
        redis_url = stack.start_redis()
        listen = ["--listen", "127.0.0.1:0"]
        rl = stack.start_service(
            "ratelimiter",
            ["ratelimiter", *listen, "--redis-url", rl_redis, "--rate-limit", "execution_count"],
        )
        common = [*listen, "--redis-url", redis_url, "--ratelimiter", rl.address]
        sched = stack.start_service("scheduler", ["scheduler", *common])
        peers = [*common, "--scheduler", sched.address]
        stack.start_service("worker-0", ["worker", *peers, "--device", "cpu"])
        gw = stack.start_service(
            "gateway",
            # no HTTP front, no metrics: Triton's default ports may be taken
            ["gateway", *peers, "--model-repository", str(tmp_path)]
            + ["--allow-http", "false", "--metrics-port", "0"],
            timeout_s=600,
        )
        yield SplitStack(gw.address, rl, rl_stack.children[0])
    finally:
        stack.stop()
        rl_stack.stop()


def _limited_ok(url: str) -> bool:
    c = client(url)
    try:
        infer_simple(c, model="limited")
    except InferenceServerException:
        return False
    finally:
        c.close()
    return True


def test_redis_down_is_unavailable_then_back(split: SplitStack) -> None:
    assert wait_until(lambda: _limited_ok(split.url), 30)
    redis_child = split.ratelimiter_redis
    redis_child.proc.send_signal(signal.SIGKILL)
    redis_child.proc.wait(10)
    port = int(redis_child.address.rsplit(":", 1)[1])

    # Through the stack: UNAVAILABLE, a short message naming the cause.
    c = client(split.url)
    try:
        with pytest.raises(InferenceServerException) as down:
            infer_simple(c, model="limited")
    finally:
        c.close()
    message = down.value.message()
    assert down.value.status() == "StatusCode.UNAVAILABLE", message
    assert REDIS_UNAVAILABLE in message, message
    assert not any(t in message for t in PYTHON_TEXT), message

    # The rate limiter's own unary calls are typed the same way.
    channel = grpc.insecure_channel(split.ratelimiter.address)
    try:
        with pytest.raises(grpc.RpcError) as listed:
            pb_grpc.RateLimiterStub(channel).ListInstances(pb.ListInstancesRequest(), timeout=10)
    finally:
        channel.close()
    assert listed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert listed.value.details() == REDIS_UNAVAILABLE

    # Redis back, empty: the worker registers again and requests succeed.
    spawn_redis(redis_child)
    back_at = time.monotonic()
    assert wait_until(lambda: redis_answers(port), 10)
    assert wait_until(lambda: _limited_ok(split.url), BACK_BOUND_S), (
        f"no success within {BACK_BOUND_S}s of Redis coming back"
    )
    print(f"serving again {time.monotonic() - back_at:.2f} s after Redis came back")
    # and it follows its release channel again (services/ratelimiter/service.py)
    r = redis.Redis(port=port, socket_timeout=5)
    try:
        assert wait_until(lambda: len(r.pubsub_channels("ss:rl:freed:*")) == 1, 10)
    finally:
        r.close()
