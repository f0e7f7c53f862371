"""`stageserve up --exit-on-error / --strict-readiness` as Triton 2.51 has them.

TRITON_2_51 is what real tritonserver 2.51 did with a model whose model.onnx
is corrupt at startup (tests/integration/startup_flags.py probes both servers
the same way; `python -m tests.integration.startup_flags` records Triton's
table again). StageServe must match it cell for cell, and print one startup
summary line for the model that failed, with the reason. The last test
re-checks the table against Triton itself when .venv-triton is installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.references import ReferenceNotInstalled, find_triton
from tests.integration.startup_flags import Outcome, probe_stageserve, probe_triton

# (mode, exit_on_error, strict_readiness) -> outcome; gRPC and HTTP answered alike.
TRITON_2_51 = {
    ("none", True, True): Outcome(exit_code=1),
    ("none", True, False): Outcome(exit_code=1),
    ("none", False, True): Outcome(None, live=True, ready=False, good_ready=True, bad_ready=False),
    ("none", False, False): Outcome(None, live=True, ready=True, good_ready=True, bad_ready=False),
    ("explicit", True, True): Outcome(exit_code=1),
    ("explicit", True, False): Outcome(exit_code=1),
    ("explicit", False, True): Outcome(
        None, live=True, ready=False, good_ready=True, bad_ready=False
    ),
    ("explicit", False, False): Outcome(
        None, live=True, ready=True, good_ready=True, bad_ready=False
    ),
}


@pytest.mark.parametrize(("mode", "exit_on_error", "strict"), sorted(TRITON_2_51))
def test_startup_flags_match_triton(
    tmp_path: Path, mode: str, exit_on_error: bool, strict: bool
) -> None:
    outcome, summary = probe_stageserve(tmp_path, mode, exit_on_error, strict)
    assert outcome == TRITON_2_51[(mode, exit_on_error, strict)]
    # The summary names the failed model, and only it, with the reason its load gave.
    assert [(s["model"], s["version"]) for s in summary] == [("bad", "1")], summary
    assert "onnx" in summary[0]["reason"].lower() or "protobuf" in summary[0]["reason"].lower()


def test_triton_still_answers_as_recorded(tmp_path: Path) -> None:
    try:
        find_triton()
    except ReferenceNotInstalled as exc:
        pytest.skip(str(exc))
    differ = []
    for cell, want in TRITON_2_51.items():
        got, log = probe_triton(tmp_path, *cell)
        if got != want:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            differ.append(f"{cell}: Triton gave {got}, recorded {want}; {log.name} ends:\n{tail}")
    assert not differ, "\n\n".join(differ)
