"""One instance of a Triton Python-backend model, executing in the worker process.

The scheduler sends a formed batch (inputs concatenated); Triton's Python
backend hands `execute` a LIST of requests, each with its own tensors, so the
batch is split back per request here and the model's per-request responses
become the batch's per-request results. Errors follow Triton 2.51 (checked
against it): an exception in execute fails every request of the batch with
INTERNAL "Failed to process the request(s) for model '<instance>', message:
<Type>: <text>" (Triton appends the traceback location; we leave it out, it
names server files); a response's TritonError fails that request alone with
the error's code; a wrong number of responses fails the batch. The instance
keeps serving after any of them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import logging
import math
import threading
import time
import weakref
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np

from services.worker.backends import BackendError, Emit, StillSending
from services.worker.python_backend import pb_utils
from services.worker.python_backend.loader import ModelImportError, import_model_file
from stageserve.config import ModelSpec
from stageserve.datatypes import from_numpy
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensors import TensorError, numpy_to_raw, raw_to_numpy

log = logging.getLogger(__name__)

#: the reason of a batch or request the model failed (INTERNAL to the client)
INTERNAL = pb.BACKEND_FAILED
# pb_utils.TritonError codes -> the FailureReason they stand for (Triton's mapping).
_REASONS = {
    pb_utils.TritonError.INTERNAL: pb.BACKEND_FAILED,
    pb_utils.TritonError.NOT_FOUND: pb.MODEL_NOT_FOUND,
    pb_utils.TritonError.INVALID_ARG: pb.INVALID_INPUT,
    pb_utils.TritonError.UNAVAILABLE: pb.STAGE_UNAVAILABLE,
    pb_utils.TritonError.UNSUPPORTED: pb.UNIMPLEMENTED,
    pb_utils.TritonError.ALREADY_EXISTS: pb.ALREADY_EXISTS,
    pb_utils.TritonError.CANCELLED: pb.CANCELLED,
    pb_utils.TritonError.UNKNOWN: pb.UNKNOWN_FAILURE,
}


class PythonModelError(BackendError):
    """initialize (or the import) failed: the model does not load."""


def failure_reason(error: pb_utils.TritonError) -> pb.FailureReason:
    """The FailureReason of a model's TritonError (BACKEND_FAILED, INTERNAL to
    the client, for a code Triton does not define)."""
    return _REASONS.get(error.code(), pb.BACKEND_FAILED)


class PythonInstance:
    #: Never inline on the event loop: a BLS call from execute waits on it.
    thread_bound = True

    def __init__(
        self,
        model_file: Path,
        spec: ModelSpec,
        config_json: str,
        *,
        instance_name: str,
        kind: str,
        device_id: int,
        version: int,
    ) -> None:
        self.spec = spec
        self.instance_name = instance_name
        self.decoupled = spec.decoupled
        try:
            module = import_model_file(model_file)
        except ModelImportError as exc:
            raise PythonModelError(str(exc)) from exc
        try:
            self.model = module.TritonPythonModel()
        except Exception as exc:
            raise PythonModelError(
                f"Failed to create TritonPythonModel of '{instance_name}': "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not callable(getattr(self.model, "execute", None)):
            raise PythonModelError(
                f"TritonPythonModel of model '{spec.name}' ({model_file}) has no execute method"
            )
        self.is_async = inspect.iscoroutinefunction(self.model.execute)
        # An `async def execute` runs on this instance's own loop, on the
        # instance's thread: awaiting BLS (async_exec) never blocks other instances.
        self._loop = asyncio.new_event_loop() if self.is_async else None
        args = {
            "model_config": config_json,
            "model_instance_kind": "GPU" if kind == "KIND_GPU" else "CPU",
            "model_instance_name": instance_name,
            "model_instance_device_id": str(max(device_id, 0)),
            "model_repository": str(model_file.parent.parent),
            "model_version": str(version),
            "model_name": spec.name,
        }
        initialize = getattr(self.model, "initialize", None)
        if initialize is not None:
            try:
                initialize(args)
            except Exception as exc:
                raise PythonModelError(
                    f"Failed to initialize model '{instance_name}': {type(exc).__name__}: {exc}"
                ) from exc

    # ---------------------------------------------------------------- execute

    def execute_batch(
        self, request: pb.ExecuteRequest, emit: Emit | None
    ) -> pb.ExecuteResponse | StillSending:
        t0 = time.monotonic_ns()
        try:
            requests = self._requests(request)
        except TensorError as exc:
            return _failed(INTERNAL, f"bad input tensor for model '{self.spec.name}': {exc}")
        senders = None
        if self.decoupled:
            padding = {i for i, info in enumerate(request.request_info) if info.padding}
            senders = _Senders(len(requests), emit, self, padding)
        if senders is not None:
            for i, req in enumerate(requests):
                req._sender = senders.sender(i, req.requested_output_names())
        t1 = time.monotonic_ns()
        try:
            responses = self._call_execute(requests)
        except Exception as exc:  # the model's own failure: this batch fails, the model serves on
            message = (
                f"Failed to process the request(s) for model '{self.instance_name}', "
                f"message: {type(exc).__name__}: {exc}"
            )
            log.warning(
                "python model execute raised",
                extra={"instance": self.instance_name, "error": message},
            )
            if senders is not None:
                senders.fail_unfinished(message)
            return _failed(INTERNAL, message)
        t2 = time.monotonic_ns()
        if senders is not None:
            return self._finish_decoupled(senders, responses, t0, t1, t2)
        out = self._collect(request, requests, responses)
        t3 = time.monotonic_ns()
        out.compute_input_ns, out.compute_infer_ns, out.compute_output_ns = (
            t1 - t0,
            t2 - t1,
            t3 - t2,
        )
        return out

    def _call_execute(self, requests: list[pb_utils.InferenceRequest]) -> Any:
        if self._loop is not None:
            return self._loop.run_until_complete(self.model.execute(requests))
        return self.model.execute(requests)

    def _finish_decoupled(
        self, senders: _Senders, responses: Any, t0: int, t1: int, t2: int
    ) -> pb.ExecuteResponse | StillSending:
        if responses is not None:  # Triton 2.51 answers this the same way
            senders.fail_unfinished(
                f"Failed to process the request(s) for model '{self.instance_name}', message: "
                f"Python model '{self.instance_name}' is using the decoupled mode and the "
                f"execute function must return None."
            )
        out = pb.ExecuteResponse()
        out.compute_input_ns, out.compute_infer_ns = t1 - t0, t2 - t1
        out.compute_output_ns = time.monotonic_ns() - t2
        # Responses may still come from the model's own threads: the instance
        # does not wait for them (Triton frees it when execute returns).
        return senders.returned(out)

    def _requests(self, request: pb.ExecuteRequest) -> list[pb_utils.InferenceRequest]:
        """Split the formed batch back into the requests it was made of."""
        sizes = list(request.request_batch_sizes)
        ragged = {r.input: r for r in request.ragged_shapes}
        per_request: list[list[pb_utils.Tensor]] = [[] for _ in sizes]
        for t in request.inputs:
            arr = raw_to_numpy(t.raw, t.datatype, t.shape)
            if t.name in ragged:
                pieces = _split_ragged(arr, ragged[t.name], len(sizes))
            elif len(sizes) == 1:
                pieces = [arr]
            else:
                pieces = np.split(arr, np.cumsum(sizes)[:-1])
            for i, piece in enumerate(pieces):
                per_request[i].append(pb_utils.Tensor(t.name, piece))
        infos = list(request.request_info)
        out = []
        for i, tensors in enumerate(per_request):
            info = infos[i] if i < len(infos) else pb.RequestInfo()
            out.append(
                pb_utils.InferenceRequest(
                    model_name=self.spec.name,
                    requested_output_names=list(request.requested[i].names)
                    or [o.name for o in self.spec.outputs],
                    inputs=tensors,
                    correlation_id=info.correlation_id_str or info.correlation_id,
                    request_id=info.request_id,
                    flags=info.flags,
                    parameters=info.parameters_json or None,
                )
            )
        return out

    def _collect(
        self,
        request: pb.ExecuteRequest,
        requests: list[pb_utils.InferenceRequest],
        responses: Any,
    ) -> pb.ExecuteResponse:
        if not isinstance(responses, list | tuple) or len(responses) != len(requests):
            got = len(responses) if isinstance(responses, list | tuple) else 0
            return _failed(
                INTERNAL,
                f"Failed to process the request(s) for model '{self.instance_name}', message: "
                f"Number of InferenceResponse objects do not match the number of "
                f"InferenceRequest objects. InferenceRequest(s) size is:{len(requests)}, and "
                f"InferenceResponse(s) size is:{got}",
            )
        out = pb.ExecuteResponse()
        for req, resp in zip(requests, responses, strict=True):
            out.results.append(self.request_outputs(req.requested_output_names(), resp))
        return out

    def request_outputs(self, requested: Collection[str], resp: Any) -> pb.RequestOutputs:
        """One response as the request's outputs (only the `requested` ones), or its error."""
        if not isinstance(resp, pb_utils.InferenceResponse):
            return pb.RequestOutputs(
                failure=INTERNAL,
                message=f"model '{self.spec.name}' returned {type(resp).__name__}, "
                f"not an InferenceResponse",
            )
        if resp.has_error():
            error = resp.error()
            assert error is not None
            return pb.RequestOutputs(failure=failure_reason(error), message=error.message())
        wanted = set(requested)
        result = pb.RequestOutputs()
        for tensor in resp.output_tensors():
            if tensor.name() not in wanted:
                continue
            try:
                result.outputs.append(self._tensor(tensor))
            except (TensorError, KeyError, ValueError) as exc:
                return pb.RequestOutputs(
                    failure=INTERNAL,
                    message=f"model '{self.spec.name}' output '{tensor.name()}': {exc}",
                )
        return result

    def _tensor(self, tensor: pb_utils.Tensor) -> pb.Tensor:
        arr = tensor.as_numpy()
        # Triton sends the tensor's own datatype, whatever the config declares
        # (checked with 2.51); BF16 has no numpy type, so the config says it.
        declared = self.spec.output(tensor.name())
        dt = from_numpy(arr.dtype)
        if declared is not None and declared.datatype.triton == "BF16":
            dt = declared.datatype
        return pb.Tensor(
            name=tensor.name(),
            datatype=dt.triton,
            shape=list(arr.shape),
            raw=numpy_to_raw(arr, dt),
        )

    # --------------------------------------------------------------- finalize

    def close(self) -> None:
        finalize = getattr(self.model, "finalize", None)
        try:
            if finalize is not None:
                result = finalize()
                if inspect.iscoroutine(result) and self._loop is not None:
                    self._loop.run_until_complete(result)
        except Exception as exc:
            log.warning(
                "python model finalize raised",
                extra={"instance": self.instance_name, "error": f"{type(exc).__name__}: {exc}"},
            )
        finally:
            if self._loop is not None:
                _close_loop(self._loop)


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Close an instance's loop as asyncio.run ends its own: the tasks still on
    it (an async_exec() the model never awaited) are cancelled first, so
    nothing logs "Task was destroyed but it is pending!" (Triton's pending
    Future says nothing at unload either)."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


