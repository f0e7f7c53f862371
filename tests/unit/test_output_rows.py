"""A batch's outputs cut into its requests' tensors (services/worker/tensor_batches.py),
on a real ONNX Runtime session: each request gets its own rows, in the
config's shape (reshape) and byte order."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from services.worker.onnx_backend import OnnxInstance
from services.worker.tensor_batches import TensorBatches
from stageserve.config import parse_config_text, to_spec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensors import raw_to_numpy
from stageserve_tools.examples import batch_size_model


def _batches(tmp_path: Path, max_batch_size: int, output_dims: str) -> TensorBatches:
    path = tmp_path / "model.onnx"
    path.write_bytes(batch_size_model(2).SerializeToString())
    spec = to_spec(
        parse_config_text(
            f"""name: "m" platform: "onnxruntime_onnx" max_batch_size: {max_batch_size}
            input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 2 ] }} ]
            output [ {{ name: "OUTPUT" data_type: TYPE_FP32 {output_dims} }} ]"""
        )
    )
    return TensorBatches(spec, OnnxInstance(path, intra_op_threads=1))


def _request(rows: list[np.ndarray], batching: bool = True) -> pb.ExecuteRequest:
    data = np.concatenate(rows) if batching else rows[0]
    request = pb.ExecuteRequest(request_batch_sizes=[len(r) for r in rows])
    for _ in rows:
        request.requested.add()
    request.inputs.add(name="INPUT", datatype="FP32", shape=list(data.shape), raw=data.tobytes())
    return request


def _answers(response: pb.ExecuteResponse) -> list[tuple[list[int], list]]:
    out = []
    for result in response.results:
        (t,) = result.outputs
        assert (t.name, t.datatype) == ("OUTPUT", "FP32")
        out.append((list(t.shape), raw_to_numpy(t.raw, t.datatype, t.shape).tolist()))
    return out


def test_each_request_gets_its_own_rows(tmp_path: Path) -> None:
    rows = [np.full((1, 2), 10, np.float32), np.full((2, 2), 20, np.float32)]
    response = _batches(tmp_path, 4, "dims: [ 2 ]").execute_batch(_request(rows), None)
    # the model adds the rows it saw (3) to every element
    assert _answers(response) == [([1, 2], [[13, 13]]), ([2, 2], [[23, 23], [23, 23]])]


def test_a_reshaped_output_takes_the_configs_dims_per_request(tmp_path: Path) -> None:
    rows = [np.full((2, 2), 1, np.float32), np.full((1, 2), 5, np.float32)]
    batches = _batches(tmp_path, 4, "dims: [ 1, 2 ] reshape: { shape: [ 2 ] }")
    response = batches.execute_batch(_request(rows), None)
    assert _answers(response) == [([2, 1, 2], [[[4, 4]], [[4, 4]]]), ([1, 1, 2], [[[8, 8]]])]


def test_a_non_batching_model_answers_its_one_request_whole(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(batch_size_model(2).SerializeToString())
    spec = to_spec(
        parse_config_text(
            """name: "m" platform: "onnxruntime_onnx" max_batch_size: 0
            input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1, 2 ] } ]
            output [ {
              name: "OUTPUT" data_type: TYPE_FP32 dims: [ 2 ] reshape: { shape: [ 1, 2 ] }
            } ]"""
        )
    )
    batches = TensorBatches(spec, OnnxInstance(path, intra_op_threads=1))
    data = np.array([[3, 4]], np.float32)
    response = batches.execute_batch(_request([data], batching=False), None)
    assert _answers(response) == [([2], [4, 5])]  # the model's [1, 2] as the config's [2]
