"""EXECUTION_ENV_PATH's pure parts: the `$$TRITON_MODEL_DIRECTORY`
substitution, the unpack-once decision, the environment manager on real
archives and folders (the messages Triton 2.51 gives where it has one,
checked against it), the in-process refusal, and the stub's command line."""

from __future__ import annotations

import io
import os
import sys
import tarfile
from pathlib import Path

import pytest

from services.worker.python_backend import env_launch
from services.worker.python_backend.process_instance import InstanceProcessError, runs_in_process
from stageserve import python_exec_env
from stageserve.config import ModelSpec
from stageserve.python_exec_env import (
    EnvironmentManager,
    ExecutionEnv,
    ExecutionEnvError,
    Unpacked,
    needs_unpack,
    requested_env,
    worker_python_version,
)

MODEL_DIR = Path("/models/m")


def test_the_model_directory_placeholder_is_substituted() -> None:
    assert requested_env({}, MODEL_DIR) is None
    assert requested_env({"EXECUTION_ENV_PATH": ""}, MODEL_DIR) is None
    assert (
        requested_env({"EXECUTION_ENV_PATH": "$$TRITON_MODEL_DIRECTORY/env.tar.gz"}, MODEL_DIR)
        == "/models/m/env.tar.gz"
    )
    # Not only at the start (Triton 2.51 eats the characters after it there).
    assert (
        requested_env({"EXECUTION_ENV_PATH": "/x/$$TRITON_MODEL_DIRECTORY/e.tar.gz"}, MODEL_DIR)
        == "/x//models/m/e.tar.gz"
    )
    assert requested_env({"EXECUTION_ENV_PATH": "/envs/a.tar.gz"}, MODEL_DIR) == "/envs/a.tar.gz"
    assert requested_env({"EXECUTION_ENV_PATH": "rel.tar.gz"}, MODEL_DIR) == "rel.tar.gz"


def test_unpack_only_when_never_unpacked_or_modified() -> None:
    known = Unpacked(Path("/tmp/e/0"), 100)
    assert needs_unpack(None, 100)
    assert not needs_unpack(known, 100)
    assert needs_unpack(known, 101)


