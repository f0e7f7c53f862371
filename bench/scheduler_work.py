"""`python -m bench.scheduler_work`: the scheduler's own work per request, in one process.

What one scheduler does for each request of a stateless batch, without its
streams: parse the gateway's message, queue the request (Queued, its batch
key, the dynamic batcher; and once more through the model's queue, as the
service submits a message's requests and wakes the queue), form the batch,
build and serialize the worker's ExecuteRequest, parse the worker's answer,
build each request's ScheduleResponse (BatchRun._answer) and pack and
serialize the answers. Each step is timed apart (best of --repeats, us per request) and the whole
path once more on fresh messages, where protobuf builds its wrappers on
first access as it does in the stack. The model is bench.scale's
`identity` (FP32 [16], max_batch_size 64, dynamic batching).

The streams' own costs (grpc, system calls, event-loop turns) are not here:
`python -m bench.scale` measures the scheduler's CPU per inference in a
stack, which this bounds from below.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import timeit
from collections.abc import Callable, Sequence

from services.scheduler.batch_run import BatchRun
from services.scheduler.batch_strategy import Queued, QueueStrategy
from services.scheduler.execute_request import build_execute_request
from services.scheduler.model_queue import ModelQueue
from stageserve.config import parse_config_text, to_spec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.settings import SchedulerSettings

CONFIG = """name: "identity" backend: "onnxruntime" max_batch_size: 64
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
dynamic_batching { }"""


class NoSizes:
    """BatchRun's batch-size histogram, unrecorded: the benches time the work around it."""

    def observe(self, value: float) -> None:
        pass


# What a tensor in shared memory carries instead of its bytes (--shm): one
# extent of its owner's region (stageserve/tensor_shm.py names them so).
SHM_BYTES = 49152


def _part(owner: str, k: int) -> pb.TensorPart:
    return pb.TensorPart(
        region=f"stageserve-{owner}-vm-4242-0f3a9c",
        offset=k * 65536,
        length=SHM_BYTES,
        generation=1000 + k,
    )


def _gateway_message(n: int, shm: bool) -> bytes:
    batch = pb.ScheduleBatch()
    for i in range(n):
        m = batch.requests.add(id=i + 1, model="identity", version=1, batch_size=1)
        if shm:
            t = m.inputs.add(name="INPUT0", datatype="FP32", shape=[1, SHM_BYTES // 4])
            t.parts.append(_part("gw", i))
            m.shm_host, m.shm_pid = "vm-4242", 4242
        else:
            m.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16], raw=bytes(64))
        m.outputs.append("OUTPUT0")
    return batch.SerializeToString()


def _worker_answer(n: int, shm: bool) -> bytes:
    resp = pb.ExecuteResponse(id=1, compute_input_ns=10, compute_infer_ns=20, compute_output_ns=30)
    for k in range(n):
        if shm:
            t = resp.results.add().outputs.add(
                name="OUTPUT0", datatype="FP32", shape=[1, SHM_BYTES // 4]
            )
            t.parts.append(_part("wk", k))
        else:
            resp.results.add().outputs.add(
                name="OUTPUT0", datatype="FP32", shape=[1, 16], raw=bytes(64)
            )
    return resp.SerializeToString()


def measure(n: int, repeats: int, number: int, shm: bool = False) -> list[tuple[str, float]]:
    """(step, us per request) for batches of `n` requests; `shm`: every input
    and output in shared memory (a reference on the streams, not bytes)."""
    spec = to_spec(parse_config_text(CONFIG))
    incoming, answer_wire = _gateway_message(n, shm), _worker_answer(n, shm)
    answers: list[pb.ScheduleResponse] = []
    run = BatchRun(
        "identity",
        None,  # type: ignore[arg-type]  # no worker call: _answer only
        None,
        lambda _q, r: answers.append(r),
        lambda _b: False,
        NoSizes(),
    )

    def respond(_r: pb.ScheduleResponse) -> None:
        pass

    def queue(msgs) -> QueueStrategy:
        strategy = QueueStrategy(spec)
        for m in msgs:
            strategy.add(Queued(m, respond, time.monotonic_ns()))
        return strategy

    def formed(msgs) -> list[Queued]:
        return queue(msgs).next_batch(time.monotonic_ns() + 10**9).batch or []

    msgs = list(pb.ScheduleBatch.FromString(incoming).requests)
    batch = formed(msgs)
    request = build_execute_request("identity_0", batch, True, spec.ragged_inputs)
    response = pb.ExecuteResponse.FromString(answer_wire)

    def answer() -> None:
        answers.clear()
        run._answer(batch, frozenset(), request, response, time.monotonic_ns())

    answer()
    ready = list(answers)

    def whole() -> None:
        fresh = formed(pb.ScheduleBatch.FromString(incoming).requests)
        built = build_execute_request("identity_0", fresh, True, spec.ragged_inputs)
        built.SerializeToString()
        answers.clear()
        run._answer(
            fresh,
            frozenset(),
            built,
            pb.ExecuteResponse.FromString(answer_wire),
            time.monotonic_ns(),
        )
        pb.ScheduleResponses(responses=answers).SerializeToString()

    # The model's queue as the service drives it: each request of a message
    # submitted without waking, then one wake (no worker: it only queues).
    loop = asyncio.new_event_loop()
    settings = SchedulerSettings()

    async def make_queue() -> ModelQueue:
        return ModelQueue("identity", 1, spec, None, None, settings)  # type: ignore[arg-type]

    model_queue = loop.run_until_complete(make_queue())

    def submitted(msgs) -> None:
        model_queue.strategy = QueueStrategy(spec, settings.adaptive_batch_delay_us)
        for m in msgs:
            model_queue.submit(m, respond, wake=False)
        model_queue.wake()

    steps: list[tuple[str, Callable[[], object]]] = [
        ("parse the gateway's message", lambda: pb.ScheduleBatch.FromString(incoming)),
        ("queue (Queued, batch key, batcher)", lambda: queue(msgs)),
        ("submit to the model's queue, wake it", lambda: submitted(msgs)),
        ("queue and form the batch", lambda: formed(msgs)),
        (
            "build the ExecuteRequest",
            lambda: build_execute_request("identity_0", batch, True, spec.ragged_inputs),
        ),
        ("serialize it", request.SerializeToString),
        ("parse the worker's answer", lambda: pb.ExecuteResponse.FromString(answer_wire)),
        ("answer each request (_answer)", answer),
        (
            "pack and serialize the answers",
            lambda: pb.ScheduleResponses(responses=ready).SerializeToString(),
        ),
        ("whole path, fresh messages", whole),
    ]
    try:
        return [
            (name, min(timeit.repeat(fn, number=number, repeat=repeats)) / number / n * 1e6)
            for name, fn in steps
        ]
    finally:
        model_queue.close()
        loop.run_until_complete(asyncio.sleep(0))  # its tasks see their cancel
        loop.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scheduler_work")
    parser.add_argument("--requests", type=int, default=20, help="requests per batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--number", type=int, default=2000, help="batches per repeat")
    parser.add_argument(
        "--shm",
        action="store_true",
        help="49 KB inputs and outputs in shared memory: the streams carry references",
    )
    args = parser.parse_args(argv)
    where = "in shared memory" if args.shm else "inline"
    print(
        f"scheduler work per request, batches of {args.requests}, tensors {where} "
        f"(best of {args.repeats})"
    )
    for name, us in measure(args.requests, args.repeats, args.number, args.shm):
        print(f"  {name:40s} {us:6.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
