"""Addresses, free ports and gRPC channel settings shared by every stage."""

from __future__ import annotations

import errno
import socket
import ssl
import tempfile
from pathlib import Path

import grpc

from stageserve.h2grpc.client import H2Channel, split_address
from stageserve.h2grpc.server import H2GrpcServer, tls_context
from stageserve.stage_tls import StageTls

# Tensors can be large; Triton itself accepts up to 2 GiB messages.
MAX_MESSAGE_BYTES = 2**31 - 1
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Detect a dead peer on an idle long-lived stream within seconds.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # A peer restarted on its address (stageserve up's supervisor, an
    # orchestrator) is redialled within 1 s of being back. gRPC's default
    # backoff (1 s, x1.6, up to 120 s) redials a peer that was down 3 s only
    # at ~4.2 s, one down 8 s at ~11 s. With restarts of ~1 s (bench.chaos,
    # scheduler and rate limiter killed twice each, load average 7-14) the
    # first success came 1.6-2.6 s after the kill either way; the cap matters
    # for slower restarts, and costs a connection attempt a second while the
    # peer is down.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Despite its name, gRPC core reads this as the shortest time a connection
    # attempt gets to complete (the subchannel's min_connect_timeout), not as a
    # backoff. At 100 ms, a peer whose HTTP/2 handshake came later (a process
    # starved on a loaded machine) failed the first RPC with UNAVAILABLE
    # "connection attempt timed out before receiving SETTINGS frame" (seen in
    # test_torch at load average 7; tests/unit/test_stage_channel_connect.py).
    # A refused connection (the peer is down) still fails at once, so the
    # redial pacing above is unchanged.
    ("grpc.min_reconnect_backoff_ms", 5_000),
]
SERVER_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def stage_channel(address: str, tls: StageTls | None) -> grpc.aio.Channel:
    """A channel to another stage: mutual TLS with `tls` (the process's
    Settings.stage_tls, stageserve/stage_tls.py), plaintext when None."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
    )
    options: list[tuple[str, int | str]] = list(GRPC_OPTIONS)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, credentials, options=options)


def own_stream_channel(address: str, tls: StageTls | None, client: str) -> H2Channel | None:
    """The channel of StageServe's own HTTP/2 client (stageserve/h2grpc/client.py)
    for the streams to another stage, with `tls` as stage_channel has it; None
    where grpc.aio's channel carries them: `client` "grpcio", or an address
    other than host:port (which only grpc resolves)."""
    if client != "h2":
        return None
    try:
        split_address(address)
    except ValueError:
        return None
    if tls is None:
        return H2Channel(address)
    return H2Channel(
        address,
        ssl_context=stage_client_ssl_context(tls),
        server_hostname=tls.server_name or None,
    )


class ListenFailed(RuntimeError):
    """A server could not bind its address. The message is tritonserver's for
    the same failure (`failed to start GRPC service: Unavailable - Socket
    '0.0.0.0:8001' already in use`): the one line a user reads before the
    process exits 1, as Triton's does."""


def listen_failed(front: str, listen: str, error: OSError | None = None) -> ListenFailed:
    """`front` as Triton names it: "GRPC", "HTTP" or "Metrics". Without
    `error` (grpc's bind failure carries no errno) a plain socket retries the
    bind to learn why."""
    if error is None:
        error = _bind_error(listen)
    if error is not None and error.errno == errno.EADDRINUSE:
        why = "already in use"
    elif error is not None:
        why = f"cannot be bound: {error.strerror}"
    else:
        why = "cannot be bound"
    return ListenFailed(f"failed to start {front} service: Unavailable - Socket '{listen}' {why}")


def _bind_error(listen: str) -> OSError | None:
    host, port = listen.rsplit(":", 1)
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, int(port)))
    except OSError as exc:
        return exc
    except ValueError:  # a port that is not a number
        return None
    return None


def stage_server(kind: str) -> grpc.aio.Server | H2GrpcServer:
    """An internal stage's gRPC server: "h2", StageServe's own HTTP/2 server
    (stageserve/h2grpc/), or "grpcio", grpc.aio's. Both serve the same
    handlers to the same grpcio clients."""
    if kind == "h2":
        return H2GrpcServer(options=SERVER_OPTIONS)
    return grpc.aio.server(options=SERVER_OPTIONS)


def add_stage_port(
    server: grpc.aio.Server | H2GrpcServer, listen: str, tls: StageTls | None
) -> int:
    """Bind an internal stage's server: with `tls` (Settings.stage_tls) clients
    must present a certificate signed by the stage CA; None: plaintext. 0 when
    it cannot bind (grpcio answers 0 or raises RuntimeError, by version)."""
    try:
        if tls is None:
            return server.add_insecure_port(listen)
        if isinstance(server, H2GrpcServer):
            return server.add_secure_port(listen, stage_ssl_context(tls))
        credentials = grpc.ssl_server_credentials(
            [(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=True
        )
        return server.add_secure_port(listen, credentials)
    except RuntimeError:
        return 0


def stage_client_ssl_context(tls: StageTls) -> ssl.SSLContext:
    """The stage TLS of `stage_channel` for the own HTTP/2 client: this
    stage's certificate, the server's checked against the stage CA and its
    name (the address's host, or tls.server_name), ALPN h2."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cadata=tls.ca.decode("ascii"))
    with tempfile.TemporaryDirectory(prefix="stageserve-tls-") as folder:
        cert, key = Path(folder, "cert.pem"), Path(folder, "key.pem")
        cert.write_bytes(tls.cert)
        key.write_bytes(tls.key)
        context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["h2"])
    return context


def stage_ssl_context(tls: StageTls) -> ssl.SSLContext:
    """The stage TLS of `add_stage_port` for the own HTTP/2 server: this
    stage's certificate, clients' certificates required and checked against
    the stage CA, ALPN h2 (which gRPC clients insist on)."""
    # ssl loads a certificate chain from files only: the PEM goes through a
    # private directory (mode 0700) that is gone once it is loaded.
    with tempfile.TemporaryDirectory(prefix="stageserve-tls-") as folder:
        cert, key = Path(folder, "cert.pem"), Path(folder, "key.pem")
        cert.write_bytes(tls.cert)
        key.write_bytes(tls.key)
        return tls_context(cert, key, ca_pem=tls.ca, require_client_cert=True)
