"""Behaviour diff: the same tritonclient calls against real Triton 2.51 and StageServe.

``python -m bench.triton_diff`` starts both servers on free ports, each on its
own copy of one repository (``identity``, an ensemble ``ens`` over it, a
``broken`` model whose config does not parse, an ensemble ``ens_ghost`` whose
composing model is not in the repository, ``py_error``, a Python model that
answers every request with an error response; Triton's copy runs the ONNX files
through the Python-backend twin :mod:`bench.triton_model`), runs :data:`STEPS`
in order against each, on the gRPC or the HTTP front as the step says (the
steps change state: loads, unloads, inferences), and prints every step whose
normalised observation differs.

An observation is ``("OK", value)`` or ``(status code, message)`` (the gRPC
status code, or the HTTP status as tritonclient.http reports it). Values are
normalised where the twins legitimately differ (``platform``/``backend``,
timings, repository paths); messages are compared only for steps marked
``message=True`` (elsewhere both are printed for reading). Differences that
are deliberate StageServe choices are listed in :data:`DOCUMENTED` with the
reason; tests/integration/test_triton_diff.py fails on any other.

Exit status: 0 when every difference is documented, 1 otherwise, 2 when
Triton is not installed (``scripts/install_references.sh triton``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2 as tpb
from tritonclient.utils import InferenceServerException

from bench.references import (
    BENCH_DIR,
    ReferenceNotInstalled,
    bench_model,
    find_triton,
    free_port,
    start_grpc_triton,
    stop_process,
    triton_config_text,
    wait_ready,
)
from stageserve_tools.examples import python_config_text, write_model, write_python_model

RPC_TIMEOUT_S = 30.0
SETTLE_S = 10.0
STARTUP_MODELS = ("identity", "ens")

ENSEMBLE_CONFIG = """name: "ens"
platform: "ensemble"
max_batch_size: 64
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 16 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "identity"
      model_version: -1
      input_map { key: "INPUT0" value: "IN" }
      output_map { key: "OUTPUT0" value: "OUT" }
    }
  ]
}
"""


GHOST_ENSEMBLE_CONFIG = ENSEMBLE_CONFIG.replace('name: "ens"', 'name: "ens_ghost"').replace(
    'model_name: "identity"', 'model_name: "ghost"'
)


#: A Python model (the same model.py on both servers) whose every response is
#: an error: how each server counts a request the model answered with one.
PY_ERROR_SOURCE = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(error=pb_utils.TritonError("refused by the model"))
            for _ in requests
        ]
"""


PY_INIT_FAILS_SOURCE = """\
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("no weights here")

    def execute(self, requests):
        return []
"""


def write_repository(root: Path, triton: bool) -> Path:
    """The diff repository; ``triton=True`` writes the Python-backend twin."""
    from bench.references import stageserve_config_text

    model = bench_model("identity")
    text = triton_config_text(model) if triton else stageserve_config_text(model)
    model_dir = write_model(root, "identity", model.onnx, text)
    if triton:
        (model_dir / "1" / "model.py").write_bytes((BENCH_DIR / "triton_model.py").read_bytes())
    (root / "ens" / "1").mkdir(parents=True)
    (root / "ens" / "config.pbtxt").write_text(ENSEMBLE_CONFIG)
    (root / "broken" / "1").mkdir(parents=True)
    (root / "broken" / "config.pbtxt").write_text("name: 'broken' max_batch_size: [oops\n")
    (root / "ens_ghost" / "1").mkdir(parents=True)
    (root / "ens_ghost" / "config.pbtxt").write_text(GHOST_ENSEMBLE_CONFIG)
    py_error = python_config_text(
        "py_error", [("INPUT0", "FP32", (16,))], [("OUTPUT0", "FP32", (16,))], max_batch_size=8
    )
    write_python_model(root, "py_error", PY_ERROR_SOURCE, py_error)
    py_init_fails = py_error.replace('"py_error"', '"py_init_fails"')
    write_python_model(root, "py_init_fails", PY_INIT_FAILS_SOURCE, py_init_fails)
    return root


# --------------------------------------------------------------------------- servers


class Server:
    url: str
    http_url: str

    def stop(self) -> None:
        raise NotImplementedError


