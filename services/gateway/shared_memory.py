"""Triton's shared-memory extensions: regions a client registers, read for
inputs and written for outputs by the gateway. One table holds both kinds, as
Triton's SharedMemoryManager does: a name is unique across system and CUDA
regions, a request's input or output finds its region whatever its kind, and
status and unregister of one kind leave the other alone.

A system region is a window [offset, offset + byte_size) of the shm object
`/dev/shm/<key>`, mapped once at registration. A CUDA region is a client's
allocation opened from its cudaIpcMemHandle_t on its device
(cuda_shared_memory.py). Input bytes are copied out of the region into the
request (they then travel to the worker as raw bytes, like any input; a CUDA
region's through a device-to-host copy); output bytes are copied into it when
the answer comes back, and the response carries an empty raw entry for that
output, as Triton's does.

Each region copies two ways: `read` / `write` on the event loop, and
`read_in_thread` / `write_in_thread` for a large copy a worker thread makes
(services/gateway/shm_copies.py), which release the GIL for the copy itself
so the loop runs meanwhile. A system region copies with pread / pwrite on the
shm object's descriptor, both ways: a slice of the mapping would hold the GIL
for its whole copy (64 MB: 45 ms), and it faults (SIGBUS, the gateway gone)
when the client has shrunk the object since it registered, where pread reads
short (validation then refuses the byte size) and pwrite grows the object
again. A small pread costs more than a slice (64 B: 0.9 against 0.1 us; 1 MiB:
64 against 24 us; the 2-core development VM): a few microseconds a request.
The mapping made at register is Triton's check of the descriptor and window.

Registrations live in the gateway process that received them, as in Triton's
single process. A client's RPCs share one HTTP/2 connection, which
SO_REUSEPORT keeps on one gateway process, so a client that registers and
infers over one connection always finds its regions.

Error codes and messages follow Triton's shared-memory manager. Beyond
Triton, an offset need not be a multiple of the page size (the mapping starts
at the page below it).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from services.gateway.cuda_shared_memory import open_window
from stageserve.errors import StageError, already_exists, internal, invalid, not_found
from stageserve.names import check_shm_key, printable
from stageserve.validation import SharedRef

log = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")

Kind = Literal["system", "cuda"]
SYSTEM: Kind = "system"
CUDA: Kind = "cuda"
_TITLE = {SYSTEM: "system", CUDA: "CUDA"}


class Window(Protocol):
    """The memory behind a region, addressed from the region's start."""

    def read(self, begin: int, byte_size: int) -> bytes: ...

    def write(self, begin: int, data: bytes) -> None: ...

    def read_in_thread(self, begin: int, byte_size: int) -> bytes:
        """`read`, releasing the GIL for the copy (a worker thread's)."""
        ...

    def write_in_thread(self, begin: int, data: bytes) -> None:
        """`write`, releasing the GIL for the copy (a worker thread's)."""
        ...

    def close(self) -> None: ...


#: (name, raw handle, device id, byte size) -> the opened CUDA window
#: (cuda_shared_memory.open_window; a test injects its own)
CudaOpener = Callable[[str, bytes, int, int], Window]


@dataclass
class MappedWindow:
    """A system region's bytes: its window of the shm object, copied with
    pread / pwrite on the object's descriptor (the module's docstring: why
    not slices of the mapping)."""

    _map: mmap.mmap  # made at register, Triton's check; no copy goes through it
    _start: int  # where the region begins inside the mapping
    _fd: int  # the shm object, open as long as the mapping
    _position: int  # where the region begins inside the object

    def read(self, begin: int, byte_size: int) -> bytes:
        """pread: an object the client shrank since it registered reads short."""
        return _pread(self._fd, byte_size, self._position + begin)

    def write(self, begin: int, data: bytes) -> None:
        """pwrite: an object the client shrank grows again, never faults."""
        _pwrite(self._fd, data, self._position + begin)

    # pread / pwrite release the GIL while the kernel copies: a worker
    # thread's copies are the same calls.
    read_in_thread = read
    write_in_thread = write

    def close(self) -> None:
        fd, self._fd = self._fd, -1  # a copy after close fails (EBADF), never
        try:  # reads a file that reused the number
            self._map.close()
        finally:
            os.close(fd)


def _pread(fd: int, byte_size: int, position: int) -> bytes:
    """`byte_size` bytes of `fd` from `position`, fewer at its end. Linux reads
    at most 2 GiB - 4 KiB per call; only a larger read joins its pieces."""
    data = os.pread(fd, byte_size, position)
    if len(data) == byte_size or not data:
        return data
    pieces = [data]
    got = len(data)
    while got < byte_size and (more := os.pread(fd, byte_size - got, position + got)):
        pieces.append(more)
        got += len(more)
    return b"".join(pieces)


def _pwrite(fd: int, data: bytes, position: int) -> None:
    """All of `data` to `fd` at `position` (pwrite may write part of it)."""
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], position + done)


