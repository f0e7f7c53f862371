"""Error boundary for a public gRPC service: no Python exception text reaches a client.

A server interceptor wraps every handler. A StageError that escapes a handler
ends the call with its own code and message; any other exception ends it
with INTERNAL and a short message naming the method, while the log gets the
detail and traceback. Without it grpc.aio answers UNKNOWN with
"Unexpected <class 'OSError'>: [Errno 36] File name too long: '/path/...'",
which leaks paths and says nothing a client can act on.

Adopt it with ``grpc.aio.server(interceptors=[ErrorBoundary()])``; the
handlers need no change.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from stageserve.errors import StageError

log = logging.getLogger(__name__)


def internal_message(method: str) -> str:
    return f"internal error in {method.rsplit('/', 1)[-1]}; the server log has the detail"


async def _answer(exc: BaseException, method: str, context: grpc.aio.ServicerContext) -> None:
    if isinstance(exc, StageError):
        await context.abort(exc.code, exc.message)
    await context.abort(grpc.StatusCode.INTERNAL, stream_error_message(exc, method))


def stream_error_message(exc: BaseException, method: str) -> str:
    """What a client is told of `exc` (also the error_message of one streamed
    response): a StageError's own message; for anything else the short INTERNAL
    text, with the detail and traceback in the log."""
    if isinstance(exc, StageError):
        return exc.message
    log.error(
        "unexpected error in a public RPC",
        exc_info=(type(exc), exc, exc.__traceback__),
        extra={"method": method, "error": f"{type(exc).__name__}: {exc}"[:500]},
    )
    return internal_message(method)


_PASS_THROUGH = (asyncio.CancelledError, grpc.aio.AbortError)


def _guard_unary(behavior: Callable[..., Awaitable[Any]], method: str):
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except _PASS_THROUGH:
            raise
        except Exception as exc:  # the boundary: see the module docstring
            await _answer(exc, method, context)

    return guarded


def _guard_stream(behavior: Callable[..., AsyncIterator[Any]], method: str):
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in behavior(request, context):
                yield item
        except _PASS_THROUGH:
            raise
        except Exception as exc:
            await _answer(exc, method, context)

    return guarded


class ErrorBoundary(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self._guarded: dict[str, grpc.RpcMethodHandler] = {}  # per method, built once

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if (guarded := self._guarded.get(method)) is not None:
            return guarded
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        guarded = self._guarded[method] = _guard(handler, method)
        return guarded


def _guard(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    io = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_guard_unary(handler.unary_unary, method), **io)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            _guard_unary(handler.stream_unary, method), **io
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            _guard_stream(handler.unary_stream, method), **io
        )
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(
            _guard_stream(handler.stream_stream, method), **io
        )
    return handler
