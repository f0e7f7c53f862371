"""A Python-backend instance in its own process (a stub), as Triton runs each.

Chosen per model with the parameter `STAGESERVE_INSTANCE_PROCESS` ("true" /
"false"), or for every Python model of a worker with
`STAGESERVE_WORKER_PYTHON_INSTANCE_PROCESS=1`; the default is in-process
(docs/python_backend.md has the measurements behind that choice).

`ProcessInstance` has PythonInstance's interface (`execute_batch(request,
emit)`, `close()`), so the worker hosts it the same way: the batch goes to
the stub as the ExecuteRequest's bytes, the stub runs the very same
PythonInstance code, and its ExecuteResponse (and a decoupled model's early
messages) come back as bytes. What a process buys: a model.py that kills its
process (a segfault in a C extension, `os._exit`) fails only the requests
it was executing, INTERNAL "Stub process '<instance>' is not healthy." as in
Triton 2.51, and a new stub is started at once (initialize runs again) while
the worker and its other models go on (beyond Triton 2.51, checked: it
answers that error ~1 s after the crash, then to every later request of the
instance until the model is reloaded); and pure-Python code of several
instances runs in parallel. What it costs: the stub's start at load (an
interpreter and the model's imports) and a copy of every batch both ways.

BLS calls made in a stub come to the worker (`("bls", ...)` messages) and go
through the worker's one BLS client, as an in-process instance's do. A
decoupled call's responses go back one by one as they arrive
(`("bls_part", ...)`, then `("bls_result", ...)` with the last), from a
thread of their own: a long stream holds no thread other calls wait for,
and the worker's loop never writes to the socket.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.worker.backends import Emit, StillSending
from services.worker.python_backend import pb_utils
from services.worker.python_backend.bls_wire import (
    request_from_wire,
    response_to_wire,
)
from services.worker.python_backend.env_launch import stub_command
from services.worker.python_backend.instance import INTERNAL, PythonModelError
from services.worker.python_backend.stub import InitArgs
from services.worker.python_backend.stub_wire import StubSocket
from stageserve.config import ModelSpec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.python_exec_env import PARAMETER as ENV_PARAMETER
from stageserve.python_exec_env import ExecutionEnv

log = logging.getLogger(__name__)

#: the model parameter that chooses a process per instance for one model
PARAMETER = "STAGESERVE_INSTANCE_PROCESS"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
# How often the reader looks at the stub's exit while no message comes: a
# process the model forked may hold the socket, and then no end of file comes.
_EXIT_POLL_S = 0.2
# How long close() waits for finalize() in the stub before killing it.
_CLOSE_TIMEOUT_S = 30.0
# How long a stub whose socket ended gets to exit by itself before it is
# killed. A dying process closes its files before it can be reaped; killing it
# in that moment would log -9 (our kill) instead of its own status (seen in
# CI as [3, -9, -9] for [3, -9, 0]). A stub that ends normally exits within ms.
_EXIT_GRACE_S = 1.0


class InstanceProcessError(ValueError):
    """STAGESERVE_INSTANCE_PROCESS has a value that is not a boolean."""


def runs_in_process(spec: ModelSpec, default: bool) -> bool:
    """True: this model's instances each get a stub process. `default`, for a
    model that does not say: WorkerSettings.python_instance_process. A model
    with an execution environment (EXECUTION_ENV_PATH) always does: its
    packages cannot be the worker's; saying "false" for it fails the load."""
    value = spec.parameters.get(PARAMETER)
    own_env = bool(spec.parameters.get(ENV_PARAMETER))
    if value is None:
        return default or own_env
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        if own_env:
            raise InstanceProcessError(
                f"model '{spec.name}': parameter {ENV_PARAMETER} needs a process per "
                f"instance, and parameter {PARAMETER} is {value!r}"
            )
        return False
    raise InstanceProcessError(
        f"model '{spec.name}': parameter {PARAMETER} must be true or false, not {value!r}"
    )


@dataclass
class _Batch:
    emit: Emit | None
    open: set[int]  # decoupled requests still without their final flag
    answer: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    last: concurrent.futures.Future | None = None  # set once execute returned early


class _Stub:
    """One running stub process, its socket and the batches it executes."""

    def __init__(self, proc: subprocess.Popen, conn: StubSocket) -> None:
        self.proc = proc
        self.conn = conn
        self.lock = threading.Lock()
        self.batches: dict[int, _Batch] = {}
        self.dead = False
        self.closed: concurrent.futures.Future = concurrent.futures.Future()

    def send(self, message: tuple) -> None:
        self.conn.send(message)  # thread-safe (stub_wire.py)

    def recv(self) -> Any:
        """The next message, or None once the stub is gone."""
        while True:
            try:
                if self.conn.poll(_EXIT_POLL_S):
                    return self.conn.recv()
            except (EOFError, OSError):
                return None
            if self.proc.poll() is not None:
                return None

    def register(self, batch_id: int, batch: _Batch) -> bool:
        with self.lock:
            if self.dead:
                return False
            self.batches[batch_id] = batch
            return True


