"""services/gateway/header_forward.py: which headers become request parameters."""

from __future__ import annotations

from services.gateway.header_forward import HeaderForward, grpc_headers, http_headers
from stageserve.generated import grpc_service_pb2 as gs


def _params(request: gs.ModelInferRequest) -> dict[str, str]:
    return {k: v.string_param for k, v in request.parameters.items()}


def test_a_match_anywhere_in_the_lowercased_name_is_forwarded() -> None:
    request = gs.ModelInferRequest()
    headers = [("X-Tenant", "a"), ("my-x-thing", "b"), ("other", "c"), ("xy", "d")]
    HeaderForward("x-.*").apply(request, headers)
    assert _params(request) == {"x-tenant": "a", "my-x-thing": "b"}


def test_a_header_replaces_a_parameter_of_its_name() -> None:
    request = gs.ModelInferRequest()
    request.parameters["x-tenant"].string_param = "given"
    request.parameters["k"].int64_param = 1
    HeaderForward("^x-").apply(request, [("x-tenant", "header")])
    assert request.parameters["x-tenant"].string_param == "header"
    assert request.parameters["k"].int64_param == 1


def test_binary_grpc_metadata_is_left_out_and_http_bytes_are_text() -> None:
    assert grpc_headers([("x-a", "1"), ("x-b-bin", b"\x00")]) == [("x-a", "1")]
    assert http_headers([(b"x-a", b"caf\xe9")]) == [("x-a", "café")]
