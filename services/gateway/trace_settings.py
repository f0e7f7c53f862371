"""The gateway's side of Triton's trace settings: the TraceSetting RPC and
/v2/trace/setting answers (read and written in the stack's Redis,
stageserve/trace_store.py), and a local copy of the settings that decides,
per request, whether it is traced.

Untraced requests cost one attribute read (`active`, False while no setting
samples anything); the copy follows every gateway's updates through the
events channel (and a reload every `refresh_s`, should a message be missed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from services.gateway.request_trace import FileRequestTrace, RequestTrace
from services.gateway.trace_file import TraceFile
from stageserve import redis_keys as keys
from stageserve import task_stop
from stageserve.trace_spans import SpanEmitter
from stageserve.trace_store import TraceStore
from stageserve.tracing import (
    MODE_OPENTELEMETRY,
    Sampler,
    Setting,
    TraceConfig,
    TraceSettingError,
    TraceState,
    parse_update,
    response,
)

log = logging.getLogger(__name__)


class TraceSettings:
    def __init__(self, store: TraceStore, config: TraceConfig, refresh_s: float = 1.0) -> None:
        self.store = store
        self.config = config
        self.refresh_s = refresh_s
        self.active = False  # some setting samples: the hot path checks only this
        self.state: TraceState | None = None
        self._samplers: dict[str, Sampler] = {}  # setting uid -> its sampler here
        self._task: asyncio.Task | None = None
        self._emitter: SpanEmitter | None = None
        self._files: dict[str, TraceFile] = {}  # triton mode: by path

    async def start(self) -> None:
        await self.store.seed(self.config)
        await self.reload()
        self._task = asyncio.create_task(self._follow())

    async def close(self) -> None:
        if self._task is not None:
            await task_stop.stop(self._task)
        if self._emitter is not None:
            await asyncio.to_thread(self._emitter.close)  # exports what is buffered
        for file in self._files.values():
            file.close()

    # ----------------------------------------------------------------- API

    async def get(self, model: str) -> dict[str, list[str]]:
        state = await self._current()
        return response(state.effective(model), state.config)

    async def update(
        self, model: str, settings: Mapping[str, Sequence[str] | None]
    ) -> dict[str, list[str]]:
        """TraceSettingError as Triton refuses the update."""
        state = await self.store.update(model, parse_update(settings))
        self._use(state)
        return response(state.effective(model), state.config)

    # ------------------------------------------------------------ sampling

    def sampler(self, model: str) -> Sampler | None:
        """The sampler of the setting `model` follows, when it samples at all."""
        state = self.state
        if state is None:
            return None
        setting = state.effective(model)
        return self._samplers.get(setting.uid)

    async def begin(
        self, model: str, version: int, client_traceparent: str, request_id: str, start_ns: int
    ) -> RequestTrace | FileRequestTrace | None:
        """The trace of this request when it is sampled (only called while
        `active`); None when it is not traced."""
        setting = await self.sample(model)
        if setting is None or self.state is None:
            return None
        if self.state.config.mode != MODE_OPENTELEMETRY:
            values = setting.values
            file = self._files.get(values.file)
            if file is None or file.log_frequency != values.log_frequency:
                if file is not None:
                    file.close()
                file = self._files[values.file] = TraceFile(values.file, values.log_frequency)
            return FileRequestTrace(file, model, version, request_id, start_ns, values.level)
        if self._emitter is None:
            self._emitter = SpanEmitter("gateway", self.state.config)
        return RequestTrace(
            self._emitter, model, version, client_traceparent, start_ns, setting.values.level
        )

    async def sample(self, model: str) -> Setting | None:
        """The setting this request is traced under, or None (only called
        while `active`)."""
        sampler = self.sampler(model)
        if sampler is None or not sampler.hit():
            return None
        setting = sampler.setting
        if setting.values.count >= 0 and not await self.store.take(setting.uid):
            return None
        return setting

    # ------------------------------------------------------------- follow

    async def _current(self) -> TraceState:
        state = await self.store.load()
        if state is None:  # Redis lost it: the startup settings again
            await self.store.seed(self.config)
            state = await self.store.load()
        assert state is not None
        return state

    async def reload(self) -> None:
        self._use(await self._current())

    def _use(self, state: TraceState) -> None:
        samplers: dict[str, Sampler] = {}
        mode = state.config.mode
        for setting in state.settings():
            if setting.values.invalid_reason(mode) is not None:
                continue
            kept = self._samplers.get(setting.uid)
            samplers[setting.uid] = kept if kept is not None else Sampler(setting, mode)
        self._samplers = samplers
        self.state = state
        self.active = bool(samplers)

    async def _follow(self) -> None:
        while True:
            events = self.store.redis.pubsub()
            try:
                await events.subscribe(keys.TRACE_EVENTS)
                await self.reload()  # what changed while not subscribed
                while True:
                    await events.get_message(ignore_subscribe_messages=True, timeout=self.refresh_s)
                    await self.reload()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: try again after a period
                log.warning("trace settings: reload failed", extra={"error": repr(exc)})
                await asyncio.sleep(self.refresh_s)
            finally:
                await events.aclose()


__all__ = ["TraceSettings", "TraceSettingError"]