class Triton(Server):
    def __init__(self, workdir: Path) -> None:
        repo = write_repository(workdir / "triton_repo", triton=True)
        self.http_url = f"127.0.0.1:{free_port()}"
        extra = ["--model-control-mode", "explicit", "--strict-readiness", "true"]
        extra += ["--allow-http", "true", "--http-address", "127.0.0.1"]
        extra += ["--http-port", self.http_url.rsplit(":", 1)[1]]
        for m in STARTUP_MODELS:
            extra += ["--load-model", m]
        self.proc, self.url = start_grpc_triton(workdir, repo, list(STARTUP_MODELS), extra)

    def stop(self) -> None:
        stop_process(self.proc)


class StageServe(Server):
    def __init__(self, workdir: Path) -> None:
        from stageserve.launcher import Stack, start_services

        repo = write_repository(workdir / "stageserve_repo", triton=False)
        self.stack = Stack()
        try:
            services = start_services(
                self.stack,
                repo,
                control_mode="explicit",
                load_models=list(STARTUP_MODELS),
                device="cpu",
            )
            self.url = services.gateway.address
            self.http_url = services.gateway.http_address
            wait_ready(self.url, list(STARTUP_MODELS), 120)
        except BaseException:
            self.stack.stop()
            raise

    def stop(self) -> None:
        self.stack.stop()


# --------------------------------------------------------------------------- steps

Client: TypeAlias = grpcclient.InferenceServerClient  # untyped library: Any
HttpClient: TypeAlias = httpclient.InferenceServerClient
Observation = tuple[str, Any]


@dataclass(frozen=True)
class Step:
    name: str
    call: Callable[[Any], Any]  # given the front's tritonclient client
    message: bool = False  # compare error messages too (normalised)
    value: bool = True  # compare the OK value (False: only print it with --verbose)
    http: bool = False  # the HTTP front (tritonclient.http); else gRPC


def _identity_input(name: str = "INPUT0", dtype: str = "FP32", shape=(1, 16)):
    inp = grpcclient.InferInput(name, list(shape), dtype)
    data = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    inp.set_data_from_numpy(data.astype(np.int32) if dtype == "INT32" else data)
    return inp


def _infer(model: str, inp_name: str = "INPUT0", dtype: str = "FP32", shape=(1, 16), version=""):
    def call(c: Client) -> Any:
        r = c.infer(
            model,
            [_identity_input(inp_name, dtype, shape)],
            model_version=version,
            client_timeout=RPC_TIMEOUT_S,
        )
        out = r.get_response()
        return [(o.name, o.datatype, list(o.shape)) for o in out.outputs]

    return call


def _index(
    ready: bool = False, reasons: bool = False, broken: bool = False
) -> Callable[[Client], Any]:
    """The index once no model is LOADING/UNLOADING (Triton unloads in the
    background); without `broken`, the broken model's row (a documented
    difference, compared once) is left out."""

    def call(c: Client) -> Any:
        deadline = time.monotonic() + SETTLE_S
        while True:
            idx = c.get_model_repository_index(as_json=True).get("models", [])
            busy = any(m.get("state") in ("LOADING", "UNLOADING") for m in idx)
            if not busy or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return sorted(
            (m["name"], m.get("version", ""), m.get("state", ""))
            + ((m.get("reason", ""),) if reasons else ())
            for m in idx
            if (not ready or m.get("state") == "READY") and (broken or m["name"] != "broken")
        )

    return call


def _stats(name: str = "", version: str = "") -> Callable[[Client], Any]:
    """The statistics once two reads 0.25 s apart agree (at most 3 s): both
    servers' Python models (Triton's `identity` twin is one) record a
    request's statistics after its response went out, so a read right after
    the last answer can miss it under load, on either side."""

    def call(c: Client) -> Any:
        rows = _stats_once(c, name, version)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            time.sleep(0.25)
            again = _stats_once(c, name, version)
            if again == rows:
                break
            rows = again
        return rows

    return call


def _stats_once(c: Client, name: str, version: str) -> list[tuple[str, str, int, int, int, int]]:
    out = c.get_inference_statistics(name, version, as_json=True).get("model_stats", [])
    rows = []
    for s in out:
        st = s.get("inference_stats", {})
        rows.append(
            (
                s["name"],
                s.get("version", ""),
                int(s.get("inference_count", 0)),
                int(s.get("execution_count", 0)),
                int(st.get("success", {}).get("count", 0)),
                int(st.get("fail", {}).get("count", 0)),
            )
        )
    return sorted(rows)


