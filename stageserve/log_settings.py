"""Triton's log settings (the LogSettings RPC, GET/POST /v2/logging): the value,
an update parsed as Triton 2.51 parses it on each front, and its form in Redis.

Pure: no I/O, no grpc import (a Python model's stub process imports this
through stageserve/logs.py, possibly in an environment of its own).

What Triton 2.51 does, checked against it (bench/log_settings_diff.py keeps the
record):

* The settings are read in a fixed order, whatever the request's order:
  log_file, log_info, log_warning, log_error, log_verbose_level, log_format.
  Each is applied as soon as it parses; the first bad one ends the request
  with its error, and what came before it stays applied.
* log_file present (HTTP: not null; gRPC: any value) refuses the request:
  "log file location can not be updated through network protocol",
  UNIMPLEMENTED / HTTP 501, nothing applied.
* A setting of the wrong type: gRPC INVALID_ARGUMENT "expect boolean for
  'log_info'" ("expect int32 ..." for the level, "expect string ..." for the
  format); HTTP 500 with RapidJSON's words ("attempt to access JSON
  non-boolean as boolean", ...). HTTP null skips a setting; unknown keys and a
  body that is not a JSON object are ignored.
* log_format other than "default" or "ISO8601" (case matters): gRPC
  INVALID_ARGUMENT "invalid argument for log_format, got: xml", HTTP 503
  "invalid argument for --log_format, got: xml".
* log_verbose_level is an unsigned integer (HTTP: up to 2^64 - 1, not a float)
  that Triton stores as a C int: the low 32 bits, and a value that is negative
  as an int32 reads back as 0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

DEFAULT_FORMAT = "default"
ISO8601 = "ISO8601"
FORMATS = (DEFAULT_FORMAT, ISO8601)
SWITCHES = ("log_info", "log_warning", "log_error")
# The order Triton reads (and applies) the settings of one request in.
ORDER = (*SWITCHES, "log_verbose_level", "log_format")

FILE_REFUSED = "log file location can not be updated through network protocol"

Value = bool | int | str


@dataclass(frozen=True)
class LogSettings:
    """One process's log settings, with Triton's names and defaults."""

    log_file: str = ""
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: str = DEFAULT_FORMAT

    def updated(self, changes: Mapping[str, Value]) -> LogSettings:
        return replace(self, **changes)  # type: ignore[arg-type]

    def as_json(self) -> dict[str, Value]:
        """Triton's GET /v2/logging document (its key order)."""
        return asdict(self)


@dataclass(frozen=True)
class LogSettingsError(Exception):
    """A refused update: its gRPC status code (by name, as grpc.StatusCode
    spells it), its HTTP status, and Triton's message."""

    code: str
    http: int
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Update:
    """A request's outcome: the settings applied (in ORDER), then the error
    that ended it, if one did."""

    changes: dict[str, Value]
    error: LogSettingsError | None = None


def int32_level(value: int) -> int:
    """Triton's verbose level of an unsigned request value: the low 32 bits
    as a C int, negative read back as 0."""
    low = value & 0xFFFFFFFF
    return 0 if low >= 2**31 else low


# ----------------------------------------------------------------------- HTTP

_JSON_TYPE_ERRORS = {
    bool: "attempt to access JSON non-boolean as boolean",
    int: "attempt to access JSON non-unsigned-integer as unsigned-integer",
    str: "attempt to access JSON non-string as string",
}


