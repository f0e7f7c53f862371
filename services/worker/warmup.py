"""Triton's model_warmup: synthetic requests every instance runs before READY.

`warmup_requests` is pure: it turns a model's validated `WarmupSpec`s
(stageserve.config) into the ExecuteRequests they stand for, with Triton's
data sources:

* ``zero_data``: zeros (BYTES: empty elements, BOOL: False);
* ``random_data``: random values (BYTES: random printable bytes, as Triton
  fills strings with random characters);
* ``input_data_file``: the raw bytes of ``<model>/warmup/<file>``, row-major,
  exactly as a request's raw input (BYTES: 4-byte length-prefixed elements);
  a file of the wrong size is an error, not padded.

The tensors carry the batch dimension (``batch_size``) when the model
batches and the config's ``reshape`` where an input has one, as the gateway
gives them to workers. Each sample runs ``count`` times (0: once).

`run_warmup` executes them on one instance through the same path as real
batches (batch inputs, output splitting), on the instance's own thread. A
failure raises `WarmupError` with the sample's name and the reason; the
worker then fails the load with it.

Statistics: Triton counts warmup requests in ModelStatistics like any
request (inference_count, execution_count, success, batch_stats; measured
on Triton 2.51, see run_warmup), so StageServe does too: `warm_up` adds each
instance's warmup figures to the model load's shared statistics in Redis.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import redis.asyncio as aioredis

from services.worker.instances import HostedInstance
from stageserve import redis_keys as keys
from stageserve.config import ModelSpec, WarmupInput, WarmupSpec
from stageserve.generated import stageserve_pb2 as pb

# Statistics bookkeeping (pure) and key lifetime shared with the gateways:
# warmup figures join the gateways' shares in the same Redis hash, so they are kept alike.
from stageserve.shared_stats import KEEP_MS
from stageserve.statistics import ModelVersionStats
from stageserve.tensors import TensorError, numpy_to_raw, raw_to_numpy

log = logging.getLogger(__name__)

WARMUP_FOLDER = "warmup"
_RANDOM_SEED = 0  # warmup data is reproducible from load to load


class WarmupError(RuntimeError):
    """A warmup sample could not be built or failed to execute."""


@dataclass(frozen=True)
class WarmupRequest:
    name: str
    request: pb.ExecuteRequest
    count: int


def warmup_requests(spec: ModelSpec, model_dir: Path) -> list[WarmupRequest]:
    """The ExecuteRequests of every warmup sample, in config order."""
    rng = np.random.default_rng(_RANDOM_SEED)
    out = []
    for sample in spec.warmups:
        # As in Triton, a sample of batch_size n is n requests of batch 1 run
        # as one batch (one request when the model does not batch).
        requests = sample.batch_size if spec.batching else 1
        request = pb.ExecuteRequest(request_batch_sizes=[1] * requests)
        for _ in range(requests):
            request.requested.add()  # no names: every output
        for inp in sample.inputs:
            shape = _shape(spec, sample, inp)
            try:
                raw = _raw(inp, shape, model_dir, rng)
            except (OSError, TensorError, ValueError) as exc:
                raise WarmupError(f"warmup '{sample.name}' input '{inp.name}': {exc}") from exc
            request.inputs.add(name=inp.name, datatype=inp.datatype.triton, shape=shape, raw=raw)
        out.append(WarmupRequest(sample.name, request, sample.count))
    return out


def _shape(spec: ModelSpec, sample: WarmupSpec, inp: WarmupInput) -> list[int]:
    """The shape the model sees: [batch] + dims, or the config's reshape."""
    inner = list(inp.dims)
    declared = spec.input(inp.name)
    if declared is not None and declared.reshape is not None:
        target = list(declared.reshape)
        if -1 in target:
            known = math.prod(d for d in target if d != -1)
            target[target.index(-1)] = math.prod(inner) // max(known, 1)
        inner = target
    return ([sample.batch_size] if spec.batching else []) + inner


