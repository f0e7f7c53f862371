"""Shared helpers for the integration tests.

Everything here talks to the stack the way a Triton user would: through the
real ``tritonclient.grpc`` package, and (for requests tritonclient cannot
build, e.g. typed ``contents`` or parameters of the wrong type) through
tritonclient's own generated stubs ``tritonclient.grpc.service_pb2`` /
``service_pb2_grpc``. Nothing here imports ``stageserve.generated``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from stageserve.launcher import Child
from tests.stack import RunningStack, running_stack, start_stack

#: Upper bound for any single RPC a test makes; nothing may hang a test.
RPC_TIMEOUT_S = 30.0


# --------------------------------------------------------------- tritonclient


def client(url: str) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(url)


def simple_inputs(a: np.ndarray, b: np.ndarray) -> list[grpcclient.InferInput]:
    i0 = grpcclient.InferInput("INPUT0", list(a.shape), "INT32")
    i0.set_data_from_numpy(a)
    i1 = grpcclient.InferInput("INPUT1", list(b.shape), "INT32")
    i1.set_data_from_numpy(b)
    return [i0, i1]


def tensor_input(name: str, data: np.ndarray, datatype: str) -> grpcclient.InferInput:
    inp = grpcclient.InferInput(name, list(data.shape), datatype)
    inp.set_data_from_numpy(data)
    return inp


def infer_simple(
    c: grpcclient.InferenceServerClient, batch: int = 1, model: str = "simple", **kwargs
) -> grpcclient.InferResult:
    """A valid request to an add/sub model; checks the answer."""
    a = np.arange(16 * batch, dtype=np.int32).reshape(batch, 16)
    b = np.full((batch, 16), 2, dtype=np.int32)
    result = c.infer(model, simple_inputs(a, b), client_timeout=RPC_TIMEOUT_S, **kwargs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    return result


def mlp_input(batch: int = 1, seed: int = 0) -> list[grpcclient.InferInput]:
    x = np.random.default_rng(seed).standard_normal((batch, 256)).astype(np.float32)
    return [tensor_input("INPUT0", x, "FP32")]


def expect_error(
    fn, *args, status: str | tuple[str, ...], contains: tuple[str, ...] = (), **kwargs
) -> InferenceServerException:
    """Call a tritonclient method that must fail; check status and message."""
    with pytest.raises(InferenceServerException) as info:
        fn(*args, **kwargs)
    err = info.value
    wanted = (status,) if isinstance(status, str) else status
    assert err.status() in wanted, f"status {err.status()} not in {wanted}: {err.message()}"
    message = err.message() or ""
    for fragment in contains:
        assert fragment in message, f"{fragment!r} not in error message {message!r}"
    return err


def model_stats(c: grpcclient.InferenceServerClient, model: str, version: str = ""):
    stats = c.get_inference_statistics(model, version, client_timeout=RPC_TIMEOUT_S)
    assert len(stats.model_stats) == 1, stats
    return stats.model_stats[0]


def index_states(c: grpcclient.InferenceServerClient) -> dict[str, dict[str, tuple[str, str]]]:
    """RepositoryIndex as {model: {version: (state, reason)}}."""
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for m in c.get_model_repository_index(client_timeout=RPC_TIMEOUT_S).models:
        out.setdefault(m.name, {})[m.version] = (m.state, m.reason)
    return out


# ------------------------------------------------------------------ raw stubs


@contextlib.contextmanager
def raw_stub(url: str) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    """tritonclient's own generated stub, for requests its client API cannot build."""
    channel = grpc.insecure_channel(url)
    try:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    finally:
        channel.close()


def raw_infer(url: str, request: service_pb2.ModelInferRequest) -> service_pb2.ModelInferResponse:
    with raw_stub(url) as stub:
        return stub.ModelInfer(request, timeout=RPC_TIMEOUT_S)


def expect_raw_error(
    url: str,
    request: service_pb2.ModelInferRequest,
    code: grpc.StatusCode,
    contains: tuple[str, ...] = (),
) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        raw_infer(url, request)
    err = info.value
    assert err.code() == code, f"{err.code()} != {code}: {err.details()}"
    for fragment in contains:
        assert fragment in (err.details() or ""), f"{fragment!r} not in {err.details()!r}"
    return err


