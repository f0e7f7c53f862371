"""The reference servers StageServe is measured against, started and stopped by code.

Three servers, one at a time, each serving the SAME models (same ONNX bytes,
same weights), built by :mod:`stageserve_tools.examples` and :mod:`bench.cnn`:

``identity``
    FP32 ``INPUT0`` -> ``OUTPUT0``, dims ``[16]``.
``mlp``
    256 -> 1024 -> 1024 -> 10 classifier (:func:`stageserve_tools.examples.mlp_model`).
``cnn``
    the ResNet-style CNN of :func:`bench.cnn.cnn_model` (width 32), FP32
    ``INPUT`` ``[3, 32, 32]`` -> ``OUTPUT`` ``[10]``: a compute-bound model
    (about 1.5 ms of CPU per image, see :data:`CNN_IMAGE_SIZE`).

All with ``max_batch_size: 64`` and dynamic batching, and ONNX Runtime with
the same session options everywhere (intra-op threads = cores // instances,
no spin-waiting).

* **triton** -- the real ``tritonserver`` 2.51 from the ``nvidia-pytriton``
  wheel (``scripts/install_references.sh`` -> ``.venv-triton``), started
  directly. That build ships only the Python backend, so each model is a
  ``backend: "python"`` model whose ``model.py`` (:mod:`bench.triton_model`)
  runs the ``.onnx`` file with ONNX Runtime, one ``session.run`` per dynamic
  batch.
* **mlserver** -- MLServer 1.7 (``.venv-mlserver``) with a custom runtime
  (:mod:`bench.mlserver_runtime`) and adaptive batching. MLServer has no
  ``ModelConfig`` RPC, which ``perf_analyzer`` needs once before measuring:
  by default :mod:`bench.mlserver_boot` adds that one method to MLServer's own
  gRPC server (``config_rpc="inject"``: no extra hop); ``config_rpc="proxy"``
  instead puts :func:`serve_proxy` (a byte-for-byte gRPC forwarder that
  answers ``ModelConfig`` itself) in front of an unmodified MLServer.
* **stageserve** -- :func:`stageserve.launcher.start_services` on a
  repository written with :mod:`stageserve_tools.examples`.

``python -m bench.references SERVER`` starts one server on free ports, runs the
consistency check and waits (Ctrl-C stops it) -- handy for poking at it with
``perf_analyzer`` by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Protocol, TextIO

import numpy as np
import onnx
import psutil

from bench.blas_coretype import reference_coretype
from bench.cnn import CLASSES as CNN_CLASSES
from bench.cnn import cnn_model, reference_forward
from stageserve.config import parse_config_text
from stageserve.net import free_port
from stageserve_tools.examples import (
    config_text,
    identity_model,
    mlp_model,
    mlp_reference,
    mlp_weights,
    write_model,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent
TRITON_VENV = ".venv-triton"
MLSERVER_VENV = ".venv-mlserver"
SERVERS = ("triton", "mlserver", "stageserve")
MODELS = ("identity", "mlp", "cnn", "numpy")
#: What ``python -m bench.compare`` runs without ``--models``. ``numpy`` is
#: issue 10's Python-backend model (``--servers triton stageserve-python
#: --models numpy``); ONNX servers run its ONNX twin.
DEFAULT_MODELS = ("identity", "mlp", "cnn")
#: Layer sizes of the ``numpy`` model (an MLP, Gemm + ReLU, softmax). Chosen so
#: its numpy ``execute`` (bench/numpy_model.py) does at least 1 ms of work per
#: batch: numpy 1.26 / OpenBLAS on this 2-vCPU VM, one thread, took 0.75 ms at
#: (512, 2048, 2048, 16) for a batch of 1 and 3.6 ms for 8; the 1024-wide input
#: adds 2M multiply-adds per row (24 MB of weights read per batch).
NUMPY_SIZES = (1024, 2048, 2048, 16)
MAX_BATCH_SIZE = 64
#: Seed of the input rows perf_analyzer sends (BenchModel.write_input_data).
PERF_DATA_SEED = 11
#: Image side of the ``cnn`` model. Chosen so one inference does real work yet
#: a run at c=8 and c=32 stays short: onnxruntime 1.32 alone on this 2-vCPU VM
#: (load average 0.7; :func:`bench.cnn.cnn_model` at width 32, no spinning)
#: took 1.45 ms of CPU per image at batch 1 on 1 intra-op thread, 1.93 ms of
#: CPU (1.23 ms wall) on the benchmark's 2 threads, and 1.3-1.4 ms of CPU per
#: image in batches of 8. (16: 0.4 ms, 24: 0.9 ms, 40: 2.1 ms, 48: 3.1 ms.)
CNN_IMAGE_SIZE = 32
CNN_WIDTH = 32
#: Consistency tolerance of ``cnn``, relative to the reference's largest
#: output: 15 float32 convolutions (fan-in up to 128*3*3 = 1152) summed in
#: ONNX Runtime's kernel-dependent order against a float64 numpy forward pass.
#: Measured error 3.5e-6 on outputs up to 15.6 (2e-7 relative); 1e-4 leaves
#: room for other CPUs' kernels (AVX2 / AVX-512 paths, thread splits) while a wrong
#: weight, layout or batch split shows up as errors of order 1.
CNN_RTOL = 1e-4
MLSERVER_RUNTIME_MODULE = "stageserve_bench_runtime"
MLSERVER_IMPLEMENTATION = f"{MLSERVER_RUNTIME_MODULE}.OnnxRuntimeModel"
MODEL_CONFIG_METHOD = "/inference.GRPCInferenceService/ModelConfig"
STREAM_METHODS = frozenset({"/inference.GRPCInferenceService/ModelStreamInfer"})

INSTALL_HINT = "run scripts/install_references.sh"
_PR_SET_PDEATHSIG = 1


class ReferenceNotInstalled(FileNotFoundError):
    """A reference server's virtualenv is missing (see scripts/install_references.sh)."""


