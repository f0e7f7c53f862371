"""The `stageserve` command: `up` runs the whole stack; one subcommand per service.

Flags follow tritonserver's names where they exist (--model-repository,
--grpc-port, --http-port, --allow-http, --metrics-port, --model-control-mode, --load-model,
--log-verbose), so a Triton command line carries over. Peer addresses and the
Redis URL also come from the environment (REDIS_URL, STAGESERVE_RATELIMITER,
STAGESERVE_SCHEDULER), which is how compose and Kubernetes configure them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, overload

from services.ratelimiter.options import (
    add_rate_limit_flags,
    rate_limit_argv,
    resource_overrides,
)
from stageserve import event_loop
from stageserve.autocomplete_options import DEFAULT_MAX_BATCH_SIZE, AutoComplete
from stageserve.cache_options import parse_cache_config
from stageserve.gpus import AUTO, parse_per_device, parse_workers
from stageserve.grpc_io import use_grpc_io
from stageserve.log_options import STAGES, add_log_flags, flag_bool, log_argv, log_settings_of
from stageserve.logs import setup_logging
from stageserve.scale_out import gateway_count, parse_gateways
from stageserve.scheduler_count import parse_schedulers, scheduler_count
from stageserve.security_options import add_flags as add_security_flags
from stageserve.security_options import (
    gateway_flags,
    http_restrictions_from,
    restrictions_from,
    tls_from,
)
from stageserve.settings import (
    GatewaySettings,
    SchedulerSettings,
    Settings,
    settings_from_env,
    with_flags,
)
from stageserve.tracing import TraceConfigError, parse_trace_config
from stageserve.triton_flags import (
    add_triton_flags,
    default_max_batch_size,
    deprecated_configs,
    ignored,
    refused,
    unused_backend_configs,
)

log = logging.getLogger("stageserve")

DEFAULT_EXAMPLE_REPOSITORY = Path(".stageserve/example_repository")

# The adaptive hold's cap (stageserve/settings.py says why this default).
ADAPTIVE_DELAY_US = SchedulerSettings().adaptive_batch_delay_us


@overload
def _env(name: str, default: str) -> str: ...
@overload
def _env(name: str, default: None = None) -> str | None: ...
def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-verbose", type=int, default=0, help="0 = info, 1+ = debug")
    add_log_flags(p)


def _redis(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument(
        "--redis-url",
        default=_env("REDIS_URL"),
        required=required and _env("REDIS_URL") is None,
        help="redis://host:port/db (env REDIS_URL)",
    )


def _autocomplete(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--disable-auto-complete-config",
        action="store_true",
        help="as Triton's: configs must declare platform, inputs and outputs",
    )
    p.add_argument(
        "--default-max-batch-size",
        type=int,
        default=DEFAULT_MAX_BATCH_SIZE,
        help="max_batch_size auto-complete gives a batchable ONNX model that sets none "
        "(Triton's --backend-config=default-max-batch-size)",
    )


def _http(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-http",
        type=flag_bool,
        nargs="?",
        const=True,
        default=True,
        help="serve the HTTP/REST (KServe v2) front too (as tritonserver: true|false)",
    )
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--http-address", default="0.0.0.0")


def _startup_flags(p: argparse.ArgumentParser) -> None:
    """tritonserver's, with its defaults (services/gateway/startup.py)."""
    for flag, what in (
        ("--exit-on-error", "exit (status 1) when a startup model fails to load"),
        ("--strict-readiness", "ServerReady only once every model is ready, else once live"),
    ):
        p.add_argument(flag, type=flag_bool, nargs="?", const=True, default=True, help=what)


def _reuse_port_flags(p: argparse.ArgumentParser) -> None:
    """tritonserver's: several servers on one port (SO_REUSEPORT), off by default."""
    for flag in ("--reuse-grpc-port", "--reuse-http-port"):
        p.add_argument(
            flag,
            type=flag_bool,
            nargs="?",
            const=True,
            default=None,
            help="share the port with other gateways (SO_REUSEPORT; true|false, default false)",
        )


