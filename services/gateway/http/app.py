"""The KServe v2 / Triton HTTP/REST front: a bare ASGI app over the DataPlane.

No framework: the routes are few and fixed, and every layer between the
socket and the dataplane costs CPU per request on a 2-core budget (the
server itself is chosen by measurement: docs/benchmarks.md). Each handler
turns the HTTP request into the dataplane's message (codec.py), calls the
dataplane, and answers JSON; a StageError becomes Triton's HTTP status with
{"error": message} (the same message the gRPC front sends), anything
unexpected a 500 with a short message and a log line.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import unquote_to_bytes

from prometheus_client import Histogram

from services.gateway.cuda_shared_memory import check_http_register
from services.gateway.dataplane import DataPlane
from services.gateway.header_forward import http_headers
from services.gateway.http import codec
from services.gateway.infer_answer import InferAnswer
from services.gateway.log_control import http_log_settings
from stageserve.errors import StageError, http_status, internal, invalid
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import stageserve_pb2 as pb
from stageserve.security_options import Restriction, restrictions_by_group
from stageserve.tracing import http_json, http_update

log = logging.getLogger(__name__)

HEADER_LENGTH = "inference-header-content-length"

# Endpoint (as _route labels it) -> Triton's API group for --http-restricted-api.
API_GROUP = {
    "health_live": "health",
    "health_ready": "health",
    "model_ready": "health",
    "server_metadata": "metadata",
    "model_metadata": "metadata",
    "infer": "inference",
    "generate": "inference",
    "generate_stream": "inference",
    "model_config": "model-config",
    "model_stats": "statistics",
    "repository_index": "model-repository",
    "repository_load": "model-repository",
    "repository_unload": "model-repository",
    "shm_status": "shared-memory",
    "shm_register": "shared-memory",
    "shm_unregister": "shared-memory",
    "cuda_shm_status": "shared-memory",
    "cuda_shm_register": "shared-memory",
    "cuda_shm_unregister": "shared-memory",
    "trace": "trace",
    "logging": "logging",
}

HTTP_DURATION = Histogram(
    "stageserve_http_request_duration_seconds",
    "Public HTTP/REST request handling time at the gateway, per endpoint and status",
    ["endpoint", "status"],
)


class Response:
    """`stream`, when set, is the body sent chunk by chunk (Server-Sent Events)."""

    __slots__ = ("status", "body", "headers", "stream")

    def __init__(
        self,
        status: int = 200,
        body: bytes = b"",
        headers: Sequence[tuple[bytes, bytes]] = (),
        stream: AsyncIterator[bytes] | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.headers = list(headers)
        self.stream = stream


def json_response(doc: Any, status: int = 200) -> Response:
    body = json.dumps(doc, separators=(",", ":")).encode()
    return Response(status, body, [(b"content-type", b"application/json")])


def error_response(status: int, message: str) -> Response:
    return json_response({"error": message}, status)


# A route's method when its handler answers more than one (and 405 to the rest).
ANY_METHOD = "*"

# Called with the request, then the route's path arguments (model, version, ...).
Handler = Callable[..., Awaitable[Response]]


def path_segments(raw_path: bytes | None, path: str) -> list[str]:
    """The URL path's segments, each percent-decoded on its own: split before
    decoding, so `a%2Fb` stays one segment (model name "a/b", refused as a
    path with the gRPC front's message) instead of becoming two, and `%2Fetc`
    never loses its slash to name model "etc". An empty segment (`//`) makes
    the path match no route. `path` (already decoded) when the server gives
    no raw path (ASGI makes it optional)."""
    if raw_path is None:
        segments = path.split("/")
    else:
        segments = [unquote_to_bytes(s).decode("utf-8", "replace") for s in raw_path.split(b"/")]
    segments = segments[1:] if segments[:1] == [""] else segments
    while segments and segments[-1] == "":
        segments.pop()  # a trailing slash is tolerated
    return segments if all(segments) else [""]


class Request:
    __slots__ = ("method", "parts", "headers", "body")

    def __init__(self, method: str, parts: list[str], headers: dict[bytes, bytes], body: bytes):
        self.method = method
        self.parts = parts
        self.headers = headers
        self.body = body


class HttpFront:
    """ASGI application: `await front(scope, receive, send)`."""

    def __init__(self, dataplane: DataPlane, restrictions: Sequence[Restriction] = ()) -> None:
        """`restrictions`: Triton's --http-restricted-api (stageserve/security_options.py)."""
        self.dp = dataplane
        self._timers: dict[tuple[str, int], Any] = {}
        self._restricted = {
            group: (r.header, r.header.encode("latin-1"), r.value.encode("utf-8"))
            for group, r in restrictions_by_group(restrictions).items()
        }

    # ------------------------------------------------------------------- ASGI

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        start = time.perf_counter()
        body = await _read_body(receive)
        parts = path_segments(scope.get("raw_path"), scope["path"])
        request = Request(scope["method"], parts, dict(scope["headers"]), body)
        endpoint, response = await self._dispatch(request)
        if response.stream is not None:
            await self._send_stream(response, send)
        else:
            headers = [(b"content-length", str(len(response.body)).encode()), *response.headers]
            start_msg = {"type": "http.response.start", "status": response.status}
            await send({**start_msg, "headers": headers})
            await send({"type": "http.response.body", "body": response.body})
        self._timer(endpoint, response.status).observe(time.perf_counter() - start)

    @staticmethod
    async def _send_stream(response: Response, send) -> None:
        assert response.stream is not None
        start = {"type": "http.response.start", "status": response.status}
        await send({**start, "headers": response.headers})
        try:
            async for chunk in response.stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await response.stream.aclose()  # type: ignore[attr-defined]
        await send({"type": "http.response.body", "body": b""})

    def _timer(self, endpoint: str, status: int):
        timer = self._timers.get((endpoint, status))
        if timer is None:
            timer = self._timers[endpoint, status] = HTTP_DURATION.labels(endpoint, str(status))
        return timer

    async def _dispatch(self, request: Request) -> tuple[str, Response]:
        endpoint, handler, method, args = self._route(request.parts)
        if handler is None:
            return endpoint, error_response(404, "Not Found")
        restriction = self._restricted.get(API_GROUP.get(endpoint, ""))
        if restriction is not None:
            header, key, value = restriction
            if request.headers.get(key) != value:  # as Triton: 403 with its words
                message = f"This API is restricted, expecting header '{header}'"
                return endpoint, error_response(403, message)
        if method != ANY_METHOD and request.method not in method.split(","):
            return endpoint, error_response(405, "Method Not Allowed")
        try:
            return endpoint, await handler(request, *args)
        except StageError as err:
            return endpoint, error_response(http_status(err.reason), err.message)
        except Exception as exc:
            log.exception("unexpected error", extra={"endpoint": endpoint, "error": repr(exc)})
            return endpoint, error_response(500, f"internal error in {endpoint}")

    # ----------------------------------------------------------------- routes

    def _route(self, p: list[str]) -> tuple[str, Handler | None, str, tuple]:
        """(endpoint label, handler, its method, path arguments)."""
        n = len(p)
        if n == 0 or p[0] != "v2":
            return "unknown", None, "", ()
        if n == 1:
            return "server_metadata", self.server_metadata, "GET", ()
        if p[1] == "health" and n == 3 and p[2] in ("live", "ready"):
            return f"health_{p[2]}", getattr(self, f"health_{p[2]}"), "GET", ()
        if p[1] == "models":
            if n == 3 and p[2] == "stats":
                return "model_stats", self.model_stats, "GET", ("", "")
            if n < 3:
                return "unknown", None, "", ()
            model, version, rest = p[2], "", p[3:]
            if len(rest) >= 2 and rest[0] == "versions":
                version, rest = rest[1], rest[2:]
                if not (version.isascii() and version.isdigit()):
                    # Triton's route takes digits only ([0-9]+): anything else is
                    # no route, 404 "Not Found" (checked against 2.51)
                    return "unknown", None, "", ()
            if not rest:
                return "model_metadata", self.model_metadata, "GET", (model, version)
            if rest == ["trace", "setting"] and not version:
                return "trace", self.trace_setting, "GET,POST", (model,)
            if len(rest) == 1:
                action = rest[0]
                route = self._MODEL_ROUTES.get(action)
                if route is not None:
                    name, method = route
                    return name, getattr(self, name), method, (model, version)
            return "unknown", None, "", ()
        if p[1] == "repository":
            if n == 3 and p[2] == "index":
                return "repository_index", self.repository_index, "POST", ()
            if n == 5 and p[2] == "models" and p[4] in ("load", "unload"):
                name = f"repository_{p[4]}"
                return name, getattr(self, name), "POST", (p[3],)
            return "unknown", None, "", ()
        if p[1] == "systemsharedmemory":
            rest, region = p[2:], ""
            if len(rest) >= 2 and rest[0] == "region":
                region, rest = rest[1], rest[2:]
            if rest == ["status"]:
                return "shm_status", self.shm_status, "GET", (region,)
            if rest == ["register"] and region:
                return "shm_register", self.shm_register, "POST", (region,)
            if rest == ["unregister"]:
                return "shm_unregister", self.shm_unregister, "POST", (region,)
            return "unknown", None, "", ()
        if p[1] == "cudasharedmemory":
            rest, region = p[2:], ""
            if len(rest) >= 2 and rest[0] == "region":
                region, rest = rest[1], rest[2:]
            if rest == ["status"]:
                return "cuda_shm_status", self.cuda_shm_status, "GET", (region,)
            if rest == ["register"] and region:
                return "cuda_shm_register", self.cuda_shm_register, "POST", (region,)
            if rest == ["unregister"]:
                return "cuda_shm_unregister", self.cuda_shm_unregister, "POST", (region,)
            return "unknown", None, "", ()
        if p[1] == "logging":  # GET and POST, as Triton
            return "logging", self.log_settings if n == 2 else None, ANY_METHOD, ()
        if p[1:] == ["trace", "setting"]:
            return "trace", self.trace_setting, "GET,POST", ("",)
        if p[1] in ("trace", "logging"):
            return p[1], self.unsupported, "GET" if p[-1] in ("status", "setting") else "POST", ()
        return "unknown", None, "", ()

    _MODEL_ROUTES = {
        "ready": ("model_ready", "GET"),
        "config": ("model_config", "GET"),
        "stats": ("model_stats", "GET"),
        "infer": ("infer", "POST"),
        "generate": ("generate", "POST"),
        "generate_stream": ("generate_stream", "POST"),
    }

    # --------------------------------------------------------- health / meta

    async def health_live(self, request: Request) -> Response:
        return Response(200)

    async def health_ready(self, request: Request) -> Response:
        # As Triton: 200 when ready, 400 (and no body) when not.
        return Response(200 if self.dp.server_ready() else 400)

    async def model_ready(self, request: Request, model: str, version: str) -> Response:
        if self.dp.model_ready(model, version):
            return Response(200)
        return error_response(400, "Model version not ready")  # Triton's words

    async def server_metadata(self, request: Request) -> Response:
        return json_response(codec.proto_json(self.dp.server_metadata()))

    async def model_metadata(self, request: Request, model: str, version: str) -> Response:
        meta = self.dp.model_metadata(gs.ModelMetadataRequest(name=model, version=version))
        return json_response(codec.proto_json(meta))

    async def model_config(self, request: Request, model: str, version: str) -> Response:
        config = self.dp.model_config(gs.ModelConfigRequest(name=model, version=version))
        return json_response(codec.proto_json(config.config))

    async def model_stats(self, request: Request, model: str, version: str) -> Response:
        stats = await self.dp.statistics(gs.ModelStatisticsRequest(name=model, version=version))
        return json_response(codec.proto_json(stats))

    # ------------------------------------------------------------------ infer

    def _forward(self, infer: gs.ModelInferRequest, request: Request) -> None:
        """Triton's --http-header-forward-pattern (services/gateway/header_forward.py)."""
        if (forward := self.dp.http_forward) is not None:
            forward.apply(infer, http_headers(request.headers.items()))

    async def infer(self, request: Request, model: str, version: str) -> Response:
        header_length = _header_length(request.headers)
        body = _decompressed(request)
        parsed = codec.parse_infer(body, header_length, model, version)
        self._forward(parsed.request, request)
        if self.dp.is_decoupled(parsed.request.model_name):  # as Triton's HTTP front
            raise invalid("HTTP end point doesn't support models with decoupled transaction policy")
        traceparent = ""
        if self.dp.traces is not None and self.dp.traces.active:
            traceparent = request.headers.get(b"traceparent", b"").decode("latin-1")
        answer = await self.dp.infer_answer(parsed.request, parsed.raw, traceparent=traceparent)
        if isinstance(answer, InferAnswer):
            body, json_length = codec.encode_infer(answer.response, parsed, answer.all_raws())
        else:
            body, json_length = codec.encode_infer(answer, parsed)
        if json_length is None:
            headers = [(b"content-type", b"application/json")]
        else:
            headers = [
                (b"content-type", b"application/octet-stream"),
                (HEADER_LENGTH.encode(), str(json_length).encode()),
            ]
        # As Triton: Accept-Encoding gzip / deflate compresses the whole body;
        # Inference-Header-Content-Length counts the uncompressed bytes.
        accept = request.headers.get(b"accept-encoding", b"").decode("latin-1")
        for name, compress in _COMPRESSORS.items():
            if name in accept:
                body = compress(body)
                headers.append((b"content-encoding", name.encode()))
                break
        return Response(200, body, headers)

    async def generate(self, request: Request, model: str, version: str) -> Response:
        """Triton's generate extension: one response. A decoupled model may
        answer it when it sends exactly one response (generate_stream otherwise)."""
        entry, _ = self.dp.models.resolve(model, version)
        assert entry.spec is not None
        infer = codec.parse_generate(request.body, entry.spec, version)
        self._forward(infer, request)
        sent: list[gs.ModelStreamInferResponse] = []
        stream = self.dp.decoupled_stream(infer, sent.append)
        response = await self.dp.infer(infer, stream=stream)
        final = gs.ModelStreamInferResponse(infer_response=response)
        if stream is not None and (last := stream.last(final)) is not None:
            sent.append(last)
        elif stream is None:
            sent.append(final)
        for message in sent:
            if message.error_message:
                raise invalid(message.error_message)
        if len(sent) != 1:
            raise invalid(
                f"generate expects one response from model '{entry.name}', which sent "
                f"{len(sent)}: use generate_stream for a decoupled model's responses"
            )
        return json_response(codec.encode_generate(sent[0].infer_response))

    async def generate_stream(self, request: Request, model: str, version: str) -> Response:
        """Server-Sent Events, one per response: one for a non-decoupled model,
        each of a decoupled model's responses as it arrives. An error before
        the first event is an HTTP error; after it, an event {"error": ...}."""
        entry, _ = self.dp.models.resolve(model, version)
        assert entry.spec is not None
        infer = codec.parse_generate(request.body, entry.spec, version)
        self._forward(infer, request)
        events: asyncio.Queue[gs.ModelStreamInferResponse | StageError | None] = asyncio.Queue()
        stream = self.dp.decoupled_stream(infer, events.put_nowait)

        async def run() -> None:
            out: gs.ModelStreamInferResponse | None
            try:
                out = gs.ModelStreamInferResponse(
                    infer_response=await self.dp.infer(infer, stream=stream)
                )
                if stream is None or (out := stream.last(out)) is not None:
                    events.put_nowait(out)
            except StageError as err:
                events.put_nowait(err)
            except Exception as exc:
                log.exception(
                    "unexpected error", extra={"endpoint": "generate_stream", "error": repr(exc)}
                )
                events.put_nowait(internal("internal error in generate_stream"))
            finally:
                events.put_nowait(None)

        task = asyncio.create_task(run())
        first = await events.get()
        if isinstance(first, StageError):
            await task
            raise first

        async def body() -> AsyncIterator[bytes]:
            item: gs.ModelStreamInferResponse | StageError | None = first
            try:
                while item is not None:
                    yield _sse_event(item)
                    item = await events.get()
            finally:
                if not task.done():
                    task.cancel()

        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        return Response(200, headers=headers, stream=body())

    # ------------------------------------------------------------- repository

    async def repository_index(self, request: Request) -> Response:
        doc = codec.json_body(request.body)
        ready = doc.get("ready", False)
        if not isinstance(ready, bool):
            raise invalid("'ready' of a repository index request must be a bool")
        index = self.dp.repository_index(gs.RepositoryIndexRequest(ready=ready))
        return json_response([codec.proto_json(m) for m in index.models])

    async def repository_load(self, request: Request, model: str) -> Response:
        await self.dp.load(codec.load_request(model, request.body))
        return Response(200)

    async def repository_unload(self, request: Request, model: str) -> Response:
        await self.dp.unload(codec.unload_request(model, request.body))
        return Response(200)

    # ----------------------------------------------------- system shared memory

    async def shm_status(self, request: Request, region: str) -> Response:
        status = self.dp.shm_status(gs.SystemSharedMemoryStatusRequest(name=region))
        return json_response([codec.proto_json(r) for r in status.regions.values()])

    async def shm_register(self, request: Request, region: str) -> Response:
        doc = codec.json_body(request.body)
        key, offset, size = doc.get("key"), doc.get("offset", 0), doc.get("byte_size")
        if not isinstance(key, str) or not isinstance(offset, int) or not isinstance(size, int):
            raise invalid(
                "a system shared memory register request needs 'key' (string), "
                "'byte_size' and optional 'offset' (integers)"
            )
        self.dp.shm_register(
            gs.SystemSharedMemoryRegisterRequest(
                name=region, key=key, offset=offset, byte_size=size
            )
        )
        return Response(200)

    async def shm_unregister(self, request: Request, region: str) -> Response:
        self.dp.shm_unregister(gs.SystemSharedMemoryUnregisterRequest(name=region))
        return Response(200)

    async def cuda_shm_status(self, request: Request, region: str) -> Response:
        status = self.dp.cuda_shm_status(gs.CudaSharedMemoryStatusRequest(name=region))
        return json_response([codec.proto_json(r) for r in status.regions.values()])

    async def cuda_shm_register(self, request: Request, region: str) -> Response:
        raw, device, size = check_http_register(codec.json_body(request.body))
        self.dp.cuda_shm_register(
            gs.CudaSharedMemoryRegisterRequest(
                name=region, raw_handle=raw, device_id=device, byte_size=size
            )
        )
        return Response(200)

    async def cuda_shm_unregister(self, request: Request, region: str) -> Response:
        self.dp.cuda_shm_unregister(gs.CudaSharedMemoryUnregisterRequest(name=region))
        return Response(200)

    async def log_settings(self, request: Request) -> Response:
        if self.dp.log_control is None:
            raise unsupported_error("logging")
        status, doc = await http_log_settings(self.dp.log_control, request.method, request.body)
        return json_response(doc, status)

    async def trace_setting(self, request: Request, model: str) -> Response:
        """Triton's trace extension: GET reads, POST updates (null clears a
        field). Triton answers a value of the wrong JSON type, or a body that
        is no JSON, with 500 and its parser's words."""
        settings = None
        if request.method == "POST":
            try:
                settings = http_update(json.loads(request.body))
            except ValueError as exc:
                return error_response(500, f"failed to parse the request JSON buffer: {exc}")
            except TypeError as exc:
                return error_response(500, str(exc))
        try:
            answer = await self.dp.trace_setting(model, settings)
        except StageError as err:
            status = 501 if err.reason == pb.UNIMPLEMENTED else http_status(err.reason)
            return error_response(status, err.message)
        return json_response(http_json(answer))

    async def unsupported(self, request: Request) -> Response:
        raise unsupported_error(request.parts[1])


def _sse_event(item: gs.ModelStreamInferResponse | StageError) -> bytes:
    if isinstance(item, StageError):
        doc: dict[str, Any] = {"error": item.message}
    elif item.error_message:
        doc = {"error": item.error_message}
    else:
        doc = codec.encode_generate(item.infer_response)
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def unsupported_error(what: str) -> StageError:
    # The gRPC front answers UNIMPLEMENTED for these; Triton's HTTP code for it is 400.
    return StageError.of(pb.UNIMPLEMENTED, f"{what} is not supported by StageServe")


_BodyCoding = Callable[[bytes], bytes]
# deflate = zlib format
_COMPRESSORS: dict[str, _BodyCoding] = {"gzip": gzip.compress, "deflate": zlib.compress}
_DECOMPRESSORS: dict[bytes, _BodyCoding] = {b"gzip": gzip.decompress, b"deflate": zlib.decompress}


def _decompressed(request: Request) -> bytes:
    """The body after Content-Encoding gzip / deflate (tritonclient's
    request_compression_algorithm)."""
    encoding = request.headers.get(b"content-encoding")
    if encoding is None or encoding == b"identity":
        return request.body
    decompress = _DECOMPRESSORS.get(encoding)
    if decompress is None:
        raise invalid(f"unsupported Content-Encoding {encoding.decode('latin-1')!r}")
    try:
        return decompress(request.body)
    except (OSError, zlib.error, EOFError) as exc:
        raise invalid(
            f"failed to decompress the request body ({encoding.decode()}): {exc}"
        ) from None


def _header_length(headers: dict[bytes, bytes]) -> int | None:
    raw = headers.get(HEADER_LENGTH.encode())
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise invalid(f"Inference-Header-Content-Length is not an integer: {raw!r}") from None


async def _read_body(receive) -> bytes:
    message = await receive()
    body = message.get("body", b"")
    if not message.get("more_body", False):
        return body  # the common case: one chunk, no copy
    chunks = [body]
    while message.get("more_body", False):
        message = await receive()
        chunks.append(message.get("body", b""))
    return b"".join(chunks)


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
