"""Build a Triton-layout example model repository from code.

Every model is an ONNX graph made with ``onnx.helper`` plus a Triton
``config.pbtxt``, written as ``<root>/<model>/config.pbtxt`` and
``<root>/<model>/<version>/model.onnx``, or a Triton Python-backend
``<version>/model.py``; where torch is installed, the TorchScript models of
``stageserve_tools.torch_examples`` join them. Nothing is downloaded.

    python -m stageserve_tools.examples OUTDIR

The graphs use ONNX opset ``OPSET`` with IR version ``IR_VERSION``: old enough
for the ONNX Runtime releases that Triton images ship, new enough for
Identity to accept every Triton datatype (bfloat16 and string included).
When ``max_batch_size > 0`` the leading ONNX dimension is the symbolic
``"batch"``, so any batch size runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from stageserve.datatypes import BY_TRITON, DataType, from_triton

OPSET = 17
IR_VERSION = 8

#: Every Triton datatype, in model_config.proto order; one identity model each.
ALL_DATATYPES: tuple[str, ...] = tuple(BY_TRITON)

MLP_SEED = 20240607

#: (name, Triton datatype, dims as written in config.pbtxt)
TensorSpec = tuple[str, str, Sequence[int]]


# --------------------------------------------------------------------------
# config.pbtxt text


def _dims_text(dims: Sequence[int]) -> str:
    return "[ " + ", ".join(str(int(d)) for d in dims) + " ]"


def _tensor_block(spec: TensorSpec) -> str:
    name, datatype, dims = spec
    dt = from_triton(datatype.upper())
    return (
        "  {\n"
        f'    name: "{name}"\n'
        f"    data_type: {dt.config_enum}\n"
        f"    dims: {_dims_text(dims)}\n"
        "  }"
    )


def config_text(
    name: str,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    *,
    max_batch_size: int,
    dynamic_batching: bool = False,
    max_queue_delay_microseconds: int = 0,
    instance_count: int = 1,
    kind: str = "KIND_CPU",
    platform: str = "onnxruntime_onnx",
) -> str:
    """A Triton config.pbtxt for an ONNX model (text format of ModelConfig)."""
    parts = [
        f'name: "{name}"',
        f'platform: "{platform}"',
        f"max_batch_size: {int(max_batch_size)}",
        "input [\n" + ",\n".join(_tensor_block(s) for s in inputs) + "\n]",
        "output [\n" + ",\n".join(_tensor_block(s) for s in outputs) + "\n]",
        f"instance_group [\n  {{\n    count: {int(instance_count)}\n    kind: {kind}\n  }}\n]",
    ]
    if dynamic_batching:
        parts.append(
            "dynamic_batching {\n"
            f"  max_queue_delay_microseconds: {int(max_queue_delay_microseconds)}\n"
            "}"
        )
    return "\n".join(parts) + "\n"


# --------------------------------------------------------------------------
# ONNX helpers


def _onnx_shape(dims: Sequence[int], max_batch_size: int, prefix: str) -> list[int | str]:
    """Config dims -> ONNX shape: symbolic batch dim first, -1 -> symbolic."""
    shape: list[int | str] = ["batch"] if max_batch_size > 0 else []
    for i, d in enumerate(dims):
        shape.append(f"{prefix}{i}" if int(d) < 0 else int(d))
    return shape


def _value_info(name: str, dt: DataType, shape: list[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dt.onnx, shape)


def make_model(graph: onnx.GraphProto) -> onnx.ModelProto:
    """Wrap a graph with the repository's opset / IR version and check it."""
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="stageserve.examples",
    )
    onnx.checker.check_model(model)
    return model


def write_model(
    root: Path,
    name: str,
    onnx_model: onnx.ModelProto | bytes,
    config_text: str,
    versions: Iterable[int] = (1,),
) -> Path:
    """Write ``<root>/<name>/config.pbtxt`` and ``<root>/<name>/<v>/model.onnx``."""
    model_dir = Path(root) / name
    model_dir.mkdir(parents=True, exist_ok=True)
    data = onnx_model if isinstance(onnx_model, bytes) else onnx_model.SerializeToString()
    for v in versions:
        vdir = model_dir / str(int(v))
        vdir.mkdir(parents=True, exist_ok=True)
        (vdir / "model.onnx").write_bytes(data)
    (model_dir / "config.pbtxt").write_text(config_text)
    return model_dir


