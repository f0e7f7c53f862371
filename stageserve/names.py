"""Names a client sends that could reach the file system, checked before they do.

Pure validation with Triton's codes and messages: model names (one folder of
the repository, never a path), model versions (Triton parses them with
``std::stol``), file-override paths of ``RepositoryModelLoad`` (relative,
inside the model's folder) and system shared-memory keys (one POSIX shm
object). Every function raises StageError; none touches the disk.

Triton 2.51 answers a load of ``a/b``, ``..``, ``/etc`` or an over-long name
with INTERNAL "failed to poll from model repository" (it looks, finds nothing).
StageServe never looks: such a name cannot be a model folder, so the load is
refused at once with INVALID_ARGUMENT (a client's mistake is never INTERNAL
here; docs/hardening.md).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from stageserve.errors import StageError, invalid, load_failed

#: NAME_MAX on Linux: a longer folder name cannot exist (ENAMETOOLONG).
MAX_NAME_BYTES = 255
#: std::stol's range: Triton refuses a version outside it.
MAX_VERSION = 2**63 - 1
#: Triton's message for a version std::stol cannot parse.
_STOL = (
    "failed to get model version from specified version string '{}' (details: stol), "
    "version should be an integral value > 0"
)


def model_name_problem(name: str) -> str | None:
    """Why `name` cannot be a folder of the repository, or None when it can."""
    if not name:
        return "the model name is empty"
    if "\x00" in name:
        return "a model name cannot contain a NUL character"
    if "/" in name or "\\" in name:
        return "a model name is one folder of the repository, never a path"
    if name in (".", ".."):
        return f"'{name}' is not a model folder"
    if name.startswith("."):
        return "hidden folders are not models"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return f"a model name is at most {MAX_NAME_BYTES} bytes"
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in name):
        return "a model name cannot contain control characters"
    return None


def printable(name: str, limit: int = 256) -> str:
    """A name as it may appear in a message or log: escaped and cut short."""
    text = "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in name
    )
    return text if len(text) <= limit else f"{text[:limit]}...({len(name)} chars)"


def check_model_name(name: str, action: str = "load") -> None:
    """An error unless `name` can be a model folder of the repository: INTERNAL
    for a load (Triton 2.51's code for a load it refuses, errors.load_failed),
    INVALID_ARGUMENT for anything else."""
    problem = model_name_problem(name)
    if problem is not None:
        message = f"failed to {action} '{printable(name)}': {problem}"
        raise load_failed(message) if action == "load" else invalid(message)


def model_dir(root: Path, name: str) -> Path:
    """The folder of model `name` inside `root` (validated, never outside it)."""
    check_model_name(name)
    return root / name


def parse_version(text: str) -> int | None:
    """A request's model_version: None for '' (the server's choice), else the
    integer, with Triton's INVALID_ARGUMENT for what std::stol refuses."""
    if text == "":
        return None
    digits = text[1:] if text[:1] == "-" else text
    if not digits.isascii() or not digits.isdigit() or int(digits) > MAX_VERSION:
        raise invalid(_STOL.format(printable(text)))
    version = int(text)
    if version < 0:
        raise invalid(
            f"invalid model version specified '{text}' , version should be an integral value > 0"
        )
    return version


OUTSIDE_MODEL_DIR = "the path must stay within model directory"


def override_path_problem(path: str) -> str | None:
    """Why a `file:<path>` override of RepositoryModelLoad cannot be a file of the
    model folder, or None. It must be relative, inside the folder, without '..',
    NUL or '\\', and every part a valid file name."""
    if not path or "\x00" in path or "\\" in path:
        return OUTSIDE_MODEL_DIR
    if PurePosixPath(path).is_absolute() or any(part in ("..", ".") for part in path.split("/")):
        return f"{OUTSIDE_MODEL_DIR} (relative, without '.' or '..')"
    for part in PurePosixPath(path).parts:
        if len(part.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            return f"file name too long: a part of the path is over {MAX_NAME_BYTES} bytes"
    return None


def check_override_path(path: str) -> PurePosixPath:
    """INVALID_ARGUMENT unless `path` is a file of the model folder
    (override_path_problem)."""
    problem = override_path_problem(path)
    if problem is not None:
        raise invalid(f"invalid file override path '{printable(path)}': {problem}")
    return PurePosixPath(path)


def shm_key_problem(key: str) -> str | None:
    """Why `key` cannot name one POSIX shared-memory object, or None."""
    bare = key[1:] if key.startswith("/") else key
    if not bare:
        return "empty key"
    if "/" in bare or "\x00" in bare:
        return "a key names one shared-memory object, never a path"
    if bare in (".", ".."):
        return "not a shared-memory object"
    if len(bare.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return "key too long"
    return None


def check_shm_key(key: str, code_error: StageError) -> str:
    """The shm object name for `key`, or `code_error` (Triton's answer for a key
    it cannot open) when the key could reach anything but one /dev/shm object."""
    if shm_key_problem(key) is not None:
        raise code_error
    return key[1:] if key.startswith("/") else key
