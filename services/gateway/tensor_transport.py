"""Which requests the gateway sends through its shared-memory tensor region.

Only a plain model's request: a sequence model's state rows, an ensemble's
intermediate tensors and a decoupled model's responses are built and read
by the scheduler or stream back in parts, so they keep raw bytes.
"""

from __future__ import annotations

from stageserve.config import ModelSpec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensor_shm import TensorShm


def shm_eligible(spec: ModelSpec) -> bool:
    return spec.sequence is None and not spec.steps and not spec.decoupled


def shm_request(shm: TensorShm, request: pb.ScheduleRequest) -> list[pb.TensorPart]:
    """Move the request's large inputs into the region and ask the worker for
    large outputs through shared memory; the input extents to release."""
    request.shm_host = shm.host
    request.shm_pid = shm.pid
    return shm.stage_inputs(request.inputs)
