"""Triton's trace settings, as pure data: the startup `--trace-config`, the
TraceSetting update rules (per-model settings that inherit unspecified fields
from the global one, a cleared field falling back, a cleared global field
back to its startup value), value parsing with Triton 2.51's messages, and
the response both fronts answer.

The rules are Triton's TraceManager (server src/tracer.cc): a setting is a
value per field plus whether each field was *specified* (set by an update
rather than inherited). Updating the global setting re-derives every model
setting that inherits some field; a model setting with nothing specified is
dropped (the model follows the global setting again). A setting may only be
stored when it is valid (level not OFF, rate not 0, a file in triton mode,
count not 0) or when it turns tracing off. Sampling: every `rate`-th request
of a setting is traced while its count (-1: unlimited) lasts.

Answers recorded from Triton 2.51 (bench/trace_diff.py keeps them as a diff
test): numbers parse as C's stoi (leading digits, sign, spaces; "5abc" is 5,
"0x10" is 0) and rate / log_frequency wrap as uint32 ("-5" is 4294967291);
unknown level names are ignored (with none known, the level stays);
`trace_mode` and unknown keys are ignored; `trace_file` cannot be changed
(UNIMPLEMENTED).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MODE_TRITON = "triton"
MODE_OPENTELEMETRY = "opentelemetry"
LEVELS = ("TIMESTAMPS", "TENSORS")  # the order Triton lists them in
FIELDS = ("trace_level", "trace_rate", "trace_count", "log_frequency", "trace_file")
UINT32 = 1 << 32
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
# Triton 2.51's OpenTelemetry batch span processor defaults (shown by GET in that mode)
OTEL_DEFAULTS = {
    "bsp_max_queue_size": "2048",
    "bsp_schedule_delay": "5000",
    "bsp_max_export_batch_size": "512",
}


class TraceSettingError(Exception):
    """A refused update: `unimplemented` ones are UNIMPLEMENTED (HTTP 501),
    the rest INVALID_ARGUMENT (HTTP 400), as Triton answers them."""

    def __init__(self, message: str, unimplemented: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.unimplemented = unimplemented


class TraceConfigError(ValueError):
    """A `--trace-config` argument that does not parse."""


@dataclass(frozen=True)
class Values:
    level: tuple[str, ...] = ()  # empty: OFF
    rate: int = 1000
    count: int = -1
    log_frequency: int = 0
    file: str = ""

    def invalid_reason(self, mode: str) -> str | None:
        """Why this setting samples nothing ("" when only its count ran
        out), or None when it samples."""
        if not self.level:
            return "tracing is disabled"
        if self.rate == 0:
            return "sample rate must be non-zero"
        if mode == MODE_TRITON and not self.file:
            return "trace file name is not given"
        if self.count == 0:
            return ""
        return None


@dataclass(frozen=True)
class Setting:
    values: Values
    specified: frozenset[str] = frozenset()
    uid: str = ""  # names this setting's count and sample counter while it lives


@dataclass(frozen=True)
class TraceConfig:
    """What `--trace-config` sets at startup: the global default, the mode and
    the mode's own options (OpenTelemetry's url, resource, ...)."""

    values: Values = Values()
    mode: str = MODE_TRITON
    options: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def url(self) -> str:
        return (self.options.get("url") or ("http://localhost:4318/v1/traces",))[0]

    def resources(self) -> dict[str, str]:
        out = {}
        for item in self.options.get("resource", ()):
            key, _, value = item.partition("=")
            out[key] = value
        return out


# ------------------------------------------------------------------ --trace-config

_GLOBAL_KEYS = {"rate", "level", "count", "mode", "log-frequency", "file"}


def parse_trace_config(args: Sequence[str]) -> TraceConfig:
    """Triton's `--trace-config [<mode>,]<setting>=<value>`, repeatable:
    `mode=triton|opentelemetry`, `rate=`, `level=OFF|TIMESTAMPS|TENSORS`
    (repeat for several), `count=`, `triton,file=`, `triton,log-frequency=`,
    `opentelemetry,url=`, `opentelemetry,resource=key=value`, ..."""
    values = Values()
    mode = MODE_TRITON
    levels: list[str] = []
    options: dict[str, list[str]] = {}
    for arg in args:
        section, _, rest = arg.partition(",")
        if not rest or "=" in section:
            section, rest = "", arg
        key, eq, value = rest.partition("=")
        if not eq or not key:
            raise TraceConfigError(
                f"--trace-config expects [<mode>,]<setting>=<value>, got {arg!r}"
            )
        if section not in ("", MODE_TRITON, MODE_OPENTELEMETRY):
            raise TraceConfigError(f"--trace-config: unknown trace mode {section!r}")
        if section == MODE_OPENTELEMETRY:
            scheme, sep, _ = value.partition("://")
            if key == "url" and sep and scheme.lower() not in ("http", "https", "grpc"):
                raise TraceConfigError(
                    f"--trace-config: the OTLP url's scheme must be http, https or grpc, "
                    f"got {value!r}"
                )
            options.setdefault(key, []).append(value)
            continue
        if key not in _GLOBAL_KEYS:
            raise TraceConfigError(f"--trace-config: unknown setting {key!r} in {arg!r}")
        if key == "mode":
            if value not in (MODE_TRITON, MODE_OPENTELEMETRY):
                raise TraceConfigError(f"--trace-config: unknown trace mode {value!r}")
            mode = value
        elif key == "level":
            name = value.upper()
            if name not in ("OFF", *LEVELS):
                raise TraceConfigError(f"--trace-config: unknown trace level {value!r}")
            levels = [] if name == "OFF" else [*levels, name]
        elif key == "file":
            values = dataclasses.replace(values, file=value)
        else:
            number = _config_int(key, value)
            name = {"rate": "rate", "count": "count", "log-frequency": "log_frequency"}[key]
            change: dict[str, Any] = {name: number}
            values = dataclasses.replace(values, **change)
    level = tuple(n for n in LEVELS if n in levels)
    values = dataclasses.replace(values, level=level)
    return TraceConfig(values, mode, {k: tuple(v) for k, v in options.items()})


def _config_int(key: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise TraceConfigError(f"--trace-config: {key} must be an integer, got {value!r}") from None
    low = -1 if key == "count" else 0
    high = INT32_MAX if key == "count" else UINT32 - 1
    if not low <= number <= high:
        raise TraceConfigError(f"--trace-config: {key} must be in [{low}, {high}], got {number}")
    return number


# ------------------------------------------------------------------ updates

_STOI = re.compile(r"\s*([+-]?\d+)")


def _stoi(key: str, text: str) -> int:
    """C's std::stoi, as Triton parses setting values."""
    match = _STOI.match(text)
    if match is None:
        raise TraceSettingError(f"Unable to parse '{key}', got: {text}")
    number = int(match.group(1))
    if not INT32_MIN <= number <= INT32_MAX:
        low, high = ("-1", str(INT32_MAX)) if key == "trace_count" else ("0", str(UINT32 - 1))
        raise TraceSettingError(
            f"Unable to parse '{key}', value is out of range [ {low}, {high} ], got: {text}"
        )
    return number


