"""Model instances hosted by this worker, and how one executes a batch.

Each instance owns one backend (backends.InstanceBackend) and one thread, so
the instances of a model (instance_group count) really execute concurrently:
ONNX Runtime and torch release the GIL while they compute.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from services.worker.backends import Emit, InstanceBackend, StillSending
from services.worker.inline_policy import GPU_INLINE_LIMIT_NS, InlinePolicy
from services.worker.tensor_batches import TensorBatches, execute_delay_s
from stageserve import tensor_shm
from stageserve.config import InstanceGroup, ModelSpec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.telemetry import WORKER_COMPUTE

#: an instance_group's rate_limiter: (priority, ((resource, count, global), ...))
RateLimit = tuple[int, tuple[tuple[str, int, bool], ...]]


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


#: builds one instance's backend (its placement, its instance_group, its index
#: in the group), on the thread that will execute its batches
BackendMaker = Callable[[Placement, InstanceGroup, int], InstanceBackend]


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
    backend: InstanceBackend
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="instance")
    )
    rate_limit: RateLimit = (0, ())
    in_flight: int = 0
    compute_timers: tuple = ()
    inline: InlinePolicy = field(default_factory=InlinePolicy)

    @property
    def execute_delay_s(self) -> float:
        return execute_delay_s(self.spec)

    def __post_init__(self) -> None:
        if self.backend.thread_bound:
            self.inline = InlinePolicy(limit_ns=0)
        elif self.placement.kind == "KIND_GPU":
            self.inline = InlinePolicy(limit_ns=GPU_INLINE_LIMIT_NS)
        labels = (self.model, str(self.version), self.instance_id)
        self.compute_timers = tuple(
            WORKER_COMPUTE.labels(*labels, phase) for phase in ("input", "infer", "output")
        )

    def execute(
        self, request: pb.ExecuteRequest, emit: Emit | None = None
    ) -> pb.ExecuteResponse | StillSending:
        """Run one batch on the backend: on the instance's own thread, or
        inline on the event loop when its policy says the model is fast.
        `emit` sends a decoupled model's responses early, and StillSending
        says its execute returned before every final."""
        t0 = time.monotonic_ns()
        cpu0 = time.thread_time_ns()  # the inline policy's measure (inline_policy.py)
        retaken: set[int] = set()
        if not isinstance(self.backend, TensorBatches):  # it reads shared memory itself
            retaken = tensor_shm.materialize_batch(request)
        result = self.backend.execute_batch(request, emit)
        if isinstance(result, pb.ExecuteResponse):
            # A request whose input slots the gateway freed and handed to
            # another request (it was cancelled while queued) read someone
            # else's bytes: CANCELLED, never that answer. Checked after the
            # run: a zero-copy input is read until the run ends.
            retaken |= tensor_shm.retaken_rows(request)
            if retaken:
                tensor_shm.cancel_rows(result, retaken)
            owner = tensor_shm.OWNER
            if owner is not None:
                owner.stage_outputs(request, result)
        self.inline.observe(
            self._inline_cost(time.monotonic_ns() - t0, time.thread_time_ns() - cpu0)
        )
        return result

    def _inline_cost(self, wall_ns: int, cpu_ns: int) -> int:
        """What one execution teaches the inline policy (inline_policy.py): the
        executing thread's CPU time, which neither a GIL wait nor a descheduled
        core inflates. On a GPU the thread waits for the device, and the
        execute_delay_ms testing aid sleeps: both count as cost."""
        if self.placement.kind == "KIND_GPU":
            return wall_ns
        return cpu_ns + int(self.execute_delay_s * 1e9)

    def close(self) -> None:
        # On the instance's thread, after its last batch.
        self.executor.submit(self.backend.close).result()
        self.executor.shutdown(wait=True)
