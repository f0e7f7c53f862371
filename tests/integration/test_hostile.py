"""Hostile names on every public RPC that takes one: a clear answer at once, with
Triton's code, nothing read or written outside the repository, no Python text.

One explicit-mode stack for the module. Codes are the ones real Triton 2.51
answers (bench/triton_diff.py checks them against it); a load refused answers
INTERNAL, as Triton's does, with our reason in the message.
"""

from __future__ import annotations

import http.client
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from stageserve_tools.examples import write_simple
from tests.integration.helpers import infer_simple, simple_inputs, stack_retrying
from tests.stack import RunningStack

#: every answer here must come well within this (a name with '/' must not hang)
PROMPT_S = 3.0

HOSTILE = {
    "slash": "a/b",
    "dotdot": "..",
    "parent": "../simple",
    "absolute": "/etc",
    "nul": "sim\x00ple",
    "long": "x" * 300,
    "very long": "y" * 70_000,
    "dot": ".",
    "version folder": "simple/1",
    "hidden": ".git",
    "newline": "a\nb",
}
LEAKS = ("Traceback", "Errno", "<class", 'File "', "/tmp/", "/work/")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile_repository")
    write_simple(root, "simple")
    (root / "simple" / "1" / "config.pbtxt").write_text("not a model")  # bait for 'simple/1'
    return root


@pytest.fixture(scope="module")
def hostile(repo: Path) -> Iterator[RunningStack]:
    with stack_retrying(repo, control_mode="explicit", load_models=("simple",)) as s:
        yield s


def _answer(fn, *args, **kwargs) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        value = fn(*args, client_timeout=PROMPT_S * 2, **kwargs)
        code, message = "OK", repr(value)
    except InferenceServerException as err:
        code, message = str(err.status()), err.message() or ""
    return code, message, time.monotonic() - start


def _http_answer(fn, *args, **kwargs) -> tuple[str, str, float]:
    """_answer for tritonclient.http (its timeout is the client's network_timeout)."""
    start = time.monotonic()
    try:
        value = fn(*args, **kwargs)
        code, message = "OK", repr(value)
    except InferenceServerException as err:
        code, message = str(err.status()), err.message() or ""
    return code, message, time.monotonic() - start


def _http_client(s: RunningStack) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(s.gateway.http_address, network_timeout=PROMPT_S * 2)


def _check(answer: tuple[str, str, float], code: str, leaks: tuple[str, ...] = LEAKS) -> None:
    got, message, seconds = answer
    assert got == code, (got, message)
    assert seconds < PROMPT_S, seconds
    assert not any(leak in message for leak in leaks), message
    assert len(message) < 400, len(message)


