"""Optional mutual TLS between stages (beyond Triton, which is one process).

Set all three of these in every stage's environment (`stageserve up` passes
its own environment to its children; compose and Kubernetes: docs/deployment.md):

- ``STAGESERVE_STAGE_TLS_CERT``: this stage's certificate (PEM), presented
  both as a server and as a client;
- ``STAGESERVE_STAGE_TLS_KEY``: its private key (PEM);
- ``STAGESERVE_STAGE_TLS_CA``: the CA (PEM) every peer's certificate must
  chain to.

Then every internal gRPC server (scheduler, rate limiter, worker) accepts only
clients presenting a certificate signed by that CA, and every internal channel
presents its certificate and checks the server's. The certificate must name
the address peers dial (a SAN such as ``IP:127.0.0.1`` or the Service's DNS
name); ``STAGESERVE_STAGE_TLS_SERVER_NAME`` makes clients check that name
instead (one certificate shared by every stage). The public endpoint keeps
Triton's own flags (``--grpc-use-ssl`` ...); Redis connections are not
covered (use a ``rediss://`` URL). None set: plaintext.

The files are read once, when the process builds its settings tree
(stageserve/settings.py, field ``stage_tls``); the tree's value is handed to
the constructors that own a stage's channels or its listening port
(stageserve/net.py's ``stage_channel`` and ``add_stage_port`` take it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

ENV_CERT = "STAGESERVE_STAGE_TLS_CERT"
ENV_KEY = "STAGESERVE_STAGE_TLS_KEY"
ENV_CA = "STAGESERVE_STAGE_TLS_CA"
ENV_SERVER_NAME = "STAGESERVE_STAGE_TLS_SERVER_NAME"


class StageTlsError(ValueError):
    """The stage TLS settings are incomplete or unreadable."""


@dataclass(frozen=True)
class StageTls:
    """The PEM contents every internal channel and port uses."""

    cert: bytes
    # Kept out of repr: a logged settings tree must not carry the private key.
    key: bytes = field(repr=False)
    ca: bytes
    # The name clients check in a peer's certificate instead of the dialled host.
    server_name: str | None = None


def from_environ(environ: Mapping[str, str]) -> StageTls | None:
    """The settings in `environ`: None when none is set; StageTlsError when
    only some are, or a file cannot be read."""
    paths = {name: environ.get(name, "") for name in (ENV_CERT, ENV_KEY, ENV_CA)}
    given = [name for name, value in paths.items() if value]
    if not given:
        return None
    if len(given) != len(paths):
        missing = ", ".join(name for name in paths if name not in given)
        raise StageTlsError(
            f"stage TLS needs {ENV_CERT}, {ENV_KEY} and {ENV_CA}; missing {missing}"
        )
    contents = {}
    for name, value in paths.items():
        try:
            contents[name] = Path(value).read_bytes()
        except OSError as exc:
            raise StageTlsError(f"{name}={value}: {exc.strerror or exc}") from None
    server_name = environ.get(ENV_SERVER_NAME) or None
    return StageTls(contents[ENV_CERT], contents[ENV_KEY], contents[ENV_CA], server_name)
