"""The error contract between stages and towards clients.

A failure has a reason (stageserve.v1.FailureReason); FAILURES, the one table
here, maps each reason to the gRPC status code a client gets, the HTTP status
the HTTP front answers (Triton's HttpCodeFromError: NOT_FOUND 404, UNAVAILABLE
503, INTERNAL 500, the rest 400) and Triton's `reason` label of
nv_inference_request_failure (BACKEND for an execution error, CANCELED,
REJECTED for a queue policy's refusal or a size limit, OTHER for the rest).
The gRPC front, the HTTP front and the metrics recorder all read it.

StageError is the one exception that crosses stages: a reason, its status
code and a message. On the wire between stages a failure is its reason and
message only (stageserve.proto's `failure` fields); the stage that answers a
client derives the status code from the table (StageError.of).
"""

from __future__ import annotations

from typing import NamedTuple

import grpc

from stageserve.generated import stageserve_pb2 as pb


class Failure(NamedTuple):
    code: grpc.StatusCode
    http: int
    triton: str  # nv_inference_request_failure{reason=...}


#: FailureReason -> what clients and metrics see of it.
FAILURES: dict[pb.FailureReason, Failure] = {
    pb.INVALID_INPUT: Failure(grpc.StatusCode.INVALID_ARGUMENT, 400, "OTHER"),
    pb.MODEL_NOT_FOUND: Failure(grpc.StatusCode.NOT_FOUND, 404, "OTHER"),
    pb.STAGE_UNAVAILABLE: Failure(grpc.StatusCode.UNAVAILABLE, 503, "OTHER"),
    pb.NO_INSTANCE: Failure(grpc.StatusCode.UNAVAILABLE, 503, "OTHER"),
    pb.INSTANCE_BUSY: Failure(grpc.StatusCode.UNAVAILABLE, 503, "OTHER"),
    pb.QUEUE_REJECTED: Failure(grpc.StatusCode.UNAVAILABLE, 503, "REJECTED"),
    pb.RESOURCE_EXHAUSTED: Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, 400, "REJECTED"),
    pb.BACKEND_FAILED: Failure(grpc.StatusCode.INTERNAL, 500, "BACKEND"),
    # Triton 2.51's code for every load it refuses ("failed to poll from model repository")
    pb.LOAD_FAILED: Failure(grpc.StatusCode.INTERNAL, 500, "OTHER"),
    pb.CANCELLED: Failure(grpc.StatusCode.CANCELLED, 400, "CANCELED"),
    pb.ALREADY_EXISTS: Failure(grpc.StatusCode.ALREADY_EXISTS, 400, "OTHER"),
    pb.UNIMPLEMENTED: Failure(grpc.StatusCode.UNIMPLEMENTED, 400, "OTHER"),
    pb.DEADLINE_EXCEEDED: Failure(grpc.StatusCode.DEADLINE_EXCEEDED, 400, "OTHER"),
    pb.UNKNOWN_FAILURE: Failure(grpc.StatusCode.UNKNOWN, 400, "OTHER"),
    pb.STAGE_FAULT: Failure(grpc.StatusCode.INTERNAL, 500, "OTHER"),
    # Internal and retried by the router (stageserve/scheduler_routing.py); a
    # client sees it only when the model's shard moved twice within one request.
    pb.NOT_OWNER: Failure(grpc.StatusCode.UNAVAILABLE, 503, "OTHER"),
    # Internal: the gateway resends the request with inline bytes
    # (services/gateway/dataplane.py); a client sees it only if that fails too.
    pb.TENSOR_REGION_NOT_LOCAL: Failure(grpc.StatusCode.UNAVAILABLE, 503, "OTHER"),
}

#: a status code told without a reason (a broken stream's, a literal) -> the
#: reason it stands for: the first in FAILURES with that code
_BY_CODE: dict[grpc.StatusCode, pb.FailureReason] = {}
for _reason, _failure in FAILURES.items():
    _BY_CODE.setdefault(_failure.code, _reason)
#: a reason this table does not know (a newer peer's)
_OTHER = FAILURES[pb.UNKNOWN_FAILURE]


def reason_of(code: grpc.StatusCode) -> pb.FailureReason:
    """The reason a status code stands for (UNKNOWN_FAILURE for one not in the table)."""
    return _BY_CODE.get(code, pb.UNKNOWN_FAILURE)


def failure_of(reason: pb.FailureReason) -> Failure:
    return FAILURES.get(reason, _OTHER)


def status_code(reason: pb.FailureReason) -> grpc.StatusCode:
    """The gRPC status code a client gets for a failure with this reason."""
    return failure_of(reason).code


def http_status(reason: pb.FailureReason) -> int:
    """The HTTP front's status for a failure with this reason."""
    return failure_of(reason).http


def triton_reason(reason: pb.FailureReason) -> str:
    """Triton's nv_inference_request_failure reason label."""
    return failure_of(reason).triton


class StageError(Exception):
    """An error answered to the client with Triton's gRPC status code.

    `reason`: why (a FailureReason); given, or the one `code` stands for.
    A queue policy's refusal (a full queue, or its queue timeout with
    timeout_action REJECT) is QUEUE_REJECTED, which Triton counts under
    nv_inference_request_failure{reason="REJECTED"}.
    """

    def __init__(
        self, code: grpc.StatusCode, message: str, *, reason: pb.FailureReason | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason_of(code) if reason is None else reason

    @classmethod
    def of(cls, reason: pb.FailureReason, message: str) -> StageError:
        """The error for a FailureReason (a stage message's `failure`), with
        the table's code."""
        return cls(status_code(reason), message, reason=reason)

    @property
    def rejected(self) -> bool:
        """A queue policy refused the request."""
        return self.reason == pb.QUEUE_REJECTED

    def __repr__(self) -> str:
        return f"StageError({self.code.name}, {self.message!r})"


def invalid(message: str) -> StageError:
    return StageError.of(pb.INVALID_INPUT, message)


def not_found(message: str) -> StageError:
    return StageError.of(pb.MODEL_NOT_FOUND, message)


def unavailable(message: str) -> StageError:
    return StageError.of(pb.STAGE_UNAVAILABLE, message)


def already_exists(message: str) -> StageError:
    return StageError.of(pb.ALREADY_EXISTS, message)


def queue_full(message: str) -> StageError:
    """A request refused because its queue is full (UNAVAILABLE, as Triton)."""
    return StageError.of(pb.QUEUE_REJECTED, message)


def queue_timeout(message: str) -> StageError:
    """A request its queue policy's timeout (timeout_action REJECT) refused:
    UNAVAILABLE and counted REJECTED, as Triton 2.51 does (checked: two timed
    out requests gave nv_inference_request_failure{reason="REJECTED"} 2)."""
    return StageError.of(pb.QUEUE_REJECTED, message)


def internal(message: str) -> StageError:
    """INTERNAL: the model's execution failed (Triton's BACKEND failure)."""
    return StageError.of(pb.BACKEND_FAILED, message)


def stage_fault(message: str) -> StageError:
    """INTERNAL: a stage's own unexpected error (a bug), counted OTHER."""
    return StageError.of(pb.STAGE_FAULT, message)


def load_failed(message: str) -> StageError:
    """A RepositoryModelLoad refused: INTERNAL, Triton 2.51's code for every load
    its repository poll or the model's load refuses ("failed to poll from model
    repository"), even where the cause is the client's request."""
    return StageError.of(pb.LOAD_FAILED, message)
