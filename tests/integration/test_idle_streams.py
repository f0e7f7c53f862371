"""The stages' long-lived streams outlive an idle spell longer than their keepalive.

Every internal stream (gateway -> scheduler, scheduler -> worker and rate
limiter) dials with the own HTTP/2 client (stageserve/h2grpc/client.py),
which pings a connection after 10 s without a frame while a call is open
and drops it when the ping goes unanswered 5 s later. A stack left alone
for longer than both must still answer as before: a healthy peer's answer
to the ping keeps the stream, where a dropped worker stream would make the
scheduler take the worker for dead (its instances deregistered, the next
request answered 503 "no instance ... is registered").
"""

from __future__ import annotations

import time

import numpy as np

from tests.integration.test_infer import simple_inputs
from tests.stack import RunningStack

#: keepalive (10 s) + the ping's answer bound (5 s) + margin
IDLE_S = 16.5


def test_a_stack_left_idle_past_its_keepalive_still_answers(stack: RunningStack) -> None:
    client = stack.client()
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 2, dtype=np.int32)
    first = client.infer("simple", simple_inputs(a, b))  # every stream open now
    np.testing.assert_array_equal(first.as_numpy("OUTPUT0"), a + b)
    time.sleep(IDLE_S)
    for k in range(10):
        b = np.full((1, 16), k, dtype=np.int32)
        result = client.infer("simple", simple_inputs(a, b))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