# --------------------------------------------------------------------------
# the example models


def simple_model(max_batch_size: int = 8, dims: Sequence[int] = (16,)) -> onnx.ModelProto:
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, all INT32."""
    dt = from_triton("INT32")
    shape = _onnx_shape(dims, max_batch_size, "d")
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"], name="add"),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"], name="sub"),
        ],
        "simple",
        [_value_info("INPUT0", dt, shape), _value_info("INPUT1", dt, shape)],
        [_value_info("OUTPUT0", dt, shape), _value_info("OUTPUT1", dt, shape)],
    )
    return make_model(graph)


def batch_size_model(width: int = 2) -> onnx.ModelProto:
    """OUTPUT = INPUT + the batch size the session ran (FP32 [batch, width]):
    each answer shows how many rows the model saw (batch padding's tests)."""
    dt = from_triton("FP32")
    shape = _onnx_shape((width,), 1, "d")
    graph = helper.make_graph(
        [
            helper.make_node("Shape", ["INPUT"], ["rows"], name="rows", start=0, end=1),
            helper.make_node("Cast", ["rows"], ["rows_f"], name="cast", to=dt.onnx),
            helper.make_node("Add", ["INPUT", "rows_f"], ["OUTPUT"], name="add"),
        ],
        "batch_size",
        [_value_info("INPUT", dt, shape)],
        [_value_info("OUTPUT", dt, shape)],
    )
    return make_model(graph)


def write_simple(
    root: Path,
    name: str = "simple",
    max_batch_size: int = 8,
    *,
    dims: Sequence[int] | None = None,
    dynamic_batching: bool | None = None,
    instance_count: int = 1,
    kind: str = "KIND_CPU",
) -> Path:
    """Triton's classic add/sub model.

    With ``max_batch_size > 0`` the dims are ``[16]`` and dynamic batching is
    on; with ``max_batch_size == 0`` the dims are ``[1, 16]`` (no batch dim,
    the shape tritonclient's simple examples send) and batching is off.
    """
    if dims is None:
        dims = (16,) if max_batch_size > 0 else (1, 16)
    if dynamic_batching is None:
        dynamic_batching = max_batch_size > 0
    ios = [("INPUT0", "INT32", dims), ("INPUT1", "INT32", dims)]
    outs = [("OUTPUT0", "INT32", dims), ("OUTPUT1", "INT32", dims)]
    text = config_text(
        name,
        ios,
        outs,
        max_batch_size=max_batch_size,
        dynamic_batching=dynamic_batching,
        instance_count=instance_count,
        kind=kind,
    )
    return write_model(root, name, simple_model(max_batch_size, dims), text)


def identity_model(
    datatype: str, dims: Sequence[int] = (-1,), max_batch_size: int = 64
) -> onnx.ModelProto:
    """INPUT0 -> OUTPUT0 unchanged, via ONNX Identity (valid for every datatype)."""
    dt = from_triton(datatype.upper())
    shape = _onnx_shape(dims, max_batch_size, "d")
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"], name="identity")],
        f"identity_{dt.triton.lower()}",
        [_value_info("INPUT0", dt, shape)],
        [_value_info("OUTPUT0", dt, shape)],
    )
    return make_model(graph)


def write_identity(
    root: Path,
    name: str,
    datatype: str,
    dims: Sequence[int] = (-1,),
    max_batch_size: int = 64,
    dynamic_batching: bool = True,
    instance_count: int = 1,
    *,
    kind: str = "KIND_CPU",
) -> Path:
    dt = from_triton(datatype.upper())
    text = config_text(
        name,
        [("INPUT0", dt.triton, dims)],
        [("OUTPUT0", dt.triton, dims)],
        max_batch_size=max_batch_size,
        dynamic_batching=dynamic_batching and max_batch_size > 0,
        instance_count=instance_count,
        kind=kind,
    )
    return write_model(root, name, identity_model(dt.triton, dims, max_batch_size), text)


