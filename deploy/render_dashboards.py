#!/usr/bin/env python3
"""Draw Grafana dashboards as PNGs from their own queries, evaluated by Prometheus.

    python deploy/render_dashboards.py --prometheus http://127.0.0.1:9090 \\
        --start -15m [--end now] [--scrape-interval 15s] [--out docs/images] [FILE.json ...]

This is not Grafana: no Grafana server is needed or used. For every panel of
each dashboard JSON (default: deploy/grafana/dashboards/*.json) it

- substitutes Grafana's variables the way Grafana would with the defaults
  selected (a multi-value variable set to *All* becomes its ``allValue``;
  ``$__rate_interval`` is max(4 x scrape interval, step + scrape interval),
  ``$__interval`` the step, ``$__range`` the range),
- evaluates each visible target through Prometheus' HTTP API
  (``/api/v1/query_range`` over the range; ``/api/v1/query`` at its end for
  instant targets),
- draws it with matplotlib at the panel's ``gridPos`` on a 24-column grid:
  timeseries as lines (stacked when the panel stacks), stat and gauge panels
  as the reduced number over a sparkline, bar gauges and heatmaps as bars,
  tables as tables, rows as headers; titles, legend formats, legend
  calculations, units and stat thresholds come from the JSON. Unlike
  Grafana, series without a single number (0/0 rates of idle models) are
  left out, and a table too long for its panel is split into side-by-side
  blocks instead of scrolling.

One PNG per dashboard, ``dashboard-<name>.png`` where <name> is the first word
after the last " / " of the title ("StageServe / Stages" -> dashboard-stages.png).
deploy/smoke.py --render DIR (scripts/validate_deploy.sh --render DIR) runs it
on a live stack under load. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DASHBOARD_DIR = HERE / "grafana" / "dashboards"

GRID_COLUMNS = 24
MAX_POINTS = 400  # per series; Grafana aims at about one point per pixel, we need fewer

# Figure geometry, in inches. Grafana's grid unit is 30 px tall (+ margin) for
# a column of about 80 px; a slightly taller unit leaves room for legends.
FIG_WIDTH_IN = 18.0
UNIT_H_IN = 0.42
HEADER_IN = 0.75
GAP_IN = 0.08
MARGIN_IN = 0.15

# Grafana's classic palette, so series colours look familiar.
PALETTE = (
    "#7EB26D", "#EAB839", "#6ED0E0", "#EF843C", "#E24D42", "#1F78C1", "#BA43A9",
    "#705DA0", "#508642", "#CCA300", "#447EBC", "#C15C17", "#890F02", "#0A437C",
)  # fmt: skip
NAMED_COLORS = {
    "green": "#73BF69",
    "orange": "#FF9830",
    "red": "#F2495C",
    "yellow": "#FADE2A",
    "blue": "#5794F2",
    "purple": "#B877D9",
    "text": "#333333",
}


# --------------------------------------------------------------------------- dashboard model


@dataclass(frozen=True)
class Query:
    """One panel target, ready for Prometheus."""

    ref: str
    expr: str
    legend: str
    instant: bool = False
    heatmap: bool = False


@dataclass
class Series:
    label: str
    metric: dict[str, str]
    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class TimeRange:
    start: float
    end: float
    step: float
    scrape_interval: float


def iter_panels(dash: dict) -> list[dict]:
    """Every panel in layout order, rows included; collapsed rows' panels after their row."""
    out: list[dict] = []
    for panel in dash.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []) if panel.get("type") == "row" else [])
    return out


def grid_height(panels: Iterable[dict]) -> int:
    """Grid units from the top of the dashboard to the bottom of its lowest panel."""
    return max((p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels), default=0)


