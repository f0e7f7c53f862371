"""stageserve/triton_flags.py and its wiring in the CLI: tritonserver 2.51's flags
that launch scripts carry, parsed with its rules and messages (the messages
below are tritonserver 2.51's, recorded from the binary; the integration test
test_triton_flags.py runs both servers on the same command lines)."""

from __future__ import annotations

import argparse

import pytest

from stageserve.cli import (
    _check_triton_flags,
    _gateways,
    _settings,
    _up_gateway_flags,
    build_parser,
)
from stageserve.triton_flags import (
    BackendConfig,
    backend_config,
    default_max_batch_size,
    ignored,
    refused,
    triton_int,
    triton_pair,
    unused_backend_configs,
)


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What `stageserve up ARGV` says before it starts anything (the CLI's
    parsing and checks, in main's order)."""
    parser = build_parser()
    with pytest.raises(SystemExit) as exc:
        args = parser.parse_args(["up", *argv])
        _check_triton_flags(parser, args)
        _settings(parser, args)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_backend_config_takes_tritons_two_forms() -> None:
    assert backend_config("python,shm-default-byte-size=1048576") == BackendConfig(
        "python", "shm-default-byte-size", "1048576"
    )
    assert backend_config("default-max-batch-size=8") == BackendConfig(
        "", "default-max-batch-size", "8"
    )
    assert backend_config("python,a=b=c").value == "b=c"  # the first '=' splits


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bad", "--backend-config option format is '<backend name>,<setting>=<value>'. Got bad"),
        (
            "python,bad",
            "--backend-config option format is '<backend name>,<setting>=<value>'. Got python,bad",
        ),
        ("a=", "--backend-config option format is '<backend name>,<setting>=<value>'. Got a="),
        (
            ",a=b",
            "No backend specified. --backend-config option format is <backend name>,"
            "<setting>=<value> or <setting>=<value>. Got ,a=b",
        ),
    ],
)
def test_a_malformed_backend_config_gets_tritons_message(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        backend_config(text)
    assert str(exc.value) == message


def test_integers_and_pairs_parse_as_tritonserver_parses_them() -> None:
    assert triton_int("7") == 7 and triton_int("7.5") == 7 and triton_int("-1") == -1
    with pytest.raises(argparse.ArgumentTypeError, match=r"^Invalid option value. Got x$"):
        triton_int("x")
    assert triton_pair("0:67108864") == (0, 67108864)
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        triton_pair("abc")
    assert str(exc.value) == (
        "Cannot parse pair option due to incorrect number of inputs.--<pair option> argument "
        "requires format <first>:<second>. Found: abc"
    )


def test_default_max_batch_size_comes_from_global_or_onnxruntime_configs() -> None:
    configs = [
        backend_config("python,default-max-batch-size=2"),  # not a backend we complete
        backend_config("default-max-batch-size=8"),
        backend_config("python,shm-default-byte-size=1048576"),
    ]
    assert default_max_batch_size(configs) == 8
    assert (
        default_max_batch_size([*configs, backend_config("onnxruntime,default-max-batch-size=16")])
        == 16
    )
    assert default_max_batch_size([]) is None
    assert unused_backend_configs(configs) == [
        "python,default-max-batch-size=2",
        "python,shm-default-byte-size=1048576",
    ]
    with pytest.raises(ValueError, match="must be an integer"):
        default_max_batch_size([backend_config("default-max-batch-size=many")])


def test_aliases_and_autocomplete_flags_reach_the_settings(tmp_path) -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["up", "--model-store", str(tmp_path), "--id", "edge-7",
         "--backend-config=default-max-batch-size=8", "--exit-timeout-secs=7"]
    )  # fmt: skip
    settings = _settings(parser, args)
    assert args.model_repository == tmp_path
    assert settings.gateway.server_name == "edge-7"
    assert settings.gateway.autocomplete.enabled
    assert settings.gateway.autocomplete.default_max_batch_size == 8
    assert settings.gateway.exit_timeout_secs == 7
    assert _up_gateway_flags(args, settings.gateway) == ["--exit-timeout-secs", "7"]

    strict = parser.parse_args(["up", "--strict-model-config=true"])
    assert not _settings(parser, strict).gateway.autocomplete.enabled
    loose = parser.parse_args(["up", "--strict-model-config=false"])
    assert _settings(parser, loose).gateway.autocomplete.enabled
    plain = parser.parse_args(["up"])
    assert _settings(parser, plain).gateway.server_name == "triton"
    assert _settings(parser, plain).gateway.exit_timeout_secs == 5