def mlp_weights(
    sizes: Sequence[int] = (256, 1024, 1024, 10), seed: int = MLP_SEED
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Deterministic (W, b) per layer, He-scaled so the softmax is not degenerate."""
    rng = np.random.default_rng(seed)
    layers = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
        w = rng.standard_normal((fan_in, fan_out), dtype=np.float32)
        w *= np.float32(np.sqrt(2.0 / fan_in))
        b = (rng.standard_normal(fan_out, dtype=np.float32) * np.float32(0.01)).astype(np.float32)
        layers.append((w, b))
    return layers


def mlp_reference(x: np.ndarray, layers: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """numpy forward pass of the MLP (float64 accumulate), for tests."""
    h = x.astype(np.float64)
    for i, (w, b) in enumerate(layers):
        h = h @ w.astype(np.float64) + b.astype(np.float64)
        if i < len(layers) - 1:
            h = np.maximum(h, 0.0)
    h = h - h.max(axis=-1, keepdims=True)
    e = np.exp(h)
    return e / e.sum(axis=-1, keepdims=True)


def mlp_model(
    sizes: Sequence[int] = (256, 1024, 1024, 10), max_batch_size: int = 64, seed: int = MLP_SEED
) -> onnx.ModelProto:
    """Gemm -> Relu -> ... -> Gemm -> Softmax classifier, FP32."""
    if len(sizes) < 2:
        raise ValueError("an MLP needs at least an input and an output size")
    dt = from_triton("FP32")
    layers = mlp_weights(sizes, seed)
    nodes, inits = [], []
    cur = "INPUT0"
    for i, (w, b) in enumerate(layers):
        inits.append(numpy_helper.from_array(w, f"W{i}"))
        inits.append(numpy_helper.from_array(b, f"B{i}"))
        out = f"fc{i}"
        nodes.append(helper.make_node("Gemm", [cur, f"W{i}", f"B{i}"], [out], name=f"gemm{i}"))
        cur = out
        if i < len(layers) - 1:
            nodes.append(helper.make_node("Relu", [cur], [f"relu{i}"], name=f"relu{i}"))
            cur = f"relu{i}"
    nodes.append(helper.make_node("Softmax", [cur], ["OUTPUT0"], name="softmax", axis=-1))
    if max_batch_size > 0:
        in_shape: list[int | str] = ["batch", int(sizes[0])]
        out_shape: list[int | str] = ["batch", int(sizes[-1])]
    else:  # Gemm needs 2-D input: a fixed batch of one
        in_shape, out_shape = [1, int(sizes[0])], [1, int(sizes[-1])]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [_value_info("INPUT0", dt, in_shape)],
        [_value_info("OUTPUT0", dt, out_shape)],
        initializer=inits,
    )
    return make_model(graph)


def write_mlp(
    root: Path,
    name: str = "mlp",
    sizes: Sequence[int] = (256, 1024, 1024, 10),
    max_batch_size: int = 64,
    instance_count: int = 1,
    *,
    dynamic_batching: bool = True,
    kind: str = "KIND_CPU",
    seed: int = MLP_SEED,
) -> Path:
    in_dims: tuple[int, ...]
    out_dims: tuple[int, ...]
    if max_batch_size > 0:
        in_dims, out_dims = (int(sizes[0]),), (int(sizes[-1]),)
    else:
        in_dims, out_dims = (1, int(sizes[0])), (1, int(sizes[-1]))
    text = config_text(
        name,
        [("INPUT0", "FP32", in_dims)],
        [("OUTPUT0", "FP32", out_dims)],
        max_batch_size=max_batch_size,
        dynamic_batching=dynamic_batching and max_batch_size > 0,
        instance_count=instance_count,
        kind=kind,
    )
    return write_model(root, name, mlp_model(sizes, max_batch_size, seed), text)


# --------------------------------------------------------------------------
# a stateful model for the sequence batcher


# The three forms a sequence control can take in config.pbtxt, with the
# false/true values the accumulator's configs use.
CONTROL_FORMS = {
    "INT32": "int32_false_true: [ 0, 1 ]",
    "FP32": "fp32_false_true: [ 0.0, 1.0 ]",
    "BOOL": "bool_false_true: [ false, true ]",
}


def accumulator_model(
    corrid_type: str = "UINT64", max_batch_size: int = 8, control_type: str = "INT32"
) -> onnx.ModelProto:
    """Running sum per sequence, kept in implicit state ACC_IN -> ACC_OUT.

    OUTPUT = (0 if START else ACC_IN) + INPUT; the control inputs are echoed
    (START_OUT, END_OUT, READY_OUT, CORRID_OUT) so tests can see what the
    scheduler filled in.
    """
    i32 = from_triton("INT32")
    ctl = from_triton(control_type)
    corr = from_triton(corrid_type)
    shape = _onnx_shape((1,), max_batch_size, "d")
    inputs = (
        [_value_info(n, i32, shape) for n in ("INPUT", "ACC_IN")]
        + [_value_info(n, ctl, shape) for n in ("START", "END", "READY")]
        + [_value_info("CORRID", corr, shape)]
    )
    outputs = (
        [_value_info(n, i32, shape) for n in ("OUTPUT", "ACC_OUT")]
        + [_value_info(n, ctl, shape) for n in ("START_OUT", "END_OUT", "READY_OUT")]
        + [_value_info("CORRID_OUT", corr, shape)]
    )
    zero = helper.make_tensor("zero", i32.onnx, [], [0])
    nodes = [
        helper.make_node("Cast", ["START"], ["start_b"], to=onnx.TensorProto.BOOL),
        helper.make_node("Where", ["start_b", "zero", "ACC_IN"], ["base"]),
        helper.make_node("Add", ["base", "INPUT"], ["sum"]),
        helper.make_node("Identity", ["sum"], ["OUTPUT"]),
        helper.make_node("Identity", ["sum"], ["ACC_OUT"]),
        helper.make_node("Identity", ["START"], ["START_OUT"]),
        helper.make_node("Identity", ["END"], ["END_OUT"]),
        helper.make_node("Identity", ["READY"], ["READY_OUT"]),
        helper.make_node("Identity", ["CORRID"], ["CORRID_OUT"]),
    ]
    graph = helper.make_graph(nodes, "accumulator", inputs, outputs, initializer=[zero])
    return make_model(graph)


def accumulator_config(
    name: str,
    corrid_type: str = "UINT64",
    strategy: str = "oldest",
    max_batch_size: int = 8,
    idle_us: int = 5_000_000,
    instance_count: int = 1,
    extra: str = "",
    control_type: str = "INT32",
) -> str:
    corr_enum = from_triton(corrid_type).config_enum
    ctl_enum = from_triton(control_type).config_enum
    form = CONTROL_FORMS[control_type]
    if strategy == "direct":
        strategy_text = "direct { }"
    else:
        strategy_text = "oldest { max_candidate_sequences: 64 }"
    outs = ",\n".join(
        f'  {{ name: "{n}" data_type: {t} dims: [ 1 ] }}'
        for n, t in (
            ("OUTPUT", "TYPE_INT32"),
            ("START_OUT", ctl_enum),
            ("END_OUT", ctl_enum),
            ("READY_OUT", ctl_enum),
            ("CORRID_OUT", corr_enum),
        )
    )
    return f"""name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: {max_batch_size}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [
{outs}
]
sequence_batching {{
  max_sequence_idle_microseconds: {idle_us}
  {strategy_text}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START {form} }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END {form} }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY {form} }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: {corr_enum} }} ] }}
  ]
  state [
    {{
      input_name: "ACC_IN"
      output_name: "ACC_OUT"
      data_type: TYPE_INT32
      dims: [ 1 ]
      initial_state: {{ data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "zeros" }}
    }}
  ]
}}
instance_group [ {{ count: {instance_count} kind: KIND_CPU }} ]
{extra}"""


def write_accumulator(
    root: Path,
    name: str = "accumulator",
    corrid_type: str = "UINT64",
    strategy: str = "oldest",
    **config: Any,
) -> Path:
    return write_model(
        root,
        name,
        accumulator_model(
            corrid_type, config.get("max_batch_size", 8), config.get("control_type", "INT32")
        ),
        accumulator_config(name, corrid_type, strategy, **config),
    )


# --------------------------------------------------------------------------
# ragged batching: requests of different lengths in one batch


def ragged_sum_model() -> onnx.ModelProto:
    """Sums over ragged rows; its two outputs show where the server put the boundaries.

    Inputs, all 1-D: INPUT (FP32, every request's elements concatenated),
    ITEM_LENGTHS (INT32, BATCH_ITEM_SHAPE_FLATTEN of INPUT: each batch item's
    length) and REQUEST_ENDS (INT32, BATCH_ACCUMULATED_ELEMENT_COUNT of INPUT).
    SUM [items, 1] is each item's (row's) sum; RUNNING_SUM [elements] is the
    running sum of each request's elements, restarting at every request, and
    goes back to each request in its INPUT shape (BATCH_SCATTER_WITH_INPUT_SHAPE).
    """
    fp32, i32, i64 = (from_triton(t) for t in ("FP32", "INT32", "INT64"))
    inputs = [
        _value_info("INPUT", fp32, ["elements"]),
        _value_info("ITEM_LENGTHS", i32, ["batch"]),
        _value_info("REQUEST_ENDS", i32, ["requests"]),
    ]
    outputs = [
        _value_info("SUM", fp32, ["batch", 1]),
        _value_info("RUNNING_SUM", fp32, ["elements"]),
    ]
    consts = [
        helper.make_tensor("axis0", i64.onnx, [], [0]),
        helper.make_tensor("zero_f", fp32.onnx, [1], [0.0]),
        helper.make_tensor("zero_i", i64.onnx, [1], [0]),
        helper.make_tensor("zero_s", i64.onnx, [], [0]),
        helper.make_tensor("one_s", i64.onnx, [], [1]),
        helper.make_tensor("ax0", i64.onnx, [1], [0]),
        helper.make_tensor("ax1", i64.onnx, [1], [1]),
    ]
    i64_type = onnx.TensorProto.INT64
    nodes = [
        # prefix sums of all elements, with a leading 0: sum(x[a:b]) = cz[b] - cz[a]
        helper.make_node("CumSum", ["INPUT", "axis0"], ["c"]),
        helper.make_node("Concat", ["zero_f", "c"], ["cz"], axis=0),
        # SUM: one segment per batch item, from the item lengths
        helper.make_node("Cast", ["ITEM_LENGTHS"], ["len"], to=i64_type),
        helper.make_node("CumSum", ["len", "axis0"], ["item_end"]),
        helper.make_node("Sub", ["item_end", "len"], ["item_start"]),
        helper.make_node("Gather", ["cz", "item_end"], ["at_end"]),
        helper.make_node("Gather", ["cz", "item_start"], ["at_start"]),
        helper.make_node("Sub", ["at_end", "at_start"], ["item_sum"]),
        helper.make_node("Unsqueeze", ["item_sum", "ax1"], ["SUM"]),
        # RUNNING_SUM: element j belongs to request #(request ends <= j)
        helper.make_node("Cast", ["REQUEST_ENDS"], ["ends"], to=i64_type),
        helper.make_node("Size", ["INPUT"], ["n"]),
        helper.make_node("Range", ["zero_s", "n", "one_s"], ["j"]),
        helper.make_node("Unsqueeze", ["j", "ax1"], ["j_col"]),
        helper.make_node("Unsqueeze", ["ends", "ax0"], ["ends_row"]),
        helper.make_node("GreaterOrEqual", ["j_col", "ends_row"], ["past"]),
        helper.make_node("Cast", ["past"], ["past_i"], to=i64_type),
        helper.make_node("ReduceSum", ["past_i", "ax1"], ["request"], keepdims=0),
        helper.make_node("Concat", ["zero_i", "ends"], ["starts"], axis=0),
        helper.make_node("Gather", ["starts", "request"], ["start"]),
        helper.make_node("Gather", ["cz", "start"], ["before"]),
        helper.make_node("Sub", ["c", "before"], ["RUNNING_SUM"]),
    ]
    graph = helper.make_graph(nodes, "ragged_sum", inputs, outputs, initializer=consts)
    return make_model(graph)


def ragged_sum_config(
    name: str = "ragged_sum", max_batch_size: int = 8, max_queue_delay_us: int = 0, extra: str = ""
) -> str:
    return f"""name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: {max_batch_size}
