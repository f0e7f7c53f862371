"""Import a Triton model.py, once per instance, with pb_utils importable.

`triton_python_backend_utils` is registered in sys.modules as StageServe's
pb_utils.py (beside this file) rather than shipped as a top-level module: a real
Triton install in the same environment keeps its own file, and a model.py
imported here always gets ours. Each instance imports its own copy of the
model.py module, as each Triton instance has its own stub process: module
globals are never shared between instances.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType

from services.worker.backends import install_hint
from services.worker.python_backend import pb_utils

PB_UTILS_NAME = "triton_python_backend_utils"
_serial = itertools.count(1)


class ModelImportError(Exception):
    """A model.py that cannot be imported or has no TritonPythonModel."""


def register_pb_utils() -> None:
    sys.modules.setdefault(PB_UTILS_NAME, pb_utils)


def import_model_file(path: Path) -> ModuleType:
    """The model.py as a fresh module (its directory importable, as in Triton)."""
    register_pb_utils()
    if not path.is_file():
        raise ModelImportError(f"model file {path} does not exist")
    name = f"_stageserve_model_{next(_serial)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.append(folder)
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as exc:  # a package model.py imports is not installed here
        fix = f"; {install_hint(exc.name)}" if exc.name else ""
        raise ModelImportError(f"failed to import {path}: ModuleNotFoundError: {exc}{fix}") from exc
    except Exception as exc:
        raise ModelImportError(f"failed to import {path}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(getattr(module, "TritonPythonModel", None), type):
        raise ModelImportError(f"{path} defines no class TritonPythonModel")
    return module