def panel_rect(
    pos: dict,
    fig_w_in: float,
    fig_h_in: float,
    top_in: float = HEADER_IN,
    unit_h_in: float = UNIT_H_IN,
    gap_in: float = GAP_IN,
    margin_in: float = MARGIN_IN,
) -> tuple[float, float, float, float]:
    """A gridPos as matplotlib's (left, bottom, width, height) in figure fractions."""
    col_w = (fig_w_in - 2 * margin_in) / GRID_COLUMNS
    left = margin_in + pos["x"] * col_w + gap_in / 2
    width = pos["w"] * col_w - gap_in
    top = top_in + pos["y"] * unit_h_in + gap_in / 2
    height = pos["h"] * unit_h_in - gap_in
    bottom = fig_h_in - top - height
    return (left / fig_w_in, bottom / fig_h_in, width / fig_w_in, height / fig_h_in)


def figure_size(dash: dict, width_in: float = FIG_WIDTH_IN) -> tuple[float, float]:
    return width_in, HEADER_IN + grid_height(iter_panels(dash)) * UNIT_H_IN + MARGIN_IN


def output_name(dash: dict) -> str:
    """dashboard-<first word after the last ' / ' of the title>.png, lower case."""
    tail = dash.get("title", "dashboard").split(" / ")[-1]
    word = re.sub(r"[^a-z0-9]+", "-", tail.lower()).strip("-").split("-")[0]
    return f"dashboard-{word or dash.get('uid', 'dashboard')}.png"


# --------------------------------------------------------------------------- variables, queries

_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)?$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
_VAR_RE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def parse_duration(text: str) -> float:
    """'15s', '1m', '250ms', '2h' or plain seconds -> seconds."""
    m = _DURATION_RE.match(text.strip())
    if not m:
        raise ValueError(f"not a duration: {text!r}")
    return float(m[1]) * _UNIT_S[m[2]]


def prom_duration(seconds: float) -> str:
    """Seconds as a PromQL duration (whole milliseconds)."""
    ms = max(1, round(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def rate_interval(step_s: float, scrape_s: float) -> float:
    """Grafana's $__rate_interval: max(4 x scrape interval, interval + scrape interval)."""
    return max(4 * scrape_s, step_s + scrape_s)


def pick_step(start: float, end: float, max_points: int = MAX_POINTS) -> float:
    """A whole-second step giving at most max_points points over [start, end]."""
    return float(max(1, math.ceil((end - start) / max_points)))


def builtin_values(rng: TimeRange) -> dict[str, str]:
    span = rng.end - rng.start
    return {
        "__rate_interval": prom_duration(rate_interval(rng.step, rng.scrape_interval)),
        "__interval": prom_duration(rng.step),
        "__interval_ms": str(round(rng.step * 1000)),
        "__range": prom_duration(span),
        "__range_s": str(round(span)),
        "__range_ms": str(round(span * 1000)),
    }


def variable_values(dash: dict) -> dict[str, str]:
    """Each template variable's value as Grafana interpolates it with the defaults."""
    values: dict[str, str] = {}
    for var in dash.get("templating", {}).get("list", []):
        current = (var.get("current") or {}).get("value")
        picked = current if isinstance(current, list) else [current] if current else []
        if var.get("includeAll") and (not picked or "$__all" in picked):
            values[var["name"]] = var.get("allValue") or ".*"
        elif len(picked) > 1:
            values[var["name"]] = "(" + "|".join(re.escape(str(v)) for v in picked) + ")"
        else:
            values[var["name"]] = str(picked[0]) if picked else ""
    return values


def interpolate(expr: str, values: dict[str, str]) -> str:
    """Replace $var, ${var} and [[var]]; an unknown variable is an error."""

    def repl(m: re.Match) -> str:
        name = m[1] or m[2] or m[3]
        if name not in values:
            raise KeyError(f"undefined variable ${name} in {expr!r}")
        return values[name]

    return _VAR_RE.sub(repl, expr)


def panel_queries(panel: dict, values: dict[str, str]) -> list[Query]:
    """The panel's visible targets with variables substituted."""
    return [
        Query(
            ref=str(t.get("refId", "")),
            expr=interpolate(t["expr"], values),
            legend=t.get("legendFormat", "") or "",
            instant=bool(t.get("instant")) and not t.get("range", False),
            heatmap=t.get("format") == "heatmap",
        )
        for t in panel.get("targets", [])
        if t.get("expr") and not t.get("hide")
    ]


def legend_label(fmt: str, metric: dict[str, str]) -> str:
    """Grafana's legendFormat: {{label}} from the series; empty format -> name{labels}."""
    if fmt and fmt != "__auto":
        text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m[1], ""), fmt)
        return " ".join(text.split())
    name = metric.get("__name__", "")
    labels = ", ".join(f'{k}="{v}"' for k, v in sorted(metric.items()) if k != "__name__")
    return f"{name}{{{labels}}}" if labels or not name else name