def _stats_settled(name: str, inferences: int, wait_s: float = 5.0) -> Callable[[Client], Any]:
    """As _stats, once the model counts `inferences` (or after `wait_s`):
    both servers record a Python model's statistics after its response went
    out (Triton's backend reports them once the responses are sent), so a
    read right after the last answer may miss it, on either server."""
    read = _stats(name)

    def call(c: Client) -> Any:
        deadline = time.monotonic() + wait_s
        rows = read(c)
        while sum(r[2] for r in rows) < inferences and time.monotonic() < deadline:
            time.sleep(0.05)
            rows = read(c)
        return rows

    return call


def _metadata(name: str, version: str = "") -> Callable[[Client], Any]:
    def call(c: Client) -> Any:
        m = c.get_model_metadata(name, version, as_json=True)
        m.pop("platform", None)  # python (twin) vs onnxruntime_onnx / ensemble
        return m

    return call


def _config(name: str, version: str = "") -> Callable[[Client], Any]:
    """The fields a client acts on; backend/platform/parameters differ by twin."""

    def call(c: Client) -> Any:
        cfg = c.get_model_config(name, version, as_json=True)["config"]
        return {
            "name": cfg.get("name"),
            "max_batch_size": cfg.get("max_batch_size", 0),
            "input": [(t["name"], t["data_type"], t.get("dims")) for t in cfg.get("input", [])],
            "output": [(t["name"], t["data_type"], t.get("dims")) for t in cfg.get("output", [])],
            "dynamic_batching": "dynamic_batching" in cfg,
            "version_policy": cfg.get("version_policy"),
        }

    return call


def _ready(name: str, version: str = "") -> Callable[[Client], Any]:
    return lambda c: c.is_model_ready(name, version)


def _load(name: str, **kw) -> Callable[[Client], Any]:
    return lambda c: c.load_model(name, **kw)


def _unload(name: str, **kw) -> Callable[[Client], Any]:
    return lambda c: c.unload_model(name, **kw)


def _load_override(files: dict[str, bytes] | None = None, **config_changes: Any):
    """Load identity with its own config (as this server reports it) changed, plus files."""

    text = config_changes.pop("text", None)

    def call(c: Client) -> Any:
        config = c.get_model_config("identity", as_json=True)["config"]
        config.update(config_changes)
        return c.load_model("identity", config=text or json.dumps(config), files=files)

    return call


def _h_index(c: HttpClient) -> Any:
    return sorted(
        (m["name"], m.get("version", ""), m.get("state", ""))
        for m in c.get_model_repository_index()
    )


def _h_stats(name: str = "", version: str = "") -> Callable[[HttpClient], Any]:
    def call(c: HttpClient) -> Any:
        out = c.get_inference_statistics(name, version).get("model_stats", [])
        return sorted((s["name"], s.get("version", "")) for s in out)

    return call


def _h_metadata(name: str, version: str = "") -> Callable[[HttpClient], Any]:
    def call(c: HttpClient) -> Any:
        m = c.get_model_metadata(name, version)
        m.pop("platform", None)
        return m

    return call


def _h_config(name: str, version: str = "") -> Callable[[HttpClient], Any]:
    def call(c: HttpClient) -> Any:
        cfg = c.get_model_config(name, version)
        return {"name": cfg.get("name"), "max_batch_size": cfg.get("max_batch_size", 0)}

    return call


def _h_override(files: dict[str, bytes] | None = None, text: str | None = None):
    def call(c: HttpClient) -> Any:
        config = c.get_model_config("identity")
        return c.load_model("identity", config=text or json.dumps(config), files=files)

    return call


def _raw_and_typed(n_raw: int, name: str = "INPUT0", typed: bool = True) -> Callable[[Client], Any]:
    """ModelInfer with typed contents and raw_input_contents (the generated stub:
    tritonclient's InferInput never sends the mix itself)."""

    def call(c: Client) -> Any:
        request = tpb.ModelInferRequest(model_name="identity")
        t = request.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        if typed:
            t.contents.fp32_contents.extend([1.0] * 16)
        for _ in range(n_raw):
            request.raw_input_contents.append(np.zeros(16, np.float32).tobytes())
        try:
            return c._client_stub.ModelInfer(request, timeout=RPC_TIMEOUT_S).model_name
        except grpc.RpcError as err:
            raise InferenceServerException(err.details(), str(err.code())) from None

    return call