def _raw(inp: WarmupInput, shape: list[int], model_dir: Path, rng: np.random.Generator) -> bytes:
    count = math.prod(shape)
    dt = inp.datatype
    if inp.source == "input_data_file":
        data = (model_dir / WARMUP_FOLDER / inp.data_file).read_bytes()
        raw_to_numpy(data, dt.triton, shape)  # checks the size (and BYTES framing)
        return data
    if dt.triton == "BYTES":
        if inp.source == "zero_data":
            items = [b""] * count
        else:
            items = [bytes(rng.integers(32, 127, size=8, dtype=np.uint8)) for _ in range(count)]
        return numpy_to_raw(np.array(items, dtype=object).reshape(shape), dt)
    if inp.source == "zero_data":
        return bytes(count * dt.item_size)
    return numpy_to_raw(_random(dt.triton, count, rng).reshape(shape), dt)


def _random(triton: str, count: int, rng: np.random.Generator) -> np.ndarray:
    if triton == "BOOL":
        return rng.integers(0, 2, size=count).astype(bool)
    if triton == "BF16":  # the upper 16 bits of float32 values in [0, 1)
        return (rng.random(count, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if triton in ("FP16", "FP32", "FP64"):
        return rng.random(count)  # numpy_to_raw casts to the datatype
    dtype = np.dtype(triton.lower())
    return rng.integers(0, min(np.iinfo(dtype).max, 127), size=count, endpoint=True).astype(dtype)


def run_warmup(
    execute: Callable[[pb.ExecuteRequest], pb.ExecuteResponse],
    requests: list[WarmupRequest],
) -> ModelVersionStats:
    """Run every sample `count` times through `execute`; returns the
    statistics they add, counted as Triton counts them: every warmup request
    is a successful inference, every execution a batch (measured on Triton
    2.51: a sample of batch_size 2, count 3 on 2 instances shows
    inference_count 12, execution_count 6, batch_stats {2: 6})."""
    stats = ModelVersionStats()
    for w in requests:
        sizes = list(w.request.request_batch_sizes)
        for _ in range(w.count):
            t0 = time.monotonic_ns()
            try:
                response = execute(w.request)
            except Exception as exc:  # BackendError, or whatever the model raised
                raise WarmupError(f"warmup '{w.name}' failed: {exc}") from exc
            elapsed = time.monotonic_ns() - t0
            failed = response.message if response.failure else ""
            failed = failed or next((r.message for r in response.results if r.failure), "")
            if failed:  # a Python model answers errors, it does not raise them
                raise WarmupError(f"warmup '{w.name}' failed: {failed}")
            for i, size in enumerate(sizes):
                timing = pb.Timing(
                    compute_input_ns=response.compute_input_ns,
                    compute_infer_ns=response.compute_infer_ns,
                    compute_output_ns=response.compute_output_ns,
                    batch_leader=i == 0,
                    batch_size=sum(sizes),
                )
                stats.record_success(elapsed, size, timing)
    return stats


async def warm_up(
    instance: HostedInstance, requests: list[WarmupRequest], redis: aioredis.Redis
) -> None:
    """Run the warmup samples on the instance's own thread (where its backend
    keeps per-thread settings such as torch's thread count), then add their
    statistics to the model load's shared ModelStatistics, which every
    gateway sums (stageserve/shared_stats.py), before the instance
    registers: the first ModelStatistics after READY includes them."""
    if not requests:
        return
    loop = asyncio.get_running_loop()
    # Never StillSending: a decoupled model with model_warmup does not load
    # (python_backend/hosting.py).
    execute = cast("Callable[[pb.ExecuteRequest], pb.ExecuteResponse]", instance.execute)
    stats = await loop.run_in_executor(instance.executor, run_warmup, execute, requests)
    key = keys.model_stats(instance.model, instance.generation, instance.version)
    data = stats.to_pb(instance.model, instance.version).SerializeToString()
    try:
        async with redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, f"warmup:{instance.instance_id}", data)
            pipe.pexpire(key, KEEP_MS)
            await pipe.execute()
    except Exception as exc:  # Redis away: the instance is warm all the same
        log.warning(
            "warmup statistics not recorded",
            extra={"instance": instance.instance_id, "error": str(exc)},
        )
    log.info(
        "instance warmed up",
        extra={"instance": instance.instance_id, "executions": stats.execution_count},
    )
