"""ModelStatistics over several gateways: any gateway answers the model's
totals (its own live figures plus the others' published ones)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from stageserve_tools.examples import write_simple
from tests.integration.helpers import infer_simple, two_paths
from tests.stack import wait_until


def counts(client: grpcclient.InferenceServerClient) -> tuple[int, int, int]:
    s = client.get_inference_statistics("simple").model_stats[0]
    return s.inference_stats.success.count, s.inference_stats.fail.count, s.inference_count


def wait_for_counts(client, expected) -> None:
    assert wait_until(lambda: counts(client) == expected), (counts(client), expected)


def test_every_gateway_answers_the_totals(tmp_path: Path) -> None:
    write_simple(tmp_path)
    with two_paths(tmp_path) as (running, _, client_b):
        client_a = running.client()
        for _ in range(3):
            infer_simple(client_a)
        for _ in range(2):
            infer_simple(client_b, batch=2)
        # A request refused by validation is no failure (as in Triton 2.51);
        # merging failure counts is covered by tests/unit/test_statistics.py.
        bad = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
        with pytest.raises(InferenceServerException) as info:
            client_b.infer("simple", [bad])
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        # 5 successful requests, 7 inferences (two of batch 2), no failure.
        wait_for_counts(client_a, (5, 0, 7))
        wait_for_counts(client_b, (5, 0, 7))
        # Each gateway published its own share to Redis.
        r = redis.Redis.from_url(running.redis_url)
        keys = [k.decode() for k in r.scan_iter("ss:stats:simple:*")]
        assert len(keys) == 1 and r.hlen(keys[0]) == 2, keys


def test_without_redis_a_gateway_answers_its_own_figures(tmp_path: Path) -> None:
    write_simple(tmp_path)
    with two_paths(tmp_path) as (running, _, client_b):
        client_a = running.client()
        infer_simple(client_a)
        infer_simple(client_b)
        wait_for_counts(client_a, (2, 0, 2))
        redis_child = next(c for c in running.stack.children if c.name == "redis")
        redis_child.proc.kill()
        redis_child.proc.wait(10)
        # Redis is gone: the statistics RPC still answers, with this gateway's share.
        assert counts(client_a) == (1, 0, 1)
        assert counts(client_b) == (1, 0, 1)
