"""Sequence routing, backlog and implicit state in Redis.

Per sequence (one correlation id of one model version), with expiry tied to
max_sequence_idle_microseconds:

- a hash with its slot, the latest value of every implicit state and that
  state's shape (states with variable dims change shape as they grow);
- a list, the backlog: one entry per request of the sequence that some
  scheduler has accepted and not yet finished, in arrival order. Only the
  entry at the head may execute, and it stays there until its results are
  committed, so one request of a sequence runs at a time, in order, across
  any number of schedulers.

Entries are "{owner}:{n}"; each scheduler's owner key lives while it
heartbeats. A scheduler that dies leaves entries whose owner key expires, and
the next claim drops them, so its in-flight request cannot block the
sequence. The request payloads stay with the scheduler that accepted them:
the reply channel is that scheduler's stream to the gateway, which ends with
it, so a payload copy in Redis could only be replayed against a client that
was already answered UNAVAILABLE (and would apply its state change twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from redis.typing import EncodableT

from services.scheduler import sequence_lua
from stageserve import redis_keys as keys
from stageserve.script_lane import ScriptLane

CLAIMED, UNKNOWN, WAIT = 0, 1, 2


def sequence_key(sequence_id: int, sequence_id_str: str) -> str:
    return f"s:{sequence_id_str}" if sequence_id_str else f"i:{sequence_id}"


@dataclass
class Claim:
    status: int
    slot: int = -1
    states: dict[str, bytes] = field(default_factory=dict)  # state output name -> raw
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # its shape, if kept


@dataclass
class Placement:
    """Where a model's previous owner ran continuing sequences: their slots
    (cid -> slot) and its instance pins (group -> instance, instance_pins.py)."""

    slots: dict[str, int]
    pins: dict[int, str]


@dataclass(frozen=True)
class PinsSnapshot:
    """The owner's instance pins (group -> instance) as a commit carries
    them; `serial` orders one owner's snapshots."""

    serial: int
    pins: dict[int, str]


@dataclass(slots=True)
class StateUpdate:
    raw: bytes
    shape: tuple[int, ...]


@dataclass(slots=True)
class Finished:
    """One executed (or failed) request, for commit: its new states (None:
    unchanged). `held`: it ran with states the scheduler kept
    (sequence_cache.py), unclaimed and unlisted (entry ""); a held START
    row also records the sequence's `slot`."""

    cid: str
    entry: str
    end: bool
    states: dict[str, StateUpdate] | None = None
    start: bool = False
    held: bool = False
    slot: int = -1


@dataclass
class Committed:
    """`fenced`: the model's term had changed, nothing was kept; `lost`:
    the held rows (indexes) whose sequence Redis no longer has."""

    fenced: bool = False
    lost: list[int] = field(default_factory=list)


