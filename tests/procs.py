"""What /proc says about a process the tests started (or its children did)."""

from __future__ import annotations


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name (which may hold spaces)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Running: a zombie (exited, not yet reaped) is gone for our purpose."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except FileNotFoundError:
        return False


def parent_pid(pid: int) -> int:
    return int(_stat_fields(pid)[1])