def _env_folder(root: Path, version: str | None = None) -> Path:
    """An environment: bin/activate, and bin/python3 (this interpreter, or a
    script that says it is `version`)."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "activate").write_text("# sourced before the stub starts\n")
    python = root / "bin" / "python3"
    if version is None:
        python.symlink_to(sys.executable)
    else:
        python.write_text(f"#!/bin/sh\necho {version}\n")
        python.chmod(0o755)
    return root


def _archive(path: Path, folder: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        tar.add(folder, arcname=".")
    return path


def test_an_archive_is_unpacked_once_until_its_mtime_changes(tmp_path: Path) -> None:
    archive = _archive(tmp_path / "env.tar.gz", _env_folder(tmp_path / "src"))
    manager = EnvironmentManager(tmp_path / "unpacked")
    first = manager.prepare(str(archive))
    assert first.root.parent == tmp_path / "unpacked"
    assert first.version == worker_python_version()
    assert (first.root / "bin" / "activate").is_file()
    marker = first.root / "marker"
    marker.write_text("")
    assert manager.prepare(str(archive)) == first and manager.unpacks == 1
    # Through another spelling of the same file: the same environment.
    assert manager.prepare(str(tmp_path / "src" / ".." / "env.tar.gz")) == first
    assert marker.exists()
    later = archive.stat().st_mtime + 5
    os.utime(archive, (later, later))
    again = manager.prepare(str(archive))
    assert again.root == first.root and manager.unpacks == 2 and not marker.exists()
    assert again.stamp == archive.stat().st_mtime_ns != first.stamp


def test_two_archives_get_two_folders(tmp_path: Path) -> None:
    folder = _env_folder(tmp_path / "src")
    a = _archive(tmp_path / "a.tar.gz", folder)
    b = _archive(tmp_path / "b.tar.gz", folder)
    manager = EnvironmentManager(tmp_path / "unpacked")
    assert manager.prepare(str(a)).root != manager.prepare(str(b)).root
    assert manager.unpacks == 2


def test_a_directory_is_used_in_place(tmp_path: Path) -> None:
    folder = _env_folder(tmp_path / "env")
    manager = EnvironmentManager(tmp_path / "unpacked")
    env = manager.prepare(str(folder))
    assert (env.root, env.python) == (folder, folder / "bin" / "python3")
    assert env.version == worker_python_version() and env.stamp == folder.stat().st_mtime_ns
    assert manager.unpacks == 0 and not (tmp_path / "unpacked").exists()


def test_a_path_that_does_not_resolve_gives_tritons_message(tmp_path: Path) -> None:
    missing = tmp_path / "nothing.tar.gz"
    with pytest.raises(ExecutionEnvError) as info:
        EnvironmentManager(tmp_path / "unpacked").prepare(str(missing))
    assert str(info.value) == f"Failed to get the canonical path for {missing}."


def test_a_bad_archive_fails_and_spoils_no_later_unpack(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not an archive")
    manager = EnvironmentManager(tmp_path / "unpacked")
    with pytest.raises(ExecutionEnvError) as info:
        manager.prepare(str(bad))
    assert str(info.value) == (
        f"Failed to unpack the Python execution environment {bad}: "
        "not a tar archive (plain, gzip, bzip2 or xz)"
    )
    assert list((tmp_path / "unpacked").iterdir()) == []  # nothing half unpacked
    # (Triton 2.51 fails every later archive after a bad one: checked.)
    good = _archive(tmp_path / "good.tar.gz", _env_folder(tmp_path / "src"))
    assert manager.prepare(str(good)).version == worker_python_version()


def test_a_member_outside_the_folder_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("../outside")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ExecutionEnvError, match="OutsideDestinationError"):
        EnvironmentManager(tmp_path / "unpacked").prepare(str(archive))
    assert not (tmp_path / "outside").exists()


def test_an_environment_without_activate_gives_tritons_message(tmp_path: Path) -> None:
    folder = _env_folder(tmp_path / "env")
    (folder / "bin" / "activate").unlink()
    with pytest.raises(ExecutionEnvError) as info:
        EnvironmentManager().prepare(str(folder))
    assert str(info.value) == (
        f"Path {folder}/bin/activate does not exist. "
        "The Python environment should contain an 'activate' script."
    )


def test_an_environment_without_an_interpreter_is_refused(tmp_path: Path) -> None:
    folder = _env_folder(tmp_path / "env")
    (folder / "bin" / "python3").unlink()
    with pytest.raises(ExecutionEnvError, match="should contain a Python interpreter"):
        EnvironmentManager().prepare(str(folder))


def test_another_python_version_is_refused(tmp_path: Path) -> None:
    folder = _env_folder(tmp_path / "env", version="3.6")
    with pytest.raises(ExecutionEnvError) as info:
        EnvironmentManager().prepare(str(folder))
    assert str(info.value) == (
        f"The Python execution environment {folder} has Python 3.6; "
        f"this worker's stub needs Python {worker_python_version()}"
    )


def _spec(**parameters: str) -> ModelSpec:
    return ModelSpec(
        name="m",
        platform="",
        max_batch_size=0,
        inputs=(),
        outputs=(),
        dynamic_batching=None,
        instance_groups=(),
        model_filename="model.py",
        parameters=parameters,
        backend="python",
    )


def test_an_environment_means_a_process_per_instance() -> None:
    env = {"EXECUTION_ENV_PATH": "/e.tar.gz"}
    assert runs_in_process(_spec(**env), default=False)
    assert runs_in_process(_spec(**env, STAGESERVE_INSTANCE_PROCESS="true"), default=False)
    assert not runs_in_process(_spec(), default=False)
    with pytest.raises(InstanceProcessError) as info:
        runs_in_process(_spec(**env, STAGESERVE_INSTANCE_PROCESS="false"), default=True)
    assert str(info.value) == (
        "model 'm': parameter EXECUTION_ENV_PATH needs a process per instance, "
        "and parameter STAGESERVE_INSTANCE_PROCESS is 'false'"
    )


def test_the_stub_command_in_an_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setattr(sys, "path", [*sys.path, "/somewhere"])  # as PYTHONPATH puts it
    plain, plain_vars = env_launch.stub_command(7, None)
    assert plain == [sys.executable, "-m", env_launch.STUB_MODULE, "7"]
    assert plain_vars["PYTHONPATH"].split(os.pathsep) == [python_exec_env.SOURCE_ROOT, "/somewhere"]

    env = ExecutionEnv(tmp_path, tmp_path / "bin" / "python3", worker_python_version())
    argv, variables = env_launch.stub_command(7, env)
    assert argv[:2] == ["bash", "-c"]
    assert argv[3:5] == [str(tmp_path), str(tmp_path / "bin" / "python3")]
    assert argv[-2:] == [env_launch.STUB_MODULE, "7"]
    assert "PYTHONPATH" not in variables and variables["PYTHONNOUSERSITE"] == "1"
    path = variables[python_exec_env.PATH_VARIABLE].split(os.pathsep)
    assert path[0] == python_exec_env.SOURCE_ROOT
    assert "/somewhere" in path  # appended, never before the environment's packages
    assert any(p.endswith("site-packages") for p in path)
    assert os.path.dirname(os.__file__) not in path  # the environment brings its own


def test_a_module_runs_on_the_environments_packages_first(tmp_path: Path) -> None:
    """A real venv whose site-packages has its own `json_probe`, shadowing
    the one the caller's path appends: the environment's wins, and a module
    only the caller has is found too."""
    import venv

    env_root = tmp_path / "env"
    venv.create(env_root, with_pip=False)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = env_root / "lib" / version / "site-packages"
    (site / "probe_mod.py").write_text("WHO = 'environment'\n")
    caller = tmp_path / "caller"
    caller.mkdir()
    (caller / "probe_mod.py").write_text("WHO = 'caller'\n")
    (caller / "probe_main.py").write_text(
        "import sys, probe_mod, grpc\nprint(probe_mod.WHO, sys.prefix, sys.argv[1:])\n"
    )
    env = EnvironmentManager().prepare(str(env_root))
    import subprocess

    saved = list(sys.path)
    sys.path.append(str(caller))
    try:
        argv, variables = python_exec_env.module_command("probe_main", ["a", "b"], env)
    finally:
        sys.path[:] = saved
    done = subprocess.run(argv, env=variables, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["environment", str(env_root), "['a',", "'b']"]


AUTO_IN_ENV = """\
import only_in_env


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [1]})
        config.add_output({"name": only_in_env.NAME, "data_type": "TYPE_FP32", "dims": [1]})
        return config

    def execute(self, requests):
        return []
