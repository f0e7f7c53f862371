"""Ensembles (platform "ensemble"): run the steps as a dataflow inside the scheduler.

A step runs as soon as every tensor its input_map names exists, so
independent steps run concurrently; results flow from step to step here,
never back through the gateway. A failed step fails the request with that
step's message. Steps are ordinary requests to the composing models' queues
(so they batch with other traffic); a step that is itself an ensemble
recurses. Each composing execution is reported back (StepStat) so the
gateway keeps statistics per composing model.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from services.scheduler.ensemble_spans import start_step_span
from stageserve.config import EnsembleStep, ModelSpec
from stageserve.errors import StageError, internal, invalid
from stageserve.generated import stageserve_pb2 as pb

# Runs one request against a model (by name) and returns its response; it
# marks the step's StepStat when the response cache answered or kept it.
Submit = Callable[[pb.ScheduleRequest, pb.StepStat], Awaitable[pb.ScheduleResponse]]


class EnsembleReadiness:
    """The pure part: which steps can run given the tensors produced so far."""

    def __init__(self, steps: tuple[EnsembleStep, ...], available: set[str]) -> None:
        self.pending = list(range(len(steps)))
        self.steps = steps
        self.available = set(available)

    def ready(self) -> list[int]:
        out = [
            i
            for i in self.pending
            if all(tensor in self.available for _, tensor in self.steps[i].input_map)
        ]
        for i in out:
            self.pending.remove(i)
        return out

    def produced(self, names: list[str]) -> None:
        self.available.update(names)


async def run_ensemble(
    msg: pb.ScheduleRequest, spec: ModelSpec, submit: Submit
) -> pb.ScheduleResponse:
    start = time.monotonic_ns()
    tensors: dict[str, pb.Tensor] = {t.name: t for t in msg.inputs}
    readiness = EnsembleReadiness(spec.steps, set(tensors))
    stats: list[pb.StepStat] = []
    running: dict[asyncio.Task, int] = {}
    try:
        while True:
            for i in readiness.ready():
                task = asyncio.create_task(_run_step(spec.steps[i], msg, tensors, spec, submit))
                running[task] = i
            if not running:
                break
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                step = spec.steps[running.pop(task)]
                resp, step_stats = task.result()
                stats.extend(step_stats)
                if resp.failure:
                    raise StageError.of(
                        resp.failure,
                        f"in ensemble '{spec.name}', step '{step.model}': {resp.message}",
                    )
                produced = {t.name: t for t in resp.outputs}
                for model_out, tensor in step.output_map:
                    if model_out in produced:
                        t = produced[model_out]
                        tensors[tensor] = pb.Tensor(
                            name=tensor, datatype=t.datatype, shape=t.shape, raw=t.raw
                        )
                readiness.produced([tensor for _, tensor in step.output_map])
    except StageError as err:
        for task in running:
            task.cancel()
        return pb.ScheduleResponse(id=msg.id, failure=err.reason, message=err.message, steps=stats)
    if readiness.pending:
        names = sorted({spec.steps[i].model for i in readiness.pending})
        return _error(msg, internal(f"ensemble '{spec.name}': steps {names} never became ready"))
    wanted = list(msg.outputs) or [o.name for o in spec.outputs]
    missing = [n for n in wanted if n not in tensors]
    if missing:
        return _error(msg, internal(f"ensemble '{spec.name}' produced no {missing}"))
    duration = time.monotonic_ns() - start
    outputs = [
        pb.Tensor(name=n, datatype=tensors[n].datatype, shape=tensors[n].shape, raw=tensors[n].raw)
        for n in wanted
    ]
    timing = pb.Timing(
        compute_infer_ns=duration, batch_size=max(msg.batch_size, 1), batch_leader=True
    )
    if msg.traceparent:  # queued (its steps ran), no execution of its own: Triton's stamps
        timing.enqueue_ns = start
    return pb.ScheduleResponse(id=msg.id, outputs=outputs, timing=timing, steps=stats)


def _error(msg: pb.ScheduleRequest, err: StageError) -> pb.ScheduleResponse:
    return pb.ScheduleResponse(id=msg.id, failure=err.reason, message=err.message)


async def _run_step(
    step: EnsembleStep,
    msg: pb.ScheduleRequest,
    tensors: dict[str, pb.Tensor],
    spec: ModelSpec,
    submit: Submit,
) -> tuple[pb.ScheduleResponse, list[pb.StepStat]]:
    request = pb.ScheduleRequest(
        model=step.model,
        version=step.version,
        batch_size=msg.batch_size,
        priority=msg.priority,
        timeout_us=msg.timeout_us,
        outputs=[model_out for model_out, _ in step.output_map],
    )
    for model_in, tensor in step.input_map:
        t = tensors[tensor]
        request.inputs.append(
            pb.Tensor(name=model_in, datatype=t.datatype, shape=t.shape, raw=t.raw)
        )
    start = time.monotonic_ns()
    span = None
    if msg.traceparent:
        span = await start_step_span(msg, request, start)
        if span is None:  # triton mode: the step's times come back in its Timing
            request.traceparent = msg.traceparent
    stat = pb.StepStat(model=step.model)
    try:
        resp = await submit(request, stat)
    except StageError as err:
        resp = _error(request, err)
    if span is not None:
        span.end(time.monotonic_ns(), resp)
    stat.version = request.version
    stat.timing.CopyFrom(resp.timing)
    stat.batch_size = max(msg.batch_size, 1)
    stat.duration_ns = time.monotonic_ns() - start
    stat.failure = resp.failure
    stat.message = resp.message
    stat.model_error = resp.model_error
    if msg.traceparent:
        stat.start_ns = start
    return resp, [*resp.steps, stat]


def check_step_input(model: ModelSpec, request: pb.ScheduleRequest) -> None:
    """An ensemble wires tensors between models: types and shapes must agree."""
    for t in request.inputs:
        spec = model.input(t.name)
        if spec is None:
            raise invalid(f"model '{model.name}' has no input '{t.name}'")
        if spec.datatype.triton != t.datatype:
            raise invalid(
                f"model '{model.name}' input '{t.name}' expects {spec.datatype.triton}, "
                f"the ensemble gives {t.datatype}"
            )
        inner = tuple(t.shape[1:] if model.batching else t.shape)
        if not spec.matches(inner):
            raise invalid(
                f"model '{model.name}' input '{t.name}' expects dims {list(spec.dims)}, the "
                f"ensemble gives shape {list(t.shape)}"
            )
