"""Batch padding policy (beyond Triton): the batch sizes a model's formed
batches are padded up to before they run.

On a GPU, ONNX Runtime (cuDNN's algorithm search) and TorchScript (kernel
choice) pay for every new input shape, and a dynamic batcher forms any size
from 1 to max_batch_size. Padding a formed batch up to the nearest allowed
size makes the device see a few shapes. The worker pads
(services/worker/batch_padding.py); this module reads what the model asks for
from its config.pbtxt, as StageServe's own model parameter:

    parameters { key: "pad_batch" value { string_value: "true" } }

* absent or "" (``auto``): pad on the instances whose session runs on a GPU
  (KIND_GPU, or KIND_AUTO on a GPU worker); never on the CPU; silently off
  where padding cannot be right (below). An ONNX Runtime model pads every
  batch to max_batch_size alone (``one_shape``): ONNX Runtime's CUDA EP
  redoes each convolution's set-up whenever the input shape differs from
  the previous run's, so any mix of sizes is slow (H100, the bench.gpu
  CNN, runs alternating batch 32 and 25: 25 ms each with HEURISTIC
  search, 155 ms with EXHAUSTIVE, against 1.8-2.2 ms at a fixed 32;
  docs/benchmarks.md). A TorchScript model pads to its dynamic_batching
  ``preferred_batch_size`` and max_batch_size, if it has preferred sizes;
* "true": pad on every instance, to the preferred sizes and max_batch_size
  (no preferred sizes: the powers of two below max_batch_size, and it);
* a list such as "1,2,4,8,16,32": pad on every instance to those sizes, and
  max_batch_size so every batch has one;
* "false": never pad.

Padding cannot be right, and an explicit "true" or list fails the load with
the reason, for a model that does not batch, is not an ONNX Runtime or
TorchScript model, has a ragged input (its batch is one 1-D tensor, not
rows), batch_input tensors (computed from the real requests' shapes),
batch_output scattering (cut by the real requests' shapes) or sequence
state (a padded row's state output has no sequence to go to).

Pure: no I/O, unit-tested.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PAD_PARAMETER = "pad_batch"

AUTO, ON, OFF = "auto", "on", "off"

# How pad_batch and shape_warmup spell a boolean (any case).
TRUE_WORDS = ("true", "on", "yes", "1")
FALSE_WORDS = ("false", "off", "no", "0")


class PadPolicyError(ValueError):
    """A pad_batch parameter that cannot be honoured (the load fails with it)."""


@dataclass(frozen=True)
class PadPolicy:
    """`mode`: AUTO (instances on a GPU only), ON (every instance) or OFF;
    `sizes`: the allowed batch sizes, ascending, max_batch_size last (empty
    when the model never pads)."""

    mode: str = OFF
    sizes: tuple[int, ...] = ()

    def sizes_for(self, on_gpu: bool) -> tuple[int, ...]:
        """The sizes an instance pads to (empty: it does not pad)."""
        if self.mode == ON or (self.mode == AUTO and on_gpu):
            return self.sizes
        return ()


def powers_of_two(top: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `top`, then `top`."""
    out, p = [], 1
    while p < top:
        out.append(p)
        p *= 2
    return (*out, top)


def pad_policy(
    parameters: Mapping[str, str],
    max_batch_size: int,
    preferred: Sequence[int],
    obstacles: Sequence[str],
    one_shape: bool = False,
) -> PadPolicy:
    """The model's padding policy from its `pad_batch` parameter.

    `obstacles`: why padding cannot be right for this model (empty: it can).
    Raises PadPolicyError for a value that is not a boolean or a list of
    sizes in 1..max_batch_size, and for an explicit request the obstacles
    forbid. `one_shape`: auto pads to max_batch_size alone (ONNX Runtime)."""
    text = parameters.get(PAD_PARAMETER, "").strip().lower()
    if text in FALSE_WORDS:
        return PadPolicy()
    if not text:  # auto: on a GPU, where padding is right
        if obstacles or max_batch_size <= 0:
            return PadPolicy()
        if one_shape:
            return PadPolicy(AUTO, (max_batch_size,))
        if not preferred:
            return PadPolicy()
        return PadPolicy(AUTO, _with_top(preferred, max_batch_size))
    if max_batch_size <= 0:
        obstacles = ["max_batch_size is 0 (the model does not batch)", *obstacles]
    if obstacles:
        raise PadPolicyError(
            f"parameter {PAD_PARAMETER}={text!r} cannot be honoured: {'; '.join(obstacles)}"
        )
    if text in TRUE_WORDS:
        sizes = tuple(preferred) or powers_of_two(max_batch_size)
        return PadPolicy(ON, _with_top(sizes, max_batch_size))
    return PadPolicy(ON, _with_top(_size_list(text, max_batch_size), max_batch_size))


def _size_list(text: str, max_batch_size: int) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise PadPolicyError(
            f"parameter {PAD_PARAMETER} must be true, false or a list of batch sizes such as "
            f"'1,2,4,8', got {text!r}"
        ) from None
    bad = [s for s in sizes if not 1 <= s <= max_batch_size]
    if bad or not sizes:
        raise PadPolicyError(
            f"parameter {PAD_PARAMETER} sizes {list(bad) or text!r} must be in "
            f"1..max_batch_size ({max_batch_size})"
        )
    return sizes


def _with_top(sizes: Sequence[int], top: int) -> tuple[int, ...]:
    return tuple(sorted({*sizes, top}))
