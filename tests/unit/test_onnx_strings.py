"""BYTES through ONNX Runtime's Python API: which graphs carry arbitrary bytes
exactly (services.worker.onnx_strings) and what the backend does otherwise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from services.worker.backends import InvalidInputError
from services.worker.onnx_backend import OnnxInstance
from services.worker.onnx_strings import bytes_transparent
from stageserve_tools.examples import identity_model, make_model

STR = TensorProto.STRING
ODD = [b"", b"a\x00b", b"\xff\xfe", b"\x80", "é".encode(), b"\x00"]


def _graph(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    return make_model(helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits)))


def _io(name: str, elem: int = STR, shape=("n",)) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, list(shape))


def concat_constant_model() -> onnx.ModelProto:
    """OUTPUT0 = concat(INPUT0, ["é"]): a string constant, so content matters."""
    const = numpy_helper.from_array(np.array(["é".encode()], dtype=object), "C")
    node = helper.make_node("Concat", ["INPUT0", "C"], ["OUTPUT0"], axis=0)
    return _graph([node], [_io("INPUT0")], [_io("OUTPUT0", shape=("m",))], [const])


def moving_model() -> onnx.ModelProto:
    """Reshape + Concat + Gather of graph-input strings: moves, never reads."""
    shape = numpy_helper.from_array(np.array([-1], dtype=np.int64), "shape")
    idx = numpy_helper.from_array(np.array([1, 0], dtype=np.int64), "idx")
    nodes = [
        helper.make_node("Concat", ["A", "B"], ["ab"], axis=0),
        helper.make_node("Reshape", ["ab", "shape"], ["flat"]),
        helper.make_node("Gather", ["flat", "idx"], ["OUT"], axis=0),
    ]
    return _graph(nodes, [_io("A"), _io("B")], [_io("OUT", shape=(2,))], [shape, idx])


def test_which_graphs_carry_bytes_exactly() -> None:
    assert bytes_transparent(identity_model("BYTES")) == (True, "")
    assert bytes_transparent(moving_model())[0]
    exact, why = bytes_transparent(concat_constant_model())
    assert not exact and "string constant" in why
    normalizer = _graph(
        [helper.make_node("StringNormalizer", ["X"], ["Y"], case_change_action="LOWER")],
        [_io("X", shape=(3,))],
        [_io("Y", shape=(3,))],
    )
    exact, why = bytes_transparent(normalizer)
    assert not exact and "StringNormalizer reads string content" in why


def _instance(tmp_path: Path, model: onnx.ModelProto, ins, outs) -> OnnxInstance:
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    return OnnxInstance(path, "cpu", 1, ins, outs)


def _objects(items) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr


def test_moving_graph_passes_any_bytes(tmp_path: Path) -> None:
    inst = _instance(tmp_path, moving_model(), {"A": "BYTES", "B": "BYTES"}, {"OUT": "BYTES"})
    out = inst.run({"A": _objects([b"\xff"]), "B": _objects([b"\x00\x81"])})["OUT"]
    assert out.tolist() == [b"\x00\x81", b"\xff"]


def test_content_reading_graph_gets_utf8_and_refuses_other_bytes(tmp_path: Path) -> None:
    inst = _instance(tmp_path, concat_constant_model(), {"INPUT0": "BYTES"}, {"OUTPUT0": "BYTES"})
    assert inst.string_encoding == "utf-8"
    text = ["é".encode(), b"nul\x00inside"]
    out = inst.run({"INPUT0": _objects(text)})["OUTPUT0"]
    assert out.tolist() == [*text, "é".encode()]  # the model's constant is UTF-8 text
    with pytest.raises(InvalidInputError, match="element 1 is not valid UTF-8.*string constant"):
        inst.run({"INPUT0": _objects([b"ok", b"\xff"])})
    # an element that is not bytes at all (a direct caller's None) is refused
    # the same way (not an AttributeError from the error handler)
    with pytest.raises(InvalidInputError, match="element 1 .*NoneType"):
        inst.run({"INPUT0": _objects([b"ok", None])})