def test_up_hands_the_reuse_flags_to_its_gateway_when_given() -> None:
    parser = build_parser()
    args = parser.parse_args(["up", "--reuse-grpc-port=true", "--reuse-http-port=1"])
    flags = _up_gateway_flags(args, _settings(parser, args).gateway)
    assert flags == [
        "--exit-timeout-secs", "5", "--reuse-grpc-port", "true", "--reuse-http-port", "true"
    ]  # fmt: skip


def test_the_no_effect_flags_parse_with_tritons_types() -> None:
    args = _parse(
        "--pinned-memory-pool-byte-size=268435456",
        "--cuda-memory-pool-byte-size=0:67108864",
        "--cuda-memory-pool-byte-size=1:67108864",
        "--min-supported-compute-capability=6.0",
        "--model-load-thread-count=2",
        "--allow-gpu-metrics=false",
        "--metrics-config=summary_latencies=true",
    )
    assert args.cuda_memory_pool_byte_size == [(0, 67108864), (1, 67108864)]
    assert args.pinned_memory_pool_byte_size == 268435456
    assert args.allow_gpu_metrics is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--allow-metrics=maybe"], "invalid value for bool option: maybe"),
        (["--exit-timeout-secs=abc"], "Invalid option value. Got abc"),
        (["--model-load-thread-count=x"], "Invalid option value. Got x"),
        (["--backend-config=bad"], "Got bad"),
        (["--cuda-memory-pool-byte-size=abc"], "<first>:<second>. Found: abc"),
        (["--allow-grpc=false"], "--allow-grpc=false is not supported"),
        (["--reuse-grpc-port=false", "--gateways", "2"], "need one gateway"),
        (["--backend-config=default-max-batch-size=many"], "must be an integer"),
        (["--allow-sagemaker=true"], "--allow-sagemaker=true is not supported"),
        (["--allow-vertex-ai"], "--allow-vertex-ai=true is not supported"),
        (["--model-config-name=a b"], "--model-config-name must be a name without spaces"),
        (["--grpc-max-connection-age=x"], "Invalid option value. Got x"),
        (["--model-load-gpu-limit=0"], "<first>:<second>. Found: 0"),
        (["--grpc-header-forward-pattern=x-("], "invalid regular expression 'x-('"),
    ],
)
def test_bad_values_end_the_cli_with_tritons_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert message in _refused(capsys, *argv)


def test_ports_of_its_own_make_auto_one_gateway() -> None:
    parser = build_parser()
    exclusive = parser.parse_args(["up", "--reuse-http-port=false"])
    assert _gateways(parser, exclusive, _settings(parser, exclusive)) == 1
    _check_triton_flags(parser, exclusive)  # auto: allowed, it becomes one
    given = parser.parse_args(["up", "--gateways", "3"])
    assert _gateways(parser, given, _settings(parser, given)) == 3


