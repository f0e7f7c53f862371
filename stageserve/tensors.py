"""Raw tensor bytes <-> numpy, in the KServe v2 / Triton raw layout.

Fixed-size types are little-endian, row-major, no padding. BYTES tensors are
a sequence of elements, each a 4-byte little-endian length followed by that
many bytes. Because the batch dimension is outermost, concatenating the raw
bytes of several requests yields the raw bytes of the batched tensor, for
BYTES too: the scheduler batches without decoding anything.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np

from stageserve.datatypes import DataType, from_triton

_LEN = struct.Struct("<I")


class TensorError(ValueError):
    """Raw bytes that do not form a tensor of the declared type and shape."""


def element_count(shape: Sequence[int]) -> int:
    return math.prod(shape)


def split_bytes_elements(raw: bytes | memoryview, expected: int | None = None) -> list[bytes]:
    """Parse BYTES framing into its elements; strict about truncation."""
    view = memoryview(raw)
    out: list[bytes] = []
    pos, end = 0, len(view)
    while pos < end:
        if pos + 4 > end:
            raise TensorError(
                f"BYTES element {len(out)} has a truncated 4-byte length prefix "
                f"({end - pos} bytes left)"
            )
        (length,) = _LEN.unpack_from(view, pos)
        pos += 4
        if pos + length > end:
            raise TensorError(
                f"BYTES element {len(out)} declares {length} bytes but only "
                f"{end - pos} remain in the buffer"
            )
        out.append(bytes(view[pos : pos + length]))
        pos += length
    if expected is not None and len(out) != expected:
        raise TensorError(f"BYTES tensor holds {len(out)} elements, expected {expected}")
    return out


def count_bytes_elements(raw: bytes | memoryview) -> int:
    """Number of well-framed BYTES elements; raises TensorError if malformed."""
    view = memoryview(raw)
    count, pos, end = 0, 0, len(view)
    while pos < end:
        if pos + 4 > end:
            raise TensorError(
                f"BYTES element {count} has a truncated 4-byte length prefix "
                f"({end - pos} bytes left)"
            )
        (length,) = _LEN.unpack_from(view, pos)
        pos += 4 + length
        if pos > end:
            raise TensorError(
                f"BYTES element {count} declares {length} bytes but only "
                f"{end - pos + length} remain in the buffer"
            )
        count += 1
    return count


def serialize_bytes_elements(items: Sequence[bytes | str]) -> bytes:
    parts: list[bytes] = []
    for item in items:
        b = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        parts.append(_LEN.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def raw_to_numpy(raw: bytes | memoryview, datatype: str, shape: Sequence[int]) -> np.ndarray:
    """Decode raw bytes; BYTES become an object array of bytes, BF16 a uint16 array."""
    dt = from_triton(datatype)
    shape = tuple(int(s) for s in shape)
    if dt.numpy is None:
        items = split_bytes_elements(raw, element_count(shape))
        arr = np.empty(len(items), dtype=object)
        arr[:] = items
        return arr.reshape(shape)
    expected = element_count(shape) * dt.item_size
    if len(raw) != expected:
        raise TensorError(
            f"{datatype} tensor of shape {list(shape)} needs {expected} bytes, got {len(raw)}"
        )
    return np.frombuffer(raw, dtype=dt.numpy).reshape(shape)


def numpy_to_raw(arr: np.ndarray, dt: DataType | None = None) -> bytes:
    """Encode a numpy array in the raw layout of its (or the given) datatype."""
    if dt is None or dt.numpy is None:
        if dt is not None or arr.dtype.kind in ("O", "S", "U"):
            return serialize_bytes_elements([_as_bytes(x) for x in arr.reshape(-1)])
        return _little_endian(arr).tobytes()
    if dt.triton == "BF16":
        return _bf16_words(arr).tobytes()
    if arr.dtype != dt.numpy:
        arr = arr.astype(dt.numpy)
    return _little_endian(arr).tobytes()


def _little_endian(arr: np.ndarray) -> np.ndarray:
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr


def _bf16_words(arr: np.ndarray) -> np.ndarray:
    """BF16 as 2-byte words: bfloat16 and 16-bit integer arrays already hold the
    words; any other numbers are rounded to the nearest bfloat16 (ties to even)."""
    if arr.dtype.name == "bfloat16":
        return np.ascontiguousarray(arr).view(np.uint16)
    if arr.dtype.kind in ("i", "u") and arr.dtype.itemsize == 2:
        return _little_endian(arr)
    f32 = np.ascontiguousarray(arr, dtype=np.float32)
    bits = f32.view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(f32), np.uint16(0x7FC0), rounded).astype(np.uint16)


def _as_bytes(x: object) -> bytes:
    if isinstance(x, bytes):
        return x
    if isinstance(x, str):
        return x.encode("utf-8")
    if isinstance(x, np.bytes_):
        return bytes(x)
    return str(x).encode("utf-8")
