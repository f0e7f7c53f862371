"""A Python model's own execution environment (EXECUTION_ENV_PATH), as in
Triton's Python backend: the model runs on the environment's packages, here
numpy 1.26.4 packed at test time beside the worker's numpy 2.x. The model's
int32 accumulator wraps silently under numpy 1.x (as in Triton's numpy 1.26
stub) and raises OverflowError under 2.x. The archive is unpacked once per
worker and reused by every instance, model and reload naming it, until its
modification time changes; a directory is used in place; a bad path or
archive fails the load with the reason (Triton 2.51's words where it has
them: tests/unit/test_python_exec_env.py and below)."""

from __future__ import annotations

import bz2
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from stageserve_tools.examples import python_config_text, write_python_model
from tests.integration.helpers import triton_grpc
from tests.stack import RunningStack, running_stack

OLD_NUMPY = "1.26.4"
ENV_PARAMETER = 'parameters { key: "EXECUTION_ENV_PATH" value { string_value: "%s" } }\n'
PROCESS = 'parameters { key: "STAGESERVE_INSTANCE_PROCESS" value { string_value: "%s" } }\n'
# Triton 2.51 answers INVALID_ARGUMENT "load failed for model ..." to a model
# whose environment is missing, not an archive or without bin/activate
# (test_the_reasons_are_tritons runs it). The gateway's auto-complete finds
# these first (it runs auto_complete_config in the environment, as Triton
# does) and answers Triton's code; a load a worker failed (auto-complete off,
# or the in-process refusal) answers it too, in Triton's "load failed for
# model" frame (docs/architecture.md).
AUTOCOMPLETE_FAILED = "StatusCode.INVALID_ARGUMENT"
WORKER_FAILED = "StatusCode.INVALID_ARGUMENT"
# py_big_env's archive: 2-4 s to unpack on the 2-core dev machine.
BIG_ENV_MB = 256

# SUM: the request's values accumulated in an int32 output; VERSION: numpy's;
# PREFIX: the interpreter's environment; PID: the process that executed.
# initialize leaves "<pid> <prefix>" in the model's directory.
SOURCE = """\
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        with open(os.path.join(args["model_repository"], "initialized"), "a") as f:
            f.write(f"{os.getpid()} {sys.prefix}\\n")

    def execute(self, requests):
        out = []
        for r in requests:
            total = 0
            for value in pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().tolist():
                total += value
            # numpy 1.x wraps an out-of-range Python int (a DeprecationWarning);
            # numpy 2.x raises OverflowError.
            acc = np.array([total], dtype=np.int32)
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", acc),
                pb_utils.Tensor("VERSION", np.array([np.__version__.encode()], np.object_)),
                pb_utils.Tensor("PREFIX", np.array([sys.prefix.encode()], np.object_)),
                pb_utils.Tensor("PID", np.array([os.getpid()], np.int64)),
            ]))
        return out
"""


# A model.py that imports, at its top, a package only its environment has:
# Triton imports it there both for auto-complete and for serving.
ENV_SOURCE = "import only_in_env\n" + SOURCE


def _config(name: str, env: str | None, instances: int = 1, process: str | None = None) -> str:
    text = python_config_text(
        name,
        [("IN", "INT64", (2,))],
        [("SUM", "INT32", (1,)), ("VERSION", "BYTES", (1,)), ("PREFIX", "BYTES", (1,)),
         ("PID", "INT64", (1,))],
        max_batch_size=0,
        instance_count=instances,
    )  # fmt: skip
    if env is not None:
        text += ENV_PARAMETER % env
    if process is not None:
        text += PROCESS % process
    return text


