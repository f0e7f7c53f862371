"""A Python model's own execution environment (parameter EXECUTION_ENV_PATH).

Triton's Python backend semantics (python_backend src/pb_env.cc and
stub_launcher.cc, checked against Triton 2.51):

- `$$TRITON_MODEL_DIRECTORY` in the value stands for the model's directory;
  any other relative path is relative to the server's (here: the worker's)
  working directory.
- A path that does not resolve fails the load: INTERNAL "Failed to get the
  canonical path for <path>." (the gateway answers it as any load failure).
- A directory is the environment itself, used in place.
- A file is a (conda-pack) archive, unpacked once per process (each worker;
  the gateway too, for auto-complete) into a folder of its own under a
  temporary directory and reused by every instance and reload of every model
  that names the same file, until the file's modification time changes: then
  it is unpacked again, into the same folder.
- The environment must hold `bin/activate`, or the load fails with Triton's
  message.

The folder of all unpacked environments is removed when its process exits.

Both the worker (each instance's stub) and whoever reads the repository
(auto_complete_config, stageserve/python_autocomplete.py) run a model's
Python in its environment, hence this module in the kernel.

How a module runs in an environment (`module_command`), as Triton starts
its stub: the environment's `bin/activate` is sourced and its `lib` goes
first on LD_LIBRARY_PATH; then the environment's own interpreter runs the
module. Its module search path is the environment's (standard library and
site-packages, user site off) FIRST, then the folders StageServe's code
needs that the environment may lack: StageServe's source and the caller's
site-packages (grpc, protobuf, ...). So the model's packages (numpy 1.x,
torch, a tokenizer) are the environment's, and a package the environment
does not have comes from the caller. The caller's PYTHONPATH is not put
before the environment's packages (it is appended, like the rest).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: the model parameter that names the environment
PARAMETER = "EXECUTION_ENV_PATH"
#: the placeholder Triton replaces with the model's directory
MODEL_DIRECTORY = "$$TRITON_MODEL_DIRECTORY"
# How long the environment's interpreter gets to tell its version.
_VERSION_TIMEOUT_S = 60.0


class ExecutionEnvError(RuntimeError):
    """The environment cannot be used: the model does not load."""


def requested_env(parameters: Mapping[str, str], model_dir: Path) -> str | None:
    """The environment a model's parameters name, `$$TRITON_MODEL_DIRECTORY`
    replaced by its directory; None when there is none (absent or empty, as
    Triton treats an empty value)."""
    value = parameters.get(PARAMETER, "")
    if not value:
        return None
    # Every occurrence stands for the directory. (Triton 2.51 replaces the
    # first one and, where it is not at the start, eats the characters after
    # it too: "/x/$$TRITON_MODEL_DIRECTORY/env.tar.gz" becomes ".../modeltar.gz".)
    return value.replace(MODEL_DIRECTORY, str(model_dir))


@dataclass(frozen=True)
class Unpacked:
    """An archive unpacked into `folder` when its mtime was `mtime_ns`."""

    folder: Path
    mtime_ns: int


def needs_unpack(known: Unpacked | None, mtime_ns: int) -> bool:
    """True when the archive must be unpacked (again): never unpacked in this
    process, or modified since (Triton compares the modification time only)."""
    return known is None or known.mtime_ns != mtime_ns


@dataclass(frozen=True)
class ExecutionEnv:
    """A usable environment: its root, the interpreter a stub runs on, that
    interpreter's "major.minor", and the modification time (ns) of the
    archive it was unpacked from, or of the directory: a process kept
    running in an environment serves only while its stamp is current."""

    root: Path
    python: Path
    version: str
    stamp: int = 0


def worker_python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


class EnvironmentManager:
    """A process's environments: unpacks each archive once, checks each
    environment once per unpack. Thread-safe: instances load concurrently."""

    def __init__(self, base: Path | None = None) -> None:
        self._base = base  # created at the first unpack
        self._lock = threading.Lock()
        self._unpacked: dict[Path, Unpacked] = {}
        self._checked: dict[tuple[Path, int], ExecutionEnv] = {}
        #: how many archives this manager unpacked (logged with each unpack)
        self.unpacks = 0

    def prepare(self, path: str) -> ExecutionEnv:
        """The environment at `path` (unpacked first if it is an archive).
        Raises ExecutionEnvError with the reason the model does not load."""
        try:
            canonical = Path(os.path.realpath(path, strict=True))
            stat = canonical.stat()
        except OSError as exc:
            raise ExecutionEnvError(f"Failed to get the canonical path for {path}.") from exc
        with self._lock:
            if canonical.is_dir():
                root, stamp = canonical, stat.st_mtime_ns
            else:
                root = self._unpack(canonical, stat.st_mtime_ns).folder
                stamp = self._unpacked[canonical].mtime_ns
            key = (root, stamp)
            if key not in self._checked:
                self._checked[key] = _check(root, stamp)
            return self._checked[key]

    def _unpack(self, archive: Path, mtime_ns: int) -> Unpacked:
        known = self._unpacked.get(archive)
        if not needs_unpack(known, mtime_ns):
            assert known is not None
            return known
        if not hasattr(tarfile, "tar_filter"):  # Python 3.11.0-3.11.3: no safe extraction
            raise ExecutionEnvError(
                f"Cannot unpack the Python execution environment {archive}: "
                "the worker's Python has no tarfile filters (3.11.4 or later has them)"
            )
        folder = known.folder if known is not None else self._base_dir() / str(len(self._unpacked))
        # Into a fresh sibling first: a failed unpack leaves no half environment
        # behind, and the folder a reload reuses is never half replaced.
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            with tarfile.open(archive) as tar:
                # "tar": no member outside the folder, while links may point
                # anywhere (a venv's bin/python links to its base interpreter).
                tar.extractall(partial, filter="tar")
        except (tarfile.TarError, OSError, EOFError) as exc:
            shutil.rmtree(partial, ignore_errors=True)
            why = (
                "not a tar archive (plain, gzip, bzip2 or xz)"
                if type(exc) is tarfile.ReadError
                else f"{type(exc).__name__}: {exc}"
            )
            raise ExecutionEnvError(
                f"Failed to unpack the Python execution environment {archive}: {why}"
            ) from exc
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
        unpacked = Unpacked(folder, mtime_ns)
        self._unpacked[archive] = unpacked
        self.unpacks += 1
        log.info(
            "python execution env unpacked",
            extra={"archive": str(archive), "folder": str(folder), "unpacks": self.unpacks},
        )
        return unpacked

    def _base_dir(self) -> Path:
        if self._base is None:
            self._base = Path(tempfile.mkdtemp(prefix="stageserve_python_env_"))
            atexit.register(shutil.rmtree, self._base, True)
        return self._base


def _check(root: Path, stamp: int) -> ExecutionEnv:
    """Triton's requirement (an activate script), plus ours: an interpreter
    whose major.minor is the worker's, as the stub imports the worker's
    compiled packages (grpc, protobuf)."""
    activate = root / "bin" / "activate"
    if not activate.is_file():
        raise ExecutionEnvError(
            f"Path {activate} does not exist. "
            "The Python environment should contain an 'activate' script."
        )
    candidates = (root / "bin" / "python3", root / "bin" / "python")
    python = next((p for p in candidates if p.exists()), None)
    if python is None:
        raise ExecutionEnvError(
            f"Path {root / 'bin' / 'python3'} does not exist. The Python environment "
            "should contain a Python interpreter: the model's stub runs on it."
        )
    try:
        done = subprocess.run(
            [str(python), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=_VERSION_TIMEOUT_S,
            env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ExecutionEnvError(f"The Python interpreter {python} does not run: {exc}") from exc
    version = done.stdout.strip()
    if done.returncode != 0 or not version:
        raise ExecutionEnvError(
            f"The Python interpreter {python} does not run: exit status {done.returncode}"
        )
    if version != worker_python_version():
        raise ExecutionEnvError(
            f"The Python execution environment {root} has Python {version}; "
            f"this worker's stub needs Python {worker_python_version()}"
        )
    return ExecutionEnv(root, python, version, stamp)


#: this process's environments (one manager per process, as Triton has one per server)
ENVIRONMENTS = EnvironmentManager()

# The environment variable that carries the folders appended to the module path.
PATH_VARIABLE = "STAGESERVE_ENV_FALLBACK_PATH"
# The folder that holds the `stageserve` and `services` packages.
SOURCE_ROOT = str(Path(__file__).resolve().parents[1])

# Runs first in an environment's interpreter: drops the working directory
# `-c` puts first, appends the caller's folders, then runs the module named
# by argv[1] as `python -m` would, with the arguments after it.
_BOOT = (
    "import os, runpy, sys; "
    "sys.path[:] = [p for p in sys.path if p] + "
    f"os.environ.pop({PATH_VARIABLE!r}).split(os.pathsep); "
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
)

# Sourced as Triton does; the interpreter is exec'd so the module runs in the child.
_ACTIVATE = (
    'source "$0/bin/activate" && '
    'LD_LIBRARY_PATH="$0/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$@"'
)


def module_command(
    module: str, args: list[str], env: ExecutionEnv | None
) -> tuple[list[str], dict[str, str]]:
    """argv and environment variables that run `python -m module *args`: on
    this interpreter with StageServe's source first on PYTHONPATH (env None),
    or in `env` as this module's docstring says."""
    if env is None:
        path = [SOURCE_ROOT, os.environ.get("PYTHONPATH", "")]
        return (
            [sys.executable, "-m", module, *args],
            {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)},
        )
    variables = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    variables["PYTHONNOUSERSITE"] = "1"
    variables[PATH_VARIABLE] = os.pathsep.join(fallback_path())
    python = [str(env.python), "-c", _BOOT, module, *args]
    return ["bash", "-c", _ACTIVATE, str(env.root), *python], variables


def fallback_path() -> list[str]:
    """StageServe's source, then this process's module path without its
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