# --------------------------------------------------------------------------- numbers and units

_REDUCERS = {
    "lastNotNull": lambda v: v[-1] if v else math.nan,
    "last": lambda v: v[-1] if v else math.nan,
    "firstNotNull": lambda v: v[0] if v else math.nan,
    "first": lambda v: v[0] if v else math.nan,
    "mean": lambda v: sum(v) / len(v) if v else math.nan,
    "max": lambda v: max(v) if v else math.nan,
    "min": lambda v: min(v) if v else math.nan,
    "sum": lambda v: sum(v) if v else math.nan,
}
CALC_NAMES = {"lastNotNull": "last", "firstNotNull": "first"}


def reduce_values(values: Sequence[float], calc: str) -> float:
    """Grafana's reducer over the non-null (finite) points of a series."""
    finite = [v for v in values if not math.isnan(v) and not math.isinf(v)]
    return _REDUCERS.get(calc, _REDUCERS["lastNotNull"])(finite)


def _si(v: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.3g}{suffix}"
    return f"{v:.3g}"


def format_value(v: float, unit: str) -> str:
    """A number as Grafana would print it for the common units, auto-scaled."""
    if v is None or math.isnan(v):
        return "–"
    if unit in ("s", "µs", "ms"):
        seconds = v * {"s": 1.0, "ms": 1e-3, "µs": 1e-6}[unit]
        a = abs(seconds)
        if a == 0:
            return f"0 {unit}"
        if a < 1e-3:
            return f"{seconds * 1e6:.3g} µs"
        return f"{seconds * 1e3:.3g} ms" if a < 1 else f"{seconds:.3g} s"
    if unit == "bytes":
        for div, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(v) >= div:
                return f"{v / div:.3g} {suffix}"
        return f"{v:.3g} B"
    if unit == "percentunit":
        return f"{v * 100:.3g}%"
    suffix = {"ops": " ops/s", "reqps": " req/s", "watt": " W"}.get(unit, "")
    return _si(v) + suffix


def threshold_color(value: float, thresholds: dict | None) -> str:
    """Colour of the highest absolute threshold step the value reaches."""
    steps = (thresholds or {}).get("steps") or [{"color": "green", "value": None}]
    color = steps[0].get("color", "green")
    for s in steps[1:]:
        if s.get("value") is not None and not math.isnan(value) and value >= s["value"]:
            color = s.get("color", color)
    return NAMED_COLORS.get(color, color)


def _bound(s: Series) -> float:
    le = s.metric.get("le", "+Inf")
    return math.inf if le in ("+Inf", "Inf") else float(le)


