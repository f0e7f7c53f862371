"""`python -m bench.chaos`: kill -9 each stage under steady load and watch it heal.

Starts a supervised stack (as `stageserve up` runs it) on the example
repository, drives it with tritonclient threads (most send `simple`, one
runs `accumulator` sequences and checks every running sum, and from three
clients up one sends 48 KiB tensors to `identity_fp32`, which travel
through shared memory, and checks them byte for byte), and for each
stage in turn: measures the throughput of the seconds before, kill -9s the
stage's process (Redis included: it comes back empty), and reports

- requests ok / failed / hung (no answer within HUNG_S) / wrong (an answer
  that is not the model's), for requests that ended in the window;
- seconds from the kill to the first success of a request sent after it,
  and to full throughput (the first 1 s window with >= FULL_FRACTION of the
  pre-kill rate);
- an audit of Redis at the end of the window (bench/chaos_audit.py: grants,
  resource counts, sequence slots that nobody holds);
and once the load stopped, the shared-memory tensor slots still held in
the stack's regions (bench/chaos_audit.tensor_slots_in_use; 0, or a leak).

  python -m bench.chaos                       # every stage, 8 clients, 8 s windows
  python -m bench.chaos --stages worker-0 redis --window-s 5 --clients 4

Goals (issue 14): 0 hung, 0 wrong, 0 leaked, full throughput within 5 s;
(issue 26) 0 tensor slots held after the load.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from bench.chaos_audit import Audit, audit_redis, tensor_slots_in_use
from stageserve.launcher import Stack, start_services
from stageserve.tensor_shm import SHM_LOST_AFTER_S, SHM_RECLAIM_EVERY_S
from stageserve_tools.examples import build_example_repository

STAGES = ("worker-0", "scheduler", "ratelimiter", "gateway", "redis")
#: More stages to pick with --stages once there are more gateways (--gateways N)
#: or schedulers (--schedulers N): `gateway-1` is the second gateway on the same
#: ports, `scheduler-1` the second scheduler (its models move to the first).
EXTRA_STAGES = ("gateway-1", "scheduler-1")
HUNG_S = 10.0  # a call with no answer by then is hung (the client's deadline)
FULL_FRACTION = 0.8  # "full throughput": this share of the pre-kill rate, per second
SEQUENCE_LENGTH = 5
PYTHON_TEXT = ("Traceback", "<class '", "Exception:")
LARGE_ELEMENTS = 12_288  # FP32: 48 KiB, over tensor_shm_min_bytes (16 KiB)
#: Answers in flight when the load stopped are taken within a few seconds; an
#: answer lost with a killed scheduler leaves its output slots to the worker's
#: periodic reclaim (stageserve/tensor_shm.py), which frees them by this.
SLOTS_SETTLE_S = SHM_LOST_AFTER_S + 2 * SHM_RECLAIM_EVERY_S + 3.0


@dataclass(frozen=True)
class Call:
    start: float
    end: float
    outcome: str  # ok | failed | hung | wrong
    detail: str = ""


class Load:
    """Client threads calling the stack back to back until stopped."""

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._cids = itertools.count(1)
        self._threads = [
            threading.Thread(target=self._simple, args=(i,), daemon=True)
            for i in range(max(1, clients - 1) - (clients >= 3))
        ]
        if clients >= 3:
            self._threads.append(threading.Thread(target=self._large, daemon=True))
        if clients > 1:
            self._threads.append(threading.Thread(target=self._sequences, daemon=True))

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(HUNG_S + 5)

    def _record(self, start: float, outcome: str, detail: str = "") -> None:
        with self._lock:
            self.calls.append(Call(start, time.monotonic(), outcome, detail))

    def _simple(self, seed: int) -> None:
        client = grpcclient.InferenceServerClient(self.url)
        rng = np.random.default_rng(seed)
        while not self._stop.is_set():
            a = rng.integers(-1000, 1000, (1, 16), dtype=np.int32)
            b = rng.integers(-1000, 1000, (1, 16), dtype=np.int32)
            inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            start = time.monotonic()
            try:
                result = client.infer("simple", inputs, client_timeout=HUNG_S)
            except InferenceServerException as exc:
                self._failure(start, exc)
                continue
            right = np.array_equal(result.as_numpy("OUTPUT0"), a + b) and np.array_equal(
                result.as_numpy("OUTPUT1"), a - b
            )
            self._record(start, "ok" if right else "wrong")

    def _large(self) -> None:
        """identity_fp32 with 48 KiB inputs: through shared memory (on by
        default), byte-exact or wrong."""
        client = grpcclient.InferenceServerClient(self.url)
        rng = np.random.default_rng(7)
        while not self._stop.is_set():
            x = rng.standard_normal((1, LARGE_ELEMENTS), dtype=np.float32)
            inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            start = time.monotonic()
            try:
                result = client.infer("identity_fp32", [inp], client_timeout=HUNG_S)
            except InferenceServerException as exc:
                self._failure(start, exc)
                continue
            right = result.as_numpy("OUTPUT0").tobytes() == x.tobytes()
            self._record(start, "ok" if right else "wrong", "identity_fp32 bytes differ")

    def _sequences(self) -> None:
        """accumulator: OUTPUT is the running sum since START. A sequence whose
        state was lost must fail, never restart from zero (that would be a
        wrong sum); after any failure a new sequence starts."""
        client = grpcclient.InferenceServerClient(self.url)
        while not self._stop.is_set():
            cid, total = next(self._cids) + 10_000_000, 0
            for step in range(SEQUENCE_LENGTH):
                value = step + 1
                total += value
                inp = grpcclient.InferInput("INPUT", [1, 1], "INT32")
                inp.set_data_from_numpy(np.array([[value]], dtype=np.int32))
                start = time.monotonic()
                try:
                    result = client.infer(
                        "accumulator",
                        [inp],
                        sequence_id=cid,
                        sequence_start=step == 0,
                        sequence_end=step == SEQUENCE_LENGTH - 1,
                        client_timeout=HUNG_S,
                    )
                except InferenceServerException as exc:
                    self._failure(start, exc)
                    break
                got = int(result.as_numpy("OUTPUT").reshape(-1)[0])
                self._record(start, "ok" if got == total else "wrong", f"{got} != {total}")
                if got != total:
                    break

    def _failure(self, start: float, exc: InferenceServerException) -> None:
        status = exc.status() or ""
        hung = "DEADLINE_EXCEEDED" in status
        self._record(start, "hung" if hung else "failed", f"{status}: {exc.message()}")
        if not hung:
            time.sleep(0.02)  # failures are fast; do not spin

    def ok_rate(self, since: float, until: float) -> float:
        with self._lock:
            n = sum(1 for c in self.calls if c.outcome == "ok" and since <= c.end < until)
        return n / max(until - since, 1e-9)


@dataclass
class ChaosRun:
    """Every stage's result, and the tensor slots held once the load stopped."""

    results: list[StageResult]
    tensor_slots: int