@pytest.fixture(scope="session")
def packed_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv (the worker's Python, no pip) with numpy 1.26.4 in its
    site-packages, as a folder; built once per run."""
    root = tmp_path_factory.mktemp("packed_env") / "env"
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    install = [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
        "--only-binary=:all:", "--disable-pip-version-check",
        "--target", str(root / "lib" / version / "site-packages"), f"numpy=={OLD_NUMPY}",
    ]  # fmt: skip
    done = subprocess.run(install, capture_output=True, text=True)
    assert done.returncode == 0, f"pip could not install numpy=={OLD_NUMPY}: {done.stderr}"
    # A package only the environment has (a model's tokenizer, say).
    (root / "lib" / version / "site-packages" / "only_in_env.py").write_text("NAME = 'env'\n")
    return root


@pytest.fixture(scope="session")
def env_archive(packed_env: Path) -> Path:
    """packed_env as a gzip'd tar of its contents (conda-pack's layout)."""
    archive = packed_env.parent / "env.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        tar.add(packed_env, arcname=".")
    return archive


def _write_slow_archive(path: Path, megabytes: int) -> None:
    """A bzip2'd tar of one file of zeros (no bin/activate): a few kilobytes
    that take seconds to unpack (bzip2 streams, one per MiB, concatenated:
    tarfile reads them as one)."""
    member = tarfile.TarInfo("zeros.bin")
    member.size = megabytes << 20
    chunk = bz2.compress(bytes(1 << 20))
    with path.open("wb") as f:
        f.write(bz2.compress(member.tobuf(format=tarfile.GNU_FORMAT)))
        for _ in range(megabytes):
            f.write(chunk)
        f.write(bz2.compress(bytes(2 * tarfile.BLOCKSIZE)))  # the end-of-archive blocks


@pytest.fixture(scope="module")
def env_stack(
    tmp_path_factory: pytest.TempPathFactory, packed_env: Path, env_archive: Path
) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("exec_env_repository")
    here = "$$TRITON_MODEL_DIRECTORY/env.tar.gz"
    write_python_model(root, "py_env", ENV_SOURCE, _config("py_env", here, instances=2))
    shutil.copy(env_archive, root / "py_env" / "env.tar.gz")
    # The same archive, through the other model's directory: one unpack for both.
    shared = "$$TRITON_MODEL_DIRECTORY/../py_env/env.tar.gz"
    write_python_model(root, "py_env_shared", ENV_SOURCE, _config("py_env_shared", shared))
    write_python_model(root, "py_env_dir", ENV_SOURCE, _config("py_env_dir", str(packed_env)))
    write_python_model(root, "py_plain", SOURCE, _config("py_plain", None))
    write_python_model(root, "py_missing", SOURCE, _config("py_missing", here))
    envdir = "$$TRITON_MODEL_DIRECTORY/envdir"
    write_python_model(root, "py_no_activate", SOURCE, _config("py_no_activate", envdir))
    (root / "py_no_activate" / "envdir").mkdir()
    write_python_model(root, "py_garbage", SOURCE, _config("py_garbage", here))
    (root / "py_garbage" / "env.tar.gz").write_bytes(b"not an archive")
    write_python_model(
        root, "py_env_thread", SOURCE, _config("py_env_thread", str(env_archive), process="false")
    )
    write_python_model(root, "py_big_env", SOURCE, _config("py_big_env", here))
    _write_slow_archive(root / "py_big_env" / "env.tar.gz", BIG_ENV_MB)
    loaded = ("py_env", "py_env_shared", "py_env_dir", "py_plain")
    with running_stack(root, control_mode="explicit", load_models=loaded) as s:
        yield s


def _infer(client: grpcclient.InferenceServerClient, model: str, values: list[int]) -> dict:
    inp = grpcclient.InferInput("IN", [2], "INT64")
    inp.set_data_from_numpy(np.array(values, np.int64))
    result = client.infer(model, [inp], client_timeout=60)
    return {
        "sum": int(result.as_numpy("SUM")[0]),
        "version": result.as_numpy("VERSION")[0].decode(),
        "prefix": result.as_numpy("PREFIX")[0].decode(),
        "pid": int(result.as_numpy("PID")[0]),
    }


def test_the_model_runs_on_its_environments_numpy(env_stack: RunningStack) -> None:
    with env_stack.client() as c:
        got = _infer(c, "py_env", [2**31 - 1, 1])
        assert got["version"] == OLD_NUMPY
        assert got["sum"] == -(2**31)  # wrapped silently, as under Triton's numpy 1.26
        assert _infer(c, "py_env", [40, 2])["sum"] == 42
        unpacked = Path(got["prefix"])
        assert unpacked.name != "py_env" and (unpacked / "pyvenv.cfg").is_file()
        assert not unpacked.is_relative_to(env_stack.repository)


def test_a_model_without_the_parameter_runs_on_the_workers_numpy(env_stack: RunningStack) -> None:
    with env_stack.client() as c:
        got = _infer(c, "py_plain", [40, 2])
        assert got["version"] == np.__version__ and got["version"].startswith("2.")
        assert got["sum"] == 42
        assert got["pid"] == env_stack.workers[0].proc.pid  # in-process, the default
        with pytest.raises(InferenceServerException) as info:
            _infer(c, "py_plain", [2**31 - 1, 1])
        assert info.value.status() == "StatusCode.INTERNAL"
        assert "OverflowError" in info.value.message()
        assert "out of bounds for int32" in info.value.message()


def test_a_directory_is_used_in_place(env_stack: RunningStack, packed_env: Path) -> None:
    with env_stack.client() as c:
        got = _infer(c, "py_env_dir", [2**31 - 1, 1])
    assert got["version"] == OLD_NUMPY and got["sum"] == -(2**31)
    assert Path(got["prefix"]) == packed_env.resolve()


def test_the_archive_is_unpacked_once_until_it_changes(env_stack: RunningStack) -> None:
    """Both instances of py_env, py_env_shared (the same archive) and its
    reload all run in the one unpacked folder: a file left in it survives. A
    new modification time unpacks it again, into the same folder."""
    archive = env_stack.repository / "py_env" / "env.tar.gz"
    started = _initialized(env_stack, "py_env")
    stubs = {pid for pid, _ in started}
    assert len(started) == 2 and len(stubs) == 2
    assert env_stack.workers[0].proc.pid not in stubs
    folder = Path(started[0][1])
    assert {prefix for _, prefix in started} == {str(folder)}
    with env_stack.client() as c:
        first = _infer(c, "py_env_shared", [1, 1])
        assert first["prefix"] == str(folder)
        marker = folder / "left-by-the-test"
        marker.write_text("")

        model_py = env_stack.repository / "py_env_shared" / "1" / "model.py"
        model_py.write_text(ENV_SOURCE + "# reload\n")
        c.load_model("py_env_shared")  # a new version of the files: a new stub
        again = _infer(c, "py_env_shared", [1, 1])
        assert again["pid"] != first["pid"] and again["prefix"] == str(folder)
        assert marker.exists()  # not unpacked again

        later = archive.stat().st_mtime + 10
        os.utime(archive, (later, later))
        model_py.write_text(ENV_SOURCE + "# reload again\n")
        c.load_model("py_env_shared")
        renewed = _infer(c, "py_env_shared", [2**31 - 1, 1])
        assert renewed["prefix"] == str(folder) and not marker.exists()
        assert renewed["version"] == OLD_NUMPY and renewed["sum"] == -(2**31)


def _initialized(stack: RunningStack, model: str) -> list[tuple[int, str]]:
    text = (stack.repository / model / "initialized").read_text()
    rows = (line.split(" ", 1) for line in text.splitlines())
    return [(int(pid), prefix) for pid, prefix in rows]


def _load_error(stack: RunningStack, model: str) -> InferenceServerException:
    with stack.client() as c, pytest.raises(InferenceServerException) as info:
        c.load_model(model)
    return info.value


def test_a_path_that_does_not_exist_fails_the_load(env_stack: RunningStack) -> None:
    """Triton 2.51 (checked): "load failed for model 'py_missing': version 1
    is at UNAVAILABLE state: Internal: Failed to get the canonical path for
    <path>."; the reason is the same here."""
    error = _load_error(env_stack, "py_missing")
    path = env_stack.repository / "py_missing" / "env.tar.gz"
    assert error.status() == AUTOCOMPLETE_FAILED
    assert f"Failed to get the canonical path for {path}." in error.message()