input [
  {{ name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true }}
]
batch_input [
  {{
    kind: BATCH_ITEM_SHAPE_FLATTEN
    target_name: "ITEM_LENGTHS"
    data_type: TYPE_INT32
    source_input: "INPUT"
  }},
  {{
    kind: BATCH_ACCUMULATED_ELEMENT_COUNT
    target_name: "REQUEST_ENDS"
    data_type: TYPE_INT32
    source_input: "INPUT"
  }}
]
output [
  {{ name: "SUM" data_type: TYPE_FP32 dims: [ 1 ] }},
  {{ name: "RUNNING_SUM" data_type: TYPE_FP32 dims: [ -1 ] }}
]
batch_output [
  {{
    target_name: "RUNNING_SUM"
    kind: BATCH_SCATTER_WITH_INPUT_SHAPE
    source_input: "INPUT"
  }}
]
dynamic_batching {{ max_queue_delay_microseconds: {max_queue_delay_us} }}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
{extra}"""


def write_ragged_sum(root: Path, name: str = "ragged_sum", **config: Any) -> Path:
    return write_model(root, name, ragged_sum_model(), ragged_sum_config(name, **config))


# --------------------------------------------------------------------------
# a stateful model whose state grows (variable state dims, Triton's growable state)


def history_model() -> onnx.ModelProto:
    """STATE_OUT = STATE_IN ++ INPUT along the state dim; OUTPUT = its sum.
    The state gains one element per request, so its shape changes each step."""
    i32 = from_triton("INT32")
    graph = helper.make_graph(
        [
            helper.make_node("Concat", ["STATE_IN", "INPUT"], ["STATE_OUT"], axis=1),
            helper.make_node("ReduceSum", ["STATE_OUT", "axes"], ["OUTPUT"], keepdims=1),
        ],
        "history",
        [
            _value_info("INPUT", i32, ["batch", 1]),
            _value_info("STATE_IN", i32, ["batch", "length"]),
        ],
        [
            _value_info("OUTPUT", i32, ["batch", 1]),
            _value_info("STATE_OUT", i32, ["batch", "length_plus_one"]),
        ],
        initializer=[helper.make_tensor("axes", onnx.TensorProto.INT64, [1], [1])],
    )
    return make_model(graph)


def history_config(
    name: str, strategy: str = "oldest", max_batch_size: int = 8, idle_us: int = 10_000_000
) -> str:
    strategy_text = "direct { }" if strategy == "direct" else "oldest { }"
    return f"""name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: {max_batch_size}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [
  {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "STATE_OUT" data_type: TYPE_INT32 dims: [ -1 ] }}
]
sequence_batching {{
  max_sequence_idle_microseconds: {idle_us}
  {strategy_text}
  state [
    {{
      input_name: "STATE_IN"
      output_name: "STATE_OUT"
      data_type: TYPE_INT32
      dims: [ -1 ]
      use_growable_memory: true
    }}
  ]
}}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""


