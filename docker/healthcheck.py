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


def check(address: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(_dialable(address)) as channel:
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
    args = p.parse_args(argv)

    address = args.address
    if address is None:
        service_argv = _stageserve_argv()
        if service_argv is None:
            print("no stageserve process found", file=sys.stderr)
            return 1
        address = _address_from_argv(service_argv)
        if address is None:
            print("one-shot command: nothing to check")
            return 0
    ok, text = check(address, args.service, args.timeout)
    print(text, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
