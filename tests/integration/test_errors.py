"""Every request validation error: Triton's gRPC status code and a message naming it.

Each case sends one bad request (through tritonclient where its API can
express it, else through tritonclient's generated stub) and then checks that

* the status code is the one Triton answers with and the message names the
  model / tensor / parameter at fault;
* ModelStatistics did not move: the request never reached the model;
* a valid request right after still succeeds (and is counted).
"""

from __future__ import annotations

import queue
from collections.abc import Callable

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.integration.helpers import (
    RPC_TIMEOUT_S,
    bytes_framing,
    expect_error,
    expect_raw_error,
    infer_simple,
    model_stats,
    raw_request,
    simple_inputs,
    simple_raw_request,
    tensor_input,
)
from tests.stack import RunningStack

INVALID = "StatusCode.INVALID_ARGUMENT"
NOT_FOUND = "StatusCode.NOT_FOUND"


def _ones(shape) -> np.ndarray:
    return np.ones(shape, dtype=np.int32)


def _infer(stack: RunningStack, model: str, inputs, **kwargs) -> Callable[[], None]:
    c = stack.client()

    def go() -> None:
        c.infer(model, inputs, client_timeout=RPC_TIMEOUT_S, **kwargs)

    return go


def _counts(stats) -> tuple[int, int, int]:
    return stats.inference_count, stats.execution_count, stats.inference_stats.success.count


def _check_rejected_then_valid(stack: RunningStack, model: str, send_bad: Callable[[], object]):
    """send_bad raises its own assertion on the error; the model must not see it."""
    c = stack.client()
    before = model_stats(c, model)
    result = send_bad()
    after = model_stats(c, model)
    assert _counts(after) == _counts(before), "a rejected request reached the model"
    # the stack keeps serving: a valid request succeeds and is counted
    if model == "identity_bytes":
        data = np.array([[b"ok", b"still"]], dtype=np.object_)
        out = c.infer(
            model, [tensor_input("INPUT0", data, "BYTES")], client_timeout=RPC_TIMEOUT_S
        ).as_numpy("OUTPUT0")
        np.testing.assert_array_equal(out, data)
    else:
        batch = 2 if model == "simple" else 1  # simple_nobatch takes [1,16] only
        infer_simple(c, batch=batch, model=model)
    final = model_stats(c, model)
    assert final.inference_count == before.inference_count + (2 if model == "simple" else 1)
    return result


# ------------------------------------------------------- unknown model/version


def test_unknown_model(stack: RunningStack) -> None:
    def bad():
        return expect_error(
            _infer(stack, "no_such_model", simple_inputs(_ones((1, 16)), _ones((1, 16)))),
            status=NOT_FOUND,
            contains=("no_such_model",),
        )

    _check_rejected_then_valid(stack, "simple", bad)


def test_unknown_version(stack: RunningStack) -> None:
    def bad():
        return expect_error(
            _infer(
                stack, "simple", simple_inputs(_ones((1, 16)), _ones((1, 16))), model_version="7"
            ),
            status=NOT_FOUND,
            contains=("simple", "7"),
        )

    _check_rejected_then_valid(stack, "simple", bad)


def test_version_not_an_integer(stack: RunningStack) -> None:
    def bad():
        return expect_error(
            _infer(
                stack,
                "simple",
                simple_inputs(_ones((1, 16)), _ones((1, 16))),
                model_version="latest",
            ),
            status=INVALID,
            contains=("latest", "integral value"),  # Triton's message names the version
        )

    _check_rejected_then_valid(stack, "simple", bad)


# --------------------------------------------------------- tensors: type/shape


def test_wrong_datatype(stack: RunningStack) -> None:
    i0 = tensor_input("INPUT0", np.ones((1, 16), np.float32), "FP32")
    i1 = tensor_input("INPUT1", _ones((1, 16)), "INT32")

    def bad():
        return expect_error(
            _infer(stack, "simple", [i0, i1]),
            status=INVALID,
            contains=("INPUT0", "FP32", "INT32", "simple"),
        )

    _check_rejected_then_valid(stack, "simple", bad)


