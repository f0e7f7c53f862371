"""perf_analyzer (tritonclient 2.50's binary) runs unchanged against both fronts of the gateway."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from bench import references
from bench.perf_analyzer import PerfAnalyzerError, find_perf_analyzer, run_perf
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


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("model", ["simple", "mlp"])
def test_perf_analyzer_measures_throughput(
    stack: RunningStack, analyzer, model: str, protocol: str
) -> None:
    client = stack.client()
    before = client.get_inference_statistics(model).model_stats[0].inference_count
    result = run_perf(
        stack.url if protocol == "grpc" else stack.gateway.http_address,
        model,
        4,
        measurement_ms=1000,
        stability_pct=1000,  # a functional check, not a figure: any windows will do
        protocol=protocol,
        # HTTP's first windows vary more while uvicorn warms up: more trials to settle.
        extra_args=["--max-trials", "3" if protocol == "grpc" else "10"],
        analyzer=analyzer,
    )
    assert result.throughput > 0
    assert 0 < result.p50_us <= result.p99_us
    served = client.get_inference_statistics(model).model_stats[0].inference_count - before
    assert served > 0
    if result.request_count:
        assert served >= result.request_count
    # Server-side columns come from our ModelStatistics (over HTTP for -i http).
    assert result.server is not None and result.server.compute_infer_us > 0


def test_perf_analyzer_sends_the_benchmarks_input_rows(
    stack: RunningStack, analyzer, tmp_path: Path
) -> None:
    """bench.compare's --input-data: the rows BenchModel.write_input_data
    writes reach the model, checked by perf_analyzer itself against the
    expected output (validation_data; the identity model answers its input);
    a wrong expected output makes the run fail, so the check is real."""
    model = references.bench_model("identity")
    path = model.write_input_data(tmp_path / "rows.json")
    rows = model.input_rows()["INPUT0"]
    assert rows.shape == (16,) and np.isfinite(rows).all()
    sent = json.loads(path.read_text())["data"][0]["INPUT0"]
    assert np.array_equal(np.array(sent["content"], dtype=np.float32), rows)

    def run(expected: np.ndarray):
        doc = json.loads(path.read_text())
        doc["validation_data"] = [
            {"OUTPUT0": {"content": [float(v) for v in expected], "shape": [16]}}
        ]
        checked = tmp_path / "checked.json"
        checked.write_text(json.dumps(doc))
        return run_perf(
            stack.url,
            "bench_identity",
            2,
            measurement_ms=500,
            stability_pct=1000,  # a functional check, not a figure: any windows will do
            extra_args=["--max-trials", "3"],
            analyzer=analyzer,
            input_data=checked,
        )

    assert run(rows).throughput > 0
    with pytest.raises(PerfAnalyzerError) as failed:
        run(rows + 1.0)
    assert "Output doesn't match expected output" in failed.value.output
