"""The shard assignment policy (stageserve/shard_policy.py): one owner per
model, the same on every process, and a join or a leave moves only the
models it must."""

from __future__ import annotations

import pytest

from stageserve.cli import build_parser
from stageserve.scheduler_count import auto_schedulers, parse_schedulers
from stageserve.shard_policy import Rendezvous, assign

MODELS = [f"model_{i}" for i in range(600)]


def test_every_model_gets_one_live_owner() -> None:
    owners = assign(MODELS, ["a", "b", "c"])
    assert set(owners) == set(MODELS)
    assert set(owners.values()) == {"a", "b", "c"}


def test_no_scheduler_no_owner() -> None:
    assert assign(MODELS, []) == {}
    assert Rendezvous().owner("m", []) is None


def test_the_answer_does_not_depend_on_the_order_of_schedulers() -> None:
    assert assign(MODELS, ["a", "b", "c"]) == assign(MODELS, ["c", "a", "b"])


def test_models_spread_evenly() -> None:
    owners = assign(MODELS, ["a", "b", "c"])
    counts = [list(owners.values()).count(s) for s in "abc"]
    assert all(150 <= c <= 250 for c in counts), counts  # 200 each, +-25%


def test_a_join_moves_only_models_to_the_newcomer_about_one_in_n() -> None:
    before = assign(MODELS, ["a", "b", "c"])
    after = assign(MODELS, ["a", "b", "c", "d"])
    moved = [m for m in MODELS if before[m] != after[m]]
    assert all(after[m] == "d" for m in moved)
    assert 0.15 * len(MODELS) <= len(moved) <= 0.35 * len(MODELS)  # ~1/4


def test_a_leave_moves_only_the_leavers_models() -> None:
    before = assign(MODELS, ["a", "b", "c"])
    after = assign(MODELS, ["a", "c"])
    for m in MODELS:
        if before[m] != "b":
            assert after[m] == before[m]
        else:
            assert after[m] in {"a", "c"}


def test_schedulers_flag() -> None:
    assert parse_schedulers("auto") == "auto"
    assert parse_schedulers("3") == 3
    for bad in ("0", "-1", "x"):
        with pytest.raises(Exception, match="expected"):
            parse_schedulers(bad)
    assert [auto_schedulers(c) for c in (1, 2, 7, 8, 16, 64)] == [1, 1, 1, 1, 2, 8]
    assert build_parser().parse_args(["up", "--schedulers", "2"]).schedulers == 2
    assert build_parser().parse_args(["up"]).schedulers == "auto"
    argv = ["scheduler", "--scheduler-id", "s1", "--redis-url", "redis://127.0.0.1:1/0"]
    scheduler = build_parser().parse_args(argv)
    assert scheduler.scheduler_id == "s1"