CUDA_HANDLE = bytes(range(64))  # as long as a cudaIpcMemHandle_t; opens nothing
LONG_FILE = "file:1/" + "x" * 256  # one byte over a file name's limit

HOSTILE = {
    "slash": "a/b",
    "dotdot": "..",
    "parent": "../identity",
    "absolute": "/etc",
    "nul": "ident\x00ity",
    "long": "x" * 300,
    "dot": ".",
    "version_dir": "identity/1",
}

STEPS: list[Step] = [
    Step("live", lambda c: c.is_server_live()),
    Step("server_ready", lambda c: c.is_server_ready()),
    Step("index", _index()),
    Step("index_ready", _index(ready=True)),
    *(
        Step(f"ready {m} {v!r}", _ready(m, v))
        for m in ("identity", "ens", "broken", "nope")
        for v in ("", "1", "2")
    ),
    *(
        Step(f"ready identity {v!r}", _ready("identity", v), message=True)
        for v in ("abc", "-1", "0", "9" * 30)
    ),
    Step("metadata identity", _metadata("identity")),
    Step("metadata ens", _metadata("ens")),
    Step("metadata nope", _metadata("nope"), message=True),
    Step("metadata broken", _metadata("broken")),
    Step("metadata identity v2", _metadata("identity", "2"), message=True),
    Step("metadata identity vabc", _metadata("identity", "abc"), message=True),
    Step("config identity", _config("identity")),
    Step("config ens", _config("ens")),
    Step("config nope", _config("nope"), message=True),
    Step("stats all (fresh)", _stats()),
    Step("infer identity", _infer("identity")),
    Step("infer ens", _infer("ens", "IN")),
    Step("infer identity wrong input", _infer("identity", "NOPE")),
    Step("infer identity wrong dtype", _infer("identity", dtype="INT32")),
    Step("infer identity wrong shape", _infer("identity", shape=(1, 15))),
    Step("infer identity batch too big", _infer("identity", shape=(65, 16))),
    Step("infer nope", _infer("nope")),
    Step("infer identity v2", _infer("identity", version="2")),
    Step("stats all", _stats()),
    Step("stats identity", _stats("identity")),
    Step("stats identity v1", _stats("identity", "1")),
    Step("stats identity v2", _stats("identity", "2"), message=True),
    Step("stats identity vabc", _stats("identity", "abc"), message=True),
    Step("stats nope", _stats("nope"), message=True),
    Step("stats broken", _stats("broken"), message=True),
    *(Step(f"load hostile {k}", _load(v)) for k, v in HOSTILE.items()),
    *(Step(f"unload hostile {k}", _unload(v)) for k, v in HOSTILE.items()),
    *(Step(f"metadata hostile {k}", _metadata(v)) for k, v in HOSTILE.items()),
    *(Step(f"stats hostile {k}", _stats(v)) for k, v in HOSTILE.items()),
    *(Step(f"ready hostile {k}", _ready(v)) for k, v in HOSTILE.items()),
    Step("load with its own config as override", _load_override()),
    Step("config after override load", _config("identity")),
    Step("load override files without config", _load("identity", files={"file:1/x": b"x"})),
    Step("load override traversal", _load_override({"file:../../../escaped": b"x"})),
    Step("load override bad json", _load_override(text="{not json")),
    Step("load override other name", _load_override(name="other")),
    Step("ready after refused overrides", _ready("identity")),
    Step("load nope", _load("nope")),
    Step("unload nope", _unload("nope")),
    Step("load broken", _load("broken")),
    Step("index after broken", _index()),
    Step("index row of broken after its load failed", _index(broken=True)),
    Step("index reasons after broken", _index(reasons=True), value=False),
    Step("ready broken", _ready("broken")),
    Step("stats broken after load", _stats("broken"), message=True),
    Step("unload identity (ens depends on it)", _unload("identity")),
    Step("index after unload identity", _index()),
    Step("index reasons after unload identity", _index(reasons=True), value=False),
    Step("ready ens after unload identity", _ready("ens")),
    Step("ready identity after unload", _ready("identity")),
    Step("ready identity v1 after unload", _ready("identity", "1")),
    Step("metadata identity after unload", _metadata("identity"), message=True),
    Step("config identity after unload", _config("identity"), message=True),
    Step("infer identity after unload", _infer("identity"), message=True),
    Step("infer identity v1 after unload", _infer("identity", version="1"), message=True),
    Step("server ready after unload", lambda c: c.is_server_ready()),
    Step("infer ens after unload identity", _infer("ens", "IN")),
    Step("stats identity after unload", _stats("identity"), message=True),
    Step("stats all after unload", _stats()),
    Step("unload identity again", _unload("identity")),
    Step("load ens (loads identity)", _load("ens")),
    Step("index after load ens", _index()),
    Step("infer ens after reload", _infer("ens", "IN")),
    Step("stats ens", _stats("ens")),
    Step("unload ens with dependents", _unload("ens", unload_dependents=True)),
    Step("index after unload dependents", _index()),
    Step("load identity", _load("identity")),
    Step("infer identity again", _infer("identity")),
    Step("load identity again (reload)", _load("identity")),
    Step("stats identity after reload", _stats("identity")),
    Step("unload ens (not loaded)", _unload("ens")),
    Step("index at end", _index()),
    Step("shm status unknown", lambda c: c.get_system_shared_memory_status("nope"), message=True),
    Step("shm unregister unknown", lambda c: c.unregister_system_shared_memory("nope")),
    Step(
        "shm register missing key",
        lambda c: c.register_system_shared_memory("r", "/nope_key_x", 16),
    ),
    Step(
        "shm register traversal key",
        lambda c: c.register_system_shared_memory("r", "/../etc/passwd", 16),
    ),
    Step("shm status all", lambda c: c.get_system_shared_memory_status(as_json=True)),
    # ---- Triton's own client examples' calls (tritonclient src/python/examples)
    Step("server metadata name", lambda c: c.get_server_metadata(as_json=True)["name"]),
    Step("http server metadata name", lambda c: c.get_server_metadata()["name"], http=True),
    Step("cuda shm status all", lambda c: c.get_cuda_shared_memory_status(as_json=True)),
    Step(
        "cuda shm status unknown",
        lambda c: c.get_cuda_shared_memory_status("nope"),
        message=True,
    ),
    Step("cuda shm unregister all", lambda c: c.unregister_cuda_shared_memory()),
    Step("cuda shm unregister unknown", lambda c: c.unregister_cuda_shared_memory("nope")),
    Step(
        "cuda shm register",
        lambda c: c.register_cuda_shared_memory("r", CUDA_HANDLE, 0, 16),
        message=True,
    ),
    Step("http cuda shm status all", lambda c: c.get_cuda_shared_memory_status(), http=True),
    Step(
        "http cuda shm status unknown",
        lambda c: c.get_cuda_shared_memory_status("nope"),
        message=True,
        http=True,
    ),
    Step("http cuda shm unregister all", lambda c: c.unregister_cuda_shared_memory(), http=True),
    Step(
        "http cuda shm unregister unknown",
        lambda c: c.unregister_cuda_shared_memory("nope"),
        http=True,
    ),
    Step("infer raw and typed contents", _raw_and_typed(1), message=True),
    Step("infer raw and typed contents, two raws", _raw_and_typed(2), message=True),
    Step("infer raw and typed contents, unknown input", _raw_and_typed(1, "NOPE"), message=True),
    Step("infer two raw contents for one input", _raw_and_typed(2, typed=False)),
    Step("load override file name too long", _load_override({LONG_FILE: b"x"})),
    Step("ready after long override", _ready("identity")),
    # ---- every repository / statistics / metadata / config error on both fronts
    Step("config broken", _config("broken"), message=True),
    Step("config identity v2", _config("identity", "2"), message=True),
    Step("config identity vabc", _config("identity", "abc"), message=True),
    Step("http index", _h_index, http=True),
    Step("http metadata nope", _h_metadata("nope"), message=True, http=True),
    Step("http metadata identity v2", _h_metadata("identity", "2"), message=True, http=True),
    Step("http metadata broken", _h_metadata("broken"), message=True, http=True),
    Step("http config nope", _h_config("nope"), message=True, http=True),
    Step("http config identity v2", _h_config("identity", "2"), message=True, http=True),
    Step("http config broken", _h_config("broken"), message=True, http=True),
    Step("http stats nope", _h_stats("nope"), message=True, http=True),
    Step("http stats identity v2", _h_stats("identity", "2"), message=True, http=True),
    Step("http stats broken", _h_stats("broken"), message=True, http=True),
    *(
        Step(f"http {what} identity v{v}", call("identity", v), message=True, http=True)
        for v in ("abc", "-1")
        for what, call in (("metadata", _h_metadata), ("config", _h_config), ("stats", _h_stats))
    ),
    Step(
        "http shm status unknown",
        lambda c: c.get_system_shared_memory_status("nope"),
        message=True,
        http=True,
    ),
    Step(
        "http shm unregister unknown",
        lambda c: c.unregister_system_shared_memory("nope"),
        http=True,
    ),
    Step(
        "http shm register missing key",
        lambda c: c.register_system_shared_memory("r", "/nope_key_x", 16),
        message=True,
        http=True,
    ),
    Step("http ready nope", lambda c: c.is_model_ready("nope"), http=True),
    Step("http load nope", lambda c: c.load_model("nope"), http=True),
    Step("http unload nope", lambda c: c.unload_model("nope"), http=True),
    Step("http load broken", lambda c: c.load_model("broken"), http=True),
    Step("http load override traversal", _h_override({"file:../../../x": b"x"}), http=True),
    Step("http load override bad json", _h_override(text="{not json"), http=True),
    Step("http load override file name too long", _h_override({LONG_FILE: b"x"}), http=True),
    Step(
        "http load override files without config",
        lambda c: c.load_model("identity", files={"file:1/x": b"x"}),
        http=True,
    ),
    Step("ready after http overrides", _ready("identity")),
    # ---- an ensemble whose composing model is not in the repository
    Step("load ens_ghost", _load("ens_ghost")),
    Step("http load ens_ghost", lambda c: c.load_model("ens_ghost"), http=True),
    Step("ready ens_ghost", _ready("ens_ghost")),
    Step("metadata ens_ghost", _metadata("ens_ghost"), message=True),
    Step("config ens_ghost", _config("ens_ghost"), message=True),
    Step("stats ens_ghost", _stats("ens_ghost"), message=True),
    Step("infer ens_ghost", _infer("ens_ghost", "IN"), message=True),
    Step("http metadata ens_ghost", _h_metadata("ens_ghost"), message=True, http=True),
    Step("http stats ens_ghost", _h_stats("ens_ghost"), message=True, http=True),
    Step("index with ens_ghost", _index()),
    Step("load py_init_fails", _load("py_init_fails")),
    Step("load py_error", _load("py_error")),
    Step("infer py_error", _infer("py_error"), message=True),
    Step("infer py_error again", _infer("py_error"), message=True),
    Step("stats py_error", _stats_settled("py_error", 2)),
    Step("unload py_error", _unload("py_error")),
    # ---- an unloaded model on HTTP
    Step("unload identity at end", _unload("identity")),
    Step("http ready identity after unload", lambda c: c.is_model_ready("identity"), http=True),
    Step("http metadata identity after unload", _h_metadata("identity"), message=True, http=True),
    Step("http config identity after unload", _h_config("identity"), message=True, http=True),
    Step("http stats identity after unload", _h_stats("identity"), message=True, http=True),
    Step("http stats identity v1 after unload", _h_stats("identity", "1"), message=True, http=True),
    Step("http unload identity again", lambda c: c.unload_model("identity"), http=True),
]


