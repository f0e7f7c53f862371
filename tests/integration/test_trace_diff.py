"""StageServe's trace settings against real Triton 2.51 (bench.trace_diff):
every TraceSetting read, update, clear, inheritance step, count decrement and
error, on the gRPC and the HTTP front, answers as Triton's does, or the
difference is documented (bench.trace_diff.DOCUMENTED).

Needs .venv-triton (scripts/install_references.sh triton); skips without it.
About 15 s: the servers run one after the other.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.references import ReferenceNotInstalled, find_triton
from bench.trace_diff import DOCUMENTED, STEPS, differences, report, run_stageserve, run_triton


def test_trace_settings_answer_as_triton(tmp_path: Path) -> None:
    try:
        find_triton()
    except ReferenceNotInstalled as exc:
        pytest.skip(str(exc))
    theirs = run_triton(tmp_path)
    ours = run_stageserve(tmp_path)
    diffs = differences(theirs, ours)
    assert not [d for d in diffs if not d.documented], report(diffs)
    assert set(DOCUMENTED) <= {s.name for s in STEPS}