@dataclass
class StageResult:
    stage: str
    ok: int = 0
    failed: int = 0
    hung: int = 0
    wrong: int = 0
    first_ok_s: float | None = None
    full_s: float | None = None
    baseline_rps: float = 0.0
    audit: Audit | None = None
    errors: dict[str, int] = field(default_factory=dict)
    # Failures whose message carries Python exception text (house rule: never).
    python_text: int = 0
    # Calls that ended in the window's last second: healed means answers and
    # no failures there, whatever the throughput a busy machine allows.
    ok_last_s: int = 0
    failed_last_s: int = 0

    @property
    def leaked(self) -> int:
        return self.audit.leaked if self.audit is not None else -1


def _pid(stack: Stack, stage: str) -> int:
    return next(c.proc.pid for c in stack.children if c.name == stage)


def wait_steady(load: Load, reference_rps: float, timeout_s: float = 30.0) -> None:
    """Until the last second's rate is back to FULL_FRACTION of the reference
    (the previous kill's stage may still be recovering)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = time.monotonic()
        if load.ok_rate(now - 1.0, now) >= FULL_FRACTION * reference_rps:
            return
        time.sleep(0.2)


def healed(load: Load, now: float) -> bool:
    """The last second's finished calls answered, and none failed."""
    last = [c for c in list(load.calls) if now - 1.0 <= c.end < now]
    return any(c.outcome == "ok" for c in last) and all(c.outcome == "ok" for c in last)


def measure(
    stack: Stack,
    load: Load,
    redis_url: str,
    stage: str,
    baseline_s: float,
    window_s: float,
    heal_s: float = 0.0,
) -> tuple[StageResult, float, float]:
    """Kill one stage after baseline_s of load; the window that follows is
    judged later (judge): window_s, or longer, up to heal_s, until the
    stage healed (a restart takes longer on a busy machine). Returns the
    result so far, the kill's time and the window's length."""
    time.sleep(baseline_s)
    kill_at = time.monotonic()
    baseline = load.ok_rate(kill_at - baseline_s, kill_at)
    os.kill(_pid(stack, stage), signal.SIGKILL)
    time.sleep(window_s)
    while time.monotonic() - kill_at < heal_s and not healed(load, time.monotonic()):
        time.sleep(0.25)
    window = time.monotonic() - kill_at
    audit = audit_redis(redis_url)
    return StageResult(stage, baseline_rps=baseline, audit=audit), kill_at, window


