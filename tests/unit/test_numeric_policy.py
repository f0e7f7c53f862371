"""services.worker.numeric_policy: the allow_tf32 parameter, the tolerance
promised, and the one process-wide TF32 setting of CUDA TorchScript instances."""

from __future__ import annotations

import pytest

from services.worker.backends import BackendError
from services.worker.numeric_policy import (
    DEFAULT_ALLOW_TF32,
    FP32_TOLERANCE,
    TF32_TOLERANCE,
    InvalidParameter,
    TorchTf32,
    _set_torch_tf32,
    tf32_requested,
    tolerance,
)


def test_tf32_is_on_unless_a_model_says_no() -> None:
    assert DEFAULT_ALLOW_TF32 is True
    assert tf32_requested({}) is True
    assert tf32_requested({"allow_tf32": "false"}) is False
    assert tf32_requested({"allow_tf32": "true"}) is True
    assert tf32_requested({"ALLOW_TF32": "1"}) is True  # PyTorch parameters are upper case
    assert tf32_requested({"allow_tf32": "off"}) is False
    with pytest.raises(InvalidParameter, match="failed to convert 'sure' to boolean"):
        tf32_requested({"allow_tf32": "sure"})


def test_tolerance_scales_with_the_output() -> None:
    assert tolerance(False, 0.5) == FP32_TOLERANCE
    assert tolerance(True, 0.5) == TF32_TOLERANCE
    assert tolerance(False, 100.0) == pytest.approx(100 * FP32_TOLERANCE)


def test_one_setting_per_process() -> None:
    applied: list[bool] = []
    policy = TorchTf32(applied.append)
    assert policy.value is None
    policy.acquire(1, False, "a")
    policy.acquire(2, False, "b")
    assert applied == [False] and policy.value is False
    with pytest.raises(BackendError, match="process-wide .* 2 CUDA TorchScript instance"):
        policy.acquire(3, True, "c")
    policy.release(1)
    with pytest.raises(BackendError, match="allow_tf32=false"):
        policy.acquire(3, True, "c")
    policy.release(2)
    assert policy.value is None
    policy.acquire(3, True, "c")  # every holder left: the other value may take over
    assert applied == [False, True] and policy.value is True


def test_torch_switches_follow_the_setting() -> None:
    torch = pytest.importorskip("torch")
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        _set_torch_tf32(False)
        assert not torch.backends.cuda.matmul.allow_tf32
        assert not torch.backends.cudnn.allow_tf32
        _set_torch_tf32(True)
        assert torch.backends.cuda.matmul.allow_tf32
        assert torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
