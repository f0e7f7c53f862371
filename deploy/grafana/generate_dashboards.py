#!/usr/bin/env python3
"""Write StageServe's Grafana dashboards (deploy/grafana/dashboards/*.json).

    python deploy/grafana/generate_dashboards.py          # rewrite the JSON files
    python deploy/grafana/generate_dashboards.py --check  # exit 1 if they are stale

The JSON files are what Grafana loads (provisioning, or Dashboards > Import);
this script is their source. tests/unit/test_deploy.py fails when the JSON
files differ from what this script writes, and checks every PromQL expression
against the metric catalogue in deploy/checks.py.

Two dashboards:

- ``stageserve-triton.json``: Triton's own metric families and labels
  (``nv_inference_*``, ``nv_cpu_*``, ``nv_gpu_*``), so the view is the one a
  Triton user knows, per model.
- ``stageserve-stages.json``: StageServe's per-stage metrics, laid out along
  the path of a request: gateway -> scheduler -> rate limiter -> worker.

Every query sums over scrape targets (``instance``) by model, so replicas of a
stage add up.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT_DIR = HERE / "dashboards"

DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
M = 'model=~"$model"'  # the model template variable, used by every per-model query
# The schedulers' series of a gauge the gateways also serve as the stack's total
# (nv_inference_pending_request_count): a sum over every stage would count it twice.
SCHEDULERS = 'job="scheduler"'

SCHEMA_VERSION = 39  # Grafana 11.x


# --------------------------------------------------------------------------- builders


class Layout:
    """Places panels on Grafana's 24-column grid, row by row."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.next_id = 1
        self.x = 0
        self.y = 0
        self.row_h = 0

    def _id(self) -> int:
        i = self.next_id
        self.next_id += 1
        return i

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {
                "type": "row",
                "id": self._id(),
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
            self.x = 0
            self.row_h = 0

    def add(self, panel: dict, w: int = 12, h: int = 8) -> None:
        if self.x + w > 24:
            self._newline()
        panel["id"] = self._id()
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)
        if self.x >= 24:
            self._newline()


def target(expr: str, legend: str, ref: str, **extra) -> dict:
    t = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}
    t.update(extra)
    return t


def _targets(queries: list[tuple[str, str]]) -> list[dict]:
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(queries)]


def timeseries(
    title: str,
    description: str,
    queries: list[tuple[str, str]],
    unit: str,
    stack: bool = False,
    draw: str = "line",
    min_zero: bool = True,
) -> dict:
    custom = {
        "drawStyle": draw,
        "lineWidth": 1,
        "fillOpacity": 30 if stack else 10,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
    }
    defaults: dict = {"unit": unit, "custom": custom}
    if min_zero:
        defaults["min"] = 0
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {
                "displayMode": "table",
                "placement": "bottom",
                "showLegend": True,
                "calcs": ["mean", "max", "lastNotNull"],
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": _targets(queries),
    }


def stat(title: str, description: str, expr: str, unit: str, thresholds=None) -> dict:
    steps = thresholds or [{"color": "green", "value": None}]
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "thresholds": {"mode": "absolute", "steps": steps},
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "textMode": "auto",
            "orientation": "auto",
        },
        "targets": [target(expr, "", "A", instant=False)],
    }


def heatmap(title: str, description: str, expr: str, unit: str) -> dict:
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {
            "calculate": False,
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
            "yAxis": {"axisPlacement": "left", "unit": unit},
            "rowsFrame": {"layout": "auto"},
            "tooltip": {"mode": "single", "yHistogram": True},
            "legend": {"show": True},
        },
        "targets": [target(expr, "{{le}}", "A", format="heatmap")],
    }


def table(title: str, description: str, queries: list[tuple[str, str]], unit: str) -> dict:
    targets = [
        target(expr, legend, chr(ord("A") + i), format="table", instant=True, range=False)
        for i, (expr, legend) in enumerate(queries)
    ]
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"showHeader": True, "cellHeight": "sm"},
        "transformations": [
            {"id": "organize", "options": {"excludeByName": {"Time": True}}},
        ],
        "targets": targets,
    }