def bucket_bars(series: Sequence[Series]) -> list[tuple[str, float]]:
    """Cumulative `le` bucket series -> ("≤bound", mean rate in that bucket alone)."""
    ordered = sorted(series, key=_bound)
    cumulative = [reduce_values(s.values, "mean") for s in ordered]
    cumulative = [0.0 if math.isnan(c) else c for c in cumulative]
    bars = [
        (
            "+Inf" if math.isinf(_bound(s)) else f"≤{_bound(s):g}",
            max(0.0, c - (cumulative[i - 1] if i else 0.0)),
        )
        for i, (s, c) in enumerate(zip(ordered, cumulative, strict=True))
    ]
    # Trim empty buckets at both ends: the interesting part is where batches fall.
    nonzero = [i for i, (_, v) in enumerate(bars) if v > 0]
    return bars[nonzero[0] : nonzero[-1] + 1] if nonzero else bars


# --------------------------------------------------------------------------- Prometheus


class Prometheus:
    """The two HTTP API calls the renderer needs."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/") if "://" in url else f"http://{url.rstrip('/')}"
        self.timeout_s = timeout_s

    def _get(self, path: str, params: dict[str, str]) -> dict:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # Prometheus explains bad queries in the body
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise RuntimeError(body.get("error") or body)
        return body["data"]

    def evaluate(self, q: Query, rng: TimeRange) -> list[Series]:
        if q.instant:
            data = self._get("/api/v1/query", {"query": q.expr, "time": str(rng.end)})
            points = lambda r: [r["value"]]  # noqa: E731
        else:
            params = {"query": q.expr, "start": str(rng.start), "end": str(rng.end)}
            data = self._get("/api/v1/query_range", {**params, "step": str(rng.step)})
            points = lambda r: r["values"]  # noqa: E731
        return [
            Series(
                label=legend_label(q.legend, r["metric"]),
                metric=r["metric"],
                times=[float(t) for t, _ in points(r)],
                values=[float(v) for _, v in points(r)],
            )
            for r in data["result"]
        ]


@dataclass
class PanelData:
    series: list[Series] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def has_numbers(s: Series) -> bool:
    """Whether a series has a finite point; 0/0 rates of idle models are NaN throughout."""
    return any(math.isfinite(v) for v in s.values)


def fetch_panel(prom: Prometheus, queries: Sequence[Query], rng: TimeRange) -> PanelData:
    """Every query's series, less those without a single number (they would only fill
    the legend with dashes: e.g. each of the 21 example models in a per-model ratio)."""
    data = PanelData()
    for q in queries:
        try:
            data.series += [s for s in prom.evaluate(q, rng) if has_numbers(s)]
        except Exception as exc:  # noqa: BLE001 - shown in the panel, like Grafana does
            data.errors.append(f"{q.ref}: {exc}")
    return data


# --------------------------------------------------------------------------- drawing

TITLE_IN = 0.26  # panel title strip
LEGEND_LINE_IN = 0.17
TABLE_ROW_IN = 0.17
TABLE_BLOCK_MIN_IN = 3.5
INK, DIM, FAINT = "#222222", "#555555", "#999999"

Rect = tuple[float, float, float, float]  # left, bottom, width, height in figure fractions


class Canvas:
    """A figure addressed in figure fractions, with offsets and sizes in inches."""

    def __init__(self, fig) -> None:
        self.fig = fig
        self.w, self.h = fig.get_size_inches()

    def text(self, x: float, y: float, s: str, size: float = 7, color: str = DIM, **kw) -> None:
        self.fig.text(x, y, s, fontsize=size, color=color, va=kw.pop("va", "center"), **kw)

    def inset(self, r: Rect, left: float, bottom: float, right: float, top: float) -> Rect:
        return (
            r[0] + left / self.w,
            r[1] + bottom / self.h,
            r[2] - (left + right) / self.w,
            r[3] - (bottom + top) / self.h,
        )

    def axes(self, r: Rect, unit: str | None = None):
        ax = self.fig.add_axes(r)
        if unit is not None:
            _style_axes(ax, unit)
        return ax

    def no_data(self, r: Rect, data: PanelData) -> None:
        text = "query error" if data.errors else "No data"
        self.text(r[0] + r[2] / 2, r[1] + r[3] / 2, text, size=10, color=FAINT, ha="center")

    def note(self, r: Rect, text: str, color: str = FAINT) -> None:
        """Small text in the bottom-left corner of a panel."""
        self.text(r[0] + 0.06 / self.w, r[1] + 0.07 / self.h, text, color=color)


def _style_axes(ax, unit: str) -> None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_value(v, unit)))
    ax.yaxis.set_major_locator(MaxNLocator(4))
    ax.tick_params(labelsize=7.5, length=2, colors=DIM)
    ax.grid(True, color="#e5e5e5", linewidth=0.6)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_color("#bbbbbb")


def _panel_frame(c: Canvas, r: Rect, title: str) -> Rect:
    """White panel with a border and its title; returns the area under the title."""
    from matplotlib.patches import Rectangle

    frame = Rectangle(r[:2], r[2], r[3], transform=c.fig.transFigure, facecolor="white",
                      edgecolor="#d8d8d8", linewidth=0.8, zorder=-1)  # fmt: skip
    c.fig.patches.append(frame)  # zorder -1: under the panel's axes
    title_h = TITLE_IN / c.h
    c.text(r[0] + 0.06 / c.w, r[1] + r[3] - title_h / 2, title, 9, INK, fontweight="bold")
    return (r[0], r[1], r[2], r[3] - title_h)


def _legend_rows(n: int, inner_h_in: float) -> int:
    """Legend lines that fit in at most 40 % of the panel (the last says '+k more' if cut)."""
    return max(1, min(n, int(0.4 * inner_h_in / LEGEND_LINE_IN)))


def _draw_legend(
    c: Canvas,
    r: Rect,
    series: list[Series],
    colors: list[str],
    calcs: list[str],
    unit: str,
    rows: int,
) -> None:
    """Grafana's table legend: colour, name, then one column per calculation."""
    line, col_w = LEGEND_LINE_IN / c.h, 0.75 / c.w
    top = r[1] + r[3] - 0.5 * line
    x_calc = [r[0] + r[2] - (len(calcs) - j - 1) * col_w - 0.05 / c.w for j in range(len(calcs))]
    for x, calc in zip(x_calc, calcs, strict=True):
        c.text(x, top, CALC_NAMES.get(calc, calc), color=FAINT, ha="right")
    shown = series if len(series) <= rows else series[: rows - 1]
    max_chars = max(10, int((r[2] - len(calcs) * col_w) * c.w / 0.06))
    for i, (s, color) in enumerate(zip(shown, colors, strict=False)):
        y = top - (i + 1) * line
        c.text(r[0] + 0.08 / c.w, y, "▬", 7, color)
        label = s.label if len(s.label) <= max_chars else s.label[: max_chars - 1] + "…"
        c.text(r[0] + 0.26 / c.w, y, label or " ", color=INK)
        for x, calc in zip(x_calc, calcs, strict=True):
            c.text(x, y, format_value(reduce_values(s.values, calc), unit), color=INK, ha="right")
    if len(series) > len(shown):
        c.text(r[0] + 0.26 / c.w, top - rows * line, f"+{len(series) - len(shown)} more")