def _server_name(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--server-name",
        default="triton",
        help="the name server metadata answers (default triton, as Triton's: its client "
        "examples check it)",
    )


def _cache_config(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-config",
        action="append",
        default=[],
        help="as tritonserver, repeatable: local,size=<bytes> (an LRU in each gateway) or "
        "redis[,host=H,port=P,user=U,password=W,db=D,connect_timeout=ms,socket_timeout=ms,"
        "pool_size=N,wait_timeout=ms,size=<bytes>] (shared by every gateway; no host: the "
        "stack's Redis); without it no response is cached",
    )


def _trace_config(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace-config",
        action="append",
        default=[],
        help="Triton's [<mode>,]<setting>=<value>, repeatable: mode=triton|opentelemetry, "
        "rate=, level=OFF|TIMESTAMPS|TENSORS, count=, triton,file=, triton,log-frequency=, "
        "opentelemetry,url=, opentelemetry,resource=<key>=<value>",
    )


def _http_listen(args: argparse.Namespace) -> str | None:
    return f"{args.http_address}:{args.http_port}" if args.allow_http else None


def _autocomplete_of(args: argparse.Namespace) -> AutoComplete:
    """--disable-auto-complete-config, or Triton's deprecated
    --strict-model-config=true; the default max_batch_size from
    --backend-config=[onnxruntime,]default-max-batch-size=N when given (Triton's
    way), else --default-max-batch-size."""
    strict = getattr(args, "strict_model_config", None) is True
    from_backend = default_max_batch_size(getattr(args, "backend_config", []))
    return AutoComplete(
        not (args.disable_auto_complete_config or strict),
        args.default_max_batch_size if from_backend is None else from_backend,
    )


def _poll_secs(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--repository-poll-secs",
        type=float,
        default=GatewaySettings().repository_poll_secs,
        help="with --model-control-mode poll: seconds between repository scans",
    )


def _check_triton_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """tritonserver's flags that `up` and the gateway take (stageserve/triton_flags.py):
    what cannot be served is refused, what changes nothing is logged."""
    if not hasattr(args, "allow_grpc"):
        return
    if args.command == "gateway" and args.model_repository is None:
        parser.error("the following arguments are required: --model-repository")
    why = refused(args)
    if why is not None:
        parser.error(why)
    traces, caches = deprecated_configs(args)
    if traces and hasattr(args, "trace_config"):
        args.trace_config = [*traces, *args.trace_config]
    if caches and hasattr(args, "cache_config"):
        args.cache_config = [*caches, *args.cache_config]
    if args.command == "up" and _exclusive_ports(args) and args.gateways not in (1, AUTO):
        parser.error(
            "--reuse-grpc-port=false and --reuse-http-port=false need one gateway: "
            "several gateways share the ports"
        )


def _log_triton_flags(args: argparse.Namespace) -> None:
    """The Triton flags given that change nothing here, one line each."""
    if not hasattr(args, "allow_grpc"):
        return
    if args.strict_model_config is not None:
        log.warning(
            "'--strict-model-config' has been deprecated! Please use "
            "'--disable-auto-complete-config' instead."
        )
    for flag in ignored(args):
        log.info("flag accepted, no effect in StageServe", extra={"flag": flag})
    for config in unused_backend_configs(args.backend_config):
        log.info("--backend-config not used by StageServe", extra={"config": config})


