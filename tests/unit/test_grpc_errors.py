"""The gateway's `grpc_errors` boundary on a real grpc.aio server, called through tritonclient."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from services.gateway.service import client_message, grpc_errors, internal_message
from stageserve.errors import not_found
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import grpc_service_pb2_grpc as gs_grpc


class Faulty(gs_grpc.GRPCInferenceServiceServicer):
    """Handlers that fail the ways a real one can: a bug, and a StageError left uncaught."""

    @grpc_errors
    async def ServerLive(self, request, context):
        raise OSError(36, "File name too long", "/secret/path/" + "x" * 300)

    @grpc_errors
    async def ServerReady(self, request, context):
        raise not_found("no such thing")

    @grpc_errors
    async def ServerMetadata(self, request, context):
        return gs.ServerMetadataResponse(name="faulty")

    @grpc_errors
    async def ModelStreamInfer(self, request_iterator, context):
        async for _ in request_iterator:
            raise KeyError("internal detail")
            yield  # pragma: no cover


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict = {}

    async def main() -> None:
        server = grpc.aio.server()
        gs_grpc.add_GRPCInferenceServiceServicer_to_server(Faulty(), server)
        holder["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        holder["server"] = server
        started.set()
        await server.wait_for_termination()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(10)
    yield f"127.0.0.1:{holder['port']}"
    asyncio.run_coroutine_threadsafe(holder["server"].stop(0), loop)
    thread.join(5)  # daemon: a stream the client left open cannot hold the test run


def test_an_unexpected_exception_is_internal_with_a_short_message(url, caplog) -> None:
    c = grpcclient.InferenceServerClient(url)
    with (
        caplog.at_level(logging.ERROR, logger="services.gateway.service"),
        pytest.raises(InferenceServerException) as info,
    ):
        c.is_server_live(client_timeout=10)
    assert info.value.status() == "StatusCode.INTERNAL"
    message = info.value.message()
    assert "ServerLive" in message and "secret" not in message and "Errno" not in message
    assert "Traceback" not in message and len(message) < 120
    # the detail goes to the log
    assert any("secret/path" in r.getMessage() or r.exc_info for r in caplog.records)


def test_an_uncaught_stage_error_keeps_its_code(url) -> None:
    c = grpcclient.InferenceServerClient(url)
    with pytest.raises(InferenceServerException) as info:
        c.is_server_ready(client_timeout=10)
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert info.value.message() == "no such thing"


def test_healthy_handlers_answer_unchanged(url) -> None:
    c = grpcclient.InferenceServerClient(url)
    assert c.get_server_metadata(client_timeout=10).name == "faulty"


def test_a_stream_handler_failure_is_internal(url) -> None:
    errors: list = []
    c = grpcclient.InferenceServerClient(url)
    c.start_stream(callback=lambda result, error: errors.append(error))
    inp = grpcclient.InferInput("INPUT0", [1], "FP32")
    inp.set_data_from_numpy(np.zeros(1, np.float32))
    c.async_stream_infer("m", [inp])
    c.stop_stream()
    assert errors and errors[0] is not None
    assert "StatusCode.INTERNAL" in str(errors[0].status())
    assert "internal detail" not in str(errors[0])


def test_a_streamed_response_gets_the_same_short_text(caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="services.gateway.service"):
        text = client_message(KeyError("secret detail"), "ModelStreamInfer")
    assert text == internal_message("ModelStreamInfer") and "secret" not in text
    assert any("secret detail" in str(getattr(r, "error", "")) for r in caplog.records)
    assert client_message(not_found("gone"), "ModelStreamInfer") == "gone"
