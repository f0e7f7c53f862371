"""Host one model version: the same path for every backend.

For each placement of each instance_group the backend is built on the
instance's own thread (where it will execute: torch's per-thread settings, a
model.py's event loop or CUDA context), the instance is warmed up with the
model's model_warmup samples before it is registered (Triton warms up before
READY), then with every batch shape it can be handed (shape_warmup.py,
beyond Triton, not counted in statistics), and a version whose instance
fails to build or warm up closes the instances it already started, as Triton
unloads a failed model.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import redis.asyncio as aioredis

from services.worker.instances import BackendMaker, HostedInstance, Placement
from services.worker.python_backend.hosting import python_backends
from services.worker.shape_warmup import instance_shapes, warm_up_shapes
from services.worker.tensor_sessions import tensor_backends
from services.worker.warmup import warm_up, warmup_requests
from stageserve.config import InstanceGroup
from stageserve.instance_ids import instance_id
from stageserve.model_state import LoadedModel

log = logging.getLogger(__name__)

Groups = list[tuple[InstanceGroup, list[Placement]]]


def backend_maker(
    model: LoadedModel, version: int, groups: Groups, python_process_default: bool
) -> BackendMaker:
    """What builds the instances of `version`, by the model's backend
    (`python_process_default`: WorkerSettings.python_instance_process).
    Raises BackendError or WarmupError when the version cannot load."""
    if model.spec.backend == "python":
        return python_backends(model, version, python_process_default)
    return tensor_backends(model, version, groups)


async def host_version(
    worker_id: str,
    model: LoadedModel,
    version: int,
    groups: Groups,
    redis: aioredis.Redis,
    python_process_default: bool,
) -> list[HostedInstance]:
    """Build and warm up every instance of `version` this worker hosts (in
    the groups' order). Raises BackendError or WarmupError when one fails,
    after closing those already built."""
    make = backend_maker(model, version, groups, python_process_default)
    warmups = warmup_requests(model.spec, model.path)
    loaded: list[HostedInstance] = []
    shapes: set[int] = set()
    shape_seconds = 0.0
    try:
        for group, places in groups:
            for index, place in enumerate(places):
                executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="instance")
                try:
                    backend = await asyncio.wrap_future(executor.submit(make, place, group, index))
                except BaseException:
                    executor.shutdown(wait=False)  # a failed build leaves no thread behind
                    raise
                loaded.append(
                    HostedInstance(
                        instance_id(
                            worker_id, model.name, version, model.generation, group.name, index
                        ),
                        model.name,
                        version,
                        model.generation,
                        place,
                        model.spec,
                        backend,
                        executor=executor,
                        rate_limit=(group.rate_limiter_priority, group.rate_limiter_resources),
                    )
                )
                await warm_up(loaded[-1], warmups, redis)  # before READY
                sizes = instance_shapes(loaded[-1])
                if sizes:
                    shape_seconds += await warm_up_shapes(loaded[-1], sizes, model.path)
                    shapes.update(sizes)
    except BaseException:
        for inst in loaded:
            await asyncio.to_thread(inst.close)
        raise
    if shapes:
        log.info(
            "shape warm-up done",
            extra={
                "model": model.name,
                "version": version,
                "instances": len(loaded),
                "shapes": sorted(shapes),
                "seconds": round(shape_seconds, 3),
            },
        )
    return loaded