class ServerStartError(RuntimeError):
    """A server process exited or did not become ready; carries its log tail."""


# --------------------------------------------------------------------------- models

#: (name, Triton datatype, dims without the batch dimension)
Tensor = tuple[str, str, tuple[int, ...]]


@dataclass(frozen=True)
class BenchModel:
    name: str
    onnx: bytes = field(repr=False)
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]

    @property
    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        """Input name -> dims without the batch dimension (perf_analyzer's ``--shape``)."""
        return {name: dims for name, _, dims in self.inputs}

    def input_rows(self, seed: int = PERF_DATA_SEED) -> dict[str, np.ndarray]:
        """One request's row of the (one) input: :func:`consistency_input`'s
        standard-normal FP32, from another fixed seed."""
        name, _, _ = self.inputs[0]
        return {name: consistency_input(self, batch=1, seed=seed)[0]}

    def write_input_data(self, path: Path) -> Path:
        """perf_analyzer's ``--input-data FILE``: :meth:`input_rows` as its JSON
        (``{"data": [{name: {"content": [...], "shape": dims}}]}``), so every
        server is sent the same realistic numbers.

        Why not perf_analyzer's default random data: it fills each input with
        random bytes, and read as FP32 some are NaN or infinite. The cnn's
        outputs were then NaN on every server, and MLServer, which encodes a
        NaN output as null, fails every such request ("required argument is
        not a float" while packing the raw output; perf_analyzer exit 99), so
        the cnn would have no MLServer figures.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        row = {
            name: {"content": [float(v) for v in arr.ravel()], "shape": list(arr.shape)}
            for name, arr in self.input_rows().items()
        }
        path.write_text(json.dumps({"data": [row]}))
        return path


def bench_model(name: str) -> BenchModel:
    """One of :data:`MODELS`, as ONNX bytes plus its tensors."""
    if name == "identity":
        dims = (16,)
        onnx_model = identity_model("FP32", dims, MAX_BATCH_SIZE)
        return BenchModel(
            name,
            onnx_model.SerializeToString(),
            (("INPUT0", "FP32", dims),),
            (("OUTPUT0", "FP32", dims),),
        )
    if name == "mlp":
        sizes = (256, 1024, 1024, 10)
        onnx_model = mlp_model(sizes, MAX_BATCH_SIZE)
        return BenchModel(
            name,
            onnx_model.SerializeToString(),
            (("INPUT0", "FP32", (sizes[0],)),),
            (("OUTPUT0", "FP32", (sizes[-1],)),),
        )
    if name == "cnn":
        onnx_model = cnn_model(CNN_IMAGE_SIZE, CNN_WIDTH)
        side = CNN_IMAGE_SIZE
        return BenchModel(
            name,
            onnx_model.SerializeToString(),
            (("INPUT", "FP32", (3, side, side)),),
            (("OUTPUT", "FP32", (CNN_CLASSES,)),),
        )
    if name == "numpy":
        onnx_model = mlp_model(NUMPY_SIZES, MAX_BATCH_SIZE)
        return BenchModel(
            name,
            onnx_model.SerializeToString(),
            (("INPUT0", "FP32", (NUMPY_SIZES[0],)),),
            (("OUTPUT0", "FP32", (NUMPY_SIZES[-1],)),),
        )
    raise ValueError(f"unknown benchmark model {name!r} (choose from {', '.join(MODELS)})")


def bench_models(names: Sequence[str] = DEFAULT_MODELS) -> list[BenchModel]:
    return [bench_model(n) for n in names]


def default_intra_op_threads(instances: int) -> int:
    """StageServe's worker default: split the cores between the instances."""
    return max(1, (os.cpu_count() or 1) // max(1, instances))


def stageserve_config_text(model: BenchModel, instances: int = 1) -> str:
    """config.pbtxt for StageServe (ONNX platform, dynamic batching)."""
    return config_text(
        model.name,
        model.inputs,
        model.outputs,
        max_batch_size=MAX_BATCH_SIZE,
        dynamic_batching=True,
        instance_count=instances,
    )


def triton_config_text(
    model: BenchModel, instances: int = 1, intra_op_threads: int | None = None
) -> str:
    """config.pbtxt for real Triton: the same model as a Python-backend model."""
    text = stageserve_config_text(model, instances)
    text = text.replace('platform: "onnxruntime_onnx"', 'backend: "python"')
    threads = intra_op_threads or default_intra_op_threads(instances)
    return text + (
        "parameters [\n  {\n"
        '    key: "intra_op_thread_count"\n'
        f'    value: {{ string_value: "{threads}" }}\n'
        "  }\n]\n"
    )


def write_stageserve_repository(
    root: Path, models: Sequence[BenchModel], instances: int = 1
) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for m in models:
        write_model(root, m.name, m.onnx, stageserve_config_text(m, instances))
    return root


def write_triton_repository(root: Path, models: Sequence[BenchModel], instances: int = 1) -> Path:
    """``<root>/<model>/config.pbtxt`` + ``1/model.onnx`` + ``1/model.py``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for m in models:
        model_dir = write_model(root, m.name, m.onnx, triton_config_text(m, instances))
        if m.name == "numpy":  # execute in numpy, with the ONNX twin's weights
            shutil.copyfile(BENCH_DIR / "numpy_model.py", model_dir / "1" / "model.py")
            arrays: dict[str, Any] = {}  # Any: savez's keywords include allow_pickle
            for i, (w, b) in enumerate(mlp_weights(NUMPY_SIZES)):
                arrays[f"W{i}"], arrays[f"B{i}"] = w, b
            np.savez(model_dir / "1" / "weights.npz", **arrays)
        else:
            shutil.copyfile(BENCH_DIR / "triton_model.py", model_dir / "1" / "model.py")
    return root


def model_config_response(config_text_: str) -> bytes:
    """A serialized ``inference.ModelConfigResponse`` for a config.pbtxt text."""
    from stageserve.generated import grpc_service_pb2 as gs

    return gs.ModelConfigResponse(config=parse_config_text(config_text_)).SerializeToString()


def mlserver_model_settings(
    model: BenchModel,
    *,
    max_batch_time_s: float = 0.001,
    intra_op_threads: int | None = None,
) -> dict:
    """``model-settings.json`` for one model (custom runtime, adaptive batching)."""

    def tensors(specs: Sequence[Tensor]) -> list[dict]:
        return [{"name": n, "datatype": dt, "shape": [-1, *dims]} for n, dt, dims in specs]

    return {
        "name": model.name,
        "implementation": MLSERVER_IMPLEMENTATION,
        "max_batch_size": MAX_BATCH_SIZE,
        "max_batch_time": max_batch_time_s,
        "inputs": tensors(model.inputs),
        "outputs": tensors(model.outputs),
        "parameters": {
            "uri": "./model.onnx",
            "extra": {"intra_op_threads": intra_op_threads or default_intra_op_threads(1)},
        },
    }


def mlserver_settings(
    *, grpc_port: int, http_port: int, metrics_port: int, parallel_workers: int = 0
) -> dict:
    """``settings.json``: no access log (``debug``), no metrics, loopback only."""
    return {
        "debug": False,
        "host": "127.0.0.1",
        "grpc_port": grpc_port,
        "http_port": http_port,
        "metrics_port": metrics_port,
        "metrics_endpoint": None,
        "parallel_workers": parallel_workers,
        "load_models_at_startup": True,
    }


def write_mlserver_repository(
    root: Path,
    models: Sequence[BenchModel],
    *,
    grpc_port: int,
    http_port: int,
    metrics_port: int,
    parallel_workers: int = 0,
    max_batch_time_s: float = 0.001,
    instances: int = 1,
) -> Path:
    """MLServer folder: settings.json, runtime module, ``<model>/`` with settings + onnx.

    Also writes ``model_configs.json`` (model -> hex ModelConfigResponse) for
    :mod:`bench.mlserver_boot` / :func:`serve_proxy`.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    settings = mlserver_settings(
        grpc_port=grpc_port,
        http_port=http_port,
        metrics_port=metrics_port,
        parallel_workers=parallel_workers,
    )
    (root / "settings.json").write_text(json.dumps(settings, indent=2))
    shutil.copyfile(BENCH_DIR / "mlserver_runtime.py", root / f"{MLSERVER_RUNTIME_MODULE}.py")
    configs = {}
    for m in models:
        mdir = root / m.name
        mdir.mkdir(parents=True, exist_ok=True)
        (mdir / "model.onnx").write_bytes(m.onnx)
        ms = mlserver_model_settings(m, max_batch_time_s=max_batch_time_s)
        (mdir / "model-settings.json").write_text(json.dumps(ms, indent=2))
        configs[m.name] = model_config_response(stageserve_config_text(m, instances)).hex()
    (root / "model_configs.json").write_text(json.dumps(configs, indent=2))
    return root


# --------------------------------------------------------------------------- installs


def _venv(name: str, env_var: str) -> Path:
    raw = Path(os.environ.get(env_var, name))
    return raw if raw.is_absolute() else REPO_ROOT / raw


@dataclass(frozen=True)
class TritonInstall:
    venv: Path
    binary: Path
    libs: Path  # nvidia_pytriton.libs
    backend_files: Path  # pytriton/tritonserver/backends/python
    stub: Path  # the triton_python_backend_stub for the venv's Python

    def make_backend_dir(self, root: Path) -> Path:
        """A ``--backend-directory`` whose ``python/`` holds the backend and the stub."""
        py = Path(root) / "python"
        py.mkdir(parents=True, exist_ok=True)
        for src in (
            self.backend_files / "libtriton_python.so",
            self.backend_files / "triton_python_backend_utils.py",
            self.stub,
        ):
            dst = py / src.name
            if not dst.exists():
                dst.symlink_to(src)
        return Path(root)

    def env(self) -> dict[str, str]:
        """tritonserver's environment: its libs, and the venv's Python first on PATH.

        The stub embeds Debian's libpython3.11 and takes ``sys.prefix`` from
        the ``python3`` it finds on PATH, so that must be the venv made from
        /usr/bin/python3.11 (numpy + onnxruntime in it). PYTHONHOME /
        PYTHONPATH from a pyenv shell would mix another stdlib in: dropped.
        OPENBLAS_CORETYPE is set when the venv's OpenBLAS does not know this
        CPU (bench/blas_coretype.py), unless the user set it.
        """
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "PYTHONPATH")}
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = f"{self.libs}:{old}" if old else str(self.libs)
        env["PATH"] = f"{self.venv / 'bin'}:{env.get('PATH', '')}"
        env.pop("VIRTUAL_ENV", None)
        if "OPENBLAS_CORETYPE" not in env:
            coretype = reference_coretype(self.venv / "bin" / "python")
            if coretype is not None:
                env["OPENBLAS_CORETYPE"] = coretype
                _announce_coretype(coretype)
        return env


