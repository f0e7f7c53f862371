"""Triton's auto-complete for Python models: the model's own
`TritonPythonModel.auto_complete_config(auto_complete_model_config)`.

The gateway calls this while it reads the repository (unless auto-complete
is disabled), as Triton does at load: the model.py is imported, given the
configuration as pb_utils.ModelConfig, and what it returns becomes the
configuration (inputs, outputs, max_batch_size, dynamic batching, the
transaction policy). Errors it raises make the model fail to load.
"""

from __future__ import annotations

import json

from google.protobuf import json_format

from services.worker.python_backend.loader import ModelImportError, import_model_file
from stageserve import pb_utils
from stageserve.config import DEFAULT_PYTHON_FILENAME, ConfigError
from stageserve.generated import model_config_pb2 as mc


def complete_python(config: mc.ModelConfig, model_dir, versions: list[int]) -> None:
    filename = config.default_model_filename or DEFAULT_PYTHON_FILENAME
    model_file = next(
        (
            model_dir / str(v) / filename
            for v in sorted(versions, reverse=True)
            if (model_dir / str(v) / filename).is_file()
        ),
        None,
    )
    if model_file is None:
        return  # the repository reports the missing file
    try:
        module = import_model_file(model_file)
    except ModelImportError as exc:
        raise ConfigError(str(exc)) from exc
    hook = getattr(module.TritonPythonModel, "auto_complete_config", None)
    if hook is None:
        return
    as_dict = json_format.MessageToDict(config, preserving_proto_field_name=True)
    completed = pb_utils.ModelConfig(json.dumps(as_dict))
    try:
        result = hook(completed)
        completed_dict = (result if result is not None else completed).as_dict()
        fresh = mc.ModelConfig()
        json_format.ParseDict(completed_dict, fresh)
    except (ValueError, TypeError, json_format.ParseError) as exc:
        raise ConfigError(
            f"auto-complete of model '{config.name}' failed: {type(exc).__name__}: {exc}"
        ) from exc
    except Exception as exc:  # the model's own code
        raise ConfigError(
            f"auto_complete_config of model '{config.name}' raised {type(exc).__name__}: {exc}"
        ) from exc
    config.CopyFrom(fresh)
