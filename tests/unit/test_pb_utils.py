"""python_backend/pb_utils.py: the triton_python_backend_utils surface a model.py uses."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from services.worker.python_backend import pb_utils


def test_bytes_serialization_round_trip_is_exact() -> None:
    values = np.array([b"a\x00b", b"\xff\xfe", b"", "\u00e9"], dtype=np.object_)
    encoded = pb_utils.serialize_byte_tensor(values)
    assert encoded is not None and encoded.dtype == np.uint8
    decoded = pb_utils.deserialize_bytes_tensor(encoded.tobytes())
    assert decoded.tolist() == [b"a\x00b", b"\xff\xfe", b"", "\u00e9".encode()]


def test_type_tables() -> None:
    assert pb_utils.triton_string_to_numpy("TYPE_FP32") is np.float32
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert pb_utils.triton_to_numpy_type(11) is np.float32
    assert pb_utils.numpy_to_triton_type(np.int64) == 9
    assert pb_utils.numpy_to_triton_type(np.object_) == 13


def test_tensor_and_lookups() -> None:
    t = pb_utils.Tensor("X", np.arange(6, dtype=np.float32).reshape(2, 3))
    assert t.name() == "X" and t.shape() == [2, 3] and t.is_cpu()
    back = pb_utils.Tensor.from_dlpack("Y", t.to_dlpack())
    np.testing.assert_array_equal(back.as_numpy(), t.as_numpy())
    req = pb_utils.InferenceRequest(model_name="m", requested_output_names=["O"], inputs=[t])
    assert pb_utils.get_input_tensor_by_name(req, "X") is t
    assert pb_utils.get_input_tensor_by_name(req, "nope") is None
    resp = pb_utils.InferenceResponse([t])
    assert pb_utils.get_output_tensor_by_name(resp, "X") is t and not resp.has_error()
    config = {"input": [{"name": "X"}], "output": [{"name": "O", "data_type": "TYPE_FP32"}]}
    out = pb_utils.get_output_config_by_name(config, "O")
    assert out is not None and out["data_type"] == "TYPE_FP32"
    assert pb_utils.get_input_config_by_name(config, "Z") is None


def test_error_codes() -> None:
    err = pb_utils.TritonError("nope", pb_utils.TritonError.NOT_FOUND)
    assert err.message() == "nope" and err.code() == pb_utils.TritonError.NOT_FOUND
    assert pb_utils.TritonError("x").code() == pb_utils.TritonError.INTERNAL
    resp = pb_utils.InferenceResponse(error=err)
    assert resp.has_error() and resp.error() is err
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.InferenceResponse(error="not an error object")  # type: ignore[arg-type]


def test_async_exec_needs_a_running_loop_and_a_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """As Triton 2.51's (asyncio.get_running_loop() first): a plain `def
    execute` calling async_exec() gets RuntimeError, not a coroutine."""
    monkeypatch.setattr(pb_utils.InferenceRequest, "_bls", None)  # outside a worker
    request = pb_utils.InferenceRequest(model_name="m", requested_output_names=["O"])
    with pytest.raises(RuntimeError, match="no running event loop"):
        request.async_exec()

    async def in_a_loop() -> None:
        with pytest.raises(pb_utils.TritonModelException, match="inside a model"):
            request.async_exec()

    asyncio.run(in_a_loop())


def test_response_sender_final_flag_closes_it() -> None:
    sent: list[tuple[object, bool]] = []
    sender = pb_utils.InferenceResponseSender(lambda r, final: sent.append((r, final)))
    resp = pb_utils.InferenceResponse([])
    sender.send(resp)
    with pytest.raises(pb_utils.TritonModelException):
        sender.send()  # no response and not final
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    assert sent == [(resp, False), (None, True)]
    with pytest.raises(pb_utils.TritonModelException):
        sender.send(resp)


def test_request_parameters_are_json() -> None:
    req = pb_utils.InferenceRequest(parameters={"b": 1, "a": "x"})
    assert json.loads(req.parameters()) == {"a": "x", "b": 1}
    with pytest.raises(pb_utils.TritonModelException):
        req.get_response_sender()  # not a decoupled model's request


def test_model_config_completion_rules() -> None:
    config = pb_utils.ModelConfig(json.dumps({"name": "m", "max_batch_size": 4}))
    config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [2]})
    config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [2], "optional": True})
    assert config.as_dict()["input"] == [
        {"name": "IN", "data_type": "TYPE_FP32", "dims": [2], "optional": True}
    ]
    with pytest.raises(ValueError, match="configuration expects datatype TYPE_FP32"):
        config.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [2]})
    with pytest.raises(ValueError, match="the model expects dims"):
        config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [3]})
    with pytest.raises(ValueError, match="missing 'dims'"):
        config.add_output({"name": "O", "data_type": "TYPE_FP32"})
    with pytest.raises(ValueError, match="contains property other than"):
        config.add_output({"name": "O", "data_type": "TYPE_FP32", "dims": [1], "x": 1})
    with pytest.raises(ValueError, match="specified max_batch_size 4"):
        config.set_max_batch_size(2)
    config.set_max_batch_size(8)
    config.set_dynamic_batching()
    config.set_model_transaction_policy({"decoupled": True})
    with pytest.raises(ValueError, match="trying to change decoupled"):
        config.set_model_transaction_policy({"decoupled": False})
    assert config.as_dict()["max_batch_size"] == 8
    assert config.as_dict()["dynamic_batching"] == {}
    sequence = pb_utils.ModelConfig({"name": "s", "sequence_batching": {}})
    with pytest.raises(ValueError, match="'sequence_batching'"):
        sequence.set_dynamic_batching()
