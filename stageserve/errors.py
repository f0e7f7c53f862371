"""The one error type that crosses stages: a gRPC status code and a message."""

from __future__ import annotations

import grpc


class StageError(Exception):
    """An error answered to the client with Triton's gRPC status code.

    `rejected`: a queue policy refused the request (a full queue, or its
    queue timeout with timeout_action REJECT): Triton counts it under
    nv_inference_request_failure{reason="REJECTED"}.
    """

    def __init__(self, code: grpc.StatusCode, message: str, *, rejected: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.rejected = rejected

    def __repr__(self) -> str:
        return f"StageError({self.code.name}, {self.message!r})"


def invalid(message: str) -> StageError:
    return StageError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> StageError:
    return StageError(grpc.StatusCode.NOT_FOUND, message)


def unavailable(message: str) -> StageError:
    return StageError(grpc.StatusCode.UNAVAILABLE, message)


def queue_full(message: str) -> StageError:
    """A request refused because its queue is full (UNAVAILABLE, as Triton)."""
    return StageError(grpc.StatusCode.UNAVAILABLE, message, rejected=True)


def queue_timeout(message: str) -> StageError:
    """A request its queue policy's timeout (timeout_action REJECT) refused:
    UNAVAILABLE and counted REJECTED, as Triton 2.51 does (checked: two timed
    out requests gave nv_inference_request_failure{reason="REJECTED"} 2)."""
    return StageError(grpc.StatusCode.UNAVAILABLE, message, rejected=True)


def internal(message: str) -> StageError:
    return StageError(grpc.StatusCode.INTERNAL, message)


def load_failed(message: str) -> StageError:
    """A RepositoryModelLoad refused: INTERNAL, Triton 2.51's code for every load
    its repository poll or the model's load refuses ("failed to poll from model
    repository"), even where the cause is the client's request."""
    return StageError(grpc.StatusCode.INTERNAL, message)


_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def code_from_int(value: int) -> grpc.StatusCode:
    return _BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)
