"""Padding a formed batch up to an allowed size, and dropping the padded rows.

The policy (which sizes, on which instances) is stageserve/pad_policy.py;
this is the arithmetic on the numpy feeds and results of one batch:

* `padded_size`: the smallest allowed size that holds the batch;
* `pad_feeds`: every input grown to that many rows by repeating its last
  real row. Not zeros: a model that divides by, takes the log of, or
  normalises by a statistic of its input makes NaN or inf from an all-zero
  row, and a floating-point trap, a NaN check or a NaN-propagating batch
  reduction would then cost the real rows too. A copy of a real row is a
  value the model already handles.
* `unpad_results`: every output cut back to the real rows, so padded rows
  never reach a client; an output whose first dimension is not the padded
  batch cannot be cut and is an error (padding needs batch-major outputs).

Pure (no I/O), unit-tested.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


class BatchPaddingError(ValueError):
    """A batch whose tensors are not batch-major, so padding cannot be undone."""


def padded_size(n: int, allowed: Sequence[int]) -> int:
    """The smallest size in `allowed` that is >= n; n itself when none is
    (or `allowed` is empty: no padding)."""
    return min((s for s in allowed if s >= n), default=n)


def pad_feeds(feeds: Mapping[str, np.ndarray], real: int, padded: int) -> dict[str, np.ndarray]:
    """Each feed of `real` rows grown to `padded` rows by repeating its last row."""
    if padded == real:
        return feeds if isinstance(feeds, dict) else dict(feeds)
    out = {}
    for name, arr in feeds.items():
        if arr.ndim == 0 or arr.shape[0] != real or real == 0:
            raise BatchPaddingError(
                f"input '{name}' has shape {list(arr.shape)}, not the batch of {real} first"
            )
        extra = np.repeat(arr[-1:], padded - real, axis=0)
        out[name] = np.concatenate([arr, extra], axis=0)
    return out


def unpad_results(
    results: Mapping[str, np.ndarray], real: int, padded: int
) -> dict[str, np.ndarray]:
    """Each output of `padded` rows cut to its first `real` rows (views, no copy)."""
    if padded == real:
        return results if isinstance(results, dict) else dict(results)
    out = {}
    for name, arr in results.items():
        if arr.ndim == 0 or arr.shape[0] != padded:
            raise BatchPaddingError(
                f"output '{name}' has shape {list(arr.shape)} for a batch padded to {padded}: "
                f"padding needs outputs whose first dimension is the batch (set the model "
                f"parameter pad_batch to false)"
            )
        out[name] = arr[:real]
    return out