def _up_gateway_flags(args: argparse.Namespace, gateway: GatewaySettings) -> list[str]:
    """Triton flags `up` hands its gateways: the exit timeout, the model
    config name, the metrics address and the reuse flags where given (with
    several gateways `up` turns both reuse flags on itself, and serves the
    metrics port itself)."""
    flags = ["--exit-timeout-secs", str(gateway.exit_timeout_secs)]
    if gateway.model_config_name is not None:
        flags += ["--model-config-name", gateway.model_config_name]
    if args.metrics_address is not None:
        flags += ["--metrics-address", gateway.metrics_address]
    for flag, ms in (
        ("--grpc-max-connection-age", gateway.grpc_max_connection_age_ms),
        ("--grpc-max-connection-age-grace", gateway.grpc_max_connection_age_grace_ms),
    ):
        if ms is not None:
            flags += [flag, str(ms)]
    if args.model_load_retry_count is not None:
        flags += ["--model-load-retry-count", str(gateway.model_load_retry_count)]
    if args.grpc_infer_response_compression_level is not None:
        flags += [
            "--grpc-infer-response-compression-level",
            gateway.grpc_infer_response_compression,
        ]
    for flag, pattern in (
        ("--grpc-header-forward-pattern", gateway.grpc_header_forward_pattern),
        ("--http-header-forward-pattern", gateway.http_header_forward_pattern),
    ):
        if pattern is not None:
            flags += [flag, pattern]
    for flag in ("reuse_grpc_port", "reuse_http_port"):
        value = getattr(args, flag)
        if value is not None:
            flags += [f"--{flag.replace('_', '-')}", str(value).lower()]
    return flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stageserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start Redis and every service on a model repository")
    up.add_argument(
        "--model-repository",
        type=Path,
        default=None,
        help="Triton-layout repository; default: build the example repository and serve it",
    )
    up.add_argument("--grpc-port", type=int, default=8001)
    up.add_argument("--grpc-address", default="0.0.0.0")
    _http(up)
    _server_name(up)
    _cache_config(up)
    up.add_argument("--metrics-port", type=int, default=8002)
    up.add_argument("--model-control-mode", choices=["none", "explicit", "poll"], default="none")
    up.add_argument("--load-model", action="append", default=[], help="repeatable; * = all")
    _startup_flags(up)
    _poll_secs(up)
    _autocomplete(up)
    _trace_config(up)
    # Workers, schedulers and gateways default to auto: `up` sizes them from
    # the GPUs and cores it finds (on a 2-core host without a GPU: one of
    # each). With several gateways, --metrics-port serves the whole stack's
    # Triton metrics, merged by `up` from each gateway's own port
    # (docs/deployment.md, "Several gateways on one port").
    up.add_argument(
        "--workers",
        type=parse_workers,
        default=AUTO,
        help="worker processes to start, or auto: one per GPU (cuda:0..N-1; 1 without a GPU)",
    )
    up.add_argument(
        "--workers-per-device",
        type=parse_per_device,
        default=1,
        help="with --workers auto: this many workers on each GPU (on the one device without "
        "a GPU), for a model whose one worker process binds before its GPU does",
    )
    up.add_argument(
        "--gateways",
        type=parse_gateways,
        default=AUTO,
        help="gateway processes sharing the gRPC and HTTP ports (SO_REUSEPORT), or auto "
        "(default): by the cores present (stageserve/scale_out.py)",
    )
    up.add_argument("--device", default="auto", help="auto | cpu | cuda:N for the workers")
    up.add_argument(
        "--schedulers",
        type=parse_schedulers,
        default=AUTO,
        help="scheduler processes, sharded by model, or auto: one per 8 cores, at least 1",
    )
    add_rate_limit_flags(up)
    up.add_argument(
        "--supervisor-metrics-port",
        type=int,
        default=0,
        help="/metrics with stageserve_stage_restarts_total (0: a free port, announced)",
    )
    _redis(up, required=False)
    _common(up)
    add_security_flags(up)
    _reuse_port_flags(up)
    add_triton_flags(up)

    gw = sub.add_parser("gateway", help="public GRPCInferenceService and HTTP/REST endpoints")
    gw.add_argument("--listen", default=None, help="host:port (default 0.0.0.0:--grpc-port)")
    gw.add_argument("--grpc-port", type=int, default=8001)
    _http(gw)
    _server_name(gw)
    _cache_config(gw)
    gw.add_argument("--model-repository", type=Path, default=None, help="(required)")
    gw.add_argument("--model-control-mode", choices=["none", "explicit", "poll"], default="none")
    gw.add_argument("--load-model", action="append", default=[])
    _startup_flags(gw)
    _poll_secs(gw)
    _autocomplete(gw)
    _trace_config(gw)
    gw.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics (0: off)")
    _reuse_port_flags(gw)
    gw.add_argument("--ratelimiter", default=_env("STAGESERVE_RATELIMITER"), required=False)
    gw.add_argument("--scheduler", default=_env("STAGESERVE_SCHEDULER"), required=False)
    _redis(gw)
    _common(gw)
    add_security_flags(gw)
    add_triton_flags(gw)

    sc = sub.add_parser("scheduler", help="per-model queues and batch formation")
    sc.add_argument("--listen", default="0.0.0.0:9001")
    sc.add_argument("--ratelimiter", default=_env("STAGESERVE_RATELIMITER"))
    sc.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics (0: off)")
    sc.add_argument("--advertise", default=None, help="address peers dial (default: bound one)")
    sc.add_argument(
        "--scheduler-id",
        default=None,
        help="name in the shard map; a restart that keeps it keeps its models (default host-pid)",
    )
    sc.add_argument(
        "--adaptive-batch-delay-us",
        type=int,
        default=None,
        help="beyond Triton: hold a dynamic batch open while requests keep arriving and "
        "holding pays (tried on the traffic), at most this long after its oldest "
        f"(default: env STAGESERVE_ADAPTIVE_BATCH_DELAY_US, else {ADAPTIVE_DELAY_US}; "
        "0: off, Triton's batching exactly)",
    )
    _cache_config(sc)
    _redis(sc)
    _common(sc)

    rl = sub.add_parser("ratelimiter", help="instance registry and execution grants")
    rl.add_argument("--listen", default="0.0.0.0:9002")
    rl.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics (0: off)")
    add_rate_limit_flags(rl)
    _redis(rl)
    _common(rl)

    wk = sub.add_parser("worker", help="hosts model instances and executes batches")
    wk.add_argument("--listen", default="0.0.0.0:9003")
    wk.add_argument("--advertise", default=None, help="address peers dial (default: bound one)")
    wk.add_argument("--ratelimiter", default=_env("STAGESERVE_RATELIMITER"))
    wk.add_argument("--device", default="auto", help="auto | cpu | cuda:N")
    wk.add_argument("--worker-id", default=None)
    wk.add_argument(
        "--scheduler",
        default=_env("STAGESERVE_SCHEDULER"),
        help="scheduler address for Python models' BLS requests",
    )
    wk.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics (0: off)")
    _redis(wk)
    _common(wk)

    run = sub.add_parser("exec", help=argparse.SUPPRESS)  # launcher: run a binary as a child
    run.add_argument("argv", nargs=argparse.REMAINDER)

    ex = sub.add_parser("make-examples", help="write the example model repository")
    ex.add_argument("directory", type=Path)
    return parser


