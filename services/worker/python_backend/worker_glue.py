"""The worker's Python-backend branch of `_load`: host a model.py's instances."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from services.worker.instances import placements
from services.worker.python_backend.hosting import python_instances
from services.worker.python_backend.instance import PythonModelError
from services.worker.warmup import WarmupError, warm_up, warmup_requests
from stageserve.model_state import LoadedModel

if TYPE_CHECKING:
    from services.worker.service import WorkerService

log = logging.getLogger(__name__)


async def load_python_model(worker: WorkerService, model: LoadedModel) -> bool:
    """Load the versions of `model` this worker does not host yet; True if any loaded.

    A model.py that fails to import or initialize is reported as that
    version's load error (the gateway answers UNAVAILABLE with the reason)."""
    hosted = {(i.model, i.version, i.generation) for i in worker.instances.values()}
    groups = [(g, placements(g, worker.gpu)) for g in model.spec.instance_groups]
    changed = False
    for version in model.versions:
        if (model.name, version, model.generation) in hosted:
            continue
        loaded = []
        try:
            if model.spec.decoupled and model.spec.warmups:
                raise WarmupError(
                    "model_warmup is not supported for decoupled Python models by StageServe"
                )
            warmups = warmup_requests(model.spec, model.path)
            loaded = await asyncio.to_thread(
                python_instances,
                model,
                version,
                groups,
                worker.worker_id,
                bool(worker.settings.python_instance_process),
            )
            for inst in loaded:  # Triton warms up Python models too, before READY
                await warm_up(inst, warmups, worker.state.redis)
        except (PythonModelError, WarmupError) as exc:
            for inst in loaded:
                await asyncio.to_thread(inst.close)
            log.error(
                "python model load failed",
                extra={"model": model.name, "version": version, "error": str(exc)},
            )
            await worker.state.report_load_error(model.name, version, worker.worker_id, str(exc))
            continue
        # python_instances keeps the groups' order: each instance takes its
        # group's rate_limiter (priority, resources), as the ONNX branch does.
        group_of = [g for g, places in groups for _ in places]
        for inst, group in zip(loaded, group_of, strict=True):
            worker.instances[inst.instance_id] = inst
            worker.rate_limits[inst.instance_id] = (
                group.rate_limiter_priority,
                group.rate_limiter_resources,
            )
        log.info(
            "python model loaded",
            extra={"model": model.name, "version": version, "instances": len(loaded)},
        )
        changed = True
    return changed