@functools.cache
def _announce_coretype(coretype: str) -> None:
    print(
        f"Triton's numpy (OpenBLAS 0.3.23) does not know this CPU and would run its generic "
        f"kernels: tritonserver starts with OPENBLAS_CORETYPE={coretype} "
        f"(bench/blas_coretype.py)",
        flush=True,
    )


def find_triton(venv: str | os.PathLike[str] | None = None) -> TritonInstall:
    root = Path(venv) if venv is not None else _venv(TRITON_VENV, "TRITON_VENV")
    for site in sorted(root.glob("lib/python3*/site-packages")):
        dist = site / "pytriton" / "tritonserver"
        binary = dist / "bin" / "tritonserver"
        py = site.parent.name.removeprefix("python")  # "3.11"
        stub = dist / "python_backend_stubs" / py / "triton_python_backend_stub"
        if binary.is_file() and stub.is_file():
            return TritonInstall(
                root, binary, site / "nvidia_pytriton.libs", dist / "backends" / "python", stub
            )
    raise ReferenceNotInstalled(f"no tritonserver in {root}: {INSTALL_HINT}")


def find_mlserver_python(venv: str | os.PathLike[str] | None = None) -> Path:
    root = Path(venv) if venv is not None else _venv(MLSERVER_VENV, "MLSERVER_VENV")
    python = root / "bin" / "python"
    if not (python.exists() and (root / "bin" / "mlserver").exists()):
        raise ReferenceNotInstalled(f"no mlserver in {root}: {INSTALL_HINT}")
    return python


