"""StageServe against real Triton 2.51: every step of bench.triton_diff, on the gRPC
and the HTTP front, answers the same status code (and message, where the step
compares it), or the difference is documented (bench.triton_diff.DOCUMENTED).

Needs .venv-triton (scripts/install_references.sh triton); skips cleanly without
it. About 20 s: the servers run one after the other.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.references import ReferenceNotInstalled, find_triton
from bench.triton_diff import DOCUMENTED, STEPS, differences, report, run, side_by_side


def test_every_difference_from_triton_is_documented(tmp_path: Path) -> None:
    try:
        find_triton()
    except ReferenceNotInstalled as exc:
        pytest.skip(str(exc))
    theirs, ours = run(tmp_path)
    diffs = differences(theirs, ours)
    undocumented = [d for d in diffs if not d.documented]
    assert not undocumented, report(diffs) + "\n\n" + side_by_side(theirs, ours)
    # the documented list names real steps (a renamed step must not hide a difference)
    assert set(DOCUMENTED) <= {s.name for s in STEPS}