@dataclass
class Region:
    name: str
    kind: Kind
    byte_size: int
    _window: Window = field(repr=False)
    key: str = ""  # system: the shm key and the window's offset in its object
    offset: int = 0
    device_id: int = 0  # cuda: the device the handle was opened on
    raw_handle: bytes = b""  # cuda: the client's cudaIpcMemHandle_t (the in-place path sends it)
    users: int = 0  # requests holding the region (unregister waits for them)
    unregistered: bool = False

    def read(self, offset: int, byte_size: int) -> bytes:
        self.check(offset, byte_size)
        return self._window.read(offset, byte_size)

    def write(self, offset: int, data: bytes) -> None:
        self.check(offset, len(data))
        self._window.write(offset, data)

    def read_in_thread(self, offset: int, byte_size: int) -> bytes:
        """`read` for a worker thread: the copy leaves the GIL to the event loop."""
        self.check(offset, byte_size)
        return self._window.read_in_thread(offset, byte_size)

    def write_in_thread(self, offset: int, data: bytes) -> None:
        """`write` for a worker thread: the copy leaves the GIL to the event loop."""
        self.check(offset, len(data))
        self._window.write_in_thread(offset, data)

    def check(self, offset: int, byte_size: int) -> None:
        """Triton's bounds rule for a window of this region."""
        if offset < 0 or offset >= self.byte_size:
            raise invalid(f"Invalid offset for shared memory region: '{self.name}'")
        if byte_size < 0 or offset + byte_size > self.byte_size:
            raise invalid(f"Invalid offset + byte size for shared memory region: '{self.name}'")

    def close(self) -> None:
        self._window.close()


class SharedMemory:
    """The gateway's registry of shared-memory regions, system and CUDA."""

    def __init__(self, root: Path = SHM_ROOT, open_cuda: CudaOpener = open_window) -> None:
        self.root = root
        self._open_cuda = open_cuda
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """A system region: `byte_size` bytes at `offset` of /dev/shm/<key>."""
        with self._lock:
            self._check_new(name)
            self._regions[name] = self._map(name, key, offset, byte_size)

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """A CUDA region: the client's allocation behind `raw_handle`, opened on
        `device_id` (refused with Triton's answer where CUDA is unavailable)."""
        with self._lock:
            self._check_new(name)
            window = self._open_cuda(name, raw_handle, device_id, byte_size)
            self._regions[name] = Region(
                name, CUDA, byte_size, window, device_id=device_id, raw_handle=raw_handle
            )

    def _check_new(self, name: str) -> None:
        if name in self._regions:  # of either kind, as in Triton
            raise already_exists(f"shared memory region '{name}' already in manager")

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
            os.close(fd)
            raise invalid(f"failed to register shared memory region '{name}': {exc}") from None
        except BaseException:
            os.close(fd)
            raise
        window = MappedWindow(mapping, offset - start, fd, offset)
        return Region(name, SYSTEM, byte_size, window, key=key, offset=offset)

    def status(self, name: str = "", kind: Kind = SYSTEM) -> list[Region]:
        """The regions of `kind`, or the one named (NOT_FOUND if it is unknown
        or of the other kind, with Triton's messages)."""
        with self._lock:
            if not name:
                return [r for r in self._regions.values() if r.kind == kind]
            region = self._regions.get(name)
        if region is None:
            which = "cuda" if kind == CUDA else "system"
            raise not_found(f"Unable to find {which} shared memory region: '{name}'")
        if region.kind != kind:
            raise not_found(
                f"The region named '{name}' is registered as {_TITLE[region.kind]} shared "
                f"memory, not {_TITLE[kind]} shared memory"
            )
        return [region]

    def unregister(self, name: str = "", kind: Kind = SYSTEM) -> None:
        """One region of `kind`, or all of them with an empty name; an unknown
        name, or one of the other kind, is no error (as Triton). A region still
        used by in-flight requests is closed when they finish. A region whose
        close fails (a CUDA handle cudaIpcCloseMemHandle refuses) stays
        registered, and the answer is Triton's INTERNAL: that close's message
        for one name, the list of the regions left for all of them."""
        with self._lock:
            names = [n for n, r in self._regions.items() if r.kind == kind] if not name else [name]
            failed: dict[str, StageError] = {}  # name -> its close's error; the region stays
            for n in names:
                region = self._regions.get(n)
                if region is None or region.kind != kind:
                    continue
                if region.users == 0:
                    try:
                        region.close()
                    except StageError as exc:  # still open: it stays, as in Triton
                        failed[n] = exc
                        continue
                del self._regions[n]
                region.unregistered = True
        if name and failed:
            raise failed[name]
        if failed:
            listed = "".join(f"{n} ," for n in failed)  # Triton's separator, as it writes it
            # the kind as Triton spells it here: "system" / "cuda"
            raise internal(
                f"Failed to unregister the following {kind} shared memory regions: {listed}"
            )

    def acquire(self, name: str) -> Region:
        """The region a request reads or writes; release() it when the request ends."""
        with self._lock:
            region = self._regions.get(name)
            if region is None:
                raise not_found(f"Unable to find shared memory region: '{name}'")
            region.users += 1
            return region

    def read(self, ref: SharedRef) -> bytes:
        """A request's input bytes in a region (held while it reads)."""
        return self._read(ref, Region.read)

    def read_in_thread(self, ref: SharedRef) -> bytes:
        """`read` for a copy thread: the region is held while it copies (an
        unregister meanwhile closes it after), the GIL left to the loop."""
        return self._read(ref, Region.read_in_thread)

    def _read(self, ref: SharedRef, copy: Callable[[Region, int, int], bytes]) -> bytes:
        region = self.acquire(ref.region)
        try:
            return copy(region, ref.offset, ref.byte_size)
        finally:
            self.release(region)

    def hold(self, region: Region) -> None:
        """One more holder of a region the caller holds (acquire), for a copy
        in a thread that may outlive the request: it release()s it when done."""
        with self._lock:
            region.users += 1

    def release(self, region: Region) -> None:
        with self._lock:
            region.users -= 1
            if region.users == 0 and region.unregistered:
                try:
                    region.close()
                except StageError as exc:  # no client waits on this close: logged
                    log.error("closing an unregistered region failed", extra={"error": exc.message})
