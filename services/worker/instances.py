"""Model instances hosted by this worker, and how one executes a batch.

Each instance owns one backend session and one thread, so the instances of a
model (instance_group count) really execute concurrently: ONNX Runtime
releases the GIL while it computes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from services.worker.backends import TensorBackend
from services.worker.batch_io import (
    BatchIOError,
    batch_input_array,
    request_shapes,
    scatter,
    scatter_shapes,
)
from services.worker.inline_policy import InlinePolicy
from services.worker.onnx_backend import BackendError
from stageserve.config import InstanceGroup, ModelSpec
from stageserve.datatypes import from_triton
from stageserve.generated import stageserve_pb2 as pb
from stageserve.telemetry import WORKER_COMPUTE
from stageserve.tensors import TensorError, numpy_to_raw, raw_to_numpy

if TYPE_CHECKING:
    from services.worker.python_backend.instance import StillSending


@dataclass(frozen=True)
class Placement:
    """Where an instance runs: this worker's CPU or one of its GPUs."""

    kind: str  # KIND_CPU / KIND_GPU
    device_id: int  # -1 for CPU

    @property
    def device(self) -> str:
        return "cpu" if self.device_id < 0 else f"cuda:{self.device_id}"


def placements(group: InstanceGroup, worker_gpu: int | None) -> list[Placement]:
    """Instances this worker hosts for one instance_group.

    `count` is per worker, as Triton's count is per server (per GPU for
    KIND_GPU): adding a worker adds capacity. A GPU group lands only on a
    worker that owns a listed GPU; KIND_AUTO uses the GPU when there is one.
    """
    if group.kind == "KIND_GPU":
        if worker_gpu is None or (group.gpus and worker_gpu not in group.gpus):
            return []
        return [Placement("KIND_GPU", worker_gpu)] * group.count
    if group.kind == "KIND_AUTO" and worker_gpu is not None:
        return [Placement("KIND_GPU", worker_gpu)] * group.count
    return [Placement("KIND_CPU", -1)] * group.count