@pytest.mark.parametrize("shape", [[1, 15], [1, 17], [1, 4, 4], [2, 8]], ids=str)
def test_wrong_shape(stack: RunningStack, shape: list[int]) -> None:
    data = _ones(shape)

    def bad():
        return expect_error(
            _infer(stack, "simple", simple_inputs(data, data)),
            status=INVALID,
            contains=("INPUT0", "simple", "[-1,16]"),
        )

    _check_rejected_then_valid(stack, "simple", bad)


def test_missing_batch_dimension(stack: RunningStack) -> None:
    # As in Triton, the first dimension is the batch: [16] is a batch of 16 > 8.
    data = _ones((16,))

    def bad():
        return expect_error(
            _infer(stack, "simple", simple_inputs(data, data)),
            status=INVALID,
            contains=("batch-size", "simple", "16"),
        )

    _check_rejected_then_valid(stack, "simple", bad)


def test_wrong_shape_without_batching(stack: RunningStack) -> None:
    """simple_nobatch takes exactly [1,16]; a 'batch' of 2 is a wrong shape."""
    data = _ones((2, 16))

    def bad():
        return expect_error(
            _infer(stack, "simple_nobatch", simple_inputs(data, data)),
            status=INVALID,
            contains=("INPUT0", "simple_nobatch", "[1,16]"),
        )

    _check_rejected_then_valid(stack, "simple_nobatch", bad)


def test_inputs_disagree_on_batch_size(stack: RunningStack) -> None:
    def bad():
        return expect_error(
            _infer(stack, "simple", simple_inputs(_ones((2, 16)), _ones((3, 16)))),
            status=INVALID,
            contains=("INPUT1", "batch size"),
        )

    _check_rejected_then_valid(stack, "simple", bad)


def test_batch_larger_than_max_batch_size(stack: RunningStack) -> None:
    data = _ones((9, 16))

    def bad():
        return expect_error(
            _infer(stack, "simple", simple_inputs(data, data)),
            status=INVALID,
            contains=("batch-size", "8", "simple"),
        )

    _check_rejected_then_valid(stack, "simple", bad)


def test_zero_batch_size(stack: RunningStack) -> None:
    data = _ones((0, 16))

    def bad():
        return expect_error(
            _infer(stack, "simple", simple_inputs(data, data)),
            status=INVALID,
            contains=("batch-size", "simple"),
        )

    _check_rejected_then_valid(stack, "simple", bad)


# --------------------------------------------------------- tensors: data size


def test_raw_byte_size_mismatch(stack: RunningStack) -> None:
    # 15 int32 values (60 bytes) announced as shape [1,16] (64 bytes)
    i0 = tensor_input("INPUT0", np.ones((1, 15), np.int32), "INT32")
    i0.set_shape([1, 16])
    i1 = tensor_input("INPUT1", _ones((1, 16)), "INT32")

    def bad():
        return expect_error(
            _infer(stack, "simple", [i0, i1]),
            status=INVALID,
            contains=("INPUT0", "simple", "64", "60"),
        )

    _check_rejected_then_valid(stack, "simple", bad)


def test_raw_contents_count_differs_from_inputs(stack: RunningStack) -> None:
    request = simple_raw_request()
    del request.raw_input_contents[1]

    def bad():
        return expect_raw_error(
            stack.url, request, grpc.StatusCode.INVALID_ARGUMENT, contains=("raw", "simple")
        )

    _check_rejected_then_valid(stack, "simple", bad)


def test_wrong_element_count_in_typed_contents(stack: RunningStack) -> None:
    request = raw_request("simple", [("INPUT0", "INT32", [1, 16]), ("INPUT1", "INT32", [1, 16])])
    request.inputs[0].contents.int_contents.extend(range(15))
    request.inputs[1].contents.int_contents.extend(range(16))

    def bad():
        return expect_raw_error(
            stack.url,
            request,
            grpc.StatusCode.INVALID_ARGUMENT,
            contains=("INPUT0", "simple", "16", "15"),
        )

    _check_rejected_then_valid(stack, "simple", bad)


