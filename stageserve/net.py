"""Addresses, free ports and gRPC channel settings shared by every stage."""

from __future__ import annotations

import socket

import grpc

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
]
SERVER_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def insecure_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