def _on_grid(s: Series, rng: TimeRange):
    """The series' values on the range's step grid (NaN where it has no point)."""
    import numpy as np

    grid = np.arange(rng.start, rng.end + rng.step / 2, rng.step)
    y = np.full(len(grid), np.nan)
    idx = np.round((np.asarray(s.times) - rng.start) / rng.step).astype(int)
    y[np.clip(idx, 0, len(grid) - 1)] = s.values
    y[~np.isfinite(y)] = np.nan
    return (grid * 1000).astype("datetime64[ms]"), y  # matplotlib plots datetime64 as dates


def _draw_timeseries(c: Canvas, inner: Rect, panel: dict, data: PanelData, rng: TimeRange) -> None:
    import matplotlib.dates as mdates
    import numpy as np

    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    unit = defaults.get("unit", "short")
    stacked = (defaults.get("custom", {}).get("stacking") or {}).get("mode") == "normal"
    legend = panel.get("options", {}).get("legend", {})
    calcs = list(legend.get("calcs", [])) if legend.get("displayMode") == "table" else []
    series, colors = data.series, [PALETTE[i % len(PALETTE)] for i in range(len(data.series))]
    show_legend = bool(series) and legend.get("showLegend", True)
    rows = _legend_rows(len(series), inner[3] * c.h)
    legend_h = (rows + 1) * LEGEND_LINE_IN  # + the header line
    plot = c.inset(inner, 0.62, 0.25 + (legend_h if show_legend else 0), 0.12, 0.04)
    ax = c.axes(plot, unit)
    base = None
    for s, color in zip(series, colors, strict=True):
        times, y = _on_grid(s, rng)
        if stacked:  # Grafana stacks treating a missing point as 0
            base = np.zeros(len(y)) if base is None else base
            top = base + np.nan_to_num(y)
            ax.fill_between(times, base, top, color=color, alpha=0.3, linewidth=0)
            ax.plot(times, np.where(np.isnan(y), np.nan, top), color=color, linewidth=1)
            base = top
        else:
            ax.plot(times, y, color=color, linewidth=1.1)
    ax.set_xlim(*(np.array([rng.start, rng.end]) * 1000).astype("datetime64[ms]"))
    if defaults.get("min") == 0:
        ax.set_ylim(bottom=0)
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=6))
    if not series:
        ax.set_axis_off()
        c.no_data(plot, data)
    if show_legend:
        area = c.inset(inner, 0.05, 0.04, 0.05, inner[3] * c.h - legend_h - 0.04)
        _draw_legend(c, area, series, colors, calcs, unit, rows)


