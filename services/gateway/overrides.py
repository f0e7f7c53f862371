"""RepositoryModelLoad's `config` and `file:<path>` overrides, confined to the gateway's
own override area.

As in Triton 2.51: `config` (a ModelConfig in JSON) replaces the model's
config.pbtxt for this load; `file:<version>/<name>` parameters (bytes) are
the model's files, and then `config` is required and the repository folder is
ignored (a model that is not in the repository can be loaded this way). Each
load with overrides gets a fresh folder `<area>/<random>/<model>/` holding
the config and either the given files or links to the repository's
versions; the repository itself is never written. Every override path is
checked by stageserve.names.override_path_problem and, once resolved, must lie
inside that folder (Triton: "must stay within model directory").

The area is a folder the gateway creates at start and removes at exit. A
folder is removed when its model is loaded again or unloaded. The workers
read model files from the published path, so in a multi-host deployment the
area must be shared with them like the repository (--override-dir is not a
flag yet: single host only, docs/hardening.md).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from google.protobuf import json_format, text_format

from stageserve.errors import load_failed
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import model_config_pb2 as mc
from stageserve.names import check_model_name, override_path_problem, printable

log = logging.getLogger(__name__)

FILE_PREFIX = "file:"


class OverrideArea:
    def __init__(self, root: Path | None = None) -> None:
        self.root = root or Path(tempfile.mkdtemp(prefix="stageserve-overrides-"))
        self._owned = root is None
        self._current: dict[str, Path] = {}  # model -> the folder its serving load came from

    def prepare(
        self,
        name: str,
        parameters: Mapping[str, gs.ModelRepositoryParameter],
        repository: Path,
    ) -> Path | None:
        """A repository root holding `<name>/` for a load with overrides, or None
        when the load has none. Raises INTERNAL, Triton's code for a refused load
        (errors.load_failed), with Triton's reasons."""
        unknown = sorted(k for k in parameters if k != "config" and not k.startswith(FILE_PREFIX))
        if unknown:
            raise load_failed(
                f"failed to load '{printable(name)}': unknown load parameters {unknown}"
            )
        files = {k: v for k, v in parameters.items() if k.startswith(FILE_PREFIX)}
        if "config" not in parameters:
            if files:
                raise load_failed(
                    f"failed to load '{printable(name)}': Load parameter 'config' must be "
                    "specified for model file override"
                )
            return None
        check_model_name(name)
        config = _parse_config(name, parameters["config"])
        checked = {k: _checked_file(name, k, v) for k, v in files.items()}
        source = repository / name
        if not checked and not source.is_dir():
            raise load_failed(f"failed to load '{name}': model not found in any model repository")
        root = Path(tempfile.mkdtemp(prefix="load-", dir=self.root))
        model_dir = root / name
        model_dir.mkdir()
        try:
            if checked:
                for rel, data in checked.values():
                    target = (model_dir / rel).resolve()
                    if not target.is_relative_to(model_dir.resolve()):  # defence in depth
                        raise load_failed(f"invalid file override path '{printable(str(rel))}'")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(data)
            else:
                for entry in source.iterdir():
                    if entry.name != "config.pbtxt":
                        (model_dir / entry.name).symlink_to(entry.resolve())
            (model_dir / "config.pbtxt").write_text(text_format.MessageToString(config))
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        log.info(
            "load overrides prepared",
            extra={"model": name, "files": sorted(files), "folder": str(root)},
        )
        return root

    def settle(self, name: str, root: Path | None, loaded: bool) -> None:
        """After a load (`loaded`: it succeeded) or an unload (root None, loaded
        True): keep the folder now serving, remove the one it replaced."""
        if not loaded:
            self._remove(root)
            return
        previous = self._current.pop(name, None)
        if root is not None:
            self._current[name] = root
        if previous != root:
            self._remove(previous)

    def close(self) -> None:
        for root in self._current.values():
            self._remove(root)
        self._current.clear()
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)

    def _remove(self, root: Path | None) -> None:
        if root is not None and root.parent == self.root:
            with contextlib.suppress(OSError):
                shutil.rmtree(root)


def _parse_config(name: str, param: gs.ModelRepositoryParameter) -> mc.ModelConfig:
    if param.WhichOneof("parameter_choice") != "string_param":
        raise load_failed(
            f"failed to load '{name}': Load parameter 'config' must be a string (JSON)"
        )
    config = mc.ModelConfig()
    try:
        json_format.Parse(param.string_param, config)
    except json_format.ParseError as exc:
        reason = str(exc).split(" Available Fields")[0][:200]  # protobuf lists every field
        raise load_failed(f"failed to load '{name}': Invalid config override: {reason}") from None
    if config.name and config.name != name:
        raise load_failed(
            f"failed to load '{name}': unexpected directory name '{name}' for model "
            f"'{printable(config.name)}', directory name must equal model name"
        )
    config.name = name
    return config


def _checked_file(name: str, key: str, param: gs.ModelRepositoryParameter) -> tuple[Path, bytes]:
    path = key[len(FILE_PREFIX) :]
    problem = override_path_problem(path)
    if problem is not None:
        raise load_failed(
            f"failed to load '{name}': Invalid file parameter '{printable(key)}': {problem}"
        )
    if param.WhichOneof("parameter_choice") != "bytes_param":
        raise load_failed(
            f"failed to load '{name}': file parameter '{printable(key)}' must be bytes"
        )
    return Path(path), param.bytes_param
