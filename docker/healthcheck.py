#!/usr/bin/env python3
"""Container health check: ask a StageServe service's gRPC health service.

    stageserve-healthcheck [HOST:PORT] [--service NAME] [--timeout SECONDS]

With no address it finds the `stageserve` process of this container (PID 1,
or the first `stageserve` process in /proc) and takes the gRPC address from
its own command line, parsed by `stageserve.cli.build_parser`, so one image
HEALTHCHECK works for every service. Exit status: 0 when the answer is
SERVING, 1 otherwise (Docker's and Kubernetes' exec-probe convention).
`make-examples` containers (one-shot) are always healthy.

This is a stand-in for `grpc_health_probe`, which no package registry ships.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_PORTS = {"gateway": 8001, "scheduler": 9001, "ratelimiter": 9002, "worker": 9003}


def _cmdline(pid: str) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _stageserve_argv() -> list[str] | None:
    """argv after the `stageserve` program name, from PID 1 or any stageserve process."""
    pids = ["1"] + sorted((p.name for p in Path("/proc").iterdir() if p.name.isdigit()), key=int)
    for pid in pids:
        argv = _cmdline(pid)
        for i, arg in enumerate(argv):
            if os.path.basename(arg) == "stageserve" or arg.endswith("stageserve.cli"):
                return argv[i + 1 :]
    return None


def _address_from_argv(argv: list[str]) -> str | None:
    """The address the service's gRPC server listens on, or None for one-shot commands."""
    try:
        from stageserve.cli import build_parser

        args = build_parser().parse_args(argv)
        command = args.command
        listen = getattr(args, "listen", None)
        grpc_port = getattr(args, "grpc_port", None)
    except (SystemExit, ImportError):  # fall back to reading the flags by hand
        command = argv[0] if argv else ""
        listen, grpc_port = None, None
        for i, arg in enumerate(argv):
            if arg.startswith("--listen="):
                listen = arg.split("=", 1)[1]
            elif arg == "--listen" and i + 1 < len(argv):
                listen = argv[i + 1]
            elif arg.startswith("--grpc-port="):
                grpc_port = int(arg.split("=", 1)[1])
            elif arg == "--grpc-port" and i + 1 < len(argv):
                grpc_port = int(argv[i + 1])
    if command in ("make-examples", ""):
        return None
    if listen:
        return listen
    return f"127.0.0.1:{grpc_port or DEFAULT_PORTS.get(command, 8001)}"


def _dialable(address: str) -> str:
    host, _, port = address.rpartition(":")
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = "127.0.0.1"
    return f"{host}:{port}"


def _channel(address: str, stage_tls: bool):
    """Plaintext, or mutual TLS with the stage certificate when `stage_tls` and
    STAGESERVE_STAGE_TLS_* are set (the internal stages then require it)."""
    import grpc

    tls = None
    if stage_tls:
        from stageserve.stage_tls import from_environ

        # The stage's own variables, as `stageserve` reads them into its settings tree.
        tls = from_environ(os.environ)
    if tls is None:
        return grpc.insecure_channel(address)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
    )
    options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return grpc.secure_channel(address, credentials, options=options)


def check(
    address: str, service: str = "", timeout: float = 3.0, stage_tls: bool = False
) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with _channel(_dialable(address), stage_tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return False, f"{address}: {exc.code().name} {exc.details() or ''}".strip()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stageserve-healthcheck", description=__doc__)
    p.add_argument("address", nargs="?", help="host:port (default: from the container's command)")
    p.add_argument("--service", default="", help="health service name ('' = whole server)")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument(
        "--plaintext",
        action="store_true",
        help="never use the stage TLS certificate (STAGESERVE_STAGE_TLS_*)",
    )
    args = p.parse_args(argv)

    address = args.address
    # An internal stage speaks mutual TLS when STAGESERVE_STAGE_TLS_* is set;
    # the gateway's public port never does (it has Triton's own TLS flags).
    stage_tls = not args.plaintext
    if address is None:
        service_argv = _stageserve_argv()
        if service_argv is None:
            print("no stageserve process found", file=sys.stderr)
            return 1
        address = _address_from_argv(service_argv)
        if address is None:
            print("one-shot command: nothing to check")
            return 0
        stage_tls = stage_tls and bool(service_argv) and service_argv[0] != "gateway"
    ok, text = check(address, args.service, args.timeout, stage_tls)
    print(text, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