def variables(model_query_metric: str) -> dict:
    definition = f"label_values({model_query_metric}, model)"
    return {
        "list": [
            {
                "name": "datasource",
                "label": "Data source",
                "type": "datasource",
                "query": "prometheus",
                "current": {"selected": True, "text": "Prometheus", "value": "prometheus"},
                "hide": 0,
                "includeAll": False,
                "multi": False,
                "refresh": 1,
                "regex": "",
                "options": [],
            },
            {
                "name": "model",
                "label": "Model",
                "type": "query",
                "datasource": DS,
                "definition": definition,
                "query": {"query": definition, "refId": "model"},
                "refresh": 2,
                "includeAll": True,
                "allValue": ".*",
                "multi": True,
                "sort": 1,
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                "hide": 0,
                "regex": "",
                "options": [],
            },
        ]
    }


def dashboard(uid: str, title: str, description: str, layout: Layout, model_metric: str) -> dict:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["stageserve", "triton", "inference"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [
            {
                "title": "StageServe dashboards",
                "type": "dashboards",
                "tags": ["stageserve"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "annotations": {"list": []},
        "templating": variables(model_metric),
        "panels": layout.panels,
    }


# --------------------------------------------------------------------------- Triton view


def _per_success(counter: str) -> str:
    """Average per successful request: Triton's documented way to read its *_us counters."""
    return (
        f"sum by (model) (rate({counter}{{{M}}}[{RATE}]))\n"
        f"/\nsum by (model) (rate(nv_inference_request_success{{{M}}}[{RATE}]))"
    )


def triton_dashboard() -> dict:
    L = Layout()
    L.row("Traffic")
    L.add(
        timeseries(
            "Throughput (inferences/s)",
            "rate(nv_inference_count): inferences per second, a batch of n counts n. "
            "Summed over every gateway.",
            [(f"sum by (model) (rate(nv_inference_count{{{M}}}[{RATE}]))", "{{model}}")],
            "ops",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "Successful requests/s",
            "rate(nv_inference_request_success) per model.",
            [
                (
                    f"sum by (model) (rate(nv_inference_request_success{{{M}}}[{RATE}]))",
                    "{{model}}",
                )
            ],
            "reqps",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "Failed requests/s by reason",
            "rate(nv_inference_request_failure) per model and Triton failure reason "
            "(REJECTED, CANCELED, BACKEND, OTHER).",
            [
                (
                    f"sum by (model, reason) (rate(nv_inference_request_failure{{{M}}}[{RATE}]))",
                    "{{model}} {{reason}}",
                )
            ],
            "reqps",
        ),
        w=8,
    )
    L.add(
        stat(
            "Success ratio",
            "Successful / (successful + failed) requests over the selected models "
            "(no failure series yet counts as no failures).",
            f"sum(rate(nv_inference_request_success{{{M}}}[{RATE}]))\n/\n"
            f"(sum(rate(nv_inference_request_success{{{M}}}[{RATE}]))"
            f" + (sum(rate(nv_inference_request_failure{{{M}}}[{RATE}])) or vector(0)))",
            "percentunit",
            [
                {"color": "red", "value": None},
                {"color": "orange", "value": 0.99},
                {"color": "green", "value": 0.999},
            ],
        ),
        w=6,
        h=6,
    )
    L.add(
        stat(
            "Throughput",
            "Inferences per second over the selected models.",
            f"sum(rate(nv_inference_count{{{M}}}[{RATE}]))",
            "ops",
        ),
        w=6,
        h=6,
    )
    L.add(
        stat(
            "Pending requests",
            "nv_inference_pending_request_count: requests queued in the schedulers, not yet "
            "executing (summed over the schedulers: each gateway serves the stack's total too, "
            "as a Triton metrics port does).",
            f"sum(nv_inference_pending_request_count{{{SCHEDULERS},{M}}})",
            "short",
        ),
        w=6,
        h=6,
    )
    L.add(
        stat(
            "Avg request latency",
            "rate(nv_inference_request_duration_us) / rate(nv_inference_request_success).",
            f"sum(rate(nv_inference_request_duration_us{{{M}}}[{RATE}]))\n/\n"
            f"sum(rate(nv_inference_request_success{{{M}}}[{RATE}]))",
            "µs",
        ),
        w=6,
        h=6,
    )

    L.row("Latency (average per request, Triton's cumulative microsecond counters)")
    L.add(
        timeseries(
            "Avg request latency",
            "End-to-end time in the server per successful request: "
            "rate(nv_inference_request_duration_us) / rate(nv_inference_request_success).",
            [(_per_success("nv_inference_request_duration_us"), "{{model}}")],
            "µs",
        )
    )
    L.add(
        timeseries(
            "Avg queue time",
            "Time a request waited in the scheduler's queue before its batch started "
            "executing: rate(nv_inference_queue_duration_us) / rate(nv_inference_request_success).",
            [(_per_success("nv_inference_queue_duration_us"), "{{model}}")],
            "µs",
        )
    )
    L.add(
        timeseries(
            "Avg compute time by phase",
            "Compute input (copy in), infer (the backend) and output (copy out) per request.",
            [
                (_per_success("nv_inference_compute_input_duration_us"), "{{model}} input"),
                (_per_success("nv_inference_compute_infer_duration_us"), "{{model}} infer"),
                (_per_success("nv_inference_compute_output_duration_us"), "{{model}} output"),
            ],
            "µs",
        )
    )
    L.add(
        timeseries(
            "Where the time goes (all selected models)",
            "Average per request, stacked: queue + compute input + infer + output. "
            "The gap to the request latency above is gateway and transport time.",
            [
                (
                    f"sum(rate(nv_inference_{phase}_duration_us{{{M}}}[{RATE}]))\n/\n"
                    f"sum(rate(nv_inference_request_success{{{M}}}[{RATE}]))",
                    label,
                )
                for phase, label in (
                    ("queue", "queue"),
                    ("compute_input", "compute input"),
                    ("compute_infer", "compute infer"),
                    ("compute_output", "compute output"),
                )
            ],
            "µs",
            stack=True,
        )
    )

    L.row("Batching")
    L.add(
        timeseries(
            "Batch efficiency (inferences per execution)",
            "rate(nv_inference_count) / rate(nv_inference_exec_count): the average batch "
            "size the scheduler formed. 1 means no batching; it grows with load.",
            [
                (
                    f"sum by (model) (rate(nv_inference_count{{{M}}}[{RATE}]))\n/\n"
                    f"sum by (model) (rate(nv_inference_exec_count{{{M}}}[{RATE}]))",
                    "{{model}}",
                )
            ],
            "short",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "Executions/s",
            "rate(nv_inference_exec_count): model executions (batches) per second.",
            [(f"sum by (model) (rate(nv_inference_exec_count{{{M}}}[{RATE}]))", "{{model}}")],
            "ops",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "Pending requests",
            "nv_inference_pending_request_count per model, summed over schedulers (each "
            "gateway serves the stack's total too): the backlog that calls for more workers "
            "(the worker autoscaler in deploy/k8s reads the same number as "
            "stageserve_scheduler_queue_depth).",
            [
                (
                    f"sum by (model) (nv_inference_pending_request_count{{{SCHEDULERS},{M}}})",
                    "{{model}}",
                )
            ],
            "short",
        ),
        w=8,
    )

    L.row("Models")
    L.add(
        table(
            "Model load time",
            "nv_model_load_duration_secs: seconds the last load of each model version took.",
            [(f"max by (model, version) (nv_model_load_duration_secs{{{M}}})", "")],
            "s",
        ),
        w=24,
        h=6,
    )

    L.row("CPU and GPU")
    L.add(
        timeseries(
            "CPU utilization",
            "nv_cpu_utilization (0-1) as each StageServe process sees its host.",
            [("avg by (job, instance) (nv_cpu_utilization)", "{{job}} {{instance}}")],
            "percentunit",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "CPU memory",
            "nv_cpu_memory_used_bytes against nv_cpu_memory_total_bytes, per process' host.",
            [
                ("max by (instance) (nv_cpu_memory_used_bytes)", "used {{instance}}"),
                ("max by (instance) (nv_cpu_memory_total_bytes)", "total {{instance}}"),
            ],
            "bytes",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "GPU utilization",
            "nv_gpu_utilization (0-1) per GPU (label gpu_uuid), from the GPU workers.",
            [("avg by (gpu_uuid) (nv_gpu_utilization)", "{{gpu_uuid}}")],
            "percentunit",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "GPU memory",
            "nv_gpu_memory_used_bytes against nv_gpu_memory_total_bytes per GPU.",
            [
                ("max by (gpu_uuid) (nv_gpu_memory_used_bytes)", "used {{gpu_uuid}}"),
                ("max by (gpu_uuid) (nv_gpu_memory_total_bytes)", "total {{gpu_uuid}}"),
            ],
            "bytes",
        )
    )
    L.add(
        timeseries(
            "GPU power",
            "nv_gpu_power_usage in watts per GPU.",
            [("max by (gpu_uuid) (nv_gpu_power_usage)", "{{gpu_uuid}}")],
            "watt",
        )
    )
    return dashboard(
        "stageserve-triton",
        "StageServe / Models (Triton metrics)",
        "Per-model view from Triton's metric names and labels (nv_inference_*, nv_cpu_*, "
        "nv_gpu_*): throughput, failures, average latency split into queue and compute, "
        "batch efficiency, backlog, CPU and GPU.",
        L,
        "nv_inference_request_success",
    )


# --------------------------------------------------------------------------- stage view


def _quantile(q: float, metric: str, by: str, matchers: str = M) -> str:
    return (
        f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{matchers}}}[{RATE}])))"
    )


