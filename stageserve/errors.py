"""The error contract between stages and towards clients.

A failure has a reason (stageserve.v1.FailureReason); FAILURES, the one table
here, maps each reason to the gRPC status code a client gets, the HTTP status
the HTTP front answers (Triton's HttpCodeFromError: NOT_FOUND 404, UNAVAILABLE
503, INTERNAL 500, the rest 400) and Triton's `reason` label of
nv_inference_request_failure (BACKEND for an execution error, CANCELED,
REJECTED for a queue policy's refusal or a size limit, OTHER for the rest).
The gRPC front, the HTTP front and the metrics recorder all read it.

StageError is the one exception that crosses stages: a status code and a
message; its reason is given, or follows from the code.
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
FAILURES: dict[int, Failure] = {
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
}

#: a status code told without a reason -> the reason it stands for
_BY_CODE: dict[grpc.StatusCode, int] = {}
for _reason, _failure in FAILURES.items():
    _BY_CODE.setdefault(_failure.code, _reason)
_OTHER = Failure(grpc.StatusCode.UNKNOWN, 400, "OTHER")


def reason_of(code: grpc.StatusCode, rejected: bool = False) -> int:
    """The reason a status code stands for (FAILURE_NONE for one not in the
    table); `rejected`: a queue policy's refusal (QUEUE_REJECTED)."""
    if rejected:
        return pb.QUEUE_REJECTED
    return _BY_CODE.get(code, pb.FAILURE_NONE)


def failure_of(code: grpc.StatusCode, rejected: bool = False) -> Failure:
    return FAILURES.get(reason_of(code, rejected), _OTHER)


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP front's status for an error with this gRPC code."""
    return failure_of(code).http


def triton_reason(code: grpc.StatusCode, rejected: bool = False) -> str:
    """Triton's nv_inference_request_failure reason label."""
    return failure_of(code, rejected).triton


def wire_code(reason: int) -> int:
    """The grpc.StatusCode value a stage message's `code` field carries for `reason`."""
    return FAILURES[reason].code.value[0]


class StageError(Exception):
    """An error answered to the client with Triton's gRPC status code.

    `rejected`: a queue policy refused the request (a full queue, or its
    queue timeout with timeout_action REJECT): Triton counts it under
    nv_inference_request_failure{reason="REJECTED"}.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        rejected: bool = False,
        reason: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.rejected = rejected
        self.reason = reason_of(code, rejected) if reason is None else reason

    @classmethod
    def of(cls, reason: int, message: str) -> StageError:
        """The error for a FailureReason, with the table's code."""
        failure = FAILURES[reason]
        return cls(failure.code, message, rejected=reason == pb.QUEUE_REJECTED, reason=reason)

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
    return StageError.of(pb.BACKEND_FAILED, message)


def load_failed(message: str) -> StageError:
    """A RepositoryModelLoad refused: INTERNAL, Triton 2.51's code for every load
    its repository poll or the model's load refuses ("failed to poll from model
    repository"), even where the cause is the client's request."""
    return StageError.of(pb.LOAD_FAILED, message)


_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def code_from_int(value: int) -> grpc.StatusCode:
    return _BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)