def test_the_reasons_are_tritons(env_stack: RunningStack, tmp_path: Path) -> None:
    """Real Triton 2.51 on the same repository: a path that does not
    resolve, a file that is not an archive and an environment without
    bin/activate fail its load with the code ours gives, the first and last
    with the reason ours gives too (for the second ours says more than
    Triton's "archive_read_open_filename() failed.")."""
    models = ("py_missing", "py_no_activate", "py_garbage")
    explicit = ("--model-control-mode", "explicit")
    with (
        triton_grpc(env_stack.repository, tmp_path, [], *explicit) as url,
        grpcclient.InferenceServerClient(url) as triton,
    ):
        for model in models:
            with pytest.raises(InferenceServerException) as info:
                triton.load_model(model)
            message = info.value.message()
            assert message.startswith(f"load failed for model '{model}': version 1 is at ")
            ours = _load_error(env_stack, model)
            assert ours.status() == info.value.status() == AUTOCOMPLETE_FAILED
            if model != "py_garbage":
                reason = message.split("UNAVAILABLE state: Internal: ", 1)[1].rstrip(";\n")
                assert reason in ours.message()


def test_a_file_that_is_not_an_archive_fails_the_load(env_stack: RunningStack) -> None:
    """Triton 2.51 says "archive_read_open_filename() failed." (libarchive's
    call); ours names the file and why."""
    error = _load_error(env_stack, "py_garbage")
    path = env_stack.repository / "py_garbage" / "env.tar.gz"
    assert error.status() == AUTOCOMPLETE_FAILED
    assert (
        f"Failed to unpack the Python execution environment {path}: "
        "not a tar archive (plain, gzip, bzip2 or xz)"
    ) in error.message()
    with env_stack.client() as c:  # a failed unpack spoils nothing for the others
        assert _infer(c, "py_env_shared", [1, 2])["version"] == OLD_NUMPY


