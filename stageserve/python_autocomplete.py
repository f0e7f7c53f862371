"""Triton's auto-complete for Python models: the model's own
`TritonPythonModel.auto_complete_config(auto_complete_model_config)`.

Whoever reads the repository (the gateway, unless auto-complete is disabled)
calls `complete_python` at load, as Triton does: the model.py is imported, given
the configuration as pb_utils.ModelConfig, and what it returns becomes the
configuration (inputs, outputs, max_batch_size, dynamic batching, the
transaction policy). Errors it raises make the model fail to load.

The model.py runs in a short-lived child process (`python -m` the Python
backend's autocomplete_child module, started by name so this kernel module
imports nothing of the worker), as Triton runs it in its stub process, never
in the caller: its imports (torch, say) stay out of the gateway, and a
model.py that exits, crashes or hangs at import fails its own load instead of
taking the gateway down.
The child is kept for the next model (see _Helper for the cost). A model
with its own execution environment (EXECUTION_ENV_PATH) is completed by a
child running in that environment (stageserve/python_exec_env.py), one kept
per environment, as Triton runs its auto-complete stub there.
"""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
import threading
import time
from pathlib import Path

from google.protobuf import json_format

from stageserve.config import DEFAULT_PYTHON_FILENAME, ConfigError
from stageserve.generated import model_config_pb2 as mc
from stageserve.python_exec_env import (
    ENVIRONMENTS,
    ExecutionEnv,
    ExecutionEnvError,
    module_command,
    requested_env,
)

# A model.py whose import or auto_complete_config takes longer fails its load.
CHILD_TIMEOUT_S = 120.0
# How long a child whose stdout ended may take to exit before it is killed.
_EXIT_GRACE_S = 5.0
# The child's module: it imports the model.py with pb_utils registered.
CHILD_MODULE = "services.worker.python_backend.autocomplete_child"


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
    env = _model_env(config, Path(model_dir))
    as_dict = json_format.MessageToDict(config, preserving_proto_field_name=True)
    answer = _run_child(config.name, {"config": as_dict, "model_file": str(model_file)}, env)
    if "error" in answer:
        raise ConfigError(answer["error"])
    fresh = mc.ModelConfig()
    try:
        json_format.ParseDict(answer["config"], fresh)
    except (ValueError, TypeError, json_format.ParseError) as exc:
        raise ConfigError(
            f"auto-complete of model '{config.name}' failed: {type(exc).__name__}: {exc}"
        ) from exc
    config.CopyFrom(fresh)


class _Helper:
    """The child process, kept for the next model: its interpreter start and
    imports are paid once per process that reads the repository, not once per
    model. A child that dies or times out is replaced at the next call.

    Measured on the 2-core dev machine over the example repository's Python
    models: the first one 113 ms (the child's start), each later one 1-2 ms;
    in-process it was 9 ms for the first and 0.4-0.9 ms for the others."""

    def __init__(self, env: ExecutionEnv | None = None) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._env = env  # None: this interpreter and its packages

    def run(self, name: str, job: dict) -> dict:
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                proc = self._proc = self._start()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps(job) + "\n")
                proc.stdin.flush()
            except OSError:
                pass  # it died: reported below
            line, timed_out = _answer_line(proc)
            if line:
                return json.loads(line)
            self._proc = None
            if not timed_out:
                # Its stdout ended, so it is exiting: the kernel closes a dying
                # process's files before its parent can reap it, and poll()
                # in that window says None (which would report "did not
                # finish within 120 s" for a child that had exited at once).
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=_EXIT_GRACE_S)
            proc.kill()
            status = proc.wait()
        if timed_out:
            raise ConfigError(
                f"auto_complete_config of model '{name}' did not finish within "
                f"{CHILD_TIMEOUT_S:g} s"
            )
        raise ConfigError(
            f"auto_complete_config of model '{name}': its process ended with status "
            f"{status} before answering"
        )

    def stop(self) -> None:
        """Ends the kept child, if any (after the job it may be running)."""
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()

    def _start(self) -> subprocess.Popen:
        argv, variables = module_command(CHILD_MODULE, [], self._env)
        return subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=variables
        )


def _answer_line(proc: subprocess.Popen) -> tuple[str, bool]:
    """The child's next line ("" when it exited first) and whether
    CHILD_TIMEOUT_S passed without either.

    Its exit is watched, not only its stdout's end of file: a process forked
    by the caller meanwhile may hold the pipe's write end, and then no end of
    file comes, and the caller would wait the whole timeout for a child that
    had exited at once."""
    assert proc.stdout is not None
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.05)
        if ready:
            return proc.stdout.readline(), False
        if proc.poll() is not None:
            ready, _, _ = select.select([proc.stdout], [], [], 0)
            return (proc.stdout.readline() if ready else ""), False
    return "", True


_helper = _Helper()
# One child per execution environment, kept as _helper is.
_env_helpers: dict[ExecutionEnv, _Helper] = {}
_env_helpers_lock = threading.Lock()


def _run_child(name: str, job: dict, env: ExecutionEnv | None = None) -> dict:
    if env is None:
        return _helper.run(name, job)
    with _env_helpers_lock:
        helper = _env_helpers.get(env)
        if helper is None:
            # An archive unpacked again: the child of its former unpack has
            # the former packages imported.
            for stale in [e for e in _env_helpers if e.root == env.root]:
                _env_helpers.pop(stale).stop()
            helper = _env_helpers[env] = _Helper(env)
    return helper.run(name, job)


class ExecutionEnvUnusable(ConfigError):
    """The model's EXECUTION_ENV_PATH cannot be used (missing, not an
    archive, no activate script, ...). Triton fails the model's version load
    for it, not the repository read: INVALID_ARGUMENT "load failed for model"
    (checked against Triton 2.51)."""


def _model_env(config: mc.ModelConfig, model_dir: Path) -> ExecutionEnv | None:
    """The model's execution environment, unpacked if need be; None when it
    names none. Raises ConfigError with the reason it cannot be used."""
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    path = requested_env(parameters, model_dir)
    if path is None:
        return None
    try:
        return ENVIRONMENTS.prepare(path)
    except ExecutionEnvError as exc:
        raise ExecutionEnvUnusable(str(exc)) from exc
