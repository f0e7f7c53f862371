"""Log settings diff: the same LogSettings / ``/v2/logging`` calls against real
Triton 2.51 and StageServe.

:data:`STEPS` run in order on one server (they change its settings: a step
sees what the steps before it left), each on the HTTP front (raw requests, so
that malformed bodies can be sent) or the gRPC front (raw
``LogSettingsRequest`` messages, so that a setting of the wrong type or with
no value can be sent). An observation is ``(HTTP status, JSON document)`` or
``("OK", settings)`` / ``(gRPC status code name, message)``.

``bench/log_settings_triton.json`` is Triton 2.51's record
(``python -m bench.log_settings_diff --record`` writes it again);
tests/integration/test_log_settings.py checks StageServe against it, and
Triton against it where Triton is installed. Steps with ``message=False`` are
compared without their error message: Triton's is RapidJSON's parse error with
a byte offset of RapidJSON's own, which Python's JSON parser does not
reproduce (the status and the message's beginning are the same).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from tritonclient.grpc import service_pb2 as tpb
from tritonclient.grpc import service_pb2_grpc as tpb_grpc

RECORD = Path(__file__).with_name("log_settings_triton.json")
RPC_TIMEOUT_S = 10.0
HTTP_READY_S = 30.0

Observation = list[Any]  # JSON-shaped, as the record stores it


@dataclass(frozen=True)
class Endpoints:
    grpc_url: str
    http_url: str


@dataclass(frozen=True)
class Step:
    name: str
    call: Callable[[Endpoints], Observation]
    message: bool = True  # compare the error message too


def _http(method: str, body: bytes | str | None = None, path: str = "/v2/logging"):
    raw = body.encode() if isinstance(body, str) else body

    def call(ends: Endpoints) -> Observation:
        host, port = ends.http_url.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=RPC_TIMEOUT_S)
        try:
            conn.request(method, path, body=raw)
            response = conn.getresponse()
            text = response.read().decode()
        finally:
            conn.close()
        try:
            doc: Any = json.loads(text)
        except ValueError:
            doc = text
        return [response.status, doc]

    return call


def _post(doc: Any) -> Callable[[Endpoints], Observation]:
    return _http("POST", doc if isinstance(doc, str) else json.dumps(doc))


# gRPC settings: name -> (oneof field or None for a value with none set, value)
GrpcSettings = dict[str, tuple[str | None, Any]]


def _grpc(settings: GrpcSettings | None = None) -> Callable[[Endpoints], Observation]:
    def call(ends: Endpoints) -> Observation:
        request = tpb.LogSettingsRequest()
        for key, (field, value) in (settings or {}).items():
            if field is None:
                request.settings[key].SetInParent()
            else:
                setattr(request.settings[key], field, value)
        with grpc.insecure_channel(ends.grpc_url) as channel:
            stub = tpb_grpc.GRPCInferenceServiceStub(channel)
            try:
                response = stub.LogSettings(request, timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as err:
                return [err.code().name, err.details()]
        shown = {}
        for key, value in sorted(response.settings.items()):
            field = value.WhichOneof("parameter_choice")
            shown[key] = [field, getattr(value, field) if field else None]
        return ["OK", shown]

    return call


DEFAULTS = {
    "log_info": True,
    "log_warning": True,
    "log_error": True,
    "log_verbose_level": 0,
    "log_format": "default",
}

STEPS: list[Step] = [
    # Both fronts on a fresh server: Triton's defaults.
    Step("http get (fresh)", _http("GET")),
    Step("grpc get (fresh)", _grpc()),
    # HTTP
    Step("http post {}", _post({})),
    Step("http verbose 1", _post({"log_verbose_level": 1})),
    Step("grpc get sees http's change", _grpc()),
    Step("http verbose -1", _post({"log_verbose_level": -1})),
    Step("http verbose '2'", _post({"log_verbose_level": "2"})),
    Step("http verbose 1.5", _post({"log_verbose_level": 1.5})),
    Step("http verbose 1e2", _post('{"log_verbose_level": 1e2}')),
    Step("http verbose 2^32 + 1", _post({"log_verbose_level": 2**32 + 1})),
    Step("http verbose 2^31", _post({"log_verbose_level": 2**31})),
    Step("http verbose 2^64 - 1", _post({"log_verbose_level": 2**64 - 1})),
    Step("http verbose 2^64", _post({"log_verbose_level": 2**64})),
    Step("http verbose true", _post({"log_verbose_level": True})),
    Step("http info 'false'", _post({"log_info": "false"})),
    Step("http info 0", _post({"log_info": 0})),
    Step("http info false", _post({"log_info": False})),
    Step("http warning false, error false", _post({"log_warning": False, "log_error": False})),
    Step("http format xml", _post({"log_format": "xml"})),
    Step("http format iso8601 (lower case)", _post({"log_format": "iso8601"})),
    Step("http format 1", _post({"log_format": 1})),
    Step("http format ISO8601", _post({"log_format": "ISO8601"})),
    Step("http unknown key", _post({"bogus": 1})),
    Step("http file", _post({"log_file": "/tmp/stageserve-log-diff.log"})),
    Step("http file ''", _post({"log_file": ""})),
    Step("http file with a level", _post({"log_file": "x", "log_verbose_level": 7})),
    Step("http file null", _post({"log_file": None})),
    Step("http null values skip", _post({k: None for k in DEFAULTS})),
    Step("http level then bad format", _post({"log_verbose_level": 3, "log_format": "xml"})),
    Step("http get: the level stayed", _http("GET")),
    Step("http bad format then level", _post('{"log_format": "xml", "log_verbose_level": 4}')),
    Step("http get: the level applied first", _http("GET")),
    Step("http level then bad info", _post('{"log_verbose_level": 2, "log_info": "x"}')),
    Step("http get: info comes first", _http("GET")),
    Step("http repeated key", _post('{"log_verbose_level": 5, "log_verbose_level": 6}')),
    Step("http array body", _post("[1]")),
    Step("http string body", _post('"x"')),
    Step("http not json", _post("not json"), message=False),
    Step("http empty body", _http("POST", b"")),
    Step("http PUT", _http("PUT", b"{}")),
    Step("http GET ignores a body", _http("GET", b'{"log_verbose_level": 9}')),
    Step("http sub path", _http("GET", path="/v2/logging/x")),
    Step("http reset", _post(DEFAULTS)),
    # gRPC
    Step("grpc verbose 2", _grpc({"log_verbose_level": ("uint32_param", 2)})),
    Step("http get sees grpc's change", _http("GET")),
    Step("grpc verbose bool", _grpc({"log_verbose_level": ("bool_param", True)})),
    Step("grpc verbose string", _grpc({"log_verbose_level": ("string_param", "3")})),
    Step("grpc verbose unset", _grpc({"log_verbose_level": (None, None)})),
    Step("grpc verbose 2^32 - 1", _grpc({"log_verbose_level": ("uint32_param", 2**32 - 1)})),
    Step("grpc verbose 2^31", _grpc({"log_verbose_level": ("uint32_param", 2**31)})),
    Step("grpc info uint", _grpc({"log_info": ("uint32_param", 0)})),
    Step("grpc info string", _grpc({"log_info": ("string_param", "false")})),
    Step("grpc info false", _grpc({"log_info": ("bool_param", False)})),
    Step("grpc error false", _grpc({"log_error": ("bool_param", False)})),
    Step("grpc format xml", _grpc({"log_format": ("string_param", "xml")})),
    Step("grpc format uint", _grpc({"log_format": ("uint32_param", 1)})),
    Step("grpc format unset", _grpc({"log_format": (None, None)})),
    Step("grpc format ISO8601", _grpc({"log_format": ("string_param", "ISO8601")})),
    Step("grpc file", _grpc({"log_file": ("string_param", "/tmp/x")})),
    Step("grpc file ''", _grpc({"log_file": ("string_param", "")})),
    Step("grpc file unset", _grpc({"log_file": (None, None)})),
    Step("grpc unknown key", _grpc({"bogus": ("uint32_param", 1)})),
    Step(
        "grpc level then bad format",
        _grpc({"log_verbose_level": ("uint32_param", 5), "log_format": ("string_param", "xml")}),
    ),
    Step("grpc get: the level stayed", _grpc()),
    Step(
        "grpc info then bad warning",
        _grpc({"log_info": ("bool_param", True), "log_warning": ("string_param", "x")}),
    ),
    Step("grpc get: info stayed", _grpc()),
    Step(
        "grpc reset",
        _grpc(
            {
                "log_info": ("bool_param", True),
                "log_warning": ("bool_param", True),
                "log_error": ("bool_param", True),
                "log_verbose_level": ("uint32_param", 0),
                "log_format": ("string_param", "default"),
            }
        ),
    ),
]


def run(ends: Endpoints) -> dict[str, Observation]:
    return {step.name: step.call(ends) for step in STEPS}


def normalise(step: Step, observation: Observation) -> Observation:
    """What is compared of an observation: without the message where the
    step says so."""
    status, detail = observation
    if step.message or status in (200, "OK"):
        return [status, detail]
    return [status, detail.get("error", "").split(":")[0] if isinstance(detail, dict) else ""]


def without_log_file(observation: Observation, log_file: str) -> Observation:
    """The observation with the server's own --log-file shown as "" (Triton's
    record was taken without one)."""
    status, detail = observation
    if not log_file or not isinstance(detail, dict) or "log_file" not in detail:
        return observation
    shown = detail["log_file"]
    if shown == log_file:
        shown = ""
    elif shown == ["string_param", log_file]:
        shown = ["string_param", ""]
    return [status, {**detail, "log_file": shown}]


def differences(
    expected: dict[str, Observation], got: dict[str, Observation], log_file: str = ""
) -> list[str]:
    """One line per step whose normalised observations differ; `log_file`: the
    server's own --log-file, which it reports where Triton's record has ""."""
    lines = []
    for step in STEPS:
        want = normalise(step, expected.get(step.name, ["missing", None]))
        have = got.get(step.name, ["missing", None])
        have = normalise(step, without_log_file(have, log_file))
        if want != have:
            lines.append(f"{step.name}: Triton {want!r}, StageServe {have!r}")
    return lines


def load_record() -> dict[str, Observation]:
    return json.loads(RECORD.read_text())


def triton_endpoints(workdir: Path):
    """Start real Triton on an empty repository: (process, Endpoints)."""
    from bench.references import free_port, start_grpc_triton, stop_process

    (workdir / "repo").mkdir(parents=True, exist_ok=True)
    http_port = free_port()
    extra = ["--model-control-mode", "explicit", "--allow-http", "true"]
    extra += ["--http-address", "127.0.0.1", "--http-port", str(http_port)]
    proc, url = start_grpc_triton(workdir, workdir / "repo", [], extra)
    ends = Endpoints(url, f"127.0.0.1:{http_port}")
    try:
        wait_http(ends.http_url, HTTP_READY_S)
    except BaseException:
        stop_process(proc)
        raise
    return proc, ends


def wait_http(http_url: str, timeout_s: float) -> None:
    """Until the HTTP front answers /v2/health/live (Triton opens it after gRPC)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if _http("GET", path="/v2/health/live")(Endpoints("", http_url))[0] == 200:
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help=f"write Triton's answers to {RECORD}")
    args = parser.parse_args(argv)
    from bench.references import stop_process

    with tempfile.TemporaryDirectory(prefix="log-settings-diff-") as tmp:
        proc, ends = triton_endpoints(Path(tmp))
        try:
            observed = run(ends)
        finally:
            stop_process(proc)
    if args.record:
        RECORD.write_text(json.dumps(observed, indent=1) + "\n")
        print(f"wrote {len(observed)} observations to {RECORD}")
        return 0
    diffs = differences(load_record(), observed)
    print("\n".join(diffs) or "Triton answers as recorded")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
