"""py-spy profiles of every stage while perf_analyzer runs (`python -m bench --profile DIR`).

The hot path is measured, not guessed: each stage process is sampled with
``py-spy record --format raw`` (collapsed stacks, one ``frame;frame;... count``
line per distinct stack) for the whole measurement, and the summary prints,
per stage, the frames with the most *self* samples (where the CPU is spent)
and the share of samples *inside* a few frames we care about (grpc.aio's
machinery, protobuf, our own modules). py-spy is meant to skip idle threads,
but on these machines its samples include threads blocked in a wait (the
event loop's epoll, an executor thread's queue get): at c=1 those were 60-85%
of every stage's samples, which made the shares say little. Stacks whose leaf
is such a wait (IDLE_LEAVES) are counted apart and left out of the shares.
A leaf `Thread.run (threading.py)` is a thread inside C code, mostly grpc's
poller: its work and its own epoll wait look alike without ``--native``;
so is a leaf `Runner.run (asyncio/runners.py)` under uvloop's loop, which
is counted as a wait (UVLOOP_LEAF).

py-spy is a development tool, not a dependency: ``pip install py-spy``.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# "frame (file:line)" in py-spy's raw output; the leaf is the last frame.
_FRAME_LINE = re.compile(r"\s*\(([^)]*?)(?::\d+)?\)$")

#: Substrings of a frame's file that group samples into areas (first match wins).
AREAS: tuple[tuple[str, str], ...] = (
    ("grpc/_cython", "grpc cython"),
    ("grpc/aio", "grpc.aio python"),
    ("google/protobuf", "protobuf"),
    ("asyncio/", "asyncio"),
    ("services/", "stageserve services"),
    ("stageserve/", "stageserve lib"),
    ("onnxruntime", "onnxruntime"),
    ("numpy", "numpy"),
    ("redis", "redis client"),
)


#: Leaf frames that mean "blocked, waiting", not work: (function, file) pairs
#: matched against py-spy's "function (file:line)" leaf; native frames too.
IDLE_LEAVES: tuple[tuple[str, str], ...] = (
    ("select", "selectors.py"),  # the asyncio loop's epoll
    ("_worker", "concurrent/futures/thread.py"),  # an executor thread's queue get
    ("wait", "threading.py"),
    ("epoll_wait", ""),
    ("poll", "libc.so"),
    ("sem_wait", ""),
    ("pthread_cond_wait", ""),
    ("pthread_cond_timedwait", ""),
)


#: uvloop's loop (stageserve/event_loop.py) runs in C under asyncio's
#: Runner.run: a leaf there is the loop inside its own code, which without
#: ``--native`` shows its epoll wait and its socket and timer work alike.
#: Counted as a wait: at c=64 such samples were 40-50 % of the scheduler's,
#: the worker's and the rate limiter's, as much as their idle share.
UVLOOP_LEAF = "Runner.run (asyncio/runners.py"


def is_idle(frame: str) -> bool:
    if frame.startswith(UVLOOP_LEAF):
        return True
    function, _, where = frame.partition(" (")
    name = function.rpartition(".")[2]  # "EpollSelector.select" -> "select"
    return any(name == fn and (not file or file in where) for fn, file in IDLE_LEAVES)


@dataclass
class Profile:
    stage: str
    samples: int  # on CPU: idle samples left out
    self_frames: Counter[str]
    areas: Counter[str]
    idle: int = 0  # samples of threads blocked in a wait (IDLE_LEAVES)
    # on-CPU samples of the asyncio event loop's thread: a stage's own Python
    # work runs there, grpc's poller (`Thread.run` without --native) does not
    loop: int = 0


def _frame_file(frame: str) -> str:
    m = _FRAME_LINE.search(frame)
    return m.group(1) if m else frame


def area_of(frame: str) -> str:
    path = _frame_file(frame)
    for needle, area in AREAS:
        if needle in path:
            return area
    return "other"


#: a frame of the thread that runs the event loop: asyncio's run_forever, or
#: for uvloop's loop (C, no frames of its own) the Runner above it
_LOOP_FRAMES = ("run_forever (asyncio/base_events.py", "Runner.run (asyncio/runners.py")


def parse_collapsed(lines: Iterable[str], stage: str) -> Profile:
    """A Profile from py-spy's raw (collapsed) output."""
    self_frames: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    samples = idle = loop = 0
    for line in lines:
        line = line.rstrip("\n")
        if not line:
            continue
        stack, _, count_text = line.rpartition(" ")
        try:
            count = int(count_text)
        except ValueError:
            continue
        frames = stack.split(";")
        leaf = frames[-1]
        if is_idle(leaf):
            idle += count
            continue
        samples += count
        self_frames[leaf] += count
        areas[area_of(leaf)] += count
        if any(marker in frame for frame in frames for marker in _LOOP_FRAMES):
            loop += count
    return Profile(stage, samples, self_frames, areas, idle, loop)


def format_profile(profile: Profile, top: int = 12) -> str:
    if not profile.samples:
        return f"{profile.stage}: no samples"
    out = [
        f"{profile.stage}: {profile.samples} samples on CPU ({profile.idle} blocked in a wait,"
        f" left out); the event loop's thread {profile.loop / profile.samples:.0%}"
    ]
    out.append(
        "  by area (self): "
        + ", ".join(f"{area} {n / profile.samples:.0%}" for area, n in profile.areas.most_common())
    )
    for frame, n in profile.self_frames.most_common(top):
        out.append(f"  {n / profile.samples:6.1%}  {frame}")
    return "\n".join(out)


class Recorder:
    """py-spy record on several processes at once, stopped together."""

    def __init__(self, out_dir: Path, rate: int = 250, native: bool = False) -> None:
        self.out_dir = out_dir
        self.rate = rate
        self.native = native  # C/Cython frames too (grpc's Cython core): slower sampling
        self._procs: list[tuple[str, Path, subprocess.Popen]] = []

    @staticmethod
    def executable() -> str | None:
        """py-spy on PATH, or beside this interpreter (a venv not activated)."""
        beside = Path(sys.executable).parent / "py-spy"
        return shutil.which("py-spy") or (str(beside) if beside.exists() else None)

    @classmethod
    def available(cls) -> bool:
        return cls.executable() is not None

    def start(self, targets: Sequence[tuple[str, int]], label: str) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for stage, pid in targets:
            path = self.out_dir / f"{label}-{stage}.txt"
            cmd = [
                self.executable() or "py-spy",
                "record",
                "--pid",
                str(pid),
                "--rate",
                str(self.rate),
                "--format",
                "raw",
                "--output",
                str(path),
                # py-spy cannot unwind native frames without pausing the process.
                *(["--native"] if self.native else ["--nonblocking"]),
            ]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._procs.append((stage, path, proc))

    def stop(self) -> list[Profile]:
        profiles = []
        for _, _, proc in self._procs:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for stage, path, proc in self._procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            lines = path.read_text().splitlines() if path.exists() else []
            profiles.append(parse_collapsed(lines, stage))
        self._procs = []
        return profiles