class _Senders:
    """The response senders of one decoupled batch: parts go out as sent, and
    the batch ends once execute returned and every request had its final flag.

    Parts are emitted under the lock, so the stream carries them in the order
    the senders' calls took it, and the batch's last message (sent once
    `last` resolves) after every one of them."""

    def __init__(
        self,
        count: int,
        emit: Emit | None,
        instance: PythonInstance,
        padding: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        self._emit = emit
        self._instance = instance
        # A padding row waits for nothing: what the model sends for it is dropped.
        self._unfinished = set(range(count)) - set(padding)
        # Reentrant: a sender freed by a garbage collection that runs while
        # this thread holds the lock calls _released -> _send on it.
        self._lock = threading.RLock()
        self._ended = False
        self._start_ns = time.monotonic_ns()  # a request's compute time ends at its final
        self._last_message: pb.ExecuteResponse | None = None  # set when execute returned
        self._last: concurrent.futures.Future[pb.ExecuteResponse] = concurrent.futures.Future()

    def sender(self, index: int, requested: Collection[str]) -> pb_utils.InferenceResponseSender:
        """Request `index`'s response sender. It holds no reference to its
        request (which holds it), so once the model has let go of both,
        CPython frees it at once and `_released` ends a request the model can
        no longer finish."""
        instance = self._instance

        def emit(response: pb_utils.InferenceResponse | None, final: bool) -> None:
            part = pb.DecoupledPart(request_index=index, final=final)
            if response is not None:
                part.has_response = True
                part.response.CopyFrom(instance.request_outputs(requested, response))
            self._send(part)

        sender = pb_utils.InferenceResponseSender(emit)
        weakref.finalize(sender, self._released, index).atexit = False
        return sender

    def _released(self, index: int) -> None:
        """The sender of request `index` is gone: if it never sent the final
        flag, nothing can now, so the request ends with an error. Triton 2.51
        leaves such a request open for ever (checked: no answer, and the
        server then cannot stop cleanly); a StageServe choice."""
        with self._lock:
            open_ = index in self._unfinished
        if not open_:
            return
        log.warning(
            "python model released a response sender without the final flag",
            extra={"instance": self._instance.instance_name, "request_index": index},
        )
        self.fail_unfinished(
            f"Failed to process the request(s) for model '{self._instance.instance_name}', "
            f"message: the response sender was released without sending "
            f"TRITONSERVER_RESPONSE_COMPLETE_FINAL",
            only=index,
        )

    def _send(self, part: pb.DecoupledPart) -> None:
        with self._lock:
            if part.request_index not in self._unfinished:
                return
            if part.final:
                self._unfinished.discard(part.request_index)
                part.compute_infer_ns = time.monotonic_ns() - self._start_ns
            if self._emit is not None:  # a thread-safe hand-off, it never blocks
                self._emit(pb.ExecuteResponse(parts=[part], more=True))
            ended = not self._unfinished and self._last_message is not None and not self._ended
            self._ended = self._ended or ended  # the batch ends once, reentrant calls included
        # Cancelled when the scheduler's stream went away (the worker's wait
        # for it was cancelled): the model's send must not raise for that.
        if ended and self._last.set_running_or_notify_cancel():
            assert self._last_message is not None  # ended: execute returned it
            self._last.set_result(self._last_message)

    def fail_unfinished(self, message: str, only: int | None = None) -> None:
        """Every request still open (or just request `only`) ends INTERNAL."""
        with self._lock:
            pending = sorted(self._unfinished) if only is None else [only]
        for index in pending:
            self._send(
                pb.DecoupledPart(
                    request_index=index,
                    has_response=True,
                    response=pb.RequestOutputs(failure=INTERNAL, message=message),
                    final=True,
                )
            )

    def returned(self, last_message: pb.ExecuteResponse) -> pb.ExecuteResponse | StillSending:
        """execute returned: the batch's last message now if every final is
        in, else the worker is told (execute_returned) and gets it later."""
        with self._lock:
            self._last_message = last_message
            if not self._unfinished:
                return last_message
            if self._emit is not None:
                self._emit(pb.ExecuteResponse(more=True, execute_returned=True))
        return StillSending(self._last)


def _split_ragged(arr: np.ndarray, shapes: pb.RaggedShapes, requests: int) -> list[np.ndarray]:
    rank = int(shapes.rank)
    dims = list(shapes.dims)
    out, offset = [], 0
    for i in range(requests):
        shape = tuple(dims[i * rank : (i + 1) * rank])
        count = math.prod(shape)
        out.append(arr[offset : offset + count].reshape(shape))
        offset += count
    return out


def _failed(reason: pb.FailureReason, message: str) -> pb.ExecuteResponse:
    return pb.ExecuteResponse(failure=reason, message=message)


def config_json(config: Any) -> str:
    """A ModelConfig proto as the JSON Triton gives `initialize`: field names as
    in config.pbtxt, every field present (defaults too), 64-bit integers as
    numbers (protobuf's JSON writes them as strings)."""
    from google.protobuf import json_format

    as_dict = json_format.MessageToDict(
        config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return json.dumps(_int64_numbers(as_dict))


def _int64_numbers(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _int64_numbers(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_int64_numbers(v, key) for v in value]
    if key == "string_value":  # a parameter's text stays text
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return value
