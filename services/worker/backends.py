"""What the worker hosts: the contract every model instance implements.

Every instance the worker hosts, whatever runs it (ONNX Runtime, TorchScript,
a model.py in this process or in a stub process of its own), is an
``InstanceBackend``: it executes one formed batch, is closed once, and says
whether it is bound to its own thread. ONNX Runtime and TorchScript sessions
compute on numpy tensors (``TensorBackend``); ``tensor_batches.TensorBatches``
makes one of them an ``InstanceBackend``. Python-backend instances take the
batch whole (python_backend/instance.py, process_instance.py).

This module imports no backend library: the Python-backend stub process
imports it too.
"""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from stageserve.generated import stageserve_pb2 as pb

_CUDA_RE = re.compile(r"^(?:cuda|gpu)(?::(\d+))?$")

#: emit(part_message): sends a decoupled model's responses as they are made.
Emit = Callable[[pb.ExecuteResponse], None]


class BackendError(RuntimeError):
    """The model could not be loaded, or a run failed (INTERNAL to the client)."""


class InvalidInputError(BackendError):
    """A request this backend refuses before running it (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class StillSending:
    """A decoupled batch whose execute returned before every request's final
    flag: the instance is free (as in Triton), the model's senders go on, and
    `last` resolves with the batch's last message once every final is in."""

    last: concurrent.futures.Future[pb.ExecuteResponse]


class InstanceBackend(Protocol):
    """One hosted model instance, as the worker drives it."""

    #: True: every batch runs on the instance's own thread, never inline on
    #: the event loop (per-thread state such as torch's thread count, or a
    #: model.py whose BLS calls wait on the loop).
    thread_bound: bool

    def execute_batch(
        self, request: pb.ExecuteRequest, emit: Emit | None
    ) -> pb.ExecuteResponse | StillSending:
        """Run one formed batch; `emit` sends a decoupled model's responses
        early, and StillSending says its execute returned before every final."""
        ...

    def close(self) -> None:
        """Release the instance, on its own thread, after its last batch."""
        ...


class TensorBackend(Protocol):
    """A session computing on StageServe's numpy tensors (ONNX Runtime, TorchScript)."""

    device: str
    thread_bound: bool

    def run(
        self, feeds: dict[str, np.ndarray], output_names: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


#: how to install what a missing top-level module belongs to, where StageServe knows
_INSTALL = {"torch": "pip install 'stageserve[torch]'"}


def install_hint(module: str) -> str:
    """What to tell the user whose worker cannot import `module`."""
    top = module.split(".", 1)[0]
    fix = _INSTALL.get(top)
    if fix is not None:
        return f"install it with: {fix}"
    return f"install the package that provides '{top}' in the server's Python environment"


def missing_dependency(needed_by: str, exc: ImportError) -> BackendError:
    """The load error of a model whose backend or model.py needs a module this
    worker's environment cannot import: names the module and the fix."""
    module = exc.name or str(exc)
    return BackendError(
        f"{needed_by} needs '{module}', which this worker cannot import ({exc}); "
        f"{install_hint(module)}"
    )


def parse_device(device: str) -> tuple[str, int]:
    """Map "cpu" to ("cpu", 0) and "cuda", "cuda:N" or "gpu:N" to ("cuda", N)."""
    d = (device or "cpu").strip().lower()
    if d == "cpu":
        return "cpu", 0
    m = _CUDA_RE.match(d)
    if not m:
        raise BackendError(f"unknown device {device!r}: expected 'cpu' or 'cuda:N'")
    return "cuda", int(m.group(1) or 0)