def _mean(metric: str, by: str, matchers: str = M) -> str:
    return (
        f"sum by ({by}) (rate({metric}_sum{{{matchers}}}[{RATE}]))\n/\n"
        f"sum by ({by}) (rate({metric}_count{{{matchers}}}[{RATE}]))"
    )


def stages_dashboard() -> dict:
    L = Layout()
    req = "stageserve_request_duration_seconds"
    L.row("The request path: where the time goes")
    L.add(
        timeseries(
            "p50 by phase",
            "Median of stageserve_request_duration_seconds per phase: request (end to end "
            "at the gateway), queue (scheduler), compute_input / compute_infer / "
            "compute_output (worker).",
            [(_quantile(0.5, req, "phase"), "{{phase}}")],
            "s",
        )
    )
    L.add(
        timeseries(
            "p99 by phase",
            "99th percentile of stageserve_request_duration_seconds per phase.",
            [(_quantile(0.99, req, "phase"), "{{phase}}")],
            "s",
        )
    )
    L.add(
        timeseries(
            "Mean time per request, stacked by stage",
            "Mean of each phase (queue, compute_*) plus what is left of the end-to-end "
            "request time: gateway validation, the hops between stages and rate-limiter "
            "grants. The stack's top is the mean request latency.",
            [
                (_mean(req, "phase", f'{M}, phase!="request"'), "{{phase}}"),
                (
                    f'(sum(rate({req}_sum{{{M}, phase="request"}}[{RATE}]))\n'
                    f'- sum(rate({req}_sum{{{M}, phase!="request"}}[{RATE}])))\n/\n'
                    f'sum(rate({req}_count{{{M}, phase="request"}}[{RATE}]))',
                    "gateway + transport",
                ),
            ],
            "s",
            stack=True,
        )
    )
    L.add(
        timeseries(
            "p99 request latency by model",
            "99th percentile of the end-to-end request time per model.",
            [(_quantile(0.99, req, "model", f'{M}, phase="request"'), "{{model}}")],
            "s",
        )
    )

    L.row("Gateway")
    rpc = "stageserve_gateway_rpc_duration_seconds"
    L.add(
        timeseries(
            "RPCs/s by method and status",
            "Public GRPCInferenceService calls per second by method and gRPC status code "
            "(from stageserve_gateway_rpc_duration_seconds_count).",
            [(f"sum by (method, code) (rate({rpc}_count[{RATE}]))", "{{method}} {{code}}")],
            "reqps",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "RPC p99 by method",
            "99th percentile of public RPC duration by method.",
            [(_quantile(0.99, rpc, "method", ""), "{{method}}")],
            "s",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "In-flight requests",
            "stageserve_gateway_inflight_requests per model, summed over gateways.",
            [(f"sum by (model) (stageserve_gateway_inflight_requests{{{M}}})", "{{model}}")],
            "short",
        ),
        w=8,
    )
    http = "stageserve_http_request_duration_seconds"
    L.add(
        timeseries(
            "HTTP requests/s by endpoint and status",
            "Public HTTP/REST (KServe v2) requests per second by endpoint and HTTP status "
            "(from stageserve_http_request_duration_seconds_count).",
            [
                (
                    f"sum by (endpoint, status) (rate({http}_count[{RATE}]))",
                    "{{endpoint}} {{status}}",
                )
            ],
            "reqps",
        ),
    )
    L.add(
        timeseries(
            "HTTP p99 by endpoint",
            "99th percentile of public HTTP/REST request duration by endpoint.",
            [(_quantile(0.99, http, "endpoint", ""), "{{endpoint}}")],
            "s",
        ),
    )

    L.row("Scheduler")
    L.add(
        timeseries(
            "Queue depth",
            "stageserve_scheduler_queue_depth: requests waiting for a batch slot, per model "
            "version, summed over schedulers. A queue that keeps growing needs workers.",
            [
                (
                    f"sum by (model, version) (stageserve_scheduler_queue_depth{{{M}}})",
                    "{{model}} v{{version}}",
                )
            ],
            "short",
        ),
        w=8,
    )
    bs = "stageserve_scheduler_batch_size"
    L.add(
        timeseries(
            "Batch size: mean and p99",
            "Requests per executed batch (stageserve_scheduler_batch_size). Batches form "
            "when an instance is free, so they grow under load.",
            [
                (_mean(bs, "model"), "mean {{model}}"),
                (_quantile(0.99, bs, "model"), "p99 {{model}}"),
            ],
            "short",
        ),
        w=8,
    )
    L.add(
        heatmap(
            "Batch size distribution",
            "Batches per second by size bucket (stageserve_scheduler_batch_size_bucket).",
            f"sum by (le) (rate({bs}_bucket{{{M}}}[{RATE}]))",
            "short",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "Models owned per scheduler",
            "stageserve_scheduler_shard_owned: the models whose queues each scheduler owns "
            "(schedulers sharded by model). A model appears under exactly one scheduler; "
            "after a scheduler joins, leaves or dies its models move within seconds.",
            [
                (
                    f"sum by (instance) (stageserve_scheduler_shard_owned{{{M}}})",
                    "{{instance}}",
                )
            ],
            "short",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "Shared-memory tensor slots in use",
            "stageserve_tensor_slots_in_use: slots of each gateway's and worker's shared-memory "
            "tensor region holding a tensor in transit (tensor_shm on). It returns to 0 when "
            "the stack is idle; a level that stays up is a leak.",
            [
                (
                    "sum by (instance, stage) (stageserve_tensor_slots_in_use)",
                    "{{stage}} {{instance}}",
                )
            ],
            "short",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "CUDA shared-memory copies",
            "stageserve_cuda_shm_copies_total: copies the gateway made between clients' CUDA "
            "shared-memory regions and host memory, per second: d2h an input read out of a "
            "region, h2d an output written into one; d2d a tensor a worker on the region's "
            "device read or wrote in place (docs/architecture.md).",
            [
                (
                    "sum by (direction) (rate(stageserve_cuda_shm_copies_total[1m]))",
                    "{{direction}}",
                )
            ],
            "ops",
        ),
        w=8,
    )

    L.add(
        timeseries(
            "Requests per internal stream message",
            "stageserve_stream_requests_total over stageserve_stream_messages_total, by link: "
            "how many requests each message of an internal stream carried (scheduler: "
            "gateway -> scheduler, packed by the gateway's write hold; worker: a batch per "
            "message). Each message costs CPU on both ends whatever it carries.",
            [
                (
                    "sum by (link) (rate(stageserve_stream_requests_total[1m])) / "
                    "sum by (link) (rate(stageserve_stream_messages_total[1m]))",
                    "{{link}}",
                )
            ],
            "short",
        ),
        w=8,
    )

    L.row("Rate limiter")
    wait = "stageserve_ratelimiter_wait_seconds"
    L.add(
        timeseries(
            "Grant wait p50 / p99",
            "Time an Acquire call waited for an execution grant (a free model instance): "
            "stageserve_ratelimiter_wait_seconds. Schedulers reuse the grants they hold and "
            "ask only for instances beyond them, so under load these calls wait for an "
            "instance to free up (or for their wait limit).",
            [
                (_quantile(0.5, wait, "model"), "p50 {{model}}"),
                (_quantile(0.99, wait, "model"), "p99 {{model}}"),
            ],
            "s",
        ),
        w=6,
    )
    L.add(
        timeseries(
            "Grants/s",
            "Execution grants handed out per second (stageserve_ratelimiter_grants_total). "
            "A scheduler reuses a grant for the next batches on that instance for a short "
            "while, so this counts instance hand-overs: far fewer than executions (except "
            "grants that hold rate_limiter resources: one per execution).",
            [
                (
                    f"sum by (model) (rate(stageserve_ratelimiter_grants_total{{{M}}}[{RATE}]))",
                    "{{model}}",
                )
            ],
            "ops",
        ),
        w=6,
    )
    inst = "stageserve_ratelimiter_instances"
    L.add(
        timeseries(
            "Instances free / busy",
            "stageserve_ratelimiter_instances by state. The registry lives in Redis, so "
            "every rate limiter replica reports the same numbers: max, not sum, over them.",
            [
                (
                    f"sum by (model, state) (max by (model, version, state) ({inst}{{{M}}}))",
                    "{{model}} {{state}}",
                )
            ],
            "short",
            stack=True,
        ),
        w=6,
    )
    L.add(
        timeseries(
            "Instance utilization",
            "busy / (free + busy) instances per model: near 1 means requests wait for "
            "instances; add workers (or instance_group count).",
            [
                (
                    f'sum by (model) (max by (model, version) ({inst}{{{M}, state="busy"}}))\n/\n'
                    f"sum by (model) (max by (model, version, state) ({inst}{{{M}}}))",
                    "{{model}}",
                )
            ],
            "percentunit",
        ),
        w=6,
    )
    gw = "stageserve_ratelimiter_grant_wait_seconds"
    L.add(
        timeseries(
            "Grant wait by priority p99",
            "Time a granted Acquire waited, by model and the rate_limiter priority of the "
            "instance it got (stageserve_ratelimiter_grant_wait_seconds). With "
            "--rate-limit=execution_count, a larger priority value waits longer at a "
            "contended resource (Triton's scaled priority).",
            [(_quantile(0.99, gw, "model, priority"), "{{model}} priority {{priority}}")],
            "s",
        ),
        w=12,
    )
    res = "stageserve_ratelimiter_resources"
    L.add(
        timeseries(
            "Resources held / available",
            "stageserve_ratelimiter_resources per resource and device (a worker's device, or "
            "global): held counts and available counts (the largest count any instance asks "
            "for, or --rate-limit-resource). Counts live in Redis, so every rate limiter "
            "replica reports the same numbers: max, not sum, over them.",
            [
                (
                    f"max by (resource, device, state) ({res})",
                    "{{resource}}@{{device}} {{state}}",
                )
            ],
            "short",
        ),
        w=12,
    )

    L.row("Workers")
    wc = "stageserve_worker_compute_seconds"
    L.add(
        timeseries(
            "Compute time by phase (mean per batch)",
            "stageserve_worker_compute_seconds per phase (input, infer, output), "
            "mean per executed batch.",
            [(_mean(wc, "model, phase"), "{{model}} {{phase}}")],
            "s",
            stack=True,
        ),
        w=8,
    )
    L.add(
        timeseries(
            "Infer p99 by worker and model instance",
            "99th percentile of the infer phase per worker (instance = the worker's "
            "metrics address) and model instance (model_instance).",
            [
                (
                    _quantile(0.99, wc, "instance, model_instance", f'{M}, phase="infer"'),
                    "{{instance}} {{model_instance}}",
                )
            ],
            "s",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "Batches/s per worker",
            "Executed batches per second on each worker: how evenly the load spreads.",
            [
                (
                    f'sum by (instance) (rate({wc}_count{{{M}, phase="infer"}}[{RATE}]))',
                    "{{instance}}",
                )
            ],
            "ops",
        ),
        w=8,
    )

    L.row("Stage-to-stage RPCs")
    srpc = "stageserve_stage_rpc_duration_seconds"
    L.add(
        timeseries(
            "Internal RPC p99",
            "stageserve_stage_rpc_duration_seconds: calls between stages (service -> peer, "
            "method), e.g. scheduler -> ratelimiter Acquire, scheduler -> worker Execute.",
            [
                (
                    _quantile(0.99, srpc, "service, peer, method", ""),
                    "{{service}} → {{peer}} {{method}}",
                )
            ],
            "s",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "Internal RPCs/s",
            "Calls per second between stages.",
            [
                (
                    f"sum by (service, peer, method) (rate({srpc}_count[{RATE}]))",
                    "{{service}} → {{peer}} {{method}}",
                )
            ],
            "reqps",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "Internal RPC errors/s",
            "stageserve_stage_rpc_errors_total by caller, peer, method and gRPC code; "
            "UNAVAILABLE usually means a stage restarted or a worker died.",
            [
                (
                    "sum by (service, peer, method, code) "
                    f"(rate(stageserve_stage_rpc_errors_total[{RATE}]))",
                    "{{service}} → {{peer}} {{method}} {{code}}",
                )
            ],
            "reqps",
        ),
        w=8,
    )

    L.row("Processes")
    L.add(
        timeseries(
            "Targets up",
            "Scrape targets that answer, per stage (job). Workers count one per replica.",
            [("sum by (job) (up)", "{{job}}")],
            "short",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "CPU per stage",
            "CPU cores used by each stage's processes (process_cpu_seconds_total).",
            [("sum by (job) (rate(process_cpu_seconds_total[$__rate_interval]))", "{{job}}")],
            "short",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "Resident memory per stage",
            "process_resident_memory_bytes summed over each stage's processes.",
            [("sum by (job) (process_resident_memory_bytes)", "{{job}}")],
            "bytes",
        ),
        w=8,
    )
    return dashboard(
        "stageserve-stages",
        "StageServe / Stages",
        "The path of a request through StageServe's stages: per-phase latency "
        "percentiles, gateway RPCs, scheduler queues and batch sizes, rate-limiter "
        "waits and instances, worker compute, stage-to-stage RPCs and errors.",
        L,
        "stageserve_request_duration_seconds_count",
    )


DASHBOARDS = {
    "stageserve-triton.json": triton_dashboard,
    "stageserve-stages.json": stages_dashboard,
}


def render() -> dict[str, str]:
    return {
        name: json.dumps(build(), indent=2, ensure_ascii=False) + "\n"
        for name, build in DASHBOARDS.items()
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the JSON files are stale")
    args = p.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = OUT_DIR / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print("stale (run python deploy/grafana/generate_dashboards.py): " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
