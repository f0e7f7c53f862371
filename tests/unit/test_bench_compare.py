"""Pure parts of bench.compare / bench.references: no server, no perf_analyzer."""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import compare, mlserver_boot, references
from bench.cnn import cnn_model
from bench.compare import Measurement, Point
from stageserve.config import parse_config_text, to_spec
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import model_config_pb2 as mc
from stageserve_tools.examples import identity_model, mlp_model

# --------------------------------------------------------------------------- results


def _m(server, model, conc, thr, p50=1000.0, p99=2000.0, cores=1.0, **kw) -> Measurement:
    return Measurement(server, model, conc, thr, p50, p99, cores, **kw)


def _points() -> list[Point]:
    ms = [
        _m("triton", "mlp", 8, 4000.0, p50=1000, p99=4000, cores=1.0),
        _m("mlserver", "mlp", 8, 1000.0, p50=4000, p99=8000, cores=1.0),
        _m("stageserve", "mlp", 8, 2000.0, p50=2000, p99=2000, cores=0.5),
        _m("triton", "identity", 1, 2000.0, cores=None),
        _m("stageserve", "identity", 1, 500.0),
    ]
    return compare.summarize(ms)


def test_summarize_takes_medians_over_repeats():
    ms = [
        _m("stageserve", "mlp", 8, 100.0, 10, 50, 1.0, window_spread=0.1, avg_batch=2.0),
        _m("stageserve", "mlp", 8, 300.0, 30, 70, 2.0, window_spread=0.3, avg_batch=4.0),
        _m("stageserve", "mlp", 8, 200.0, p50=20, p99=60, cores=1.5, stable=False, repeat=2),
        _m("stageserve", "mlp", 1, 50.0),
    ]
    points = compare.summarize(ms)
    assert [(p.model, p.concurrency) for p in points] == [("mlp", 8), ("mlp", 1)]
    p = points[0]
    assert (p.throughput, p.p50_us, p.p99_us, p.server_cores) == (200.0, 20, 60, 1.5)
    assert (p.repeats, p.throughput_min, p.throughput_max) == (3, 100.0, 300.0)
    assert p.window_spread == 0.3  # the worst repeat
    assert p.avg_batch == 3.0  # median of the repeats that have it
    assert p.stable is False  # one repeat needed the relaxed criterion
    assert points[1].repeats == 1 and points[1].stable


def test_point_cpu_per_inference_and_per_core():
    p = Point("triton", "mlp", 8, throughput=4000.0, p50_us=1, p99_us=2, server_cores=2.0)
    assert p.cpu_us_per_infer == pytest.approx(500.0)
    assert p.per_core == pytest.approx(2000.0)
    none = Point("triton", "mlp", 8, throughput=4000.0, p50_us=1, p99_us=2)
    assert none.cpu_us_per_infer is None and none.per_core is None


def test_ratios_stageserve_over_each_reference():
    rs = {(r.model, r.concurrency, r.reference): r for r in compare.ratios(_points())}
    tri = rs[("mlp", 8, "triton")]
    assert tri.throughput == pytest.approx(0.5)
    assert tri.p50 == pytest.approx(2.0)
    assert tri.p99 == pytest.approx(0.5)
    assert tri.per_core == pytest.approx((2000 / 0.5) / (4000 / 1.0))  # 1.0
    mls = rs[("mlp", 8, "mlserver")]
    assert mls.throughput == pytest.approx(2.0)
    assert mls.per_core == pytest.approx(4.0)
    # identity c=1: no MLServer point; Triton's CPU unknown -> per-core ratio unknown
    assert rs[("identity", 1, "mlserver")].throughput is None
    assert rs[("identity", 1, "triton")].throughput == pytest.approx(0.25)
    assert rs[("identity", 1, "triton")].per_core is None


def test_ratios_skip_references_that_were_not_run():
    points = compare.summarize([_m("stageserve", "mlp", 1, 10.0), _m("triton", "mlp", 1, 20.0)])
    assert {r.reference for r in compare.ratios(points)} == {"triton"}


