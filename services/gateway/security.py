"""Applies Triton's security options (stageserve/security_options.py) to the gateway's
gRPC server: TLS / mTLS credentials and the restricted-protocol interceptor."""

from __future__ import annotations

import ssl
from collections.abc import Sequence

import grpc

from stageserve.h2grpc.server import tls_context
from stageserve.security_options import GROUP_OF, Restriction, TlsOptions, restrictions_by_group


def server_credentials(tls: TlsOptions) -> grpc.ServerCredentials:
    root = tls.root_cert.read_bytes() if tls.root_cert is not None else None
    return grpc.ssl_server_credentials(
        [(tls.server_key.read_bytes(), tls.server_cert.read_bytes())],
        root_certificates=root,
        require_client_auth=tls.mutual,
    )


def ssl_context(tls: TlsOptions) -> ssl.SSLContext:
    """The same TLS for the gateway's own HTTP/2 server (stageserve/h2grpc):
    its certificate, and with mutual TLS the clients' CA, required; ALPN h2,
    which gRPC clients insist on."""
    return tls_context(
        tls.server_cert, tls.server_key, ca_file=tls.root_cert, require_client_cert=tls.mutual
    )


def _denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def abort(request, context):
        await context.abort(grpc.StatusCode.UNAVAILABLE, message)

    async def abort_stream(request, context):
        await context.abort(grpc.StatusCode.UNAVAILABLE, message)
        yield  # pragma: no cover - an async generator for streaming handlers

    io = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(abort, **io)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort, **io)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort_stream, **io)
    return grpc.stream_stream_rpc_method_handler(abort_stream, **io)


class RestrictedProtocols(grpc.aio.ServerInterceptor):
    """Answers a restricted RPC only when its header carries the configured value."""

    def __init__(self, restrictions: Sequence[Restriction]) -> None:
        self.by_group = restrictions_by_group(restrictions)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method.rsplit("/", 1)[-1]
        restriction = self.by_group.get(GROUP_OF.get(method, ""))
        if restriction is None:
            return await continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata or ())
        if sent.get(restriction.header) == restriction.value:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _denied(
            handler, f"This protocol is restricted, expecting header '{restriction.header}'"
        )
