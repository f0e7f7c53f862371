"""The worker's spans of a batch's traced requests (stageserve/trace_spans.py):
"compute" with its children "compute_input", "compute_infer" and
"compute_output", under the scheduler's "execute" span each traced request
names in ExecuteRequest.traceparents. The batch's three phases are measured
as durations (tensor_batches.py); they are laid end to end, ending when the
answer was built."""

from __future__ import annotations

from stageserve import trace_spans
from stageserve.generated import stageserve_pb2 as pb


def phases(resp: pb.ExecuteResponse, end_ns: int) -> list[tuple[str, int, int]]:
    """(name, start, end) of the batch's input, infer and output phases."""
    out_start = end_ns - resp.compute_output_ns
    infer_start = out_start - resp.compute_infer_ns
    input_start = infer_start - resp.compute_input_ns
    return [
        ("compute_input", input_start, infer_start),
        ("compute_infer", infer_start, out_start),
        ("compute_output", out_start, end_ns),
    ]


def record_compute_spans(request: pb.ExecuteRequest, resp: pb.ExecuteResponse, end_ns: int) -> None:
    stage = trace_spans.STAGE
    if stage is None:
        return
    parents = [p for p in map(trace_spans.parse_traceparent, request.traceparents) if p]
    steps = phases(resp, end_ns)
    total = sum(request.request_batch_sizes)
    attributes = {"stageserve.instance": request.instance_id, "stageserve.batch_size": total}

    def record(emitter: trace_spans.SpanEmitter) -> None:
        for parent in parents:
            compute, context = emitter.start("compute", parent, steps[0][1], attributes)
            for name, start, end in steps:
                emitter.span(name, context, start, end)
            emitter.end(compute, end_ns, resp.message if resp.failure else "")

    stage.emit(record)