def write_history(root: Path, name: str = "history", strategy: str = "oldest", **config) -> Path:
    return write_model(root, name, history_model(), history_config(name, strategy, **config))


# --------------------------------------------------------------------------
# an ensemble: preprocess -> classifier


def scale_model(size: int = 256, offset: float = 0.5, factor: float = 2.0) -> onnx.ModelProto:
    """OUTPUT0 = (INPUT0 - offset) * factor: a stand-in preprocessing step."""
    fp32 = from_triton("FP32")
    shape = _onnx_shape((size,), 64, "d")
    graph = helper.make_graph(
        [
            helper.make_node("Sub", ["INPUT0", "offset"], ["centered"]),
            helper.make_node("Mul", ["centered", "factor"], ["OUTPUT0"]),
        ],
        "scale",
        [_value_info("INPUT0", fp32, shape)],
        [_value_info("OUTPUT0", fp32, shape)],
        initializer=[
            helper.make_tensor("offset", fp32.onnx, [], [offset]),
            helper.make_tensor("factor", fp32.onnx, [], [factor]),
        ],
    )
    return make_model(graph)


def ensemble_config(name: str, steps_text: str, inputs: str, outputs: str, mbs: int = 64) -> str:
    return f"""name: "{name}"
platform: "ensemble"
max_batch_size: {mbs}
input [ {inputs} ]
output [ {outputs} ]
ensemble_scheduling {{
{steps_text}
}}
"""