def _draw_stat(c: Canvas, inner: Rect, panel: dict, data: PanelData) -> None:
    """The reduced value, coloured by the thresholds, over a sparkline (graphMode area)."""
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    options = panel.get("options", {})
    calc = ((options.get("reduceOptions") or {}).get("calcs") or ["lastNotNull"])[0]
    n = len(data.series)
    for i, s in enumerate(data.series):  # several series: side by side, like Grafana
        cell = (inner[0] + i * inner[2] / n, inner[1], inner[2] / n, inner[3])
        value = reduce_values(s.values, calc)
        color = threshold_color(value, defaults.get("thresholds"))
        if options.get("graphMode", "area") == "area" and len(s.values) > 1:
            ax = c.axes(c.inset(cell, 0.02, 0.02, 0.02, 0.02))
            ax.fill_between(s.times, s.values, color=color, alpha=0.18, linewidth=0)
            ax.plot(s.times, s.values, color=color, linewidth=1, alpha=0.7)
            ax.set_axis_off()
        text = format_value(value, defaults.get("unit", "short"))
        c.text(cell[0] + cell[2] / 2, cell[1] + cell[3] * 0.55, text, 22, color, ha="center",
               fontweight="bold")  # fmt: skip
        if n > 1 and s.label:
            c.text(cell[0] + cell[2] / 2, cell[1] + cell[3] * 0.2, s.label, 7, ha="center")
    if not n:
        c.no_data(inner, data)


def _draw_bars(c: Canvas, inner: Rect, panel: dict, data: PanelData) -> None:
    """Heatmap: mean rate per bucket over the range. Bar gauge: last value per series."""
    if not data.series:
        c.no_data(inner, data)
        return
    if panel.get("type") == "heatmap":
        unit = panel.get("options", {}).get("yAxis", {}).get("unit", "short")
        bars = bucket_bars(data.series)
        scale = "" if unit == "short" else f" ({unit})"
        value_unit, xlabel = "short", f"bucket{scale}: mean per second over the whole range"
    else:
        value_unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        bars = [(s.label, reduce_values(s.values, "lastNotNull")) for s in data.series]
        xlabel = ""
    ax = c.axes(c.inset(inner, 0.62, 0.42, 0.12, 0.06), value_unit)
    ax.bar(range(len(bars)), [v for _, v in bars], color=PALETTE[3], width=0.8)
    ax.set_xticks(range(len(bars)), [b for b, _ in bars], fontsize=7)
    ax.set_xlabel(xlabel, fontsize=7, color=DIM)
    ax.set_ylim(bottom=0)