@pytest.mark.parametrize("name", list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_names_get_triton_codes_at_once(hostile: RunningStack, name: str) -> None:
    c = hostile.client()
    _check(_answer(c.load_model, name), "StatusCode.INTERNAL")
    _check(_answer(c.unload_model, name), "OK")  # Triton: unloading what is not loaded is no error
    _check(_answer(c.get_model_metadata, name), "StatusCode.NOT_FOUND")
    _check(_answer(c.get_model_config, name), "StatusCode.NOT_FOUND")
    _check(_answer(c.get_inference_statistics, name), "StatusCode.INVALID_ARGUMENT")
    _check(_answer(c.is_model_ready, name), "OK")
    assert c.is_model_ready(name) is False
    _check(
        _answer(
            c.infer, name, simple_inputs(np.ones((1, 16), np.int32), np.ones((1, 16), np.int32))
        ),
        "StatusCode.NOT_FOUND",
    )


# Names the HTTP front can carry in its URL path (one segment: no '/', no NUL;
# '.' and '..' would be resolved away by any HTTP client).
HTTP_HOSTILE = {
    k: v for k, v in HOSTILE.items() if "/" not in v and "\x00" not in v and v[0] != "."
}


@pytest.mark.parametrize("name", list(HTTP_HOSTILE.values()), ids=list(HTTP_HOSTILE))
def test_hostile_names_over_http_get_tritons_http_statuses(
    hostile: RunningStack, name: str
) -> None:
    """The same dataplane checks behind the HTTP front, with Triton's HTTP mapping
    (INVALID_ARGUMENT 400, NOT_FOUND 404, a refused load's INTERNAL 500), just as
    promptly and without leaks."""
    c = _http_client(hostile)
    if len(name) > 60_000:  # the HTTP server itself refuses a request line this long
        for fn in (c.load_model, c.unload_model, c.get_model_metadata):
            assert _http_answer(fn, name)[0] == "400"
        assert c.is_server_live()
        return
    _check(_http_answer(c.load_model, name), "500")
    _check(_http_answer(c.unload_model, name), "OK")
    _check(_http_answer(c.get_model_metadata, name), "404")
    _check(_http_answer(c.get_model_config, name), "404")
    _check(_http_answer(c.get_inference_statistics, name), "400")
    assert c.is_model_ready(name) is False
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(np.ones((1, 16), np.int32))
    _check(_http_answer(c.infer, name, inputs), "404")


def test_overrides_and_cascade_over_http(hostile: RunningStack, repo: Path) -> None:
    """Load overrides and unload go through the dataplane for the HTTP front too."""
    c = _http_client(hostile)
    g = hostile.client()
    before = _listing(repo)
    config = _simple_config(g, name="fresh_http")
    onnx = (repo / "simple" / "1" / "model.onnx").read_bytes()
    c.load_model("fresh_http", config=config, files={"file:1/model.onnx": onnx})
    assert g.is_model_ready("fresh_http")
    infer_simple(g, model="fresh_http")
    assert _listing(repo) == before
    answer = _http_answer(c.load_model, "simple", config="{not json")
    _check(answer, "500")  # Triton 2.51: a refused load is INTERNAL
    assert "Invalid config override" in answer[1]
    c.unload_model("fresh_http")
    assert not g.is_model_ready("fresh_http")


def test_hostile_versions_get_invalid_argument(hostile: RunningStack) -> None:
    c = hostile.client()
    for version in ("abc", "-1", "1/..", "../1", "9" * 40):
        for fn in (c.is_model_ready, c.get_model_metadata, c.get_inference_statistics):
            _check(_answer(fn, "simple", version), "StatusCode.INVALID_ARGUMENT")


def test_hostile_calls_leave_the_index_and_the_file_system_alone(
    hostile: RunningStack, repo: Path
) -> None:
    c = hostile.client()
    before = sorted(os.listdir(repo)), sorted(os.listdir(repo.parent))
    for name in HOSTILE.values():
        _answer(c.load_model, name)
        _answer(c.unload_model, name)
    assert {m.name for m in c.get_model_repository_index().models} == {"simple"}
    assert (sorted(os.listdir(repo)), sorted(os.listdir(repo.parent))) == before
    # and the server kept serving
    assert c.is_model_ready("simple")
    infer_simple(c)


def test_shared_memory_keys_never_reach_outside_dev_shm(hostile: RunningStack) -> None:
    c = hostile.client()
    for key in ("/../etc/passwd", "/a/b", "/..", "/" + "k" * 300, "/x\x00y"):
        code, message, seconds = _answer(c.register_system_shared_memory, "r", key, 16)
        # Triton's answer for a key it cannot open
        _check((code, message, seconds), "StatusCode.INTERNAL")
        assert message.startswith("Unable to open shared memory region"), message
    assert c.get_system_shared_memory_status(as_json=True) == {}


# ------------------------------------------------- RepositoryModelLoad overrides


def _simple_config(c, **changes) -> str:
    cfg = c.get_model_config("simple", as_json=True)["config"]
    cfg.update(changes)
    return json.dumps(cfg)


def _listing(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*"))


def test_config_override_applies_to_this_load_only(hostile: RunningStack, repo: Path) -> None:
    c = hostile.client()
    before = _listing(repo)
    c.load_model("simple", config=_simple_config(c, max_batch_size=2), client_timeout=30)
    assert c.get_model_config("simple").config.max_batch_size == 2
    a = np.ones((3, 16), np.int32)
    _check(_answer(c.infer, "simple", simple_inputs(a, a)), "StatusCode.INVALID_ARGUMENT")
    infer_simple(c, batch=2)
    assert _listing(repo) == before  # the repository is never written
    c.load_model("simple", client_timeout=30)  # a plain load reads the repository again
    assert c.get_model_config("simple").config.max_batch_size == 8
    infer_simple(c, batch=3)


def test_file_override_loads_a_model_that_is_not_in_the_repository(
    hostile: RunningStack, repo: Path
) -> None:
    c = hostile.client()
    before = _listing(repo)
    config = _simple_config(c, name="fresh")
    onnx = (repo / "simple" / "1" / "model.onnx").read_bytes()
    c.load_model("fresh", config=config, files={"file:1/model.onnx": onnx}, client_timeout=30)
    assert c.is_model_ready("fresh")
    infer_simple(c, model="fresh")
    assert _listing(repo) == before
    c.unload_model("fresh", client_timeout=30)
    assert not c.is_model_ready("fresh")


@pytest.mark.parametrize("front", ["grpc", "http"])
@pytest.mark.parametrize(
    "path",
    ["../../../{tmp}/escaped", "/{tmp}/escaped", "1/../../../../{tmp}/escaped", "1/a\x00b", ""],
)
def test_file_override_paths_stay_inside_the_model_folder(
    hostile: RunningStack, tmp_path: Path, path: str, front: str
) -> None:
    c = hostile.client()
    key = "file:" + path.format(tmp=str(tmp_path).strip("/"))
    config = _simple_config(c)
    if front == "grpc":
        answer = _answer(c.load_model, "simple", config=config, files={key: b"payload"})
        code = "StatusCode.INTERNAL"
    else:
        load = _http_client(hostile).load_model
        answer, code = _http_answer(load, "simple", config=config, files={key: b"payload"}), "500"
    _check(answer, code, leaks=("Traceback", "Errno"))  # echoes the key
    assert "within model directory" in answer[1] or "file override" in answer[1], answer
    assert list(tmp_path.iterdir()) == []
    assert c.is_model_ready("simple")  # the loaded model keeps serving


@pytest.mark.parametrize("front", ["grpc", "http"])
def test_file_override_name_too_long_says_so_with_tritons_code(
    hostile: RunningStack, front: str
) -> None:
    """A 256-byte file name (tritonclient's simple_grpc_model_control tries one):
    Triton 2.51 answers INTERNAL (HTTP 500); the message names the real cause."""
    c = hostile.client()
    files = {"file:1/" + "x" * 256: b"payload"}
    if front == "grpc":
        answer = _answer(c.load_model, "simple", config=_simple_config(c), files=files)
        code = "StatusCode.INTERNAL"
    else:
        load = _http_client(hostile).load_model
        answer, code = _http_answer(load, "simple", config=_simple_config(c), files=files), "500"
    _check(answer, code)
    assert "file name too long" in answer[1] and "over 255 bytes" in answer[1], answer
    assert "within model directory" not in answer[1], answer
    files = {"file:1/" + "x" * 255: b"payload"}  # the longest name is no path problem
    answer = _answer(c.load_model, "simple", config=_simple_config(c), files=files)
    assert "too long" not in answer[1], answer
    assert c.is_model_ready("simple")


def test_malformed_overrides_are_refused_with_triton_reasons(hostile: RunningStack) -> None:
    c = hostile.client()
    # load_model's keyword arguments (config=, files=) -> a piece of the reason
    cases: list[tuple[dict[str, str | dict[str, bytes]], str]] = [
        ({"files": {"file:1/model.onnx": b"x"}}, "'config' must be specified"),
        ({"config": "{not json"}, "Invalid config override"),
        ({"config": json.dumps({"no_such_field": 1})}, "Invalid config override"),
        ({"config": _simple_config(c, name="other")}, "directory name must equal model name"),
    ]
    for kwargs, reason in cases:
        answer = _answer(c.load_model, "simple", **kwargs)
        _check(answer, "StatusCode.INTERNAL")
        assert reason in answer[1], answer
    answer = _answer(c.load_model, "not_there", config=json.dumps({"name": "not_there"}))
    _check(answer, "StatusCode.INTERNAL")
    assert "not found in any model repository" in answer[1]
    assert c.is_model_ready("simple")
    infer_simple(c)


# ----------------------------------------------------- raw HTTP paths (no client)

# Model names as raw URL path segments, sent as-is with http.client (tritonclient
# leaves '/' unencoded and any client resolves '..'). Each segment is
# percent-decoded on its own, so it stays one name and gets the gRPC front's
# answer; '%2Fsimple' must not be split and decoded to a load of 'simple'.
RAW_SEGMENTS = {
    "encoded slash": ("a%2Fb", "never a path"),
    "leading encoded slash": ("%2Fsimple", "never a path"),
    "absolute": ("%2Fetc", "never a path"),
    "version folder": ("simple%2F1", "never a path"),
    "encoded dotdot": ("%2E%2E", "not a model folder"),
    "encoded parent": ("%2E%2E%2Fsimple", "never a path"),
    "raw dotdot": ("..", "not a model folder"),
    "nul": ("a%00b", "NUL"),
    "long": ("%78" * 300, "at most 255 bytes"),
    "newline": ("a%0Ab", "control characters"),
}


def _raw(s: RunningStack, method: str, path: str, body: bytes = b"{}") -> tuple[str, str, float]:
    """(HTTP status, error message, seconds) of one raw request."""
    host, port = s.gateway.http_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=PROMPT_S * 2)
    start = time.monotonic()
    try:
        conn.request(method, path, body=body if method == "POST" else None)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    message = json.loads(data).get("error", "") if data else ""
    return str(response.status), message, time.monotonic() - start


@pytest.mark.parametrize(("segment", "reason"), list(RAW_SEGMENTS.values()), ids=list(RAW_SEGMENTS))
def test_percent_encoded_names_in_http_paths_stay_one_name(
    hostile: RunningStack, repo: Path, segment: str, reason: str
) -> None:
    before = _listing(repo), sorted(os.listdir(repo.parent))
    load = _raw(hostile, "POST", f"/v2/repository/models/{segment}/load")
    _check(load, "500")  # a refused load is INTERNAL, as Triton
    assert reason in load[1], load
    _check(_raw(hostile, "POST", f"/v2/repository/models/{segment}/unload"), "200")
    _check(_raw(hostile, "GET", f"/v2/models/{segment}"), "404")
    _check(_raw(hostile, "GET", f"/v2/models/{segment}/config"), "404")
    _check(_raw(hostile, "GET", f"/v2/models/{segment}/versions/1"), "404")
    _check(_raw(hostile, "GET", f"/v2/models/{segment}/ready"), "400")  # not ready
    _check(_raw(hostile, "GET", f"/v2/models/{segment}/stats"), "400")
    _check(_raw(hostile, "POST", f"/v2/models/{segment}/infer", b'{"inputs": []}'), "404")
    assert (_listing(repo), sorted(os.listdir(repo.parent))) == before
    c = hostile.client()
    assert {m.name for m in c.get_model_repository_index().models} == {"simple"}
    infer_simple(c)


def test_hostile_http_paths_match_no_route_or_a_clear_error(hostile: RunningStack) -> None:
    for path in ("/v2/models//ready", "/v2/repository/models//load", "/v2//health/live"):
        _check(_raw(hostile, "POST" if "load" in path else "GET", path), "404")
    # Triton's version route takes digits only: anything else matches no route (404)
    for version in ("..%2F1", "1%00", "%2E%2E", "abc", "-1", "%D9%A1"):  # last: Arabic 1
        for path in (f"/v2/models/simple/versions/{version}", "/ready", "/config", "/stats"):
            full = path if path.startswith("/v2") else f"/v2/models/simple/versions/{version}{path}"
            answer = _raw(hostile, "GET", full)
            _check(answer, "404")
            assert answer[1] == "Not Found", answer
    # digits that std::stol cannot take: Triton's 400
    _check(_raw(hostile, "GET", f"/v2/models/simple/versions/{'9' * 40}/ready"), "400")
    _check(_raw(hostile, "GET", f"/v2/models/simple/versions/{'9' * 40}"), "400")
    status = _raw(hostile, "GET", "/v2/systemsharedmemory/region/a%2Fb/status")
    _check(status, "404")
    assert "'a/b'" in status[1]
    _check(_raw(hostile, "POST", "/v2/systemsharedmemory/region/..%2F..%2Fx/unregister"), "200")


def test_shared_memory_keys_over_http_never_reach_outside_dev_shm(hostile: RunningStack) -> None:
    c = _http_client(hostile)
    for key in ("/../etc/passwd", "/a/b", "/..", "/" + "k" * 300, "/x\x00y", ""):
        answer = _http_answer(c.register_system_shared_memory, "r", key, 16)
        _check(answer, "500")  # Triton's status for a key it cannot open
        assert answer[1].startswith("Unable to open shared memory region"), answer
    bad = _raw(hostile, "POST", "/v2/systemsharedmemory/region/r/register", b'{"key": 5}')
    _check(bad, "400")
    assert c.get_system_shared_memory_status() == []


def test_a_bad_onnx_runtime_option_fails_the_load_with_tritons_message(
    hostile: RunningStack, repo: Path
) -> None:
    # execution_mode is read for every instance (onnx_options.py), so a CPU
    # stack shows how a bad ONNX Runtime option reaches the client
    c = hostile.client()
    config = json.loads(_simple_config(c, name="bad_opts"))
    config["parameters"] = {"execution_mode": {"string_value": "2"}}
    onnx = (repo / "simple" / "1" / "model.onnx").read_bytes()
    code, message, _ = _answer(
        c.load_model, "bad_opts", config=json.dumps(config), files={"file:1/model.onnx": onnx}
    )
    assert code != "OK"
    assert "Expected values for  execution_mode are 0 or 1 but got 2 ." in message, message
    assert "Traceback" not in message
    assert not c.is_model_ready("bad_opts")