def _first_key_wins(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """RapidJSON's FindMember finds a repeated key's first value."""
    doc: dict[str, Any] = {}
    for key, value in pairs:
        doc.setdefault(key, value)
    return doc


def parse_http(body: bytes) -> Update:
    """POST /v2/logging's body, as Triton 2.51 reads it."""
    if not body.strip():
        return Update({}, _http_parse_error("The document is empty.", 0))
    try:
        doc = json.loads(body, object_pairs_hook=_first_key_wins)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return Update({}, _http_parse_error("Invalid value.", getattr(exc, "pos", 0)))
    if not isinstance(doc, dict):
        return Update({})
    if doc.get("log_file") is not None:
        return Update({}, LogSettingsError("UNIMPLEMENTED", 501, FILE_REFUSED))
    changes: dict[str, Value] = {}
    for key in ORDER:
        value = doc.get(key)
        if value is None:
            continue
        kind = _kind(key)
        if not _json_is(value, kind):
            return Update(changes, LogSettingsError("INTERNAL", 500, _JSON_TYPE_ERRORS[kind]))
        if key == "log_format" and value not in FORMATS:
            message = f"invalid argument for --log_format, got: {value}"
            return Update(changes, LogSettingsError("UNAVAILABLE", 503, message))
        changes[key] = int32_level(value) if key == "log_verbose_level" else value
    return Update(changes)


def _http_parse_error(what: str, offset: int) -> LogSettingsError:
    message = f"failed to parse the request JSON buffer: {what} at {offset}"
    return LogSettingsError("INTERNAL", 500, message)


def _json_is(value: object, kind: type) -> bool:
    if kind is int:  # RapidJSON's IsUint64: an integer literal in [0, 2^64)
        return type(value) is int and 0 <= value < 2**64
    return type(value) is kind


def _kind(key: str) -> type:
    return bool if key in SWITCHES else int if key == "log_verbose_level" else str


# ----------------------------------------------------------------------- gRPC


class SettingValue(Protocol):
    """LogSettingsRequest.SettingValue: a oneof of bool_param, uint32_param,
    string_param."""

    def WhichOneof(self, group: str) -> str | None: ...


_GRPC_FIELDS = {bool: "bool_param", int: "uint32_param", str: "string_param"}
_GRPC_NAMES = {bool: "boolean", int: "int32", str: "string"}


def parse_grpc(settings: Mapping[str, SettingValue]) -> Update:
    """LogSettingsRequest.settings, as Triton 2.51 reads it."""
    if "log_file" in settings:
        return Update({}, LogSettingsError("UNIMPLEMENTED", 501, FILE_REFUSED))
    changes: dict[str, Value] = {}
    for key in ORDER:
        if key not in settings:
            continue
        kind = _kind(key)
        setting = settings[key]
        field = _GRPC_FIELDS[kind]
        if setting.WhichOneof("parameter_choice") != field:
            message = f"expect {_GRPC_NAMES[kind]} for '{key}'"
            return Update(changes, LogSettingsError("INVALID_ARGUMENT", 400, message))
        value = getattr(setting, field)
        if key == "log_format" and value not in FORMATS:
            message = f"invalid argument for log_format, got: {value}"
            return Update(changes, LogSettingsError("INVALID_ARGUMENT", 400, message))
        changes[key] = int32_level(value) if key == "log_verbose_level" else value
    return Update(changes)


def grpc_fields(settings: LogSettings) -> dict[str, tuple[str, Value]]:
    """LogSettingsResponse.settings: name -> (its oneof field, value)."""
    return {key: (_GRPC_FIELDS[type(value)], value) for key, value in settings.as_json().items()}


# ---------------------------------------------------------------------- Redis


def to_redis(changes: Mapping[str, Value]) -> dict[str, str]:
    """Changed settings as fields of the stack's settings hash (one field
    each, so that updates of different settings from two gateways merge)."""
    return {key: json.dumps(value) for key, value in changes.items() if key in ORDER}


def from_redis(base: LogSettings, fields: Mapping[Any, Any]) -> LogSettings:
    """`base` (this process's flags) with the stack's settings hash over it; a
    field this version does not know or cannot read is left out."""
    changes: dict[str, Value] = {}
    for raw_key, raw_value in fields.items():  # bytes from Redis
        key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
        if key not in ORDER:
            continue
        try:
            value: Any = json.loads(raw_value)
        except ValueError:
            continue
        kind = _kind(key)
        if not _json_is(value, kind) or (key == "log_format" and value not in FORMATS):
            continue
        changes[key] = int32_level(value) if kind is int else value
    return base.updated(changes)