# --------------------------------------------------------------------------- processes


def _tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def stop_process(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """SIGTERM the process group we created, then SIGKILL what is left."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tree_cpu_seconds(pids: Sequence[int]) -> float:
    """user+system CPU seconds of these processes and all their descendants."""
    total = 0.0
    seen: set[int] = set()
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                t = p.cpu_times()
                total += t.user + t.system
    return total


def wait_ready(
    url: str,
    models: Sequence[str],
    timeout_s: float,
    procs: Sequence[subprocess.Popen] = (),
    log: Path | None = None,
) -> None:
    """Poll ServerReady and ModelReady over gRPC until all are ready."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    deadline = time.monotonic() + timeout_s
    client = grpcclient.InferenceServerClient(url)
    try:
        while True:
            for p in procs:
                if p.poll() is not None:
                    raise ServerStartError(
                        f"process {p.args[0] if isinstance(p.args, list) else p.args!s} exited "
                        f"with {p.returncode}\n{_tail(log)}"
                    )
            with contextlib.suppress(InferenceServerException):
                if client.is_server_ready() and all(client.is_model_ready(m) for m in models):
                    return
            if time.monotonic() > deadline:
                raise ServerStartError(f"{url} not ready after {timeout_s:.0f}s\n{_tail(log)}")
            time.sleep(0.2)
    finally:
        client.close()


class RunningServer:
    """A started server: its gRPC ``url`` and the processes whose CPU counts as the server's."""

    name = "server"

    def __init__(self) -> None:
        self.url = ""
        self.http_url = ""  # HTTP/REST endpoint, where the server was started with one
        self.procs: list[subprocess.Popen] = []
        self.extra_pids: list[int] = []
        self.log: Path | None = None
        self.notes: dict[str, str] = {}

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs] + list(self.extra_pids)

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.pids())

    def stop(self) -> None:
        for p in reversed(self.procs):
            stop_process(p)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _own_group_and_die_with_parent() -> None:
    """Runs in the child before exec: own process group (stopped as a whole), and
    SIGTERM when the harness dies, so a killed benchmark leaves no server behind."""
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


