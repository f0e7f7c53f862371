"""services/scheduler/sequence_slots.py: the sequence batcher's pure strategy."""

from __future__ import annotations

from services.scheduler.sequence_slots import DirectSlots, ready_in_age_order


def test_ready_sequences_oldest_head_first_skipping_unlisted_running_and_retrying():
    heads = [("c", True, 30), ("a", True, 10), ("b", False, 5), ("d", True, 20), ("e", True, 1)]
    ready = ready_in_age_order(heads, running={"d"}, retry_at={"e": 5.0}, now=1.0)
    assert ready == ["a", "c"]  # b unlisted, d executing, e retries later
    assert ready_in_age_order(heads, {"d"}, {"e": 5.0}, now=5.0) == ["e", "a", "c"]


def test_direct_slots_admit_until_full_then_wait():
    slots: DirectSlots[str] = DirectSlots()
    assert slots.admit("s1", start=True, capacity=2, now=0.0)
    assert slots.admit("s2", start=True, capacity=2, now=0.0)
    assert not slots.admit("s3", start=True, capacity=2, now=0.0)  # a START waits
    assert slots.admit("s1", start=False, capacity=2, now=1.0)  # keeps its slot
    assert (slots.slot("s1"), slots.slot("s2"), slots.slot("s3")) == (0, 1, -1)
    slots.release("s1")  # END
    assert slots.admit("s3", start=True, capacity=2, now=1.0) and slots.slot("s3") == 0


def test_start_on_an_active_id_starts_over_in_a_free_slot():
    slots: DirectSlots[str] = DirectSlots()
    slots.admit("a", True, 3, 0.0)
    slots.admit("b", True, 3, 0.0)
    slots.release("a")
    slots.admit("c", True, 3, 0.0)  # takes slot 0
    assert slots.admit("b", start=True, capacity=3, now=1.0)
    assert slots.slot("b") == 1  # gave up slot 1, the lowest free one is 1 again


def test_idle_slots_come_free_unless_busy():
    slots: DirectSlots[str] = DirectSlots()
    slots.admit("old", True, 2, 0.0)
    slots.admit("busy", True, 2, 0.0)
    slots.admit("fresh", True, 3, 9.5)
    assert slots.next_idle_expiry(running={"busy"}, idle_s=5.0) == 5.0
    slots.free_idle(now=10.0, idle_s=5.0, busy=lambda cid: cid == "busy")
    assert "old" not in slots and "busy" in slots and "fresh" in slots
    slots.touch("busy", 10.0)
    assert slots.next_idle_expiry(running=set(), idle_s=5.0) == 14.5
    assert DirectSlots().next_idle_expiry(set(), 5.0) is None


def test_layout_puts_slot_s_in_row_s_div_groups_with_padding_and_spills_clashes():
    slots: DirectSlots[str] = DirectSlots()
    for cid in ("a", "b", "c"):
        slots.admit(cid, True, 4, 0.0)
    slots.release("b")  # slot 1 free: a=0, c=2
    assert slots.layout([("c", "row-c", -1), ("a", "row-a", -1)], groups=1) == [
        "row-a",
        None,
        "row-c",
    ]
    # two groups: slot s is row s // 2 of group s % 2; a sequence unknown here
    # (e.g. claimed by another scheduler) takes its claimed slot's row (slot 3:
    # row 1), or after a clash the first gap
    assert slots.layout([("a", "A", -1), ("x", "X", 0), ("y", "Y", 3)], groups=2) == [
        "A",
        "Y",
        "X",
    ]
    assert slots.layout([("a", "A", -1), ("x", "X", 0), ("y", "Y", 4)], groups=2) == [
        "A",
        "X",
        "Y",
    ]
