"""Settings from the environment: STAGESERVE_<SERVICE>_<FIELD>, typed, checked."""

from __future__ import annotations

import pytest

from stageserve.settings import SchedulerSettings, WorkerSettings, from_env


def test_defaults_without_environment() -> None:
    assert from_env(WorkerSettings, "worker", {}) == WorkerSettings()


def test_each_field_is_overridden_by_its_variable_with_its_type() -> None:
    s = from_env(
        SchedulerSettings,
        "scheduler",
        {
            "STAGESERVE_SCHEDULER_GRANT_LEASE_MS": "5000",
            "STAGESERVE_SCHEDULER_GRANT_RENEW_S": "1.5",
        },
    )
    assert s.grant_lease_ms == 5000 and isinstance(s.grant_lease_ms, int)
    assert s.grant_renew_s == 1.5
    assert s.acquire_wait_ms == SchedulerSettings().acquire_wait_ms


@pytest.mark.parametrize("value", ["soon", "1.5", "-1"])
def test_a_bad_value_names_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match="STAGESERVE_WORKER_LEASE_MS"):
        from_env(WorkerSettings, "worker", {"STAGESERVE_WORKER_LEASE_MS": value})