def write_ensemble_mlp(root: Path, name: str = "ensemble_mlp", mlp: str = "mlp") -> Path:
    """RAW --preprocess--> NORMALIZED --mlp--> PROBS (the example ensemble)."""
    steps = f"""  step [
    {{
      model_name: "preprocess"
      model_version: -1
      input_map {{ key: "INPUT0" value: "RAW" }}
      output_map {{ key: "OUTPUT0" value: "NORMALIZED" }}
    }},
    {{
      model_name: "{mlp}"
      model_version: -1
      input_map {{ key: "INPUT0" value: "NORMALIZED" }}
      output_map {{ key: "OUTPUT0" value: "PROBS" }}
    }}
  ]"""
    model_dir = Path(root) / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(
        ensemble_config(
            name,
            steps,
            '{ name: "RAW" data_type: TYPE_FP32 dims: [ 256 ] }',
            '{ name: "PROBS" data_type: TYPE_FP32 dims: [ 10 ] }',
        )
    )
    return model_dir


def write_preprocess(root: Path, name: str = "preprocess") -> Path:
    fp32: TensorSpec = ("INPUT0", "FP32", (256,))
    out: TensorSpec = ("OUTPUT0", "FP32", (256,))
    return write_model(
        root,
        name,
        scale_model(),
        config_text(name, [fp32], [out], max_batch_size=64, dynamic_batching=True),
    )


