"""The settings tree from the environment (STAGESERVE_<SECTION>_<FIELD>, typed,
checked) and the command-line flags."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from stageserve.settings import (
    GatewaySettings,
    RateLimiterSettings,
    SchedulerSettings,
    Settings,
    WorkerSettings,
    from_env,
    settings_from,
    settings_from_env,
)


def test_defaults_without_environment() -> None:
    assert from_env(WorkerSettings, "worker", {}) == WorkerSettings()


def test_each_field_is_overridden_by_its_variable_with_its_type() -> None:
    s = from_env(
        SchedulerSettings,
        "scheduler",
        {
            "STAGESERVE_SCHEDULER_GRANT_LEASE_MS": "5000",
            "STAGESERVE_SCHEDULER_GRANT_RENEW_S": "1.5",
        },
    )
    assert s.grant_lease_ms == 5000 and isinstance(s.grant_lease_ms, int)
    assert s.grant_renew_s == 1.5
    assert s.acquire_wait_ms == SchedulerSettings().acquire_wait_ms


@pytest.mark.parametrize("value", ["soon", "1.5", "-1"])
def test_a_bad_value_names_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match="STAGESERVE_WORKER_LEASE_MS"):
        from_env(WorkerSettings, "worker", {"STAGESERVE_WORKER_LEASE_MS": value})


def test_the_tree_reads_every_section_from_its_variables() -> None:
    s = settings_from_env(
        {
            "STAGESERVE_GATEWAY_LOAD_TIMEOUT_S": "7.5",
            "STAGESERVE_RATELIMITER_SWEEP_S": "0.5",
            "STAGESERVE_REDIS_CLIENT_RETRIES": "9",
            "STAGESERVE_SUPERVISOR_START_TIMEOUT_S": "30",
            "STAGESERVE_WORKER_LEASE_MS": "4000",
        }
    )
    assert s.gateway.load_timeout_s == 7.5
    assert s.ratelimiter.sweep_s == 0.5
    assert s.redis_client.retries == 9
    assert s.supervisor.start_timeout_s == 30.0
    assert s.worker.lease_ms == 4000
    assert s.scheduler.grant_lease_ms == SchedulerSettings().grant_lease_ms
    assert settings_from_env({}) == Settings()


def test_a_bad_variable_in_any_section_stops_the_tree() -> None:
    with pytest.raises(ValueError, match="STAGESERVE_GATEWAY_STATS_PUBLISH_S"):
        settings_from_env({"STAGESERVE_GATEWAY_STATS_PUBLISH_S": "often"})


def test_flag_fields_do_not_come_from_the_environment() -> None:
    s = settings_from_env(
        {
            "STAGESERVE_RATELIMITER_MODE": "execution_count",
            "STAGESERVE_SCHEDULER_ADAPTIVE_BATCH_DELAY_US": "0",
        }
    )
    assert s.ratelimiter.mode == "off"
    assert s.scheduler.adaptive_batch_delay_us == SchedulerSettings().adaptive_batch_delay_us


def test_flags_set_their_fields_beside_the_environments() -> None:
    env = {"STAGESERVE_SCHEDULER_GRANT_REUSE_S": "1.5"}
    flags = argparse.Namespace(
        adaptive_batch_delay_us=0,
        repository_poll_secs=3.0,
        rate_limit="execution_count",
        rate_limit_resources=(("R", 4), ("G@0", 2)),
        device="cpu",
        model_control_mode="poll",
        log_verbose=1,  # not a settings field: ignored
    )
    s = settings_from(flags, env)
    assert s.scheduler.grant_reuse_s == 1.5
    assert s.scheduler.adaptive_batch_delay_us == 0
    assert s.gateway.repository_poll_secs == 3.0
    assert s.gateway.model_control_mode == "poll"
    assert s.ratelimiter.mode == "execution_count"
    assert s.ratelimiter.resources == (("R", 4), ("G@0", 2))
    assert s.worker.device == "cpu"
    # Another service's flags are absent: their fields keep the defaults.
    assert settings_from({"device": "cpu"}, env).ratelimiter == RateLimiterSettings()


def test_the_cli_builds_the_tree_from_its_flags() -> None:
    from stageserve.cli import _settings, build_parser

    parser = build_parser()
    args = parser.parse_args(
        [
            "ratelimiter",
            "--redis-url",
            "redis://h",
            "--rate-limit",
            "execution_count",
            "--rate-limit-resource",
            "R:4",
            "--rate-limit-resource",
            "G:2:0",
        ]
    )
    s = _settings(parser, args)
    assert s.ratelimiter.mode == "execution_count"
    assert s.ratelimiter.resources == (("R", 4), ("G@0", 2))
    args = parser.parse_args(["scheduler", "--redis-url", "r", "--adaptive-batch-delay-us", "7"])
    assert _settings(parser, args).scheduler.adaptive_batch_delay_us == 7


def test_the_tree_is_frozen() -> None:
    s = Settings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.worker.lease_ms = 1  # type: ignore[misc]


def test_the_gateway_section_holds_its_public_endpoint_flags(tmp_path) -> None:
    from stageserve.cli import _settings, build_parser

    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    parser = build_parser()
    args = parser.parse_args(
        [
            "gateway",
            "--redis-url",
            "r",
            "--model-repository",
            str(tmp_path),
            "--model-control-mode",
            "explicit",
            "--disable-auto-complete-config",
            "--grpc-use-ssl=true",
            f"--grpc-server-cert={cert}",
            f"--grpc-server-key={key}",
            "--grpc-restricted-protocol=model-repository:admin=secret",
            "--http-restricted-api=health:k=v",
        ]
    )
    gateway = _settings(parser, args).gateway
    assert gateway.model_control_mode == "explicit"
    assert not gateway.autocomplete.enabled
    assert gateway.public_tls is not None and gateway.public_tls.server_cert == cert
    (grpc_rule,) = gateway.grpc_restrictions
    assert grpc_rule.groups == {"model-repository"} and grpc_rule.value == "secret"
    (http_rule,) = gateway.http_restrictions
    assert http_rule.header == "k" and http_rule.groups == {"health"}


def test_a_bad_security_flag_stops_the_cli_with_its_message(tmp_path) -> None:
    from stageserve.cli import _settings, build_parser

    parser = build_parser()
    args = parser.parse_args(
        ["gateway", "--redis-url", "r", "--model-repository", str(tmp_path), "--grpc-use-ssl=true"]
    )
    with pytest.raises(SystemExit, match="--grpc-use-ssl needs --grpc-server-cert"):
        _settings(parser, args)


def _stage_tls_env(tmp_path) -> dict[str, str]:
    env = {}
    for name in ("cert", "key", "ca"):
        path = tmp_path / f"{name}.pem"
        path.write_text(f"{name} pem")
        env[f"STAGESERVE_STAGE_TLS_{name.upper()}"] = str(path)
    return env


def test_the_stage_tls_section_holds_the_files_read_once(tmp_path) -> None:
    env = _stage_tls_env(tmp_path) | {"STAGESERVE_STAGE_TLS_SERVER_NAME": "stages.internal"}
    tls = settings_from_env(env).stage_tls
    assert tls is not None
    assert (tls.cert, tls.key, tls.ca) == (b"cert pem", b"key pem", b"ca pem")
    assert tls.server_name == "stages.internal"
    (tmp_path / "key.pem").unlink()  # the tree keeps what it read
    assert tls.key == b"key pem"
    # A logged tree does not carry the private key.
    assert "key pem" not in repr(settings_from_env(_stage_tls_env(tmp_path)))
    assert settings_from_env({}).stage_tls is None


def test_a_half_configured_stage_tls_stops_the_tree(tmp_path) -> None:
    env = _stage_tls_env(tmp_path)
    del env["STAGESERVE_STAGE_TLS_CA"]
    with pytest.raises(ValueError, match="missing STAGESERVE_STAGE_TLS_CA"):
        settings_from_env(env)


def test_flags_keep_the_environments_stage_tls_and_grpc_io(tmp_path) -> None:
    env = _stage_tls_env(tmp_path) | {"GRPC_EXPERIMENTS": "event_engine_client"}
    s = settings_from({"device": "cpu"}, env)
    assert s.worker.device == "cpu"
    assert s.stage_tls == settings_from_env(env).stage_tls is not None
    assert s.grpc_io.experiments == "event_engine_client"


def test_the_cli_hands_the_environments_tree_on(tmp_path) -> None:
    from stageserve.cli import _settings, build_parser

    environment = settings_from_env(_stage_tls_env(tmp_path))
    parser = build_parser()
    args = parser.parse_args(["worker", "--redis-url", "r", "--device", "cpu"])
    s = _settings(parser, args, environment)
    assert s.stage_tls is environment.stage_tls
    assert s.worker.device == "cpu"


def test_the_cli_stops_on_a_bad_environment_before_parsing(monkeypatch, capsys) -> None:
    from stageserve.cli import main

    monkeypatch.setenv("STAGESERVE_STAGE_TLS_CERT", "/nonexistent/cert.pem")
    assert main(["worker"]) == 2
    err = capsys.readouterr().err
    assert "stage TLS needs" in err and "missing STAGESERVE_STAGE_TLS_KEY" in err
    monkeypatch.delenv("STAGESERVE_STAGE_TLS_CERT")
    monkeypatch.setenv("STAGESERVE_WORKER_LEASE_MS", "soon")
    assert main(["worker"]) == 2
    assert "STAGESERVE_WORKER_LEASE_MS='soon': expected int" in capsys.readouterr().err


def test_the_rate_limiter_child_of_up_gets_the_trees_section_again() -> None:
    from services.ratelimiter.options import rate_limit_argv
    from stageserve.cli import _settings, build_parser

    parser = build_parser()
    up_argv = ["up", "--rate-limit", "execution_count", "--rate-limit-resource", "R:4"]
    up_argv += ["--rate-limit-resource", "G:2:0", "--rate-limit-resource", "mem@x:7"]
    up = _settings(parser, parser.parse_args(up_argv)).ratelimiter
    assert up.resources == (("R", 4), ("G@0", 2), ("mem@x", 7))
    child_argv = ["ratelimiter", "--redis-url", "r", *rate_limit_argv(up.mode, up.resources)]
    assert _settings(parser, parser.parse_args(child_argv)).ratelimiter == up


def test_a_text_field_takes_one_of_its_choices() -> None:
    assert GatewaySettings().http_server == "uvicorn"
    env = {"STAGESERVE_GATEWAY_HTTP_SERVER": "granian"}
    assert settings_from_env(env).gateway.http_server == "granian"
    with pytest.raises(
        ValueError, match="STAGESERVE_GATEWAY_HTTP_SERVER='nginx': expected uvicorn or granian"
    ):
        settings_from_env({"STAGESERVE_GATEWAY_HTTP_SERVER": "nginx"})


def test_a_flag_fields_own_variable_is_checked_like_the_others() -> None:
    env = {"STAGESERVE_ADAPTIVE_BATCH_DELAY_US": "300"}
    assert settings_from_env(env).scheduler.adaptive_batch_delay_us == 300
    assert settings_from({"adaptive_batch_delay_us": 7}, env).scheduler.adaptive_batch_delay_us == 7
    with pytest.raises(ValueError, match="STAGESERVE_ADAPTIVE_BATCH_DELAY_US='soon': expected int"):
        settings_from_env({"STAGESERVE_ADAPTIVE_BATCH_DELAY_US": "soon"})
