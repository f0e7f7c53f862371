"""A tensor region: one file under /dev/shm, mapped, with its slot table inside.

Layout: a 64-byte header (magic, slot count, slot size, owner pid, the
owner's pid namespace), the
tags (uint32 per slot), the stamps (uint64 per slot), the generations
(uint64 per slot), then the data area from a 64-byte boundary. The file's
pages are reserved when it is created (posix_fallocate): a full /dev/shm
fails the creation, and the process goes without a region (inline bytes),
instead of a SIGBUS at the first write into a page tmpfs cannot supply. The file is named
``stageserve-<stack>-<role>-<pid>``: one per owning process, so a peer
knows the owner by name, and a region whose pid is dead is garbage that any
process of the stack may unlink (`sweep`), and so may any process of any
stack in the same pid namespace (`sweep_dead`: a stack killed whole, or
whose killed process was never restarted, leaves no file behind for the
next stack on the host). A process's own region is unlinked when it exits
normally; kill -9 leaves the file for the sweeps.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from stageserve.tensor_slots import SlotTable, extent_slots, retaken

SHM_DIR = Path("/dev/shm")
_MAGIC = b"SSTSLOT2"
_HEADER = struct.Struct("<8sIIIQ")  # magic, slots, slot size, pid, pid namespace
_HEADER_SIZE = 64


def pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid; 0 unknown)."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return 0
    digits = link.rsplit("[", 1)[-1].rstrip("]")
    return int(digits) if digits.isdigit() else 0


def region_name(stack: str, role: str, pid: int) -> str:
    return f"stageserve-{stack}-{role}-{pid}"


def owner_pid(name: str) -> int:
    """The pid a region name ends with (0 if it has none)."""
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def pid_alive(pid: int) -> bool:
    """True while `pid` runs on this host (a zombie counts as dead: it freed nothing
    but will never touch its region again)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _layout(slots: int) -> tuple[int, int, int, int]:
    """(tags offset, stamps offset, generations offset, data offset)."""
    tags = _HEADER_SIZE
    stamps = tags + 4 * slots
    stamps += -stamps % 8
    gens = stamps + 8 * slots
    data = gens + 8 * slots
    data += -data % 64
    return tags, stamps, gens, data


class TensorRegion:
    """A mapped region: its slot table and its data area."""

    def __init__(self, name: str, mapping: mmap.mmap, writable: bool) -> None:
        magic, slots, slot_size, pid, _ns = _HEADER.unpack_from(mapping, 0)
        if magic != _MAGIC:
            raise ValueError(f"{name} is not a tensor region")
        self.name = name
        self.pid = pid
        self._mapping = mapping
        tags_at, stamps_at, gens_at, data_at = _layout(slots)
        buf = memoryview(mapping)
        self.data = buf[data_at : data_at + slots * slot_size]
        # read-only in a reader's mapping: what `retaken` compares
        self.gens = np.frombuffer(buf, np.uint64, slots, gens_at)
        self.table: SlotTable | None = None
        if writable:
            tags = np.frombuffer(buf, np.uint32, slots, tags_at)
            stamps = np.frombuffer(buf, np.uint64, slots, stamps_at)
            self.table = SlotTable(tags, stamps, slot_size, self.gens)
        self.slot_size = slot_size

    @classmethod
    def create(cls, name: str, slots: int, slot_size: int) -> TensorRegion:
        path = SHM_DIR / name
        size = _layout(slots)[3] + slots * slot_size
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # every page now (OSError ENOSPC on a full tmpfs), not at first touch
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            raise
        finally:
            os.close(fd)
        _HEADER.pack_into(mapping, 0, _MAGIC, slots, slot_size, os.getpid(), pid_namespace())
        return cls(name, mapping, writable=True)

    @classmethod
    def open(cls, name: str, writable: bool) -> TensorRegion:
        """A peer's region: read-only for reading its extents, writable for
        freeing them (the consumer of a worker's outputs)."""
        fd = os.open(SHM_DIR / name, os.O_RDWR if writable else os.O_RDONLY)
        try:
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            mapping = mmap.mmap(fd, 0, access=access)
        finally:
            os.close(fd)
        return cls(name, mapping, writable=writable)

    def extent(self, offset: int, length: int) -> memoryview:
        return self.data[offset : offset + length]

    def retaken(self, offset: int, length: int, generation: int) -> bool:
        """The extent at `offset` no longer carries `generation` (its owner
        freed it and handed it out again); generation 0: unchecked."""
        if not generation:
            return False
        start = offset // self.slot_size
        return retaken(self.gens, start, start + extent_slots(length, self.slot_size), generation)

    def close(self) -> None:
        self.table = None
        self.data.release()
        with contextlib.suppress(BufferError):  # numpy views still alive: the GC unmaps
            self._mapping.close()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / self.name).unlink()


def sweep(stack: str) -> list[str]:
    """Unlink the stack's regions whose owner is dead; the names removed."""
    removed = []
    for path in SHM_DIR.glob(f"stageserve-{stack}-*"):
        if not pid_alive(owner_pid(path.name)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            removed.append(path.name)
    return removed


def sweep_dead(namespace: int | None = None) -> list[str]:
    """Unlink every stack's regions whose owner is dead and ran in this pid
    namespace (the header says; where the pid means another process, as in
    a container sharing /dev/shm only, nothing is touched); the names removed."""
    namespace = pid_namespace() if namespace is None else namespace
    removed: list[str] = []
    if not namespace:
        return removed
    for path in SHM_DIR.glob("stageserve-*"):
        if pid_alive(owner_pid(path.name)) or _header_namespace(path) != namespace:
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        removed.append(path.name)
    return removed


def _header_namespace(path: Path) -> int | None:
    """The pid namespace a region's header names; None: not a region of this layout."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
    except OSError:
        return None
    if len(head) < _HEADER.size:
        return None
    magic, _slots, _size, _pid, namespace = _HEADER.unpack(head)
    return int(namespace) if magic == _MAGIC else None


def slots_in_use(stack: str) -> dict[str, int]:
    """Slots in use in each live region of the stack: what the chaos audit
    counts. Dead owners' regions are swept first, and slots a dead process
    was to free (a killed gateway's outputs) are reclaimed, as the region's
    owner would when it fills: what is left is held by live processes."""
    sweep(stack)
    counts = {}
    for path in SHM_DIR.glob(f"stageserve-{stack}-*"):
        try:
            region = TensorRegion.open(path.name, writable=True)
        except (OSError, ValueError):
            continue
        assert region.table is not None
        region.table.reclaim(lambda pid: not pid_alive(pid))
        counts[path.name] = region.table.in_use()
        region.close()
    return counts
