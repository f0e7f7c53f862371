"""scripts/gpu_host_check.sh, dry: every command line of every step goes
through its program's own parser here (GPU_CHECK_DRY_RUN=1 skips the install;
a `python3` ahead on PATH makes each argparse parse end the process once it
parsed, and runs the GPU tests' pytest as --collect-only). A step whose flags
drifted from its bench's fails here, not in a GPU host's few minutes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ALL_STEPS = "tests scale onnx scaled http work seq scaleprof profile"
# The commands each step runs (scripts/gpu_host_check.sh): a new or dropped
# command changes this count on purpose.
COMMANDS = {
    "tests": 1,
    "scale": 6,
    "onnx": 3,
    "scaled": 3,
    "http": 1,
    "work": 3,
    "seq": 1,
    "scaleprof": 1,
    "profile": 1,
}

SITECUSTOMIZE = """\
import argparse
import os

if os.environ.get("GPU_CHECK_PARSE_ONLY"):
    _parse = argparse.ArgumentParser.parse_args

    def _parse_then_end(self, args=None, namespace=None):
        _parse(self, args, namespace)  # exits 2 with argparse's message on a bad flag
        print(f"dry run: {self.prog} parsed its arguments", flush=True)
        os._exit(0)

    argparse.ArgumentParser.parse_args = _parse_then_end
"""

PYTHON3 = """\
#!/usr/bin/env bash
export PYTHONPATH="{shim}:${{PYTHONPATH:-}}"
if [ "${{1:-}}" = -m ] && [ "${{2:-}}" = pytest ]; then
  exec {python} "$@" --collect-only -q
fi
GPU_CHECK_PARSE_ONLY=1 exec {python} "$@"
"""


def test_every_step_command_parses(tmp_path: Path) -> None:
    shim, stubs, bundle, out = (tmp_path / d for d in ("shim", "bin", "bundle", "out"))
    for folder in (shim, stubs, bundle, out):
        folder.mkdir()
    (shim / "sitecustomize.py").write_text(SITECUSTOMIZE)
    python3 = stubs / "python3"
    python3.write_text(PYTHON3.format(shim=shim, python=sys.executable))
    python3.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "OUT": str(out),
        "GPU_CHECK_DRY_RUN": "1",
    }
    done = subprocess.run(
        ["bash", "scripts/gpu_host_check.sh", str(bundle), "900", ALL_STEPS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = (out / "steps.txt").read_text()
    assert "skipped" not in steps, steps
    # Most important first: a step that runs long cuts only the ones after it.
    started = [
        line.split("] ", 1)[1].split(" ", 1)[0] for line in steps.splitlines() if "] " in line
    ]
    order = [step for step in dict.fromkeys(started) if step in COMMANDS]
    assert order == ALL_STEPS.split(), order
    for step, count in COMMANDS.items():
        text = (out / f"{step}.txt").read_text()
        runs = re.split(r"^== ", text, flags=re.MULTILINE)[1:]
        assert len(runs) == count, f"{step}: {len(runs)} commands, expected {count}\n{text}"
        for run in runs:
            command = run.splitlines()[0]
            assert run.rstrip().endswith("exit 0"), f"{step}: {command}\n{run[-2000:]}"
            if step == "tests":
                counts = re.findall(r"^tests/\S+\.py: (\d+)$", run, flags=re.MULTILINE)
                assert sum(map(int, counts)) > 0, run[-2000:]  # GPU-marked tests collected
            else:
                assert "parsed its arguments" in run, f"{step}: {command}\n{run[-2000:]}"
    # The scale step's last run puts every stage on asyncio's loop, named in its header.
    scale_headers = re.findall(r"^== .*$", (out / "scale.txt").read_text(), flags=re.MULTILINE)
    loops = [h.rsplit("event loop ", 1)[1].rstrip(")") for h in scale_headers]
    assert loops == ["uvloop"] * 5 + ["asyncio"], scale_headers
