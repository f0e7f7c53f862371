"""Two gateways, Redis comes back empty, one gateway restarts at that moment.

The restarted gateway marks its (empty) model set in Redis before the other
gateway republished the model it loaded in explicit mode. Workers must not
take that for the whole model set: they keep the instances of the other
gateway's model until it has republished it, so it never goes unavailable
(services/worker/publishers.py, services/gateway/republish.py).

Made deterministic by stopping gateway A (SIGSTOP) from before the flush until
the restarted gateway B has marked and the worker has had time to act on it
(a model event or its reconcile_s re-check): a stopped gateway stands for one
that is merely slower than B. Before the fix, the worker unloaded A's model
within that window and A, finding Redis marked, never republished it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import redis

from stageserve import redis_keys as keys
from stageserve.settings import settings_from_env
from stageserve_tools.examples import write_simple
from tests.integration.helpers import infer_simple, registered_instances, two_paths
from tests.stack import wait_until


def _generation(redis_url: str) -> int | None:
    r = redis.Redis.from_url(redis_url)
    try:
        value = r.hget(keys.model("simple"), "generation")
        return None if value is None else int(value)
    finally:
        r.close()


def test_restarting_gateway_never_makes_workers_drop_another_gateways_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker waits this long for a gateway it saw to mark again; gateway A
    # is held stopped for several seconds here, on a machine shared with other jobs.
    monkeypatch.setenv("STAGESERVE_WORKER_PUBLISHER_GRACE_S", "60")
    write_simple(tmp_path, "simple")
    explicit = ("--model-control-mode", "explicit")
    with two_paths(tmp_path, explicit, control_mode="explicit") as (running, _, client_b):
        client_a = running.client()
        client_a.load_model("simple")  # through gateway A only: B does not know it
        infer_simple(client_a)
        assert not client_b.is_model_ready("simple")
        instances = registered_instances(running.redis_url, "simple")
        generation = _generation(running.redis_url)
        assert instances and generation is not None

        gateway_b = running.child("gateway-2")
        b_args = gateway_b.cmd[gateway_b.cmd.index("stageserve.cli") + 1 :]
        samples: list[set[str]] = []

        def sample_for(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                samples.append(registered_instances(running.redis_url, "simple"))
                time.sleep(0.05)

        os.kill(running.gateway.proc.pid, signal.SIGSTOP)
        try:
            r = redis.Redis.from_url(running.redis_url)
            r.flushall()  # Redis "restarted empty"
            r.close()
            gateway_b.proc.terminate()
            gateway_b.proc.wait(10)
            running.stack.start_service("gateway-3", b_args)  # marks at startup
            sample_for(settings_from_env().worker.reconcile_s + 1.5)
        finally:
            os.kill(running.gateway.proc.pid, signal.SIGCONT)
        _assert_kept(samples, instances)  # while A was stopped
        # A notices its mark is gone and republishes with the same generation.
        assert wait_until(lambda: _generation(running.redis_url) == generation, 10)
        sample_for(settings_from_env().worker.reconcile_s + 1.0)
        _assert_kept(samples, instances)
        assert client_a.is_model_ready("simple")
        infer_simple(client_a)
        client_a.close()
        client_b.close()


def _assert_kept(samples: list[set[str]], instances: set[str]) -> None:
    """The worker re-registered its instances after the flush (heartbeat) and
    never dropped them: once back, they stayed, the same ones."""
    first = next((i for i, s in enumerate(samples) if s), None)
    assert first is not None, "the worker never registered the instances again"
    dropped = [i for i, s in enumerate(samples[first:], first) if s != instances]
    assert not dropped, f"instances gone at samples {dropped[:5]} of {len(samples)}"
