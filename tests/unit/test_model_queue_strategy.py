"""services/scheduler/batch_strategy.py: the default / dynamic batching strategy
ModelQueue composes, driven directly with a fake clock (times in ns)."""

from __future__ import annotations

import pytest

from services.scheduler.batch_strategy import MAX_ATTEMPTS, Queued, QueueStrategy
from services.scheduler.batcher import QueueFull
from stageserve.config import ModelSpec, parse_config_text, to_spec
from stageserve.generated import stageserve_pb2 as pb

MS = 1_000_000


def _spec(batching: str, inputs: str = 'input [ { name: "I" data_type: TYPE_FP32 dims: [ -1 ] } ]'):
    return to_spec(
        parse_config_text(
            f"""name: "m" platform: "onnxruntime_onnx" max_batch_size: 8
            {inputs}
            output [ {{ name: "O" data_type: TYPE_FP32 dims: [ -1 ] }} ]
            {batching}"""
        )
    )


def _q(n: int, t_ns: int, length: int = 2, priority: int = 0, timeout_us: int = 0) -> Queued:
    msg = pb.ScheduleRequest(
        id=n, batch_size=1, priority=priority, timeout_us=timeout_us,
        inputs=[pb.Tensor(name="I", datatype="FP32", shape=[1, length])],
    )  # fmt: skip
    return Queued(msg, lambda _r: None, t_ns)


DYNAMIC = "dynamic_batching { max_queue_delay_microseconds: 2000 }"


def test_batch_waits_for_the_queue_delay_then_takes_the_requests_themselves() -> None:
    s = QueueStrategy(_spec(DYNAMIC))
    a, b = _q(1, 0), _q(2, 1 * MS)
    assert not s.add(a) and not s.add(b)  # no queue timeout: no deadline
    assert len(s) == 2 and s.has_work(0) and s.wake_at_ns(0) is None
    d = s.next_batch(1 * MS)
    assert d.batch is None and d.wake_at_ns == 2 * MS  # the oldest's delay
    d = s.next_batch(2 * MS)
    assert d.batch == [a, b] and len(s) == 0  # Queued, not the batcher's entries
    assert not s.has_work(2 * MS) and s.next_batch(2 * MS).batch is None


def test_different_shapes_do_not_share_a_batch() -> None:
    s = QueueStrategy(_spec(DYNAMIC))
    a, b = _q(1, 0, length=2), _q(2, 0, length=3)
    s.add(a)
    s.add(b)
    assert s.next_batch(0).batch == [a]  # b cannot join: sent at once
    assert s.next_batch(5 * MS).batch == [b]


def test_default_scheduler_runs_one_request_per_batch() -> None:
    s = QueueStrategy(_spec(""))
    qs = [_q(i, 0) for i in range(3)]
    for q in qs:
        s.add(q)
    assert [s.next_batch(0).batch for _ in qs] == [[q] for q in qs]


def test_requeue_puts_a_batch_back_in_front_until_max_attempts() -> None:
    s = QueueStrategy(_spec(DYNAMIC))
    a, b, c = _q(1, 0), _q(2, 0), _q(3, 5 * MS)
    s.add(a)
    s.add(b)
    batch = s.next_batch(2 * MS).batch
    assert batch == [a, b]
    s.add(c)
    assert s.requeue(batch)
    assert (a.attempts, b.attempts, len(s)) == (1, 1, 3)
    assert s.next_batch(9 * MS).batch == [a, b, c]  # back in front of c
    for _ in range(MAX_ATTEMPTS - 1):
        assert s.requeue(batch)
        assert s.next_batch(9 * MS).batch == [a, b]
    assert a.attempts == MAX_ATTEMPTS
    assert not s.requeue(batch) and len(s) == 0  # answered instead


def test_expire_answers_rejected_requests_as_queued() -> None:
    policy = "dynamic_batching { default_queue_policy { default_timeout_microseconds: 1000 } }"
    s = QueueStrategy(_spec(policy))
    a = _q(1, 0)
    assert s.add(a)  # it has a deadline
    assert s.next_deadline() == 1 * MS
    assert s.expire(0) == []
    assert s.expire(1 * MS) == [a] and len(s) == 0


def test_full_queue_refuses_and_names_the_level() -> None:
    levels = (
        "dynamic_batching { priority_levels: 2 default_priority_level: 2 "
        "priority_queue_policy { key: 1 value: { max_queue_size: 1 } } }"
    )
    s = QueueStrategy(_spec(levels))
    s.add(_q(1, 0, priority=1))
    with pytest.raises(QueueFull):
        s.add(_q(2, 0, priority=1))
    assert s.level_of(1) == 1 and s.level_of(0) == 2 and s.level_of(9) == 2
    s.add(_q(3, 0, priority=2))  # the other level has room
    assert [q.msg.id for q in s.drain()] == [1, 3] and len(s) == 0


def test_reconfigure_keeps_the_queue_and_recomputes_shape_keys() -> None:
    s = QueueStrategy(_spec(DYNAMIC))
    a, b = _q(1, 0, length=2), _q(2, 0, length=3)
    s.add(a)
    s.add(b)
    ragged = 'input [ { name: "I" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]'
    spec: ModelSpec = _spec(DYNAMIC, ragged)
    s.reconfigure(spec)
    assert len(s) == 2 and s.spec is spec
    assert s.next_batch(5 * MS).batch == [a, b]  # ragged now: one batch
