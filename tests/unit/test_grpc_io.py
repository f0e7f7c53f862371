"""stageserve/grpc_io.py: the settings tree's grpc I/O path, from the environment
(a user's GRPC_EXPERIMENTS wins), written back before grpc loads."""

import subprocess
import sys

import pytest

from stageserve.grpc_io import GRPC_EXPERIMENTS, GrpcIo, choose_grpc_io, from_environ, use_grpc_io
from stageserve.settings import settings_from_env


def test_the_tree_holds_the_iomgr_path_when_the_user_chose_none():
    assert from_environ({}) == GrpcIo(GRPC_EXPERIMENTS)
    assert settings_from_env({}).grpc_io.experiments == GRPC_EXPERIMENTS


@pytest.mark.parametrize("value", ["event_engine_client", ""])
def test_a_user_value_wins(value):
    assert settings_from_env({"GRPC_EXPERIMENTS": value}).grpc_io.experiments == value


def test_the_trees_value_is_written_where_grpc_reads_it():
    env: dict[str, str] = {"GRPC_EXPERIMENTS": "stale"}
    use_grpc_io(GrpcIo("event_engine_listener"), env)
    assert env == {"GRPC_EXPERIMENTS": "event_engine_listener"}


def test_a_child_environment_gets_the_same_choice():
    env: dict[str, str] = {}
    assert choose_grpc_io(env) == GRPC_EXPERIMENTS
    assert env == {"GRPC_EXPERIMENTS": GRPC_EXPERIMENTS}
    assert choose_grpc_io({"GRPC_EXPERIMENTS": "x"}) == "x"


def _python(code: str, env_value: str | None = None) -> subprocess.CompletedProcess:
    setup = "import os, sys; os.environ.pop('GRPC_EXPERIMENTS', None);"
    if env_value is not None:
        setup += f"os.environ['GRPC_EXPERIMENTS'] = {env_value!r};"
    return subprocess.run(
        [sys.executable, "-c", setup + code], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("user", [None, "event_engine_client"])
def test_the_cli_writes_the_trees_choice_before_grpc_is_imported(user):
    """`stageserve` imports grpc only after main() wrote the tree's value (a
    scheduler with no --redis-url gets that far, then stops at argument parsing)."""
    code = (
        "os.environ.pop('REDIS_URL', None);"
        "import stageserve.cli as cli; assert 'grpc' not in sys.modules;"
        "\ntry:\n    cli.main(['scheduler'])\nexcept SystemExit:\n    pass\n"
        "assert 'grpc' in sys.modules; print(os.environ['GRPC_EXPERIMENTS'])"
    )
    out = _python(code, user)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (user or GRPC_EXPERIMENTS)


def test_a_choice_made_after_grpc_was_imported_is_refused():
    out = _python(
        "import grpc; from stageserve.grpc_io import GrpcIo, use_grpc_io;"
        "use_grpc_io(GrpcIo('event_engine_client'))"
    )
    assert out.returncode == 1
    assert "grpc was imported before GRPC_EXPERIMENTS='event_engine_client'" in out.stderr
