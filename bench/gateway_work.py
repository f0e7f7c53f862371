"""`python -m bench.gateway_work`: the gateway's own work per request, in one process.

What one gateway does with a request of bench.scale's `identity_49k` (FP32
[3, 64, 64], 49,152 bytes in and out) when its tensors go through shared
memory, or of `identity` (FP32 [16], inline), without its fronts' sockets
and its stream to the scheduler: the HTTP/2 front's frame parsing, parse
the ModelInferRequest, validate it, stage the input into the gateway's
tensor region, build and serialize the ScheduleRequest, take the output out
of the worker's region, build and serialize the ModelInferResponse, and
the answer's HTTP/2 frames. Each
step is timed apart (best of --repeats, us per request) and the whole path
once more on fresh messages.

The sockets, grpc and event-loop turns are not here: `python -m bench.scale`
measures the gateway's CPU per inference in a stack, which this bounds from
below.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import timeit
from collections.abc import Callable, Sequence

import hpack

from services.gateway.dataplane import _response
from services.gateway.infer_answer import serialize
from services.gateway.infer_request import InferCall, parse_infer_request
from stageserve.config import ModelSpec, parse_config_text, to_spec
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import stageserve_pb2 as pb
from stageserve.h2grpc import wire
from stageserve.h2grpc.connection import ServerConnection
from stageserve.tensor_shm import TensorShm, release_outputs, take_outputs
from stageserve.validation import ValidatedRequest, validate_infer

#: (config.pbtxt dims, bytes per request)
MODELS = {"identity": ([16], 64), "identity_49k": ([3, 64, 64], 49152)}
SLOTS, SLOT_BYTES, MIN_SHM_BYTES = 64, 65536, 16384


def _config(name: str, dims: list[int]) -> str:
    d = ", ".join(map(str, dims))
    return f"""name: "{name}" backend: "onnxruntime" max_batch_size: 32
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {d} ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {d} ] }} ]
dynamic_batching {{ }}"""


def _client_request(name: str, dims: list[int], nbytes: int) -> bytes:
    req = gs.ModelInferRequest(model_name=name, id="1")
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, *dims])
    req.outputs.add(name="OUTPUT0")
    req.raw_input_contents.append(bytes(nbytes))
    return req.SerializeToString()


#: A ModelInfer call's request headers, as a gRPC client sends them.
HEADERS = {
    ":method": "POST",
    ":scheme": "http",
    ":path": "/inference.GRPCInferenceService/ModelInfer",
    ":authority": "localhost",
    "content-type": "application/grpc",
    "te": "trailers",
}


class _Discard(asyncio.WriteTransport):
    """Where the frames go: taken as a socket's transport takes them, then dropped."""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def writelines(self, list_of_data: object) -> None:
        pass


_DISCARD = _Discard()


def _request_frames(headers: bytes, message: bytes, sid: int) -> bytes:
    """One unary call as a client sends it: HEADERS, then the message in one DATA frame."""
    body = b"\x00" + len(message).to_bytes(4, "big") + message
    return wire.frame(wire.HEADERS, wire.END_HEADERS, sid, headers) + wire.frame(
        wire.DATA, wire.END_STREAM, sid, body
    )


def measure(model: str, repeats: int, number: int) -> list[tuple[str, float]]:
    """(step, us per request) for one request of `model`."""
    dims, nbytes = MODELS[model]
    spec = to_spec(parse_config_text(_config(model, dims)))
    wire_request = _client_request(model, dims, nbytes)
    stack = f"bench-{os.getpid()}"
    gateway = TensorShm(stack, "gateway", SLOTS, SLOT_BYTES, MIN_SHM_BYTES)
    worker = TensorShm(stack, "worker", SLOTS, SLOT_BYTES, MIN_SHM_BYTES)
    try:
        return _steps(model, spec, wire_request, nbytes, gateway, worker, repeats, number)
    finally:
        gateway.close()
        worker.close()


