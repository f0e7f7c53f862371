"""What builds the instances of a Python-backend model version."""

from __future__ import annotations

from services.worker.backends import InstanceBackend
from services.worker.instances import BackendMaker, Placement
from services.worker.python_backend.instance import PythonInstance, PythonModelError, config_json
from services.worker.python_backend.process_instance import (
    InstanceProcessError,
    ProcessInstance,
    runs_in_process,
)
from services.worker.warmup import WarmupError
from stageserve.config import InstanceGroup
from stageserve.model_state import LoadedModel
from stageserve.python_exec_env import (
    ENVIRONMENTS,
    ExecutionEnv,
    ExecutionEnvError,
    requested_env,
)


def python_backends(model: LoadedModel, version: int, process_default: bool) -> BackendMaker:
    """Each instance is a PythonInstance (model.py in this process) or a
    ProcessInstance (its stub process) when the model runs a process per
    instance (`process_default` for a model whose config does not say); its
    initialize runs on the thread that will execute, so a model that keeps
    thread-bound state (an event loop, a CUDA context) finds it there.

    Raises PythonModelError (here, or from the maker when model.py does not
    import or initialize fails) and WarmupError."""
    if model.spec.decoupled and model.spec.warmups:
        raise WarmupError("model_warmup is not supported for decoupled Python models by StageServe")
    try:
        own_process = runs_in_process(model.spec, process_default)
    except InstanceProcessError as exc:
        raise PythonModelError(str(exc)) from exc
    path = model.path / str(version) / model.spec.model_filename
    text = config_json(model.config)

    def make(place: Placement, group: InstanceGroup, index: int) -> InstanceBackend:
        name = f"{group.name}_{index}"
        if own_process:
            # Here, on the instance's thread, not on the worker's loop: an
            # unpack takes seconds. The second instance finds it unpacked.
            env = _execution_env(model)
            return ProcessInstance(
                path,
                model.spec,
                text,
                instance_name=name,
                kind=place.kind,
                device_id=place.device_id,
                version=version,
                execution_env=env,
            )
        return PythonInstance(
            path,
            model.spec,
            text,
            instance_name=name,
            kind=place.kind,
            device_id=place.device_id,
            version=version,
        )

    return make


def _execution_env(model: LoadedModel) -> ExecutionEnv | None:
    """The model's EXECUTION_ENV_PATH, unpacked if need be (stageserve/python_exec_env.py);
    None for a model that runs on the worker's own packages."""
    path = requested_env(model.spec.parameters, model.path)
    if path is None:
        return None
    try:
        return ENVIRONMENTS.prepare(path)
    except ExecutionEnvError as exc:
        raise PythonModelError(str(exc)) from exc