def _security(args: argparse.Namespace, read):
    """A security option read from the flags; a bad one ends the CLI with its message."""
    try:
        return read(args)
    except ValueError as exc:
        raise SystemExit(f"stageserve: {exc}") from None


def _gateway_argv(gateway: GatewaySettings) -> list[str]:
    """The gateway section's public-endpoint flags again, for `up`'s gateway child."""
    return gateway_flags(gateway.public_tls, gateway.grpc_restrictions, gateway.http_restrictions)


def _need(args: argparse.Namespace, *names: str) -> None:
    missing = [n for n in names if not getattr(args, n)]
    if missing:
        flags = ", ".join("--" + n.replace("_", "-") for n in missing)
        sys.exit(f"stageserve {args.command}: missing {flags} (or its environment variable)")


def _settings(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    environment: Settings | None = None,
) -> Settings:
    """The settings tree this process runs with: `environment` (the tree built
    from the environment; default: this process's), then the flags; a bad
    value ends the CLI with its message."""
    # The flags that become one field each: parsed here, checked once.
    parsed: dict[str, object] = {}
    if hasattr(args, "disable_auto_complete_config"):
        try:
            parsed["autocomplete"] = _autocomplete_of(args)
        except ValueError as exc:
            parser.error(str(exc))
    if hasattr(args, "grpc_use_ssl"):
        parsed["public_tls"] = _security(args, tls_from)
        parsed["grpc_restrictions"] = tuple(_security(args, restrictions_from))
        parsed["http_restrictions"] = tuple(_security(args, http_restrictions_from))
    if hasattr(args, "trace_config"):
        try:
            parse_trace_config(args.trace_config)
        except TraceConfigError as exc:
            parser.error(str(exc))
        parsed["trace_config"] = tuple(args.trace_config)
    try:
        if hasattr(args, "cache_config"):
            parsed["cache_config"] = parse_cache_config(args.cache_config)
        resources = resource_overrides(getattr(args, "rate_limit_resource", []))
        parsed["rate_limit_resources"] = tuple(resources.items())
        if environment is None:
            environment = settings_from_env(os.environ)
        return with_flags(environment, {**vars(args), **parsed})
    except ValueError as exc:
        parser.error(str(exc))