# --------------------------------------------------------------------------
# Triton Python-backend models (model.py + triton_python_backend_utils)


def python_config_text(
    name: str,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    *,
    max_batch_size: int,
    dynamic_batching: bool = False,
    instance_count: int = 1,
    decoupled: bool = False,
) -> str:
    """config.pbtxt of a `backend: "python"` model."""
    text = config_text(
        name,
        inputs,
        outputs,
        max_batch_size=max_batch_size,
        dynamic_batching=dynamic_batching,
        instance_count=instance_count,
    ).replace('platform: "onnxruntime_onnx"', 'backend: "python"')
    if decoupled:
        text += "model_transaction_policy { decoupled: true }\n"
    return text


def write_python_model(
    root: Path, name: str, source: str, config: str | None, versions: Iterable[int] = (1,)
) -> Path:
    """``<root>/<name>/config.pbtxt`` (None: none, for auto-complete) and
    ``<root>/<name>/<v>/model.py``."""
    model_dir = Path(root) / name
    model_dir.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (model_dir / "config.pbtxt").write_text(config)
    for v in versions:
        (model_dir / str(v)).mkdir(exist_ok=True)
        (model_dir / str(v) / "model.py").write_text(source)
    return model_dir


#: The classic Triton pre-processing step, in Python: (x - 0.5) * 2 per request.
PY_PREPROCESS_SOURCE = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            y = ((x - np.float32(0.5)) * np.float32(2.0)).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", y)]))
        return responses
