"""The command line the supervisor restarts a stage with (launcher.Child.restart_cmd)."""

from __future__ import annotations

import subprocess

from stageserve.launcher import RESTART_FLAGS, Child


def _child(name: str, cmd: list[str], **kwargs) -> Child:
    proc: subprocess.Popen = None  # type: ignore[assignment]  # restart_cmd never reads it
    return Child(name, proc, cmd=cmd, **kwargs)


def test_a_restarted_gateway_does_not_exit_on_a_startup_model_error() -> None:
    cmd = ["stageserve", "gateway", "--listen", "127.0.0.1:0", "--exit-on-error", "true"]
    child = _child("gateway", cmd, address="127.0.0.1:8001", restart_flags=RESTART_FLAGS["gateway"])
    again = child.restart_cmd()
    assert again[again.index("--exit-on-error") + 1] == "false"
    assert again[again.index("--listen") + 1] == "127.0.0.1:8001"  # the address peers were given
    assert cmd[cmd.index("--exit-on-error") + 1] == "true"  # the first start's line is kept


def test_a_restart_flag_missing_from_the_line_is_added() -> None:
    child = _child("gateway", ["stageserve", "gateway"], restart_flags={"--exit-on-error": "false"})
    assert child.restart_cmd() == ["stageserve", "gateway", "--exit-on-error", "false"]


def test_other_stages_restart_with_their_own_flags() -> None:
    assert set(RESTART_FLAGS) == {"gateway"}
    cmd = ["stageserve", "worker", "--listen", "127.0.0.1:0"]
    child = _child("worker-0", cmd, address="127.0.0.1:5000", pin_address=False)
    assert child.restart_cmd() == cmd