def test_tritons_transport_and_cloud_flags_parse_and_change_nothing() -> None:
    args = _parse(
        "--grpc-keepalive-time=10000",
        "--grpc-keepalive-permit-without-calls=1",
        "--grpc-infer-response-compression-level=high",
        "--grpc-header-forward-pattern=x-.*",
        "--host-policy=gpu0,numa-node=0",
        "--host-policy=gpu1,cpu-cores=0-3",
        "--model-load-gpu-limit=0:0.8",
        "--sagemaker-safe-port-range=8000-8010",
        "--allow-vertex-ai=false",
    )
    assert args.grpc_keepalive_time == 10000
    assert args.grpc_keepalive_permit_without_calls is True
    assert args.host_policy == ["gpu0,numa-node=0", "gpu1,cpu-cores=0-3"]
    assert args.model_load_gpu_limit == [(0, 0.8)]
    assert args.sagemaker_safe_port_range == (8000, 8010)
    named = [entry.split(" (", 1)[0] for entry in ignored(args)]
    for flag in (
        "--grpc-keepalive-time",
        "--grpc-keepalive-permit-without-calls",
        "--host-policy",
        "--model-load-gpu-limit",
        "--sagemaker-safe-port-range",
    ):
        assert flag in named, (flag, named)
    assert refused(args) is None
    # compression takes effect (stageserve/h2grpc/wire.py response_encoding),
    # in every gateway `up` starts
    assert "--grpc-infer-response-compression-level" not in named
    parser = build_parser()
    up = parser.parse_args(["up", "--grpc-infer-response-compression-level=high"])
    gateway = _settings(parser, up).gateway
    assert gateway.grpc_infer_response_compression == "high"
    flags = _up_gateway_flags(up, gateway)
    at = flags.index("--grpc-infer-response-compression-level")
    assert flags[at + 1] == "high"
    plain = parser.parse_args(["up"])
    assert _settings(parser, plain).gateway.grpc_infer_response_compression == "none"
    assert _settings(parser, plain).gateway.model_load_retry_count == 0
    retry = parser.parse_args(["up", "--model-load-retry-count=2"])
    gateway = _settings(parser, retry).gateway
    assert gateway.model_load_retry_count == 2
    assert _up_gateway_flags(retry, gateway)[-2:] == ["--model-load-retry-count", "2"]
    assert not any(e.startswith("--model-load-retry-count") for e in ignored(retry))
    aged = parser.parse_args(
        ["up", "--grpc-max-connection-age=60000", "--grpc-max-connection-age-grace=5000"]
    )
    gateway = _settings(parser, aged).gateway
    assert (gateway.grpc_max_connection_age_ms, gateway.grpc_max_connection_age_grace_ms) == (
        60000,
        5000,
    )
    assert _up_gateway_flags(aged, gateway)[-4:] == [
        "--grpc-max-connection-age",
        "60000",
        "--grpc-max-connection-age-grace",
        "5000",
    ]
    assert not any(e.startswith("--grpc-max-connection-age") for e in ignored(aged))


def test_deprecated_trace_and_cache_flags_become_their_configs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    args = parser.parse_args(
        [
            "up",
            "--trace-file=/tmp/t.json",
            "--trace-level=TIMESTAMPS",
            "--trace-level=TENSORS",
            "--trace-rate=10",
            "--trace-count=5",
            "--trace-log-frequency=2",
            "--trace-config=mode=triton",
            "--response-cache-byte-size=1048576",
        ]
    )
    _check_triton_flags(parser, args)
    assert args.trace_config == [
        "triton,file=/tmp/t.json",
        "level=TIMESTAMPS",
        "level=TENSORS",
        "rate=10",
        "count=5",
        "triton,log-frequency=2",
        "mode=triton",
    ]
    assert args.cache_config == ["local,size=1048576"]
    settings = _settings(parser, args)
    assert settings.gateway.trace_config == tuple(args.trace_config)
    assert settings.gateway.response_cache is not None
    err = capsys.readouterr().err
    assert "Warning: '--trace-file' has been deprecated" in err
    assert "'--cache-config=local,size=1048576'" in err


def test_model_config_name_and_metrics_address_reach_the_gateways() -> None:
    parser = build_parser()
    args = parser.parse_args(
        [
            "up",
            "--model-config-name=h100",
            "--metrics-address=127.0.0.1",
            "--http-header-forward-pattern=^x-",
        ]
    )
    settings = _settings(parser, args)
    assert settings.gateway.model_config_name == "h100"
    assert settings.gateway.http_header_forward_pattern == "^x-"
    assert settings.gateway.grpc_header_forward_pattern is None
    assert settings.gateway.metrics_address == "127.0.0.1"
    flags = _up_gateway_flags(args, settings.gateway)
    assert flags[flags.index("--model-config-name") + 1] == "h100"
    assert flags[flags.index("--metrics-address") + 1] == "127.0.0.1"
    assert flags[flags.index("--http-header-forward-pattern") + 1] == "^x-"
    assert "--grpc-header-forward-pattern" not in flags
    plain = parser.parse_args(["up"])
    plain_settings = _settings(parser, plain)
    assert plain_settings.gateway.metrics_address == "0.0.0.0"
    plain_flags = _up_gateway_flags(plain, plain_settings.gateway)
    assert "--model-config-name" not in plain_flags and "--metrics-address" not in plain_flags
