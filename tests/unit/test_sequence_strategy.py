"""services/scheduler/sequence_strategy.py: the sequence batcher's batch forming
(oldest, direct), driven directly with a fake clock (times in ns), no Redis."""

from __future__ import annotations

from services.scheduler.batch_strategy import Queued
from services.scheduler.instance_pins import InstanceFilter
from services.scheduler.sequence_store import Placement
from services.scheduler.sequence_strategy import SequenceStrategy
from stageserve.config import parse_config_text, to_spec
from stageserve.generated import stageserve_pb2 as pb

MS = 1_000_000
S = 1_000_000_000


def _strategy(
    kind: str,
    delay_us: int = 0,
    max_batch: int = 2,
    idle_us: int = 1_000_000,
    extra: str = "",
    instances: int = 1,
):
    spec = to_spec(
        parse_config_text(
            f"""name: "m" platform: "onnxruntime_onnx" max_batch_size: {max_batch}
            input [ {{ name: "I" data_type: TYPE_INT32 dims: [ -1 ] }} ]
            output [ {{ name: "O" data_type: TYPE_INT32 dims: [ -1 ] }} ]
            sequence_batching {{
              max_sequence_idle_microseconds: {idle_us}
              {kind} {{ max_queue_delay_microseconds: {delay_us} {extra} }}
            }}
            instance_group [ {{ kind: KIND_CPU count: {instances} }} ]"""
        )
    )
    return SequenceStrategy(spec)


def _q(sid, t_ns: int, start=False, end=False, length: int = 1) -> Queued:
    msg = pb.ScheduleRequest(
        sequence_id=sid if isinstance(sid, int) else 0,
        sequence_id_str=sid if isinstance(sid, str) else "",
        sequence_start=start, sequence_end=end,
        inputs=[pb.Tensor(name="I", datatype="INT32", shape=[1, length])],
    )  # fmt: skip
    return Queued(msg, lambda _r: None, t_ns)


def _added(s: SequenceStrategy, *qs: Queued) -> list[Queued]:
    for q in qs:
        s.add(q)
    assert s.listed(list(qs)) == []
    return list(qs)


def test_a_request_waits_until_its_backlog_entry_is_listed() -> None:
    s = _strategy("oldest")
    q = _q(1, 0, start=True)
    s.add(q)
    assert q.cid == "i:1" and len(s) == 1
    assert not s.has_work(0) and s.next_batch(0).batch is None
    s.listed([q])
    assert s.has_work(0) and s.next_batch(0).batch == [q] and len(s) == 0
    x, zero = _q("x", 0), _q(0, 0)
    s.add(x)
    s.add(zero)
    assert (x.cid, zero.cid) == ("s:x", "i:0")  # string and integer ids never mix


def test_one_request_per_sequence_oldest_first_and_in_order() -> None:
    s = _strategy("oldest", max_batch=3)
    a1, b1, a2 = _added(s, _q(1, 10), _q(2, 5), _q(1, 20))
    assert s.next_batch(30).batch == [b1, a1]  # oldest head first; a2 waits for a1
    assert not s.has_work(30)  # both sequences running
    s.finished([b1, a1], 40)
    assert s.next_batch(40).batch == [a2]
    s.finished([a2], 50)
    assert s.backlogs == {} and s.running == set()