#: tritonserver 2.51's Python backend can abort on its own interprocess lock
#: (exit -6) while loading Python models with the machine loaded (seen: the
#: test suite on two processes beside two CPU burners on 2 cores), whatever it
#: was asked: the referee crashed, so it is started again.
TRITON_SELF_ABORT = "boost::interprocess::lock_exception"
TRITON_START_TRIES = 3


def start_grpc_triton(
    workdir: Path,
    repo: Path,
    models: Sequence[str],
    extra: Sequence[str] = (),
    timeout_s: float = 180.0,
) -> tuple[subprocess.Popen, str]:
    """tritonserver on `repo`, gRPC only on a free port (no HTTP, no metrics, no
    auto-complete), plus `extra` flags; (process, url) once `models` are ready.
    Its log is workdir/tritonserver.log. Started again (up to
    TRITON_START_TRIES in all) when it aborted on TRITON_SELF_ABORT."""
    for tries_left in range(TRITON_START_TRIES - 1, -1, -1):
        try:
            return _start_grpc_triton(workdir, repo, models, extra, timeout_s)
        except ServerStartError as exc:
            if tries_left == 0 or TRITON_SELF_ABORT not in str(exc):
                raise
            print("tritonserver aborted on its own lock; starting it again", file=sys.stderr)
    raise AssertionError("unreachable")


def _start_grpc_triton(
    workdir: Path,
    repo: Path,
    models: Sequence[str],
    extra: Sequence[str],
    timeout_s: float,
) -> tuple[subprocess.Popen, str]:
    install = find_triton()
    backends = install.make_backend_dir(workdir / "triton_backends")
    port = free_port()
    url = f"127.0.0.1:{port}"
    log = workdir / "tritonserver.log"
    cmd = [
        str(install.binary),
        "--model-repository", str(repo),
        "--backend-directory", str(backends),
        "--grpc-port", str(port),
        "--grpc-address", "127.0.0.1",
        "--allow-http", "false",
        "--allow-metrics", "false",
        "--disable-auto-complete-config",
        "--exit-timeout-secs", "5",
        *extra,
    ]  # fmt: skip
    proc = _popen(cmd, log, env=install.env(), cwd=workdir)
    try:
        wait_ready(url, models, timeout_s, [proc], log)
    except BaseException:
        stop_process(proc)
        raise
    return proc, url


def _popen(cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd=None):
    fh = log.open("ab")
    try:
        return subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            preexec_fn=_own_group_and_die_with_parent,
        )
    finally:
        fh.close()


class TritonServer(RunningServer):
    name = "triton"

    def __init__(
        self,
        workdir: Path,
        models: Sequence[BenchModel],
        *,
        instances: int = 1,
        install: TritonInstall | None = None,
        timeout_s: float = 180.0,
        http: bool = False,
    ) -> None:
        super().__init__()
        install = install or find_triton()
        workdir = Path(workdir)
        repo = write_triton_repository(workdir / "triton_models", models, instances)
        backends = install.make_backend_dir(workdir / "triton_backends")
        port = free_port()
        self.log = workdir / "tritonserver.log"
        cmd = [
            str(install.binary),
            "--model-repository", str(repo),
            "--backend-directory", str(backends),
            "--grpc-port", str(port),
            "--grpc-address", "127.0.0.1",
            "--allow-metrics", "false",
            "--allow-gpu-metrics", "false",
            "--disable-auto-complete-config",
            "--exit-timeout-secs", "5",
        ]  # fmt: skip
        if http:
            http_port = free_port()
            cmd += ["--http-port", str(http_port), "--http-address", "127.0.0.1"]
            self.http_url = f"127.0.0.1:{http_port}"
        else:
            cmd += ["--allow-http", "false"]
        self.url = f"127.0.0.1:{port}"
        self.procs.append(_popen(cmd, self.log, env=install.env(), cwd=workdir))
        self.notes = {"backend": "python (model.py -> onnxruntime)", "instances": str(instances)}
        try:
            wait_ready(self.url, [m.name for m in models], timeout_s, self.procs, self.log)
        except BaseException:
            self.stop()
            raise