def test_no_ratios_without_stageserve_and_proxy_overhead_table():
    ms = [
        _m("mlserver", "mlp", 8, 1500.0, p50=4000, p99=12000, cores=1.0),
        _m("mlserver-proxy", "mlp", 8, 1000.0, p50=6000, p99=18000, cores=1.5),
    ]
    points = compare.summarize(ms)
    assert compare.ratios(points) == []
    (r,) = compare.proxy_overhead(points)
    assert (r.reference, r.throughput, r.p50, r.p99) == ("mlserver", pytest.approx(2 / 3), 1.5, 1.5)
    assert r.per_core == pytest.approx((1000 / 1.5) / 1500)
    text = compare.format_ratios([r], ours_label="proxy")
    assert text.splitlines()[0].split()[:4] == ["model", "conc", "proxy/MLServer", "infer/s"]
    assert text.splitlines()[-1].split() == ["mlp", "8", "0.67x", "1.50x", "1.50x", "0.44x"]


def test_format_points_table():
    text = compare.format_points(_points())
    lines = text.splitlines()
    assert lines[0].split() == [
        "model", "conc", "server", "infer/s", "spread", "p50", "ms", "p99", "ms", "cores",
        "cpu", "us/inf", "batch",
    ]  # fmt: skip
    assert set(lines[1]) <= {"-", " "}
    # identity (MODELS order) before mlp; Triton before MLServer before StageServe
    body = [ln.split()[:3] for ln in lines[2:]]
    assert body == [
        ["identity", "1", "Triton"],
        ["identity", "1", "StageServe"],
        ["mlp", "8", "Triton"],
        ["mlp", "8", "MLServer"],
        ["mlp", "8", "StageServe"],
    ]
    stage = lines[-1].split()
    assert stage[3:] == ["2,000", "-", "2.00", "2.00", "0.50", "250", "-"]
    assert lines[2].split()[-3:] == ["-", "-", "-"]  # Triton identity: no CPU figure


def _three_model_points() -> list[Point]:
    """All three bench models at c=8 and 32, measured in an odd order."""
    ms = []
    for model, base in (("cnn", 300.0), ("mlp", 2000.0), ("identity", 3000.0)):
        for conc in (32, 8):
            ms.append(_m("stageserve", model, conc, base * 0.96, p50=1100, p99=2300))
            ms.append(_m("triton", model, conc, base, p50=1000, p99=2000, cores=1.2))
    return compare.summarize(ms)


def test_tables_and_csv_with_three_models():
    points = _three_model_points()
    body = [ln.split()[:3] for ln in compare.format_points(points).splitlines()[2:]]
    # MODELS order (identity, mlp, cnn), then concurrency, then server
    assert body == [
        [model, conc, server]
        for model in ("identity", "mlp", "cnn")
        for conc in ("8", "32")
        for server in ("Triton", "StageServe")
    ]
    rs = compare.ratios(points)
    assert len(rs) == 6 and {r.reference for r in rs} == {"triton"}
    text = compare.format_ratios(rs).splitlines()
    # ratios keep the order points were first measured in, as the run goes
    assert [tuple(ln.split()[:2]) for ln in text[2:]] == [
        (model, conc) for model in ("cnn", "mlp", "identity") for conc in ("32", "8")
    ]
    cnn8 = [ln.split() for ln in text if ln.startswith("cnn") and ln.split()[1] == "8"][0]
    assert cnn8 == ["cnn", "8", "0.96x", "1.10x", "1.15x", "1.15x"]  # infer/s, p50, p99, per-core
    rows = list(csv.DictReader(io.StringIO(compare.points_csv(points))))
    assert {r["model"] for r in rows} == {"identity", "mlp", "cnn"} and len(rows) == 12
    ratio_rows = list(csv.DictReader(io.StringIO(compare.ratios_csv(rs))))
    cnn = [r for r in ratio_rows if r["model"] == "cnn"]
    assert sorted(float(r["throughput"]) for r in cnn) == [0.96, 0.96]
    assert {float(r["p99"]) for r in cnn} == {1.15}


