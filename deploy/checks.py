#!/usr/bin/env python3
"""Offline consistency checks for StageServe's deployment files.

    python deploy/checks.py                      # every section; exit 1 on any error
    python deploy/checks.py dashboards k8s       # some sections
    python deploy/checks.py --compose-config F   # also check `docker compose config
                                                 #   --format json` output saved in F
    python deploy/checks.py --emit-promql-rules F  # dashboard queries as a Prometheus
                                                 #   rules file, for `promtool check rules`

Sections:

- ``dashboards``: deploy/grafana/dashboards/*.json parse, are laid out and
  wired to the datasource variable, and every PromQL expression (and template
  query) uses only the metric families of ``METRICS`` with their labels, known
  label values, rate() only on counters and histograms, histogram_quantile
  over ``_bucket`` series grouped by ``le``.
- ``grafana``: provisioning files agree with compose.yaml and the dashboards.
- ``compose``: compose.yaml's stageserve commands parse with ``stageserve``'s
  own argument parser (stageserve.cli.build_parser) under the service's
  environment, ports/health checks/metrics ports agree, workers scale, the
  GPU worker is a ``gpu`` profile with an NVIDIA device reservation.
- ``prometheus``: deploy/prometheus/*.yml scrape every stage on its metrics
  port (DNS discovery for scaled workers).
- ``k8s``: deploy/k8s manifests: commands parse, gRPC probes on the gRPC port
  (the gateway: HTTP probes of /v2/health/ready and /live on its HTTP port),
  scrape annotations on the metrics port, Services match pods, HPAs target
  real Deployments with a queue/pending metric served by the adapter rules
  and a CPU fallback, GPU DaemonSet requests one GPU.

Only the standard library, PyYAML and the repository itself are needed; no
network. tests/unit/test_deploy.py runs the same functions.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "compose.yaml"
DASHBOARD_DIR = ROOT / "deploy" / "grafana" / "dashboards"
PROVISIONING_DIR = ROOT / "deploy" / "grafana" / "provisioning"
PROMETHEUS_FILE = ROOT / "deploy" / "prometheus" / "prometheus.yml"
PROMETHEUS_K8S_FILE = ROOT / "deploy" / "prometheus" / "prometheus-k8s.yml"
K8S_DIR = ROOT / "deploy" / "k8s"
ADAPTER_VALUES = K8S_DIR / "prometheus-adapter" / "values.yaml"

# The ports every stage uses, in compose and Kubernetes alike.
GRPC_PORTS = {"gateway": 8001, "scheduler": 9001, "ratelimiter": 9002, "worker": 9003}
METRICS_PORTS = {"gateway": 8002, "scheduler": 9101, "ratelimiter": 9102, "worker": 9103}
#: The gateway's HTTP/REST (KServe v2) front; Kubernetes probes it over HTTP.
GATEWAY_HTTP_PORT = 8000
GATEWAY_HTTP_PROBES = {
    "startupProbe": "/v2/health/ready",
    "readinessProbe": "/v2/health/ready",
    "livenessProbe": "/v2/health/live",
}
STAGES = tuple(GRPC_PORTS)
ENV_KEYS = ("REDIS_URL", "STAGESERVE_RATELIMITER", "STAGESERVE_SCHEDULER")

# --------------------------------------------------------------------------- metric catalogue

# Labels Prometheus adds to every series (target labels): `job` and `instance`
# always; `compose_service` (prometheus.yml, workers) and `namespace`, `pod`,
# `node` (prometheus-k8s.yml) from relabelling.
TARGET_LABELS = frozenset({"job", "instance", "compose_service", "namespace", "pod", "node"})

_MV = ("model", "version")


@dataclass(frozen=True)
class Family:
    name: str
    type: str  # counter | gauge | histogram
    labels: frozenset[str]


def _fam(name: str, type_: str, *labels: str) -> Family:
    return Family(name, type_, frozenset(labels))


#: Every metric family the dashboards may use. Triton's names and labels for
#: the nv_* families (counters without a _total suffix, durations in
#: microseconds); StageServe's own families are Prometheus histograms in
#: seconds. No family may carry a target label (``TARGET_LABELS``): Prometheus
#: would store it as ``exported_<label>`` (why the worker's model-instance label
#: is ``model_instance``, not ``instance``).
METRICS: dict[str, Family] = {
    f.name: f
    for f in (
        _fam("nv_inference_request_success", "counter", *_MV),
        _fam("nv_inference_request_failure", "counter", *_MV, "reason"),
        _fam("nv_inference_count", "counter", *_MV),
        _fam("nv_inference_exec_count", "counter", *_MV),
        _fam("nv_inference_request_duration_us", "counter", *_MV),
        _fam("nv_inference_queue_duration_us", "counter", *_MV),
        _fam("nv_inference_compute_input_duration_us", "counter", *_MV),
        _fam("nv_inference_compute_infer_duration_us", "counter", *_MV),
        _fam("nv_inference_compute_output_duration_us", "counter", *_MV),
        _fam("nv_inference_pending_request_count", "gauge", *_MV),
        _fam("nv_model_load_duration_secs", "gauge", *_MV),
        _fam("nv_cpu_utilization", "gauge"),
        _fam("nv_cpu_memory_total_bytes", "gauge"),
        _fam("nv_cpu_memory_used_bytes", "gauge"),
        _fam("nv_gpu_utilization", "gauge", "gpu_uuid"),
        _fam("nv_gpu_memory_total_bytes", "gauge", "gpu_uuid"),
        _fam("nv_gpu_memory_used_bytes", "gauge", "gpu_uuid"),
        _fam("nv_gpu_power_usage", "gauge", "gpu_uuid"),
        _fam("stageserve_request_duration_seconds", "histogram", *_MV, "phase"),
        _fam("stageserve_gateway_rpc_duration_seconds", "histogram", "method", "code"),
        _fam("stageserve_http_request_duration_seconds", "histogram", "endpoint", "status"),
        _fam("stageserve_gateway_inflight_requests", "gauge", "model"),
        _fam("stageserve_scheduler_queue_depth", "gauge", *_MV),
        _fam("stageserve_scheduler_batch_size", "histogram", *_MV),
        _fam("stageserve_scheduler_shard_owned", "gauge", "model"),
        _fam("stageserve_tensor_slots_in_use", "gauge", "stage"),
        _fam("stageserve_cuda_shm_copies_total", "counter", "direction"),
        _fam("stageserve_stream_messages_total", "counter", "link"),
        _fam("stageserve_stream_requests_total", "counter", "link"),
        _fam("stageserve_ratelimiter_wait_seconds", "histogram", *_MV),
        _fam("stageserve_ratelimiter_instances", "gauge", *_MV, "state"),
        _fam("stageserve_ratelimiter_grants_total", "counter", *_MV),
        _fam("stageserve_ratelimiter_grant_wait_seconds", "histogram", "model", "priority"),
        _fam("stageserve_ratelimiter_resources", "gauge", "resource", "device", "state"),
        _fam("stageserve_worker_compute_seconds", "histogram", *_MV, "model_instance", "phase"),
        _fam("stageserve_stage_rpc_duration_seconds", "histogram", "service", "peer", "method"),
        _fam("stageserve_stage_rpc_errors_total", "counter", "service", "peer", "method", "code"),
        # prometheus_client's standard process collector, in every process.
        _fam("process_cpu_seconds_total", "counter"),
        _fam("process_resident_memory_bytes", "gauge"),
        _fam("process_virtual_memory_bytes", "gauge"),
        _fam("process_start_time_seconds", "gauge"),
        _fam("process_open_fds", "gauge"),
        _fam("process_max_fds", "gauge"),
        # Written by Prometheus itself for every target.
        _fam("up", "gauge"),
    )
}

#: The stage whose processes export a metric an autoscaler reads: a Pods
#: metric must come from the scaled pods themselves (stageserve/telemetry.py
#: and the services that set each metric).
METRIC_SOURCE = {
    "stageserve_gateway_inflight_requests": "gateway",
    "stageserve_scheduler_queue_depth": "scheduler",
    "nv_inference_pending_request_count": "scheduler",
}

#: Closed sets of label values: a `label="value"` matcher must use one of them.
LABEL_VALUES: dict[tuple[str, str], frozenset[str]] = {
    ("stageserve_request_duration_seconds", "phase"): frozenset(
        {"request", "queue", "compute_input", "compute_infer", "compute_output"}
    ),
    ("stageserve_worker_compute_seconds", "phase"): frozenset({"input", "infer", "output"}),
    ("stageserve_ratelimiter_instances", "state"): frozenset({"free", "busy"}),
    ("stageserve_ratelimiter_resources", "state"): frozenset({"held", "available"}),
    ("nv_inference_request_failure", "reason"): frozenset(
        {"REJECTED", "CANCELED", "BACKEND", "OTHER"}
    ),
}

_AGGREGATIONS = (
    "sum min max avg group stddev stdvar count count_values bottomk topk quantile "
    "limitk limit_ratio"
)
AGGREGATIONS = frozenset(_AGGREGATIONS.split())
_FUNCTIONS = """
    abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes
    clamp clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year
    days_in_month deg delta deriv exp floor histogram_avg histogram_count histogram_fraction
    histogram_quantile histogram_stddev histogram_stdvar histogram_sum holt_winters hour idelta
    increase irate label_join label_replace last_over_time ln log10 log2 mad_over_time
    max_over_time min_over_time minute month pi predict_linear present_over_time
    quantile_over_time rad rate resets round scalar sgn sin sinh sort sort_by_label
    sort_by_label_desc sort_desc sqrt stddev_over_time stdvar_over_time sum_over_time tan tanh
    time timestamp vector year"""
FUNCTIONS = frozenset(_FUNCTIONS.split())
RATE_FUNCS = frozenset({"rate", "irate", "increase"})
GROUPING_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
BINARY_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "atan2"})

# Grafana's built-in interval variables and what promtool sees instead.
GRAFANA_BUILTINS = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
    "__interval_ms": "60000",
    "__range_s": "3600",
}


def family_of(series: str) -> tuple[Family, str] | None:
    """(family, suffix) for a series name: histograms have _bucket/_sum/_count series."""
    if series in METRICS and METRICS[series].type != "histogram":
        return METRICS[series], ""
    for suffix in ("_bucket", "_sum", "_count"):
        base = series.removesuffix(suffix)
        if base != series and base in METRICS and METRICS[base].type == "histogram":
            return METRICS[base], suffix
    return None


# --------------------------------------------------------------------------- PromQL analysis

_TOKEN_RE = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<num>(?:0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?:ms|[smhdwy])*)
  | (?P<id>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=(){}\[\],:@])
    """,
    re.VERBOSE,
)
_VAR_RE = re.compile(r"\$\{([A-Za-z_]\w*)(?::[\w]+)?\}|\$([A-Za-z_]\w*)|\[\[([A-Za-z_]\w*)\]\]")
_VAR_PLACEHOLDER = "grafanavar"


