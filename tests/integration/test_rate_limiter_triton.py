"""Rate-limiter priorities against real Triton 2.51: the same Python-backend
model(s), the same load, the pick counts of priority 1 and priority 4 compared.

bench/triton_priority.py holds the model and the load: two instances (p1,
p4) needing the one count of resource R, each execution sleeping 5 ms and
answering its instance's name; 8 clients keep both instances waiting for R,
so every pick is contended. Two layouts: one model with two instance groups,
and two models of one group each (a global R). Measured on the 2-core dev
machine: Triton 3.98-4.01 p1 picks per p4 pick in both layouts, StageServe
3.97-4.02 (before the Python backend registered its groups' rate_limiter,
StageServe's one-model ratio was 1.00: R was not held at all).

Needs .venv-triton (scripts/install_references.sh triton); skips cleanly
without it. About 20 s per layout: the servers run one after the other.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.references import ReferenceNotInstalled, find_triton
from bench.triton_priority import LAYOUTS, TritonServer, picks, ratio, write_repository
from tests.integration.helpers import stack_retrying

SECONDS = 4.0
CLIENTS = 8
#: StageServe's ratio / Triton's may differ by this much (measured: < 1%)
TOLERANCE = 0.15


@pytest.mark.parametrize("layout", LAYOUTS)
def test_priorities_1_and_4_pick_as_real_triton(tmp_path: Path, layout: str) -> None:
    try:
        find_triton()
    except ReferenceNotInstalled as exc:
        pytest.skip(str(exc))
    triton = TritonServer(tmp_path / "triton", layout)
    try:
        theirs = picks(triton.url, SECONDS, CLIENTS, layout)
    finally:
        triton.stop()
    repo = write_repository(tmp_path / "stageserve", layout)
    with stack_retrying(repo, ratelimiter_args=("--rate-limit", "execution_count")) as running:
        ours = picks(running.url, SECONDS, CLIENTS, layout)
    print(f"{layout}: Triton {dict(theirs)}, ours {dict(ours)}")
    # enough picks that a ratio means something, on both sides
    assert theirs["p4_0"] >= 20 and ours["p4_0"] >= 20, (theirs, ours)
    # the setup really contends (priorities matter): otherwise 1:1 would "match"
    assert ratio(theirs) > 2.0, theirs
    assert abs(ratio(ours) / ratio(theirs) - 1) <= TOLERANCE, (theirs, ours)