class ProcessInstance:
    #: Never inline on the event loop: a BLS call from the stub waits on it.
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
        execution_env: ExecutionEnv | None = None,
    ) -> None:
        self.spec = spec
        self._env = execution_env  # None: the worker's own interpreter and packages
        self.instance_name = instance_name
        self.decoupled = spec.decoupled
        self._init = InitArgs(
            str(model_file), spec, config_json, instance_name, kind, device_id, version
        )
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards _stub and its replacement
        self._closing = False
        # BLS calls from the stub wait on the worker's loop: never on the reader thread.
        self._bls_pool = concurrent.futures.ThreadPoolExecutor(
            4, thread_name_prefix=f"bls-{instance_name}"
        )
        self._stub: _Stub | None = self._start()  # PythonModelError: the load fails

    # ------------------------------------------------------------- the stub

    def _start(self) -> _Stub:
        parent, child = socket.socketpair()
        argv, variables = stub_command(child.fileno(), self._env)
        try:
            proc = subprocess.Popen(argv, pass_fds=[child.fileno()], env=variables)
        finally:
            child.close()
        stub = _Stub(proc, StubSocket(parent))
        stub.send(("init", self._init))
        first = stub.recv()
        if first is None or first[0] != "ready":
            reason = (
                first[1]
                if first is not None and first[0] == "init_failed"
                else f"its stub process ended with status {proc.wait()} before initializing"
            )
            _stop(stub)
            raise PythonModelError(reason)
        threading.Thread(
            target=self._read, args=(stub,), name=f"stub-{self.instance_name}", daemon=True
        ).start()
        log.info("python stub started", extra={"instance": self.instance_name, "pid": proc.pid})
        return stub

    def _current(self) -> _Stub:
        """The live stub, a new one if the last died (initialize runs again)."""
        with self._lock:
            if self._stub is None or self._stub.dead:
                self._stub = None
                self._stub = self._start()
            return self._stub

    def _read(self, stub: _Stub) -> None:
        """Route the stub's messages until it is gone."""
        while (message := stub.recv()) is not None:
            kind = message[0]
            if kind == "part":
                self._part(stub, message[1], pb.ExecuteResponse.FromString(message[2]))
            elif kind == "done":
                with stub.lock:
                    batch = stub.batches.pop(message[1], None)
                if batch is not None:
                    _resolve(batch, pb.ExecuteResponse.FromString(message[2]))
            elif kind == "bls":
                if message[2]:  # decoupled: streams for as long as its target sends
                    threading.Thread(
                        target=self._bls_stream,
                        args=(stub, message[1], message[3]),
                        name=f"bls-stream-{self.instance_name}",
                        daemon=True,
                    ).start()
                else:
                    self._bls_pool.submit(self._bls, stub, message[1], message[3])
            elif kind == "closed":
                stub.closed.set_result(None)
                break
        self._gone(stub)

    def _part(self, stub: _Stub, batch_id: int, message: pb.ExecuteResponse) -> None:
        with stub.lock:
            batch = stub.batches.get(batch_id)
        if batch is None:
            return
        for part in message.parts:
            if part.final:
                batch.open.discard(part.request_index)
        if batch.emit is not None:
            batch.emit(message)
        if message.execute_returned:
            batch.last = concurrent.futures.Future()
            batch.answer.set_result(StillSending(batch.last))

    def _bls(self, stub: _Stub, call_id: int, wire: dict) -> None:
        try:
            response = _bls_client().response(request_from_wire(wire))
            answer: tuple = ("bls_result", call_id, True, [response_to_wire(response)])
        except Exception as exc:  # answered, never left waiting
            answer = _bls_failure(call_id, exc)
        with contextlib.suppress(OSError):  # the stub died meanwhile
            stub.send(answer)

    def _bls_stream(self, stub: _Stub, call_id: int, wire: dict) -> None:
        """A decoupled call: each response to the stub as it arrives
        ("bls_part"), the last one in the "bls_result" that ends the call."""
        try:
            responses = _bls_client().stream(request_from_wire(wire))
            for response in responses:  # waits on this thread, never on the loop
                if responses.finished:
                    answer: tuple = ("bls_result", call_id, True, [response_to_wire(response)])
                    break
                stub.send(("bls_part", call_id, response_to_wire(response)))
            else:
                answer = ("bls_result", call_id, True, [])
        except OSError:  # the stub died: the rest is dropped (the target runs to its end)
            return
        except Exception as exc:  # answered, never left waiting
            answer = _bls_failure(call_id, exc)
        with contextlib.suppress(OSError):  # the stub died meanwhile
            stub.send(answer)

    def _gone(self, stub: _Stub) -> None:
        """The stub exited: every batch it held fails, and (unless the instance
        is closing) a new stub starts now (beyond Triton 2.51, which keeps
        failing the instance until a reload)."""
        with stub.lock:
            stub.dead = True
            batches, stub.batches = stub.batches, {}
        closing = self._closing  # as it was when the stub went, not after the grace
        if not closing:
            message = self._unhealthy()
            for batch in batches.values():  # answered now, not after the grace
                _fail(batch, message)
        with contextlib.suppress(subprocess.TimeoutExpired):
            stub.proc.wait(timeout=_EXIT_GRACE_S)
        _stop(stub)
        status = stub.proc.returncode
        if not stub.closed.done():
            stub.closed.set_result(None)
        if closing:
            return
        log.error(
            "python stub died",
            extra={"instance": self.instance_name, "status": status, "batches": len(batches)},
        )
        try:
            self._current()
        except PythonModelError as exc:  # tried again at the next batch
            log.error(
                "python stub restart failed",
                extra={"instance": self.instance_name, "error": str(exc)},
            )

    def _unhealthy(self) -> str:
        """Triton 2.51's answer, word for word (checked), for each request a
        dead stub held: INTERNAL, also as a decoupled request's error final."""
        return f"Stub process '{self.instance_name}' is not healthy."

    # ------------------------------------------------------ the instance API

    def execute_batch(
        self, request: pb.ExecuteRequest, emit: Emit | None
    ) -> pb.ExecuteResponse | StillSending:
        try:
            stub = self._current()
        except PythonModelError as exc:
            return pb.ExecuteResponse(
                failure=INTERNAL,
                message=f"Stub process '{self.instance_name}' is not healthy: "
                f"it could not restart: {exc}",
            )
        open_ = set()
        if self.decoupled:
            padding = {i for i, info in enumerate(request.request_info) if info.padding}
            open_ = set(range(len(request.request_batch_sizes))) - padding
        batch = _Batch(emit, open_)
        batch_id = next(self._ids)
        if not stub.register(batch_id, batch):
            _fail(batch, self._unhealthy())
        else:
            # An OSError: the reader sees the stub gone and fails the batch.
            with contextlib.suppress(OSError):
                stub.send(("exec", batch_id, request.SerializeToString()))
        return batch.answer.result()

    def close(self) -> None:
        """finalize() in the stub (after its last batch), then the stub exits."""
        self._closing = True
        with self._lock:
            stub, self._stub = self._stub, None
        if stub is not None and not stub.dead:
            try:
                stub.send(("close",))
                stub.closed.result(timeout=_CLOSE_TIMEOUT_S)
            except (OSError, concurrent.futures.TimeoutError):
                log.warning("python stub did not finalize", extra={"instance": self.instance_name})
            _stop(stub)
        self._bls_pool.shutdown(wait=False)