class MLServerServer(RunningServer):
    name = "mlserver"

    def __init__(
        self,
        workdir: Path,
        models: Sequence[BenchModel],
        *,
        parallel_workers: int = 0,
        max_batch_time_s: float = 0.001,
        config_rpc: str = "inject",
        instances: int = 1,
        python: Path | None = None,
        timeout_s: float = 180.0,
    ) -> None:
        super().__init__()
        if config_rpc not in ("inject", "proxy"):
            raise ValueError("config_rpc must be 'inject' or 'proxy'")
        python = python or find_mlserver_python()
        workdir = Path(workdir)
        grpc_port = free_port()
        repo = write_mlserver_repository(
            workdir / "mlserver_models",
            models,
            grpc_port=grpc_port,
            http_port=free_port(),
            metrics_port=free_port(),
            parallel_workers=parallel_workers,
            max_batch_time_s=max_batch_time_s,
            instances=instances,
        )
        self.log = workdir / "mlserver.log"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV")}
        env["PYTHONPATH"] = str(repo)  # the runtime module, for parallel workers too
        env["PATH"] = f"{python.parent}:{env.get('PATH', '')}"
        configs = repo / "model_configs.json"
        if config_rpc == "inject":
            cmd = [str(python), str(BENCH_DIR / "mlserver_boot.py"), str(repo), str(configs)]
        else:
            cmd = [str(python.parent / "mlserver"), "start", str(repo)]
        self.procs.append(_popen(cmd, self.log, env=env, cwd=workdir))
        upstream = f"127.0.0.1:{grpc_port}"
        self.url = upstream
        self.notes = {
            "parallel_workers": str(parallel_workers),
            "max_batch_time_ms": f"{max_batch_time_s * 1000:g}",
            "model_config_rpc": config_rpc,
        }
        try:
            wait_ready(upstream, [m.name for m in models], timeout_s, self.procs, self.log)
            if config_rpc == "proxy":
                proxy_port = free_port()
                self.proxy_log = workdir / "proxy.log"
                cmd = [
                    sys.executable, "-m", "bench.references", "proxy",
                    "--listen", f"127.0.0.1:{proxy_port}",
                    "--upstream", upstream,
                    "--configs", str(configs),
                ]  # fmt: skip
                self.procs.append(_popen(cmd, self.proxy_log, cwd=REPO_ROOT))
                self.url = f"127.0.0.1:{proxy_port}"
                wait_ready(self.url, [m.name for m in models], 60, self.procs, self.proxy_log)
        except BaseException:
            self.stop()
            raise


