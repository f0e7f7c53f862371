"""The worker's numeric policy on GPUs: TF32 on unless a model says no.

TF32 runs FP32 matrix products and convolutions on tensor cores with a
10-bit mantissa: faster, and about 1e-3 relative off FP32. By default both
backends use it on the GPU, as Triton's backends do with each library's
default (ONNX Runtime's CUDA EP on; torch's cuDNN convolutions on, its
matmul off: StageServe turns both on). Measured on an H100 with the
bench.gpu CNN (docs/benchmarks.md), TF32 on against off: TorchScript
30,656 against 14,361 images/s, ONNX Runtime 29,880 against 18,026. The
model parameter ``allow_tf32`` ("false") keeps full FP32 (beyond Triton),
and the tolerance each setting promises is checked by the GPU tests.

ONNX Runtime takes the switch per session (the CUDA EP's ``use_tf32``,
onnx_options.py). torch's switches (``torch.backends.cuda.matmul.allow_tf32``,
``torch.backends.cudnn.allow_tf32``) are process-wide: setting them around
each run would race with the other instances running on their own threads,
and serialising GPU runs to avoid that would cost the concurrency several
instances exist for. So ``TorchTf32`` holds one value per worker process:
the first CUDA TorchScript instance sets it, instances asking the same share
it, and one asking the other value fails its load, naming the conflict,
until every holder of the current value is unloaded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from services.worker.backends import BackendError


class InvalidParameter(BackendError):
    """A model parameter whose value cannot be used (Triton: INVALID_ARG)."""


#: TF32 when a model does not say (ONNX Runtime and PyTorch, GPU instances).
DEFAULT_ALLOW_TF32 = True

#: What the policy promises for an FP32 model on a GPU, against the float64
#: reference of the same model: |answer - reference| <= tolerance * scale,
#: scale = max(1, max |reference|). The example MLP (256-1024-1024-10,
#: softmax): ONNX Runtime on the CPU 2.3e-7 off; with TF32 (the CUDA EP's
#: default) 3e-4 off on an H100 (issue 25), and a numpy emulation of TF32's
#: rounding gives 2.9e-4. So FP32_TOLERANCE tells the two apart, and
#: TF32_TOLERANCE leaves room for deeper models.
FP32_TOLERANCE = 1e-4
TF32_TOLERANCE = 2e-3

#: StageServe's model parameter turning TF32 on (any case: PyTorch's
#: parameters are upper case, ONNX Runtime's lower case).
ALLOW_TF32 = "allow_tf32"


def tolerance(allow_tf32: bool, reference_scale: float) -> float:
    """The absolute tolerance the policy promises for outputs of this scale."""
    return (TF32_TOLERANCE if allow_tf32 else FP32_TOLERANCE) * max(1.0, reference_scale)


def tf32_requested(parameters: Mapping[str, str]) -> bool:
    """The model's ``allow_tf32`` parameter, or the default; a value that is
    not a boolean fails the load as Triton's parsers do."""
    for key, value in parameters.items():
        if key.lower() == ALLOW_TF32:
            return parse_bool(value)
    return DEFAULT_ALLOW_TF32


def parse_bool(value: str) -> bool:
    """A boolean parameter as Triton's backends read one ("true"/"on"/"1",
    "false"/"off"/"0", any case); anything else fails the load."""
    lowered = value.lower()
    if lowered in ("true", "on", "1"):
        return True
    if lowered in ("false", "off", "0"):
        return False
    raise InvalidParameter(f"failed to convert '{value}' to boolean")


class TorchTf32:
    """The worker process's one TF32 setting for CUDA TorchScript instances.

    ``apply(allow)`` sets torch's switches; it runs when the first holder
    arrives (and when a value changes after every holder left)."""

    def __init__(self, apply: Callable[[bool], None]) -> None:
        self._apply = apply
        self._lock = threading.Lock()
        self._value: bool | None = None
        self._holders: set[int] = set()

    @property
    def value(self) -> bool | None:
        """The value in force while some instance holds it, else None."""
        return self._value if self._holders else None

    def acquire(self, holder: int, allow: bool, model: str) -> None:
        """Hold `allow` for `holder` (an instance id); BackendError when the
        process already runs CUDA TorchScript instances with the other value."""
        with self._lock:
            if self._holders and self._value != allow:
                raise BackendError(
                    f"{model}: {ALLOW_TF32}={str(allow).lower()} cannot be honoured: torch's "
                    "TF32 switches are process-wide and this worker already runs "
                    f"{len(self._holders)} CUDA TorchScript instance(s) with "
                    f"{ALLOW_TF32}={str(self._value).lower()}; give the models the same "
                    f"{ALLOW_TF32}, or serve them from different workers"
                )
            if self._value != allow or not self._holders:
                self._apply(allow)
                self._value = allow
            self._holders.add(holder)

    def release(self, holder: int) -> None:
        with self._lock:
            self._holders.discard(holder)


def _set_torch_tf32(allow: bool) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = allow
    torch.backends.cudnn.allow_tf32 = allow


#: The worker's setting (torch imported only when a CUDA instance loads).
TORCH_TF32 = TorchTf32(_set_torch_tf32)