def judge(load: Load, result: StageResult, kill_at: float, window_s: float) -> StageResult:
    """Fill the counts and recovery times from the calls (after the load stopped,
    so every call in the window has its outcome)."""
    calls = [c for c in load.calls if kill_at <= c.end < kill_at + window_s]
    for c in calls:
        setattr(result, c.outcome, getattr(result, c.outcome) + 1)
        if c.outcome != "ok":
            key = c.detail.split(":", 1)[0] or c.outcome
            result.errors[key] = result.errors.get(key, 0) + 1
            if any(mark in c.detail for mark in PYTHON_TEXT):
                result.python_text += 1
    last_s = kill_at + window_s - 1.0
    result.ok_last_s = sum(1 for c in calls if c.end >= last_s and c.outcome == "ok")
    result.failed_last_s = sum(1 for c in calls if c.end >= last_s and c.outcome != "ok")
    after = sorted(c.end for c in load.calls if c.outcome == "ok" and c.start >= kill_at)
    if after:
        result.first_ok_s = after[0] - kill_at
    target = FULL_FRACTION * result.baseline_rps
    t = kill_at
    while t + 1.0 <= kill_at + window_s:
        if sum(1 for e in after if t <= e < t + 1.0) >= target:
            result.full_s = t - kill_at
            break
        t += 0.1
    return result


def settled_tensor_slots(redis_url: str, within_s: float = SLOTS_SETTLE_S) -> int:
    """The stack's shared-memory tensor slots in use once they settle to 0
    (within `within_s`), or the count left then: a leak."""
    deadline = time.monotonic() + within_s
    while True:
        held = tensor_slots_in_use(redis_url)
        if held == 0 or time.monotonic() >= deadline:
            return held
        time.sleep(0.2)


def run_chaos(
    repository: Path,
    stages: tuple[str, ...] = STAGES,
    clients: int = 8,
    baseline_s: float = 3.0,
    window_s: float = 8.0,
    settle_s: float = 2.0,
    gateways: int = 1,
    heal_s: float = 0.0,
    schedulers: int = 1,
) -> ChaosRun:
    """`gateways`: gateway processes on the one port (`stageserve up --gateways`);
    `schedulers`: schedulers sharing the models (`--schedulers`);
    `heal_s`: a window goes on past window_s, up to heal_s, until healed."""
    stack = Stack()
    try:
        services = start_services(
            stack, repository, device="cpu", gateways=gateways, schedulers=schedulers
        )
        stack.supervise()
        load = Load(services.gateway.address, clients)
        load.start()
        time.sleep(settle_s)
        now = time.monotonic()
        reference = load.ok_rate(now - settle_s / 2, now)
        results: list[tuple[StageResult, float, float]] = []
        for stage in stages:
            wait_steady(load, reference)
            results.append(
                measure(stack, load, services.redis_url, stage, baseline_s, window_s, heal_s)
            )
        load.stop()
        slots = settled_tensor_slots(services.redis_url)
        return ChaosRun([judge(load, r, k, w) for r, k, w in results], slots)
    finally:
        stack.stop()


def table(results: list[StageResult]) -> str:
    def s(x: float | None) -> str:
        return "never" if x is None else f"{x:.1f}"

    rows = [
        "| stage killed | ok | failed | hung | wrong | first success (s) | full throughput (s) "
        "| req/s before | leaked | audit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r.stage} | {r.ok} | {r.failed} | {r.hung} | {r.wrong} | {s(r.first_ok_s)} "
            f"| {s(r.full_s)} | {r.baseline_rps:.0f} | {r.leaked} "
            f"| {r.audit.summary() if r.audit else ''} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__)
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES + EXTRA_STAGES)
    p.add_argument(
        "--gateways", type=int, default=1, help="gateways on the one port (gateway-1: the 2nd)"
    )
    p.add_argument(
        "--schedulers", type=int, default=1, help="schedulers sharing the models (scheduler-1)"
    )
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--baseline-s", type=float, default=3.0)
    p.add_argument("--window-s", type=float, default=8.0)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stageserve-chaos-") as tmp:
        repository = Path(tmp) / "repository"
        build_example_repository(repository)
        if "gateway-1" in args.stages and args.gateways < 2:
            p.error("--stages gateway-1 needs --gateways 2 or more")
        if "scheduler-1" in args.stages and args.schedulers < 2:
            p.error("--stages scheduler-1 needs --schedulers 2 or more")
        run = run_chaos(
            repository,
            tuple(args.stages),
            args.clients,
            args.baseline_s,
            args.window_s,
            gateways=args.gateways,
            schedulers=args.schedulers,
        )
    results = run.results
    print(table(results))
    print(f"shared-memory tensor slots held after the load: {run.tensor_slots}")
    for r in results:
        if r.errors:
            print(f"{r.stage}: failures by status: {r.errors}")
    goals = run.tensor_slots == 0 and all(
        r.hung == 0 and r.wrong == 0 and r.leaked == 0 and r.full_s is not None and r.full_s <= 5
        for r in results
    )
    print("goals met" if goals else "goals NOT met")
    return 0 if goals else 1


if __name__ == "__main__":
    sys.exit(main())
