"""services.worker.onnx_backend: loading, type handling, describe(), errors."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from services.worker.backends import BackendError, parse_device
from services.worker.onnx_backend import OnnxInstance
from stageserve_tools import examples

I32 = {"INPUT0": "INT32", "INPUT1": "INT32"}
O32 = {"OUTPUT0": "INT32", "OUTPUT1": "INT32"}


@pytest.fixture(scope="module")
def simple_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    return examples.write_simple(root) / "1" / "model.onnx"


def _save(tmp_path: Path, graph, name: str = "model.onnx") -> Path:
    path = tmp_path / name
    path.write_bytes(examples.make_model(graph).SerializeToString())
    return path


def _vi(name: str, elem: int, shape=("batch", "n")):
    return helper.make_tensor_value_info(name, elem, list(shape))


# --------------------------------------------------------------------------
# load errors


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match="not found"):
        OnnxInstance(tmp_path / "nope.onnx", "cpu", 0, I32, O32)


def test_corrupt_file(tmp_path: Path) -> None:
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"this is not a protobuf \x00\xff" * 10)
    with pytest.raises(BackendError, match="failed to load"):
        OnnxInstance(bad, "cpu", 0, I32, O32)


def test_truncated_file(tmp_path: Path, simple_path: Path) -> None:
    bad = tmp_path / "model.onnx"
    bad.write_bytes(simple_path.read_bytes()[:40])
    with pytest.raises(BackendError):
        OnnxInstance(bad, "cpu", 0, I32, O32)


def test_empty_file(tmp_path: Path) -> None:
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"")
    with pytest.raises(BackendError):
        OnnxInstance(bad, "cpu", 0, I32, O32)


def test_config_input_not_in_model(simple_path: Path) -> None:
    with pytest.raises(BackendError, match="'INPUT9'.*not a model input"):
        OnnxInstance(simple_path, "cpu", 0, {**I32, "INPUT9": "INT32"}, O32)


def test_config_output_not_in_model(simple_path: Path) -> None:
    with pytest.raises(BackendError, match="'OUTPUT7'.*not a model output"):
        OnnxInstance(simple_path, "cpu", 0, I32, {"OUTPUT7": "INT32"})


def test_model_input_missing_from_config(simple_path: Path) -> None:
    with pytest.raises(BackendError, match="INPUT1"):
        OnnxInstance(simple_path, "cpu", 0, {"INPUT0": "INT32"}, O32)


def test_datatype_mismatch(simple_path: Path) -> None:
    with pytest.raises(BackendError, match="TYPE_FP32.*'INPUT0'.*TYPE_INT32"):
        OnnxInstance(simple_path, "cpu", 0, {"INPUT0": "FP32", "INPUT1": "INT32"}, O32)
    with pytest.raises(BackendError, match="unknown datatype"):
        OnnxInstance(simple_path, "cpu", 0, {"INPUT0": "FLOAT", "INPUT1": "INT32"}, O32)


def test_bad_device(simple_path: Path) -> None:
    with pytest.raises(BackendError, match="unknown device"):
        OnnxInstance(simple_path, "tpu:0", 0, I32, O32)


def test_parse_device() -> None:
    assert parse_device("cpu") == ("cpu", 0)
    assert parse_device("cuda") == ("cuda", 0)
    assert parse_device("cuda:3") == ("cuda", 3)
    assert parse_device("GPU:1") == ("cuda", 1)


# --------------------------------------------------------------------------
# providers, describe, subsets


@pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers(), reason="CUDA EP present"
)
def test_cuda_falls_back_to_cpu(simple_path: Path) -> None:
    inst = OnnxInstance(simple_path, "cuda:0", 0, I32, O32)
    assert inst.device == "cpu"
    assert inst.providers == ["CPUExecutionProvider"]


@pytest.mark.gpu
@pytest.mark.skipif(
    "CUDAExecutionProvider" not in ort.get_available_providers(), reason="no CUDA EP"
)
def test_cuda_provider(simple_path: Path) -> None:  # pragma: no cover - needs a GPU
    inst = OnnxInstance(simple_path, "cuda:0", 0, I32, O32)
    assert inst.providers[0] == "CUDAExecutionProvider"
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    np.testing.assert_array_equal(inst.run({"INPUT0": a, "INPUT1": a})["OUTPUT0"], a * 2)


def test_describe(simple_path: Path) -> None:
    inst = OnnxInstance(simple_path, "cpu", 1, I32, O32)
    d = inst.describe()
    assert [t.name for t in d.inputs] == ["INPUT0", "INPUT1"]
    assert [t.name for t in d.outputs] == ["OUTPUT0", "OUTPUT1"]
    t = d.input("INPUT0")
    assert t.datatype == "INT32" and t.ort_type == "tensor(int32)"
    assert t.shape == (-1, 16) and t.dim_names == ("batch", None)
    assert d.output("OUTPUT1").shape == (-1, 16)
    assert d.providers == ("CPUExecutionProvider",)


def test_types_default_to_the_model(simple_path: Path) -> None:
    inst = OnnxInstance(simple_path)
    assert {n: t.triton for n, t in inst.input_types.items()} == I32
    assert {n: t.triton for n, t in inst.output_types.items()} == O32


def test_output_subset_and_order(simple_path: Path) -> None:
    inst = OnnxInstance(simple_path, "cpu", 1, I32, {"OUTPUT1": "INT32"})
    a = np.full((2, 16), 5, np.int32)
    b = np.full((2, 16), 2, np.int32)
    out = inst.run({"INPUT0": a, "INPUT1": b})
    assert list(out) == ["OUTPUT1"]
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)
    with pytest.raises(BackendError, match="unknown output 'OUTPUT0'"):
        inst.run({"INPUT0": a, "INPUT1": b}, ["OUTPUT0"])


# --------------------------------------------------------------------------
# run errors


def test_run_errors(simple_path: Path) -> None:
    inst = OnnxInstance(simple_path, "cpu", 1, I32, O32)
    a = np.zeros((2, 16), np.int32)
    with pytest.raises(BackendError, match="missing input"):
        inst.run({"INPUT0": a}, ["OUTPUT0"])
    with pytest.raises(BackendError, match="unknown input"):
        inst.run({"INPUT0": a, "INPUT1": a, "EXTRA": a}, ["OUTPUT0"])
    with pytest.raises(BackendError, match="INT32 but the array is float32"):
        inst.run({"INPUT0": a.astype(np.float32), "INPUT1": a}, ["OUTPUT0"])
    with pytest.raises(BackendError, match="run failed"):  # dims [16] fixed in the model
        inst.run({"INPUT0": np.zeros((2, 15), np.int32), "INPUT1": a[:, :15]}, ["OUTPUT0"])
    with pytest.raises(BackendError, match="run failed"):  # batch sizes disagree
        inst.run({"INPUT0": a, "INPUT1": np.zeros((3, 16), np.int32)}, ["OUTPUT0"])
    # still usable afterwards
    np.testing.assert_array_equal(inst.run({"INPUT0": a, "INPUT1": a})["OUTPUT0"], a)


def test_run_accepts_non_contiguous(simple_path: Path) -> None:
    inst = OnnxInstance(simple_path, "cpu", 1, I32, O32)
    a = np.arange(64, dtype=np.int32).reshape(16, 4).T  # (4, 16), Fortran order
    out = inst.run({"INPUT0": a, "INPUT1": a}, ["OUTPUT0"])
    np.testing.assert_array_equal(out["OUTPUT0"], a * 2)


def test_concurrent_runs(simple_path: Path) -> None:
    inst = OnnxInstance(simple_path, "cpu", 1, I32, O32)

    def go(i: int) -> bool:
        a = np.full((i % 7 + 1, 16), i, np.int32)
        out = inst.run({"INPUT0": a, "INPUT1": a}, ["OUTPUT0", "OUTPUT1"])
        return bool((out["OUTPUT0"] == 2 * i).all() and (out["OUTPUT1"] == 0).all())

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(go, range(200)))


# --------------------------------------------------------------------------
# BF16 and BYTES


@pytest.fixture(scope="module")
def mixed_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """BF16 in -> BF16 identity, bf16->fp32 cast; FP32 in -> bf16 cast; strings in/out."""
    t = TensorProto
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["B"], ["B_ID"]),
            helper.make_node("Cast", ["B"], ["B_AS_F32"], to=t.FLOAT),
            helper.make_node("Cast", ["F"], ["F_AS_BF16"], to=t.BFLOAT16),
            helper.make_node("Identity", ["S"], ["S_ID"]),
        ],
        "mixed",
        [_vi("B", t.BFLOAT16), _vi("F", t.FLOAT), _vi("S", t.STRING)],
        [
            _vi("B_ID", t.BFLOAT16),
            _vi("B_AS_F32", t.FLOAT),
            _vi("F_AS_BF16", t.BFLOAT16),
            _vi("S_ID", t.STRING),
        ],
    )
    return _save(tmp_path_factory.mktemp("mixed"), graph)


MIXED_IN = {"B": "BF16", "F": "FP32", "S": "BYTES"}
MIXED_OUT = {"B_ID": "BF16", "B_AS_F32": "FP32", "F_AS_BF16": "BF16", "S_ID": "BYTES"}


def _bf16_words(values) -> np.ndarray:
    """Exactly representable floats -> their bfloat16 words (top half of fp32)."""
    return (np.asarray(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _strings(rows: int, cols: int) -> np.ndarray:
    pool = [b"", "\u00e9t\u00e9".encode(), "\u4e2d\u6587".encode(), b"a\x00b", b"z"]
    arr = np.empty(rows * cols, dtype=object)
    arr[:] = [pool[i % len(pool)] for i in range(rows * cols)]
    return arr.reshape(rows, cols)


def test_bf16_inputs_are_fed_as_bfloat16(mixed_path: Path) -> None:
    inst = OnnxInstance(mixed_path, "cpu", 1, MIXED_IN, MIXED_OUT)
    vals = np.array([[1.0, -2.5, 0.0, 2.0**100], [-0.0, 0.15625, 65536.0, -1.0]], np.float32)
    b = _bf16_words(vals)
    f = np.ones((2, 4), np.float32)
    s = _strings(2, 3)
    # no BF16 output requested: the plain run path, strings allowed
    out = inst.run({"B": b, "F": f, "S": s}, ["B_AS_F32", "S_ID"])
    np.testing.assert_array_equal(out["B_AS_F32"].view(np.uint32), vals.view(np.uint32))
    assert out["S_ID"].tolist() == s.tolist()


def test_bf16_outputs_come_back_as_uint16(tmp_path: Path) -> None:
    t = TensorProto
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["B"], ["B_ID"]),
            helper.make_node("Cast", ["F"], ["F_AS_BF16"], to=t.BFLOAT16),
            helper.make_node("Identity", ["F"], ["F_ID"]),
        ],
        "bf16_out",
        [_vi("B", t.BFLOAT16), _vi("F", t.FLOAT)],
        [_vi("B_ID", t.BFLOAT16), _vi("F_AS_BF16", t.BFLOAT16), _vi("F_ID", t.FLOAT)],
    )
    path = _save(tmp_path, graph)
    inst = OnnxInstance(path)
    assert inst.input_types["B"].triton == "BF16"
    b = np.array([[0x3F80, 0x7FC1, 0xFF80, 0x0001, 0x8000]], np.uint16)  # NaN payload kept
    f = np.array([[1.0, -2.5, 0.0, 0.15625, 65536.0]], np.float32)
    out = inst.run({"B": b, "F": f}, ["F_ID", "B_ID", "F_AS_BF16"])
    assert list(out) == ["F_ID", "B_ID", "F_AS_BF16"]
    assert out["B_ID"].dtype == np.uint16 and out["F_AS_BF16"].dtype == np.uint16
    np.testing.assert_array_equal(out["B_ID"], b)
    np.testing.assert_array_equal(out["F_AS_BF16"], _bf16_words(f))
    np.testing.assert_array_equal(out["F_ID"], f)
    # empty tensors
    out = inst.run({"B": np.empty((3, 0), np.uint16), "F": np.empty((3, 0), np.float32)})
    assert out["B_ID"].shape == (3, 0) and out["B_ID"].dtype == np.uint16
    # ml_dtypes.bfloat16 arrays are accepted as well
    ml_dtypes = pytest.importorskip("ml_dtypes")
    out = inst.run({"B": b.view(ml_dtypes.bfloat16), "F": f}, ["B_ID"])
    np.testing.assert_array_equal(out["B_ID"], b)
    with pytest.raises(BackendError, match="uint16"):
        inst.run({"B": b.astype(np.float32), "F": f}, ["B_ID"])


def test_bf16_output_with_string_input_is_refused(mixed_path: Path) -> None:
    inst = OnnxInstance(mixed_path, "cpu", 1, MIXED_IN, MIXED_OUT)
    feeds = {"B": _bf16_words([[1.0]]), "F": np.ones((1, 1), np.float32), "S": _strings(1, 1)}
    with pytest.raises(BackendError, match="cannot bind string inputs"):
        inst.run(feeds, ["B_ID"])


def test_bytes_edge_cases(tmp_path: Path) -> None:
    path = tmp_path / "id.onnx"
    path.write_bytes(examples.identity_model("BYTES").SerializeToString())
    inst = OnnxInstance(path, "cpu", 1, {"INPUT0": "BYTES"}, {"OUTPUT0": "BYTES"})
    items = [b"", b"", "\u00fcml\u00e4ut".encode(), b"\x00\x00", "\U0001f600".encode()]
    x = np.empty((1, len(items)), dtype=object)
    x[0, :] = items
    out = inst.run({"INPUT0": x})["OUTPUT0"]
    assert out.tolist() == [items]
    assert all(type(v) is bytes for v in out.reshape(-1))
    # str elements are accepted and come back as UTF-8 bytes
    y = np.array([["caf\u00e9", ""]], dtype=object)
    assert inst.run({"INPUT0": y})["OUTPUT0"].tolist() == [["caf\u00e9".encode(), b""]]
    # an Identity graph only moves strings: any bytes pass exactly (Latin-1 transport)
    assert inst.string_encoding == "latin-1"
    z = np.empty((1, 3), dtype=object)
    z[0, :] = [b"ok", b"\xff\xfe", b"\x00\x80\xc3"]
    assert inst.run({"INPUT0": z})["OUTPUT0"].tolist() == [[b"ok", b"\xff\xfe", b"\x00\x80\xc3"]]