# --------------------------------------------------------------------------- compare


@dataclass(frozen=True)
class Documented:
    """A deliberate difference; with codes, only that exact pair is excused."""

    reason: str
    triton: str = ""
    stageserve: str = ""

    def excuses(self, triton: Observation, ours: Observation) -> bool:
        return not self.triton or (triton[0], ours[0]) == (self.triton, self.stageserve)


_FAILED_ROW = Documented(
    "a model whose load failed (a config.pbtxt that does not parse, an ensemble whose "
    "composing model is missing) stays listed UNAVAILABLE with the reason (Triton lists it "
    "with no state: it never got past polling)"
)

_WHY_NOT_READY = (
    "same code; Triton's message says only 'is not found', StageServe's says why the "
    "model is not ready (its load error)"
)
_NOT_READY = Documented(_WHY_NOT_READY, "StatusCode.NOT_FOUND", "StatusCode.NOT_FOUND")
_HTTP_NOT_READY = Documented(_WHY_NOT_READY, "404", "404")

#: step -> why StageServe answers differently on purpose (README, docs/hardening.md).
DOCUMENTED: dict[str, Documented] = {
    **{
        step: _NOT_READY
        for step in ("config broken", "metadata ens_ghost", "config ens_ghost", "infer ens_ghost")
    },
    **{
        step: _HTTP_NOT_READY
        for step in ("http metadata broken", "http config broken", "http metadata ens_ghost")
    },
    "index row of broken after its load failed": _FAILED_ROW,
    "http index": _FAILED_ROW,
    "index with ens_ghost": _FAILED_ROW,
    "http load ens_ghost": Documented(
        "Triton 2.51 answered this second load of an ensemble whose composing model is "
        "missing with 500 'failed to poll from model repository' (the first, over gRPC, "
        "with INVALID_ARGUMENT); StageServe answers every such load alike (400)",
        "500",
        "400",
    ),
    "infer two raw contents for one input": Documented(
        "a raw_input_contents entry no input claims is refused (INVALID_ARGUMENT, "
        "'expected 1 raw input contents'); Triton 2.51 ignores it",
        "OK",
        "StatusCode.INVALID_ARGUMENT",
    ),
    "stats ens": Documented(
        "Triton 2.51 reports zero for an ensemble inferred once after it was loaded again "
        "with its composing model (it reloads the ensemble when the composing model "
        "loads); StageServe counts that inference"
    ),
}