class SequenceStore:
    def __init__(
        self,
        redis: aioredis.Redis,
        model: str,
        version: int,
        idle_ms: int,
        owner_ttl_ms: int,
        lane: ScriptLane | None = None,
    ) -> None:
        """`owner_ttl_ms`: SchedulerSettings.sequence_owner_ttl_ms; the owner key
        is renewed three times within it, so it outlives a few missed heartbeats
        and a dead scheduler's entries block their sequences at most this long.
        `lane`: the scheduler's pipelined connection for the scripts, which
        run on every batch (stageserve/script_lane.py); None: redis-py's."""
        self.redis = redis
        self.model = model
        self.owner_ttl_ms = owner_ttl_ms
        self.heartbeat_s = owner_ttl_ms / 3000
        self.prefix = keys.sequence_prefix(model, version)
        self.owner = uuid.uuid4().hex
        self.owner_key = keys.sequence_owner(self.owner)
        self.idle_ms = max(1, idle_ms)
        self._counter = itertools.count()
        script = lane.script if lane is not None else redis.register_script
        self._claim = script(sequence_lua.SEQUENCE_CLAIM)
        self._list = script(sequence_lua.SEQUENCE_LIST)
        self._commit = script(sequence_lua.SEQUENCE_COMMIT)
        self._heartbeat: asyncio.Task | None = None
        # Sequences this scheduler claimed and did not see end: cid -> when
        # they idle out (monotonic s). Redis restarting empty loses their
        # state; remembering them here lets the next request be told so
        # instead of the generic "no START" error (see lost()).
        self._open: dict[str, float] = {}

    def new_entry(self) -> str:
        return f"{self.owner}:{next(self._counter)}"

    # ------------------------------------------------------------ liveness

    async def _beat(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # Redis down: enqueue reports it
                await self.redis.set(self.owner_key, "1", px=self.owner_ttl_ms)
            await asyncio.sleep(self.heartbeat_s)

    def close(self) -> None:
        """Stop heartbeating; our leftover entries then expire with the owner key."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None

    # ------------------------------------------------------------ backlog

    async def enqueue(self, items: list[tuple[str, str, bool]]) -> Placement | None:
        """Append (cid, entry, place) to their sequences' backlogs, in this
        order; with any `place`, also where those sequences ran before."""
        if self._heartbeat is None:
            self._heartbeat = asyncio.create_task(self._beat())
        args: list[EncodableT] = [self.prefix, self.owner_key, self.owner_ttl_ms, self.idle_ms]
        for cid, entry, place in items:
            args += (cid, entry, "1" if place else "0")
        reply = await self._list(args=args)
        if not isinstance(reply, list):
            return None
        fields, slots = reply
        wanted = [cid for cid, _, place in items if place]
        pins = {  # the group fields (the others say who wrote them)
            int(k): v.decode()
            for k, v in zip(fields[::2], fields[1::2], strict=True)
            if k.isdigit()
        }
        return Placement(
            {cid: int(slot) for cid, slot in zip(wanted, slots, strict=True) if int(slot) >= 0},
            pins,
        )

    async def forget(self, items: list[tuple[str, str]]) -> None:
        """Drop entries whose requests left without executing."""
        items = [(cid, entry) for cid, entry in items if entry]  # "": never listed
        if not items:
            return
        # Redis down: nothing to do, the entries go with the backlog's idle expiry.
        with contextlib.suppress(RedisError):
            async with self.redis.pipeline(transaction=False) as pipe:
                for cid, entry in items:
                    pipe.lrem(self.prefix + cid + ":q", 1, entry)
                await pipe.execute()

    async def backlog(self, cid: str) -> list[str]:
        # No decode_responses on our clients: Redis answers bytes.
        entries = cast("list[bytes]", await self.redis.lrange(self.prefix + cid + ":q", 0, -1))
        return [e.decode() for e in entries]

    # ------------------------------------------------------------ execution

    async def claim(self, items: list[tuple[str, str, bool, int]]) -> list[Claim]:
        """Claim (cid, entry, start, slot) for one execution each: CLAIMED when
        the entry heads its backlog, WAIT when an earlier request of the
        sequence (here or at another scheduler) has not finished, UNKNOWN when
        a non-START request finds no sequence (its entry is dropped)."""
        args: list[str | int] = [
            self.prefix,
            keys.sequence_owner(""),
            self.owner,
            self.owner_ttl_ms,
            self.idle_ms,
        ]
        for cid, entry, start, slot in items:
            args += [cid, entry, "1" if start else "0", slot]
        out = []
        now = time.monotonic()
        for (cid, _, _, _), (status, slot, fields) in zip(
            items, await self._claim(args=args), strict=True
        ):
            claim = Claim(int(status), int(slot))
            if claim.status == CLAIMED:
                self.opened(cid, now)
            for k, v in zip(fields[::2], fields[1::2], strict=True):
                name = k.decode()
                if name.startswith("st:"):
                    claim.states[name[3:]] = v
                elif name.startswith("sh:"):
                    text = v.decode()
                    claim.shapes[name[3:]] = tuple(int(d) for d in text.split(",") if d)
            out.append(claim)
        return out

    async def commit(
        self,
        rows: Sequence[Finished],
        term: str | None = None,
        pins: PinsSnapshot | None = None,
    ) -> Committed:
        """After execution: keep each sequence's new states, end the ones
        whose request had END, and take each listed entry off its backlog so
        the sequence's next request may run. `term` (the model's shard term
        when the batch formed; None without sharding): keep nothing when
        the model has another term now. `pins`: the owner's instance pins
        for the model's next owner, when they changed (None: unchanged); a
        snapshot older than the last one this store wrote is not written."""
        args: list[EncodableT] = [self.prefix, self.idle_ms, keys.SHARD_TERMS, self.model]
        args.append(term or "")
        if pins is None:
            args.append(-1)
        else:
            args += (len(pins.pins), self.owner, pins.serial)
            for group, instance in pins.pins.items():
                args += (group, instance)
        for row in rows:
            if row.end:
                self._open.pop(row.cid, None)
            kept = row.states if row.states and not row.end else {}
            flags = ("e" if row.end else "") + ("s" if row.start else "")
            flags += "h" if row.held else ""
            args += (row.cid, row.entry, flags, row.slot, len(kept))
            for name, update in kept.items():
                args += (name, update.raw, ",".join(str(d) for d in update.shape))
        reply = await self._commit(args=args)
        if int(reply[0]):
            return Committed(fenced=True)
        return Committed(lost=[int(i) - 1 for i in reply[1:]])

    def opened(self, cid: str, now: float) -> None:
        """`cid` ran here and did not end (see lost())."""
        self._open[cid] = now + self.idle_ms / 1000

    def lost(self, cid: str) -> bool:
        """Whether an UNKNOWN claim of `cid` means its state was lost: this
        scheduler ran the sequence, it neither ended nor idled out, and Redis
        no longer has it. (Forgets the sequence either way.)"""
        deadline = self._open.pop(cid, None)
        now = time.monotonic()
        if len(self._open) > 10_000:  # ended elsewhere or abandoned: bounded memory
            self._open = {c: d for c, d in self._open.items() if d > now}
        return deadline is not None and deadline > now
