"""Trace settings diff: the same TraceSetting calls against real Triton 2.51
and StageServe, on both fronts (``python -m bench.trace_diff``).

Both servers start with ``--trace-config triton,file=<their own file>`` on
the bench.triton_diff repository (``identity`` and ``ens`` loaded), and run
:data:`STEPS` in order: reads, per-model and global updates, clears,
inheritance, count decrement by inferences, every bad value and error code
on gRPC (tritonclient.grpc) and HTTP (raw GET/POST, so bodies tritonclient
would not send reach the server). An observation is ``("OK", value)`` or
``(status, message)``; the file path is normalised. Differences kept on
purpose are in :data:`DOCUMENTED`; tests/integration/test_trace_diff.py
fails on any other.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from bench.references import (
    ReferenceNotInstalled,
    find_triton,
    free_port,
    start_grpc_triton,
    stop_process,
    wait_ready,
)
from bench.triton_diff import STARTUP_MODELS, write_repository

Observation = tuple[str, Any]


class Clients:
    def __init__(self, grpc_url: str, http_url: str, trace_file: str) -> None:
        self.g = grpcclient.InferenceServerClient(grpc_url)
        self.h = httpclient.InferenceServerClient(http_url, network_timeout=30)
        self.trace_file = trace_file

    def close(self) -> None:
        self.g.close()
        self.h.close()

    def clean(self, value: Any) -> Any:
        text = json.dumps(value, sort_keys=True).replace(self.trace_file, "<file>")
        return json.loads(text)


@dataclass(frozen=True)
class Step:
    name: str
    call: Callable[[Clients], Any]


def _get(model: str = "") -> Callable[[Clients], Any]:
    def call(c: Clients) -> Any:
        answer = c.g.get_trace_settings(model_name=model or None, as_json=True)
        return {k: v.get("value", []) for k, v in answer["settings"].items()}

    return call


def _set(settings: dict[str, Any], model: str = "") -> Callable[[Clients], Any]:
    def call(c: Clients) -> Any:
        answer = c.g.update_trace_settings(
            model_name=model or None, settings=settings, as_json=True
        )
        return {k: v.get("value", []) for k, v in answer["settings"].items()}

    return call


def _path(model: str) -> str:
    return f"v2/models/{model}/trace/setting" if model else "v2/trace/setting"


def _hget(model: str = "") -> Callable[[Clients], Any]:
    def call(c: Clients) -> Any:
        r = c.h._get(_path(model), None, None)
        return (r.status_code, json.loads(r.read()))

    return call


def _hpost(body: str | dict, model: str = "") -> Callable[[Clients], Any]:
    text = body if isinstance(body, str) else json.dumps(body)

    def call(c: Clients) -> Any:
        r = c.h._post(_path(model), text, None, None)
        doc = json.loads(r.read() or b"{}")
        if r.status_code >= 500 and "failed to parse the request JSON" in doc.get("error", ""):
            doc = {"error": "<the JSON parser's message>"}
        return (r.status_code, doc)

    return call


def _infer(c: Clients) -> Any:
    x = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    x.set_data_from_numpy(np.zeros((1, 16), np.float32))
    c.g.infer("identity", [x], client_timeout=30)
    return "ok"


ON = {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}

STEPS: list[Step] = [
    Step("get global", _get()),
    Step("get identity", _get("identity")),
    Step("get nope", _get("nope")),
    Step("get ens (not loaded)", _get("ens")),
    Step("http get global", _hget()),
    Step("http get identity", _hget("identity")),
    Step("http get nope", _hget("nope")),
    Step("set identity rate 5", _set({"trace_rate": "5"}, "identity")),
    Step("get identity after rate", _get("identity")),
    Step("get global after identity rate", _get()),
    Step("set global count 3", _set({"trace_count": "3"})),
    Step("identity inherits count", _get("identity")),
    Step("set identity level TIMESTAMPS", _set({"trace_level": ["TIMESTAMPS"]}, "identity")),
    Step("set identity levels", _set({"trace_level": ["TENSORS", "TIMESTAMPS"]}, "identity")),
    Step("set identity level OFF+TIMESTAMPS", _set({"trace_level": ["OFF", "TIMESTAMPS"]})),
    Step("set identity level unknown name", _set({"trace_level": ["FOO"]}, "identity")),
    Step("set identity level lower case", _set({"trace_level": ["timestamps"]}, "identity")),
    *(
        Step(f"set rate {v!r}", _set({"trace_rate": v}))
        for v in ("abc", "-1", "0", "5abc", " 7", "1.5", "", "4294967295", "99999999999")
    ),
    Step("set rate two values", _set({"trace_rate": ["1", "2"]})),
    *(
        Step(f"set count {v!r}", _set({"trace_count": v}))
        for v in ("-2", "abc", "2147483648", "-1")
    ),
    *(Step(f"set log_frequency {v!r}", _set({"log_frequency": v})) for v in ("-1", "abc", "2")),
    Step("set trace_file", _set({"trace_file": "/tmp/elsewhere.json"})),
    Step("clear trace_file", _set({"trace_file": None})),
    Step("set trace_mode (ignored)", _set({"trace_mode": "opentelemetry"})),
    Step("set unknown key (ignored)", _set({"foo": "1"})),
    Step("set nope", _set({"trace_rate": "5"}, "nope")),
    Step("clear identity rate", _set({"trace_rate": None}, "identity")),
    Step("set global rate 9", _set({"trace_rate": "9"})),
    Step("identity follows global rate", _get("identity")),
    Step("clear global rate", _set({"trace_rate": None})),
    Step("clear identity level", _set({"trace_level": None}, "identity")),
    Step("identity back to global", _get("identity")),
    Step("trace globally, count 2", _set({**ON, "trace_count": "2"})),
    Step("infer 1", _infer),
    Step("count after 1", _get()),
    Step("infer 2", _infer),
    Step("infer 3", _infer),
    Step("count after 3", _get()),
    Step("identity count after 3", _get("identity")),
    Step("set identity level with count 0", _set({"trace_level": ["TIMESTAMPS"]}, "identity")),
    Step("set identity count 1 and trace", _set({**ON, "trace_count": "1"}, "identity")),
    Step("infer on identity's count", _infer),
    Step("identity count after infer", _get("identity")),
    Step("global count after identity infer", _get()),
    Step("global update with no field", _set({"trace_mode": "triton"})),
    Step("tracing off", _set({"trace_level": ["OFF"], "trace_count": None})),
    Step("http post rate", _hpost({"trace_rate": "7"})),
    Step("http post rate as number", _hpost({"trace_rate": 7})),
    Step("http post level as string", _hpost({"trace_level": "TIMESTAMPS"})),
    Step("http post level list", _hpost({"trace_level": ["TIMESTAMPS"]})),
    Step("http post rate as list", _hpost({"trace_rate": ["7"]})),
    Step("http post bad json", _hpost("{nope")),
    Step("http post empty body", _hpost("")),
    Step("http post not an object", _hpost("[1]")),
    Step("http post rate abc", _hpost({"trace_rate": "abc"})),
    Step("http post unknown key", _hpost({"foo": "1"})),
    Step("http post {}", _hpost("{}")),
    Step("http post identity", _hpost({"trace_rate": "9", "log_frequency": "4"}, "identity")),
    Step("http clear identity rate", _hpost({"trace_rate": None}, "identity")),
    Step("http post nope", _hpost({"trace_rate": "9"}, "nope")),
    Step("http post trace_file", _hpost({"trace_file": "x"})),
    Step("http clear global rate", _hpost({"trace_rate": None})),
    Step("http get identity at end", _hget("identity")),
]


@dataclass(frozen=True)
class Documented:
    reason: str


#: step -> why StageServe answers differently on purpose.
DOCUMENTED: dict[str, Documented] = {}


def observe(c: Clients, step: Step) -> Observation:
    try:
        value = step.call(c)
    except InferenceServerException as err:
        return (str(err.status()), c.clean(err.message() or ""))
    return ("OK", c.clean(value))


def run_steps(grpc_url: str, http_url: str, trace_file: str) -> list[Observation]:
    clients = Clients(grpc_url, http_url, trace_file)
    try:
        return [observe(clients, step) for step in STEPS]
    finally:
        clients.close()


def run_triton(workdir: Path) -> list[Observation]:
    repo = write_repository(workdir / "triton_repo", triton=True)
    http_port = free_port()
    trace_file = str(workdir / "triton_trace.json")
    extra = ["--model-control-mode", "explicit", "--allow-http", "true"]
    extra += ["--http-address", "127.0.0.1", "--http-port", str(http_port)]
    extra += ["--trace-config", f"triton,file={trace_file}"]
    for m in STARTUP_MODELS:
        extra += ["--load-model", m]
    proc, url = start_grpc_triton(workdir, repo, list(STARTUP_MODELS), extra)
    try:
        return run_steps(url, f"127.0.0.1:{http_port}", trace_file)
    finally:
        stop_process(proc)


def run_stageserve(workdir: Path) -> list[Observation]:
    from stageserve.launcher import Stack, start_services

    repo = write_repository(workdir / "stageserve_repo", triton=False)
    trace_file = str(workdir / "stageserve_trace.json")
    stack = Stack()
    try:
        services = start_services(
            stack,
            repo,
            control_mode="explicit",
            load_models=list(STARTUP_MODELS),
            device="cpu",
            gateway_extra=[f"--trace-config=triton,file={trace_file}"],
        )
        wait_ready(services.gateway.address, list(STARTUP_MODELS), 120)
        return run_steps(services.gateway.address, services.gateway.http_address, trace_file)
    finally:
        stack.stop()


@dataclass
class Difference:
    step: str
    triton: Observation
    stageserve: Observation
    documented: str = ""


def differences(triton: list[Observation], ours: list[Observation]) -> list[Difference]:
    out = []
    for step, t, s in zip(STEPS, triton, ours, strict=True):
        if t != s:
            doc = DOCUMENTED.get(step.name)
            out.append(Difference(step.name, t, s, doc.reason if doc else ""))
    return out


def report(diffs: list[Difference]) -> str:
    lines = [f"{len(STEPS)} steps, {len(diffs)} differences"]
    for d in diffs:
        tag = f"documented: {d.documented}" if d.documented else "UNDOCUMENTED"
        lines += [f"- {d.step} [{tag}]", f"    triton:     {d.triton}"]
        lines += [f"    stageserve: {d.stageserve}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="print every step's answers")
    args = parser.parse_args(argv)
    try:
        find_triton()
    except ReferenceNotInstalled as exc:
        print(exc, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="trace-diff-") as tmp:
        theirs = run_triton(Path(tmp))
        ours = run_stageserve(Path(tmp))
    if args.verbose:
        for step, t, s in zip(STEPS, theirs, ours, strict=True):
            print(f"* {step.name}\n    triton:     {t}\n    stageserve: {s}")
    diffs = differences(theirs, ours)
    print(report(diffs))
    return 0 if all(d.documented for d in diffs) else 1


if __name__ == "__main__":
    sys.exit(main())
