"""Start MLServer with one extra gRPC method: Triton's ``ModelConfig``.

Run with the Python of ``.venv-mlserver`` (it imports nothing from StageServe)::

    python bench/mlserver_boot.py MODEL_DIR CONFIGS_JSON

``perf_analyzer`` calls ``inference.GRPCInferenceService/ModelConfig`` once
before it measures, and MLServer's gRPC service has no such method (its
``dataplane.proto`` stops at the KServe-v2 calls). This script registers a
generic handler for that single method name on MLServer's own ``grpc.aio``
server, next to MLServer's servicer, then runs ``mlserver start MODEL_DIR``
unchanged. Every other RPC, inference included, is MLServer's own code on
MLServer's own server: no extra hop, nothing re-encoded.

``CONFIGS_JSON`` maps a model name to the hex of a serialized
``inference.ModelConfigResponse`` (built by :mod:`bench.references`). The
request (``ModelConfigRequest``: ``string name = 1; string version = 2``) is
decoded by hand: this environment has no Triton protos.
"""

import json
import os
import sys

# Run as a script, this file's folder (bench/) is sys.path[0], where
# bench/http.py would shadow the standard library's `http` that MLServer
# (starlette) imports: drop it before anything else is imported.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import grpc  # noqa: E402

METHOD = "/inference.GRPCInferenceService/ModelConfig"


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def request_model_name(buf: bytes) -> str:
    """Field 1 (``name``) of a serialized ModelConfigRequest."""
    pos = 0
    name = ""
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
        elif wire == 2:
            length, pos = _varint(buf, pos)
            if field == 1:
                name = buf[pos : pos + length].decode("utf-8")
            pos += length
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return name


def model_config_handler(responses: dict[str, bytes]) -> grpc.GenericRpcHandler:
    async def model_config(request: bytes, context) -> bytes:
        name = request_model_name(request)
        if name not in responses:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"Request for unknown model: '{name}'")
        return responses[name]

    unary = grpc.unary_unary_rpc_method_handler(model_config)  # bytes in, bytes out

    class Handler(grpc.GenericRpcHandler):
        def service(self, handler_call_details):
            return unary if handler_call_details.method == METHOD else None

    return Handler()


def install(responses: dict[str, bytes]) -> None:
    from mlserver.grpc.server import GRPCServer

    original = GRPCServer._create_server

    def create_server(self):
        server = original(self)
        server.add_generic_rpc_handlers((model_config_handler(responses),))
        return server

    GRPCServer._create_server = create_server


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    model_dir, configs_json = argv
    with open(configs_json) as f:
        responses = {name: bytes.fromhex(blob) for name, blob in json.load(f).items()}
    install(responses)
    from mlserver.cli.main import main as mlserver_main

    sys.argv = ["mlserver", "start", model_dir]
    mlserver_main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
