"""Triton's --grpc-header-forward-pattern and --http-header-forward-pattern.

A request header whose name matches the pattern (anywhere in the name:
`re.search`, as Triton's RE2::PartialMatch) becomes a string parameter of the
inference request, named as the header in lower case; a Python model reads
it in `request.parameters()`. Real Triton 2.51 with the pattern `x-.*`
forwards `x-tenant` and `my-x-thing`, not `other` (tests/integration/
test_header_forward.py runs both servers). A header named as a parameter the
client set replaces it: Triton keeps both in the JSON a Python model reads,
and the header, written after it, is the one `json.loads` keeps. Binary
gRPC metadata (`-bin` keys) is not forwarded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from stageserve.generated import grpc_service_pb2 as gs


class HeaderForward:
    def __init__(self, pattern: str) -> None:
        self._pattern = re.compile(pattern)

    def apply(self, request: gs.ModelInferRequest, headers: Iterable[tuple[str, str]]) -> None:
        """Add the matching `headers` (name, text value) to `request.parameters`."""
        search = self._pattern.search
        for name, value in headers:
            key = name.lower()
            if search(key):
                request.parameters[key].string_param = value


def grpc_headers(metadata: Iterable[tuple[str, str | bytes]]) -> list[tuple[str, str]]:
    """gRPC invocation metadata as text headers (binary values left out)."""
    return [(k, v) for k, v in metadata if isinstance(v, str)]


def http_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
