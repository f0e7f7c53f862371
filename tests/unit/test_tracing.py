"""The trace settings rules (stageserve/tracing.py): --trace-config parsing,
update parsing with Triton's messages, inheritance and clearing, sampling."""

from __future__ import annotations

import itertools

import pytest

from stageserve.tracing import (
    MODE_OPENTELEMETRY,
    Sampler,
    Setting,
    TraceConfig,
    TraceConfigError,
    TraceSettingError,
    TraceState,
    Values,
    http_json,
    http_update,
    parse_trace_config,
    parse_update,
    response,
)


def _uids():
    return (f"u{i}" for i in itertools.count())


def test_trace_config_triton_syntax() -> None:
    config = parse_trace_config(
        ["triton,file=/tmp/t.json", "level=TIMESTAMPS", "level=TENSORS", "rate=1", "count=5",
         "log-frequency=3"]
    )  # fmt: skip
    assert config.mode == "triton"
    assert config.values == Values(("TIMESTAMPS", "TENSORS"), 1, 5, 3, "/tmp/t.json")
    otel = parse_trace_config(
        ["mode=opentelemetry", "opentelemetry,url=collector:4317", "opentelemetry,resource=a=b"]
    )
    assert otel.mode == MODE_OPENTELEMETRY
    assert otel.url() == "collector:4317"
    assert otel.resources() == {"a": "b"}
    assert parse_trace_config(["level=TIMESTAMPS", "level=OFF"]).values.level == ()


@pytest.mark.parametrize(
    "arg",
    [
        "rate",
        "rate=abc",
        "count=-2",
        "mode=jaeger",
        "level=LOUD",
        "foo=1",
        "zipkin,url=x",
        "opentelemetry,url=ftp://collector:4318",
    ],
)
def test_trace_config_refuses(arg: str) -> None:
    with pytest.raises(TraceConfigError):
        parse_trace_config([arg])


@pytest.mark.parametrize(
    ("key", "text", "want"),
    [
        ("trace_rate", "5abc", 5),
        ("trace_rate", " 7", 7),
        ("trace_rate", "-5", 4294967291),
        ("trace_rate", "0x10", 0),
        ("log_frequency", "-1", 4294967295),
        ("trace_count", "-1", -1),
    ],
)
def test_numbers_parse_as_triton(key: str, text: str, want: int) -> None:
    update = parse_update({key: [text]})
    assert list(update.values.values()) == [want]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"trace_rate": ["abc"]}, "Unable to parse 'trace_rate', got: abc"),
        ({"trace_rate": ["1", "2"]}, "expect only 1 value for 'trace_rate'"),
        (
            {"trace_rate": ["4294967295"]},
            "Unable to parse 'trace_rate', value is out of range [ 0, 4294967295 ], "
            "got: 4294967295",
        ),
        ({"trace_count": ["-2"]}, "Unable to parse 'trace_count'. Expecting value >= -1, got: -2"),
        ({"trace_level": ["OFF", "TIMESTAMPS"]}, "Expect only one trace level 'OFF' is specified"),
    ],
)
def test_bad_values_have_tritons_messages(settings, message: str) -> None:
    with pytest.raises(TraceSettingError) as err:
        parse_update(settings)
    assert err.value.message == message and not err.value.unimplemented


def test_trace_file_cannot_change() -> None:
    with pytest.raises(TraceSettingError) as err:
        parse_update({"trace_file": ["x"]})
    assert err.value.unimplemented


def test_unknown_keys_and_levels_are_ignored() -> None:
    update = parse_update({"trace_mode": ["x"], "foo": ["1"], "trace_level": ["FOO"]})
    assert not update.values and not update.cleared


def _state(**values) -> TraceState:
    return TraceState.initial(TraceConfig(Values(file="/t.json", **values)), "g0")


def test_model_setting_inherits_and_clears() -> None:
    uids = _uids()
    state = _state().apply("m", parse_update({"trace_rate": ["5"]}), uids)
    assert state.effective("m").values.rate == 5
    assert state.effective("other").values.rate == 1000
    state = state.apply("", parse_update({"trace_count": ["3"]}), uids)
    assert state.effective("m").values.count == 3  # inherited from the global update
    assert state.effective("m").values.rate == 5  # its own stays
    state = state.apply("m", parse_update({"trace_rate": None}), uids)
    assert "m" not in state.models  # nothing specified: follows the global setting again


def test_clearing_global_goes_back_to_startup_value() -> None:
    uids = _uids()
    state = _state(rate=7).apply("", parse_update({"trace_rate": ["9"]}), uids)
    assert state.global_.values.rate == 9
    assert state.apply("", parse_update({"trace_rate": []}), uids).global_.values.rate == 7


def test_invalid_setting_only_when_off() -> None:
    state = TraceState.initial(TraceConfig(), "g0")  # triton mode, no file
    with pytest.raises(TraceSettingError, match="trace file name is not given"):
        state.apply("", parse_update({"trace_level": ["TIMESTAMPS"]}), _uids())
    spent = _state(level=("TIMESTAMPS",), count=0)
    with pytest.raises(TraceSettingError, match=r"invalid trace setting :$"):
        spent.apply("m", parse_update({"trace_rate": ["1"]}), _uids())
    # turning tracing off is always allowed
    spent.apply("", parse_update({"trace_level": ["OFF"]}), _uids())


def test_state_round_trips_with_counts() -> None:
    state = _state(level=("TIMESTAMPS",), count=4).apply(
        "m", parse_update({"trace_rate": ["2"]}), _uids()
    )
    again = TraceState.from_json(state.to_json()).with_counts({state.models["m"].uid: 1})
    assert again.effective("m").values.count == 1
    assert again.global_ == state.global_


def test_sampler_takes_every_rate_th() -> None:
    sampler = Sampler(Setting(Values(("TIMESTAMPS",), rate=3, file="f")), "triton")
    assert [sampler.hit() for _ in range(7)] == [False, False, True, False, False, True, False]


def test_answers_by_mode_and_front() -> None:
    setting = Setting(Values(("TIMESTAMPS",), 1, -1, 0, "f"))
    triton = response(setting, TraceConfig())
    assert triton["trace_file"] == ["f"] and "url" not in triton
    otel = response(setting, parse_trace_config(["mode=opentelemetry", "opentelemetry,url=u"]))
    assert otel["url"] == ["u"] and "trace_file" not in otel
    assert otel["bsp_max_queue_size"] == ["2048"]
    assert http_json(triton)["trace_rate"] == "1" and http_json(triton)["trace_level"] == [
        "TIMESTAMPS"
    ]


def test_http_bodies() -> None:
    assert http_update([1]) == {}
    assert http_update({"trace_rate": None, "foo": 1}) == {"trace_rate": None}
    with pytest.raises(TypeError, match="non-string"):
        http_update({"trace_rate": 7})
    with pytest.raises(TypeError, match="non-array"):
        http_update({"trace_level": "TIMESTAMPS"})


def test_trace_config_flag_reaches_the_gateway_settings() -> None:
    from stageserve.cli import _settings, build_parser

    parser = build_parser()
    argv = ["up", "--trace-config", "mode=opentelemetry", "--trace-config=rate=5"]
    settings = _settings(parser, parser.parse_args(argv), environment=None)
    assert settings.gateway.trace_config == ("mode=opentelemetry", "rate=5")
    assert parse_trace_config(settings.gateway.trace_config).values.rate == 5
    with pytest.raises(SystemExit):
        _settings(parser, parser.parse_args(["up", "--trace-config", "rate=x"]), None)