def test_an_environment_cannot_run_in_the_workers_process(env_stack: RunningStack) -> None:
    error = _load_error(env_stack, "py_env_thread")
    assert error.status() == WORKER_FAILED
    assert error.message().startswith("load failed for model 'py_env_thread': version 1 is at ")
    assert (
        "parameter EXECUTION_ENV_PATH needs a process per instance, and parameter "
        "STAGESERVE_INSTANCE_PROCESS is 'false'" in error.message()
    )


def test_the_gateway_answers_while_an_archive_unpacks(env_stack: RunningStack) -> None:
    """The gateway reads a model (auto-complete, which unpacks its archive)
    off its event loop: ServerLive and another model's inference answer
    while py_big_env's archive unpacks, each in a fraction of the load's
    time, and the load then fails with Triton's code (no bin/activate)."""
    done = threading.Event()
    failures: list[InferenceServerException] = []

    def load() -> None:
        try:
            with env_stack.client() as c:
                c.load_model("py_big_env", client_timeout=120)
        except InferenceServerException as exc:
            failures.append(exc)
        finally:
            done.set()

    started = time.monotonic()
    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    latencies = []
    with env_stack.client() as c:
        while not done.is_set():
            sent = time.monotonic()
            assert c.is_server_live()
            assert _infer(c, "py_plain", [40, 2])["sum"] == 42
            latencies.append(time.monotonic() - sent)
    loader.join(10)
    load_s = time.monotonic() - started
    assert len(failures) == 1 and failures[0].status() == AUTOCOMPLETE_FAILED
    assert "The Python environment should contain an 'activate' script." in failures[0].message()
    assert load_s > 1.0, f"the archive unpacked in {load_s:.2f}s: too fast to tell"
    assert len(latencies) >= 3 and max(latencies) < load_s / 2, (
        f"slowest answer {max(latencies):.2f}s of {len(latencies)} during a {load_s:.2f}s load"
    )