def test_write_results_and_plot_with_three_models(tmp_path: Path):
    ms = [
        _m(server, model, conc, 100.0 * (i + 1))
        for i, model in enumerate(("identity", "mlp", "cnn"))
        for server in ("triton", "stageserve")
        for conc in (8, 32)
    ]
    files = compare.write_results(tmp_path / "out", ms, {}, plot=False)
    md = files["markdown"].read_text()
    for model in ("identity", "mlp", "cnn"):
        assert f"| {model} | 8 | StageServe |" in md
    assert "| cnn | 8 | issue 15, vs Triton |" in md  # the target table
    targets = json.loads(files["meta"].read_text())["targets"]
    assert [(t["model"], t["concurrency"], t["reference"]) for t in targets] == [
        ("cnn", 8, "triton"),
        ("cnn", 32, "triton"),
    ]
    assert targets[0]["throughput_ratio"] == 1.0 and targets[0]["met"] is True
    pytest.importorskip("matplotlib")
    import matplotlib.image

    png = compare.plot_points(compare.summarize(ms), tmp_path / "p.png")
    assert png is not None
    height, width = matplotlib.image.imread(png).shape[:2]
    assert width > 2.5 * height  # one panel per model, side by side


def test_cnn_targets_are_issue_15():
    (t,) = compare.TARGETS
    assert (t.model, t.concurrency, t.reference) == ("cnn", (8, 32), "triton")
    assert (t.min_throughput, t.max_p99) == (0.95, 1.2)


def test_target_checks_and_table():
    ms = [
        _m("triton", "cnn", 8, 1000.0, p99=10000),
        _m("stageserve", "cnn", 8, 960.0, p99=11000),  # 0.96x, 1.10x: met
        _m("triton", "cnn", 32, 1000.0, p99=10000),
        _m("stageserve", "cnn", 32, 990.0, p99=12500),  # 0.99x, 1.25x: p99 missed
        _m("triton", "cnn", 1, 1000.0),  # not a target concurrency
        _m("stageserve", "cnn", 1, 10.0),
        _m("triton", "mlp", 8, 1000.0),  # no target for mlp
        _m("stageserve", "mlp", 8, 10.0),
        _m("mlserver", "cnn", 8, 10.0),  # not the target's reference
    ]
    checks = compare.target_checks(compare.ratios(compare.summarize(ms)))
    assert [(c.target.model, c.concurrency) for c in checks] == [("cnn", 8), ("cnn", 32)]
    c8, c32 = checks
    assert c8.throughput == pytest.approx(0.96) and c8.p99 == pytest.approx(1.1)
    assert (c8.throughput_met, c8.p99_met, c8.met) == (True, True, True)
    assert (c32.throughput_met, c32.p99_met, c32.met) == (True, False, False)
    lines = compare.format_targets(checks).splitlines()
    assert lines[0].split()[:3] == ["model", "conc", "target"]
    assert lines[2].split() == [
        "cnn", "8", "issue", "15,", "vs", "Triton", "0.96x", ">=", "0.95x", "1.10x", "<=",
        "1.20x", "yes",
    ]  # fmt: skip
    assert lines[3].split()[-1] == "NO"
    md = compare.format_targets(checks, markdown=True).splitlines()
    assert md[0] == "| model | conc | target | SS/ref infer/s | goal | SS/ref p99 | goal | met |"


def test_target_checks_without_a_figure_or_a_run():
    # Triton failed at c=32: the check is there, undecided; c=8 not run at all: no check
    ms = [_m("stageserve", "cnn", 32, 900.0), _m("triton", "mlp", 32, 1000.0)]
    (c,) = compare.target_checks(compare.ratios(compare.summarize(ms)))
    assert c.concurrency == 32 and c.throughput is None and c.met is None
    assert compare.format_targets([c]).splitlines()[-1].split()[-1] == "-"
    below = compare.TargetCheck(compare.TARGETS[0], 8, throughput=0.5, p99=None)
    assert below.met is False  # one ratio missing, the other already misses
    assert compare.target_checks([]) == []


def test_measure_point_passes_the_model_shapes(monkeypatch: pytest.MonkeyPatch):
    seen: dict[str, Any] = {}

    def fake_run_perf(url, model, concurrency, **kw):
        seen.update(kw, url=url, model=model, concurrency=concurrency)
        return type("R", (), {"throughput": 500.0, "p50_us": 1.0, "p99_us": 2.0, "stdout": ""})

    class Server:
        url = "127.0.0.1:1"

        def cpu_seconds(self) -> float:
            return 0.0

    monkeypatch.setattr(compare, "run_perf", fake_run_perf)
    monkeypatch.setattr(compare, "execution_counts", lambda url, model: None)
    args = argparse.Namespace(
        max_trials=5, stability_pct=30, unstable_retry_pct=1000, measurement_ms=2000
    )
    cnn = references.bench_model("cnn")
    rows = Path("/tmp/rows.json")
    m = compare.measure_point("stageserve", Server(), "cnn", 8, args, 0, cnn.input_shapes, rows)
    assert seen["shapes"] == {"INPUT": (3, 32, 32)} and seen["concurrency"] == 8
    assert seen["input_data"] == rows
    assert m.throughput == 500.0 and m.model == "cnn"