def _one(key: str, values: Sequence[str]) -> str:
    if len(values) != 1:
        raise TraceSettingError(f"expect only 1 value for '{key}'")
    return values[0]


@dataclass(frozen=True)
class Update:
    """One TraceSetting request: the fields it sets and the ones it clears."""

    values: Mapping[str, Any] = field(default_factory=dict)  # Values field name -> value
    cleared: frozenset[str] = frozenset()  # Values field names


_FIELD_OF = {
    "trace_level": "level",
    "trace_rate": "rate",
    "trace_count": "count",
    "log_frequency": "log_frequency",
    "trace_file": "file",
}


def parse_update(settings: Mapping[str, Sequence[str] | None]) -> Update:
    """A request's settings (None or an empty list: clear the field) as an
    Update; TraceSettingError with Triton's message for a bad value."""
    values: dict[str, Any] = {}
    cleared: set[str] = set()
    for key, raw in settings.items():
        name = _FIELD_OF.get(key)
        if name is None:
            continue  # trace_mode and unknown keys: ignored, as Triton does
        if name == "file":
            raise TraceSettingError(
                "trace file location can not be updated through network protocol",
                unimplemented=True,
            )
        if not raw:
            cleared.add(name)
            continue
        if name == "level":
            if "OFF" in raw:
                if len(raw) != 1:
                    raise TraceSettingError("Expect only one trace level 'OFF' is specified")
                values[name] = ()
            elif known := tuple(n for n in LEVELS if n in raw):
                values[name] = known
            # names Triton does not know leave the level as it was
        elif name == "count":
            number = _stoi(key, _one(key, raw))
            if number < -1:
                raise TraceSettingError(
                    f"Unable to parse 'trace_count'. Expecting value >= -1, got: {raw[0]}"
                )
            values[name] = number
        else:
            values[name] = _stoi(key, _one(key, raw)) % UINT32
    return Update(values, frozenset(cleared))


