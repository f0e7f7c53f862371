"""stageserve/errors.py: the one table from a FailureReason to what clients and
metrics see, and the codes stages carry on the wire."""

from __future__ import annotations

import grpc
import pytest

from services.worker.python_backend import pb_utils
from services.worker.python_backend.instance import grpc_code
from stageserve.errors import (
    FAILURES,
    StageError,
    code_from_int,
    http_status,
    internal,
    invalid,
    load_failed,
    not_found,
    queue_full,
    queue_timeout,
    reason_of,
    triton_reason,
    unavailable,
    wire_code,
)
from stageserve.generated import stageserve_pb2 as pb

# reason -> (gRPC code, HTTP status, Triton's nv_inference_request_failure reason).
# HTTP: Triton's HttpCodeFromError (NOT_FOUND 404, UNAVAILABLE 503, INTERNAL 500,
# anything else 400).
EXPECTED: dict[int, tuple[grpc.StatusCode, int, str]] = {
    pb.INVALID_INPUT: (grpc.StatusCode.INVALID_ARGUMENT, 400, "OTHER"),
    pb.MODEL_NOT_FOUND: (grpc.StatusCode.NOT_FOUND, 404, "OTHER"),
    pb.STAGE_UNAVAILABLE: (grpc.StatusCode.UNAVAILABLE, 503, "OTHER"),
    pb.NO_INSTANCE: (grpc.StatusCode.UNAVAILABLE, 503, "OTHER"),
    pb.INSTANCE_BUSY: (grpc.StatusCode.UNAVAILABLE, 503, "OTHER"),
    pb.QUEUE_REJECTED: (grpc.StatusCode.UNAVAILABLE, 503, "REJECTED"),
    pb.RESOURCE_EXHAUSTED: (grpc.StatusCode.RESOURCE_EXHAUSTED, 400, "REJECTED"),
    pb.BACKEND_FAILED: (grpc.StatusCode.INTERNAL, 500, "BACKEND"),
    pb.LOAD_FAILED: (grpc.StatusCode.INTERNAL, 500, "OTHER"),
    pb.CANCELLED: (grpc.StatusCode.CANCELLED, 400, "CANCELED"),
    pb.ALREADY_EXISTS: (grpc.StatusCode.ALREADY_EXISTS, 400, "OTHER"),
    pb.UNIMPLEMENTED: (grpc.StatusCode.UNIMPLEMENTED, 400, "OTHER"),
    pb.DEADLINE_EXCEEDED: (grpc.StatusCode.DEADLINE_EXCEEDED, 400, "OTHER"),
}


def test_every_failure_reason_is_in_the_table() -> None:
    reasons = set(pb.FailureReason.values()) - {pb.FAILURE_NONE}
    assert set(FAILURES) == reasons
    assert {r: tuple(f) for r, f in FAILURES.items()} == EXPECTED


@pytest.mark.parametrize("reason", sorted(EXPECTED))
def test_an_error_of_a_reason_answers_the_tables_code_and_status(reason: int) -> None:
    code, http, triton = EXPECTED[reason]
    err = StageError.of(reason, "m")
    assert (err.code, err.message, err.reason) == (code, "m", reason)
    assert http_status(err.code) == http
    assert FAILURES[err.reason].triton == triton
    assert code_from_int(wire_code(reason)) == code
    if reason_of(code, err.rejected) == reason:  # the reason its code stands for
        assert triton_reason(err.code, err.rejected) == triton


def test_a_bare_code_stands_for_its_first_reason() -> None:
    assert reason_of(grpc.StatusCode.INTERNAL) == pb.BACKEND_FAILED
    assert reason_of(grpc.StatusCode.UNAVAILABLE) == pb.STAGE_UNAVAILABLE
    assert reason_of(grpc.StatusCode.UNAVAILABLE, rejected=True) == pb.QUEUE_REJECTED
    assert reason_of(grpc.StatusCode.UNKNOWN) == pb.FAILURE_NONE
    assert http_status(grpc.StatusCode.UNKNOWN) == 400
    assert triton_reason(grpc.StatusCode.UNKNOWN) == "OTHER"


def test_the_helpers_keep_tritons_codes() -> None:
    assert invalid("m").code == grpc.StatusCode.INVALID_ARGUMENT
    assert not_found("m").code == grpc.StatusCode.NOT_FOUND
    assert unavailable("m").code == grpc.StatusCode.UNAVAILABLE
    assert internal("m").code == grpc.StatusCode.INTERNAL
    assert load_failed("m").code == grpc.StatusCode.INTERNAL  # Triton's "failed to poll"
    for refused in (queue_full("m"), queue_timeout("m")):
        assert (refused.code, refused.rejected) == (grpc.StatusCode.UNAVAILABLE, True)
        assert refused.reason == pb.QUEUE_REJECTED
        assert triton_reason(refused.code, refused.rejected) == "REJECTED"


@pytest.mark.parametrize(
    ("triton_code", "grpc_status"),
    [
        (pb_utils.TritonError.UNKNOWN, grpc.StatusCode.UNKNOWN),
        (pb_utils.TritonError.INTERNAL, grpc.StatusCode.INTERNAL),
        (pb_utils.TritonError.NOT_FOUND, grpc.StatusCode.NOT_FOUND),
        (pb_utils.TritonError.INVALID_ARG, grpc.StatusCode.INVALID_ARGUMENT),
        (pb_utils.TritonError.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
        (pb_utils.TritonError.UNSUPPORTED, grpc.StatusCode.UNIMPLEMENTED),
        (pb_utils.TritonError.ALREADY_EXISTS, grpc.StatusCode.ALREADY_EXISTS),
        (pb_utils.TritonError.CANCELLED, grpc.StatusCode.CANCELLED),
    ],
)
def test_a_python_models_triton_error_keeps_tritons_code(
    triton_code: int, grpc_status: grpc.StatusCode
) -> None:
    assert code_from_int(grpc_code(pb_utils.TritonError("m", triton_code))) == grpc_status
