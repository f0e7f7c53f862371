"""Triton's `triton` trace mode: a traced request's timestamps in Triton's
JSON trace file format, which Triton's trace summary tooling reads:

    [{"id":1,"model_name":"m","model_version":1},
     {"id":1,"timestamps":[{"name":"REQUEST_START","ns":...}]}, ...]

REQUEST_START / REQUEST_END are the gateway's; QUEUE_START and the compute
timestamps come from the scheduler in the response's Timing (its enqueue and
its batch's answer; the worker's three phase durations are laid end to end
before that answer). Every time is the host's monotonic clock, which all
processes of one host share, as Triton's steady clock.

As Triton: with `log_frequency` N, every N traces go to `<file>.<index>`.
With 0, the traces go to `<file>` itself, rewritten whole (a valid JSON
array at any time; Triton writes it at exit) at most every `flush_s`.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from stageserve.generated import stageserve_pb2 as pb


def trace_records(
    trace_id: int,
    model: str,
    version: int,
    request_id: str,
    start_ns: int,
    end_ns: int,
    timing: pb.Timing | None,
    tensors: list[dict[str, Any]] | None = None,
    timestamps: bool = True,
    parent_id: int = 0,
) -> list[dict[str, Any]]:
    """One trace's entries, in Triton's order and shape: `tensors` (level
    TENSORS: trace_tensors.py's records) after QUEUE_START, where Triton
    writes them; `timestamps` False (TENSORS alone): only those, as Triton.
    `parent_id`: an ensemble's composing request, the ensemble's trace id.
    A Timing without execute_end_ns (an ensemble's own) has QUEUE_START only."""
    if not timestamps:
        return list(tensors or ())
    head: dict[str, Any] = {"id": trace_id, "model_name": model, "model_version": version}
    if request_id:
        head["request_id"] = request_id
    if parent_id:
        head["parent_id"] = parent_id
    stamps = [("REQUEST_START", start_ns)]
    if timing is not None and timing.enqueue_ns and not timing.execute_end_ns:
        stamps.append(("QUEUE_START", timing.enqueue_ns))
    elif timing is not None and timing.enqueue_ns:
        compute_start = timing.enqueue_ns + timing.queue_ns
        output_start = timing.execute_end_ns - timing.compute_output_ns
        input_end = output_start - timing.compute_infer_ns
        stamps += [
            ("QUEUE_START", timing.enqueue_ns),
            ("COMPUTE_START", compute_start),
            ("COMPUTE_INPUT_END", input_end),
            ("COMPUTE_OUTPUT_START", output_start),
            ("COMPUTE_END", timing.execute_end_ns),
        ]
    stamps.append(("REQUEST_END", end_ns))
    entries = [{"id": trace_id, "timestamps": [{"name": n, "ns": ns}]} for n, ns in stamps]
    if tensors:
        at = 2 if len(stamps) > 2 else 1  # after QUEUE_START, else REQUEST_START
        entries[at:at] = tensors
    return [head, *entries]


class TraceFile:
    def __init__(self, path: str, log_frequency: int, flush_s: float = 0.2) -> None:
        self.path = Path(path)
        self.log_frequency = log_frequency
        self.flush_s = flush_s
        self.next_id = 1
        self._written: list[dict[str, Any]] = []  # the main file's entries (log_frequency 0)
        self._stream: list[dict[str, Any]] = []  # entries not yet in a file
        self._in_stream = 0  # traces in _stream
        self._index = 0
        self._flusher: asyncio.Task | None = None

    def add(self, records: list[dict[str, Any]]) -> None:
        self._stream.extend(records)
        self._in_stream += 1
        if self.log_frequency and self._in_stream >= self.log_frequency:
            self._write_index()
        elif not self.log_frequency and self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_later())

    def _write_index(self) -> None:
        entries, self._stream, self._in_stream = self._stream, [], 0
        _write(Path(f"{self.path}.{self._index}"), entries)
        self._index += 1

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.flush_s)
        self._flusher = None
        self.flush()

    def flush(self) -> None:
        if self.log_frequency:
            return
        if self._stream:
            self._written += self._stream
            self._stream, self._in_stream = [], 0
            _write(self.path, self._written)

    def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        if self.log_frequency and self._stream:
            self._write_index()
        self.flush()


def _write(path: Path, entries: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(entries, separators=(",", ":")))
    os.replace(tmp, path)