def derive(current: Setting | None, fallback: Setting, update: Update, uid: str = "") -> Setting:
    """The setting after `update`: every field from `fallback` unless
    specified (set now, or set before and not cleared now)."""
    merged: dict[str, Any] = {}
    specified = set()
    for name in _FIELD_OF.values():
        if name in update.cleared:
            continue
        if name in update.values:
            merged[name] = update.values[name]
            specified.add(name)
        elif current is not None and name in current.specified:
            merged[name] = getattr(current.values, name)
            specified.add(name)
    values = dataclasses.replace(fallback.values, **merged)
    return Setting(values, frozenset(specified), uid)


def check_storable(setting: Setting, mode: str) -> None:
    """Triton stores an invalid setting only when it turns tracing off."""
    reason = setting.values.invalid_reason(mode)
    if reason is not None and setting.values.level:
        raise TraceSettingError(f"Attempting to set invalid trace setting :{reason}")


@dataclass(frozen=True)
class TraceState:
    """Every trace setting of the stack: startup default, global, per model.
    A model without its own setting follows the global one."""

    config: TraceConfig
    global_: Setting
    models: Mapping[str, Setting] = field(default_factory=dict)

    @classmethod
    def initial(cls, config: TraceConfig, uid: str = "global") -> TraceState:
        return cls(config, Setting(config.values, frozenset(), uid))

    def effective(self, model: str) -> Setting:
        return self.models.get(model) or self.global_

    def apply(self, model: str, update: Update, new_uid: Iterable[str]) -> TraceState:
        """The state after one update (global when `model` is empty); each
        setting created takes the next uid of `new_uid`."""
        uids = iter(new_uid)
        mode = self.config.mode
        models = dict(self.models)
        if model:
            setting = derive(models.get(model), self.global_, update, next(uids))
            if not setting.specified:
                models.pop(model, None)
                return dataclasses.replace(self, models=models)
            check_storable(setting, mode)
            models[model] = setting
            return dataclasses.replace(self, models=models)
        default = Setting(self.config.values)
        global_ = derive(self.global_, default, update, next(uids))
        check_storable(global_, mode)
        for name, current in self.models.items():
            if len(current.specified) == len(FIELDS):
                continue  # follows nothing of the global setting
            setting = derive(current, global_, Update(), next(uids))
            check_storable(setting, mode)
            models[name] = setting
        return dataclasses.replace(self, global_=global_, models=models)

    # ---------------------------------------------------------------- storage

    def to_json(self) -> dict[str, Any]:
        return {
            "config": {
                "values": dataclasses.asdict(self.config.values),
                "mode": self.config.mode,
                "options": {k: list(v) for k, v in self.config.options.items()},
            },
            "global": _setting_json(self.global_),
            "models": {name: _setting_json(s) for name, s in self.models.items()},
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> TraceState:
        c = doc["config"]
        config = TraceConfig(
            _values(c["values"]), c["mode"], {k: tuple(v) for k, v in c["options"].items()}
        )
        models = {name: _setting(s) for name, s in doc["models"].items()}
        return cls(config, _setting(doc["global"]), models)

    def with_counts(self, counts: Mapping[str, int]) -> TraceState:
        """The state with each setting's remaining count (kept apart, as
        sampling decrements it)."""

        def counted(s: Setting) -> Setting:
            if s.uid not in counts:
                return s
            return dataclasses.replace(s, values=dataclasses.replace(s.values, count=counts[s.uid]))

        models = {name: counted(s) for name, s in self.models.items()}
        return dataclasses.replace(self, global_=counted(self.global_), models=models)

    def settings(self) -> list[Setting]:
        return [self.global_, *self.models.values()]


def _setting_json(s: Setting) -> dict[str, Any]:
    return {"values": dataclasses.asdict(s.values), "specified": sorted(s.specified), "uid": s.uid}


def _values(doc: Mapping[str, Any]) -> Values:
    return Values(tuple(doc["level"]), doc["rate"], doc["count"], doc["log_frequency"], doc["file"])


def _setting(doc: Mapping[str, Any]) -> Setting:
    return Setting(_values(doc["values"]), frozenset(doc["specified"]), doc["uid"])


# ------------------------------------------------------------------ answers


def response(setting: Setting, config: TraceConfig) -> dict[str, list[str]]:
    """The settings a GET or an update answers, as Triton 2.51 lists them:
    triton mode names the file and log frequency, opentelemetry mode its options."""
    v = setting.values
    out = {
        "trace_level": list(v.level) or ["OFF"],
        "trace_rate": [str(v.rate)],
        "trace_count": [str(v.count)],
        "trace_mode": [config.mode],
    }
    if config.mode == MODE_TRITON:
        out["log_frequency"] = [str(v.log_frequency)]
        out["trace_file"] = [v.file]
    else:
        options = {**{k: (d,) for k, d in OTEL_DEFAULTS.items()}, **config.options}
        out.update({k: list(vals) for k, vals in options.items()})
    return out


def http_json(answer: Mapping[str, list[str]]) -> dict[str, Any]:
    """The HTTP front's form: trace_level a list, every other field one string."""
    return {
        k: (v if k == "trace_level" else (v[0] if len(v) == 1 else v)) for k, v in answer.items()
    }


def http_update(doc: Any) -> dict[str, list[str] | None]:
    """An HTTP POST body as TraceSetting settings; TypeError with Triton's
    message for a value of the wrong JSON type (Triton answers 500 for it)."""
    if not isinstance(doc, dict):
        return {}  # Triton reads no settings from a non-object body
    out: dict[str, list[str] | None] = {}
    for key, value in doc.items():
        if value is None:
            out[key] = None
        elif key == "trace_level":
            if not isinstance(value, list):
                raise TypeError("attempt to access JSON non-array as array")
            if not all(isinstance(v, str) for v in value):
                raise TypeError("attempt to access JSON non-string as string")
            out[key] = list(value)
        elif key in _FIELD_OF:
            if not isinstance(value, str):
                raise TypeError("attempt to access JSON non-string as string")
            out[key] = [value]
    return out


class Sampler:
    """A gateway's sampling for one setting: every `rate`-th request it
    sees is traced (the count, shared stack-wide, is taken by the caller)."""

    __slots__ = ("setting", "mode", "seen")

    def __init__(self, setting: Setting, mode: str) -> None:
        self.setting = setting
        self.mode = mode
        self.seen = 0

    def hit(self) -> bool:
        self.seen += 1
        return self.seen % self.setting.values.rate == 0