def normalise(text: str) -> str:
    return re.sub(r"/\S*(triton|stageserve)_repo\S*", "<repo>", text)


def observe(client: Client | HttpClient, step: Step) -> Observation:
    try:
        value = step.call(client)
    except InferenceServerException as err:
        return (str(err.status()), normalise(err.message() or ""))
    return ("OK", value)


def run_steps(server: Server) -> list[Observation]:
    client = grpcclient.InferenceServerClient(server.url)
    http = httpclient.InferenceServerClient(server.http_url, network_timeout=RPC_TIMEOUT_S)
    try:
        return [observe(http if step.http else client, step) for step in STEPS]
    finally:
        client.close()
        http.close()


@dataclass
class Difference:
    step: str
    triton: Observation
    stageserve: Observation
    documented: str = ""


def differences(triton: list[Observation], ours: list[Observation]) -> list[Difference]:
    out = []
    for step, t, s in zip(STEPS, triton, ours, strict=True):
        same = t[0] == s[0] and (t[0] != "OK" or not step.value or t[1] == s[1])
        if same and t[0] != "OK" and step.message:
            same = t[1] == s[1]
        if not same:
            doc = DOCUMENTED.get(step.name)
            excused = doc.reason if doc is not None and doc.excuses(t, s) else ""
            out.append(Difference(step.name, t, s, excused))
    return out