def default_intra_op_threads(total_instances: int) -> int:
    """Split the cores between the instances that may run at once."""
    return max(1, (os.cpu_count() or 1) // max(1, total_instances))


@dataclass
class HostedInstance:
    instance_id: str
    model: str
    version: int
    generation: int
    placement: Placement
    spec: ModelSpec
    backend: TensorBackend | Any  # Any: a Python-backend instance (python_backend/)
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="instance")
    )
    in_flight: int = 0
    compute_timers: tuple = ()
    inline: InlinePolicy = field(default_factory=InlinePolicy)
    runs_inline: bool = True  # False: never on the event loop (Python models)

    @property
    def execute_delay_s(self) -> float:
        """Model parameter `execute_delay_ms`: a testing aid that makes every
        execution take at least that long (beyond Triton; think of a slow model)."""
        return float(self.spec.parameters.get("execute_delay_ms", "0") or 0) / 1000.0

    def __post_init__(self) -> None:
        if not self.runs_inline or getattr(self.backend, "thread_bound", False):
            self.inline = InlinePolicy(limit_ns=0)
        labels = (self.model, str(self.version), self.instance_id)
        self.compute_timers = tuple(
            WORKER_COMPUTE.labels(*labels, phase) for phase in ("input", "infer", "output")
        )

    def execute(
        self, request: pb.ExecuteRequest, emit: Callable[[pb.ExecuteResponse], None] | None = None
    ) -> pb.ExecuteResponse | StillSending:
        """Decode, run and split one batch: on the instance's own thread, or
        inline on the event loop when its policy says the model is fast.
        Backends that take the batch's requests themselves (Python models)
        get it whole; `emit` sends a decoupled model's responses early, and
        StillSending says its execute returned before every final."""
        execute_batch = getattr(self.backend, "execute_batch", None)
        if execute_batch is not None:
            return execute_batch(request, emit)
        t0 = time.monotonic_ns()
        cpu0 = time.thread_time_ns()  # the inline policy's measure (inline_policy.py)
        try:
            feeds = {t.name: raw_to_numpy(t.raw, t.datatype, t.shape) for t in request.inputs}
            feeds.update(self._batch_inputs(request))
        except (TensorError, BatchIOError) as exc:
            raise BackendError(f"bad input tensor: {exc}") from exc
        wanted = self._wanted_outputs(request)
        t1 = time.monotonic_ns()
        if self.execute_delay_s:
            time.sleep(self.execute_delay_s)
        results = self.backend.run(feeds, wanted)
        t2 = time.monotonic_ns()
        try:
            scattered = self._scatter(request, results)
        except BatchIOError as exc:
            raise BackendError(f"model '{self.model}': {exc}") from exc
        response = pb.ExecuteResponse()
        offset = 0
        batching = self.spec.batching
        for i, (size, requested) in enumerate(
            zip(request.request_batch_sizes, request.requested, strict=True)
        ):
            names = list(requested.names) or [o.name for o in self.spec.outputs]
            per_request = response.results.add()
            for name in names:
                if name in scattered:  # already in the request's own shape
                    per_request.outputs.append(_tensor(name, scattered[name][i], self.spec))
                    continue
                arr = results[name]
                if batching:
                    arr = arr[offset : offset + size]
                per_request.outputs.append(_tensor(name, arr, self.spec, size))
            offset += size
        t3 = time.monotonic_ns()
        self.inline.observe(self._inline_cost(t3 - t0, time.thread_time_ns() - cpu0))
        response.compute_input_ns = t1 - t0
        response.compute_infer_ns = t2 - t1
        response.compute_output_ns = t3 - t2
        return response

    def _inline_cost(self, wall_ns: int, cpu_ns: int) -> int:
        """What one execution teaches the inline policy (inline_policy.py): the
        executing thread's CPU time, which neither a GIL wait nor a descheduled
        core inflates. On a GPU the thread waits for the device, and the
        execute_delay_ms testing aid sleeps: both count as cost."""
        if self.placement.kind == "KIND_GPU":
            return wall_ns
        return cpu_ns + int(self.execute_delay_s * 1e9)

    def _batch_inputs(self, request: pb.ExecuteRequest) -> dict[str, np.ndarray]:
        """Triton's batch_input tensors, computed from the formed batch."""
        feeds: dict[str, np.ndarray] = {}
        for spec in self.spec.batch_inputs:
            shapes = request_shapes(request, self.spec, spec.source_input)
            arr = batch_input_array(spec, shapes)
            feeds.update(dict.fromkeys(spec.target_names, arr))
        return feeds

    def _scatter(
        self, request: pb.ExecuteRequest, results: dict[str, np.ndarray]
    ) -> dict[str, list[np.ndarray]]:
        """BATCH_SCATTER_WITH_INPUT_SHAPE outputs, cut into per-request pieces."""
        out: dict[str, list[np.ndarray]] = {}
        for spec in self.spec.batch_outputs:
            sources = request_shapes(request, self.spec, spec.source_input)
            for name in spec.target_names:
                declared = self.spec.output(name)
                if name not in results or declared is None:
                    continue  # not requested by this batch
                dims = (-1, *declared.dims)  # batch outputs need batching (config.py)
                out[name] = scatter(results[name], scatter_shapes(dims, sources))
        return out

    def _wanted_outputs(self, request: pb.ExecuteRequest) -> list[str]:
        """Union of what the batch's requests asked for (state outputs included)."""
        wanted: dict[str, None] = {}
        for requested in request.requested:
            names = requested.names or [o.name for o in self.spec.outputs]
            wanted.update(dict.fromkeys(names))
        return list(wanted)

    def close(self) -> None:
        finalize = getattr(self.backend, "close", None)
        if finalize is not None:  # on the instance's thread, after its last batch
            self.executor.submit(finalize).result()
        self.executor.shutdown(wait=True)


def _tensor(name: str, arr: np.ndarray, spec: ModelSpec, batch: int | None = None) -> pb.Tensor:
    """One request's output; batch None: arr already has its final shape."""
    out = spec.output_tensor(name)
    assert out is not None
    if out.reshape is not None and batch is not None:  # the model's shape -> the config's dims
        arr = arr.reshape(((batch,) if spec.batching else ()) + out.dims)
    dt = out.datatype
    if dt.triton not in ("BYTES", "BF16") and dt.numpy is not None and arr.dtype != dt.numpy:
        arr = arr.astype(dt.numpy)
    return pb.Tensor(
        name=name,
        datatype=dt.triton,
        shape=list(arr.shape),
        raw=numpy_to_raw(arr, from_triton(dt.triton)),
    )