class _StageServeLogs:
    """Keep StageServe's service logs out of the benchmark's console.

    The services log to stderr, which they inherit from this process, and the
    launcher's pump threads copy their stdout to ``sys.stdout``. While the
    stack starts, fd 2 points at ``path`` (so the children inherit the file);
    while it runs, lines written by the pump threads go to the same file.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._saved_fd: int | None = None
        self._real_stdout: TextIO | None = None

    def redirect_children(self) -> None:
        sys.stderr.flush()
        self._fh = self.path.open("a", buffering=1)
        self._saved_fd = os.dup(2)
        os.dup2(self._fh.fileno(), 2)
        real, fh = sys.stdout, self._fh

        class Router(io.TextIOBase):
            def write(self, text: str) -> int:
                pumped = threading.current_thread().name.endswith("(_pump)")
                return (fh if pumped else real).write(text)

            def flush(self) -> None:
                real.flush()
                fh.flush()

        self._real_stdout = real
        sys.stdout = Router()

    def restore_stderr(self) -> None:
        if self._saved_fd is not None:
            sys.stderr.flush()
            os.dup2(self._saved_fd, 2)
            os.close(self._saved_fd)
            self._saved_fd = None

    def close(self) -> None:
        self.restore_stderr()
        if self._real_stdout is not None:
            sys.stdout = self._real_stdout
            self._real_stdout = None
            self._fh.close()


class StageServeServer(RunningServer):
    name = "stageserve"

    def __init__(
        self,
        workdir: Path,
        models: Sequence[BenchModel],
        *,
        instances: int = 1,
        workers: int = 1,
        device: str = "cpu",
        quiet: bool = True,
        python: bool = False,
        python_process: bool = False,
    ) -> None:
        super().__init__()
        from stageserve.launcher import Stack, start_services

        workdir = Path(workdir)
        # python: the very repository Triton gets (model.py running ONNX Runtime).
        repo = (
            write_triton_repository(workdir / "stageserve_python_models", models, instances)
            if python
            else write_stageserve_repository(workdir / "stageserve_models", models, instances)
        )
        self.log = workdir / "stageserve.log"
        self._logs = _StageServeLogs(self.log) if quiet else None
        self.stack = Stack()
        try:
            if self._logs:
                self._logs.redirect_children()
            # python_process: each Python instance in its stub process (the
            # workers read it from their environment at start).
            variable = "STAGESERVE_WORKER_PYTHON_INSTANCE_PROCESS"
            before = os.environ.get(variable)
            os.environ[variable] = "1" if python_process else (before or "0")
            try:
                services = start_services(self.stack, repo, workers=workers, device=device)
            finally:
                if before is None:
                    del os.environ[variable]
                else:
                    os.environ[variable] = before
                if self._logs:
                    self._logs.restore_stderr()
            self.url = services.gateway.address
            self.http_url = services.gateway.http_address
            wait_ready(self.url, [m.name for m in models], 120, log=self.log)
        except BaseException as exc:
            self.stop()
            if isinstance(exc, RuntimeError) and not isinstance(exc, ServerStartError):
                raise ServerStartError(f"{exc}\n{_tail(self.log)}") from exc
            raise
        self.notes = {"instances": str(instances), "workers": str(workers)}
        if python:
            self.notes["backend"] = (
                "python (the model.py files Triton gets, a stub process per instance)"
                if python_process
                else "python (the model.py files Triton gets, in the worker)"
            )

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.stack.children]

    def stop(self) -> None:
        try:
            self.stack.stop()
        finally:
            if self._logs:
                self._logs.close()


def start_server(name: str, workdir: Path, models: Sequence[BenchModel], **options):
    """Start one of :data:`SERVERS` (options are passed to its class)."""
    cls = {"triton": TritonServer, "mlserver": MLServerServer, "stageserve": StageServeServer}
    if name not in cls:
        raise ValueError(f"unknown server {name!r} (choose from {', '.join(SERVERS)})")
    Path(workdir).mkdir(parents=True, exist_ok=True)
    return cls[name](workdir, models, **options)


# --------------------------------------------------------------------------- consistency


def consistency_input(model: BenchModel, batch: int = 4, seed: int = 7) -> np.ndarray:
    _, _, dims = model.inputs[0]
    return np.random.default_rng(seed).standard_normal((batch, *dims), dtype=np.float32)


def expected_output(model: BenchModel, x: np.ndarray) -> np.ndarray:
    if model.name == "identity":
        return x
    if model.name == "mlp":
        return mlp_reference(x, mlp_weights()).astype(np.float32)
    if model.name == "numpy":
        return mlp_reference(x, mlp_weights(NUMPY_SIZES)).astype(np.float32)
    if model.name == "cnn":  # float64, from the very ONNX graph the servers get
        return reference_forward(onnx.load_from_string(model.onnx), x)
    raise ValueError(model.name)


def tolerance(model: BenchModel, want: np.ndarray) -> float:
    """Largest accepted max |output - reference| for ``model`` (see :data:`CNN_RTOL`)."""
    if model.name == "cnn":
        return CNN_RTOL * max(1.0, float(np.max(np.abs(want))))
    return 1e-5


def infer_once(url: str, model: BenchModel, x: np.ndarray) -> np.ndarray:
    """One ModelInfer through tritonclient.grpc; returns OUTPUT0."""
    import tritonclient.grpc as grpcclient

    name, datatype, _ = model.inputs[0]
    client = grpcclient.InferenceServerClient(url)
    try:
        inp = grpcclient.InferInput(name, list(x.shape), datatype)
        inp.set_data_from_numpy(x)
        out_name = model.outputs[0][0]
        result = client.infer(
            model.name, [inp], outputs=[grpcclient.InferRequestedOutput(out_name)]
        )
        return result.as_numpy(out_name)
    finally:
        client.close()


def check_consistency(
    url: str, models: Sequence[BenchModel], atol: float | None = None
) -> dict[str, np.ndarray]:
    """Infer a fixed batch on every model; compare with numpy. Returns the outputs.

    Raises AssertionError when a server's answer differs from the reference
    (shape, or values beyond ``atol``; default :func:`tolerance`).
    """
    outputs = {}
    for m in models:
        x = consistency_input(m)
        got = infer_once(url, m, x)
        want = expected_output(m, x)
        if got is None or got.shape != want.shape:
            raise AssertionError(
                f"{m.name}: output shape {None if got is None else got.shape} != {want.shape}"
            )
        err = float(np.max(np.abs(got.astype(np.float64) - want)))
        limit = tolerance(m, want) if atol is None else atol
        if err > limit:
            raise AssertionError(f"{m.name}: max |output - reference| = {err:.3g} > {limit:.3g}")
        outputs[m.name] = got
    return outputs


# --------------------------------------------------------------------------- ModelConfig proxy


class _ServicerContext(Protocol):
    """The part of ``grpc.aio.ServicerContext`` the proxy uses (grpc has no types)."""

    async def abort(self, code: Any, details: str) -> NoReturn: ...


async def serve_proxy(listen: str, upstream: str, configs: dict[str, bytes]) -> None:
    """gRPC proxy: answers ModelConfig from ``configs``, forwards every other RPC as bytes.

    No message is decoded: the request bytes go upstream unchanged and the
    response bytes come back unchanged (unary calls, and ModelStreamInfer as a
    bidirectional stream). Status codes and details are passed through.
    """
    import grpc

    from stageserve.generated import grpc_service_pb2 as gs
    from stageserve.net import GRPC_OPTIONS, SERVER_OPTIONS

    channel = grpc.aio.insecure_channel(upstream, options=GRPC_OPTIONS)

    def forward_metadata(context) -> tuple:
        return tuple(
            (k, v) for k, v in context.invocation_metadata() if not k.startswith((":", "grpc-"))
        )

    async def model_config(request: bytes, context: _ServicerContext) -> bytes:
        name = gs.ModelConfigRequest.FromString(request).name
        if name not in configs:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"Request for unknown model: '{name}'")
        return configs[name]

    def unary(method: str):
        call = channel.unary_unary(method)

        async def handler(request: bytes, context: _ServicerContext) -> bytes:
            try:
                return await call(request, metadata=forward_metadata(context))
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")

        return grpc.unary_unary_rpc_method_handler(handler)

    def stream(method: str):
        call = channel.stream_stream(method)

        async def handler(request_iterator, context):
            try:
                async for response in call(request_iterator, metadata=forward_metadata(context)):
                    yield response
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")

        return grpc.stream_stream_rpc_method_handler(handler)

    cache: dict[str, grpc.RpcMethodHandler] = {
        MODEL_CONFIG_METHOD: grpc.unary_unary_rpc_method_handler(model_config)
    }

    class Forwarder(grpc.GenericRpcHandler):
        def service(self, details):
            method = details.method
            if method not in cache:
                cache[method] = stream(method) if method in STREAM_METHODS else unary(method)
            return cache[method]

    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((Forwarder(),))
    server.add_insecure_port(listen)
    await server.start()
    print(f"proxy {listen} -> {upstream}", flush=True)
    await server.wait_for_termination()


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.references", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("proxy", help="run the ModelConfig proxy (used by config_rpc='proxy')")
    p.add_argument("--listen", required=True)
    p.add_argument("--upstream", required=True)
    p.add_argument("--configs", type=Path, required=True, help="JSON: model -> hex response")
    for name in SERVERS:
        s = sub.add_parser(name, help=f"start {name} on a free port and wait")
        s.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=MODELS)
        s.add_argument("--instances", type=int, default=1)
        if name == "mlserver":
            s.add_argument("--parallel-workers", type=int, default=0)
            s.add_argument("--max-batch-time-ms", type=float, default=1.0)
            s.add_argument("--config-rpc", choices=("inject", "proxy"), default="inject")
    ns = ap.parse_args(argv)
    if ns.command == "proxy":
        configs = {k: bytes.fromhex(v) for k, v in json.loads(ns.configs.read_text()).items()}
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_proxy(ns.listen, ns.upstream, configs))
        return 0
    models = bench_models(ns.models)
    options: dict = {"instances": ns.instances}
    if ns.command == "mlserver":
        options.update(
            parallel_workers=ns.parallel_workers,
            max_batch_time_s=ns.max_batch_time_ms / 1000,
            config_rpc=ns.config_rpc,
        )
    with (
        tempfile.TemporaryDirectory(prefix=f"bench-{ns.command}-") as tmp,
        start_server(ns.command, Path(tmp), models, **options) as server,
    ):
        check_consistency(server.url, models)
        # Ctrl-C (or SIGTERM) sets an event: a KeyboardInterrupt raised inside
        # the ready line's write (a caller may signal as soon as it reads it)
        # has left the process killed by the signal or hung in its stop.
        stop = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        print(f"{ns.command} ready at {server.url} (consistency check passed); Ctrl-C stops it")
        while not stop.wait(0.5) and all(p.poll() is None for p in server.procs):
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
