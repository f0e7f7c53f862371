"""Build the hosted instances of a Python-backend model (the worker's `_load` calls this)."""

from __future__ import annotations

from services.worker.instances import HostedInstance, Placement
from services.worker.python_backend.instance import PythonInstance, PythonModelError, config_json
from services.worker.python_backend.process_instance import (
    InstanceProcessError,
    ProcessInstance,
    runs_in_process,
)
from stageserve.config import InstanceGroup
from stageserve.model_state import LoadedModel


def python_instances(
    model: LoadedModel,
    version: int,
    groups: list[tuple[InstanceGroup, list[Placement]]],
    worker_id: str,
    process_default: bool,
) -> list[HostedInstance]:
    """One instance per placement, each initialized on its own thread: a
    PythonInstance on a worker thread, or a ProcessInstance (its stub
    process) when the model runs a process per instance (`process_default`
    for a model whose config does not say).

    Raises PythonModelError when model.py does not import or initialize fails.
    """
    path = model.path / str(version) / model.spec.model_filename
    try:
        instance_class = (
            ProcessInstance if runs_in_process(model.spec, process_default) else PythonInstance
        )
    except InstanceProcessError as exc:
        raise PythonModelError(str(exc)) from exc
    text = config_json(model.config)
    loaded: list[HostedInstance] = []
    for group, places in groups:
        for index, place in enumerate(places):
            hosted = HostedInstance(
                f"{worker_id}/{model.name}/{version}/g{model.generation}/{group.name}/{index}",
                model.name,
                version,
                model.generation,
                place,
                model.spec,
                None,  # set below, on the instance's own thread
                runs_inline=False,  # never on the event loop: BLS waits on it
            )
            # initialize runs on the thread that will execute: a model that
            # keeps thread-bound state (an event loop, a CUDA context) finds it there.
            try:
                hosted.backend = hosted.executor.submit(
                    instance_class,
                    path,
                    model.spec,
                    text,
                    instance_name=f"{group.name}_{index}",
                    kind=place.kind,
                    device_id=place.device_id,
                    version=version,
                ).result()
            except BaseException:
                # A failed load leaves no thread behind; the instances already
                # initialized are finalized, as Triton unloads a failed model.
                hosted.executor.shutdown(wait=False)
                for done in loaded:
                    done.close()
                raise
            loaded.append(hosted)
    return loaded
