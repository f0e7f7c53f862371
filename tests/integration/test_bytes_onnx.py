"""BYTES with arbitrary content (NUL, invalid UTF-8) through the ONNX backend,
driven by tritonclient: exact where the graph only moves strings, as in
Triton; a graph that reads string content gets UTF-8 text, and other bytes
are refused with INVALID_ARGUMENT naming the limitation."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from stageserve_tools.examples import config_text, write_identity, write_model
from tests.integration.helpers import RPC_TIMEOUT_S, stack_retrying, tensor_input
from tests.stack import RunningStack
from tests.unit.test_onnx_strings import ODD, concat_constant_model


@pytest.fixture(scope="module")
def bytes_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("bytes_repository")
    write_identity(root, "identity_bytes", "BYTES")
    text = config_text(
        "bytes_concat", [("INPUT0", "BYTES", (-1,))], [("OUTPUT0", "BYTES", (-1,))],
        max_batch_size=0,
    )  # fmt: skip
    write_model(root, "bytes_concat", concat_constant_model(), text)
    with stack_retrying(root) as s:
        yield s


def _objects(items, shape) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr.reshape(shape)


def test_identity_returns_arbitrary_bytes_unchanged(bytes_stack: RunningStack) -> None:
    c = bytes_stack.client()
    x = _objects(ODD, (2, 3))
    r = c.infer(
        "identity_bytes", [tensor_input("INPUT0", x, "BYTES")], client_timeout=RPC_TIMEOUT_S
    )
    assert r.as_numpy("OUTPUT0").tolist() == x.tolist()


def test_content_reading_model_takes_utf8_and_refuses_other_bytes(
    bytes_stack: RunningStack,
) -> None:
    c = bytes_stack.client()
    text = _objects(["é".encode(), b"nul\x00inside", b""], (3,))
    r = c.infer(
        "bytes_concat", [tensor_input("INPUT0", text, "BYTES")], client_timeout=RPC_TIMEOUT_S
    )
    assert r.as_numpy("OUTPUT0").tolist() == [*text.tolist(), "é".encode()]
    bad = _objects([b"ok", b"\xff\xfe"], (2,))
    with pytest.raises(InferenceServerException) as err:
        c.infer(
            "bytes_concat", [tensor_input("INPUT0", bad, "BYTES")], client_timeout=RPC_TIMEOUT_S
        )
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    message = err.value.message()
    assert "element 1 is not valid UTF-8" in message and "cannot give it arbitrary bytes" in message
    assert "Traceback" not in message
