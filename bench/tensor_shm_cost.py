"""`python -m bench.tensor_shm_cost`: where shared memory beats inline bytes, per tensor.

For each tensor size, the CPU one input tensor costs on its way gateway ->
scheduler -> worker, measured in this process on the real messages and the
real region (stageserve/tensor_shm.py):

* inline: the ScheduleRequest serialized by the gateway and parsed by the
  scheduler, the ExecuteRequest serialized by the scheduler and parsed by
  the worker, and the worker's view of the bytes;
* shared memory: the gateway's slot alloc and write into its region, the
  same two hops carrying a reference, the worker's view of the extent, and
  the free.

Outputs take the same two hops back, so the crossover is the same for
them. The smallest size at which shared memory is cheaper is what the stack
setting `tensor_shm_min_bytes` stands for (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from functools import partial

from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensor_shm import TensorShm, tensor_bytes

SIZES = (1024, 4096, 8192, 16384, 32768, 49152, 65536, 262144)


def _hops(request: pb.ScheduleRequest) -> pb.Tensor:
    """gateway -> scheduler -> worker: what each stage does to the tensor's message."""
    at_scheduler = pb.ScheduleRequest.FromString(request.SerializeToString())
    execute = pb.ExecuteRequest(inputs=at_scheduler.inputs)
    at_worker = pb.ExecuteRequest.FromString(execute.SerializeToString())
    return at_worker.inputs[0]


def inline_once(data: bytes) -> None:
    t = _hops(pb.ScheduleRequest(inputs=[pb.Tensor(name="x", datatype="FP32", raw=data)]))
    memoryview(tensor_bytes(t))


def shm_once(shm: TensorShm, data: bytes) -> None:
    # as the gateway: the validated tensor moves to the region, then the request is built
    inputs = [pb.Tensor(name="x", datatype="FP32", raw=data)]
    held = shm.stage_inputs(inputs)
    assert held, "the region is full"
    memoryview(tensor_bytes(_hops(pb.ScheduleRequest(inputs=inputs))))
    shm.release(held)


def per_call_us(call: Callable[[], None], repeat: int) -> float:
    for _ in range(min(repeat, 100)):
        call()
    t0 = time.process_time_ns()
    for _ in range(repeat):
        call()
    return (time.process_time_ns() - t0) / repeat / 1000


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tensor_shm_cost")
    parser.add_argument("--repeat", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    args = parser.parse_args(argv)
    shm = TensorShm(f"bench{os.getpid()}", "gateway", 64, max(args.sizes), threshold=1)
    try:
        print(f"{'bytes':>8}  {'inline us':>10}  {'shm us':>8}  (per tensor, best of rounds)")
        for size in args.sizes:
            data = os.urandom(size)
            inline = min(
                per_call_us(partial(inline_once, data), args.repeat) for _ in range(args.rounds)
            )
            shared = min(
                per_call_us(partial(shm_once, shm, data), args.repeat) for _ in range(args.rounds)
            )
            print(f"{size:>8}  {inline:>10.2f}  {shared:>8.2f}")
    finally:
        shm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