def raw_request(
    model: str, inputs: list[tuple[str, str, list[int]]], version: str = ""
) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest with the given (name, datatype, shape) inputs and no data."""
    request = service_pb2.ModelInferRequest(model_name=model, model_version=version)
    for name, datatype, shape in inputs:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    return request


def simple_raw_request(batch: int = 1) -> service_pb2.ModelInferRequest:
    """A valid raw-contents request for `simple`."""
    request = raw_request(
        "simple", [("INPUT0", "INT32", [batch, 16]), ("INPUT1", "INT32", [batch, 16])]
    )
    data = np.ones((batch, 16), np.int32).tobytes()
    request.raw_input_contents.extend([data, data])
    return request


def bytes_framing(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


def output_array(
    response: service_pb2.ModelInferResponse, name: str, dtype: np.dtype
) -> np.ndarray:
    for i, out in enumerate(response.outputs):
        if out.name == name:
            return np.frombuffer(response.raw_output_contents[i], dtype=dtype).reshape(
                list(out.shape)
            )
    raise KeyError(name)


# --------------------------------------------------------------------- stacks

# The launcher starts children with fork + preexec_fn. When this (test) process
# has gRPC threads busy (tritonclient channels from earlier tests), gRPC's fork
# handlers occasionally leave the forked child aborting before it execs
# ("epoll_wait error: Bad file descriptor", exit code -6). That is a harness
# problem, not a server one (GRPC_ENABLE_FORK_SUPPORT=0 set before grpc is first
# imported makes it go away), so stacks started here get a few attempts.
START_ATTEMPTS = 3


def start_stack_retrying(repository: Path, **kwargs) -> RunningStack:
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return start_stack(repository, **kwargs)
        except RuntimeError as exc:
            if attempt == START_ATTEMPTS:
                raise
            warnings.warn(f"stack start attempt {attempt} failed: {exc}; retrying", stacklevel=2)
    raise AssertionError("unreachable")


@contextlib.contextmanager
def stack_retrying(repository: Path, **kwargs) -> Iterator[RunningStack]:
    """tests.stack.running_stack, with start_stack_retrying."""
    running = start_stack_retrying(repository, **kwargs)
    try:
        yield running
    finally:
        running.stack.stop()


def start_worker_retrying(running: RunningStack, name: str = "worker-extra") -> Child:
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return running.start_worker(name if attempt == 1 else f"{name}-{attempt}")
        except RuntimeError as exc:
            if attempt == START_ATTEMPTS:
                raise
            warnings.warn(f"worker start attempt {attempt} failed: {exc}; retrying", stacklevel=2)
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------- redis


def worker_id(pid: int) -> str:
    """The id a worker started without --worker-id registers under."""
    return f"{socket.gethostname()}-{pid}"


def redis_client(redis_url: str):
    import redis

    return redis.Redis.from_url(redis_url, socket_timeout=5)


def registered_workers(redis_url: str) -> set[str]:
    r = redis_client(redis_url)
    try:
        return {w.decode() for w in r.smembers("ss:rl:workers")}
    finally:
        r.close()


def held_grants(redis_url: str, prefix: str = "") -> list[str]:
    """The rate limiter's grant ids (ss:rl:grants) that begin with `prefix`."""
    r = redis_client(redis_url)
    try:
        ids = [g.decode() for g in r.zrange("ss:rl:grants", 0, -1)]
    finally:
        r.close()
    return [g for g in ids if g.startswith(prefix)]


def registered_instances(redis_url: str, model: str, version: int = 1) -> set[str]:
    r = redis_client(redis_url)
    try:
        return {i.decode() for i in r.smembers(f"ss:rl:pool:{model}:{version}")}
    finally:
        r.close()


def granted_instances(redis_url: str) -> set[str]:
    """Instances holding an execution grant right now (rate limiter keys in
    Redis). A scheduler asks for a grant when it has a request to run and
    keeps spare ones it is not using for a while (grant_pool.py), so a grant
    is not proof of an execution."""
    r = redis_client(redis_url)
    try:
        out = set()
        for gid in r.zrange("ss:rl:grants", 0, -1):
            iid = r.hget(f"ss:rl:grant:{gid.decode()}", "instance")
            if iid:
                out.add(iid.decode())
        return out
    finally:
        r.close()


