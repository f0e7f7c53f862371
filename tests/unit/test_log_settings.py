"""stageserve/log_settings.py (Triton's parsing of an update, the Redis form) and
stageserve/logs.py (the settings applied to Python logging)."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from stageserve import logs
from stageserve import redis_keys as keys
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.log_follow import LogFollower
from stageserve.log_settings import (
    FILE_REFUSED,
    LogSettings,
    from_redis,
    grpc_fields,
    int32_level,
    parse_grpc,
    parse_http,
    to_redis,
)
from stageserve.logs import (
    FOLLOW_ENV,
    current_settings,
    enabled,
    python_level,
    root_level,
    setup_child_logging,
    setup_logging,
    verbose_level_of,
)

# ------------------------------------------------------------------ parsing


def test_http_applies_in_tritons_order_and_keeps_what_came_before_an_error() -> None:
    update = parse_http(b'{"log_format": "xml", "log_verbose_level": 4, "log_info": false}')
    assert update.changes == {"log_info": False, "log_verbose_level": 4}
    assert update.error is not None
    assert (update.error.code, update.error.http) == ("UNAVAILABLE", 503)
    assert update.error.message == "invalid argument for --log_format, got: xml"


def test_http_type_errors_are_rapidjsons() -> None:
    for body, words in (
        ({"log_verbose_level": -1}, "non-unsigned-integer as unsigned-integer"),
        ({"log_verbose_level": "2"}, "non-unsigned-integer as unsigned-integer"),
        ({"log_verbose_level": 1.0}, "non-unsigned-integer as unsigned-integer"),
        ({"log_verbose_level": True}, "non-unsigned-integer as unsigned-integer"),
        ({"log_verbose_level": 2**64}, "non-unsigned-integer as unsigned-integer"),
        ({"log_warning": 0}, "non-boolean as boolean"),
        ({"log_format": 1}, "non-string as string"),
    ):
        update = parse_http(json.dumps(body).encode())
        assert update.changes == {}
        assert update.error is not None and update.error.http == 500
        assert update.error.message == f"attempt to access JSON {words}"


def test_http_file_refused_nulls_skipped_unknown_ignored_first_key_wins() -> None:
    refused = parse_http(b'{"log_file": "", "log_verbose_level": 3}')
    assert refused.changes == {}
    assert refused.error is not None
    assert (refused.error.code, refused.error.http) == ("UNIMPLEMENTED", 501)
    assert refused.error.message == FILE_REFUSED
    skipped = parse_http(b'{"log_file": null, "log_info": null, "bogus": 1, "log_error": false}')
    assert skipped.changes == {"log_error": False} and skipped.error is None
    twice = parse_http(b'{"log_verbose_level": 5, "log_verbose_level": 6}')
    assert twice.changes == {"log_verbose_level": 5}
    assert parse_http(b"[1]").changes == {} and parse_http(b"[1]").error is None


def test_http_unparsable_body() -> None:
    empty = parse_http(b"  ")
    assert empty.error is not None and empty.error.http == 500
    assert empty.error.message.endswith("The document is empty. at 0")
    bad = parse_http(b"not json")
    assert bad.error is not None and bad.error.http == 500
    assert bad.error.message.startswith("failed to parse the request JSON buffer: ")


def test_verbose_level_is_tritons_int32() -> None:
    assert [int32_level(v) for v in (0, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 1, 2**64 - 1)] == [
        0,
        7,
        2**31 - 1,
        0,
        0,
        1,
        0,
    ]


def _grpc(**settings: tuple[str | None, object]) -> gs.LogSettingsRequest:
    request = gs.LogSettingsRequest()
    for key, (field, value) in settings.items():
        if field is None:
            request.settings[key].SetInParent()
        else:
            setattr(request.settings[key], field, value)
    return request


def test_grpc_types_order_and_messages() -> None:
    update = parse_grpc(
        _grpc(log_verbose_level=("uint32_param", 5), log_format=("string_param", "xml")).settings
    )
    assert update.changes == {"log_verbose_level": 5}
    assert update.error is not None
    assert (update.error.code, update.error.message) == (
        "INVALID_ARGUMENT",
        "invalid argument for log_format, got: xml",
    )
    for key, field, value, name in (
        ("log_verbose_level", "bool_param", True, "int32"),
        ("log_verbose_level", None, None, "int32"),
        ("log_info", "uint32_param", 0, "boolean"),
        ("log_format", None, None, "string"),
    ):
        error = parse_grpc(_grpc(**{key: (field, value)}).settings).error
        assert error is not None and error.message == f"expect {name} for '{key}'"
    refused = parse_grpc(_grpc(log_file=(None, None)).settings).error
    assert refused is not None and refused.code == "UNIMPLEMENTED"
    wrapped = parse_grpc(_grpc(log_verbose_level=("uint32_param", 2**31)).settings)
    assert wrapped.changes == {"log_verbose_level": 0}


def test_grpc_answer_fields() -> None:
    assert grpc_fields(LogSettings(log_verbose_level=2)) == {
        "log_file": ("string_param", ""),
        "log_info": ("bool_param", True),
        "log_warning": ("bool_param", True),
        "log_error": ("bool_param", True),
        "log_verbose_level": ("uint32_param", 2),
        "log_format": ("string_param", "default"),
    }


def test_redis_form_round_trips_over_a_stages_own_settings() -> None:
    base = LogSettings(log_file="/tmp/x.log", log_verbose_level=3)
    stored = to_redis({"log_info": False, "log_format": "ISO8601"})
    assert from_redis(base, stored) == base.updated({"log_info": False, "log_format": "ISO8601"})
    # bytes from Redis; fields this version cannot read are left out
    raw = {b"log_verbose_level": b"1", b"log_format": b'"xml"', b"log_error": b"oops", b"x": b"1"}
    assert from_redis(base, raw) == base.updated({"log_verbose_level": 1})


# ------------------------------------------------------------------ logging


def test_levels_map_onto_python_logging() -> None:
    assert verbose_level_of(logging.DEBUG) == 1 and python_level(1) == logging.DEBUG
    assert python_level(3) == logging.DEBUG - 2
    quiet = LogSettings(log_info=False)
    assert not enabled(quiet, logging.INFO) and enabled(quiet, logging.WARNING)
    assert enabled(quiet, logging.CRITICAL) and not enabled(LogSettings(log_error=False), 50)
    assert not enabled(LogSettings(), logging.DEBUG)
    assert enabled(LogSettings(log_verbose_level=1), logging.DEBUG)
    # a library's DEBUG is level 2
    assert not enabled(LogSettings(log_verbose_level=1), logging.DEBUG, "grpc._cython")
    assert enabled(LogSettings(log_verbose_level=2), logging.DEBUG, "grpc._cython")
    assert root_level(LogSettings(log_verbose_level=2)) == logging.DEBUG - 1
    assert root_level(LogSettings(log_info=False)) == logging.WARNING
    off = LogSettings(log_info=False, log_warning=False, log_error=False)
    assert root_level(off) > logging.CRITICAL


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """This process's logging as it was (pytest's capture handlers included)."""
    root = logging.getLogger()
    handlers, level, state = root.handlers[:], root.level, logs._state
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logs._state = state


@pytest.fixture
def settings_hash(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.delete(keys.LOG_SETTINGS)
    yield client
    client.delete(keys.LOG_SETTINGS)
    client.close()


def _fields(changes: dict) -> dict[Any, Any]:
    return to_redis(changes)


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_settings_applied_at_run_time(tmp_path: Path, restore_logging: None) -> None:
    from stageserve.logs import apply_log_settings

    log_file = tmp_path / "stage.log"
    setup_logging("scheduler", settings=LogSettings(log_file=str(log_file)))
    log = logging.getLogger("stageserve.test")
    log.debug("hidden")
    log.info("shown")
    assert [json.loads(line)["msg"] for line in _lines(log_file)] == ["shown"]

    # the file stays what the flags said, whatever an update carries
    assert apply_log_settings(LogSettings(log_verbose_level=1, log_info=False, log_file="/x"))
    assert current_settings().log_file == str(log_file)
    log.debug("verbose")
    log.info("no info")
    log.warning("warned", extra={"model": "m"})
    entries = [json.loads(line) for line in _lines(log_file)[1:]]
    assert [(e["level"], e["msg"]) for e in entries] == [
        ("debug", "verbose"),
        ("warning", "warned"),
    ]

    assert apply_log_settings(current_settings().updated({"log_format": "ISO8601"}))
    assert not apply_log_settings(current_settings())  # nothing changed
    log.warning("in ISO8601", extra={"model": "m"})
    last = _lines(log_file)[-1]
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ W \d+ scheduler stageserve\.test:\d+\] "
        r'in ISO8601 \{"model": "m"\}',
        last,
    ), last


def test_a_stage_reads_the_stack_settings_at_startup_then_follows_them(
    tmp_path: Path, restore_logging: None, settings_hash: redis.Redis, redis_url: str
) -> None:
    base = LogSettings(log_file=str(tmp_path / "stage.log"), log_warning=False)
    setup_logging("worker", settings=base)
    settings_hash.hset(keys.LOG_SETTINGS, mapping=_fields({"log_verbose_level": 2}))
    follower = LogFollower(redis_url, base)
    follower.start()
    try:
        # read before start() returns: the stage's first lines log as the stack says
        assert current_settings() == base.updated({"log_verbose_level": 2})
        settings_hash.hset(keys.LOG_SETTINGS, mapping=_fields({"log_format": "ISO8601"}))
        settings_hash.publish(keys.LOG_EVENTS, "1")
        assert wait_for(lambda: current_settings().log_format == "ISO8601")
        assert current_settings() == base.updated({"log_verbose_level": 2, "log_format": "ISO8601"})
    finally:
        follower.stop()


class _UpdateDuringRead:
    """A Redis client whose HGETALL, like a follower's read racing a
    gateway's own update, returns the hash as it was just before the gateway
    stored and applied `update`."""

    def __init__(self, client: redis.Redis, base: LogSettings, update: dict[str, Any]) -> None:
        self.client, self.base, self.update = client, base, update

    def hgetall(self, key: str) -> Any:
        before = self.client.hgetall(key)
        self.client.hset(key, mapping=_fields(self.update))
        logs.apply_log_settings(current_settings().updated(self.update))
        return before


def test_a_read_older_than_this_processs_own_update_does_not_undo_it(
    tmp_path: Path, restore_logging: None, settings_hash: redis.Redis, redis_url: str
) -> None:
    base = LogSettings(log_file=str(tmp_path / "gateway.log"))
    setup_logging("gateway", settings=base)
    follower = LogFollower(redis_url, base)
    follower.sync(_UpdateDuringRead(settings_hash, base, {"log_verbose_level": 5}))  # type: ignore[arg-type]
    assert current_settings().log_verbose_level == 5  # the stale read was not applied
    follower.sync(settings_hash)  # the update's own message: read again
    assert current_settings() == base.updated({"log_verbose_level": 5})


def test_a_child_takes_its_stages_settings_from_the_environment(
    tmp_path: Path, restore_logging: None, settings_hash: redis.Redis, redis_url: str
) -> None:
    log_file = tmp_path / "worker.log"
    settings_hash.hset(keys.LOG_SETTINGS, mapping=_fields({"log_verbose_level": 1}))
    handed = {"redis": redis_url, "settings": LogSettings(log_file=str(log_file)).as_json()}
    follower = setup_child_logging("worker-stub", {FOLLOW_ENV: json.dumps(handed)})
    assert follower is not None
    try:
        assert current_settings() == LogSettings(log_file=str(log_file), log_verbose_level=1)
        logging.getLogger("stageserve.model").debug("from the stub")
        assert json.loads(_lines(log_file)[-1])["service"] == "worker-stub"
    finally:
        follower.stop()
    assert setup_child_logging("worker-stub", {}) is None
    assert current_settings() == LogSettings()


def test_tritons_log_flags_make_a_stages_own_settings() -> None:
    from stageserve.cli import build_parser
    from stageserve.log_options import log_settings_of

    args = build_parser().parse_args(
        ["scheduler", "--redis-url", "redis://x", "--log-verbose", "2", "--log-info", "false"]
        + ["--log-format", "ISO8601", "--log-file", "/tmp/s.log"]
    )
    assert log_settings_of(args) == LogSettings(
        log_file="/tmp/s.log", log_info=False, log_verbose_level=2, log_format="ISO8601"
    )
    defaults = build_parser().parse_args(["worker", "--redis-url", "redis://x"])
    assert log_settings_of(defaults) == LogSettings()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--redis-url", "r", "--log-format", "iso8601"])
