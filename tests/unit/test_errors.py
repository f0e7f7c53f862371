"""stageserve/errors.py: the one table from a FailureReason to what clients and
metrics see; stages carry the reason itself on the wire."""

from __future__ import annotations

import grpc
import pytest

from services.worker.python_backend import pb_utils
from services.worker.python_backend.instance import failure_reason
from stageserve.errors import (
    FAILURES,
    StageError,
    http_status,
    internal,
    invalid,
    load_failed,
    not_found,
    queue_full,
    queue_timeout,
    reason_of,
    stage_fault,
    status_code,
    triton_reason,
    unavailable,
)
from stageserve.generated import stageserve_pb2 as pb

# reason -> (gRPC code, HTTP status, Triton's nv_inference_request_failure reason).
# HTTP: Triton's HttpCodeFromError (NOT_FOUND 404, UNAVAILABLE 503, INTERNAL 500,
# anything else 400).
EXPECTED: dict[pb.FailureReason, tuple[grpc.StatusCode, int, str]] = {
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
    pb.UNKNOWN_FAILURE: (grpc.StatusCode.UNKNOWN, 400, "OTHER"),
    pb.STAGE_FAULT: (grpc.StatusCode.INTERNAL, 500, "OTHER"),
    pb.NOT_OWNER: (grpc.StatusCode.UNAVAILABLE, 503, "OTHER"),
    pb.TENSOR_REGION_NOT_LOCAL: (grpc.StatusCode.UNAVAILABLE, 503, "OTHER"),
}


def test_every_failure_reason_is_in_the_table() -> None:
    reasons = set(pb.FailureReason.values()) - {pb.FAILURE_NONE}
    assert set(FAILURES) == reasons
    assert {r: tuple(f) for r, f in FAILURES.items()} == EXPECTED


@pytest.mark.parametrize("reason", sorted(EXPECTED))
def test_an_error_of_a_reason_answers_the_tables_code_and_status(
    reason: pb.FailureReason,
) -> None:
    code, http, triton = EXPECTED[reason]
    err = StageError.of(reason, "m")
    assert (err.code, err.message, err.reason) == (code, "m", reason)
    assert status_code(reason) == code
    assert http_status(err.reason) == http
    assert triton_reason(err.reason) == triton
    assert err.rejected == (reason == pb.QUEUE_REJECTED)


def test_a_bare_code_stands_for_its_first_reason() -> None:
    assert reason_of(grpc.StatusCode.INTERNAL) == pb.BACKEND_FAILED
    assert reason_of(grpc.StatusCode.UNAVAILABLE) == pb.STAGE_UNAVAILABLE
    assert reason_of(grpc.StatusCode.UNKNOWN) == pb.UNKNOWN_FAILURE
    assert reason_of(grpc.StatusCode.PERMISSION_DENIED) == pb.UNKNOWN_FAILURE
    assert StageError(grpc.StatusCode.INTERNAL, "m").reason == pb.BACKEND_FAILED
    assert StageError(grpc.StatusCode.INTERNAL, "m", reason=pb.LOAD_FAILED).reason == (
        pb.LOAD_FAILED
    )


def test_a_reason_from_a_newer_peer_answers_as_unknown() -> None:
    newer = pb.FailureReason.ValueType(999)
    assert (status_code(newer), http_status(newer), triton_reason(newer)) == (
        grpc.StatusCode.UNKNOWN,
        400,
        "OTHER",
    )
    assert StageError.of(newer, "m").code == grpc.StatusCode.UNKNOWN


@pytest.mark.parametrize(
    ("reason", "triton"),
    [(pb.BACKEND_FAILED, "BACKEND"), (pb.LOAD_FAILED, "OTHER"), (pb.STAGE_FAULT, "OTHER")],
)
def test_reasons_that_share_internal_keep_their_label_across_the_wire(
    reason: pb.FailureReason, triton: str
) -> None:
    """Three reasons answer INTERNAL; the wire carries which one it was."""
    sent = pb.ScheduleResponse(id=1, failure=reason, message="m").SerializeToString()
    got = pb.ScheduleResponse.FromString(sent)
    err = StageError.of(got.failure, got.message)
    assert (err.code, triton_reason(err.reason)) == (grpc.StatusCode.INTERNAL, triton)


def test_the_helpers_keep_tritons_codes() -> None:
    assert invalid("m").code == grpc.StatusCode.INVALID_ARGUMENT
    assert not_found("m").code == grpc.StatusCode.NOT_FOUND
    assert unavailable("m").code == grpc.StatusCode.UNAVAILABLE
    assert internal("m").code == grpc.StatusCode.INTERNAL
    assert stage_fault("m").code == grpc.StatusCode.INTERNAL
    assert load_failed("m").code == grpc.StatusCode.INTERNAL  # Triton's "failed to poll"
    for refused in (queue_full("m"), queue_timeout("m")):
        assert (refused.code, refused.rejected) == (grpc.StatusCode.UNAVAILABLE, True)
        assert refused.reason == pb.QUEUE_REJECTED
        assert triton_reason(refused.reason) == "REJECTED"


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
    reason = failure_reason(pb_utils.TritonError("m", triton_code))
    assert status_code(reason) == grpc_status