def _bls_client() -> Any:
    """The worker's BLS client (bls.py), as an in-process instance's exec() finds it."""
    client = pb_utils.InferenceRequest._bls
    if client is None:
        raise pb_utils.TritonModelException("BLS requests can only be executed inside a model")
    return client


def _bls_failure(call_id: int, exc: Exception) -> tuple:
    """The answer that makes exec() raise in the stub, as it would in-process."""
    if isinstance(exc, pb_utils.TritonModelException):
        return ("bls_result", call_id, False, exc.message())
    return ("bls_result", call_id, False, f"{type(exc).__name__}: {exc}")


def _resolve(batch: _Batch, message: pb.ExecuteResponse) -> None:
    if batch.last is not None:
        if batch.last.set_running_or_notify_cancel():  # cancelled: its stream went away
            batch.last.set_result(message)
    elif not batch.answer.done():
        batch.answer.set_result(message)


def _fail(batch: _Batch, message: str) -> None:
    """A batch whose stub died: each open decoupled request gets an error
    final, then the batch ends; any other batch fails as a whole."""
    if batch.emit is not None and batch.open:
        for index in sorted(batch.open):
            batch.emit(
                pb.ExecuteResponse(
                    more=True,
                    parts=[
                        pb.DecoupledPart(
                            request_index=index,
                            has_response=True,
                            response=pb.RequestOutputs(failure=INTERNAL, message=message),
                            final=True,
                        )
                    ],
                )
            )
        batch.open.clear()
        _resolve(batch, pb.ExecuteResponse())
        return
    _resolve(batch, pb.ExecuteResponse(failure=INTERNAL, message=message))


def _stop(stub: _Stub) -> None:
    """Kill the stub if it still runs and close its socket (once: close()
    and the reader thread may both get here)."""
    with stub.lock:
        if stub.proc.poll() is None:
            stub.proc.kill()
            stub.proc.wait()
        if not stub.conn.closed:
            stub.conn.close()
