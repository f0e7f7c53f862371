"""How a stub process starts: on the worker's interpreter, or in a model's
execution environment (exec_env.py).

In an environment, as Triton does, the environment's `bin/activate` is sourced
and its `lib` goes first on LD_LIBRARY_PATH; then the environment's own
interpreter runs the stub. Its module search path is the environment's
(standard library and site-packages, user site off) FIRST, then the folders
the stub itself needs that the environment may lack: StageServe's source and
the worker's site-packages (grpc, protobuf, ...). So the model's packages
(numpy 1.x, torch, a tokenizer) are the environment's, and a package the
environment does not have comes from the worker. The worker's PYTHONPATH is
not put before the environment's packages (it is appended, like the rest).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

from services.worker.python_backend.exec_env import ExecutionEnv

STUB_MODULE = "services.worker.python_backend.stub"
# The environment variable that carries the folders appended to the stub's path.
PATH_VARIABLE = "STAGESERVE_STUB_PATH"
# The folder that holds the `services` package, for the stub's imports.
SOURCE_ROOT = str(Path(__file__).resolve().parents[3])

# Runs first in an environment's interpreter: drops the working directory
# `-c` puts first, appends the worker's folders, then runs the stub as
# `python -m` would (its argv[1] is still the socket's descriptor).
BOOT = (
    "import os, runpy, sys; "
    "sys.path[:] = [p for p in sys.path if p] + "
    f"os.environ.pop({PATH_VARIABLE!r}).split(os.pathsep); "
    f"runpy.run_module({STUB_MODULE!r}, run_name='__main__', alter_sys=True)"
)

# Sourced as Triton does; the interpreter is exec'd so the stub is the child.
_ACTIVATE = (
    'source "$0/bin/activate" && '
    'LD_LIBRARY_PATH="$0/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$@"'
)


def stub_command(fd: int, env: ExecutionEnv | None) -> tuple[list[str], dict[str, str]]:
    """argv and environment variables of a stub speaking on descriptor `fd`."""
    if env is None:
        path = [SOURCE_ROOT, os.environ.get("PYTHONPATH", "")]
        return (
            [sys.executable, "-m", STUB_MODULE, str(fd)],
            {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)},
        )
    variables = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    variables["PYTHONNOUSERSITE"] = "1"
    variables[PATH_VARIABLE] = os.pathsep.join(fallback_path())
    argv = ["bash", "-c", _ACTIVATE, str(env.root), str(env.python), "-c", BOOT, str(fd)]
    return argv, variables


def fallback_path() -> list[str]:
    """StageServe's source, then the worker's own module path without its
    standard library (the environment brings one of the same version)."""
    stdlib = {
        os.path.realpath(p)
        for p in (sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib"))
        if p
    }
    out = [SOURCE_ROOT]
    for entry in sys.path:
        if not entry or entry.endswith(".zip"):
            continue
        real = os.path.realpath(entry)
        if real in stdlib or any(real.startswith(s + os.sep + "lib-dynload") for s in stdlib):
            continue
        if entry not in out:
            out.append(entry)
    return out
