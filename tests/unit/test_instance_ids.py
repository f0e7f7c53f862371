"""Instance ids: what the worker builds, the gateway reads back."""

from __future__ import annotations

import pytest

from stageserve.instance_ids import (
    InstanceId,
    InstanceIdError,
    generation_of,
    instance_id,
    parse_instance_id,
)


def test_an_id_reads_back_as_its_fields() -> None:
    text = instance_id("host-12", "simple", 3, 41, "simple_0", 2)
    assert text == "host-12/simple/3/g41/simple_0/2"
    assert parse_instance_id(text) == InstanceId("host-12", "simple", 3, 41, "simple_0", 2)
    assert generation_of(text) == 41


@pytest.mark.parametrize(
    ("worker", "group"), [("a/b", "g/1"), ("50%", "%2F"), ("w", "x/y/z"), ("%2F/", "/")]
)
def test_slashes_and_escapes_in_worker_and_group_names_survive(worker: str, group: str) -> None:
    text = instance_id(worker, "m", 1, 7, group, 0)
    assert len(text.split("/")) == 6
    assert parse_instance_id(text) == InstanceId(worker, "m", 1, 7, group, 0)


@pytest.mark.parametrize(
    "text",
    ["", "w/m/1/g2/grp", "w/m/1/2/grp/0", "w/m/x/g2/grp/0", "w/m/1/gx/grp/0", "a/b/c/d/e/f/g"],
)
def test_what_is_not_an_id_is_refused(text: str) -> None:
    with pytest.raises(InstanceIdError):
        parse_instance_id(text)
    assert generation_of(text) is None
