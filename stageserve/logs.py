"""Structured logs: one JSON object per line on stderr (or --log-file), tagged
with the service, filtered and formatted by Triton's log settings.

Triton's settings onto Python logging (stageserve/log_settings.py holds the value):

* log_error, log_warning, log_info switch ERROR (and CRITICAL), WARNING and
  INFO records on or off, each on its own, as Triton's do.
* log_verbose_level N lets through the verbose records of level 1..N. A
  verbose record of level n is a Python record at level DEBUG + 1 - n: DEBUG
  (10) is level 1, 9 is level 2, and so on down to 1 (level 10). A library's
  DEBUG record (a logger outside StageServe's packages) is one level deeper:
  grpc logs a line per RPC at DEBUG, which would bury level 1's.
* log_format "default" is this JSON line; "ISO8601" is Triton's ISO8601
  layout, ``2026-11-26T08:04:04Z I 1234 service logger:12] message``, with
  the record's extra fields as JSON after the message.

The root logger's level is kept at the lowest level that can pass, so a
disabled debug call costs what it always did (logging's cached level check);
the handler's filter decides the rest.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stageserve.log_settings import ISO8601, LogSettings

if TYPE_CHECKING:
    from stageserve.log_follow import LogFollower

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None)))
# Python's level for each Triton verbose level: DEBUG is 1, DEBUG - 1 is 2, ...
MAX_VERBOSE = logging.DEBUG
_OFF = logging.CRITICAL + 1
# Loggers whose DEBUG is verbose level 1; a library's is level 2.
OUR_PACKAGES = frozenset({"stageserve", "services", "bench", "__main__"})
# What a stage hands the processes it starts (stageserve/log_follow.py).
FOLLOW_ENV = "STAGESERVE_LOG_FOLLOW"


def verbose_level_of(levelno: int) -> int:
    """The Triton verbose level of a record below INFO (DEBUG is 1)."""
    return logging.DEBUG + 1 - levelno


def python_level(verbose: int) -> int:
    """The lowest Python level a verbose level lets through."""
    return logging.DEBUG + 1 - min(verbose, MAX_VERBOSE)


def _extras(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in vars(record).items() if k not in _RESERVED}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(_extras(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class Iso8601Formatter(logging.Formatter):
    """Triton's --log-format=ISO8601 line: time, level letter (I, W, E; V for
    verbose), pid, where, message."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created))
        letter = "V" if record.levelno < logging.INFO else record.levelname[:1]
        line = (
            f"{stamp} {letter} {record.process} {self.service} {record.name}:{record.lineno}] "
            f"{record.getMessage()}"
        )
        extras = _extras(record)
        if extras:
            line += " " + json.dumps(extras, default=str)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class SettingsFilter(logging.Filter):
    """Lets a record through when the current settings enable its level."""

    def __init__(self, settings: LogSettings) -> None:
        super().__init__()
        self.settings = settings

    def filter(self, record: logging.LogRecord) -> bool:
        return enabled(self.settings, record.levelno, record.name)


def ours(logger: str) -> bool:
    return logger.split(".", 1)[0] in OUR_PACKAGES


def enabled(settings: LogSettings, levelno: int, logger: str = "stageserve") -> bool:
    """Whether `settings` let a record of `levelno` from `logger` through."""
    if levelno >= logging.ERROR:
        return settings.log_error
    if levelno >= logging.WARNING:
        return settings.log_warning
    if levelno >= logging.INFO:
        return settings.log_info
    level = verbose_level_of(levelno) + (0 if ours(logger) else 1)
    return level <= settings.log_verbose_level


def root_level(settings: LogSettings) -> int:
    """The lowest Python level `settings` lets through (above CRITICAL: none)."""
    if settings.log_verbose_level > 0:
        return python_level(settings.log_verbose_level)
    for level, on in (
        (logging.INFO, settings.log_info),
        (logging.WARNING, settings.log_warning),
        (logging.ERROR, settings.log_error),
    ):
        if on:
            return level
    return _OFF


@dataclass
class _Logging:
    service: str
    handler: logging.Handler
    filter: SettingsFilter


_state: _Logging | None = None


def settings_from_verbose(verbose: int) -> LogSettings:
    return LogSettings(log_verbose_level=max(verbose, 0))


def setup_logging(service: str, verbose: int = 0, settings: LogSettings | None = None) -> None:
    """Log this process's records as `service`, under `settings` (default:
    Triton's defaults with log_verbose_level `verbose`): to settings.log_file
    (appended to) when it names one, else stderr."""
    global _state
    if settings is None:
        settings = settings_from_verbose(verbose)
    handler: logging.Handler
    if settings.log_file:
        handler = logging.FileHandler(settings.log_file, encoding="utf-8")
    else:
        handler = logging.StreamHandler(sys.stderr)
    level_filter = SettingsFilter(settings)
    handler.addFilter(level_filter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    _state = _Logging(service, handler, level_filter)
    _apply(_state, settings)


def current_settings() -> LogSettings:
    """The settings this process logs under (Triton's defaults before setup)."""
    return _state.filter.settings if _state is not None else LogSettings()


# Applies in this process, counted: a reader of the stack's settings (the
# follower thread, log_follow.py) notes the count before it reads Redis and
# applies what it read only if nothing was applied meanwhile. Else a read
# taken just before this gateway's own update could land after it and undo
# it until the next message (seen: a LogSettings GET right after a SET
# answered the settings before it, under load).
_applied = 0
_apply_lock = threading.Lock()


def applied_count() -> int:
    """How many times settings were applied in this process so far."""
    return _applied


def apply_log_settings(settings: LogSettings, *, unless_applied_since: int | None = None) -> bool:
    """Log under `settings` from now on (its log_file is not changed: Triton
    does not change it at run time either); False when nothing changed, or
    when `unless_applied_since` (an applied_count()) is no longer the count."""
    global _applied
    with _apply_lock:
        if unless_applied_since is not None and unless_applied_since != _applied:
            return False
        _applied += 1
        if _state is None or settings == _state.filter.settings:
            return False
        _apply(_state, settings)
        return True


def _apply(state: _Logging, settings: LogSettings) -> None:
    settings = settings.updated({"log_file": state.filter.settings.log_file})
    formatter = Iso8601Formatter if settings.log_format == ISO8601 else JsonFormatter
    state.handler.setFormatter(formatter(state.service))
    state.filter.settings = settings
    logging.getLogger().setLevel(root_level(settings))


def setup_child_logging(
    service: str, environ: Mapping[str, str] = os.environ
) -> LogFollower | None:
    """Logging for a process a stage started (a Python model's stub): under
    the stage's startup settings, following the stack's, as FOLLOW_ENV hands
    them on; without it, Triton's defaults on stderr. An environment without
    the Redis client (a model's own) keeps the stage's startup settings.
    The follower, when there is one."""
    raw = environ.get(FOLLOW_ENV)
    if raw is None:
        setup_logging(service)
        return None
    handed = json.loads(raw)
    base = LogSettings(**handed["settings"])
    setup_logging(service, settings=base)
    try:
        from stageserve.log_follow import LogFollower
    except ImportError as exc:
        logging.getLogger(__name__).warning(
            "not following the stack's log settings", extra={"error": str(exc)}
        )
        return None
    follower = LogFollower(handed["redis"], base)
    follower.start()
    return follower
