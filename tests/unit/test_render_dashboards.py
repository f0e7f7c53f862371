"""deploy/render_dashboards.py: layout, Grafana variables, query extraction and
the numbers it prints, on the real dashboards; plus one drawing with a fake
Prometheus (no server, no network)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from tests.script_modules import load_script

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))


rd = load_script("stageserve_render_dashboards", "deploy/render_dashboards.py")


def _dash(name: str) -> dict:
    return json.loads((ROOT / "deploy" / "grafana" / "dashboards" / name).read_text())


RNG = rd.TimeRange(start=1000.0, end=1120.0, step=1.0, scrape_interval=1.0)


# --------------------------------------------------------------------------- layout


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panels_map_inside_the_figure_without_overlap(path):
    dash = json.loads(path.read_text())
    w, h = rd.figure_size(dash)
    rects = [rd.panel_rect(p["gridPos"], w, h) for p in rd.iter_panels(dash)]
    assert len(rects) == len(dash["panels"])  # no collapsed rows in ours
    for left, bottom, width, height in rects:
        assert left >= 0 and bottom >= 0
        assert left + width <= 1 and bottom + height <= 1
        assert width > 0 and height > 0
    for a, b in itertools.combinations(rects, 2):
        apart_x = a[0] + a[2] <= b[0] or b[0] + b[2] <= a[0]
        apart_y = a[1] + a[3] <= b[1] or b[1] + b[3] <= a[1]
        assert apart_x or apart_y, (a, b)


def test_panel_rect_follows_the_24_column_grid():
    w, h = 24 * 0.75 + 2 * rd.MARGIN_IN, 10.0
    half = rd.panel_rect({"x": 12, "y": 0, "w": 12, "h": 8}, w, h, gap_in=0)
    full = rd.panel_rect({"x": 0, "y": 8, "w": 24, "h": 1}, w, h, gap_in=0)
    assert half[0] == pytest.approx((rd.MARGIN_IN + 9.0) / w)
    assert half[2] == pytest.approx(9.0 / w)
    assert full[2] == pytest.approx(18.0 / w)
    # y grows downwards in Grafana: the row at y=8 sits right under the panel.
    assert full[1] + full[3] == pytest.approx(half[1])
    assert half[3] == pytest.approx(8 * rd.UNIT_H_IN / h)


def test_collapsed_rows_contribute_their_panels():
    inner = {"type": "timeseries", "gridPos": {"x": 0, "y": 5, "w": 24, "h": 8}}
    dash = {"panels": [{"type": "row", "gridPos": {"x": 0, "y": 4, "w": 24, "h": 1},
                        "collapsed": True, "panels": [inner]}]}  # fmt: skip
    assert rd.iter_panels(dash) == [dash["panels"][0], inner]
    assert rd.grid_height(rd.iter_panels(dash)) == 13


def test_output_names():
    assert rd.output_name(_dash("stageserve-triton.json")) == "dashboard-models.png"
    assert rd.output_name(_dash("stageserve-stages.json")) == "dashboard-stages.png"


def test_table_blocks():
    assert rd.table_blocks(21, 11, 5) == [range(0, 11), range(11, 21)]
    assert rd.table_blocks(21, 5, 4) == [range(0, 5), range(5, 10), range(10, 15), range(15, 20)]
    assert rd.table_blocks(3, 10, 4) == [range(0, 3)]
    assert rd.table_blocks(0, 5, 3) == []


# --------------------------------------------------------------------------- variables and queries


def test_grafana_intervals():
    assert rd.rate_interval(step_s=1, scrape_s=15) == 60  # 4 x scrape
    assert rd.rate_interval(step_s=60, scrape_s=15) == 75  # step + scrape
    assert rd.prom_duration(4.0) == "4s" and rd.prom_duration(0.25) == "250ms"
    assert rd.parse_duration("15s") == 15 and rd.parse_duration("2m") == 120
    assert rd.parse_duration("1.5") == 1.5
    assert rd.pick_step(0, 120) == 1 and rd.pick_step(0, 3600) == 9
    assert rd.parse_time("-15m", now=1000.0) == 100.0 and rd.parse_time("now", 5.0) == 5.0
    values = rd.builtin_values(RNG)
    assert values["__rate_interval"] == "4s" and values["__range"] == "120s"


def test_variable_values():
    dash = _dash("stageserve-stages.json")
    assert rd.variable_values(dash)["model"] == ".*"  # All -> allValue
    var = {"name": "model", "includeAll": True, "current": {"value": ["simple", "mlp.v2"]}}
    picked = rd.variable_values({"templating": {"list": [var]}})
    assert picked == {"model": r"(simple|mlp\.v2)"}
    one = {"name": "job", "current": {"value": "worker"}}
    assert rd.variable_values({"templating": {"list": [one]}}) == {"job": "worker"}


def test_interpolate_forms_and_unknown_variables():
    values = {"model": ".*", "__rate_interval": "4s", "__interval_ms": "1000"}
    expr = 'rate(x{model=~"$model"}[$__rate_interval]) + y{m="${model}"} + [[model]] $__interval_ms'
    assert rd.interpolate(expr, values) == 'rate(x{model=~".*"}[4s]) + y{m=".*"} + .* 1000'
    with pytest.raises(KeyError, match="nope"):
        rd.interpolate("rate(x[$nope])", values)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_yields_plain_promql(path):
    dash = json.loads(path.read_text())
    values = {**rd.variable_values(dash), **rd.builtin_values(RNG)}
    for panel in rd.iter_panels(dash):
        queries = rd.panel_queries(panel, values)
        if panel["type"] == "row":
            assert queries == []
            continue
        assert len(queries) == len(panel["targets"]) >= 1, panel["title"]
        for q in queries:
            assert "$" not in q.expr and "[[" not in q.expr, q.expr
            assert q.ref


def test_query_extraction_details():
    dash = _dash("stageserve-triton.json")
    values = {**rd.variable_values(dash), **rd.builtin_values(RNG)}
    panels = {p.get("title"): p for p in rd.iter_panels(dash)}
    (q,) = rd.panel_queries(panels["Throughput (inferences/s)"], values)
    assert q.expr == 'sum by (model) (rate(nv_inference_count{model=~".*"}[4s]))'
    assert (q.ref, q.legend, q.instant, q.heatmap) == ("A", "{{model}}", False, False)
    (table,) = rd.panel_queries(panels["Model load time"], values)
    assert table.instant  # instant: true, range: false -> /api/v1/query at the end
    phases = rd.panel_queries(panels["Avg compute time by phase"], values)
    assert [p.ref for p in phases] == ["A", "B", "C"]
    stages = {p.get("title"): p for p in rd.iter_panels(_dash("stageserve-stages.json"))}
    (heat,) = rd.panel_queries(stages["Batch size distribution"], values)
    assert heat.heatmap and not heat.instant
    hidden = {"targets": [{"expr": "up", "refId": "A", "hide": True}, {"expr": "up", "refId": "B"}]}
    assert [q.ref for q in rd.panel_queries(hidden, {})] == ["B"]


def test_legend_label():
    metric = {"__name__": "x", "model": "mlp", "reason": "OTHER"}
    assert rd.legend_label("{{model}} {{reason}}", metric) == "mlp OTHER"
    assert rd.legend_label("{{ model }} {{missing}}", metric) == "mlp"
    assert rd.legend_label("", metric) == 'x{model="mlp", reason="OTHER"}'
    assert rd.legend_label("", {"job": "worker"}) == '{job="worker"}'


# --------------------------------------------------------------------------- numbers


def test_format_value_scales_units():
    assert rd.format_value(0.0042, "s") == "4.2 ms"
    assert rd.format_value(0.00005, "s") == "50 µs"
    assert rd.format_value(1500, "µs") == "1.5 ms"
    assert rd.format_value(3 * 2**30, "bytes") == "3 GiB"
    assert rd.format_value(0.995, "percentunit") == "99.5%"
    assert rd.format_value(1234, "ops") == "1.23k ops/s"
    assert rd.format_value(7, "reqps") == "7 req/s"
    assert rd.format_value(math.nan, "s") == "–"


def test_reducers_skip_missing_points():
    values = [1.0, math.nan, 3.0, math.nan]
    assert rd.reduce_values(values, "lastNotNull") == 3.0
    assert rd.reduce_values(values, "mean") == 2.0
    assert rd.reduce_values(values, "max") == 3.0
    assert math.isnan(rd.reduce_values([math.nan], "mean"))
    assert not rd.has_numbers(rd.Series("a", {}, [1, 2], [math.nan, math.inf]))


def test_thresholds_pick_the_highest_step_reached():
    steps = {"steps": [{"color": "red", "value": None}, {"color": "green", "value": 0.999}]}
    assert rd.threshold_color(0.5, steps) == rd.NAMED_COLORS["red"]
    assert rd.threshold_color(1.0, steps) == rd.NAMED_COLORS["green"]
    assert rd.threshold_color(1.0, None) == rd.NAMED_COLORS["green"]


def test_bucket_bars_decumulate_and_trim():
    def bucket(le: str, rate: float):
        return rd.Series(le, {"le": le}, [0, 1], [rate, rate])

    series = [bucket("+Inf", 10), bucket("4.0", 10), bucket("1.0", 0), bucket("2.0", 6)]
    assert rd.bucket_bars(series) == [("≤2", 6.0), ("≤4", 4.0)]


# --------------------------------------------------------------------------- drawing


class FakePrometheus:
    """Answers every query with one ramp per series label set it is asked for."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def evaluate(self, q, rng):
        self.asked.append(q.expr)
        if "nv_gpu_" in q.expr:
            return []  # like a machine without a GPU
        times = [rng.start + i * rng.step for i in range(int((rng.end - rng.start) / rng.step))]
        if q.heatmap:
            return [rd.Series(le, {"le": le}, times, [float(i + 1)] * len(times))
                    for i, le in enumerate(("1.0", "2.0", "4.0", "+Inf"))]  # fmt: skip
        values = [float(i % 17) for i in range(len(times))]
        metric = {"model": "simple", "version": "1"}
        return [rd.Series(rd.legend_label(q.legend, metric), metric, times, values)]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_render_dashboard_writes_a_small_png(tmp_path, path):
    dash = json.loads(path.read_text())
    prom = FakePrometheus()
    out = rd.render_dashboard(dash, prom, RNG, tmp_path / rd.output_name(dash), dpi=50)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    n_targets = sum(len(p.get("targets", [])) for p in rd.iter_panels(dash))
    assert len(prom.asked) == n_targets


def test_load_phases_match_perf_analyzers_concurrency_range():
    load = load_script("stageserve_deploy_load", "deploy/load.py")
    for model in load.CONCURRENCY:
        args = load.perf_analyzer_args("127.0.0.1:8001", model, phase_s=20)
        first, last, step = map(int, args[args.index("--concurrency-range") + 1].split(":"))
        levels = list(range(first, last + 1, step))
        assert levels == [load.concurrency(model, p) for p in range(load.PHASES)]
        # -s 100 -r 3: three windows per level, so a level lasts one phase.
        assert args[args.index("-p") + 1] == "6666" and args[-4:] == ["-s", "100", "-r", "3"]
