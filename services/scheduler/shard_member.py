"""One scheduler's membership in the sharded scheduler set.

The scheduler holds a lease in Redis (ss:shard:members, renewed every
`heartbeat_s`, lasting `lease_ms`) and owns the models the map
(ss:shard:owners) gives it. Each heartbeat it compares the map with what
the policy (stageserve/shard_policy.py) says over the live schedulers:

- a model the policy gives it, with no live owner: it takes it;
- a model it owns that the policy gives another: it stops accepting the
  model's requests (they are refused NOT_OWNER, and the gateway resends
  them once the map moved), lets the model's queues drain, then hands the
  model to the new owner in one atomic step. So a model's queue is in one
  scheduler at a time, and a join moves only the models the newcomer wins.

A scheduler that dies stops renewing; once its lease is past (`lease_ms`),
the next heartbeat of any survivor prunes it and takes the models the
policy now gives that survivor. A request for a model this scheduler does
not hold yet (the map has just handed it over, or the model is new) takes
it at once when the policy names this scheduler (`holds`).

Fencing: a scheduler that stalls (SIGSTOP, a long GC or swap pause) past
its lease may find, when it runs again, that a survivor took its models.
Its lease is "fresh" for `lease_ms` from the moment it sent its last
successful renewal (Redis dates the lease from a later instant, so the
local deadline is never the later one). Before a batch runs (ModelQueue's
fence) a stale lease is renewed and the map re-read first (`confirm`); a
model the map now gives another scheduler is dropped (`on_lost`: its queued
requests are refused NOT_OWNER, which gateways resend to the new owner,
so nothing queued here runs here). With Redis unreachable the lease cannot
be renewed, but no other scheduler can take a model either: the scheduler
keeps serving what it owns.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from services.scheduler import shard_lua
from stageserve import redis_keys as keys
from stageserve import task_stop
from stageserve.shard_policy import DEFAULT_POLICY, ShardPolicy
from stageserve.telemetry import SCHEDULER_SHARD_OWNED

log = logging.getLogger(__name__)

_KEYS = [
    keys.SHARD_MEMBERS,
    keys.SHARD_ADDRESSES,
    keys.SHARD_OWNERS,
    keys.SHARD_VERSION,
    keys.SHARD_TERMS,
]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class ShardMember:
    def __init__(
        self,
        redis: aioredis.Redis,
        scheduler_id: str,
        address: str,
        drain: Callable[[str], Awaitable[None]],
        lease_ms: int = 3000,
        heartbeat_s: float = 0.5,
        policy: ShardPolicy = DEFAULT_POLICY,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        """`drain(model)`: returns once no request of `model` is queued or
        executing here (bounded by the caller); called before a release.
        `on_lost(model)`: the map gave a model this scheduler owned to
        another (this scheduler's lease had lapsed); its queue must go."""
        self.redis = redis
        self.id = scheduler_id
        self.address = address
        self.drain = drain
        self.lease_ms = lease_ms
        self.heartbeat_s = heartbeat_s
        self.policy = policy
        self.on_lost = on_lost
        self.fresh_until = 0.0  # time.monotonic() until which the lease surely holds
        self.owned: set[str] = set()  # models whose requests this scheduler accepts
        self.leaving: set[str] = set()  # models being drained before their release
        self.live: list[str] = [scheduler_id]  # live scheduler ids, as last renewed
        # The term (shard_lua.py) of each model owned or leaving, as last read.
        self.terms: dict[str, str] = {}
        self._renew = redis.register_script(shard_lua.RENEW)
        self._take = redis.register_script(shard_lua.TAKE)
        self._release = redis.register_script(shard_lua.RELEASE)
        self._leave = redis.register_script(shard_lua.LEAVE)
        self._claims: dict[str, asyncio.Future[bool]] = {}
        self._task: asyncio.Task[None] | None = None
        self._ticking: asyncio.Future[None] | None = None
        self._moves: set[asyncio.Task[None]] = set()

    def _own(self, model: str) -> None:
        if model not in self.owned:
            self.owned.add(model)
            SCHEDULER_SHARD_OWNED.labels(model).set(1)

    def _disown(self, model: str) -> None:
        if model in self.owned:
            self.owned.discard(model)
            SCHEDULER_SHARD_OWNED.remove(model)

    # The request path ------------------------------------------------------

    def owns(self, model: str) -> bool:
        return model in self.owned

    def term(self, model: str) -> str | None:
        """The model's term while this scheduler owns it (or drains it before
        a hand-over), None otherwise: the token its sequence commits check."""
        if model in self.owned or model in self.leaving:
            return self.terms.get(model)
        return None

    async def holds(self, model: str) -> bool:
        """Whether this scheduler may queue `model`'s request: it owns the
        model, adopts it now (another scheduler handed it here), or takes it
        now (the policy names it and no live scheduler owns it). Concurrent
        calls for one model share one Redis round trip."""
        if model in self.owned:
            return True
        if model in self.leaving:
            return False
        claim = self._claims.get(model)
        if claim is None:
            claim = asyncio.ensure_future(self._claim(model))
            self._claims[model] = claim
            claim.add_done_callback(lambda _: self._claims.pop(model, None))
        return await asyncio.shield(claim)

    async def _claim(self, model: str) -> bool:
        # The policy over this scheduler's last view of the live set decides a
        # take; an adoption needs none (the heir may not have seen the change).
        may_take = "1" if self.policy.owner(model, self.live) == self.id else "0"
        args = [keys.SHARD_EVENTS, self.id, model, may_take, uuid.uuid4().hex]
        term = await self._take(keys=_KEYS, args=args)
        taken = term != 0
        if taken and model not in self.leaving:
            self.terms[model] = _text(term)
            self._own(model)
            log.info("model taken", extra={"model": model, "scheduler": self.id})
        return taken and model in self.owned

    # Fencing ---------------------------------------------------------------

    def fresh(self) -> bool:
        """Whether the lease surely still holds (no Redis, per batch)."""
        return time.monotonic() < self.fresh_until

    async def confirm(self, model: str) -> bool:
        """Whether a batch of `model` may run here: renews a stale lease and
        re-reads the map first (one shared heartbeat for concurrent callers)."""
        if not self.fresh():
            try:
                await self.beat()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: nobody else can take it either
                log.warning("shard lease unconfirmed", extra={"error": str(exc)})
                return True
        return model in self.owned or model in self.leaving

    # Heartbeat -------------------------------------------------------------

    async def beat(self) -> None:
        """One tick; a tick already running is shared, never run twice at once."""
        if self._ticking is None or self._ticking.done():
            self._ticking = asyncio.ensure_future(self.tick())
        await asyncio.shield(self._ticking)

    async def join(self) -> None:
        """Register (the first lease) and take this scheduler's models."""
        await self.beat()
        self._task = asyncio.create_task(self._beat_forever())

    async def _beat_forever(self) -> None:
        failures = 0
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self.beat()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: keep serving what we own
                if not failures:
                    log.warning("shard heartbeat failed", extra={"error": str(exc)})
                failures += 1

    async def tick(self) -> None:
        """Renew the lease, then take and release to follow the policy. The
        lease counts as fresh only once the map is applied, so no batch runs
        on the strength of the renewal for a model the map moved away."""
        sent = time.monotonic()
        live = await self._renew(
            keys=_KEYS, args=[keys.SHARD_EVENTS, self.id, self.address, self.lease_ms]
        )
        self.live = sorted(_text(s) for s in live)
        async with self.redis.pipeline(transaction=True) as pipe:  # one snapshot
            pipe.hkeys(keys.MODELS)
            pipe.hgetall(keys.SHARD_OWNERS)
            pipe.hgetall(keys.SHARD_TERMS)
            models_raw, owners_raw, terms_raw = await pipe.execute()
        owners = {_text(m): _text(s) for m, s in owners_raw.items()}
        terms = {_text(m): _text(t) for m, t in terms_raw.items()}
        models = {_text(m) for m in models_raw} | set(owners)
        # The map is the truth: a model another scheduler took (this one's
        # lease lapsed while it stalled) is no longer accepted here.
        for model in list(self.owned):
            heir = owners.get(model)
            if heir == self.id:
                continue
            self._disown(model)
            self.terms.pop(model, None)
            # Another scheduler holds it: what is queued here goes there. No
            # owner at all (Redis restarted empty): it is taken back below.
            if heir is not None and self.on_lost is not None:
                log.warning("model lost", extra={"model": model, "to": heir})
                self.on_lost(model)
        for model in sorted(models):
            target = self.policy.owner(model, self.live)
            owner = owners.get(model)
            if owner == self.id and target != self.id:
                if model not in self.leaving:
                    self._move(model, target)
            elif owner == self.id and model not in self.leaving:
                self._own(model)
            if owner == self.id:  # a term that changed (or went) since last read
                self._set_term(model, terms.get(model))
            elif target == self.id and (owner is None or owner not in self.live):
                await self.holds(model)
        self.fresh_until = sent + self.lease_ms / 1000

    def _set_term(self, model: str, term: str | None) -> None:
        if term is None:
            self.terms.pop(model, None)
        else:
            self.terms[model] = term

    def _move(self, model: str, heir: str | None) -> None:
        self.leaving.add(model)
        self._disown(model)
        task = asyncio.create_task(self._hand_over(model, heir))
        self._moves.add(task)
        task.add_done_callback(self._moves.discard)

    async def _hand_over(self, model: str, heir: str | None) -> None:
        try:
            await self.drain(model)
            args = [keys.SHARD_EVENTS, self.id, model, heir or "", uuid.uuid4().hex]
            await self._release(keys=_KEYS, args=args)
            log.info("model handed over", extra={"model": model, "to": heir or "nobody"})
        finally:
            self.leaving.discard(model)
            if model not in self.owned:
                self.terms.pop(model, None)

    async def leave(self) -> None:
        """A clean stop: hand every model to its next owner, then drop the lease."""
        if self._task is not None:
            await task_stop.stop(self._task)
        others = [s for s in self.live if s != self.id]
        self.live = others  # takes nothing back from here on
        for model in sorted(self.owned):
            self._move(model, self.policy.owner(model, others))
        if self._moves:
            await asyncio.gather(*self._moves, return_exceptions=True)
        await self._leave(keys=_KEYS, args=[keys.SHARD_EVENTS, self.id])
