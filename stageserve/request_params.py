"""A request's custom parameters as the JSON object a Python model reads.

Triton's `InferenceRequest.parameters()` is a compact JSON object string of the
parameters the client set, without the ones Triton itself consumes (sequence
controls, priority, timeout). Checked against Triton 2.51.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_RESERVED = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "binary_data_output"}
)


def parameters_json(params: Mapping[str, Any]) -> str:
    """InferParameter map -> '{"key":value,...}' ("" when there are none)."""
    out: dict[str, Any] = {}
    for key, param in params.items():
        if key in _RESERVED or key.startswith("triton_") or key.startswith("shared_memory_"):
            continue
        which = param.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(param, which)
    return json.dumps(out, separators=(",", ":"), sort_keys=True) if out else ""
