"""Tensor bytes through shared memory between a gateway and a worker on one host.

A gateway writes a large input into its own region and the ScheduleRequest
carries a reference (pb.TensorPart: region, offset, length) instead of the
bytes; the scheduler passes the parts through (a batch lists every
request's parts); the worker maps the gateway's region read-only and reads
the extents (one copy into the batch at most), then checks that no extent
was freed and handed out again meanwhile (`retaken_rows`: the gateway frees
a request's slots when it ends, a cancel included, while a batch holding
them may still be queued; such a request fails CANCELLED, its client is
gone). A worker that cannot map a region refuses the batch with
TENSOR_REGION_NOT_LOCAL and the gateway resends inline. A worker writes a large
output into its own region, tagged with the pid of the gateway that asked;
that gateway copies it into the client's response and frees the slots by
zeroing their tags in the worker's region (stageserve/tensor_slots.py).

Who frees what, so that nothing leaks:
- a gateway's input slots: the gateway itself, when the request ends in any
  way (answer, error, client cancel: a `finally`);
- a worker's output slots: the gateway that receives them, also when its
  request is gone (StreamLink's orphan callback: `release_outputs`); slots
  of a dead gateway, or of an answer lost on the way (a scheduler killed
  between worker and gateway), are reclaimed by the worker when its region
  fills and every SHM_RECLAIM_EVERY_S (dead pid, or older than
  `SHM_LOST_AFTER_S`);
- a dead process's region: unlinked by the next `sweep` of any process of
  the stack (its name carries its pid), or of any stack on the host in the
  same pid namespace (`sweep_dead`, when a process starts).
A full region is back-pressure: the tensor travels inline, as across hosts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from stageserve.errors import unavailable
from stageserve.generated import stageserve_pb2 as pb
from stageserve.settings import StackSettings
from stageserve.telemetry import TENSOR_SLOTS_IN_USE
from stageserve.tensor_region import (
    SHM_DIR,
    TensorRegion,
    pid_alive,
    region_name,
    sweep,
    sweep_dead,
)

log = logging.getLogger(__name__)


class RegionNotLocal(Exception):
    """A reference to a region this process cannot map: its owner runs on
    another host or container (the worker refuses the batch with
    TENSOR_REGION_NOT_LOCAL; the gateway resends it with inline bytes)."""


#: An output slot still tagged this long after it was written lost its answer
#: (a scheduler killed between worker and gateway): an answer reaches its
#: gateway and is copied out within milliseconds of the run. Reclaiming one
#: that was only slow is safe: the gateway checks each extent's generation
#: after copying it and fails that request (UNAVAILABLE) rather than answer
#: bytes that may be another's (`take_outputs`).
SHM_LOST_AFTER_S = 10.0
#: How often a worker reclaims its lost and dead consumers' slots without
#: waiting for its region to fill, so that a lost answer's slots are free
#: again within SHM_LOST_AFTER_S + this (bench.chaos counts them).
SHM_RECLAIM_EVERY_S = 2.0


def host_id() -> str:
    """What decides whether two processes share /dev/shm: the host's name and
    boot id (a reboot changes it), the device of /dev/shm (two containers
    with one hostname and boot id, each with its own tmpfs, differ there) and
    the pid namespace (a pid tags a slot and names a region: only processes
    that see each other's pids can free and sweep them)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    try:
        dev = str(os.stat(SHM_DIR).st_dev)
    except OSError:
        dev = ""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return f"{socket.gethostname()}/{boot}/{dev}/{pidns}"


def stack_id(redis_url: str) -> str:
    """One stack's regions share this prefix: the stack's Redis names it."""
    return hashlib.sha1(redis_url.encode()).hexdigest()[:10]


# ----------------------------------------------------------- peers' regions

_peers: dict[tuple[str, bool], TensorRegion] = {}


def _peer(name: str, writable: bool) -> TensorRegion:
    region = _peers.get((name, writable))
    if region is None:
        region = _peers[(name, writable)] = TensorRegion.open(name, writable)
    return region


def _owned(name: str) -> TensorRegion | None:
    return OWNER.region if OWNER is not None and OWNER.region.name == name else None


def tensor_bytes(t: pb.Tensor) -> bytes | memoryview:
    """A tensor's bytes: `raw`, one extent of a region (no copy), or its
    parts joined (one copy)."""
    if not t.parts:
        return t.raw
    views = [part_bytes(p) for p in t.parts]
    return views[0] if len(views) == 1 else b"".join(views)


def part_bytes(part: pb.TensorPart) -> bytes | memoryview:
    """One part's bytes: its extent of a region (no copy) or its `raw`."""
    if part.HasField("cuda"):
        # a client's device memory: only the worker's in-place path reads it
        # (services/worker/cuda_inplace.py); any other reader has the gateway
        # resend the bytes, as for a region it cannot map
        raise RegionNotLocal("a CUDA shared-memory extent is read on its device only")
    if not part.region:
        return part.raw
    return _region(part.region).extent(part.offset, part.length)


def _region(name: str) -> TensorRegion:
    try:
        return _owned(name) or _peer(name, writable=False)
    except (OSError, ValueError):
        # a worker on another host or container got a reference (the gateway
        # had not seen it join yet: services/gateway/tensor_transport.py)
        raise RegionNotLocal(f"tensor region '{name}' is not on this host") from None


def retaken_rows(request: pb.ExecuteRequest) -> set[int]:
    """The requests of a batch (their indexes) some input extent of which no
    longer carries its generation: freed by the gateway (the request ended)
    and taken by another. Checked after the bytes were read (generations only
    grow, so a change before the read shows too): a request not listed read
    its own bytes."""
    rows = len(request.request_batch_sizes)
    hit: set[int] = set()
    for t in request.inputs:
        _retaken_in(t.parts, rows, hit)
    return hit


def _retaken_in(parts: Sequence[pb.TensorPart], rows: int, hit: set[int]) -> None:
    for i, part in enumerate(parts):
        if not part.region or not part.generation:
            continue
        if _region(part.region).retaken(part.offset, part.length, part.generation):
            # a batch lists one part per request, in order
            hit.update([i] if len(parts) == rows else range(rows))


def materialize(t: pb.Tensor) -> list[pb.TensorPart]:
    """`t`'s bytes into `raw`, its parts dropped and returned (whoever holds
    their slots still frees them)."""
    if not t.parts:
        return []
    raw = bytes(tensor_bytes(t))
    parts = list(t.parts)
    del t.parts[:]
    t.raw = raw
    return parts


def materialize_batch(request: pb.ExecuteRequest) -> set[int]:
    """Turn each input of a batch held in regions into raw bytes (for the
    backends that read `raw`: Python models); the requests whose extents
    were retaken by the time they were copied (`retaken_rows`)."""
    rows = len(request.request_batch_sizes)
    hit: set[int] = set()
    for t in request.inputs:
        _retaken_in(materialize(t), rows, hit)  # checked after the copy
    return hit


def cancel_rows(resp: pb.ExecuteResponse, rows: Iterable[int]) -> None:
    """Fail these requests of an answered batch CANCELLED (their input slots
    were retaken: `retaken_rows`), freeing any output of theirs already
    written into this process's region."""
    for i in rows:
        result = resp.results[i]
        for t in result.outputs:
            for part in t.parts:
                if OWNER is not None and part.region == OWNER.region.name:
                    OWNER.table.free(part.offset // OWNER.table.slot_size, part.length)
        del result.outputs[:]
        result.failure = pb.CANCELLED
        result.message = "the request ended while its batch was queued"


def release_outputs(resp: pb.ScheduleResponse) -> None:
    """Free the worker slots an answer's outputs hold (its request is gone)."""
    for t in resp.outputs:
        _free_parts(t)


def take_outputs(tensors: Iterable[pb.Tensor], keep_raw: bool = True) -> list[bytes | None]:
    """Copy each output held in a worker's region out and free its slots; the
    bytes copied, per tensor in order (None: it was inline). `keep_raw`: also
    into the tensor's `raw`, for a caller that reads the tensors again (a
    cache insert, a trace, a write into a client's region); without it the
    tensor keeps no bytes and one 49 KB copy into protobuf is saved.
    StageError (unavailable) when the worker reclaimed an extent before it
    was copied (its answer took past SHM_LOST_AFTER_S to arrive): those bytes
    may be another answer's; the other extents are freed."""
    tensors = list(tensors)
    taken: list[bytes | None] = []
    for t in tensors:
        if not t.parts:
            taken.append(None)
            continue
        raw = bytes(tensor_bytes(t))
        if any(_retaken(part) for part in t.parts):
            for held in tensors:
                _free_parts(held)
            raise unavailable(
                f"output '{t.name}' was reclaimed from shared memory before it was read"
            )
        _free_parts(t)
        del t.parts[:]
        if keep_raw:
            t.raw = raw
        taken.append(raw)
    return taken


def _retaken(part: pb.TensorPart) -> bool:
    return bool(part.region) and _region(part.region).retaken(
        part.offset, part.length, part.generation
    )


def _free_parts(t: pb.Tensor) -> None:
    """Free the extents `t` holds in peers' regions; one handed out again
    meanwhile (reclaimed: `take_outputs`) is another's now, left alone."""
    for part in t.parts:
        if not part.region:
            continue
        try:
            region = _peer(part.region, writable=True)
        except (OSError, ValueError):  # the owner died and its region was swept
            continue
        assert region.table is not None
        if region.retaken(part.offset, part.length, part.generation):
            continue
        region.table.free(part.offset // region.slot_size, part.length)


# ----------------------------------------------------------- own region


class TensorShm:
    """This process's region and what it puts there."""

    def __init__(self, stack: str, role: str, slots: int, slot_size: int, threshold: int) -> None:
        self.stack = stack
        self.threshold = threshold
        self.host = host_id()
        self.pid = os.getpid()
        sweep(stack)
        sweep_dead()  # other stacks' leftovers on this host (a stack killed whole)
        self.region = TensorRegion.create(region_name(stack, role, self.pid), slots, slot_size)
        assert self.region.table is not None
        self.table = self.region.table

    def _put(self, data: bytes | memoryview, tag: int) -> int | None:
        """`data` in a fresh extent tagged `tag`: its offset; None when the region is full."""
        offset = self._put_with(len(data), tag)
        if offset is not None:
            self.region.data[offset : offset + len(data)] = data
        return offset

    def _put_with(self, nbytes: int, tag: int) -> int | None:
        """A fresh extent for `nbytes` tagged `tag`: its offset; None when the
        region is full even after reclaiming what dead or lost consumers held."""
        start = self.table.alloc(nbytes, tag, time.monotonic_ns())
        if start is None:
            if not self.reclaim_lost():
                return None
            start = self.table.alloc(nbytes, tag, time.monotonic_ns())
            if start is None:
                return None
        return start * self.table.slot_size

    def reclaim_lost(self) -> int:
        """Free the slots of dead consumers and of answers lost on the way
        (tagged for longer than SHM_LOST_AFTER_S); how many were freed."""
        lost_before = time.monotonic_ns() - int(SHM_LOST_AFTER_S * 1e9)
        return self.table.reclaim(lambda pid: not pid_alive(pid), lost_before)

    def _move(self, t: pb.Tensor, tag: int) -> pb.TensorPart | None:
        """A large enough tensor's bytes into the region (its raw then empty,
        its one part the extent); None when it stays inline."""
        if t.datatype == "BYTES" or t.parts:
            return None
        raw = t.raw  # each read of a bytes field copies it: once
        part = self.place(raw, tag)
        if part is None:
            return None
        t.ClearField("raw")
        t.parts.append(part)
        return part

    def place(self, raw: bytes | memoryview, tag: int) -> pb.TensorPart | None:
        """`raw` in a fresh extent tagged `tag`, when it is large enough and
        the region has room: the part that refers to it; None: it stays inline."""
        if len(raw) < self.threshold:
            return None
        offset = self._put(raw, tag)
        if offset is None:
            return None
        return pb.TensorPart(
            region=self.region.name,
            offset=offset,
            length=len(raw),
            generation=self.table.generation(offset // self.table.slot_size),
        )

    # gateway side

    def stage_inputs(self, inputs: Iterable[pb.Tensor]) -> list[pb.TensorPart]:
        """Move each large input into this region (a full region: it stays
        inline); the extents to `release` when the request ends."""
        held = []
        for t in inputs:
            part = self._move(t, self.pid)
            if part is not None:
                held.append(part)
        return held

    def stage_bytes(self, raw: bytes | memoryview, datatype: str) -> pb.TensorPart | None:
        """An input's bytes, before they are in any message, into this region
        (a full region or a small or BYTES tensor: None, it stays inline); the
        extent to `release` when the request ends."""
        return None if datatype == "BYTES" else self.place(raw, self.pid)

    def release(self, held: Iterable[pb.TensorPart]) -> None:
        for part in held:
            self.table.free(part.offset // self.table.slot_size, part.length)

    # worker side

    def consumer(self, request: pb.ExecuteRequest, index: int) -> int:
        """The pid to write request `index`'s large outputs for; 0: inline."""
        if index >= len(request.shm_pids) or request.shm_hosts[index] != self.host:
            return 0
        return int(request.shm_pids[index])

    def put_array(self, t: pb.Tensor, arr: np.ndarray, tag: int) -> bool:
        """Write a numeric output straight from the model's array into this
        region (one copy, where raw bytes and then the region take three):
        `t` gets the extent as its part. False: it stays for raw bytes."""
        if arr.nbytes < self.threshold or arr.dtype.kind not in "biuf" or not _little(arr):
            return False
        offset = self._put_with(arr.nbytes, tag)
        if offset is None:
            return False
        slot = np.frombuffer(self.region.data, np.uint8, arr.nbytes, offset)
        slot[:] = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        t.parts.add(
            region=self.region.name,
            offset=offset,
            length=arr.nbytes,
            generation=self.table.generation(offset // self.table.slot_size),
        )
        return True

    def stage_outputs(self, request: pb.ExecuteRequest, resp: pb.ExecuteResponse) -> None:
        """Move the large outputs of each request whose gateway shares this host
        and asked for shared memory into this region, tagged with its pid."""
        if not request.shm_pids:
            return
        for result, host, pid in zip(
            resp.results, request.shm_hosts, request.shm_pids, strict=False
        ):
            if pid and host == self.host:
                for t in result.outputs:
                    self._move(t, pid)

    def in_use(self) -> int:
        return self.table.in_use()

    def close(self) -> None:
        self.region.unlink()


def _little(arr: np.ndarray) -> bool:
    """In the raw layout's byte order (little-endian) as it is."""
    order = arr.dtype.byteorder
    return order in ("<", "|") or (order == "=" and sys.byteorder == "little")


#: this process's region, when tensor_shm is on (set at startup)
OWNER: TensorShm | None = None


def install(settings: StackSettings, redis_url: str, role: str) -> TensorShm | None:
    """This process's region when the stack's `tensor_shm` is on (None when
    off), its slots in use on /metrics as stageserve_tensor_slots_in_use{stage}
    (0 when off: the series exists either way, as dashboards and
    deploy/smoke.py expect of every catalogued metric)."""
    global OWNER
    if not settings.tensor_shm:
        TENSOR_SLOTS_IN_USE.labels(role).set(0)
        return None
    try:
        OWNER = TensorShm(
            stack_id(redis_url),
            role,
            settings.tensor_shm_slots,
            settings.tensor_shm_slot_bytes,
            settings.tensor_shm_min_bytes,
        )
    except OSError as exc:  # /dev/shm full or missing: inline bytes, as across hosts
        log.warning("no tensor region: tensors travel inline", extra={"error": str(exc)})
        TENSOR_SLOTS_IN_USE.labels(role).set(0)
        return None
    TENSOR_SLOTS_IN_USE.labels(role).set_function(OWNER.in_use)
    return OWNER


def uninstall() -> None:
    global OWNER
    if OWNER is not None:
        OWNER.close()
        OWNER = None
