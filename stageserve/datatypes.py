"""Triton datatype names and their numpy / ONNX / config-enum equivalents.

One table, used by every stage, so a datatype is spelled one way everywhere.
BF16 has no native numpy dtype: it travels as raw 2-byte words and is viewed
as uint16 (or ml_dtypes.bfloat16 where that is installed) when decoded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DataType:
    triton: str  # wire name in KServe v2 / Triton: "FP32"
    config_enum: str  # model_config.proto DataType enum name: "TYPE_FP32"
    numpy: np.dtype | None  # None for BYTES (variable length elements)
    onnx: int  # onnx.TensorProto.DataType value
    item_size: int  # bytes per element; 0 for BYTES


_TABLE = [
    DataType("BOOL", "TYPE_BOOL", np.dtype(np.bool_), 9, 1),
    DataType("UINT8", "TYPE_UINT8", np.dtype(np.uint8), 2, 1),
    DataType("UINT16", "TYPE_UINT16", np.dtype(np.uint16), 4, 2),
    DataType("UINT32", "TYPE_UINT32", np.dtype(np.uint32), 12, 4),
    DataType("UINT64", "TYPE_UINT64", np.dtype(np.uint64), 13, 8),
    DataType("INT8", "TYPE_INT8", np.dtype(np.int8), 3, 1),
    DataType("INT16", "TYPE_INT16", np.dtype(np.int16), 5, 2),
    DataType("INT32", "TYPE_INT32", np.dtype(np.int32), 6, 4),
    DataType("INT64", "TYPE_INT64", np.dtype(np.int64), 7, 8),
    DataType("FP16", "TYPE_FP16", np.dtype(np.float16), 10, 2),
    DataType("FP32", "TYPE_FP32", np.dtype(np.float32), 1, 4),
    DataType("FP64", "TYPE_FP64", np.dtype(np.float64), 11, 8),
    DataType("BF16", "TYPE_BF16", np.dtype(np.uint16), 16, 2),
    DataType("BYTES", "TYPE_STRING", None, 8, 0),
]

BY_TRITON: dict[str, DataType] = {d.triton: d for d in _TABLE}
BY_CONFIG_ENUM: dict[str, DataType] = {d.config_enum: d for d in _TABLE}
BY_ONNX: dict[int, DataType] = {d.onnx: d for d in _TABLE}


def from_config_enum(enum_name: str) -> DataType:
    """TYPE_FP32 -> DataType. Raises KeyError for TYPE_INVALID and unknown names."""
    return BY_CONFIG_ENUM[enum_name]


def from_triton(name: str) -> DataType:
    return BY_TRITON[name]


def from_numpy(dtype: np.dtype) -> DataType:
    """numpy dtype -> DataType (object / bytes / str arrays map to BYTES)."""
    dtype = np.dtype(dtype)
    if dtype.kind in ("O", "S", "U"):
        return BY_TRITON["BYTES"]
    if dtype.name == "bfloat16":
        return BY_TRITON["BF16"]
    if dtype.byteorder == ">":  # the same type in the other byte order
        dtype = dtype.newbyteorder("<")
    for d in _TABLE:
        if d.numpy is not None and d.numpy == dtype and d.triton != "BF16":
            return d
    raise KeyError(f"no Triton datatype for numpy dtype {dtype}")