def test_format_points_marks_repeats_and_unstable():
    ms = [_m("triton", "mlp", 1, 90.0, stable=False), _m("triton", "mlp", 1, 110.0)]
    row = compare.format_points(compare.summarize(ms)).splitlines()[-1]
    assert "100 (90-110) *" in row


def test_format_ratios_text_and_markdown():
    text = compare.format_ratios(compare.ratios(_points()))
    header = text.splitlines()[0]
    assert "SS/Triton infer/s" in header and "SS/MLServer per-core" in header
    mlp_row = [ln for ln in text.splitlines() if ln.startswith("mlp")][0]
    assert mlp_row.split() == ["mlp", "8", "0.50x", "2.00x", "0.50x", "1.00x",
                               "2.00x", "0.50x", "0.25x", "4.00x"]  # fmt: skip
    md = compare.format_ratios(compare.ratios(_points()), markdown=True).splitlines()
    assert md[0].startswith("| model | conc | SS/Triton infer/s")
    assert md[1] == "|---|---|" + "|".join(["---:"] * 8) + "|"
    assert all(ln.startswith("| ") and ln.endswith(" |") for ln in md[2:])
    assert "| identity | 1 | 0.25x |" in "\n".join(md)


def test_points_csv_round_trip():
    rows = list(csv.DictReader(io.StringIO(compare.points_csv(_points()))))
    assert list(rows[0]) == list(compare.CSV_FIELDS)
    st = [r for r in rows if r["server"] == "stageserve" and r["model"] == "mlp"][0]
    assert float(st["infer_per_s"]) == 2000.0
    assert float(st["p99_us"]) == 2000.0
    assert float(st["cpu_us_per_infer"]) == pytest.approx(250.0)
    assert float(st["infer_per_s_per_core"]) == pytest.approx(4000.0)
    assert st["window_spread"] == "" and st["stable"] == "1"
    tri = [r for r in rows if r["server"] == "triton" and r["model"] == "identity"][0]
    assert tri["server_cores"] == "" and tri["cpu_us_per_infer"] == ""


def test_ratios_and_raw_csv():
    rows = list(csv.DictReader(io.StringIO(compare.ratios_csv(compare.ratios(_points())))))
    r = [x for x in rows if x["model"] == "mlp" and x["reference"] == "mlserver"][0]
    assert float(r["throughput"]) == 2.0 and float(r["per_core"]) == 4.0
    missing = [x for x in rows if x["model"] == "identity" and x["reference"] == "mlserver"][0]
    assert missing["throughput"] == ""
    raw = list(csv.DictReader(io.StringIO(compare.measurements_csv([_m("a", "mlp", 8, 1.5)]))))
    assert raw[0]["server"] == "a" and float(raw[0]["throughput"]) == 1.5


def test_write_results_without_plot(tmp_path: Path):
    ms = [_m("triton", "mlp", 8, 4000.0), _m("stageserve", "mlp", 8, 2000.0)]
    files = compare.write_results(tmp_path / "out", ms, {"k": "v"}, plot=False)
    assert set(files) == {"points", "ratios", "raw", "markdown", "meta"}
    assert all(p.is_file() for p in files.values())
    assert json.loads(files["meta"].read_text()) == {"k": "v"}
    assert "| mlp | 8 | StageServe |" in files["markdown"].read_text()


