"""BLS requests and responses as plain values, for a model.py in a stub process.

A model.py hosted in its own process (process_instance.py) calls
`exec()` / `async_exec()` there; the call travels to the worker, which sends
it through its one BLS client (bls.py) as for an in-process instance, so
batching, rate limiting and statistics apply the same way. These functions
turn both ends of the call into picklable values (numpy arrays included,
BYTES as object arrays) and back.
"""

from __future__ import annotations

from typing import Any

from stageserve import pb_utils

Wire = dict[str, Any]


def request_to_wire(request: pb_utils.InferenceRequest) -> Wire:
    return {
        "model_name": request.model_name(),
        "requested_output_names": list(request._requested),  # the order given
        "inputs": [(t.name(), t.as_numpy()) for t in request.inputs()],
        "model_version": request.model_version(),
        "correlation_id": request.correlation_id(),
        "request_id": request.request_id(),
        "flags": request.flags(),
        "timeout": request.timeout(),
        "parameters": request.parameters(),
    }


def request_from_wire(wire: Wire) -> pb_utils.InferenceRequest:
    return pb_utils.InferenceRequest(
        model_name=wire["model_name"],
        requested_output_names=wire["requested_output_names"],
        inputs=[pb_utils.Tensor(name, arr) for name, arr in wire["inputs"]],
        model_version=wire["model_version"],
        correlation_id=wire["correlation_id"],
        request_id=wire["request_id"],
        flags=wire["flags"],
        timeout=wire["timeout"],
        parameters=wire["parameters"],
    )


def responses_to_wire(responses: list[pb_utils.InferenceResponse]) -> list[Wire]:
    out = []
    for r in responses:
        err = r.error()
        out.append(
            {
                "error": None if err is None else (err.message(), err.code()),
                "outputs": [(t.name(), t.as_numpy()) for t in r.output_tensors()],
                "parameters": r.parameters(),
            }
        )
    return out


def responses_from_wire(wire: list[Wire]) -> list[pb_utils.InferenceResponse]:
    return [
        pb_utils.InferenceResponse(
            [pb_utils.Tensor(name, arr) for name, arr in r["outputs"]],
            error=None if r["error"] is None else pb_utils.TritonError(*r["error"]),
            parameters=r["parameters"],
        )
        for r in wire
    ]
