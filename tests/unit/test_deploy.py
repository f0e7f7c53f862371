"""Deployment files agree with the code: compose.yaml, Dockerfile, Prometheus,
Grafana dashboards and Kubernetes manifests.

The checks live in deploy/checks.py (also run by scripts/validate_deploy.sh,
which adds docker-compose, promtool, hadolint and kubernetes-validate); these
tests run them plus negative cases that prove the checks catch mistakes.
Offline and fast: no Docker, no network, only a local gRPC server for the
health-check script.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.script_modules import load_script

ROOT = Path(__file__).resolve().parents[2]


checks = load_script("stageserve_deploy_checks", "deploy/checks.py")
dashboards = load_script("stageserve_deploy_dashboards", "deploy/grafana/generate_dashboards.py")
healthcheck = load_script("stageserve_deploy_healthcheck", "docker/healthcheck.py")


# --------------------------------------------------------------------------- the files pass


@pytest.mark.parametrize("section", list(checks.SECTIONS))
def test_deploy_section_is_consistent(section):
    errors = checks.SECTIONS[section]()
    assert errors == [], "\n".join(errors)


def test_dashboard_json_is_generated_from_the_script():
    for name, text in dashboards.render().items():
        on_disk = (checks.DASHBOARD_DIR / name).read_text(encoding="utf-8")
        assert on_disk == text, f"{name} is stale: python deploy/grafana/generate_dashboards.py"


def test_two_dashboards_with_model_variable():
    uids = set()
    for path in checks.dashboard_files():
        dash = json.loads(path.read_text(encoding="utf-8"))
        uids.add(dash["uid"])
        names = {v["name"] for v in dash["templating"]["list"]}
        assert {"datasource", "model"} <= names, path.name
    assert uids == {"stageserve-triton", "stageserve-stages"}


def test_triton_dashboard_uses_tritons_own_names():
    dash = json.loads((checks.DASHBOARD_DIR / "stageserve-triton.json").read_text())
    exprs = " ".join(t["expr"] for p in checks._panels(dash) for t in p.get("targets", []))
    for name in (
        "nv_inference_count",
        "nv_inference_exec_count",
        "nv_inference_request_success",
        "nv_inference_request_failure",
        "nv_inference_request_duration_us",
        "nv_inference_queue_duration_us",
        "nv_inference_compute_infer_duration_us",
        "nv_inference_pending_request_count",
    ):
        assert name in exprs
    assert not re.search(r"nv_\w+_total\b", exprs)  # Triton's counters have no _total suffix


@pytest.mark.parametrize("service", sorted(checks.COMPOSE_STAGE_SERVICES) + ["examples"])
def test_compose_command_parses_with_stageserve_cli(service):
    svc = checks.load_compose()["services"][service]
    args, err = checks.parse_stageserve(checks._command(svc), checks._environment(svc))
    assert err == ""
    expected = checks.COMPOSE_STAGE_SERVICES.get(service, "make-examples")
    assert args.command == expected
    if expected != "make-examples":
        stage = expected
        assert checks._port_of(checks.grpc_address(args)) == checks.GRPC_PORTS[stage]
        assert args.metrics_port == checks.METRICS_PORTS[stage]


def test_compose_workers_scale_and_gpu_is_a_profile():
    services = checks.load_compose()["services"]
    for name in ("worker", "worker-gpu"):
        assert "container_name" not in services[name]
        assert not services[name].get("ports")
    assert "profiles" not in services["worker"]
    assert services["worker-gpu"]["profiles"] == ["gpu"]
    (device,) = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def test_catalogue_labels_are_the_exported_ones():
    """deploy/checks.py's catalogue matches stageserve/telemetry.py, label for label,
    and no exported label is a target label (Prometheus would store it as exported_*)."""
    from prometheus_client import Counter
    from prometheus_client.metrics import MetricWrapperBase

    from stageserve import telemetry

    seen = 0  # prometheus_client has no public accessor for a metric's name and labels
    for metric in vars(telemetry).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        name = metric._name + ("_total" if isinstance(metric, Counter) else "")
        assert name in checks.METRICS, name
        assert set(metric._labelnames) == checks.METRICS[name].labels, name
        assert not set(metric._labelnames) & checks.TARGET_LABELS, name
        seen += 1
    assert seen >= 10
    assert "model_instance" in checks.METRICS["stageserve_worker_compute_seconds"].labels


def test_prometheus_checker_rejects_scrape_time_label_renames(tmp_path, monkeypatch):
    (cfg,) = checks.load_yaml_docs(checks.PROMETHEUS_FILE)
    worker = next(j for j in cfg["scrape_configs"] if j["job_name"] == "worker")
    worker["metric_relabel_configs"] = [{"regex": "exported_instance", "action": "labeldrop"}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.setattr(checks, "PROMETHEUS_FILE", path)
    errors = checks.check_prometheus()
    assert any("relabels exported_* labels" in e for e in errors), errors
    clash = checks._fam("stageserve_clash", "gauge", "instance")
    monkeypatch.setitem(checks.METRICS, clash.name, clash)
    assert any("collides" in e for e in checks.check_prometheus())


def test_metrics_ports_agree_everywhere():
    (prom,) = checks.load_yaml_docs(checks.PROMETHEUS_FILE)
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    for stage in ("gateway", "scheduler", "ratelimiter"):
        assert jobs[stage]["static_configs"][0]["targets"] == [
            f"{stage}:{checks.METRICS_PORTS[stage]}"
        ]
    assert jobs["worker"]["dns_sd_configs"][0]["port"] == checks.METRICS_PORTS["worker"]
    docs, errors = checks.load_k8s()
    assert errors == []
    seen = {}
    for objs in docs.values():
        for o in objs:
            if o["kind"] in ("Deployment", "DaemonSet") and o["metadata"]["name"] != "redis":
                tmpl = o["spec"]["template"]
                stage = tmpl["metadata"]["labels"]["app.kubernetes.io/component"]
                seen[stage] = int(tmpl["metadata"]["annotations"]["prometheus.io/port"])
    assert seen == checks.METRICS_PORTS


def test_k8s_probes_grpc_on_internal_stages_http_on_the_gateway():
    docs, _ = checks.load_k8s()
    n = 0
    for objs in docs.values():
        for o in objs:
            if o["kind"] not in ("Deployment", "DaemonSet"):
                continue
            for c in o["spec"]["template"]["spec"]["containers"]:
                if not c["image"].startswith("stageserve"):
                    continue
                stage = c["args"][0]
                if stage == "gateway":
                    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
                    for probe, path in checks.GATEWAY_HTTP_PROBES.items():
                        assert c[probe]["httpGet"]["path"] == path
                        assert ports[c[probe]["httpGet"]["port"]] == checks.GATEWAY_HTTP_PORT
                else:
                    for probe in ("readinessProbe", "livenessProbe"):
                        assert c[probe]["grpc"]["port"] == checks.GRPC_PORTS[stage]
                n += 1
    assert n == 5  # gateway, scheduler, ratelimiter, CPU and GPU workers


def test_k8s_gpu_worker_is_a_daemonset_with_one_gpu():
    (ds,) = [o for o in checks.load_yaml_docs(checks.K8S_DIR / "worker-gpu.yaml")]
    assert ds["kind"] == "DaemonSet"
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert ds["spec"]["template"]["spec"]["nodeSelector"]


# ------------------------------------------------------------------ the checks catch mistakes


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ('rate(nv_inference_count_total{model=~"x"}[5m])', "unknown metric"),
        ('rate(nv_inference_count{modle="x"}[5m])', "no label 'modle'"),
        ("rate(nv_inference_pending_request_count[5m])", "rate() of gauge"),
        ("sum(nv_inference_count)", "without rate()"),
        (
            "histogram_quantile(0.9, sum by (model) "
            "(rate(stageserve_request_duration_seconds_bucket[5m])))",
            "without grouping by le",
        ),
        ('rate(stageserve_request_duration_seconds_count{phase="compute"}[5m])', "not one of"),
        ('rate(stageserve_worker_compute_seconds_count{instance="0"}[5m])', ""),
        ("sum by (gpu) (nv_gpu_utilization)", "groups by 'gpu'"),
        ("histogram_quantil(0.5, x)", "unknown function"),
        ("sum(rate(nv_inference_count[5m])", "unbalanced"),
    ],
)
def test_promql_checker_catches(expr, message):
    errors = checks.check_promql(expr)
    if message:
        assert any(message in e for e in errors), errors
    else:  # `instance` is always a (target) label: allowed
        assert errors == [], errors


def test_promql_checker_accepts_dashboard_style_queries():
    expr = (
        "histogram_quantile(0.99, sum by (le, instance, model_instance) (rate("
        'stageserve_worker_compute_seconds_bucket{model=~"grafanavar", phase="infer"}[5m])))'
    )
    assert checks.check_promql(expr) == []
    plain, errs = checks.substitute_grafana_vars("rate(x[$__rate_interval]) $nope", {"model"})
    assert "5m" in plain and errs == ["uses undefined variable $nope"]


def _compose_json(tmp_path: Path, edit) -> Path:
    compose = copy.deepcopy(checks.load_compose())
    edit(compose["services"])
    path = tmp_path / "compose.json"
    path.write_text(json.dumps(compose))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s["scheduler"]["command"].append("--no-such-flag"), "unrecognized arguments"),
        (lambda s: s["ratelimiter"]["command"].__setitem__(-1, "9999"), "--metrics-port 9999"),
        (lambda s: s["worker"].__setitem__("container_name", "w"), "no container_name"),
        (lambda s: s["worker"]["command"].extend(["--advertise", "w:9003"]), "no --advertise"),
        (lambda s: s["worker-gpu"].pop("profiles"), "profile 'gpu'"),
        (lambda s: s["worker-gpu"].pop("deploy"), "driver nvidia"),
        (lambda s: s["gateway"]["environment"].pop("STAGESERVE_SCHEDULER"), "no scheduler"),
        (lambda s: s["worker"].__setitem__("volumes", []), "must mount"),
        (lambda s: s["gateway"]["healthcheck"].__setitem__("test", ["CMD", "true"]), "healthcheck"),
        (lambda s: s["examples"].__setitem__("command", ["make-examples", "/x"]), "writes /x"),
        (lambda s: s["gateway-extra"].pop("network_mode"), "network_mode service:gateway"),
        (lambda s: s["gateway"]["command"].__setitem__(-1, "false"), "--reuse-http-port true"),
        (lambda s: s["gateway-extra"]["command"].__setitem__(8, "8002"), "--metrics-port 0"),
        (lambda s: s["gateway-extra"].pop("deploy"), "deploy.replicas"),
        (lambda s: s["gateway-extra"].__setitem__("ports", ["8001:8001"]), "publish no ports"),
        (lambda s: s["scheduler"].pop("deploy"), "STAGESERVE_SCHEDULERS"),
        (lambda s: s["scheduler"].__setitem__("container_name", "s"), "no container_name"),
        (lambda s: s["scheduler"]["command"].extend(["--scheduler-id", "s"]), "--scheduler-id"),
        (lambda s: s["scheduler"]["command"].extend(["--advertise", "s:9001"]), "--advertise"),
    ],
)
def test_compose_checker_catches(tmp_path, edit, message):
    errors = checks.check_compose(_compose_json(tmp_path, edit))
    assert any(message in e for e in errors), errors


def _k8s_copy(tmp_path: Path, monkeypatch, file: str, edit) -> None:
    target = tmp_path / "k8s"
    shutil.copytree(checks.K8S_DIR, target)
    docs = checks.load_yaml_docs(target / file)
    edit(docs)
    (target / file).write_text(yaml.safe_dump_all(docs))
    monkeypatch.setattr(checks, "K8S_DIR", target)
    monkeypatch.setattr(checks, "ADAPTER_VALUES", target / "prometheus-adapter" / "values.yaml")


def _container(docs, kind="Deployment"):
    obj = next(d for d in docs if d["kind"] == kind)
    return obj["spec"]["template"]["spec"]["containers"][0], obj


@pytest.mark.parametrize(
    ("file", "edit", "message"),
    [
        (
            "scheduler.yaml",
            lambda d: _container(d)[0]["readinessProbe"]["grpc"].__setitem__("port", 9101),
            "readinessProbe must be a gRPC probe on port 9001",
        ),
        (
            "gateway.yaml",
            lambda d: _container(d)[1]["spec"]["template"]["metadata"]["annotations"].__setitem__(
                "prometheus.io/port", "9090"
            ),
            "prometheus.io/port",
        ),
        (
            "gateway.yaml",
            lambda d: _container(d)[0]["readinessProbe"]["httpGet"].__setitem__(
                "path", "/v2/health/live"
            ),
            "readinessProbe must be an HTTP probe of /v2/health/ready",
        ),
        (
            "gateway.yaml",
            lambda d: next(o for o in d if o["kind"] == "Service")["spec"]["ports"].pop(0),
            "must expose the HTTP port 8000",
        ),
        (
            "worker-gpu.yaml",
            lambda d: _container(d, "DaemonSet")[0]["resources"]["limits"].pop("nvidia.com/gpu"),
            "nvidia.com/gpu must be 1",
        ),
        (
            "worker-cpu.yaml",
            lambda d: _container(d)[0]["args"].__setitem__(4, "worker:9003"),
            "$(POD_IP)",
        ),
        (
            "gateway.yaml",
            lambda d: next(o for o in d if o["kind"] == "HorizontalPodAutoscaler")["spec"][
                "metrics"
            ][0]["pods"]["metric"].__setitem__("name", "stageserve_scheduler_queue_depth"),
            "exported by scheduler pods",
        ),
        (
            "worker-cpu.yaml",
            lambda d: next(o for o in d if o["kind"] == "HorizontalPodAutoscaler")["spec"][
                "metrics"
            ].pop(),
            "CPU Resource metric",
        ),
        (
            "configmap.yaml",
            lambda d: d[0]["data"].__setitem__("STAGESERVE_SCHEDULER", "scheduler:9101"),
            "STAGESERVE_SCHEDULER",
        ),
    ],
)
def test_k8s_checker_catches(tmp_path, monkeypatch, file, edit, message):
    _k8s_copy(tmp_path, monkeypatch, file, edit)
    errors = checks.check_k8s()
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize(
    ("replicas", "message"),
    [
        ([], "no replicas count for the gateway"),
        ([{"name": "gateway", "count": 1}], "no replicas count for the scheduler"),
        ([{"name": "gateway", "count": 9}], "outside its HorizontalPodAutoscaler's 1..8"),
        ([{"name": "gateway", "count": 1}, {"name": "nope", "count": 1}], "not a Deployment"),
        ([{"name": "gateway", "count": 0}], "a count >= 1"),
    ],
)
def test_k8s_replica_counts_are_checked(tmp_path, monkeypatch, replicas, message):
    _k8s_copy(
        tmp_path,
        monkeypatch,
        "kustomization.yaml",
        lambda d: d[0].__setitem__("replicas", replicas),
    )
    errors = checks.check_k8s_replicas()
    assert any(message in e for e in errors), errors


def test_compose_and_k8s_take_the_scheduler_count():
    services = checks.load_compose()["services"]
    assert int(services["scheduler"]["deploy"]["replicas"]) == 1  # STAGESERVE_SCHEDULERS unset
    (kust,) = checks.load_yaml_docs(checks.K8S_DIR / "kustomization.yaml")
    assert {"name": "scheduler", "count": 1} in kust["replicas"]
    assert checks.check_k8s_replicas() == []


def test_k8s_scheduler_pods_advertise_their_own_address(tmp_path, monkeypatch):
    def edit(docs: list[dict]) -> None:
        args = docs[0]["spec"]["template"]["spec"]["containers"][0]["args"]
        args[args.index("--advertise") + 1] = "scheduler:9001"

    _k8s_copy(tmp_path, monkeypatch, "scheduler.yaml", edit)
    errors = checks.check_k8s_replicas()
    assert any("--advertise $(POD_IP)" in e for e in errors), errors


def test_compose_runs_extra_gateways_on_the_gateways_ports():
    services = checks.load_compose()["services"]
    extra = services["gateway-extra"]
    assert extra["network_mode"] == "service:gateway"
    assert int(extra["deploy"]["replicas"]) == 0  # STAGESERVE_EXTRA_GATEWAYS unset


def test_k8s_checker_sees_unlisted_manifest(tmp_path, monkeypatch):
    _k8s_copy(tmp_path, monkeypatch, "namespace.yaml", lambda d: None)
    (checks.K8S_DIR / "extra.yaml").write_text("apiVersion: v1\nkind: ConfigMap\n")
    _, errors = checks.load_k8s()
    assert any("extra.yaml is not listed" in e for e in errors)


# --------------------------------------------------------------------------- health-check script


@pytest.mark.parametrize(
    ("argv", "address"),
    [
        (["gateway", "--grpc-port", "8001", "--model-repository", "/models"], "127.0.0.1:8001"),
        (["scheduler", "--listen", "0.0.0.0:9001"], "0.0.0.0:9001"),
        (["ratelimiter"], "0.0.0.0:9002"),
        (["worker", "--listen", "0.0.0.0:9003", "--device", "cpu"], "0.0.0.0:9003"),
        (["make-examples", "/models"], None),
    ],
)
def test_healthcheck_finds_the_grpc_address_from_the_command(argv, address, monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://redis:6379/0")
    monkeypatch.setenv("STAGESERVE_RATELIMITER", "ratelimiter:9002")
    monkeypatch.setenv("STAGESERVE_SCHEDULER", "scheduler:9001")
    assert healthcheck._address_from_argv(argv) == address
    assert healthcheck._dialable("0.0.0.0:9001") == "127.0.0.1:9001"


def test_healthcheck_against_a_grpc_health_service():
    server = grpc.server(ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert healthcheck.main([f"127.0.0.1:{port}"]) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert healthcheck.main([f"127.0.0.1:{port}"]) == 1
    finally:
        server.stop(None)
    ok, text = healthcheck.check(f"127.0.0.1:{port}", timeout=1.0)
    assert not ok and "UNAVAILABLE" in text
