"""Triton's system shared-memory extension: regions a client registers by POSIX
shm key, read for inputs and written for outputs by the gateway.

A region is a window [offset, offset + byte_size) of the shm object
`/dev/shm/<key>`, mapped once at registration. Input bytes are copied out of
the mapping into the request (they then travel to the worker as raw bytes,
like any input); output bytes are copied into it when the answer comes back,
and the response carries an empty raw entry for that output, as Triton's does.

Registrations live in the gateway process that received them, as in Triton's
single process. A client's RPCs share one HTTP/2 connection, which
SO_REUSEPORT keeps on one gateway process, so a client that registers and
infers over one connection always finds its regions.

Error codes and messages follow Triton's shared-memory manager. Beyond
Triton, an offset need not be a multiple of the page size (the mapping starts
at the page below it).
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from stageserve.errors import already_exists, internal, invalid, not_found
from stageserve.names import check_shm_key, printable

SHM_ROOT = Path("/dev/shm")


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    _map: mmap.mmap = field(repr=False)
    _start: int  # where the region begins inside the mapping
    users: int = 0  # requests holding the region (unregister waits for them)
    unregistered: bool = False

    def read(self, offset: int, byte_size: int) -> bytes:
        self.check(offset, byte_size)
        begin = self._start + offset
        return self._map[begin : begin + byte_size]

    def write(self, offset: int, data: bytes) -> None:
        self.check(offset, len(data))
        begin = self._start + offset
        self._map[begin : begin + len(data)] = data

    def check(self, offset: int, byte_size: int) -> None:
        """Triton's bounds rule for a window of this region."""
        if offset < 0 or offset >= self.byte_size:
            raise invalid(f"Invalid offset for shared memory region: '{self.name}'")
        if byte_size < 0 or offset + byte_size > self.byte_size:
            raise invalid(f"Invalid offset + byte size for shared memory region: '{self.name}'")

    def close(self) -> None:
        self._map.close()


class SystemSharedMemory:
    """The gateway's registry of system shared-memory regions."""

    def __init__(self, root: Path = SHM_ROOT) -> None:
        self.root = root
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        with self._lock:
            if name in self._regions:
                raise already_exists(f"shared memory region '{name}' already in manager")
            self._regions[name] = self._map(name, key, offset, byte_size)

    def _map(self, name: str, key: str, offset: int, byte_size: int) -> Region:
        # Triton's answer for a key shm_open cannot open (INTERNAL, its code).
        cannot_open = internal(f"Unable to open shared memory region: '{printable(key)}'")
        bare = check_shm_key(key, cannot_open)  # one object of /dev/shm, never a path
        try:
            fd = os.open(self.root / bare, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            raise cannot_open from None
        try:
            size = os.fstat(fd).st_size
            if offset < 0 or byte_size <= 0 or offset + byte_size > size:
                raise invalid(f"failed to register shared memory region '{name}': invalid args")
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            mapping = mmap.mmap(fd, offset + byte_size - start, offset=start)
        except OSError as exc:
            raise invalid(f"failed to register shared memory region '{name}': {exc}") from None
        finally:
            os.close(fd)
        return Region(name, key, offset, byte_size, mapping, offset - start)

    def status(self, name: str = "") -> list[Region]:
        with self._lock:
            if not name:
                return list(self._regions.values())
            region = self._regions.get(name)
        if region is None:
            raise not_found(f"Unable to find system shared memory region: '{name}'")
        return [region]

    def unregister(self, name: str = "") -> None:
        """One region, or all with an empty name; an unknown name is no error.
        A region still used by in-flight requests is unmapped when they finish."""
        with self._lock:
            names = list(self._regions) if not name else [name]
            for n in names:
                region = self._regions.pop(n, None)
                if region is None:
                    continue
                region.unregistered = True
                if region.users == 0:
                    region.close()

    def acquire(self, name: str) -> Region:
        """The region a request reads or writes; release() it when the request ends."""
        with self._lock:
            region = self._regions.get(name)
            if region is None:
                raise not_found(f"Unable to find shared memory region: '{name}'")
            region.users += 1
            return region

    def release(self, region: Region) -> None:
        with self._lock:
            region.users -= 1
            if region.users == 0 and region.unregistered:
                region.close()
