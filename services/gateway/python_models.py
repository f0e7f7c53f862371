"""What the gateway does differently for Python-backend models (used by the
DataPlane, dataplane.py, so both fronts share it): request metadata for
model.py, Triton's refusal of ModelInfer on decoupled models, and decoupled
responses streamed (gRPC ModelStreamInfer, HTTP generate_stream) as they arrive."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypedDict

import grpc

from services.gateway.model_table import ModelTable
from stageserve.config import ModelSpec
from stageserve.errors import StageError
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import stageserve_pb2 as pb
from stageserve.request_params import parameters_json


class PythonRequestFields(TypedDict, total=False):
    """The pb.ScheduleRequest fields only a Python model's request carries."""

    request_id: str
    parameters_json: str


def python_request_fields(spec: ModelSpec, request: gs.ModelInferRequest) -> PythonRequestFields:
    """request_id and parameters for a Python model's InferenceRequest; none for the others."""
    if spec.backend != "python":
        return {}
    return {"request_id": request.id, "parameters_json": parameters_json(request.parameters)}


def check_unary_allowed(models: ModelTable, request: gs.ModelInferRequest) -> None:
    """Triton 2.51 answers ModelInfer on a decoupled model with UNIMPLEMENTED."""
    entry = models.entries.get(request.model_name)
    spec = entry.spec if entry is not None else None
    if spec is not None and spec.decoupled:
        raise StageError(
            grpc.StatusCode.UNIMPLEMENTED,
            "ModelInfer RPC doesn't support models with decoupled transaction policy",
        )


def infer_response(
    model: str, version: int, request_id: str, resp: pb.ScheduleResponse
) -> gs.ModelInferResponse:
    out = gs.ModelInferResponse(model_name=model, model_version=str(version), id=request_id)
    for t in resp.outputs:
        out.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        out.raw_output_contents.append(t.raw)
    return out


class DecoupledStream:
    """One ModelStreamInfer request to a decoupled model: every response goes to
    the client as it arrives, with Triton's `triton_final_response` parameter;
    a final flag sent without a response becomes an empty response only when
    the client set `triton_enable_empty_final_response` (as Triton 2.51)."""

    def __init__(
        self, request: gs.ModelInferRequest, put: Callable[[gs.ModelStreamInferResponse], None]
    ) -> None:
        self.request = request
        self.put = put
        param = request.parameters.get(EMPTY_FINAL)
        self.empty_final = bool(param is not None and param.bool_param)
        self.final_has_response = True

    def partial(self, response: gs.ModelInferResponse, error: str = "") -> None:
        out = gs.ModelStreamInferResponse(error_message=error, infer_response=response)
        if not error:
            mark_final(out, False)
        self.put(out)

    def final(self, resp: pb.ScheduleResponse) -> None:
        self.final_has_response = not resp.no_response

    def last(self, out: gs.ModelStreamInferResponse) -> gs.ModelStreamInferResponse | None:
        """The final stream message, or None when there is nothing to send."""
        if not self.final_has_response and not self.empty_final:
            return None
        if not self.final_has_response:
            out.infer_response.ClearField("outputs")
        return out


EMPTY_FINAL = "triton_enable_empty_final_response"


def mark_final(out: gs.ModelStreamInferResponse, final: bool = True) -> None:
    """Triton marks every streamed response with triton_final_response."""
    out.infer_response.parameters["triton_final_response"].bool_param = final


def stream_partials(
    stream: DecoupledStream | None, model: str, version: int, request_id: str
) -> Callable[[pb.ScheduleResponse], None] | None:
    """The scheduler link's callback for a decoupled request's early responses."""
    if stream is None:
        return None

    def on_more(resp: pb.ScheduleResponse) -> None:
        response = infer_response(model, version, request_id, resp)
        stream.partial(response, resp.message if resp.failure else "")

    return on_more
