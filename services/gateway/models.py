"""The gateway's view of the model repository: what is loaded and ready.

Loading a model = reading its config from the repository, publishing it in
Redis (workers load instances, schedulers read batching settings) and
waiting until every selected version has a registered instance or a load
error. Unloading stops new requests, lets in-flight ones finish, then
withdraws the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from redis.exceptions import RedisError

from stageserve.autocomplete_options import TRITON_DEFAULT, AutoComplete
from stageserve.config import ModelSpec
from stageserve.errors import StageError, invalid, not_found, unavailable
from stageserve.generated import model_config_pb2 as mc
from stageserve.generated import stageserve_pb2 as pb
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.instance_ids import generation_of
from stageserve.model_state import LoadedModel, ModelStateStore, files_digest
from stageserve.names import check_model_name, model_name_problem, parse_version, printable
from stageserve.repository import model_names, read_model
from stageserve.settings import GATEWAY
from stageserve.telemetry import TRITON, model_labels

log = logging.getLogger(__name__)

# A load override's temporary folder, as messages show it (no server path leaks).
OVERRIDE_ROOT = "<load override>"

READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"


@dataclass
class ModelEntry:
    name: str
    versions: dict[int, str] = field(default_factory=dict)  # version -> state
    reasons: dict[int, str] = field(default_factory=dict)
    reason: str = ""  # model-level reason (config error, unloaded)
    config: mc.ModelConfig | None = None
    spec: ModelSpec | None = None
    generation: int = 0
    unloaded: bool = False  # by request: not counted by server readiness
    fingerprint: tuple = ()  # of the model folder when loaded (repository.fingerprint)
    path: Path | None = None  # the folder published to workers (an override's, or the repository's)

    def ready_versions(self) -> list[int]:
        return sorted(v for v, s in self.versions.items() if s == READY)


class ModelManager:
    def __init__(
        self,
        repository: Path,
        state: ModelStateStore,
        ratelimiter: pb_grpc.RateLimiterStub,
        control_mode: str = "none",
        load_timeout_s: float = GATEWAY.load_timeout_s,
        autocomplete: AutoComplete = TRITON_DEFAULT,
    ) -> None:
        self.autocomplete = autocomplete
        self.repository = repository
        self.state = state
        self.ratelimiter = ratelimiter
        self.control_mode = control_mode
        self.load_timeout_s = load_timeout_s
        self.entries: dict[str, ModelEntry] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._in_flight: dict[str, int] = {}
        self._version_in_flight: dict[tuple[str, int], int] = {}
        self._idle: dict[str, asyncio.Event] = {}
        self._drains: set[asyncio.Task] = set()

    # ----------------------------------------------------------------- lookup

    def resolve(self, name: str, version: str) -> tuple[ModelEntry, int]:
        """The entry and version a request addresses, or Triton's error.

        Once per request: the name is escaped for a message (printable, 0.6-1.5
        us) only on the error paths."""
        entry = self.entries.get(name)
        if entry is None or not entry.versions:
            shown = printable(name)  # as messages show it (a 64 KiB name would not fit a trailer)
            if entry is not None and entry.reason:
                raise unavailable(
                    f"Request for unknown model: '{shown}' is not ready: {entry.reason}"
                )
            raise not_found(f"Request for unknown model: '{shown}' is not found")
        v = parse_version(version)
        if v is not None:
            state = entry.versions.get(v)
            if state is None:
                raise not_found(
                    f"Request for unknown model: '{printable(name)}' version {v} is not found"
                )
            if state != READY:
                reason = "" if entry.unloaded else entry.reasons.get(v, "")
                raise unavailable(
                    f"Request for unknown model: '{printable(name)}' version {v} is not at "
                    f"ready state" + (f": {reason}" if reason else "")
                )
            return entry, v
        ready = entry.ready_versions()
        if not ready:
            reason = "" if entry.unloaded else entry.reason or "; ".join(entry.reasons.values())
            # Triton answers NOT_FOUND here (2.51, bench/triton_diff.py)
            raise not_found(
                f"Request for unknown model: '{printable(name)}' has no available versions"
                + (f": {reason}" if reason else "")
            )
        return entry, ready[-1]

    def is_ready(self, name: str, version: str) -> bool:
        """False for what is not ready; INVALID_ARGUMENT for a version Triton refuses."""
        parse_version(version)
        try:
            self.resolve(name, version)
        except StageError:
            return False
        return True

    def all_ready(self) -> bool:
        return all(
            e.ready_versions() for e in self.entries.values() if e.versions and not e.unloaded
        )

    # ------------------------------------------------------------ load/unload

    async def startup(self, load: list[str]) -> None:
        """Load the startup models. A model another gateway already published with
        the same config is adopted as it is (no reload), so gateways can be
        added or restarted while the others serve."""
        names = model_names(self.repository)
        wanted = names if self.control_mode in ("none", "poll") or "*" in load else load
        # Models loaded through the API before this gateway (re)started are
        # still published: take them over too, or a restarted gateway would
        # forget them while the workers keep hosting them.
        wanted = [
            *wanted,
            *(n for n in await self.state.loaded() if n in names and n not in wanted),
        ]
        results = await asyncio.gather(
            *(self.load(name, adopt=True) for name in wanted), return_exceptions=True
        )
        for name, result in zip(wanted, results, strict=True):
            # A StageError was logged where it arose (and is the model's reason);
            # anything else would otherwise vanish here, leaving the model
            # unknown with no trace (seen: a ListInstances error at start).
            if isinstance(result, BaseException) and not isinstance(result, StageError):
                log.error(
                    "startup model load failed",
                    extra={"model": name, "error": f"{type(result).__name__}: {result}"},
                )

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def is_busy(self, name: str) -> bool:
        """A load or unload of the model is under way."""
        return name in self._locks and self._locks[name].locked()

    async def _ensure_ready(
        self, name: str, chain: tuple[str, ...], adopt: bool = False
    ) -> str | None:
        """An ensemble's composing model: load it unless it is ready (or being
        loaded, then wait for that). Returns why it is not ready, or None."""
        if name in chain:
            return f"ensemble cycle: {' -> '.join((*chain, name))}"
        entry = self.entries.get(name)
        if entry is None or not entry.ready_versions():
            if self._lock(name).locked():
                async with self._lock(name):
                    pass
            entry = self.entries.get(name)
            if entry is None or not entry.ready_versions():
                try:
                    await self.load(name, chain, adopt)
                except StageError as err:
                    return err.message
        return None

    async def load(
        self, name: str, chain: tuple[str, ...] = (), adopt: bool = False, root: Path | None = None
    ) -> bool:
        """(Re)load a model; raises StageError when it cannot become ready. Returns
        False when the model was ready and nothing in its folder changed: as in
        Triton, that load is a no-op (statistics go on). `root`: a repository
        holding this load's overridden copy of the model (services/gateway/overrides.py);
        its temporary path is shown as OVERRIDE_ROOT in messages and reasons."""
        if root is None or root == self.repository:
            return await self._load(name, chain, adopt, self.repository)
        try:
            return await self._load(name, chain, adopt, root)
        except StageError as err:
            raise StageError(err.code, err.message.replace(str(root), OVERRIDE_ROOT)) from None
        finally:
            if (entry := self.entries.get(name)) is not None:
                entry.reason = entry.reason.replace(str(root), OVERRIDE_ROOT)
                entry.reasons = {
                    v: r.replace(str(root), OVERRIDE_ROOT) for v, r in entry.reasons.items()
                }

    async def _load(self, name: str, chain: tuple[str, ...], adopt: bool, root: Path) -> bool:
        check_model_name(name)
        if model_spec := self._ensemble_spec(root, name):
            # Composing models first (outside this model's lock): Triton loads
            # an ensemble's models with it.
            for step in model_spec.steps:
                why = await self._ensure_ready(step.model, (*chain, name), adopt)
                if why is not None:
                    self.entries[name] = ModelEntry(
                        name, reason=f"composing model '{step.model}' not ready: {why}"
                    )
                    raise unavailable(
                        f"failed to load '{name}': composing model '{step.model}': {why}"
                    )
        async with self._lock(name):
            model = read_model(root, name, self.autocomplete)
            old = self.entries.get(name)
            if (
                not adopt
                and model.ok
                and old is not None
                and old.ready_versions()
                and old.fingerprint == model.fingerprint
                and old.spec is not None  # always set on a loaded entry
                and all(self._ready_now(step.model) for step in old.spec.steps)
            ):
                return False
            if not model.ok:
                in_repository = model.path.is_dir()
                if in_repository and (old is None or not old.ready_versions()):
                    self.entries[name] = ModelEntry(name, reason=model.error or "")
                log.error("model load failed", extra={"model": name, "reason": model.error})
                raise invalid(f"failed to load '{name}': {model.error}")
            assert model.config is not None and model.spec is not None
            start = time.monotonic()
            published = await self.state.get(name)
            # In poll mode the files decide: a gateway adopts another's load of
            # the folder it reads, and reloads what changed since.
            files = files_digest(model.fingerprint)
            draining = () if model.spec.steps else removed_versions(old, published, model.versions)
            generation = await self.state.publish_loaded(
                model.config,
                model.versions,
                model.path,
                files,
                adopt=adopt,
                match_files=self.control_mode == "poll",
                draining=draining,
            )
            reasons: dict[int, str]
            if model.spec.steps:  # an ensemble has no instances of its own
                versions, reasons = dict.fromkeys(model.versions, READY), {}
            else:
                versions, reasons = await self._await_instances(name, model.versions, generation)
            entry = ModelEntry(
                name,
                versions=versions,
                reasons=reasons,
                config=model.config,
                spec=model.spec,
                generation=generation,
                fingerprint=model.fingerprint,
                path=model.path,
            )
            if not entry.ready_versions() and old is not None and old.ready_versions():
                # A failed reload keeps the loaded versions serving, as in Triton,
                # and their record goes back to Redis for the other stages.
                restored = (
                    published is not None
                    and published.generation == old.generation
                    and await self.state.restore(published, generation)
                )
                log.error(
                    "model reload failed; previous load keeps serving",
                    extra={"model": name, "reasons": reasons, "record_restored": restored},
                )
                raise unavailable(f"failed to load '{name}': " + "; ".join(reasons.values()))
            self.entries[name] = entry
            # Only the gateway that published the reload ends its drain: one that
            # adopted it (poll mode, startup) would end it as soon as its own
            # requests finished, cutting the publisher's short.
            if draining and (published is None or generation != published.generation):
                task = asyncio.create_task(self._drain(name, generation, draining))
                self._drains.add(task)
                task.add_done_callback(self._drains.discard)
            seconds = time.monotonic() - start
            for v in entry.ready_versions():
                TRITON.set("nv_model_load_duration_secs", model_labels(name, v), seconds)
            log.info(
                "model load finished",
                extra={
                    "model": name,
                    "versions": versions,
                    "seconds": round(time.monotonic() - start, 3),
                },
            )
            if not entry.ready_versions():
                raise unavailable(f"failed to load '{name}': " + "; ".join(reasons.values()))
            return True

    def _ready_now(self, name: str) -> bool:
        entry = self.entries.get(name)
        return entry is not None and bool(entry.ready_versions())

    def _ensemble_spec(self, root: Path, name: str) -> ModelSpec | None:
        model = read_model(root, name, self.autocomplete)
        return model.spec if model.spec is not None and model.spec.steps else None

    async def _await_instances(
        self, name: str, versions: tuple[int, ...], generation: int
    ) -> tuple[dict[int, str], dict[int, str]]:
        """Wait until each version has an instance of this generation (instance ids
        carry it: .../<version>/g<generation>/<group>/<index>) or a load error."""
        deadline = time.monotonic() + self.load_timeout_s
        while True:
            try:
                errors = await self.state.load_errors(name)
                resp = await self.ratelimiter.ListInstances(
                    pb.ListInstancesRequest(model=name), timeout=10
                )
            except (grpc.aio.AioRpcError, RedisError) as exc:
                # A rate limiter or Redis that is briefly unreachable (restarting,
                # or slow on a loaded machine) does not fail the load: ask again
                # until the load timeout.
                if time.monotonic() > deadline:
                    raise unavailable(
                        f"failed to load '{name}': instances unknown: {type(exc).__name__}"
                    ) from None
                log.warning(
                    "waiting for instances: lookup failed, retrying",
                    extra={"model": name, "error": type(exc).__name__},
                )
                await asyncio.sleep(0.2)
                continue
            have = {i.version for i in resp.instances if generation_of(i.instance_id) == generation}
            states = {v: READY if v in have else LOADING for v in versions}
            reasons: dict[int, str] = {}
            for v in versions:
                if states[v] != READY and v in errors:
                    states[v] = UNAVAILABLE
                    reasons[v] = errors[v]
            if LOADING not in states.values():
                return states, reasons
            if time.monotonic() > deadline:
                for v, s in states.items():
                    if s == LOADING:
                        states[v] = UNAVAILABLE
                        reasons[v] = f"no worker loaded an instance within {self.load_timeout_s}s"
                return states, reasons
            await asyncio.sleep(0.05)

    async def unload(self, name: str, dependents: bool = False) -> None:
        """Triton's unload: a model that is not loaded (or cannot exist) is no error;
        ensembles using the model go down with it; with `dependents`, an
        ensemble's composing models are unloaded too."""
        if model_name_problem(name) is not None:
            return
        entry = self.entries.get(name)
        steps = [s.model for s in entry.spec.steps] if entry and entry.spec else []
        await self._unload_with_users(name)
        if dependents:
            for step in dict.fromkeys(steps):
                await self.unload(step)

    async def _unload_with_users(self, name: str, chain: tuple[str, ...] = ()) -> None:
        await self._unload_one(name)
        for user, e in list(self.entries.items()):
            uses = e.spec is not None and name in {step.model for step in e.spec.steps}
            if uses and user not in chain and e.ready_versions():
                await self._unload_with_users(user, (*chain, name))

    async def _unload_one(self, name: str) -> None:
        async with self._lock(name):
            entry = self.entries.get(name)
            if entry is None or not entry.ready_versions():
                return
            # Stop admitting, let in-flight requests finish, then withdraw.
            for v in entry.versions:
                entry.versions[v] = UNLOADING
            idle = self._idle.setdefault(name, asyncio.Event())
            while self._in_flight.get(name, 0):
                idle.clear()
                await idle.wait()
            await self.state.publish_unloaded(name)
            self.entries[name] = ModelEntry(
                name,
                versions=dict.fromkeys(entry.versions, UNAVAILABLE),
                reasons=dict.fromkeys(entry.versions, "unloaded"),
                reason="unloaded",
                unloaded=True,
            )
            log.info("model unloaded", extra={"model": name})

    async def _drain(self, name: str, generation: int, versions: tuple[int, ...]) -> None:
        """Once this gateway's requests for the versions a reload removed have
        finished (or after the load timeout, so a stuck request cannot keep
        them hosted for ever), publish the record without them: workers then
        unload their instances. Requests another gateway admitted are not
        counted here (each gateway counts its own)."""
        idle = self._idle.setdefault(name, asyncio.Event())
        deadline = time.monotonic() + self.load_timeout_s
        while (left := sum(self._version_in_flight.get((name, v), 0) for v in versions)) and (
            remaining := deadline - time.monotonic()
        ) > 0:
            idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(idle.wait(), remaining)
        try:
            ended = await self.state.end_draining(name, generation)
        except RedisError as exc:  # the next load or an unload publishes the record anew
            log.error("ending a version drain failed", extra={"model": name, "error": str(exc)})
            return
        log.info(
            "removed versions drained",
            extra={"model": name, "versions": versions, "unfinished": left, "published": ended},
        )

    # ------------------------------------------------------------- in-flight

    # Counted per model name and per version, not per entry: a reload replaces
    # the entry while requests admitted under the old one are still running
    # (an unload waits for the name's, a removed version's drain for its own).

    def in_flight(self, name: str) -> int:
        """Requests to model `name` between begin() and end()."""
        return self._in_flight.get(name, 0)

    def begin(self, entry: ModelEntry, version: int) -> None:
        self._in_flight[entry.name] = self._in_flight.get(entry.name, 0) + 1
        key = (entry.name, version)
        self._version_in_flight[key] = self._version_in_flight.get(key, 0) + 1

    def end(self, entry: ModelEntry, version: int) -> None:
        key = (entry.name, version)
        if not (left := self._version_in_flight[key] - 1):
            del self._version_in_flight[key]
        else:
            self._version_in_flight[key] = left
        total = self._in_flight[entry.name] = self._in_flight[entry.name] - 1
        if (total == 0 or left == 0) and entry.name in self._idle:
            self._idle[entry.name].set()

    # ------------------------------------------------------------------ index

    def index(self) -> list[tuple[str, str, str, str]]:
        """(name, version, state, reason) for every model in the repository."""
        rows = []
        for name in model_names(self.repository):
            entry = self.entries.get(name)
            if entry is None:  # never loaded: Triton lists it without a state
                rows.append((name, "", "", ""))
            elif not entry.versions:
                rows.append((name, "", "UNAVAILABLE", entry.reason))
            else:
                for v, s in sorted(entry.versions.items()):
                    rows.append((name, str(v), s, entry.reasons.get(v, "")))
        return rows


def removed_versions(
    old: ModelEntry | None, published: LoadedModel | None, versions: tuple[int, ...]
) -> tuple[int, ...]:
    """The versions a (re)load drops that may still have admitted requests: the
    old entry's ready ones it does not keep (all of them, not only those with
    requests in flight now: the old entry admits until the new one replaces
    it), and those the published record still drains (a reload during a drain
    must not cut it short)."""
    was = (*(old.ready_versions() if old else ()), *(published.draining if published else ()))
    return tuple(sorted({v for v in was if v not in versions}))