def table_blocks(n_rows: int, rows_fit: int, max_blocks: int) -> list[range]:
    """Split a table's rows into side-by-side blocks of at most rows_fit rows.

    Grafana would scroll; a picture shows every row while they fit in
    max_blocks blocks, and the first rows_fit * max_blocks otherwise.
    """
    rows_fit = max(1, rows_fit)
    blocks = min(max(1, max_blocks), math.ceil(n_rows / rows_fit) or 1)
    per_block = min(rows_fit, math.ceil(n_rows / blocks)) if n_rows else 0
    return [
        range(b * per_block, min(n_rows, (b + 1) * per_block))
        for b in range(blocks)
        if b * per_block < n_rows
    ]


def _draw_table(c: Canvas, inner: Rect, panel: dict, data: PanelData) -> None:
    """format=table: one row per series, its labels then its value (Time hidden)."""
    if not data.series:
        c.no_data(inner, data)
        return
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
    keys = sorted({k for s in data.series for k in s.metric if k != "__name__"})
    ordered = sorted(data.series, key=lambda s: [s.metric.get(k, "") for k in keys])
    rows = [
        [s.metric.get(k, "") for k in keys] + [format_value(s.values[-1], unit)] for s in ordered
    ]
    area = c.inset(inner, 0.08, 0.06, 0.08, 0.02)
    rows_fit = int(area[3] * c.h / TABLE_ROW_IN) - 1  # one line for the header
    blocks = table_blocks(len(rows), rows_fit, int(area[2] * c.w / TABLE_BLOCK_MIN_IN))
    width = area[2] / len(blocks)
    for b, block in enumerate(blocks):
        ax = c.axes((area[0] + b * width, area[1], width * 0.97, area[3]))
        ax.set_axis_off()
        height = (len(block) + 1) * TABLE_ROW_IN / (area[3] * c.h)
        tbl = ax.table(cellText=[rows[i] for i in block], colLabels=[*keys, "Value"],
                       cellLoc="left", bbox=(0, 1 - height, 1, height))  # fmt: skip
        tbl.auto_set_font_size(False)
        tbl.set_fontsize(7.5)
        for (i, _), cell in tbl.get_celld().items():
            cell.set_edgecolor("#e0e0e0")
            if i == 0:
                cell.set_facecolor("#f4f5f5")
                cell.set_text_props(fontweight="bold")
    hidden = len(rows) - sum(len(b) for b in blocks)
    if hidden:
        c.note(inner, f"+{hidden} more rows")


def draw_panel(c: Canvas, panel: dict, r: Rect, data: PanelData, rng: TimeRange) -> None:
    kind = panel.get("type")
    if kind == "row":
        c.text(r[0], r[1] + r[3] * 0.35, panel.get("title", ""), 11, "#1f60c4", fontweight="bold")
        return
    inner = _panel_frame(c, r, panel.get("title", ""))
    if kind in ("stat", "gauge"):
        _draw_stat(c, inner, panel, data)
    elif kind in ("bargauge", "heatmap"):
        _draw_bars(c, inner, panel, data)
    elif kind == "table":
        _draw_table(c, inner, panel, data)
    else:  # timeseries, and anything else that shows series over time
        _draw_timeseries(c, inner, panel, data, rng)
    if data.errors:
        c.note(inner, "; ".join(data.errors)[:160], NAMED_COLORS["red"])