def test_typed_contents_in_the_wrong_field(stack: RunningStack) -> None:
    request = raw_request("simple", [("INPUT0", "INT32", [1, 16]), ("INPUT1", "INT32", [1, 16])])
    request.inputs[0].contents.fp32_contents.extend([1.0] * 16)
    request.inputs[1].contents.int_contents.extend(range(16))

    def bad():
        return expect_raw_error(
            stack.url, request, grpc.StatusCode.INVALID_ARGUMENT, contains=("INPUT0", "simple")
        )

    _check_rejected_then_valid(stack, "simple", bad)


def test_typed_contents_and_raw_contents_together(stack: RunningStack) -> None:
    request = simple_raw_request()
    request.inputs[0].contents.int_contents.extend(range(16))

    def bad():
        return expect_raw_error(
            stack.url, request, grpc.StatusCode.INVALID_ARGUMENT, contains=("INPUT0", "contents")
        )

    _check_rejected_then_valid(stack, "simple", bad)


def test_fp16_cannot_use_typed_contents(stack: RunningStack) -> None:
    request = raw_request("identity_fp16", [("INPUT0", "FP16", [1, 2])])
    request.inputs[0].contents.fp32_contents.extend([1.0, 2.0])

    def bad():
        return expect_raw_error(
            stack.url, request, grpc.StatusCode.INVALID_ARGUMENT, contains=("INPUT0", "FP16", "raw")
        )

    _check_rejected_then_valid(stack, "simple", bad)


@pytest.mark.parametrize(
    ("raw", "shape", "fragment"),
    [
        (b"\x10\x00\x00\x00ab", [1, 1], "declares 16 bytes"),  # length past the end
        (bytes_framing([b"ok"]) + b"\x01\x00", [1, 2], "truncated"),  # cut length prefix
        (bytes_framing([b"a", b"b"]), [1, 3], "3"),  # 2 elements for a shape of 3
    ],
    ids=["length-past-end", "truncated-prefix", "element-count"],
)
def test_malformed_bytes_framing(stack: RunningStack, raw: bytes, shape, fragment: str) -> None:
    request = raw_request("identity_bytes", [("INPUT0", "BYTES", shape)])
    request.raw_input_contents.append(raw)

    def bad():
        return expect_raw_error(
            stack.url,
            request,
            grpc.StatusCode.INVALID_ARGUMENT,
            contains=("INPUT0", "identity_bytes", "BYTES", fragment),
        )

    _check_rejected_then_valid(stack, "identity_bytes", bad)


# ------------------------------------------------------------ inputs/outputs


def test_missing_input(stack: RunningStack) -> None:
    i0 = tensor_input("INPUT0", _ones((1, 16)), "INT32")

    def bad():
        return expect_error(
            _infer(stack, "simple", [i0]), status=INVALID, contains=("INPUT1", "simple", "missing")
        )

    _check_rejected_then_valid(stack, "simple", bad)


def test_unexpected_input(stack: RunningStack) -> None:
    inputs = simple_inputs(_ones((1, 16)), _ones((1, 16)))
    inputs.append(tensor_input("INPUT2", _ones((1, 16)), "INT32"))

    def bad():
        return expect_error(
            _infer(stack, "simple", inputs),
            status=INVALID,
            contains=("INPUT2", "simple", "unexpected"),
        )

    _check_rejected_then_valid(stack, "simple", bad)


def test_duplicate_input(stack: RunningStack) -> None:
    inputs = simple_inputs(_ones((1, 16)), _ones((1, 16)))
    inputs.append(tensor_input("INPUT0", _ones((1, 16)), "INT32"))

    def bad():
        return expect_error(
            _infer(stack, "simple", inputs), status=INVALID, contains=("INPUT0", "simple")
        )

    _check_rejected_then_valid(stack, "simple", bad)


def test_unknown_requested_output(stack: RunningStack) -> None:
    inputs = simple_inputs(_ones((1, 16)), _ones((1, 16)))
    outputs = [
        grpcclient.InferRequestedOutput("OUTPUT0"),
        grpcclient.InferRequestedOutput("OUTPUT9"),
    ]

    def bad():
        return expect_error(
            _infer(stack, "simple", inputs, outputs=outputs),
            status=INVALID,
            contains=("OUTPUT9", "simple"),
        )

    _check_rejected_then_valid(stack, "simple", bad)