def _exclusive_ports(args: argparse.Namespace) -> bool:
    """Triton's --reuse-grpc-port=false or --reuse-http-port=false given."""
    return args.reuse_grpc_port is False or args.reuse_http_port is False


def _gateways(parser: argparse.ArgumentParser, args: argparse.Namespace, settings: Settings) -> int:
    """`up`'s --gateways as a count (auto resolved on this host; one gateway
    where the user asked for ports of its own, --reuse-*-port=false)."""
    if args.gateways == AUTO and _exclusive_ports(args):
        return 1
    try:
        return gateway_count(args.gateways, settings.stack)
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    # The environment's part of the tree first, before grpc is imported: its
    # grpc_io must reach the environment before then (grpc_io.py), and a bad
    # variable or a half-configured stage TLS stops here, not at the first dial.
    try:
        environment = settings_from_env(os.environ)
    except ValueError as exc:
        print(f"stageserve: {exc}", file=sys.stderr)
        return 2
    use_grpc_io(environment.grpc_io)
    from stageserve.launcher import die_with_parent

    die_with_parent()
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_triton_flags(parser, args)
    settings = _settings(parser, args, environment)
    if args.command == "exec":  # PDEATHSIG survives exec: redis-server dies with us too
        os.execv(args.argv[0], args.argv)
    if args.command == "make-examples":
        from stageserve_tools.examples import build_example_repository

        names = build_example_repository(args.directory)
        print(f"wrote {len(names)} models to {args.directory}")
        return 0

    log_settings = log_settings_of(args)
    setup_logging(args.command, settings=log_settings)
    _log_triton_flags(args)
    if args.command in STAGES:  # each stage follows the stack's (LogSettings RPC)
        from stageserve.log_follow import follow

        follow(args.redis_url, log_settings)
    if args.command == "up":
        from stageserve.launcher import up

        if args.workers_per_device != 1 and args.workers != AUTO:
            parser.error("--workers-per-device needs --workers auto")
        repository = args.model_repository
        if repository is None:
            from stageserve_tools.examples import build_example_repository

            repository = DEFAULT_EXAMPLE_REPOSITORY.resolve()
            build_example_repository(repository)
            log.info("serving the example repository", extra={"path": str(repository)})
        gateway, ratelimiter = settings.gateway, settings.ratelimiter
        return up(
            repository=repository.resolve(),
            grpc_address=f"{args.grpc_address}:{args.grpc_port}",
            http_address=_http_listen(args),
            metrics_port=args.metrics_port if args.allow_metrics else 0,
            metrics_address=gateway.metrics_address,
            control_mode=gateway.model_control_mode,
            load_models=args.load_model,
            redis_url=args.redis_url,
            workers=args.workers,
            workers_per_device=args.workers_per_device,
            gateways=_gateways(parser, args, settings),
            schedulers=scheduler_count(args.schedulers),
            device=settings.worker.device,
            log_verbose=args.log_verbose,
            autocomplete=gateway.autocomplete,
            ratelimiter_args=rate_limit_argv(ratelimiter.mode, ratelimiter.resources),
            repository_poll_secs=gateway.repository_poll_secs,
            supervisor_metrics_port=args.supervisor_metrics_port,
            gateway_extra=[
                *_gateway_argv(gateway),
                "--server-name",
                gateway.server_name,
                *(gateway.response_cache.argv() if gateway.response_cache else []),
                *(f"--trace-config={c}" for c in gateway.trace_config),
                *_up_gateway_flags(args, gateway),
            ],
            exit_on_error=gateway.exit_on_error,
            strict_readiness=gateway.strict_readiness,
            supervisor_settings=settings.supervisor,
            log_argv=log_argv(log_settings),
            scheduler_extra=gateway.response_cache.argv() if gateway.response_cache else [],
            local_cache=gateway.response_cache is not None
            and gateway.response_cache.kind == "local",
            exit_timeout_s=gateway.exit_timeout_secs,
        )
    if args.command == "gateway":
        from services.gateway.server import serve as serve_gateway

        _need(args, "ratelimiter", "scheduler")
        listen = args.listen or f"0.0.0.0:{args.grpc_port}"
        coro = serve_gateway(
            listen,
            args.redis_url,
            args.ratelimiter,
            args.scheduler,
            args.model_repository.resolve(),
            args.load_model,
            settings,
            (args.metrics_port or None) if args.allow_metrics else None,
            _http_listen(args),
        )
    elif args.command == "scheduler":
        from services.scheduler.service import serve as serve_scheduler

        _need(args, "ratelimiter")
        coro = serve_scheduler(
            args.listen,
            args.redis_url,
            args.ratelimiter,
            settings,
            args.scheduler_id,
            args.advertise,
        )
    elif args.command == "ratelimiter":
        from services.ratelimiter.service import serve as serve_ratelimiter

        coro = serve_ratelimiter(args.listen, args.redis_url, settings)
    else:
        from services.worker.service import serve as serve_worker

        _need(args, "ratelimiter")
        coro = serve_worker(
            args.listen,
            args.redis_url,
            args.ratelimiter,
            args.worker_id,
            settings,
            args.advertise,
            args.scheduler,
        )
    from stageserve.net import ListenFailed
    from stageserve.service_runtime import end_on_listen_failure

    try:
        if args.command != "gateway" and args.metrics_port:
            from stageserve.telemetry import serve_metrics

            serve_metrics(args.metrics_port)
        if args.command == "gateway":
            from services.gateway.startup import EXIT_CODE, StartupLoadFailed

            try:
                event_loop.run(_ending_on_listen_failure(coro), settings.stack.event_loop)
            except StartupLoadFailed as exc:
                log.error("exiting (--exit-on-error)", extra={"error": str(exc)})
                return EXIT_CODE
            return 0
        event_loop.run(_ending_on_listen_failure(coro), settings.stack.event_loop)
    except ListenFailed as exc:
        end_on_listen_failure(exc)
    return 0


async def _ending_on_listen_failure(coro: Coroutine[Any, Any, None]) -> None:
    """Run a service; a port it cannot bind ends the process at once, exit
    code 1, as tritonserver ends. Nothing was served, so nothing is wound
    down: a gateway that fails there has background tasks (shared statistics,
    the shard map, trace settings) whose cancellation asyncio.run would wait
    on, and one of them has been seen to keep that wait from ending."""
    from stageserve.net import ListenFailed
    from stageserve.service_runtime import end_on_listen_failure

    try:
        await coro
    except ListenFailed as exc:
        end_on_listen_failure(exc)


if __name__ == "__main__":
    raise SystemExit(main())
