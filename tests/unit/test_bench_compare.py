"""Pure parts of bench.compare / bench.references: no server, no perf_analyzer."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest

from bench import compare, mlserver_boot, references
from bench.compare import Measurement, Point
from stageserve.config import parse_config_text, to_spec
from stageserve.examples import identity_model, mlp_model
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import model_config_pb2 as mc

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
    ident, mlp = references.bench_models()
    assert ident.onnx == identity_model("FP32", (16,), 64).SerializeToString()
    assert mlp.onnx == mlp_model().SerializeToString()
    assert ident.inputs == (("INPUT0", "FP32", (16,)),)
    assert mlp.inputs == (("INPUT0", "FP32", (256,)),)
    assert mlp.outputs == (("OUTPUT0", "FP32", (10,)),)
    with pytest.raises(ValueError):
        references.bench_model("resnet")


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
        assert config.output[0].name == "OUTPUT0"
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
            {"name": "INPUT0", "datatype": "FP32", "shape": [-1, *m.inputs[0][2]]}
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
    ident, mlp = references.bench_models()
    x = references.consistency_input(ident)
    assert x.shape == (4, 16) and x.dtype == np.float32
    assert references.expected_output(ident, x) is x
    y = references.expected_output(mlp, references.consistency_input(mlp))
    assert y.shape == (4, 10)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-5)


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