@dataclass
class Selector:
    name: str
    matchers: list[tuple[str, str, str]]
    context: str | None  # innermost enclosing function or aggregation


@dataclass
class PromQL:
    expr: str
    selectors: list[Selector] = field(default_factory=list)
    groupings: list[str] = field(default_factory=list)
    functions: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def substitute_grafana_vars(expr: str, defined: Iterable[str]) -> tuple[str, list[str]]:
    """Replace $__rate_interval & co. by durations and template variables by a placeholder."""
    defined = set(defined)
    errors: list[str] = []

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        if name not in defined:
            errors.append(f"uses undefined variable ${name}")
        return _VAR_PLACEHOLDER

    return _VAR_RE.sub(repl, expr), errors


def _tokens(expr: str) -> tuple[list[tuple[str, str]], list[str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN_RE.match(expr, pos)
        if not m:
            return out, [f"cannot tokenize at {expr[pos : pos + 20]!r}"]
        kind = m.lastgroup or ""
        if kind not in ("ws", "comment"):
            out.append((kind, m.group()))
        pos = m.end()
    return out, []


def parse_promql(expr: str) -> PromQL:
    """Find selectors, grouping labels and functions of a PromQL expression.

    Not a full parser (promtool is the syntax authority, see
    scripts/validate_deploy.sh); enough to know which series and labels an
    expression reads and in which function.
    """
    info = PromQL(expr)
    toks, errs = _tokens(expr)
    info.errors += errs
    n = len(toks)
    stack: list[str | None] = []
    pending: str | None = None
    i = 0

    def matchers(start: int) -> tuple[list[tuple[str, str, str]], int]:
        found: list[tuple[str, str, str]] = []
        j = start + 1  # after "{"
        while j < n and toks[j][1] != "}":
            if toks[j][1] == ",":
                j += 1
                continue
            if j + 2 < n and toks[j][0] in ("id", "str") and toks[j + 2][0] == "str":
                label = toks[j][1].strip("\"'`")
                found.append((label, toks[j + 1][1], toks[j + 2][1][1:-1]))
                j += 3
            else:
                info.errors.append(f"bad label matcher near {toks[j][1]!r}")
                j += 1
        if j >= n:
            info.errors.append("unclosed '{'")
        return found, j + 1

    while i < n:
        kind, val = toks[i]
        nxt = toks[i + 1][1] if i + 1 < n else None
        if kind == "id":
            if val in GROUPING_KEYWORDS:
                if nxt == "(":
                    j = i + 2
                    while j < n and toks[j][1] != ")":
                        if toks[j][0] in ("id", "str"):
                            info.groupings.append(toks[j][1].strip("\"'`"))
                        j += 1
                    i = j + 1
                else:
                    i += 1
                continue
            if val in BINARY_KEYWORDS or val.lower() in ("inf", "nan"):
                i += 1
                continue
            if val in AGGREGATIONS and nxt in ("(", "by", "without"):
                info.functions.append(val)
                pending = val
                i += 1
                continue
            if nxt == "(":
                if val not in FUNCTIONS:
                    info.errors.append(f"unknown function {val}()")
                info.functions.append(val)
                pending = val
                i += 1
                continue
            context = stack[-1] if stack else None
            if nxt == "{":
                found, i = matchers(i + 1)
            else:
                found, i = [], i + 1
            info.selectors.append(Selector(val, found, context))
            continue
        if val == "{":  # selector without a metric name
            found, i = matchers(i)
            names = [v for label, op, v in found if label == "__name__" and op == "="]
            context = stack[-1] if stack else None
            info.selectors.append(Selector(names[0] if names else "", found, context))
            continue
        if val == "[":
            while i < n and toks[i][1] != "]":
                i += 1
            i += 1
            continue
        if val == "(":
            stack.append(pending)
            pending = None
        elif val == ")":
            if not stack:
                info.errors.append("unbalanced ')'")
            else:
                stack.pop()
        i += 1
    if stack:
        info.errors.append("unbalanced '('")
    return info


def check_promql(expr: str) -> list[str]:
    """Errors of one PromQL expression against the metric catalogue (empty = fine)."""
    info = parse_promql(expr)
    errors = list(info.errors)
    if not info.selectors:
        errors.append("reads no metric")
    allowed_groupings = {"le"} | TARGET_LABELS
    uses_buckets = False
    for sel in info.selectors:
        found = family_of(sel.name)
        if found is None:
            errors.append(f"unknown metric {sel.name or '{...}'!r}")
            continue
        fam, suffix = found
        labels = fam.labels | TARGET_LABELS | ({"le"} if suffix == "_bucket" else set())
        allowed_groupings |= labels
        uses_buckets |= suffix == "_bucket"
        for label, op, value in sel.matchers:
            if label == "__name__":
                continue
            if label not in labels:
                errors.append(f"{sel.name} has no label {label!r}")
                continue
            known = LABEL_VALUES.get((fam.name, label))
            literal = op in ("=", "!=") and _VAR_PLACEHOLDER not in value
            if known and literal and value not in known:
                errors.append(f"{sel.name}: {label}={value!r} is not one of {sorted(known)}")
        counter_like = fam.type == "counter" or fam.type == "histogram"
        if sel.context in RATE_FUNCS and not counter_like:
            errors.append(f"{sel.context}() of gauge {sel.name}")
        if counter_like and sel.context not in RATE_FUNCS:
            errors.append(f"counter {sel.name} read without rate()/increase()")
    for label in info.groupings:
        if label not in allowed_groupings:
            errors.append(f"groups by {label!r}, which no metric of the expression has")
    if "histogram_quantile" in info.functions:
        if not uses_buckets:
            errors.append("histogram_quantile() over no _bucket series")
        if "le" not in info.groupings:
            errors.append("histogram_quantile() without grouping by le")
    return errors


_LABEL_VALUES_RE = re.compile(r"^\s*label_values\(\s*(?:([A-Za-z_:][\w:]*)\s*,\s*)?(\w+)\s*\)\s*$")


def check_template_query(query: str) -> list[str]:
    """A Grafana Prometheus template query: label_values(metric, label) or plain PromQL."""
    m = _LABEL_VALUES_RE.match(query)
    if not m:
        return check_promql(query)
    metric, label = m.groups()
    if metric is None:
        return [f"label_values({label}) over every metric: name a metric"]
    found = family_of(metric)
    if found is None:
        return [f"unknown metric {metric!r}"]
    fam, suffix = found
    if label not in fam.labels | TARGET_LABELS | ({"le"} if suffix == "_bucket" else set()):
        return [f"{metric} has no label {label!r}"]
    return []


# --------------------------------------------------------------------------- helpers


def load_yaml_docs(path: Path) -> list:
    with path.open(encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _interpolate(value, env: dict[str, str] | None = None):
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default} and $$, with an empty environment."""
    env = env or {}
    pattern = re.compile(r"\$\$|\$\{([A-Za-z_]\w*)(?:(:?-)([^}]*))?\}|\$([A-Za-z_]\w*)")

    def repl(m: re.Match) -> str:
        if m.group() == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        if name in env and (env[name] or m.group(2) != ":-"):
            return env[name]
        return m.group(3) or ""

    if isinstance(value, str):
        return pattern.sub(repl, value)
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    return value


def _port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in (*ENV_KEYS, *env)}
    try:
        for k in ENV_KEYS:
            os.environ.pop(k, None)
        os.environ.update(env)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def parse_stageserve(argv: list[str], env: dict[str, str]) -> tuple[argparse.Namespace | None, str]:
    """Parse a `stageserve` command line the way the service would, under `env`.

    The parser is built inside the environment because stageserve.cli reads
    REDIS_URL & co. at build time (they make --redis-url optional). Returns
    (namespace, "") or (None, error).
    """
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from stageserve.cli import build_parser

    err = io.StringIO()
    with _environ(env), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            lines = err.getvalue().strip().splitlines()
            return None, f"`stageserve {shlex.join(argv)}`: {lines[-1] if lines else 'invalid'}"
    # stageserve.cli._need: peers that must be known (flag or environment).
    need = {
        "gateway": ("ratelimiter", "scheduler", "redis_url"),
        "scheduler": ("ratelimiter", "redis_url"),
        "worker": ("ratelimiter", "redis_url"),
        "ratelimiter": ("redis_url",),
    }.get(args.command, ())
    missing = [n for n in need if not getattr(args, n, None)]
    if missing:
        return None, f"`stageserve {shlex.join(argv)}`: no {', '.join(missing)}"
    return args, ""


def grpc_address(args: argparse.Namespace) -> str:
    if args.command == "gateway":
        return args.listen or f"0.0.0.0:{args.grpc_port}"
    return args.listen


def metrics_port(args: argparse.Namespace) -> int | None:
    return getattr(args, "metrics_port", None) or None


# --------------------------------------------------------------------------- dashboards


KNOWN_PANEL_TYPES = frozenset(
    {"row", "timeseries", "stat", "gauge", "table", "heatmap", "bargauge", "text", "piechart"}
)
DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}


@dataclass
class DashboardQuery:
    dashboard: str
    panel: str
    ref: str
    expr: str  # Grafana variables substituted: plain PromQL


def _panels(dash: dict) -> list[dict]:
    out = []
    for p in dash.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []) if p.get("type") == "row" else [])
    return out


def check_dashboard(path: Path) -> tuple[list[str], list[DashboardQuery]]:
    errors: list[str] = []
    queries: list[DashboardQuery] = []
    name = path.name
    try:
        dash = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        return [f"{name}: not JSON: {exc}"], []
    for key in ("uid", "title", "panels", "templating", "schemaVersion"):
        if key not in dash:
            errors.append(f"{name}: no {key!r}")
    variables = {v.get("name"): v for v in dash.get("templating", {}).get("list", [])}
    ds = variables.get("datasource")
    if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        errors.append(f"{name}: needs a `datasource` variable of type datasource (prometheus)")
    for vname, var in variables.items():
        if var.get("type") != "query":
            continue
        q = var.get("query")
        q = q.get("query", "") if isinstance(q, dict) else (q or "")
        for e in check_template_query(q):
            errors.append(f"{name}: variable ${vname}: {e}")
        if var.get("datasource") != DATASOURCE_REF:
            errors.append(f"{name}: variable ${vname} must use datasource ${{datasource}}")

    ids: set[int] = set()
    boxes: list[tuple[str, int, int, int, int]] = []
    for panel in _panels(dash):
        title = panel.get("title", "?")
        where = f"{name}: panel {title!r}"
        ptype = panel.get("type")
        if ptype not in KNOWN_PANEL_TYPES:
            errors.append(f"{where}: unknown panel type {ptype!r}")
        pid = panel.get("id")
        if not isinstance(pid, int) or pid in ids:
            errors.append(f"{where}: id {pid!r} missing or not unique")
        ids.add(pid)
        g = panel.get("gridPos", {})
        try:
            x, y, w, h = (int(g[k]) for k in ("x", "y", "w", "h"))
        except (KeyError, TypeError, ValueError):
            errors.append(f"{where}: bad gridPos {g!r}")
        else:
            if x < 0 or w <= 0 or h <= 0 or x + w > 24:
                errors.append(f"{where}: gridPos outside the 24-column grid: {g}")
            for other, ox, oy, ow, oh in boxes:
                if x < ox + ow and ox < x + w and y < oy + oh and oy < y + h:
                    errors.append(f"{where}: overlaps panel {other!r}")
            boxes.append((title, x, y, w, h))
        if ptype == "row":
            continue
        if not panel.get("description"):
            errors.append(f"{where}: no description (say what the panel means)")
        if panel.get("datasource") != DATASOURCE_REF:
            errors.append(f"{where}: datasource must be {DATASOURCE_REF}")
        targets = panel.get("targets") or []
        if not targets:
            errors.append(f"{where}: no queries")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or None in refs:
            errors.append(f"{where}: refIds missing or repeated: {refs}")
        for t in targets:
            expr = t.get("expr", "")
            if t.get("datasource") != DATASOURCE_REF:
                errors.append(f"{where} {t.get('refId')}: datasource must be {DATASOURCE_REF}")
            plain, var_errors = substitute_grafana_vars(expr, variables)
            for e in var_errors + check_promql(plain):
                errors.append(f"{where} {t.get('refId')}: {e}\n    {' '.join(expr.split())}")
            queries.append(DashboardQuery(name, title, str(t.get("refId")), plain))
    return errors, queries


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARD_DIR.glob("*.json"))


def check_dashboards() -> list[str]:
    errors: list[str] = []
    files = dashboard_files()
    if len(files) < 2:
        errors.append(f"expected the two dashboards in {DASHBOARD_DIR}, found {len(files)}")
    uids: dict[str, str] = {}
    used_metrics: set[str] = set()
    for path in files:
        errs, queries = check_dashboard(path)
        errors += errs
        uid = json.loads(path.read_text(encoding="utf-8")).get("uid") if not errs else None
        if uid in uids:
            errors.append(f"{path.name}: uid {uid!r} also used by {uids[uid]}")
        if uid:
            uids[uid] = path.name
        for q in queries:
            for sel in parse_promql(q.expr).selectors:
                found = family_of(sel.name)
                if found:
                    used_metrics.add(found[0].name)
    # Every family of the catalogue is on some panel (process_* and up: optional).
    for name in METRICS:
        if not name.startswith("process_") and name != "up" and name not in used_metrics:
            errors.append(f"no dashboard panel shows {name}")
    return errors


def dashboard_queries() -> list[DashboardQuery]:
    out: list[DashboardQuery] = []
    for path in dashboard_files():
        out += check_dashboard(path)[1]
    return out


def promql_rules_file(queries: list[DashboardQuery]) -> str:
    """Every dashboard query as a recording rule: `promtool check rules` parses them."""
    rules = [
        {
            "record": f"dashboard:{re.sub(r'[^a-zA-Z0-9_]', '_', q.dashboard)}:q{i}",
            "expr": q.expr,
        }
        for i, q in enumerate(queries)
    ]
    return yaml.safe_dump({"groups": [{"name": "dashboard-queries", "rules": rules}]})


# --------------------------------------------------------------------------- compose


def load_compose(normalized: Path | None = None) -> dict:
    """compose.yaml with anchors merged and ${VAR:-default} resolved (empty environment).

    With `normalized`, the output of `docker compose config --format json`
    (the real implementation's view) is used instead.
    """
    if normalized is not None:
        return json.loads(normalized.read_text(encoding="utf-8"))
    (doc,) = load_yaml_docs(COMPOSE_FILE)
    return _interpolate(doc)


def _command(svc: dict) -> list[str]:
    cmd = svc.get("command") or []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def _environment(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def _ports(svc: dict) -> list[tuple[str, int]]:
    out = []
    for p in svc.get("ports") or []:
        if isinstance(p, dict):
            out.append((str(p.get("published", "")), int(p["target"])))
        else:
            parts = str(p).split(":")
            out.append((parts[-2] if len(parts) > 1 else "", int(parts[-1].split("/")[0])))
    return out


def _volumes(svc: dict) -> list[tuple[str, str, bool]]:
    out = []
    for v in svc.get("volumes") or []:
        if isinstance(v, dict):
            out.append((str(v.get("source", "")), v["target"], bool(v.get("read_only"))))
        else:
            parts = v.split(":")
            out.append((parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(",")))
    return out


def _depends_on(svc: dict) -> dict[str, str]:
    dep = svc.get("depends_on") or {}
    if isinstance(dep, list):
        return dict.fromkeys(dep, "service_started")
    return {k: (v or {}).get("condition", "service_started") for k, v in dep.items()}


def _healthcheck_port(svc: dict) -> int | None:
    test = (svc.get("healthcheck") or {}).get("test") or []
    if isinstance(test, str):
        test = ["CMD-SHELL", test]
    words = " ".join(test[1:]).split()
    if "stageserve-healthcheck" not in words:
        return None
    addr = next((w for w in words if re.fullmatch(r"[\w.\-\[\]:]+:\d+", w)), None)
    return _port_of(addr) if addr else None


def _mount_for(path: str, volumes: list[tuple[str, str, bool]]) -> tuple[str, str] | None:
    """(volume source, mount target) whose target contains `path`."""
    best = None
    for source, target, _ro in volumes:
        if (path == target or path.startswith(target.rstrip("/") + "/")) and (
            best is None or len(target) > len(best[1])
        ):
            best = (source, target)
    return best


COMPOSE_STAGE_SERVICES = {
    "gateway": "gateway",
    "scheduler": "scheduler",
    "ratelimiter": "ratelimiter",
    "worker": "worker",
    "worker-gpu": "worker",
}


#: Gateways beside `gateway` on its ports (`stageserve up --gateways N` in compose).
COMPOSE_EXTRA_GATEWAYS = "gateway-extra"


def _check_compose_extra_gateways(
    services: dict[str, dict], parsed: dict[str, argparse.Namespace]
) -> list[str]:
    """The extra gateways share the gateway's ports: its network namespace,
    SO_REUSEPORT on both fronts in every one of them, no host ports and no
    metrics port of their own (one namespace has one 8002), a replica count."""
    name = COMPOSE_EXTRA_GATEWAYS
    extra, args = services.get(name), parsed.get(name)
    if extra is None:
        return [f"compose: no service {name!r}"]
    if args is None:
        return []  # its command's error is reported already
    errors = []
    if args.command != "gateway":
        errors.append(f"compose {name}: runs `stageserve {args.command}`, expected gateway")
    if extra.get("network_mode") != "service:gateway":
        errors.append(f"compose {name}: needs network_mode service:gateway (the gateway's ports)")
    if _ports(extra) or "container_name" in extra:
        errors.append(f"compose {name}: replicas publish no ports and have no container_name")
    for svc_name in ("gateway", name):
        gw = parsed.get(svc_name)
        if gw is not None and not (gw.reuse_grpc_port and gw.reuse_http_port):
            errors.append(
                f"compose {svc_name}: needs --reuse-grpc-port true --reuse-http-port true "
                "(the gateways share 8001 and 8000)"
            )
    if metrics_port(args) not in (0, None):
        errors.append(f"compose {name}: --metrics-port 0 (the gateway holds 8002)")
    if _port_of(grpc_address(args)) != GRPC_PORTS["gateway"]:
        errors.append(f"compose {name}: gRPC port must be the gateway's {GRPC_PORTS['gateway']}")
    replicas = (extra.get("deploy") or {}).get("replicas")
    if replicas is None or int(replicas) < 0:
        errors.append(f"compose {name}: needs deploy.replicas (STAGESERVE_EXTRA_GATEWAYS)")
    if _depends_on(extra).get("gateway") != "service_healthy":
        errors.append(f"compose {name}: must start once the gateway is healthy (models loaded)")
    return errors


def _check_compose_schedulers(
    services: dict[str, dict], parsed: dict[str, argparse.Namespace]
) -> list[str]:
    """The scheduler's replicas shard the models (`stageserve up --schedulers
    N`): a replica count, and nothing two replicas would share: no
    container_name, no host ports, no --advertise, no --scheduler-id."""
    svc, args = services.get("scheduler"), parsed.get("scheduler")
    if svc is None or args is None:
        return []  # a missing service or its command's error is reported already
    errors = []
    replicas = (svc.get("deploy") or {}).get("replicas")
    if replicas is None or int(replicas) < 1:
        errors.append("compose scheduler: needs deploy.replicas >= 1 (STAGESERVE_SCHEDULERS)")
    if "container_name" in svc or _ports(svc):
        errors.append("compose scheduler: replicas have no container_name and no host ports")
    if args.advertise or args.scheduler_id:
        errors.append(
            "compose scheduler: no --advertise or --scheduler-id (each replica registers "
            "its own hostname and id in the shard map)"
        )
    return errors


def check_compose(normalized: Path | None = None) -> list[str]:
    errors: list[str] = []
    try:
        compose = load_compose(normalized)
    except (OSError, yaml.YAMLError, json.JSONDecodeError, ValueError) as exc:
        return [f"compose: cannot load: {exc}"]
    services: dict[str, dict] = compose.get("services", {})
    volumes_declared = set((compose.get("volumes") or {}).keys())
    wanted = {*COMPOSE_STAGE_SERVICES, "redis", "examples", "prometheus", "grafana"}
    for name in sorted(wanted - set(services)):
        errors.append(f"compose: no service {name!r}")

    parsed: dict[str, argparse.Namespace] = {}
    for name, svc in services.items():
        image = str(svc.get("image", ""))
        if not image.startswith("stageserve"):
            continue
        argv = _command(svc)
        args, err = parse_stageserve(argv, _environment(svc))
        if err:
            errors.append(f"compose {name}: {err}")
            continue
        parsed[name] = args
        build = svc.get("build")
        if not build:
            errors.append(f"compose {name}: no build section (image {image} is built here)")
        for source, _target, _ro in _volumes(svc):
            if not source.startswith((".", "/")) and source not in volumes_declared:
                errors.append(f"compose {name}: volume {source!r} is not declared")

    for name, stage in COMPOSE_STAGE_SERVICES.items():
        args = parsed.get(name)
        if args is None:
            continue
        svc = services[name]
        if args.command != stage:
            errors.append(f"compose {name}: runs `stageserve {args.command}`, expected {stage}")
            continue
        gport = _port_of(grpc_address(args))
        if gport != GRPC_PORTS[stage]:
            errors.append(f"compose {name}: gRPC port {gport}, expected {GRPC_PORTS[stage]}")
        if metrics_port(args) != METRICS_PORTS[stage]:
            errors.append(
                f"compose {name}: --metrics-port {metrics_port(args)}, "
                f"expected {METRICS_PORTS[stage]} (deploy/prometheus/prometheus.yml scrapes it)"
            )
        hport = _healthcheck_port(svc)
        if hport != gport:
            errors.append(
                f"compose {name}: healthcheck must run stageserve-healthcheck on the gRPC "
                f"port {gport} (got {hport})"
            )
        for dep, cond in _depends_on(svc).items():
            if dep not in services:
                errors.append(f"compose {name}: depends on unknown service {dep!r}")
            elif cond == "service_healthy" and not (services[dep].get("healthcheck") or {}).get(
                "test"
            ):
                errors.append(f"compose {name}: waits for {dep} healthy, which has no healthcheck")
        if stage == "worker":
            if "container_name" in svc or _ports(svc):
                errors.append(
                    f"compose {name}: a scalable worker has no container_name and no host ports"
                )
            if args.advertise:
                errors.append(
                    f"compose {name}: no --advertise (each replica advertises its hostname)"
                )
            if not _environment(svc).get("STAGESERVE_RATELIMITER"):
                errors.append(f"compose {name}: STAGESERVE_RATELIMITER not set")

    gw = parsed.get("gateway")
    if gw is not None:
        gw_vols = _volumes(services["gateway"])
        repo = str(gw.model_repository)
        mount = _mount_for(repo, gw_vols)
        if mount is None:
            errors.append(f"compose gateway: --model-repository {repo} is on no volume")
        else:
            for name in ("worker", "worker-gpu", "examples"):
                if name in services and _mount_for(repo, _volumes(services[name])) != mount:
                    errors.append(
                        f"compose {name}: must mount {mount[0]!r} at {mount[1]} like the gateway "
                        "(workers open models at the gateway's path)"
                    )
        published = {target: pub for pub, target in _ports(services["gateway"])}
        for port in (GRPC_PORTS["gateway"], METRICS_PORTS["gateway"], GATEWAY_HTTP_PORT):
            if port not in published:
                errors.append(f"compose gateway: port {port} is not published")
        deps = _depends_on(services["gateway"])
        if deps.get("examples") != "service_completed_successfully":
            errors.append("compose gateway: must wait for examples to complete successfully")

    errors += _check_compose_extra_gateways(services, parsed)
    errors += _check_compose_schedulers(services, parsed)

    ex = parsed.get("examples")
    if ex is not None:
        if ex.command != "make-examples":
            errors.append("compose examples: must run `stageserve make-examples DIR`")
        elif gw is not None and str(ex.directory) != str(gw.model_repository):
            errors.append(
                f"compose examples: writes {ex.directory}, gateway serves {gw.model_repository}"
            )
        if str(services["examples"].get("restart", "no")) != "no":
            errors.append("compose examples: a one-shot service needs restart: 'no'")

    cpu, gpu = services.get("worker", {}), services.get("worker-gpu", {})
    if cpu.get("profiles"):
        errors.append("compose worker: the CPU worker must run without a profile")
    if "worker" in parsed and parsed["worker"].device != "cpu":
        errors.append("compose worker: the CPU worker runs with --device cpu")
    if gpu:
        if gpu.get("profiles") != ["gpu"]:
            errors.append("compose worker-gpu: must be in profile 'gpu' only")
        devices = (
            ((gpu.get("deploy") or {}).get("resources") or {}).get("reservations") or {}
        ).get("devices") or []
        if not any(
            d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or []) for d in devices
        ):
            errors.append(
                "compose worker-gpu: needs deploy.resources.reservations.devices "
                "with driver nvidia and capabilities [gpu]"
            )
        if "worker-gpu" in parsed and not parsed["worker-gpu"].device.startswith("cuda"):
            errors.append("compose worker-gpu: runs with --device cuda:N")
        if (gpu.get("build") or {}).get("target") != "gpu":
            errors.append("compose worker-gpu: builds the Dockerfile's `gpu` target")

    errors += _check_compose_observability(services)
    return errors


def _check_compose_observability(services: dict[str, dict]) -> list[str]:
    errors: list[str] = []
    prom = services.get("prometheus", {})
    prom_mounts = {target: source for source, target, _ro in _volumes(prom)}
    cfg = next((a.split("=", 1)[1] for a in _command(prom) if a.startswith("--config.file=")), "")
    source = prom_mounts.get(cfg, "")
    if not source or (ROOT / source).resolve() != PROMETHEUS_FILE.resolve():
        errors.append(
            f"compose prometheus: --config.file {cfg!r} must be deploy/prometheus/prometheus.yml"
        )
    graf = services.get("grafana", {})
    mounts = {target: source for source, target, _ro in _volumes(graf)}
    prov = mounts.get("/etc/grafana/provisioning", "")
    if not prov or (ROOT / prov).resolve() != PROVISIONING_DIR.resolve():
        errors.append(
            "compose grafana: mount deploy/grafana/provisioning at /etc/grafana/provisioning"
        )
    dash_target = next(
        (t for t, s in mounts.items() if s and (ROOT / s).resolve() == DASHBOARD_DIR.resolve()),
        None,
    )
    if dash_target is None:
        errors.append("compose grafana: deploy/grafana/dashboards is not mounted")
    else:
        for f in PROVISIONING_DIR.glob("dashboards/*.y*ml"):
            for provider in (load_yaml_docs(f)[0] or {}).get("providers", []):
                path = (provider.get("options") or {}).get("path")
                if path != dash_target:
                    errors.append(
                        f"grafana {f.name}: provider path {path!r} != mount {dash_target!r}"
                    )
        home = _environment(graf).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
        if home and not (
            home.startswith(dash_target + "/")
            and (DASHBOARD_DIR / home[len(dash_target) + 1 :]).is_file()
        ):
            errors.append(f"compose grafana: home dashboard {home} is not a mounted dashboard")
    return errors


# --------------------------------------------------------------------------- grafana provisioning


def check_grafana_provisioning() -> list[str]:
    errors: list[str] = []
    ds_files = sorted(PROVISIONING_DIR.glob("datasources/*.y*ml"))
    if not ds_files:
        return [f"grafana: no datasource provisioning in {PROVISIONING_DIR / 'datasources'}"]
    sources = [d for f in ds_files for d in (load_yaml_docs(f)[0] or {}).get("datasources", [])]
    prom = [d for d in sources if d.get("type") == "prometheus"]
    if len(prom) != 1:
        errors.append(f"grafana: expected one Prometheus datasource, found {len(prom)}")
        return errors
    ds = prom[0]
    if not ds.get("isDefault"):
        errors.append("grafana: the Prometheus datasource should be the default")
    compose = load_compose()
    prom_svc = compose.get("services", {}).get("prometheus")
    m = re.fullmatch(r"https?://([\w.\-]+):(\d+)/?", str(ds.get("url", "")))
    if not m or m.group(1) not in compose.get("services", {}) or m.group(2) != "9090":
        errors.append(f"grafana: datasource url {ds.get('url')!r} is not the prometheus service")
    if prom_svc is None:
        errors.append("grafana: compose has no prometheus service")
    for path in dashboard_files():
        dash = json.loads(path.read_text(encoding="utf-8"))
        for var in dash.get("templating", {}).get("list", []):
            if var.get("name") == "datasource":
                current = (var.get("current") or {}).get("value")
                if current not in (ds.get("uid"), ds.get("name")):
                    errors.append(
                        f"{path.name}: datasource variable defaults to {current!r}, "
                        f"provisioned uid is {ds.get('uid')!r}"
                    )
    if not list(PROVISIONING_DIR.glob("dashboards/*.y*ml")):
        errors.append("grafana: no dashboard provider in provisioning/dashboards/")
    return errors


# --------------------------------------------------------------------------- prometheus


def _catalogue_label_clashes() -> list[str]:
    """Families whose own labels collide with a target label (stored as exported_*)."""
    return [
        f"metric {f.name}: label {label!r} collides with Prometheus' target label"
        for f in METRICS.values()
        for label in sorted(f.labels & TARGET_LABELS)
    ]


def _renames_exported_labels(job: dict) -> bool:
    """A metric relabel rule that reads exported_* labels: a clash worked around at scrape."""
    return any(
        str(label).startswith("exported_")
        for r in job.get("metric_relabel_configs") or []
        for label in [*(r.get("source_labels") or []), r.get("regex", "")]
    )


def check_prometheus() -> list[str]:
    errors: list[str] = []
    (cfg,) = load_yaml_docs(PROMETHEUS_FILE)
    jobs = {j["job_name"]: j for j in cfg.get("scrape_configs", [])}
    compose_services = load_compose().get("services", {})
    for stage in ("gateway", "scheduler", "ratelimiter"):
        job = jobs.get(stage)
        want = f"{stage}:{METRICS_PORTS[stage]}"
        targets = [t for sc in (job or {}).get("static_configs", []) for t in sc.get("targets", [])]
        if want not in targets:
            errors.append(f"prometheus.yml: job {stage!r} must scrape {want} (got {targets})")
        if stage not in compose_services:
            errors.append(f"prometheus.yml: {stage} is not a compose service")
    worker = jobs.get("worker")
    if not worker:
        errors.append("prometheus.yml: no job 'worker'")
    else:
        dns = worker.get("dns_sd_configs") or []
        names = {n for d in dns for n in d.get("names", [])}
        if not dns or any(d.get("type") != "A" for d in dns):
            errors.append("prometheus.yml: workers are found with dns_sd_configs of type A")
        if not {"worker", "worker-gpu"} <= names:
            errors.append(f"prometheus.yml: dns_sd names must be worker and worker-gpu: {names}")
        if any(d.get("port") != METRICS_PORTS["worker"] for d in dns):
            errors.append(f"prometheus.yml: worker dns_sd port must be {METRICS_PORTS['worker']}")
        if worker.get("static_configs"):
            errors.append("prometheus.yml: scaled workers must not be static targets")
    (k8s,) = load_yaml_docs(PROMETHEUS_K8S_FILE)
    for job in k8s.get("scrape_configs", []):
        sd = job.get("kubernetes_sd_configs") or []
        if not sd or any(s.get("role") != "pod" for s in sd):
            errors.append(f"prometheus-k8s.yml: job {job.get('job_name')} needs pod discovery")
        relabels = job.get("relabel_configs") or []
        keeps = [r for r in relabels if r.get("action") == "keep"]
        if not any(
            r.get("source_labels") == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
            for r in keeps
        ):
            errors.append("prometheus-k8s.yml: must keep only pods annotated prometheus.io/scrape")
        targets = {r.get("target_label") for r in relabels}
        for label in ("job", "namespace", "pod", "__address__"):
            if label not in targets:
                errors.append(f"prometheus-k8s.yml: no relabel to {label!r}")
    # Label clashes are fixed at the source (stageserve/telemetry.py), so the
    # dashboards work with any scrape config; no scrape-time renames.
    errors += _catalogue_label_clashes()
    for name, cfg_ in (("prometheus.yml", cfg), ("prometheus-k8s.yml", k8s)):
        for job in cfg_.get("scrape_configs", []):
            if _renames_exported_labels(job):
                errors.append(
                    f"{name}: job {job.get('job_name')} relabels exported_* labels; "
                    "rename the label in stageserve/telemetry.py instead"
                )
    return errors


# --------------------------------------------------------------------------- kubernetes

_QUANTITY_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[numkMGTPE]|[KMGTPE]i)?$")


@dataclass
class Workload:
    kind: str
    name: str
    obj: dict

    @property
    def pod(self) -> dict:
        return self.obj["spec"]["template"]

    @property
    def pod_spec(self) -> dict:
        return self.pod["spec"]


def load_k8s() -> tuple[dict[str, list[dict]], list[str]]:
    """{file name: objects} of every manifest listed in kustomization.yaml, and errors."""
    errors: list[str] = []
    (kust,) = load_yaml_docs(K8S_DIR / "kustomization.yaml")
    listed = list(kust.get("resources", []))
    present = sorted(p.name for p in K8S_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
    for name in sorted(set(present) - set(listed)):
        errors.append(f"k8s: {name} is not listed in kustomization.yaml")
    for name in sorted(set(listed) - set(present)):
        errors.append(f"k8s: kustomization.yaml lists missing {name}")
    docs = {name: load_yaml_docs(K8S_DIR / name) for name in listed if name in present}
    return docs, errors


def _quantities(obj, where: str) -> list[str]:
    errors = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("requests", "limits") and isinstance(v, dict):
                for rk, rv in v.items():
                    if not _QUANTITY_RE.match(str(rv)):
                        errors.append(f"{where}: {k}.{rk} {rv!r} is not a quantity")
            elif k in ("averageValue", "value") and isinstance(v, str | int | float):
                if not _QUANTITY_RE.match(str(v)):
                    errors.append(f"{where}: {k} {v!r} is not a quantity")
            else:
                errors += _quantities(v, where)
    elif isinstance(obj, list):
        for v in obj:
            errors += _quantities(v, where)
    return errors


def _expand_k8s_vars(arg: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_]\w*)\)", lambda m: env.get(m.group(1), m.group()), arg)


def _container_env(
    container: dict, configmaps: dict[str, dict]
) -> tuple[dict[str, str], list[str]]:
    env: dict[str, str] = {}
    errors: list[str] = []
    for src in container.get("envFrom", []):
        ref = (src.get("configMapRef") or {}).get("name")
        if ref is not None:
            if ref not in configmaps:
                errors.append(f"envFrom unknown ConfigMap {ref!r}")
            env.update({k: str(v) for k, v in configmaps.get(ref, {}).items()})
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = "10.0.0.1"
        else:
            env[e["name"]] = "x"
    return env, errors


def _stageserve_argv(container: dict) -> list[str] | None:
    """The stageserve argv a container runs: entrypoint + args, or `sh -c "stageserve ..."`."""
    command, args = container.get("command"), container.get("args") or []
    if command is None:
        return [str(a) for a in args]
    if command[:2] == ["sh", "-c"] and len(command) == 3:
        for part in re.split(r"&&|;|\|\|", command[2]):
            words = shlex.split(part)
            if words and words[0] == "stageserve":
                return words[1:]
        return None
    if command and Path(command[0]).name == "stageserve":
        return [str(a) for a in command[1:] + args]
    return None


def check_k8s() -> list[str]:
    docs, errors = load_k8s()
    objects = [(fname, o) for fname, objs in docs.items() for o in objs]
    by_kind: dict[str, dict[str, dict]] = {}
    for fname, o in objects:
        kind, name = o.get("kind"), (o.get("metadata") or {}).get("name")
        if not kind or not name or not o.get("apiVersion"):
            errors.append(f"k8s {fname}: object without apiVersion/kind/metadata.name")
            continue
        if kind != "Namespace" and o["metadata"].get("namespace") != "stageserve":
            errors.append(f"k8s {fname}: {kind}/{name} must be in namespace stageserve")
        if name in by_kind.setdefault(kind, {}):
            errors.append(f"k8s: {kind}/{name} defined twice")
        by_kind[kind][name] = o
        errors += _quantities(o, f"k8s {kind}/{name}")
    configmaps = {n: o.get("data") or {} for n, o in by_kind.get("ConfigMap", {}).items()}
    services = by_kind.get("Service", {})
    pvcs = set(by_kind.get("PersistentVolumeClaim", {}))

    cm = configmaps.get("stageserve-config", {})
    for key in ENV_KEYS:
        if key not in cm:
            errors.append(f"k8s ConfigMap stageserve-config: no {key}")

    workloads = [
        Workload(kind, name, o)
        for kind in ("Deployment", "DaemonSet", "Job")
        for name, o in by_kind.get(kind, {}).items()
    ]
    # stage -> list of (workload, args, container)
    stages: dict[str, list[tuple[Workload, argparse.Namespace, dict]]] = {}
    # (workload, args, repository mounts as (claim, mountPath, readOnly))
    repo_users: list[tuple[str, argparse.Namespace, list[tuple[str, str, bool]]]] = []
    for wl in workloads:
        where = f"k8s {wl.kind}/{wl.name}"
        spec = wl.obj["spec"]
        tmpl_labels = (wl.pod.get("metadata") or {}).get("labels") or {}
        if wl.kind != "Job":
            sel = (spec.get("selector") or {}).get("matchLabels") or {}
            if not sel or any(tmpl_labels.get(k) != v for k, v in sel.items()):
                errors.append(f"{where}: selector {sel} does not match template labels")
        volumes = {v["name"]: v for v in wl.pod_spec.get("volumes", [])}
        for v in volumes.values():
            claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
            if claim is not None and claim not in pvcs:
                errors.append(f"{where}: volume {v['name']} uses unknown claim {claim!r}")
        for c in wl.pod_spec.get("containers", []):
            if not str(c.get("image", "")).startswith("stageserve"):
                continue
            env, env_errors = _container_env(c, configmaps)
            errors += [f"{where}: {e}" for e in env_errors]
            argv = _stageserve_argv(c)
            if argv is None:
                errors.append(f"{where}: container {c['name']} runs no stageserve command")
                continue
            argv = [_expand_k8s_vars(a, env) for a in argv]
            unresolved = [a for a in argv if "$(" in a]
            if unresolved:
                errors.append(f"{where}: unresolved variables in args {unresolved}")
            args, err = parse_stageserve(argv, env)
            if err:
                errors.append(f"{where}: {err}")
                continue
            vmounts = [
                (
                    (volumes.get(m["name"], {}).get("persistentVolumeClaim") or {}).get(
                        "claimName", m["name"]
                    ),
                    m["mountPath"],
                    bool(m.get("readOnly")),
                )
                for m in c.get("volumeMounts", [])
            ]
            if args.command in ("make-examples", "gateway", "worker"):
                repo_users.append((f"{wl.kind}/{wl.name}", args, vmounts))
            if args.command == "make-examples":
                continue
            if args.command not in STAGES:
                errors.append(f"{where}: runs `stageserve {args.command}`")
                continue
            stages.setdefault(args.command, []).append((wl, args, c))
            errors += _check_stage_container(where, wl, args, c)

    for stage in STAGES:
        if stage not in stages:
            errors.append(f"k8s: no workload runs `stageserve {stage}`")
    # The gateway publishes model paths; workers open them: same claim, same path.
    repos = {str(a.model_repository) for _w, a, _m in repo_users if a.command == "gateway"}
    repos |= {str(a.directory) for _w, a, _m in repo_users if a.command == "make-examples"}
    if len(repos) != 1:
        errors.append(f"k8s: gateway and examples Job must agree on one repository: {repos}")
    else:
        (repo,) = repos
        mounts = {who: _mount_for(repo, vm) for who, _a, vm in repo_users}
        if None in mounts.values() or len(set(mounts.values())) > 1:
            errors.append(
                f"k8s: gateway, workers and the examples Job must mount the same claim at the "
                f"same path to see {repo}: {mounts}"
            )

    errors += _check_k8s_services(services, configmaps.get("stageserve-config", {}), by_kind)
    errors += _check_k8s_workers(stages)
    errors += _check_k8s_hpas(by_kind, stages)
    return errors


def _check_stage_container(
    where: str, wl: Workload, args: argparse.Namespace, c: dict
) -> list[str]:
    errors: list[str] = []
    stage = args.command
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    gport = _port_of(grpc_address(args))
    if gport != GRPC_PORTS[stage]:
        errors.append(f"{where}: gRPC port {gport}, expected {GRPC_PORTS[stage]}")
    if gport not in ports.values():
        errors.append(f"{where}: gRPC port {gport} is not a containerPort")
    if stage == "gateway":
        errors += _check_gateway_http(where, args, c, ports)
    for probe in ("readinessProbe", "livenessProbe"):
        if stage == "gateway":
            continue  # HTTP probes, checked above
        p = c.get(probe) or {}
        if (p.get("grpc") or {}).get("port") != gport:
            errors.append(f"{where}: {probe} must be a gRPC probe on port {gport}")
    startup = c.get("startupProbe")
    if stage != "gateway" and startup and (startup.get("grpc") or {}).get("port") != gport:
        errors.append(f"{where}: startupProbe must be a gRPC probe on port {gport}")
    mport = metrics_port(args)
    if mport != METRICS_PORTS[stage]:
        errors.append(f"{where}: --metrics-port {mport}, expected {METRICS_PORTS[stage]}")
    if mport not in ports.values():
        errors.append(f"{where}: metrics port {mport} is not a containerPort")
    ann = (wl.pod.get("metadata") or {}).get("annotations") or {}
    if ann.get("prometheus.io/scrape") != "true" or ann.get("prometheus.io/port") != str(mport):
        errors.append(
            f"{where}: pod needs annotations prometheus.io/scrape: 'true' and "
            f"prometheus.io/port: '{mport}'"
        )
    labels = (wl.pod.get("metadata") or {}).get("labels") or {}
    if labels.get("app.kubernetes.io/component") != stage:
        errors.append(
            f"{where}: pod label app.kubernetes.io/component must be {stage!r} "
            "(prometheus-k8s.yml makes it the job label the dashboards group by)"
        )
    if not (c.get("resources") or {}).get("requests", {}).get("cpu"):
        errors.append(f"{where}: no CPU request (needed by the HPA's CPU metric)")
    return errors


def _check_gateway_http(
    where: str, args: argparse.Namespace, c: dict, ports: dict[str, int]
) -> list[str]:
    """The gateway serves HTTP on GATEWAY_HTTP_PORT and is probed there."""
    errors: list[str] = []
    if not args.allow_http or args.http_port != GATEWAY_HTTP_PORT:
        errors.append(f"{where}: the gateway must serve HTTP on --http-port {GATEWAY_HTTP_PORT}")
    if GATEWAY_HTTP_PORT not in ports.values():
        errors.append(f"{where}: HTTP port {GATEWAY_HTTP_PORT} is not a containerPort")
    for probe, path in GATEWAY_HTTP_PROBES.items():
        get = (c.get(probe) or {}).get("httpGet") or {}
        port = get.get("port")
        port = ports.get(port, port) if isinstance(port, str) else port
        if port != GATEWAY_HTTP_PORT or get.get("path") != path:
            errors.append(
                f"{where}: {probe} must be an HTTP probe of {path} on port {GATEWAY_HTTP_PORT}"
            )
    return errors


def _check_k8s_services(
    services: dict[str, dict],
    cm: dict,
    by_kind: dict[str, dict[str, dict]],
) -> list[str]:
    errors: list[str] = []
    pods = [
        (
            (wl.pod.get("metadata") or {}).get("labels") or {},
            {
                p.get("name"): p["containerPort"]
                for c in wl.pod_spec.get("containers", [])
                for p in c.get("ports", [])
            },
        )
        for kind in ("Deployment", "DaemonSet")
        for wl in (Workload(kind, n, o) for n, o in by_kind.get(kind, {}).items())
    ]

    def resolve(svc_name: str, port: int) -> int | None:
        """The container port a Service port leads to, or None."""
        svc = services.get(svc_name)
        if not svc:
            return None
        sel = svc["spec"].get("selector") or {}
        for sp in svc["spec"].get("ports", []):
            if sp.get("port") != port:
                continue
            target = sp.get("targetPort", port)
            for labels, cports in pods:
                if sel and all(labels.get(k) == v for k, v in sel.items()):
                    if isinstance(target, int) and target in cports.values():
                        return target
                    if isinstance(target, str) and target in cports:
                        return cports[target]
        return None

    for name, svc in services.items():
        sel = svc["spec"].get("selector") or {}
        if not any(all(lbl.get(k) == v for k, v in sel.items()) for lbl, _ in pods):
            errors.append(f"k8s Service/{name}: selector {sel} matches no pod template")
    peers = (("STAGESERVE_RATELIMITER", "ratelimiter"), ("STAGESERVE_SCHEDULER", "scheduler"))
    for key, stage in peers:
        addr = cm.get(key, "")
        host, _, port = addr.rpartition(":")
        if not port.isdigit() or resolve(host, int(port)) != GRPC_PORTS[stage]:
            errors.append(
                f"k8s ConfigMap {key}={addr!r}: must name the {stage} Service on a port that "
                f"leads to containerPort {GRPC_PORTS[stage]}"
            )
    m = re.fullmatch(r"redis://([\w.\-]+):(\d+)(/\d+)?", cm.get("REDIS_URL", ""))
    if not m or resolve(m.group(1), int(m.group(2))) is None:
        errors.append(f"k8s ConfigMap REDIS_URL={cm.get('REDIS_URL')!r} names no Service port")
    if resolve("gateway", GRPC_PORTS["gateway"]) != GRPC_PORTS["gateway"]:
        errors.append("k8s: Service gateway must expose the gRPC port 8001")
    if resolve("gateway", GATEWAY_HTTP_PORT) != GATEWAY_HTTP_PORT:
        errors.append(f"k8s: Service gateway must expose the HTTP port {GATEWAY_HTTP_PORT}")
    return errors


def _check_k8s_workers(
    stages: dict[str, list[tuple[Workload, argparse.Namespace, dict]]],
) -> list[str]:
    errors: list[str] = []
    workers = stages.get("worker", [])
    gpu = [(wl, a, c) for wl, a, c in workers if wl.kind == "DaemonSet"]
    cpu = [(wl, a, c) for wl, a, c in workers if wl.kind == "Deployment"]
    if not gpu:
        errors.append("k8s: GPU workers run as a DaemonSet")
    if not cpu:
        errors.append("k8s: CPU workers run as a Deployment")
    for wl, args, c in gpu:
        where = f"k8s DaemonSet/{wl.name}"
        if not args.device.startswith("cuda"):
            errors.append(f"{where}: --device cuda:N")
        limits = (c.get("resources") or {}).get("limits") or {}
        if str(limits.get("nvidia.com/gpu")) != "1":
            errors.append(f"{where}: limits nvidia.com/gpu must be 1 (one worker per GPU)")
        if not wl.pod_spec.get("nodeSelector") and not wl.pod_spec.get("affinity"):
            errors.append(f"{where}: needs a nodeSelector (or affinity) for GPU nodes")
        if not any(t.get("key") == "nvidia.com/gpu" for t in wl.pod_spec.get("tolerations", [])):
            errors.append(f"{where}: needs a toleration for nvidia.com/gpu taints")
    for wl, args, _c in cpu:
        if args.device != "cpu":
            errors.append(f"k8s Deployment/{wl.name}: a CPU worker runs with --device cpu")
    for wl, args, c in workers:
        where = f"k8s {wl.kind}/{wl.name}"
        raw = " ".join(_stageserve_argv(c) or [])
        if "--advertise $(POD_IP):" not in raw:
            errors.append(
                f"{where}: --advertise $(POD_IP):{GRPC_PORTS['worker']} (pod hostnames do not "
                "resolve across pods)"
            )
        elif _port_of(args.advertise) != _port_of(args.listen):
            errors.append(f"{where}: advertised port differs from the listen port")
        if not any(e.get("name") == "POD_IP" for e in c.get("env", [])):
            errors.append(f"{where}: env POD_IP from status.podIP is missing")
    return errors


def _adapter_rules() -> dict[str, set[str]]:
    """Metric names prometheus-adapter serves: {'custom': {...}, 'external': {...}}."""
    (values,) = load_yaml_docs(ADAPTER_VALUES)
    out: dict[str, set[str]] = {"custom": set(), "external": set()}
    for kind in out:
        for rule in (values.get("rules") or {}).get(kind) or []:
            name = (rule.get("name") or {}).get("as")
            m = re.match(
                r"^\s*(?:\{__name__=~?\"([^\"]+)\"|([A-Za-z_:][\w:]*))", rule["seriesQuery"]
            )
            series = m and (m.group(1) or m.group(2))
            out[kind].add(name or series or "")
            if series and family_of(series) is None:
                out[kind].add(f"!unknown:{series}")
    return out


def _check_k8s_hpas(
    by_kind: dict[str, dict[str, dict]],
    stages: dict[str, list[tuple[Workload, argparse.Namespace, dict]]],
) -> list[str]:
    errors: list[str] = []
    rules = _adapter_rules()
    for kind, names in rules.items():
        for n in names:
            if n.startswith("!unknown:"):
                errors.append(f"prometheus-adapter {kind} rule reads unknown metric {n[9:]}")
    deployments = by_kind.get("Deployment", {})
    scaled: dict[str, str] = {}
    for name, hpa in by_kind.get("HorizontalPodAutoscaler", {}).items():
        where = f"k8s HorizontalPodAutoscaler/{name}"
        if hpa.get("apiVersion") != "autoscaling/v2":
            errors.append(f"{where}: use autoscaling/v2")
        spec = hpa["spec"]
        ref = spec.get("scaleTargetRef") or {}
        if ref.get("kind") != "Deployment" or ref.get("name") not in deployments:
            errors.append(f"{where}: scales {ref}, which is not a Deployment here")
            continue
        stage = next(
            (
                s
                for s, items in stages.items()
                for wl, _a, _c in items
                if wl.kind == "Deployment" and wl.name == ref["name"]
            ),
            None,
        )
        scaled[stage or "?"] = name
        low, high = spec.get("minReplicas", 1), spec.get("maxReplicas", 0)
        if low < 1 or high < low:
            errors.append(f"{where}: bad replica bounds")
        kinds = {m.get("type") for m in spec.get("metrics", [])}
        has_cpu = any(
            m.get("type") == "Resource" and (m.get("resource") or {}).get("name") == "cpu"
            for m in spec.get("metrics", [])
        )
        if not has_cpu:
            errors.append(f"{where}: needs a CPU Resource metric as fallback")
        if not kinds & {"External", "Pods"}:
            errors.append(f"{where}: needs a queue-depth/pending External or Pods metric")
        for m in spec.get("metrics", []):
            mtype = m.get("type")
            if mtype not in ("External", "Pods"):
                continue
            metric = (m.get(mtype.lower()) or {}).get("metric", {}).get("name", "")
            if metric not in METRICS:
                errors.append(f"{where}: metric {metric!r} is not a StageServe/Triton metric")
            source = METRIC_SOURCE.get(metric)
            if source is None:
                errors.append(f"{where}: no known stage exports {metric!r} (METRIC_SOURCE)")
            elif mtype == "Pods" and source != stage:
                errors.append(
                    f"{where}: Pods metric {metric!r} is exported by {source} pods, not by the "
                    f"{stage} pods this HPA scales (use an External metric)"
                )
            served = rules["external" if mtype == "External" else "custom"]
            if metric not in served:
                errors.append(
                    f"{where}: {mtype} metric {metric!r} is not served by the "
                    "prometheus-adapter rules (deploy/k8s/prometheus-adapter/values.yaml)"
                )
    for stage in ("gateway", "worker"):
        if stage not in scaled:
            errors.append(f"k8s: no HorizontalPodAutoscaler for the {stage} Deployment")
    return errors


def check_k8s_replicas() -> list[str]:
    """kustomization.yaml's `replicas` (the gateway and scheduler counts of
    `stageserve up --gateways/--schedulers`, in pods) names Deployments here,
    within their HPA's bounds; schedulers register their pod's own address."""
    (kust,) = load_yaml_docs(K8S_DIR / "kustomization.yaml")
    docs, errors = load_k8s()
    objects = [o for objs in docs.values() for o in objs]
    deployments = {o["metadata"]["name"] for o in objects if o.get("kind") == "Deployment"}
    bounds = {
        (o["spec"].get("scaleTargetRef") or {}).get("name"): (
            o["spec"].get("minReplicas", 1),
            o["spec"].get("maxReplicas", 0),
        )
        for o in objects
        if o.get("kind") == "HorizontalPodAutoscaler"
    }
    counts = {r.get("name"): r.get("count") for r in kust.get("replicas") or []}
    for stage in ("gateway", "scheduler"):
        if stage not in counts:
            errors.append(f"k8s kustomization.yaml: no replicas count for the {stage}")
    errors += _check_k8s_scheduler_shards(objects)
    for name, count in counts.items():
        if name not in deployments:
            errors.append(f"k8s kustomization.yaml: replicas of {name!r}, not a Deployment here")
        elif not isinstance(count, int) or count < 1:
            errors.append(f"k8s kustomization.yaml: replicas of {name} must be a count >= 1")
        elif name in bounds and not bounds[name][0] <= count <= bounds[name][1]:
            low, high = bounds[name]
            errors.append(
                f"k8s kustomization.yaml: replicas of {name} ({count}) outside its "
                f"HorizontalPodAutoscaler's {low}..{high}"
            )
    return errors


def _check_k8s_scheduler_shards(objects: list[dict]) -> list[str]:
    """Scheduler pods shard the models: each advertises its pod IP (the
    Service's one address would send every model's requests to any pod) and
    keeps its default id (the pod name); a fixed --scheduler-id would be shared."""
    errors = []
    for o in objects:
        if o.get("kind") != "Deployment" or o["metadata"]["name"] != "scheduler":
            continue
        for container in o["spec"]["template"]["spec"].get("containers") or []:
            argv = [str(a) for a in container.get("args") or container.get("command") or []]
            if "--scheduler-id" in argv:
                errors.append("k8s scheduler: no --scheduler-id (replicas would share it)")
            advertise = argv[argv.index("--advertise") + 1] if "--advertise" in argv else ""
            if "$(POD_IP)" not in advertise:
                errors.append("k8s scheduler: --advertise $(POD_IP):9001 (each pod's address)")
    return errors


# --------------------------------------------------------------------------- Dockerfile

DOCKERFILE = ROOT / "Dockerfile"


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """{stage name: [(INSTRUCTION, arguments)]} with line continuations joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            m = re.search(r"\bAS\s+(\S+)", rest, re.IGNORECASE)
            current = stages.setdefault(m.group(1) if m else f"stage{len(stages)}", [])
        if current is not None:
            current.append((instr, rest.strip()))
    return stages


def check_dockerfile() -> list[str]:
    errors: list[str] = []
    stages = dockerfile_stages()
    if not stages:
        return ["Dockerfile: no stages"]
    names = list(stages)
    final = names[-1]
    targets = {
        (svc.get("build") or {}).get("target")
        for svc in load_compose().get("services", {}).values()
        if isinstance(svc.get("build"), dict)
    }
    for target in sorted(t for t in targets if t):
        if target not in stages:
            errors.append(f"Dockerfile: compose builds target {target!r}, which is not a stage")
    if final != "runtime":
        errors.append(f"Dockerfile: the last (default) stage should be the CPU `runtime`: {final}")

    def resolved(stage: str, instr: str) -> list[str]:
        """Values of `instr` in a stage, following FROM <earlier stage> chains."""
        out: list[str] = []
        seen: set[str] = set()
        while stage in stages and stage not in seen:
            seen.add(stage)
            entries = stages[stage]
            out = [a for i, a in entries if i == instr] + out
            base = entries[0][1].split()[0]
            stage = base
        return out

    for stage in ("runtime", "gpu"):
        if stage not in stages:
            errors.append(f"Dockerfile: no `{stage}` stage")
            continue
        users = resolved(stage, "USER")
        if not users or users[-1].split(":")[0] in ("root", "0"):
            errors.append(f"Dockerfile {stage}: must end as a non-root USER")
        entry = resolved(stage, "ENTRYPOINT")
        if not entry or json.loads(entry[-1])[0] != "stageserve":
            errors.append(f'Dockerfile {stage}: ENTRYPOINT must be ["stageserve"]')
        health = resolved(stage, "HEALTHCHECK")
        if not health or "stageserve-healthcheck" not in health[-1]:
            errors.append(f"Dockerfile {stage}: HEALTHCHECK must run stageserve-healthcheck")
        exposed = {int(p) for e in resolved(stage, "EXPOSE") for p in e.split()}
        missing = sorted((set(GRPC_PORTS.values()) | set(METRICS_PORTS.values())) - exposed)
        if missing:
            errors.append(f"Dockerfile {stage}: EXPOSE misses {missing}")
    runs = " ".join(a for entries in stages.values() for i, a in entries if i == "RUN")
    # the project itself, with the torch extra (TorchScript models)
    if not re.search(r"pip install (\S+ )*\"?\.\[torch\]\"?(\s|$)", runs):
        errors.append('Dockerfile: the package is installed with `pip install ".[torch]"`')
    copies = [a for entries in stages.values() for i, a in entries if i == "COPY"]
    if not any("docker/healthcheck.py" in c and "stageserve-healthcheck" in c for c in copies):
        errors.append("Dockerfile: install docker/healthcheck.py as stageserve-healthcheck")
    return errors


# --------------------------------------------------------------------------- main

SECTIONS = {
    "dockerfile": check_dockerfile,
    "dashboards": check_dashboards,
    "grafana": check_grafana_provisioning,
    "compose": check_compose,
    "prometheus": check_prometheus,
    "k8s": check_k8s,
    "k8s-replicas": check_k8s_replicas,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sections", nargs="*", help=f"any of {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--compose-config", type=Path, help="`docker compose config --format json`")
    p.add_argument("--emit-promql-rules", type=Path, help="write dashboard queries as rules")
    args = p.parse_args(argv)
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    failed = False
    # --emit-promql-rules alone only writes the file (promtool then judges the syntax).
    for name in args.sections or ([] if args.emit_promql_rules else SECTIONS):
        errors = SECTIONS[name]()
        if name == "compose" and args.compose_config:
            errors += [f"[compose config] {e}" for e in check_compose(args.compose_config)]
        print(f"{name}: {'ok' if not errors else f'{len(errors)} error(s)'}")
        for e in errors:
            print(f"  - {e}")
        failed |= bool(errors)
    if args.emit_promql_rules:
        queries = dashboard_queries()
        args.emit_promql_rules.write_text(promql_rules_file(queries), encoding="utf-8")
        print(f"wrote {len(queries)} dashboard queries to {args.emit_promql_rules}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
