"""`stageserve up` hands tritonserver's log flags (--log-format, --log-info,
--log-warning, --log-error, --log-file) to every stage it starts, and to a
stage its supervisor starts again: each stage's own lines follow them."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stageserve.log_options import STAGES
from tests.integration.up_process import UpProcess, json_line
from tests.stack import wait_until

# Triton's ISO8601 line as stageserve/logs.py writes it: time, level letter,
# pid, service, where] message.
ISO_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ([IWEV]) (\d+) (\S+) \S+:\d+\] ")


@dataclass
class Stacks:
    iso: UpProcess  # --log-format ISO8601 --log-file <iso_log>
    iso_log: Path
    quiet: UpProcess  # --log-info false, on stderr


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stacks]:
    """Both stacks start at once (an empty repository: the stages alone)."""
    root = tmp_path_factory.mktemp("up_log_flags")
    repository = root / "models"
    repository.mkdir()
    iso_log = root / "stack.log"
    iso = UpProcess(repository, ["--log-format", "ISO8601", f"--log-file={iso_log}"])
    try:
        quiet = UpProcess(repository, ["--log-info", "false"])
        try:
            assert iso.wait(120) is not None, "".join(iso.err[-20:])
            assert quiet.wait(120) is not None, "".join(quiet.err[-20:])
            yield Stacks(iso, iso_log, quiet)
        finally:
            quiet.stop()
    finally:
        iso.stop()


def _iso_lines(path: Path) -> list[re.Match[str]]:
    """Every line of the file, parsed; a line that is not ISO8601 fails."""
    lines = path.read_text().splitlines() if path.exists() else []
    parsed = [ISO_LINE.match(line) for line in lines]
    bad = [line for line, m in zip(lines, parsed, strict=True) if m is None]
    assert not bad, f"lines not in Triton's ISO8601 format: {bad[:3]}"
    return [m for m in parsed if m is not None]


def _serving_pids(path: Path) -> dict[str, set[int]]:
    """The pids that logged "serving", by service."""
    out: dict[str, set[int]] = {}
    for line in path.read_text().splitlines():
        m = ISO_LINE.match(line)
        if m is not None and "] serving " in line:
            out.setdefault(m.group(3), set()).add(int(m.group(2)))
    return out


def test_every_stage_logs_iso8601_to_the_log_file(stacks: Stacks) -> None:
    info = stacks.iso.info()
    assert info is not None
    pids = info["pids"]
    assert wait_until(lambda: set(_serving_pids(stacks.iso_log)) >= set(STAGES), 30), (
        stacks.iso_log.read_text()[-2000:]
    )
    lines = _iso_lines(stacks.iso_log)
    by_stage = {(m.group(3), int(m.group(2))) for m in lines}
    for name, stage in (
        ("ratelimiter", "ratelimiter"),
        ("scheduler", "scheduler"),
        ("worker-0", "worker"),
        ("gateway", "gateway"),
    ):
        assert (stage, pids[name]) in by_stage, f"{name} wrote no ISO8601 line to --log-file"
    # Nothing of the stages' reaches stderr: --log-file is where they log.
    stage_lines = [e for e in map(json_line, stacks.iso.err) if e.get("service") in STAGES]
    assert not stage_lines, stage_lines[:3]


def test_a_restarted_stage_keeps_the_log_flags(stacks: Stacks) -> None:
    info = stacks.iso.info()
    assert info is not None
    old = info["pids"]["scheduler"]
    assert wait_until(lambda: old in _serving_pids(stacks.iso_log).get("scheduler", set()), 30)
    os.kill(old, signal.SIGKILL)
    assert wait_until(lambda: _serving_pids(stacks.iso_log).get("scheduler", set()) - {old}, 60), (
        "the restarted scheduler logged no ISO8601 'serving' line to --log-file"
    )
    _iso_lines(stacks.iso_log)


def test_log_info_false_silences_every_stage_info_line(stacks: Stacks) -> None:
    """Each stage logs "serving" at INFO before it announces itself, and
    "stopping" when `up` stops it: with --log-info false neither reaches
    stderr from any stage over the stack's whole run."""
    stacks.quiet.stop()  # every stage has exited and its stderr is read to the end
    entries = [json_line(line) for line in stacks.quiet.err]
    stage_entries = [e for e in entries if e.get("service") in STAGES]
    info_lines = [e for e in stage_entries if e.get("level") == "info"]
    assert not info_lines, f"INFO lines with --log-info false: {info_lines[:3]}"