def queued_requests(stack: RunningStack, model: str) -> float:
    """`model`'s requests waiting in the scheduler's queue, not yet in a batch
    (its nv_inference_pending_request_count)."""
    url = f"http://127.0.0.1:{stack.scheduler.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("nv_inference_pending_request_count{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def model_grants(stack: RunningStack, model: str) -> int:
    """Execution grants held for `model`'s instances right now."""
    return sum(f"/{model}/" in i for i in granted_instances(stack.redis_url))


def sole_request_in_a_batch(stack: RunningStack, model: str) -> bool:
    """The one request sent to `model` while it held no grant (model_grants
    was 0: a queue keeps spare grants a moment after its last batch) has
    left the queue in a batch: the scheduler holds a grant for it, which it
    asks for only once the request is queued, and after that its queue is
    empty (the stack needs stage_metrics). A grant alone is no such proof:
    the scheduler forms the batch when the grant comes back, and requests
    sent in between join it."""
    return model_grants(stack, model) == 1 and queued_requests(stack, model) == 0


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def two_paths(
    root: Path, gateway_args: tuple[str, ...] = (), **stack_kwargs
) -> Iterator[tuple[RunningStack, Child, grpcclient.InferenceServerClient]]:
    """The stack plus a second scheduler and a gateway ("gateway-2", started with
    `gateway_args` too) in front of it; `stack_kwargs` go to running_stack (its
    scheduler_extra to the second scheduler too)."""
    with running_stack(root, **stack_kwargs) as running:
        common = [
            "--listen",
            "127.0.0.1:0",
            "--redis-url",
            running.redis_url,
            "--ratelimiter",
            running.ratelimiter.address,
        ]
        sched2 = running.stack.start_service(
            "scheduler-2",
            [
                "scheduler",
                *common,
                "--scheduler-id",
                "scheduler-2",
                *stack_kwargs.get("scheduler_extra", ()),
            ],
        )
        gw2 = running.stack.start_service(
            "gateway-2",
            [
                "gateway",
                *common,
                "--scheduler",
                sched2.address,
                "--model-repository",
                str(root),
                # a port of its own: the default (Triton's 8000) may be taken
                "--http-address",
                "127.0.0.1",
                "--http-port",
                "0",
                *gateway_args,
            ],
        )
        yield running, sched2, grpcclient.InferenceServerClient(gw2.address)


def make_certs(d: Path) -> Path:
    """A CA and server/client certificates (SAN 127.0.0.1, localhost) in `d`,
    made with the openssl CLI; skips the test when there is none."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make test certificates")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=stageserve-test-ca",
    )  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who in ("server", "client"):
        openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key",
            "-out", f"{who}.csr", "-subj", f"/CN={who}",
        )  # fmt: skip
        openssl(
            "x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-out", f"{who}.crt", "-extfile", "san.ext",
        )  # fmt: skip
    return d


@contextlib.contextmanager
def triton_grpc(repository: Path, workdir: Path, models: list[str], *extra: str) -> Iterator[str]:
    """Real Triton 2.51 (.venv-triton) serving `repository` over gRPC only;
    yields its address once `models` are ready. Skips the test without it."""
    from bench.references import ReferenceNotInstalled, start_grpc_triton, stop_process

    try:
        proc, url = start_grpc_triton(workdir, repository, models, extra)
    except ReferenceNotInstalled as exc:
        pytest.skip(str(exc))
    _TRITON_LOGS[url] = workdir / "tritonserver.log"
    try:
        yield url
    finally:
        stop_process(proc)
        _TRITON_LOGS.pop(url, None)


#: What tritonserver 2.51 writes when it crashes on its own: a segfault (seen in
#: TRITONBACKEND_ResponseSend under a decoupled Python model's sender threads)
#: or its Python backend's abort on its interprocess lock, both with the 2-core
#: machine loaded.
TRITON_CRASHES = ("Signal (11) received", "boost::interprocess::lock_exception")
_TRITON_LOGS: dict[str, Path] = {}


@contextlib.contextmanager
def skip_if_triton_crashed(url: str) -> Iterator[None]:
    """Around a check against real Triton (`triton_grpc`'s address): when it
    fails because Triton itself crashed, skip, naming the crash; the referee's
    answer is lost, nothing is learned of ours. Any other failure stands."""
    try:
        yield
    except Exception:
        log = _TRITON_LOGS.get(url)
        text = log.read_text(errors="replace") if log is not None and log.exists() else ""
        for mark in TRITON_CRASHES:
            if mark in text:
                pytest.skip(f"real Triton crashed during the check ({mark!r} in its log)")
        raise


# ------------------------------------------------------------- a Python echo

# Echoes IN (INT32, dims [1]) as OUT; a negative value first sleeps 1 s (a
# call kept in flight). Real Triton 2.51 has only the Python backend here, so
# checks that run the same calls against both servers use it.
ECHO_MODEL = """
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if int(x.flat[0]) < 0:
                time.sleep(1.0)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return out
"""


def write_echo(root: Path, max_batch_size: int = 0, count: int = 1) -> Path:
    """The `echo` model above in the repository `root`; returns `root`."""
    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    (root / "echo" / "config.pbtxt").write_text(
        f"""name: "echo"
backend: "python"
max_batch_size: {max_batch_size}
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: {count} }} ]
"""
    )
    return root