def test_output_requested_twice(stack: RunningStack) -> None:
    inputs = simple_inputs(_ones((1, 16)), _ones((1, 16)))
    outputs = [
        grpcclient.InferRequestedOutput("OUTPUT1"),
        grpcclient.InferRequestedOutput("OUTPUT1"),
    ]

    def bad():
        return expect_error(
            _infer(stack, "simple", inputs, outputs=outputs),
            status=INVALID,
            contains=("OUTPUT1", "simple"),
        )

    _check_rejected_then_valid(stack, "simple", bad)


# ---------------------------------------------------------------- parameters


def _with_param(name: str, kind: str, value) -> object:
    request = simple_raw_request()
    setattr(request.parameters[name], kind, value)
    return request


@pytest.mark.parametrize(
    ("name", "kind", "value"),
    [
        ("sequence_id", "bool_param", True),
        ("sequence_id", "double_param", 1.5),
        ("sequence_start", "int64_param", 1),
        ("sequence_end", "string_param", "yes"),
        ("priority", "string_param", "high"),
        ("priority", "bool_param", True),
        ("priority", "double_param", 2.0),
        ("priority", "int64_param", -1),
        ("timeout", "string_param", "soon"),
    ],
    ids=lambda v: str(v),
)
def test_parameter_of_wrong_type(stack: RunningStack, name: str, kind: str, value) -> None:
    request = _with_param(name, kind, value)

    def bad():
        return expect_raw_error(
            stack.url, request, grpc.StatusCode.INVALID_ARGUMENT, contains=(f"'{name}'",)
        )

    _check_rejected_then_valid(stack, "simple", bad)


def test_timeout_parameter_of_wrong_type_through_tritonclient(stack: RunningStack) -> None:
    inputs = simple_inputs(_ones((1, 16)), _ones((1, 16)))

    def bad():
        return expect_error(
            _infer(stack, "simple", inputs, parameters={"timeout": "soon"}),
            status=INVALID,
            contains=("timeout",),
        )

    _check_rejected_then_valid(stack, "simple", bad)


def test_valid_priority_and_timeout_are_accepted(stack: RunningStack) -> None:
    c = stack.client()
    infer_simple(c, priority=3)
    infer_simple(c, timeout=5_000_000)
    request = _with_param("priority", "int64_param", 2)
    with_id = _with_param("sequence_id", "string_param", "corr-1")
    from tests.integration.helpers import raw_infer

    assert raw_infer(stack.url, request).model_name == "simple"
    assert raw_infer(stack.url, with_id).model_name == "simple"


# ----------------------------------------------------------------- streaming


def test_stream_reports_validation_errors_and_keeps_serving(stack: RunningStack) -> None:
    c = stack.client()
    results: queue.Queue = queue.Queue()
    c.start_stream(
        callback=lambda result, error: results.put((result, error)), stream_timeout=RPC_TIMEOUT_S
    )
    try:
        data = _ones((1, 16))
        c.async_stream_infer("simple", simple_inputs(data, _ones((1, 15))), request_id="bad")
        c.async_stream_infer("no_such_model", simple_inputs(data, data), request_id="gone")
        c.async_stream_infer("simple", simple_inputs(data, data), request_id="good")
        got = [results.get(timeout=RPC_TIMEOUT_S) for _ in range(3)]
    finally:
        c.stop_stream()
    errors = [e for _, e in got if e is not None]
    oks = [r for r, e in got if e is None]
    assert len(errors) == 2 and len(oks) == 1
    messages = sorted(e.message() for e in errors)
    assert any("INPUT1" in m for m in messages), messages
    assert any("no_such_model" in m for m in messages), messages
    assert all(isinstance(e, InferenceServerException) for e in errors)
    np.testing.assert_array_equal(oks[0].as_numpy("OUTPUT0"), 2 * data)
    assert oks[0].get_response().id == "good"