def _steps(
    model: str,
    spec: ModelSpec,
    wire_request: bytes,
    nbytes: int,
    gateway: TensorShm,
    worker: TensorShm,
    repeats: int,
    number: int,
) -> list[tuple[str, float]]:
    connection = ServerConnection()
    connection.receive(wire.PREFACE + wire.frame(wire.SETTINGS, 0, 0, b""))
    connection.data_to_send()
    # The client's header blocks: the first adds the fields to the HPACK
    # tables, every later one names them by index (as a client's do).
    encoder = hpack.Encoder()
    first, later = encoder.encode(list(HEADERS.items())), encoder.encode(list(HEADERS.items()))
    connection.receive(_request_frames(first, wire_request, 1))
    connection.reset(1)
    sid = [1]

    def call_in() -> int:
        """A call's frames in; its stream id (the stream stays open)."""
        sid[0] += 2
        connection.receive(_request_frames(later, wire_request, sid[0]))
        return sid[0]

    def call_out(stream: int, answer: bytes | wire.MessageParts) -> None:
        """The answer's frames out (after the client's WINDOW_UPDATE for them),
        handed to a transport as the server hands them."""
        size = answer.byte_size() if isinstance(answer, wire.MessageParts) else len(answer)
        refill = (size + 5).to_bytes(4, "big")
        connection.receive(wire.frame(wire.WINDOW_UPDATE, 0, 0, refill))
        connection.send_message(stream, answer)
        connection.reset(stream)
        connection.write_to(_DISCARD)

    def frames() -> None:
        stream = call_in()
        connection.reset(stream)
        connection.write_to(_DISCARD)

    answer_message = gs.ModelInferResponse(model_name=model, model_version="1", id="1")
    answer_message.outputs.add(name="OUTPUT0", datatype="FP32", shape=[1, *spec.outputs[0].dims])
    answer_message.raw_output_contents.append(bytes(nbytes))
    answer_wire = answer_message.SerializeToString()

    parsed = parse_infer_request(wire_request)  # as the own HTTP/2 front parses it
    request = parsed.request if isinstance(parsed, InferCall) else parsed
    raws = parsed.raws if isinstance(parsed, InferCall) else None

    def validate_and_place(
        call: gs.ModelInferRequest | InferCall, staged: list[pb.TensorPart]
    ) -> ValidatedRequest:
        """As the gateway validates a request whose tensors go through shared
        memory: a large input goes into its region as it is checked."""

        def place(raw: bytes | memoryview, datatype: str) -> pb.TensorPart | None:
            part = gateway.stage_bytes(raw, datatype)
            if part is not None:
                staged.append(part)
            return part

        if isinstance(call, InferCall):
            return validate_infer(call.request, spec, raw_contents=call.raws, place_raw=place)
        return validate_infer(call, spec, place_raw=place)

    def stage() -> None:
        staged: list[pb.TensorPart] = []
        validate_and_place(parsed, staged)
        gateway.release(staged)

    held: list[pb.TensorPart] = []
    validated = validate_and_place(parsed, held)

    def schedule_request() -> bytes:
        msg = pb.ScheduleRequest(model=model, version=1, inputs=validated.inputs, batch_size=1)
        msg.outputs.extend(validated.outputs)
        msg.shm_host, msg.shm_pid = gateway.host, gateway.pid
        return pb.ScheduleBatch(requests=[msg]).SerializeToString()

    output = bytes(nbytes)

    def answer() -> pb.ScheduleResponse:
        """The worker's answer as the gateway gets it: the output in the
        worker's region for this gateway when it is large enough."""
        t = pb.Tensor(name="OUTPUT0", datatype="FP32", shape=[1, *spec.outputs[0].dims])
        part = worker.place(output, gateway.pid)
        if part is None:
            t.raw = output
        else:
            t.parts.append(part)
        resp = pb.ScheduleResponse(id=1, outputs=[t])
        return pb.ScheduleResponse.FromString(resp.SerializeToString())

    def take() -> None:
        take_outputs(answer().outputs, keep_raw=False)

    def respond() -> bytes | wire.MessageParts:
        resp = answer()
        taken = take_outputs(resp.outputs, keep_raw=False)
        out, _ = _response(model, 1, "1", resp.outputs, {}, validated, taken)
        return serialize(out)

    def whole() -> None:
        stream = call_in()
        call = parse_infer_request(wire_request)
        staged: list[pb.TensorPart] = []
        checked = validate_and_place(call, staged)
        msg = pb.ScheduleRequest(model=model, version=1, inputs=checked.inputs, batch_size=1)
        msg.shm_host, msg.shm_pid = gateway.host, gateway.pid
        pb.ScheduleBatch(requests=[msg]).SerializeToString()
        resp = answer()
        taken = take_outputs(resp.outputs, keep_raw=False)
        out, _ = _response(model, 1, request.id, resp.outputs, {}, checked, taken)
        gateway.release(staged)
        call_out(stream, serialize(out))

    steps: list[tuple[str, Callable[[], object]]] = [
        ("HTTP/2 frames in (the front)", frames),
        ("HTTP/2 frames in, the answer's out", lambda: call_out(call_in(), answer_wire)),
        ("parse the ModelInferRequest", lambda: parse_infer_request(wire_request)),
        ("validate", lambda: validate_infer(request, spec, raw_contents=raws)),
        ("validate, the input into the region, release", stage),
        ("build and serialize the ScheduleRequest", schedule_request),
        ("the worker's answer (not the gateway's)", lambda: release_outputs(answer())),
        ("that, and take the output", take),
        ("that, take, build and serialize the response", respond),
        ("whole path, fresh messages", whole),
    ]
    try:
        return [
            (name, min(timeit.repeat(fn, number=number, repeat=repeats)) / number * 1e6)
            for name, fn in steps
        ]
    finally:
        gateway.release(held)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_work")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--number", type=int, default=2000, help="requests per repeat")
    args = parser.parse_args(argv)
    for model in args.models:
        print(f"gateway work per request, {model} (best of {args.repeats})")
        for name, us in measure(model, args.repeats, args.number):
            print(f"  {name:46s} {us:7.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