"""


def test_auto_complete_runs_in_the_environment_current_at_each_load(tmp_path: Path) -> None:
    """The model.py imports a module only its environment (a real venv) has;
    once the environment changes (a new stamp), a new child serves it, not
    the one that has the former module imported."""
    import venv

    from stageserve import python_autocomplete
    from stageserve.repository import read_model

    env_root = tmp_path / "env"
    venv.create(env_root, with_pip=False)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    module = env_root / "lib" / version / "site-packages" / "only_in_env.py"
    module.write_text("NAME = 'FIRST'\n")
    repo = tmp_path / "repo"
    (repo / "m" / "1").mkdir(parents=True)
    (repo / "m" / "1" / "model.py").write_text(AUTO_IN_ENV)
    config = 'name: "m"\nbackend: "python"\n'
    param = 'parameters { key: "EXECUTION_ENV_PATH" value { string_value: "%s" } }\n'
    (repo / "m" / "config.pbtxt").write_text(config + param % env_root)
    try:
        first = read_model(repo, "m")
        assert first.spec is not None, first.error
        assert [o.name for o in first.spec.outputs] == ["FIRST"]
        (former,) = [h._proc for h in python_autocomplete._env_helpers.values()]
        assert former is not None and former.poll() is None  # kept for the next load

        module.write_text("NAME = 'SECOND'\n")
        later = env_root.stat().st_mtime + 5
        os.utime(env_root, (later, later))
        second = read_model(repo, "m")
        assert second.spec is not None, second.error
        assert [o.name for o in second.spec.outputs] == ["SECOND"]
        assert former.poll() is not None  # the former environment's child is gone
        assert len(python_autocomplete._env_helpers) == 1

        (repo / "m" / "config.pbtxt").write_text(config)  # no environment: no module
        plain = read_model(repo, "m")
        assert plain.error is not None and "No module named 'only_in_env'" in plain.error
    finally:
        for helper in python_autocomplete._env_helpers.values():
            helper.stop()
        python_autocomplete._env_helpers.clear()
