"""A gateway `stageserve up`'s supervisor restarts rejoins serving, whatever
its startup load now finds.

`stageserve up` with Triton's defaults (--exit-on-error true) starts on a
repository whose models all load. A model that cannot load is then put in the
repository (in `none` control mode nothing picks it up), and the gateway is
killed. The restarted gateway loads every model of the repository again and
`bad` fails: --exit-on-error is about the server's start, so it must not exit
(the supervisor would start it again, for ever, and nothing would serve). It
serves `good`, says ServerReady false (--strict-readiness) and the index
gives `bad`'s reason; the supervisor's `stage restarted` line names `bad`.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import tritonclient.grpc as grpcclient

from tests.integration.startup_flags import write_probe_model
from tests.integration.up_process import UpProcess
from tests.stack import wait_until

BACK_BOUND_S = 60.0  # a gateway start under the shared machine's load (3 s at load 5)


def _restarted(up: UpProcess) -> list[dict]:
    return [e for e in up.logs("stage restarted") if e.get("stage") == "gateway"]


def test_a_restarted_gateway_serves_past_a_model_that_now_fails(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_probe_model(repo, "good", triton=False, corrupt=False)
    with UpProcess(repo) as up:
        info = up.wait(180)
        assert info is not None, "".join(up.err[-30:])
        assert up.events("model not loaded") == []

        write_probe_model(repo, "bad", triton=False, corrupt=True)
        os.kill(info["pids"]["gateway"], signal.SIGKILL)
        assert wait_until(lambda: _restarted(up) != [], BACK_BOUND_S), (
            "the gateway did not come back; stderr tail:\n" + "".join(up.err[-30:])
        )
        (restarted,) = _restarted(up)
        assert restarted["models_not_loaded"] == ["bad"]

        with grpcclient.InferenceServerClient(up.grpc_url()) as client:
            assert client.is_server_live()
            assert client.is_model_ready("good")
            assert not client.is_model_ready("bad")
            assert not client.is_server_ready()  # --strict-readiness, as Triton
            index = {m.name: m for m in client.get_model_repository_index().models}
            assert index["good"].state == "READY"
            assert index["bad"].state == "UNAVAILABLE"
            assert "protobuf" in index["bad"].reason.lower(), index["bad"].reason

        # It stays up: the one exit is the kill.
        time.sleep(3)
        exits = [e for e in up.logs("stage exited") if e.get("stage") == "gateway"]
        assert len(exits) == 1, exits
        assert up.proc.poll() is None
