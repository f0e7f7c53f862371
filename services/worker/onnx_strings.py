"""How BYTES tensors can cross ONNX Runtime's Python API exactly.

Triton's ONNX Runtime backend hands string tensors to ORT through the C API
as byte strings, so a string identity model returns arbitrary bytes (NUL,
invalid UTF-8) unchanged. ORT's Python API does not: measured with
onnxruntime 1.32 on an Identity(string) model,

* an object array of ``bytes`` is fed as ``str(x)`` (``"b'a\\x00b'"``: wrong);
* a numpy ``S`` array is decoded as UTF-8 (invalid bytes raise
  UnicodeDecodeError; numpy also drops trailing NULs);
* ``OrtValue`` cannot hold strings ("only supported from non-string arrays");
* an object array of ``str`` passes any text, embedded NULs included, and
  string outputs come back as ``str`` (ORT encodes/decodes UTF-8).

So every byte string must travel as a ``str``. Decoding bytes as Latin-1
maps each byte to one code point (0-255) and back, a bijection: exact for
any bytes, and the cheapest decode there is. But the model then sees
different *text* ("é" sent as UTF-8 arrives as "Ã©"), which matters as soon
as a graph looks at string content (a tokenizer, a comparison with a string
constant, a label map). `bytes_transparent` decides per graph: when string
values only flow from graph inputs through operators that move them
without reading them, Latin-1 transport is exact (StageServe answers what
Triton answers); otherwise strings go as UTF-8 text, and a request whose
bytes are not valid UTF-8 is refused before execution (INVALID_ARGUMENT).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

#: Operators that move, select or compare string elements without reading
#: their text (comparison of two graph-input strings stays exact: Latin-1 is
#: a bijection). Anything else that touches a string makes the graph
#: content-dependent.
MOVING_OPS = frozenset(
    {
        "Identity",
        "Reshape",
        "Squeeze",
        "Unsqueeze",
        "Flatten",
        "Transpose",
        "Concat",
        "Split",
        "Slice",
        "Gather",
        "GatherElements",
        "GatherND",
        "Expand",
        "Tile",
        "Compress",
        "Shape",
        "Size",
        "Equal",
    }
)


def bytes_transparent(model: onnx.ModelProto) -> tuple[bool, str]:
    """(True, "") when every string in the graph comes from a graph input and
    only passes through MOVING_OPS; else (False, why not)."""
    graph = model.graph
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    except Exception as exc:  # onnx raises its own inference errors
        return False, f"the graph's types cannot be inferred ({exc})"
    types: dict[str, int] = {}
    for vi in (*inferred.input, *inferred.output, *inferred.value_info):
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    for init in graph.initializer:
        types[init.name] = init.data_type
        if init.data_type == TensorProto.STRING:
            return False, f"it holds a string constant ('{init.name}')"
    for node in graph.node:
        tensors = [t for t in (*node.input, *node.output) if t]
        untyped = [t for t in tensors if types.get(t, 0) == 0]
        strings = [t for t in tensors if types.get(t) == TensorProto.STRING]
        if not strings and not untyped:
            continue
        if untyped and not strings:
            return False, f"operator {node.op_type} has tensors of unknown type {untyped}"
        if node.domain not in ("", "ai.onnx") or node.op_type not in MOVING_OPS:
            return False, f"operator {node.op_type} reads string content"
        subgraph = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
        if any(a.type in subgraph for a in node.attribute):
            return False, f"operator {node.op_type} has a subgraph"
    return True, ""
