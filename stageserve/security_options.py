"""Triton's security options for the public endpoints (stdlib only: the CLI parses them).

services/gateway/security.py applies the gRPC ones (TLS credentials, the
restricted-protocol interceptor); the HTTP front (services/gateway/http/app.py)
applies --http-restricted-api.

Flags, as tritonserver spells them:

* ``--grpc-use-ssl``, ``--grpc-server-cert``, ``--grpc-server-key``,
  ``--grpc-root-cert``, ``--grpc-use-ssl-mutual``: TLS on the public endpoint;
  with mutual TLS a client must present a certificate signed by the root.
* ``--grpc-restricted-protocol=<protocol>[,<protocol>...]:<key>=<value>``
  (repeatable): the RPCs of those protocol groups answer only a call that
  carries the header ``triton-grpc-protocol-<key>: <value>``; any other gets
  UNAVAILABLE "This protocol is restricted, expecting header
  'triton-grpc-protocol-<key>'" (Triton 2.51's code and message, measured).
* ``--http-restricted-api=<api>[,<api>...]:<key>=<value>`` (repeatable): the
  same groups on the HTTP front; a request must carry the header
  ``<key>: <value>`` (no prefix), any other gets 403 Forbidden
  {"error": "This API is restricted, expecting header '<key>'"} (Triton's
  http_server.cc RespondIfRestricted).

Groups and their RPCs are Triton's: health (ServerLive, ServerReady,
ModelReady), metadata (ServerMetadata, ModelMetadata), inference (ModelInfer,
ModelStreamInfer), shared-memory, model-config, model-repository,
statistics, trace, logging.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stageserve.log_options import flag_bool

HEADER_PREFIX = "triton-grpc-protocol-"

#: RPC (method name) -> Triton's protocol group
GROUP_OF = {
    "ServerLive": "health",
    "ServerReady": "health",
    "ModelReady": "health",
    "ServerMetadata": "metadata",
    "ModelMetadata": "metadata",
    "ModelInfer": "inference",
    "ModelStreamInfer": "inference",
    "ModelConfig": "model-config",
    "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository",
    "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "SystemSharedMemoryStatus": "shared-memory",
    "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory",
    "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory",
    "CudaSharedMemoryUnregister": "shared-memory",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}
GROUPS = frozenset(GROUP_OF.values())


@dataclass(frozen=True)
class Restriction:
    groups: frozenset[str]
    header: str  # full header name, lower case (gRPC metadata keys are)
    value: str

    def flag_value(self, prefix: str = HEADER_PREFIX) -> str:
        """The flag value that parses back to this rule (with the prefix its
        flag adds: HEADER_PREFIX for gRPC, none for HTTP)."""
        return f"{','.join(sorted(self.groups))}:{self.header.removeprefix(prefix)}={self.value}"


def parse_restriction(
    text: str, flag: str = "--grpc-restricted-protocol", prefix: str = HEADER_PREFIX
) -> Restriction:
    """One --grpc-restricted-protocol value (or, with its flag and no prefix,
    --http-restricted-api); ValueError with Triton's message."""
    spec, sep, setting = text.partition(":")
    key, eq, value = setting.partition("=")
    if not sep or not eq or not spec or not key:
        raise ValueError(f"{flag} option format is '<config name>:<setting>=<value>'. Got {text}")
    groups = frozenset(g.strip() for g in spec.split(","))
    for g in sorted(groups):
        if g not in GROUPS:
            raise ValueError(f"unknown restricted protocol '{g}'")
    return Restriction(groups, f"{prefix}{key.strip().lower()}", value)


def parse_http_restriction(text: str) -> Restriction:
    """One --http-restricted-api value: the header is the key itself."""
    return parse_restriction(text, "--http-restricted-api", prefix="")


def restrictions_by_group(restrictions: Sequence[Restriction]) -> dict[str, Restriction]:
    out: dict[str, Restriction] = {}
    for r in restrictions:
        for g in r.groups:
            if g in out:
                raise ValueError(f"protocol '{g}' is restricted more than once")
            out[g] = r
    return out


@dataclass(frozen=True)
class TlsOptions:
    server_cert: Path
    server_key: Path
    root_cert: Path | None = None
    mutual: bool = False


# -------------------------------------------------------------------------- CLI


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Triton's flags; --grpc-use-ssl alone means true, as --grpc-use-ssl=true does."""
    g = parser.add_argument_group("security (Triton's flags)")
    g.add_argument("--grpc-use-ssl", type=flag_bool, nargs="?", const=True, default=False)
    g.add_argument("--grpc-use-ssl-mutual", type=flag_bool, nargs="?", const=True, default=False)
    g.add_argument("--grpc-server-cert", type=Path, default=None)
    g.add_argument("--grpc-server-key", type=Path, default=None)
    g.add_argument("--grpc-root-cert", type=Path, default=None)
    g.add_argument(
        "--grpc-restricted-protocol",
        action="append",
        default=[],
        metavar="<protocol>[,<protocol>...]:<key>=<value>",
    )
    g.add_argument(
        "--http-restricted-api",
        action="append",
        default=[],
        metavar="<api>[,<api>...]:<key>=<value>",
    )


def tls_from(args: argparse.Namespace) -> TlsOptions | None:
    if not (args.grpc_use_ssl or args.grpc_use_ssl_mutual):
        return None
    if args.grpc_server_cert is None or args.grpc_server_key is None:
        raise ValueError("--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key")
    if args.grpc_use_ssl_mutual and args.grpc_root_cert is None:
        raise ValueError("--grpc-use-ssl-mutual needs --grpc-root-cert")
    return TlsOptions(
        args.grpc_server_cert.resolve(),
        args.grpc_server_key.resolve(),
        args.grpc_root_cert.resolve() if args.grpc_root_cert else None,
        bool(args.grpc_use_ssl_mutual),
    )


def restrictions_from(args: argparse.Namespace) -> list[Restriction]:
    restrictions = [parse_restriction(text) for text in args.grpc_restricted_protocol]
    restrictions_by_group(restrictions)  # refuses a group restricted twice
    return restrictions


def http_restrictions_from(args: argparse.Namespace) -> list[Restriction]:
    restrictions = [parse_http_restriction(text) for text in args.http_restricted_api]
    restrictions_by_group(restrictions)
    return restrictions


def gateway_flags(
    tls: TlsOptions | None,
    grpc_restrictions: Sequence[Restriction],
    http_restrictions: Sequence[Restriction],
) -> list[str]:
    """The flags again from their parsed form (the settings tree's gateway
    section: public_tls, grpc_restrictions, http_restrictions), for the
    gateway child `stageserve up` starts."""
    out: list[str] = []
    if tls is not None:
        out += ["--grpc-use-ssl=true", "--grpc-server-cert", str(tls.server_cert)]
        out += ["--grpc-server-key", str(tls.server_key)]
        if tls.root_cert is not None:
            out += ["--grpc-root-cert", str(tls.root_cert)]
        if tls.mutual:
            out.append("--grpc-use-ssl-mutual=true")
    for rule in grpc_restrictions:
        out.append(f"--grpc-restricted-protocol={rule.flag_value()}")
    for rule in http_restrictions:
        out.append(f"--http-restricted-api={rule.flag_value(prefix='')}")
    return out