def test_queue_delay_holds_a_batch_unless_it_is_full() -> None:
    s = _strategy("oldest", delay_us=1000, max_batch=2)
    a = _added(s, _q(1, 0))[0]
    d = s.next_batch(0)
    assert d.batch is None and d.wake_at_ns == 1 * MS
    b = _added(s, _q(2, MS // 2))[0]
    assert s.next_batch(MS // 2).batch == [a, b]  # full: at once


def test_rows_share_the_oldest_heads_input_shapes() -> None:
    s = _strategy("oldest", max_batch=3)
    a, b, c = _added(s, _q(1, 0, length=2), _q(2, 1, length=3), _q(3, 2, length=2))
    assert s.next_batch(5).batch == [a, c]
    assert s.next_batch(5).batch == [b]


def test_a_put_back_request_retries_at_its_time_and_wakes_the_queue_then() -> None:
    s = _strategy("oldest")
    a1, a2 = _added(s, _q(1, 0, start=True), _q(1, 1))
    assert s.next_batch(0).batch == [a1]
    s.put_back(a1, retry_at_ns=5 * MS)  # an earlier request of it runs elsewhere
    assert len(s) == 2 and not s.has_work(1 * MS)
    assert s.wake_at_ns(1 * MS) == 5 * MS
    assert s.next_batch(5 * MS).batch == [a1]  # still ahead of a2
    s.put_back(a1)  # no delay: eligible at once
    assert s.next_batch(5 * MS).batch == [a1]


def test_direct_start_waits_for_a_slot_and_wakes_when_the_idle_one_frees() -> None:
    s = _strategy("direct", max_batch=1, idle_us=2_000_000)
    a = _added(s, _q(1, 0, start=True))[0]
    assert s.next_batch(0).batch == [a]
    s.finished([a], 1 * S)  # slot 0 belongs to sequence 1, used at 1 s
    b = _added(s, _q(2, 1 * S, start=True))[0]
    assert not s.has_work(1 * S)  # every slot taken
    assert s.wake_at_ns(1 * S) == 3 * S + MS  # 1 ms after sequence 1 idles out
    assert s.next_batch(3 * S + MS).batch == [b]  # its slot came free
    assert s.slot("i:2") == 0 and s.slot("i:1") == -1


def test_direct_end_frees_the_slot_and_refused_sequences_hold_none() -> None:
    s = _strategy("direct", max_batch=1)
    a = _added(s, _q(1, 0, start=True, end=True))[0]
    assert s.next_batch(0).batch == [a]
    s.ended(a)
    s.finished([a], 1)
    b = _added(s, _q(2, 2))[0]  # no START: Redis will refuse it
    assert s.next_batch(2).batch == [b]
    s.refused(b)
    s.finished([b], 3)
    c = _added(s, _q(3, 4, start=True))[0]
    assert s.next_batch(4).batch == [c] and s.slot("i:3") == 0


def test_direct_layout_puts_row_i_in_slot_i_with_padding() -> None:
    s = _strategy("direct", max_batch=3)
    a, b, c = _added(s, _q(1, 0, start=True), _q(2, 1, start=True), _q(3, 2, start=True))
    assert s.next_batch(5).batch == [a, b, c]
    s.finished([a, b, c], 6)
    c2 = _added(s, _q(3, 7))[0]
    assert s.next_batch(8).batch == [c2]
    assert s.layout([(c2, s.slot("i:3"))]) == [None, None, c2]  # slots 0, 1: padding
    oldest = _strategy("oldest", max_batch=3)
    assert oldest.layout([(c2, 2), (a, 0)]) == [c2, a]  # oldest: no padding


def test_drain_leaves_running_sequences_and_listing_reports_the_gone() -> None:
    s = _strategy("oldest", max_batch=1)
    a1, a2, b1 = _added(s, _q(1, 0, start=True), _q(1, 1), _q(2, 2, start=True))
    assert s.next_batch(3).batch == [a1]
    c = _q(3, 4, start=True)
    s.add(c)  # not listed yet
    assert sorted(q.msg.sequence_id for q in s.drain()) == [2, 3]  # a2 stays: 1 runs
    assert len(s) == 1 and s.listed([c]) == [c]  # answered meanwhile: forget its entry
    assert s.drop(a2) and not s.drop(a2) and len(s) == 0


def test_oldest_start_waits_while_the_candidates_are_full() -> None:
    """max_candidate_sequences per instance: a START beyond them waits until a
    candidate sequence ends or idles out (Triton 2.51 does the same)."""
    s = _strategy("oldest", max_batch=4, idle_us=2_000_000, extra="max_candidate_sequences: 1")
    a = _added(s, _q(1, 0, start=True))[0]
    assert s.next_batch(0).batch == [a]
    s.finished([a], 1 * S)
    b = _added(s, _q(2, 1 * S, start=True))[0]
    assert not s.has_work(1 * S)  # sequence 1 is the one candidate
    assert s.wake_at_ns(1 * S) == 3 * S + MS  # 1 ms after sequence 1 idles out
    a2 = _added(s, _q(1, 2 * S, end=True))[0]
    assert s.next_batch(2 * S).batch == [a2]  # a candidate's request runs
    s.ended(a2)
    s.finished([a2], 2 * S)
    assert s.next_batch(2 * S).batch == [b]  # sequence 1 ended: 2 is a candidate


def test_oldest_candidates_default_to_max_batch_size_per_instance() -> None:
    s = _strategy("oldest", max_batch=2, instances=2)
    first = _added(s, *(_q(i, i, start=True) for i in range(1, 6)))
    batch = s.next_batch(10).batch
    # 4 candidates (2 instances x 2) in slots 0-3; a batch holds one
    # instance's group (slot % 2), at most max_batch_size of them
    assert batch == [first[0], first[2]]
    s.finished(batch, 11)
    assert s.next_batch(12).batch == [first[1], first[3]]
    assert not s.has_work(13)  # the fifth waits


def test_direct_slots_are_per_instance_and_a_batch_holds_one_instances() -> None:
    """Triton 2.51 gives every instance max_batch_size slots and hands out
    the lowest slot index across its instances: with two instances of
    max_batch_size 2, slots 0 and 2 are the first instance's rows 0 and 1,
    slots 1 and 3 the second's; four sequences run at once and a fifth
    START waits."""
    s = _strategy("direct", max_batch=2, instances=2)
    first = _added(s, *(_q(i, i, start=True) for i in range(1, 6)))
    b1 = s.next_batch(10).batch
    assert b1 == [first[0], first[2]] and [s.slot(q.cid) for q in b1] == [0, 2]
    b2 = s.next_batch(10).batch
    assert b2 == [first[1], first[3]] and [s.slot(q.cid) for q in b2] == [1, 3]
    assert not s.has_work(10)  # the fifth START: every slot taken
    assert s.layout([(q, s.slot(q.cid)) for q in b2]) == b2  # slots 1, 3: rows 0, 1
    s.finished(b1 + b2, 11)
    one, four, three = _added(s, _q(1, 12), _q(4, 13), _q(3, 14))
    assert s.next_batch(20).batch == [one, three]  # slots 0, 2: the first instance's
    assert s.next_batch(20).batch == [four]
    assert s.layout([(four, 3)]) == [None, four]  # slot 3: row 1, row 0 padding


def test_a_group_stays_on_the_instance_of_its_first_batch() -> None:
    s = _strategy("direct", max_batch=2, instances=2)
    one, two = _added(s, _q(1, 1, start=True), _q(2, 2, start=True))  # groups 0, 1
    assert s.instance_filter(3) is None  # nothing pinned: any instance
    assert s.next_batch(3, "A").batch == [one]  # group 0 now runs on A
    # group 1's work: not for A (it holds group 0), for any other instance
    assert s.instance_filter(3) == InstanceFilter(other_than=frozenset({"A"}))
    assert s.next_batch(3, "A").batch is None
    assert s.next_batch(3, "B").batch == [two]
    s.finished([one, two], 4)
    two2, one2 = _added(s, _q(2, 5), _q(1, 6))
    assert s.instance_filter(7) == InstanceFilter(only=frozenset({"A", "B"}))
    assert s.next_batch(7, "A").batch == [one2]  # its own group, not the older two2
    assert s.instance_filter(7) == InstanceFilter(only=frozenset({"B"}))
    assert s.next_batch(7, "C").batch is None  # C holds nothing: no unpinned work
    assert s.next_batch(7, "B").batch == [two2]


def test_a_group_comes_unpinned_when_its_slots_are_free_or_its_instance_is_gone() -> None:
    s = _strategy("direct", max_batch=2, instances=2)
    one, two = _added(s, _q(1, 1, start=True, end=True), _q(2, 2, start=True))
    assert s.next_batch(3, "A").batch == [one]
    assert s.next_batch(3, "B").batch == [two]
    s.ended(one)
    s.finished([one, two], 4)
    three = _added(s, _q(3, 5, start=True))[0]  # slot 0 again: group 0, now free
    # group 0 came free of A: any instance but B, whose group has no work
    assert s.instance_filter(6) == InstanceFilter(other_than=frozenset({"B"}))
    assert s.next_batch(6, "C").batch == [three]
    s.finished([three], 7)
    two2 = _added(s, _q(2, 8))[0]
    s.forget_instance("B")  # its worker died
    assert s.instance_filter(9) == InstanceFilter(other_than=frozenset({"C"}))
    assert s.next_batch(9, "C").batch is None  # C keeps to its group ...
    s.crowded(9)  # ... until the rate limiter had no other instance
    assert s.instance_filter(9) is None
    assert s.next_batch(9, "C").batch == [two2]


def test_one_instance_group_pins_without_walking_the_sequences() -> None:
    s = _strategy("oldest", max_batch=2)
    a = _added(s, _q(1, 0, start=True, end=True))[0]
    assert s.instance_filter(1) is None
    assert s.next_batch(1, "A").batch == [a]
    assert s.instance_filter(2) == InstanceFilter(only=frozenset({"A"}))
    s.ended(a)
    s.finished([a], 2)
    assert s.instance_filter(3) is None  # no sequence left: any instance


def test_continuing_sequences_take_the_slots_and_pins_of_the_previous_owner() -> None:
    s = _strategy("direct", max_batch=2, instances=2)
    fresh = _q(9, 0, start=True)
    one, four = _q(1, 1), _q(4, 2)
    assert not s.wants_placement(fresh) and s.wants_placement(one)
    for q in (fresh, one, four):
        s.add(q)
    s.listed([fresh])
    assert s.next_batch(3).batch == [fresh] and s.slot("i:9") == 0
    # the previous owner ran 1 in slot 0 (taken here now) and 4 in slot 3,
    # its group 0 on instance A and group 1 on B
    s.listed([one, four], Placement({"i:1": 0, "i:4": 3}, {1: "B", 0: "A"}), 4)
    assert s.slot("i:4") == 3 and s.slot("i:1") == 2  # slot 0 is taken: group 0's next
    assert s.instance_filter(5) == InstanceFilter(only=frozenset({"A", "B"}))
    assert s.next_batch(5, "B").batch == [four]  # group 1's slot 3: row 1
    assert s.layout([(four, 3)]) == [None, four]
    assert s.next_batch(5, "C").batch is None  # group 0 runs on A
    assert s.next_batch(5, "A").batch == [one]
