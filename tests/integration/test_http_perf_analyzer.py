"""perf_analyzer -i http (tritonclient 2.50's binary) runs unchanged against the HTTP front."""

from __future__ import annotations

import os

import pytest

from bench.perf_analyzer import find_perf_analyzer, run_perf
from tests.stack import RunningStack

pytestmark = pytest.mark.perf


@pytest.fixture(scope="module")
def analyzer():
    found = find_perf_analyzer()
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("perf_analyzer missing in CI: scripts/test.sh must install it")
        pytest.skip("perf_analyzer not installed (scripts/install_perf_analyzer.sh)")
    return found


@pytest.mark.parametrize("model", ["simple", "mlp"])
def test_perf_analyzer_http_measures_throughput(stack: RunningStack, analyzer, model) -> None:
    client = stack.client()
    before = client.get_inference_statistics(model).model_stats[0].inference_count
    result = run_perf(
        stack.gateway.http_address,
        model,
        4,
        measurement_ms=1000,
        stability_pct=100,
        protocol="http",
        extra_args=["--max-trials", "10"],
        analyzer=analyzer,
    )
    assert result.throughput > 0
    assert 0 < result.p50_us <= result.p99_us
    served = client.get_inference_statistics(model).model_stats[0].inference_count - before
    assert served > 0
    if result.request_count:
        assert served >= result.request_count
    # Server-side columns come from ModelStatistics, read over HTTP by perf_analyzer.
    assert result.server is not None and result.server.compute_infer_us > 0
