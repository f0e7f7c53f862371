"""The gateway's model lifecycle: loading, unloading and draining models.

Loading a model = reading its config from the repository, publishing it in
Redis (workers load instances, schedulers read batching settings) and
waiting until every selected version has a registered instance or a load
error. Unloading stops new requests, lets in-flight ones finish, then
withdraws the model. The entries it produces go to the ModelTable
(model_table.py), which every request reads; this module is used by the
repository RPCs, the poller and startup, never per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from pathlib import Path

import grpc
from redis.exceptions import RedisError

from services.gateway.model_table import (
    LOADING,
    READY,
    UNAVAILABLE,
    UNLOADING,
    ModelEntry,
    ModelTable,
)
from stageserve.autocomplete_options import TRITON_DEFAULT, AutoComplete
from stageserve.config import ModelSpec
from stageserve.errors import StageError, invalid, load_failed, unavailable
from stageserve.generated import stageserve_pb2 as pb
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.instance_ids import generation_of
from stageserve.model_state import LoadedModel, ModelStateStore, files_digest
from stageserve.names import check_model_name, model_name_problem
from stageserve.repository import RepositoryModel, model_names, read_model
from stageserve.settings import GatewaySettings
from stageserve.telemetry import TRITON, model_labels

log = logging.getLogger(__name__)

# A load override's temporary folder, as messages show it (no server path leaks).
OVERRIDE_ROOT = "<load override>"


class ModelLifecycle:
    """Loads, unloads and drains the models of one repository into `table`."""

    def __init__(
        self,
        table: ModelTable,
        repository: Path,
        state: ModelStateStore,
        ratelimiter: pb_grpc.RateLimiterStub,
        settings: GatewaySettings,
        autocomplete: AutoComplete = TRITON_DEFAULT,
    ) -> None:
        self.table = table
        self.autocomplete = autocomplete
        self.config_name = settings.model_config_name
        self.repository = repository
        self.state = state
        self.ratelimiter = ratelimiter
        self.control_mode = settings.model_control_mode
        self.load_timeout_s = settings.load_timeout_s
        self.load_retries = max(0, settings.model_load_retry_count)
        self._locks: dict[str, asyncio.Lock] = {}
        self._drains: set[asyncio.Task] = set()

    @property
    def entries(self) -> dict[str, ModelEntry]:
        """The table's entries: one set here is what the next request resolves."""
        return self.table.entries

    # ------------------------------------------------------------ load/unload

    async def startup(self, load: list[str]) -> list[str]:
        """Load the startup models; returns their names. A model another gateway
        already published with the same config is adopted as it is (no reload),
        so gateways can be added or restarted while the others serve."""
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
        return wanted

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
            raise StageError(
                err.code, err.message.replace(str(root), OVERRIDE_ROOT), reason=err.reason
            ) from None
        finally:
            if (entry := self.entries.get(name)) is not None:
                entry.reason = entry.reason.replace(str(root), OVERRIDE_ROOT)
                entry.reasons = {
                    v: r.replace(str(root), OVERRIDE_ROOT) for v, r in entry.reasons.items()
                }

    async def _load(self, name: str, chain: tuple[str, ...], adopt: bool, root: Path) -> bool:
        check_model_name(name)
        if model_spec := await self._ensemble_spec(root, name):
            # Composing models first (outside this model's lock): Triton loads
            # an ensemble's models with it.
            for step in model_spec.steps:
                why = await self._ensure_ready(step.model, (*chain, name), adopt)
                if why is not None:
                    self.entries[name] = ModelEntry(
                        name, reason=f"composing model '{step.model}' not ready: {why}"
                    )
                    # INVALID_ARGUMENT, as Triton 2.51 answers "ensemble ... contains
                    # models that are not available"
                    raise invalid(f"failed to load '{name}': composing model '{step.model}': {why}")
        async with self._lock(name):
            model = await self._read(root, name)
            old = self.entries.get(name)
            if (
                not adopt
                and model.ok
                and old is not None
                and old.ready_versions()
                and old.fingerprint == model.fingerprint
                and old.spec is not None  # always set on a loaded entry
                and all(self.table.ready_now(step.model) for step in old.spec.steps)
            ):
                return False
            if not model.ok:
                in_repository = model.path.is_dir()
                if in_repository and (old is None or not old.ready_versions()):
                    self.entries[name] = ModelEntry(name, reason=model.error or "")
                log.error("model load failed", extra={"model": name, "reason": model.error})
                # Triton 2.51 fails a Python model's version load on an unusable
                # execution environment: INVALID_ARGUMENT "load failed for model".
                refused = invalid if model.env_unusable else load_failed
                raise refused(f"failed to load '{name}': {model.error}")
            assert model.config is not None and model.spec is not None
            start = time.monotonic()
            published = await self.state.get(name)
            # In poll mode the files decide: a gateway adopts another's load of
            # the folder it reads, and reloads what changed since.
            files = files_digest(model.fingerprint)
            draining = () if model.spec.steps else removed_versions(old, published, model.versions)
            reasons: dict[int, str]
            for attempt in range(1 + self.load_retries):
                # A retry (Triton's --model-load-retry-count) publishes the load
                # again: a new generation the workers load afresh.
                generation = await self.state.publish_loaded(
                    model.config,
                    model.versions,
                    model.path,
                    files,
                    adopt=adopt and attempt == 0,
                    match_files=self.control_mode == "poll",
                    draining=draining,
                )
                if model.spec.steps:  # an ensemble has no instances of its own
                    versions, reasons = dict.fromkeys(model.versions, READY), {}
                    break
                versions, reasons = await self._await_instances(name, model.versions, generation)
                if not reasons or attempt == self.load_retries:
                    break
                log.warning(
                    "model load failed; trying again",
                    extra={"model": name, "reasons": reasons, "attempt": attempt + 1},
                )
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
                raise invalid(versions_failed(name, reasons))
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
                raise invalid(versions_failed(name, reasons))
            return True

    async def _ensemble_spec(self, root: Path, name: str) -> ModelSpec | None:
        model = await self._read(root, name)
        return model.spec if model.spec is not None and model.spec.steps else None

    async def _read(self, root: Path, name: str) -> RepositoryModel:
        """read_model in a thread: it reads the model's files and may run
        auto-complete, which for a Python model starts a process and may
        unpack its execution environment (seconds for a large archive), and
        the gateway's event loop keeps answering every other RPC meanwhile."""
        return await asyncio.to_thread(read_model, root, name, self.autocomplete, self.config_name)

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
            await self.table.wait_idle(name)
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
        left = await self.table.wait_versions_idle(name, versions, self.load_timeout_s)
        try:
            ended = await self.state.end_draining(name, generation)
        except RedisError as exc:  # the next load or an unload publishes the record anew
            log.error("ending a version drain failed", extra={"model": name, "error": str(exc)})
            return
        log.info(
            "removed versions drained",
            extra={"model": name, "versions": versions, "unfinished": left, "published": ended},
        )

    def forget(self, name: str) -> None:
        """A model gone from the repository leaves the index (unload it first)."""
        self.entries.pop(name, None)

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


def versions_failed(name: str, reasons: Mapping[int, str]) -> str:
    """Triton 2.51's answer (INVALID_ARGUMENT) to a load whose versions all
    failed to come up, each version's reason in its frame (checked with a
    Python model whose initialize raises: "load failed for model 'm':
    version 1 is at UNAVAILABLE state: Internal: RuntimeError: ...;")."""
    return f"load failed for model '{name}': " + "".join(
        f"version {v} is at UNAVAILABLE state: {reason};\n" for v, reason in sorted(reasons.items())
    )


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
