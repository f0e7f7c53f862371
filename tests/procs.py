"""What /proc says about a process the tests started (or its children did)."""

from __future__ import annotations

import os


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name (which may hold spaces)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Running, or still exiting: gone once every thread has exited.

    A killed process's main thread can turn zombie while another of its
    threads is still exiting (the last one out tears down the address space
    and only then closes the files): until then its sockets stay open, and a
    listener sharing a port (SO_REUSEPORT) still takes connections, which the
    kernel resets when the files close. A zombie leader whose other threads
    are all gone (/proc/<pid>/task lists only itself) holds nothing.
    """
    try:
        if _stat_fields(pid)[0] != "Z":
            return True
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except FileNotFoundError:
        return False


def parent_pid(pid: int) -> int:
    return int(_stat_fields(pid)[1])
