"""Addresses, free ports and gRPC channel settings shared by every stage."""

from __future__ import annotations

import socket

import grpc

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


def add_stage_port(server: grpc.aio.Server, listen: str, tls: StageTls | None) -> int:
    """Bind an internal stage's server: with `tls` (Settings.stage_tls) clients
    must present a certificate signed by the stage CA; None: plaintext. 0 when
    it cannot bind."""
    if tls is None:
        return server.add_insecure_port(listen)
    credentials = grpc.ssl_server_credentials(
        [(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=True
    )
    return server.add_secure_port(listen, credentials)
