"""How a stub process starts: `python -m` the stub module on the worker's
interpreter, or in a model's execution environment
(stageserve/python_exec_env.py says how a module runs there)."""

from __future__ import annotations

from stageserve.python_exec_env import ExecutionEnv, module_command

STUB_MODULE = "services.worker.python_backend.stub"


def stub_command(fd: int, env: ExecutionEnv | None) -> tuple[list[str], dict[str, str]]:
    """argv and environment variables of a stub speaking on descriptor `fd`."""
    return module_command(STUB_MODULE, [str(fd)], env)
