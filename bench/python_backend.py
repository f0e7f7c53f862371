"""`python -m bench.python_backend`: in-process Python instances vs a process per instance.

Runs the same model.py two ways, with N instances executing batches as fast
as they are fed:

* in-process (what the worker does): N PythonInstances, each on its own
  thread, `execute_batch(ExecuteRequest)` called directly;
* process per instance (STAGESERVE_INSTANCE_PROCESS, Triton's design): the
  worker's ProcessInstance, each instance in its stub process, the
  ExecuteRequest's bytes over a socket and the ExecuteResponse's back.

Models: `numpy` (execute does ~1 ms of numpy per request: three
128x256 @ 256x256 layers with tanh, softmax) and `trivial` (returns its
input). Prints batches/s and CPU ms per batch (whole process tree) for each.

    OPENBLAS_NUM_THREADS=1 python -m bench.python_backend --instances 1 2 --seconds 3

(one BLAS thread per instance, as instances are the unit of parallelism).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import cast

import numpy as np

from services.worker.python_backend.instance import PythonInstance
from services.worker.python_backend.process_instance import ProcessInstance
from stageserve.config import parse_config_text, to_spec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensors import numpy_to_raw
from stageserve_tools.examples import python_config_text

SOURCES = {
    "numpy": """\
import numpy as np
import triton_python_backend_utils as pb_utils

W = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            h = np.tanh(x @ W)
            h = np.tanh(h @ W)
            h = h @ W
            e = np.exp(h - h.max(axis=-1, keepdims=True))
            y = e / e.sum(-1, keepdims=True)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", y)]))
        return out
""",
    "trivial": """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests]
""",
}
ROWS = 128  # rows per request (the batch of one request)


def _model(root: Path, name: str) -> tuple[Path, str]:
    text = python_config_text(
        name, [("IN", "FP32", (256,))], [("OUT", "FP32", (256,))], max_batch_size=ROWS
    )
    d = root / name / "1"
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.py").write_text(SOURCES[name])
    return d / "model.py", text


def _request() -> bytes:
    x = np.random.default_rng(1).random((ROWS, 256), dtype=np.float32)
    req = pb.ExecuteRequest(instance_id="bench", request_batch_sizes=[ROWS])
    req.inputs.add(name="IN", datatype="FP32", shape=[ROWS, 256], raw=numpy_to_raw(x))
    req.requested.add()
    return req.SerializeToString()


def _instance(path: Path, text: str, index: int) -> PythonInstance:
    spec = to_spec(parse_config_text(text))
    return PythonInstance(
        path, spec, "{}", instance_name=f"bench_{index}", kind="KIND_CPU", device_id=-1, version=1
    )


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def in_process(path: Path, text: str, instances: int, seconds: float) -> tuple[int, float]:
    models = [_instance(path, text, i) for i in range(instances)]
    raw = _request()
    stop = time.monotonic() + seconds
    counts = [0] * instances

    def run(i: int) -> None:
        while time.monotonic() < stop:
            req = pb.ExecuteRequest.FromString(raw)
            # Not decoupled: never StillSending.
            resp = cast("pb.ExecuteResponse", models[i].execute_batch(req, None))
            resp.SerializeToString()
            counts[i] += 1

    cpu0 = _cpu()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(instances)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts), _cpu() - cpu0


def per_process(path: Path, text: str, instances: int, seconds: float) -> tuple[int, float]:
    """The worker's ProcessInstance: each instance in its stub process."""
    spec = to_spec(parse_config_text(text))
    models = [
        ProcessInstance(
            path, spec, "{}", instance_name=f"bench_{i}", kind="KIND_CPU", device_id=-1, version=1
        )
        for i in range(instances)
    ]
    raw = _request()
    for model in models:  # warm: the stub's start and initialize are not timed
        model.execute_batch(pb.ExecuteRequest.FromString(raw), None)
    stop = time.monotonic() + seconds
    counts = [0] * instances

    def run(i: int) -> None:
        while time.monotonic() < stop:
            req = pb.ExecuteRequest.FromString(raw)
            # Not decoupled: never StillSending.
            resp = cast("pb.ExecuteResponse", models[i].execute_batch(req, None))
            resp.SerializeToString()
            counts[i] += 1

    cpu0 = _cpu_tree([m._stub.proc.pid for m in models if m._stub is not None])
    threads = [threading.Thread(target=run, args=(i,)) for i in range(instances)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu = _cpu_tree([m._stub.proc.pid for m in models if m._stub is not None]) - cpu0
    for model in models:
        model.close()
    return sum(counts), cpu


def _cpu_tree(pids: list[int]) -> float:
    """This process's CPU seconds plus its live stubs' (from /proc)."""
    total = _cpu()
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.python_backend")
    parser.add_argument("--instances", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--models", nargs="+", default=list(SOURCES))
    args = parser.parse_args(argv)
    print(f"cores: {os.cpu_count()}, {ROWS}x256 FP32 per batch")
    print("| model | instances | mode | batches/s | CPU ms/batch |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path, text = _model(Path(tmp), name)
            for n in args.instances:
                for mode, fn in (("in-process", in_process), ("process", per_process)):
                    count, cpu = fn(path, text, n, args.seconds)
                    rate = count / args.seconds
                    print(
                        f"| {name} | {n} | {mode} | {rate:,.0f} | "
                        f"{1000 * cpu / max(count, 1):.3f} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