def run(workdir: Path) -> tuple[list[Observation], list[Observation]]:
    """Start both servers one after the other (2 cores), run every step on each."""
    triton = Triton(workdir)
    try:
        theirs = run_steps(triton)
    finally:
        triton.stop()
    ours_server = StageServe(workdir)
    try:
        ours = run_steps(ours_server)
    finally:
        ours_server.stop()
    return theirs, ours


def _short(obs: Observation) -> str:
    return f"{obs[0]}: {str(obs[1])[:200]!s}"


def side_by_side(triton: list[Observation], ours: list[Observation]) -> str:
    lines = []
    for step, t, s in zip(STEPS, triton, ours, strict=True):
        lines += [f"* {step.name}", f"    triton:     {_short(t)}", f"    stageserve: {_short(s)}"]
    return "\n".join(lines)


def report(diffs: list[Difference]) -> str:
    # Undocumented differences last: a caller that keeps only the tail (the
    # smoke test shows 4,000 characters) still sees what failed.
    undocumented = [d.step for d in diffs if not d.documented]
    lines = [f"{len(STEPS)} steps, {len(diffs)} differences"]
    for d in sorted(diffs, key=lambda d: not d.documented):
        tag = f"documented: {d.documented}" if d.documented else "UNDOCUMENTED"
        lines += [f"- {d.step} [{tag}]", f"    triton:     {_short(d.triton)}"]
        lines += [f"    stageserve: {_short(d.stageserve)}"]
    if undocumented:
        lines.append(f"UNDOCUMENTED: {', '.join(undocumented)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--verbose", action="store_true", help="print every step's answers")
    args = parser.parse_args(argv)
    try:
        find_triton()
    except ReferenceNotInstalled as exc:
        print(exc, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="triton-diff-") as tmp:
        theirs, ours = run(args.workdir or Path(tmp))
    if args.verbose:
        print(side_by_side(theirs, ours))
    diffs = differences(theirs, ours)
    print(report(diffs))
    return 0 if all(d.documented for d in diffs) else 1


if __name__ == "__main__":
    sys.exit(main())