"""

#: BLS: normalise, call the ONNX classifier through the stack, return its argmax too.
PY_BLS_SOURCE = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.target = "mlp"

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            y = ((x - np.float32(0.5)) * np.float32(2.0)).astype(np.float32)
            bls = pb_utils.InferenceRequest(
                model_name=self.target,
                requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", y)],
            )
            answer = bls.exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
                continue
            probs = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy()
            label = np.argmax(probs, axis=-1).astype(np.int64).reshape(-1, 1)
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("PROBS", probs), pb_utils.Tensor("LABEL", label)]
                )
            )
        return responses
"""

#: Decoupled: for a request [n, delay_ms], n responses (0..n-1), then the final flag.
PY_STREAM_SOURCE = """\
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            n, delay_ms = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().tolist()
            for i in range(int(n)):
                if i:
                    time.sleep(delay_ms / 1000.0)
                token = np.array([i], dtype=np.int32)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", token)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def write_py_preprocess(root: Path, name: str = "py_preprocess") -> Path:
    text = python_config_text(
        name,
        [("INPUT0", "FP32", (256,))],
        [("OUTPUT0", "FP32", (256,))],
        max_batch_size=64,
        dynamic_batching=True,
    )
    return write_python_model(root, name, PY_PREPROCESS_SOURCE, text)


def write_py_ensemble(root: Path, name: str = "ensemble_py_mlp", mlp: str = "mlp") -> Path:
    """RAW --py_preprocess (model.py)--> NORMALIZED --mlp (ONNX)--> PROBS."""
    model_dir = write_ensemble_mlp(root, name, mlp)
    text = (model_dir / "config.pbtxt").read_text()
    (model_dir / "config.pbtxt").write_text(
        text.replace('model_name: "preprocess"', 'model_name: "py_preprocess"')
    )
    return model_dir


def write_py_bls(root: Path, name: str = "py_bls", instance_count: int = 2) -> Path:
    text = python_config_text(
        name,
        [("INPUT0", "FP32", (256,))],
        [("PROBS", "FP32", (10,)), ("LABEL", "INT64", (1,))],
        max_batch_size=64,
        dynamic_batching=True,
        instance_count=instance_count,
    )
    return write_python_model(root, name, PY_BLS_SOURCE, text)


def write_py_stream(root: Path, name: str = "py_stream") -> Path:
    text = python_config_text(
        name,
        [("IN", "INT32", (2,))],
        [("OUT", "INT32", (1,))],
        max_batch_size=0,
        decoupled=True,
    )
    return write_python_model(root, name, PY_STREAM_SOURCE, text)


def build_example_repository(root: Path) -> list[str]:
    """Write the whole example repository under ``root``; return model names."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    names: list[str] = []

    write_simple(root, "simple", max_batch_size=8)
    names.append("simple")

    write_simple(root, "simple_nobatch", max_batch_size=0)
    names.append("simple_nobatch")

    for datatype in ALL_DATATYPES:
        name = f"identity_{datatype.lower()}"
        write_identity(root, name, datatype)
        names.append(name)

    write_identity(root, "bench_identity", "FP32", dims=(16,), max_batch_size=64)
    names.append("bench_identity")

    write_mlp(root, "mlp", instance_count=2)
    names.append("mlp")

    write_accumulator(root, "accumulator")
    names.append("accumulator")

    write_ragged_sum(root, "ragged_sum")
    names.append("ragged_sum")

    write_preprocess(root, "preprocess")
    write_ensemble_mlp(root, "ensemble_mlp")
    names += ["preprocess", "ensemble_mlp"]

    write_py_preprocess(root)
    write_py_ensemble(root)
    write_py_bls(root)
    write_py_stream(root)
    names += ["py_preprocess", "ensemble_py_mlp", "py_bls", "py_stream"]

    if importlib.util.find_spec("torch") is not None:  # the torch extra is installed
        from stageserve_tools.torch_examples import build_torch_examples

        names += build_torch_examples(root)
    return names


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stageserve_tools.examples",
        description="Write StageServe's example Triton model repository.",
    )
    parser.add_argument("outdir", type=Path, help="repository root to create / overwrite")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    names = build_example_repository(args.outdir)
    dt = time.perf_counter() - t0
    print(f"wrote {len(names)} models to {args.outdir} in {dt:.2f}s: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
