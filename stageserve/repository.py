"""Triton-layout model repository: <model>/config.pbtxt + numbered versions.

Reading a model never raises: a broken config or missing file yields a
RepositoryModel carrying the reason, so the gateway can report that model
UNAVAILABLE while every other model serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stageserve.autocomplete import complete_io, complete_platform, model_file_for, needs_io
from stageserve.autocomplete_options import TRITON_DEFAULT, AutoComplete
from stageserve.config import (
    PYTHON_BACKEND,
    ConfigError,
    ModelSpec,
    config_path,
    read_config,
    select_versions,
    to_spec,
)
from stageserve.generated import model_config_pb2 as mc
from stageserve.names import model_name_problem
from stageserve.python_autocomplete import ExecutionEnvUnusable, complete_python


@dataclass
class RepositoryModel:
    name: str
    path: Path
    config: mc.ModelConfig | None
    spec: ModelSpec | None
    versions: tuple[int, ...]  # versions the version_policy selects
    error: str | None = None
    fingerprint: tuple = ()  # what a reload compares: see fingerprint()
    # The error is the model's execution environment's (python_autocomplete.
    # ExecutionEnvUnusable): a failed version load in Triton, not a refused read.
    env_unusable: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


def model_names(root: Path) -> list[str]:
    """Every directory in the repository is a model, as in Triton."""
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def version_folders(model_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def fingerprint(path: Path, limit: int = 10_000) -> tuple:
    """(relative path, size, mtime) of every file under a model folder: Triton
    reloads a loaded model only when something in its folder changed."""
    rows = []
    for i, file in enumerate(sorted(path.rglob("*"))):
        if i >= limit:
            break
        try:
            st = file.stat()
        except OSError:
            continue
        rows.append((str(file.relative_to(path)), st.st_size, st.st_mtime_ns))
    return tuple(rows)


def read_model(
    root: Path,
    name: str,
    autocomplete: AutoComplete = TRITON_DEFAULT,
    config_name: str | None = None,
) -> RepositoryModel:
    """`config_name`: Triton's --model-config-name (stageserve/config.py `config_path`)."""
    problem = model_name_problem(name)
    path = root / name if problem is None else root
    if problem is not None:
        return RepositoryModel(name, path, None, None, (), problem)
    if not path.is_dir():
        return RepositoryModel(
            name, path, None, None, (), f"model '{name}' is not in the repository"
        )
    try:
        config = read_config(path, allow_missing=autocomplete.enabled, config_name=config_name)
        if autocomplete.enabled:
            _complete(config, path, autocomplete, config_path(path, config_name).is_file())
        if not config.HasField("version_policy"):
            config.version_policy.latest.num_versions = 1  # Triton's default, as it reports it
    except (ConfigError, OSError) as exc:
        unusable = isinstance(exc, ExecutionEnvUnusable)
        return RepositoryModel(name, path, None, None, (), str(exc), env_unusable=unusable)
    try:
        spec = to_spec(config)
        versions = select_versions(config, version_folders(path))
        if not versions:
            raise ConfigError(f"model '{name}' has no version folder")
        for v in versions if spec.platform != "ensemble" else ():
            file = path / str(v) / spec.model_filename
            if not file.is_file():
                raise ConfigError(f"model '{name}' version {v}: missing model file {file}")
    except (ConfigError, OSError) as exc:
        return RepositoryModel(name, path, config, None, (), str(exc))
    return RepositoryModel(name, path, config, spec, tuple(versions), None, fingerprint(path))


def _complete(
    config: mc.ModelConfig, path: Path, autocomplete: AutoComplete, written: bool
) -> None:
    """Triton's auto-complete (stageserve/autocomplete.py), before validation;
    `written`: the model has a configuration file."""
    model_file = model_file_for(config, path, version_folders(path))
    complete_platform(config, model_file)
    if config.backend == PYTHON_BACKEND and not config.platform:
        complete_python(config, path, version_folders(path))
        return
    if not written and not (config.platform or config.backend):
        raise ConfigError(f"no config.pbtxt in {path}, and no model file to generate one from")
    if not needs_io(config):
        return
    try:
        if model_file is None:
            raise ConfigError(
                f"model '{config.name}' declares no inputs or outputs and has no model file "
                f"to complete them from"
            )
        complete_io(config, model_file, autocomplete.default_max_batch_size)
    except ConfigError as exc:
        if written:
            raise
        raise ConfigError(f"no config.pbtxt in {path}, and auto-complete failed: {exc}") from exc
