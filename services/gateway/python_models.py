"""What the gateway does differently for Python-backend models (kept out of
service.py so the fronts stay thin): request metadata for model.py, and
Triton's refusal of ModelInfer on decoupled models."""

from __future__ import annotations

import grpc

from services.gateway.models import ModelManager
from stageserve.config import ModelSpec
from stageserve.errors import StageError
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.request_params import parameters_json


def python_request_fields(spec: ModelSpec, request: gs.ModelInferRequest) -> dict[str, str]:
    """request_id and parameters for a Python model's InferenceRequest; none for the others."""
    if spec.backend != "python":
        return {}
    return {"request_id": request.id, "parameters_json": parameters_json(request.parameters)}


def check_unary_allowed(models: ModelManager, request: gs.ModelInferRequest) -> None:
    """Triton 2.51 answers ModelInfer on a decoupled model with UNIMPLEMENTED."""
    entry = models.entries.get(request.model_name)
    spec = entry.spec if entry is not None else None
    if spec is not None and spec.decoupled:
        raise StageError(
            grpc.StatusCode.UNIMPLEMENTED,
            "ModelInfer RPC doesn't support models with decoupled transaction policy",
        )