def test_plot_written_when_matplotlib_is_there(tmp_path: Path):
    pytest.importorskip("matplotlib")
    png = compare.plot_points(_points(), tmp_path / "p.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert compare.plot_points([], tmp_path / "none.png") is None  # nothing measured


def test_window_spread_from_verbose_output():
    out = "\n".join(
        f"  Pass [{i}] throughput: {v} infer/sec. Avg latency: 1 usec (std 1 usec). "
        for i, v in enumerate([10.0, 90.0, 100.0, 110.0], 1)
    )
    assert compare.window_spread(out) == pytest.approx(0.2)  # last three: (110-90)/100
    assert compare.window_spread("Pass [1] throughput: 5 infer/sec") is None


# --------------------------------------------------------------------------- repositories


def test_bench_models_are_the_example_models():
    assert references.MODELS == ("identity", "mlp", "cnn", "numpy")
    assert references.DEFAULT_MODELS == ("identity", "mlp", "cnn")
    ident, mlp, cnn = references.bench_models()
    assert ident.onnx == identity_model("FP32", (16,), 64).SerializeToString()
    assert mlp.onnx == mlp_model().SerializeToString()
    assert ident.inputs == (("INPUT0", "FP32", (16,)),)
    assert mlp.inputs == (("INPUT0", "FP32", (256,)),)
    assert mlp.outputs == (("OUTPUT0", "FP32", (10,)),)
    with pytest.raises(ValueError):
        references.bench_model("resnet")


def test_bench_cnn_is_bench_cnns_model():
    cnn = references.bench_model("cnn")
    side = references.CNN_IMAGE_SIZE
    assert side == 32
    assert cnn.onnx == cnn_model(side, references.CNN_WIDTH).SerializeToString()
    assert cnn.inputs == (("INPUT", "FP32", (3, side, side)),)
    assert cnn.outputs == (("OUTPUT", "FP32", (10,)),)
    assert cnn.input_shapes == {"INPUT": (3, side, side)}
    assert references.bench_model("mlp").input_shapes == {"INPUT0": (256,)}
    # same settings as the other bench models
    config = parse_config_text(references.stageserve_config_text(cnn))
    assert config.max_batch_size == 64 and config.HasField("dynamic_batching")
    assert config.dynamic_batching.max_queue_delay_microseconds == 0
    assert list(config.input[0].dims) == [3, side, side]


def test_triton_repository_is_python_backend(tmp_path: Path):
    models = references.bench_models()
    root = references.write_triton_repository(tmp_path / "tr", models, instances=2)
    for m in models:
        mdir = root / m.name
        config = parse_config_text((mdir / "config.pbtxt").read_text())
        assert config.name == m.name
        assert config.backend == "python" and config.platform == ""
        assert config.max_batch_size == 64
        assert config.HasField("dynamic_batching")
        assert [i.count for i in config.instance_group] == [2]
        assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
        assert [(t.name, list(t.dims)) for t in config.input] == [
            (n, list(d)) for n, _, d in m.inputs
        ]
        assert config.input[0].data_type == mc.TYPE_FP32
        assert [(t.name, list(t.dims)) for t in config.output] == [
            (n, list(d)) for n, _, d in m.outputs
        ]
        threads = config.parameters["intra_op_thread_count"].string_value
        assert int(threads) == max(1, (os.cpu_count() or 1) // 2)
        assert (mdir / "1" / "model.onnx").read_bytes() == m.onnx
        model_py = (mdir / "1" / "model.py").read_text()
        assert "class TritonPythonModel" in model_py and "session.run" in model_py


def test_stageserve_repository_loads_as_a_spec(tmp_path: Path):
    models = references.bench_models()
    root = references.write_stageserve_repository(tmp_path / "ss", models, instances=1)
    for m in models:
        config = parse_config_text((root / m.name / "config.pbtxt").read_text())
        assert config.platform == "onnxruntime_onnx"
        spec = to_spec(config)
        assert spec.max_batch_size == 64
        assert spec.dynamic_batching is not None
        assert (root / m.name / "1" / "model.onnx").read_bytes() == m.onnx


def test_triton_and_stageserve_configs_differ_only_in_backend():
    m = references.bench_model("mlp")
    tri = parse_config_text(references.triton_config_text(m, 1, intra_op_threads=3))
    ss = parse_config_text(references.stageserve_config_text(m, 1))
    assert tri.parameters["intra_op_thread_count"].string_value == "3"
    tri.ClearField("parameters")
    tri.ClearField("backend")
    ss.ClearField("platform")
    assert tri == ss


def test_mlserver_repository(tmp_path: Path):
    models = references.bench_models()
    root = references.write_mlserver_repository(
        tmp_path / "ml",
        models,
        grpc_port=1234,
        http_port=1235,
        metrics_port=1236,
        parallel_workers=0,
        max_batch_time_s=0.002,
    )
    settings = json.loads((root / "settings.json").read_text())
    assert settings["grpc_port"] == 1234 and settings["http_port"] == 1235
    assert settings["parallel_workers"] == 0
    assert settings["debug"] is False and settings["metrics_endpoint"] is None
    runtime = root / f"{references.MLSERVER_RUNTIME_MODULE}.py"
    assert "class OnnxRuntimeModel(MLModel)" in runtime.read_text()
    configs = json.loads((root / "model_configs.json").read_text())
    for m in models:
        ms = json.loads((root / m.name / "model-settings.json").read_text())
        assert ms["name"] == m.name
        assert ms["implementation"] == "stageserve_bench_runtime.OnnxRuntimeModel"
        assert ms["max_batch_size"] == 64 and ms["max_batch_time"] == 0.002
        assert ms["inputs"] == [
            {"name": m.inputs[0][0], "datatype": "FP32", "shape": [-1, *m.inputs[0][2]]}
        ]
        assert ms["outputs"] == [
            {"name": m.outputs[0][0], "datatype": "FP32", "shape": [-1, *m.outputs[0][2]]}
        ]
        assert ms["parameters"]["uri"] == "./model.onnx"
        assert (root / m.name / "model.onnx").read_bytes() == m.onnx
        response = gs.ModelConfigResponse.FromString(bytes.fromhex(configs[m.name]))
        assert response.config.name == m.name
        assert response.config.max_batch_size == 64
        assert list(response.config.input[0].dims) == list(m.inputs[0][2])


def test_mlserver_boot_decodes_model_config_request():
    for req in (
        gs.ModelConfigRequest(name="mlp"),
        gs.ModelConfigRequest(name="identity", version="1"),
        gs.ModelConfigRequest(version="7", name="x" * 300),  # multi-byte length varint
        gs.ModelConfigRequest(),
    ):
        assert mlserver_boot.request_model_name(req.SerializeToString()) == req.name


def test_expected_outputs():
    ident, mlp, cnn = references.bench_models()
    x = references.consistency_input(ident)
    assert x.shape == (4, 16) and x.dtype == np.float32
    assert references.expected_output(ident, x) is x
    y = references.expected_output(mlp, references.consistency_input(mlp))
    assert y.shape == (4, 10)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-5)
    x = references.consistency_input(cnn)
    assert x.shape == (4, 3, 32, 32) and x.dtype == np.float32
    y = references.expected_output(cnn, x)
    assert y.shape == (4, 10) and y.dtype == np.float64


def test_cnn_reference_agrees_with_onnxruntime_within_the_tolerance():
    """What every server runs (ONNX Runtime, float32) against the float64 numpy
    reference: well inside the tolerance, and a wrong answer is well outside."""
    ort = pytest.importorskip("onnxruntime")
    cnn = references.bench_model("cnn")
    x = references.consistency_input(cnn)
    want = references.expected_output(cnn, x)
    tol = references.tolerance(cnn, want)
    assert tol == pytest.approx(1e-4 * np.abs(want).max())
    session = ort.InferenceSession(cnn.onnx, providers=["CPUExecutionProvider"])
    got = session.run(["OUTPUT"], {"INPUT": x})[0]
    assert got.dtype == np.float32
    assert np.abs(got - want).max() < tol / 10
    # one image's answer in another's place, or another seed's weights, fail
    assert np.abs(got[[1, 0, 2, 3]] - want).max() > 100 * tol
    other = ort.InferenceSession(
        cnn_model(32, 32, seed=8).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    assert np.abs(other.run(["OUTPUT"], {"INPUT": x})[0] - want).max() > 100 * tol
    assert references.tolerance(references.bench_model("mlp"), want) == 1e-5


# --------------------------------------------------------------------------- installs


def test_find_reference_installs_report_missing(tmp_path: Path):
    with pytest.raises(references.ReferenceNotInstalled, match="install_references"):
        references.find_triton(tmp_path / "nope")
    with pytest.raises(references.ReferenceNotInstalled):
        references.find_mlserver_python(tmp_path / "nope")


def test_triton_install_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    dist = site / "pytriton" / "tritonserver"
    for rel in (
        "bin/tritonserver",
        "backends/python/libtriton_python.so",
        "backends/python/triton_python_backend_utils.py",
        "python_backend_stubs/3.11/triton_python_backend_stub",
    ):
        (dist / rel).parent.mkdir(parents=True, exist_ok=True)
        (dist / rel).write_text("")
    install = references.find_triton(tmp_path / "venv")
    assert install.stub == dist / "python_backend_stubs/3.11/triton_python_backend_stub"
    backends = install.make_backend_dir(tmp_path / "backends")
    assert sorted(p.name for p in (backends / "python").iterdir()) == [
        "libtriton_python.so",
        "triton_python_backend_stub",
        "triton_python_backend_utils.py",
    ]
    assert (backends / "python" / "triton_python_backend_stub").resolve() == install.stub
    install.make_backend_dir(tmp_path / "backends")  # idempotent
    monkeypatch.setenv("PYTHONHOME", "/somewhere")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/old")
    env = install.env()
    assert "PYTHONHOME" not in env
    assert env["LD_LIBRARY_PATH"] == f"{site / 'nvidia_pytriton.libs'}:/old"
    assert env["PATH"].startswith(f"{tmp_path / 'venv' / 'bin'}:")


def test_numpy_model_runs_its_forward_pass_in_numpy_with_the_onnx_twins_weights(tmp_path: Path):
    """Issue 10's benchmark model: Python-backend servers get bench/numpy_model.py
    plus weights.npz, ONNX servers the same network as ONNX; all answer alike."""
    import onnxruntime as ort

    from services.worker.python_backend import pb_utils
    from services.worker.python_backend.loader import import_model_file

    (model,) = references.bench_models(["numpy"])
    assert model.inputs == (("INPUT0", "FP32", (references.NUMPY_SIZES[0],)),)
    assert model.outputs == (("OUTPUT0", "FP32", (references.NUMPY_SIZES[-1],)),)
    root = references.write_triton_repository(tmp_path / "tr", [model])
    version_dir = root / "numpy" / "1"
    assert (version_dir / "model.py").read_text() == (
        references.BENCH_DIR / "numpy_model.py"
    ).read_text()
    instance = import_model_file(version_dir / "model.py").TritonPythonModel()
    instance.initialize({"model_repository": str(root / "numpy"), "model_version": "1"})
    x = references.consistency_input(model, batch=5)
    requests = [  # a dynamic batch of two requests (3 + 2 rows)
        pb_utils.InferenceRequest(
            inputs=[pb_utils.Tensor("INPUT0", part)],
            model_name="numpy",
            requested_output_names=["OUTPUT0"],
        )
        for part in (x[:3], x[3:])
    ]
    responses = instance.execute(requests)
    outputs = []
    for r in responses:
        out = pb_utils.get_output_tensor_by_name(r, "OUTPUT0")
        assert out is not None
        outputs.append(out.as_numpy())
    got = np.concatenate(outputs)
    want = references.expected_output(model, x)
    assert got.shape == want.shape == (5, references.NUMPY_SIZES[-1])
    assert np.max(np.abs(got - want)) <= references.tolerance(model, want)
    onnx_out = ort.InferenceSession(model.onnx).run(None, {"INPUT0": x})[0]
    assert np.max(np.abs(onnx_out - want)) <= references.tolerance(model, want)


def test_perf_input_rows_are_finite_fixed_and_shaped(tmp_path: Path):
    """perf_analyzer's random bytes include NaN and inf as FP32 (which made the
    cnn answer NaN everywhere and MLServer fail); the benchmark sends these
    rows instead, the same to every server."""
    cnn = references.bench_model("cnn")
    path = cnn.write_input_data(tmp_path / "cnn.json")
    (row,) = json.loads(path.read_text())["data"]
    assert list(row) == ["INPUT"] and row["INPUT"]["shape"] == [3, 32, 32]
    sent = np.array(row["INPUT"]["content"], dtype=np.float32).reshape(3, 32, 32)
    assert np.isfinite(sent).all() and 0.5 < sent.std() < 2.0
    assert np.array_equal(sent, cnn.input_rows()["INPUT"])  # exact through JSON
    assert np.array_equal(cnn.input_rows()["INPUT"], cnn.input_rows()["INPUT"])
    assert not np.array_equal(cnn.input_rows(seed=1)["INPUT"], sent)