def _header(c: Canvas, dash: dict, rng: TimeRange, rate: str) -> None:
    first, last = time.gmtime(rng.start), time.gmtime(rng.end)
    span = f"{time.strftime('%Y-%m-%d %H:%M:%S', first)} – {time.strftime('%H:%M:%S', last)} UTC"
    x = MARGIN_IN / c.w
    c.text(x, 1 - 0.28 / c.h, dash.get("title", ""), 15, INK, fontweight="bold")
    note = (
        f"{span} · step {prom_duration(rng.step)} · $__rate_interval = {rate} · drawn by "
        "deploy/render_dashboards.py from the dashboard's own queries evaluated by Prometheus "
        "(not a Grafana screenshot)"
    )
    c.text(x, 1 - 0.55 / c.h, note, 8)


def render_dashboard(
    dash: dict, prom: Prometheus, rng: TimeRange, out: Path, dpi: int = 90
) -> Path:
    """Evaluate every panel's queries and write the dashboard as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = {**variable_values(dash), **builtin_values(rng)}
    fig_w, fig_h = figure_size(dash)
    c = Canvas(plt.figure(figsize=(fig_w, fig_h), facecolor="#f4f5f5"))
    _header(c, dash, rng, values["__rate_interval"])
    for panel in iter_panels(dash):
        queries = panel_queries(panel, values)
        data = fetch_panel(prom, queries, rng) if queries else PanelData()
        draw_panel(c, panel, panel_rect(panel["gridPos"], fig_w, fig_h), data, rng)
    out.parent.mkdir(parents=True, exist_ok=True)
    c.fig.savefig(out, dpi=dpi, facecolor=c.fig.get_facecolor())
    plt.close(c.fig)
    _shrink_png(out)
    return out


def _shrink_png(path: Path) -> None:
    """Palette PNG: flat colours and thin lines lose nothing visible, the file a lot."""
    try:
        from PIL import Image
    except ImportError:  # matplotlib ships with Pillow, but stay optional
        return
    with Image.open(path) as img:
        small = img.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def render_all(
    prometheus: str,
    files: Sequence[Path],
    out_dir: Path,
    start: float,
    end: float,
    scrape_interval: float = 15.0,
    step: float | None = None,
    dpi: int = 90,
) -> list[Path]:
    prom = Prometheus(prometheus)
    rng = TimeRange(start, end, step or pick_step(start, end), scrape_interval)
    written = []
    for path in files:
        dash = json.loads(Path(path).read_text(encoding="utf-8"))
        written.append(render_dashboard(dash, prom, rng, out_dir / output_name(dash), dpi))
    return written


def parse_time(text: str, now: float) -> float:
    """'now', '-15m' (relative to now) or unix seconds."""
    if text == "now":
        return now
    if text.startswith("-"):
        return now - parse_duration(text[1:])
    return float(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", type=Path, help="dashboard JSON (default: all of ours)")
    p.add_argument("--prometheus", required=True, help="Prometheus base URL")
    p.add_argument("--start", default="-15m", help="unix seconds, or -DURATION from --end")
    p.add_argument("--end", default="now", help="unix seconds or now")
    p.add_argument("--step", type=parse_duration, help="query step (default: range / 400)")
    p.add_argument(
        "--scrape-interval",
        type=parse_duration,
        default=15.0,
        help="Prometheus' scrape interval, for $__rate_interval (default 15s)",
    )
    p.add_argument("--out", type=Path, default=Path("."), help="directory for the PNGs")
    p.add_argument("--dpi", type=int, default=90)
    args = p.parse_args(argv)
    now = time.time()
    end = parse_time(args.end, now)
    files = args.files or sorted(DASHBOARD_DIR.glob("*.json"))
    for path in render_all(
        args.prometheus,
        files,
        args.out,
        parse_time(args.start, end),
        end,
        args.scrape_interval,
        args.step,
        args.dpi,
    ):
        print(f"wrote {path} ({path.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
