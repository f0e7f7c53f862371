"""Model repository behaviour through the real tritonclient, on stacks of our own.

* explicit model control: load / unload / reload, loading what is not there,
  unloading under load;
* control mode none: load/unload refused;
* broken models (bad config.pbtxt, corrupt model.onnx) reported UNAVAILABLE
  with a reason while the rest serves;
* version_policy (latest / all / specific) and which version answers;
* max_batch_size 0 vs > 0 and input/output ``reshape``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
import redis
import tritonclient.grpc as grpcclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from stageserve import redis_keys as keys
from stageserve.generated import model_config_pb2 as mc
from stageserve_tools.examples import (
    config_text,
    make_model,
    write_identity,
    write_mlp,
    write_model,
    write_simple,
)
from tests.integration.helpers import (
    RPC_TIMEOUT_S,
    expect_error,
    index_states,
    infer_simple,
    mlp_input,
    model_stats,
    simple_inputs,
    stack_retrying,
    tensor_input,
)
from tests.stack import RunningStack, wait_until

UNAVAILABLE = "StatusCode.UNAVAILABLE"
NOT_FOUND = "StatusCode.NOT_FOUND"
INVALID = "StatusCode.INVALID_ARGUMENT"
INTERNAL = "StatusCode.INTERNAL"

# --------------------------------------------------------------- repositories


def add_const_model(constant: int) -> onnx.ModelProto:
    """OUTPUT0 = INPUT0 + constant (INT32 [batch, 4]): tells versions apart."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "C"], ["OUTPUT0"], name="add")],
        f"add_{constant}",
        [helper.make_tensor_value_info("INPUT0", TensorProto.INT32, ["batch", 4])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.INT32, ["batch", 4])],
        initializer=[numpy_helper.from_array(np.array([constant], np.int32), "C")],
    )
    return make_model(graph)


def write_versioned(root: Path, name: str, policy: str | None) -> None:
    """Versions 1, 2, 3; version v adds 100 * v."""
    text = config_text(
        name, [("INPUT0", "INT32", [4])], [("OUTPUT0", "INT32", [4])], max_batch_size=8
    )
    if policy is not None:
        text += f"version_policy {{ {policy} }}\n"
    for v in (1, 2, 3):
        write_model(root, name, add_const_model(100 * v), text, versions=(v,))


def reshape_model(batching: bool) -> onnx.ModelProto:
    """INPUT0 [batch,4,4] -> OUTPUT0 = INPUT0, OUTPUT1 = 2 * INPUT0 (FP32)."""
    shape: list[int | str] = (["batch"] if batching else []) + [4, 4]
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"], name="id"),
            helper.make_node("Mul", ["INPUT0", "TWO"], ["OUTPUT1"], name="double"),
        ],
        "reshape",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, shape)],
        [
            helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("OUTPUT1", TensorProto.FLOAT, shape),
        ],
        initializer=[numpy_helper.from_array(np.array([2.0], np.float32), "TWO")],
    )
    return make_model(graph)


def write_reshape(root: Path, name: str, max_batch_size: int) -> None:
    """Config INPUT0 dims [16] reshape [4,4]; OUTPUT0 dims [4,4]; OUTPUT1 dims [16]
    reshape [4,4] (the model produces [4,4], clients see [16])."""
    text = f"""
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: {max_batch_size}
input [
  {{
    name: "INPUT0"
    data_type: TYPE_FP32
    dims: [ 16 ]
    reshape: {{ shape: [ 4, 4 ] }}
  }}
]
output [
  {{
    name: "OUTPUT0"
    data_type: TYPE_FP32
    dims: [ 4, 4 ]
  }},
  {{
    name: "OUTPUT1"
    data_type: TYPE_FP32
    dims: [ 16 ]
    reshape: {{ shape: [ 4, 4 ] }}
  }}
]
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
"""
    if max_batch_size > 0:
        text += "dynamic_batching { }\n"
    write_model(root, name, reshape_model(max_batch_size > 0), text)


def write_broken_config(root: Path, name: str = "broken_config") -> None:
    model_dir = root / name
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.onnx").write_bytes(add_const_model(1).SerializeToString())
    (model_dir / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\ninput [ {{ nme: }}\n'
    )


def write_corrupt_onnx(root: Path, name: str = "corrupt_onnx") -> None:
    text = config_text(
        name, [("INPUT0", "FP32", [-1])], [("OUTPUT0", "FP32", [-1])], max_batch_size=8
    )
    write_model(root, name, b"\x08\x07garbage, not an ONNX model \xff\xfe" * 10, text)


@pytest.fixture(scope="module")
def explicit_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("explicit_repository")
    write_simple(root, "simple")
    write_identity(root, "identity_fp32", "FP32")
    write_mlp(root, "mlp", instance_count=2)
    write_broken_config(root)
    return root


@pytest.fixture(scope="module")
def explicit(explicit_repo: Path) -> Iterator[RunningStack]:
    with stack_retrying(explicit_repo, control_mode="explicit", load_models=("simple",)) as s:
        yield s


@pytest.fixture(scope="module")
def mixed_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mixed_repository")
    write_simple(root, "simple")
    write_simple(root, "simple_nobatch", max_batch_size=0)
    write_identity(root, "identity_nobatch", "FP32", dims=(-1,), max_batch_size=0)
    write_broken_config(root)
    write_corrupt_onnx(root)
    write_versioned(root, "versions_default", None)
    write_versioned(root, "versions_latest2", "latest { num_versions: 2 }")
    write_versioned(root, "versions_all", "all { }")
    write_versioned(root, "versions_specific", "specific { versions: [1, 3] }")
    write_reshape(root, "reshape_batch", 8)
    write_reshape(root, "reshape_nobatch", 0)
    return root


@pytest.fixture(scope="module")
def mixed(mixed_repo: Path) -> Iterator[RunningStack]:
    with stack_retrying(mixed_repo) as s:  # model control mode none: load everything
        yield s


def _ready(c: grpcclient.InferenceServerClient, model: str, version: str = "") -> bool:
    return c.is_model_ready(model, version, client_timeout=RPC_TIMEOUT_S)


def _fresh_load(c: grpcclient.InferenceServerClient, model: str) -> None:
    """Load a model that is not loaded (reloading a loaded one races: see the xfail)."""
    if _ready(c, model):
        c.unload_model(model, client_timeout=RPC_TIMEOUT_S)
    c.load_model(model, client_timeout=RPC_TIMEOUT_S)
    assert _ready(c, model)


# ----------------------------------------------------------- explicit control


def test_explicit_only_startup_models_are_ready(explicit: RunningStack) -> None:
    c = explicit.client()
    assert _ready(c, "simple")
    assert not _ready(c, "identity_fp32")
    assert not _ready(c, "mlp")
    assert c.is_server_ready(client_timeout=RPC_TIMEOUT_S)
    states = index_states(c)
    assert sorted(states) == ["broken_config", "identity_fp32", "mlp", "simple"]
    assert states["simple"] == {"1": ("READY", "")}
    for name in ("identity_fp32", "mlp"):
        assert all(state != "READY" for state, _ in states[name].values()), states[name]
    infer_simple(c)
    err = expect_error(
        c.infer,
        "identity_fp32",
        [tensor_input("INPUT0", np.ones((1, 3), np.float32), "FP32")],
        client_timeout=RPC_TIMEOUT_S,
        status=(UNAVAILABLE, NOT_FOUND),
        contains=("identity_fp32",),
    )
    assert err.status() == NOT_FOUND  # never loaded: unknown, as in Triton


def test_explicit_load_makes_model_ready(explicit: RunningStack) -> None:
    c = explicit.client()
    _fresh_load(c, "identity_fp32")
    assert _ready(c, "identity_fp32", "1")
    assert index_states(c)["identity_fp32"] == {"1": ("READY", "")}
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = c.infer(
        "identity_fp32", [tensor_input("INPUT0", x, "FP32")], client_timeout=RPC_TIMEOUT_S
    ).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(out, x)
    assert _ready(c, "simple")  # loading one model leaves the others alone
    infer_simple(c)


def test_explicit_unload_makes_model_unavailable(explicit: RunningStack) -> None:
    c = explicit.client()
    if not _ready(c, "identity_fp32"):
        c.load_model("identity_fp32", client_timeout=RPC_TIMEOUT_S)
    c.unload_model("identity_fp32", client_timeout=RPC_TIMEOUT_S)
    assert not _ready(c, "identity_fp32")
    assert not _ready(c, "identity_fp32", "1")
    err = expect_error(
        c.infer,
        "identity_fp32",
        [tensor_input("INPUT0", np.ones((1, 3), np.float32), "FP32")],
        client_timeout=RPC_TIMEOUT_S,
        status=(UNAVAILABLE, NOT_FOUND),
        contains=("identity_fp32",),
    )
    assert err.status() == NOT_FOUND, err  # Triton 2.51: "has no available versions"
    states = index_states(c)["identity_fp32"]
    assert all(state == "UNAVAILABLE" for state, _ in states.values()), states
    # an unloaded model does not make the server unready (Triton's strict readiness)
    assert c.is_server_ready(client_timeout=RPC_TIMEOUT_S)
    assert _ready(c, "simple")
    infer_simple(c)


def test_explicit_reload_after_unload(explicit: RunningStack) -> None:
    c = explicit.client()
    _fresh_load(c, "identity_fp32")
    c.unload_model("identity_fp32", client_timeout=RPC_TIMEOUT_S)
    assert not _ready(c, "identity_fp32")
    c.load_model("identity_fp32", client_timeout=RPC_TIMEOUT_S)
    assert _ready(c, "identity_fp32")
    for k in range(5):
        x = np.full((1, 4), k, dtype=np.float32)
        out = c.infer(
            "identity_fp32", [tensor_input("INPUT0", x, "FP32")], client_timeout=RPC_TIMEOUT_S
        ).as_numpy("OUTPUT0")
        np.testing.assert_array_equal(out, x)
    # a reload starts the statistics afresh, as in Triton
    assert model_stats(c, "identity_fp32").inference_count == 5


def test_explicit_load_of_missing_model_fails_clearly(explicit: RunningStack) -> None:
    c = explicit.client()
    err = expect_error(
        c.load_model,
        "no_such_model",
        client_timeout=RPC_TIMEOUT_S,
        status=INTERNAL,  # Triton 2.51's code for a load that finds no model
        contains=("no_such_model", "not in the repository"),
    )
    assert err.message()
    assert not _ready(c, "no_such_model")
    assert "no_such_model" not in index_states(c)
    infer_simple(c)


def test_explicit_failed_load_of_missing_model_keeps_it_unknown(explicit: RunningStack) -> None:
    c = explicit.client()
    expect_error(c.load_model, "never_there", client_timeout=RPC_TIMEOUT_S, status=INTERNAL)
    expect_error(
        c.infer,
        "never_there",
        simple_inputs(np.ones((1, 16), np.int32), np.ones((1, 16), np.int32)),
        client_timeout=RPC_TIMEOUT_S,
        status=NOT_FOUND,
        contains=("never_there",),
    )


def test_explicit_load_of_broken_model_fails_clearly(explicit: RunningStack) -> None:
    c = explicit.client()
    err = expect_error(
        c.load_model,
        "broken_config",
        client_timeout=RPC_TIMEOUT_S,
        status=INTERNAL,
        contains=("broken_config",),
    )
    assert "parse" in err.message(), err.message()
    assert not _ready(c, "broken_config")
    ((state, reason),) = index_states(c)["broken_config"].values()
    assert state == "UNAVAILABLE" and reason
    infer_simple(c)


def test_explicit_unload_of_missing_model(explicit: RunningStack) -> None:
    # Triton 2.51 answers OK: unloading what is not loaded is no error
    explicit.client().unload_model("not_there_either", client_timeout=RPC_TIMEOUT_S)


def test_explicit_unload_lets_in_flight_requests_finish(explicit: RunningStack) -> None:
    c = explicit.client()
    _fresh_load(c, "mlp")
    results: queue.Queue = queue.Queue()
    n = 20
    for k in range(n):
        c.async_infer(
            "mlp",
            mlp_input(64, seed=k),
            client_timeout=RPC_TIMEOUT_S,
            callback=lambda result, error, k=k: results.put((k, result, error)),
        )
    time.sleep(0.05)  # let the gateway admit them
    t0 = time.monotonic()
    c.unload_model("mlp", client_timeout=RPC_TIMEOUT_S)
    unload_s = time.monotonic() - t0
    done = [results.get(timeout=RPC_TIMEOUT_S) for _ in range(n)]
    ok = [(k, r) for k, r, e in done if e is None]
    failed = [(k, e) for k, _, e in done if e is not None]
    assert ok, "requests sent before the unload must have been admitted and finished"
    for _, result in ok:
        probs = result.as_numpy("OUTPUT0")
        assert probs.shape == (64, 10)
        np.testing.assert_allclose(probs.sum(axis=1), np.ones(64), rtol=1e-4)
    # a request may only fail by not being admitted: never half-way through execution
    for _, err in failed:  # UNLOADING: UNAVAILABLE; unloaded: NOT_FOUND (as Triton)
        assert err.status() in (UNAVAILABLE, NOT_FOUND), err
        assert "mlp" in err.message()
        assert "worker" not in err.message() and "instance" not in err.message(), err
    assert not _ready(c, "mlp")
    assert unload_s < RPC_TIMEOUT_S
    # and the model loads again afterwards
    c.load_model("mlp", client_timeout=RPC_TIMEOUT_S)
    out = c.infer("mlp", mlp_input(2), client_timeout=RPC_TIMEOUT_S).as_numpy("OUTPUT0")
    assert out.shape == (2, 10)


def test_explicit_unload_during_steady_load_never_hangs(explicit: RunningStack) -> None:
    """Clients hammering a model while it is unloaded get answers, never a hang."""
    c = explicit.client()
    _fresh_load(c, "identity_fp32")
    stop = threading.Event()
    outcomes: list[str] = []

    def hammer() -> None:
        cl = grpcclient.InferenceServerClient(explicit.url)
        x = np.ones((1, 8), np.float32)
        while not stop.is_set():
            try:
                cl.infer("identity_fp32", [tensor_input("INPUT0", x, "FP32")], client_timeout=10)
                outcomes.append("ok")
            except InferenceServerException as exc:
                outcomes.append(exc.status() or repr(exc))

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    assert wait_until(lambda: "ok" in outcomes, RPC_TIMEOUT_S)  # served before the unload
    c.unload_model("identity_fp32", client_timeout=RPC_TIMEOUT_S)
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(15)
    assert not any(t.is_alive() for t in threads)
    assert "ok" in outcomes
    assert set(outcomes) <= {"ok", UNAVAILABLE, NOT_FOUND}, set(outcomes)


# ------------------------------------------- reloading a loaded model under load


@pytest.fixture
def reload_stack(explicit_repo: Path) -> Iterator[RunningStack]:
    """A stack of its own: these tests can leave the gateway's model state wedged."""
    with stack_retrying(explicit_repo, control_mode="explicit", load_models=("mlp",)) as s:
        yield s


def _reload_under_load(running: RunningStack, reloads: int = 4) -> list[str]:
    """Reload mlp (already loaded) while two clients keep sending requests."""
    c = running.client()
    assert _ready(c, "mlp")
    stop = threading.Event()
    outcomes: list[str] = []

    def hammer() -> None:
        cl = grpcclient.InferenceServerClient(running.url)
        while not stop.is_set():
            try:
                cl.infer("mlp", mlp_input(1), client_timeout=10)
                outcomes.append("ok")
            except Exception as exc:  # collected and asserted by the callers
                outcomes.append(str(exc))

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    # Some requests served before each reload and after the last: counted,
    # not timed (a loaded machine serves fewer in a fixed time).
    served = 0
    try:
        for _ in range(reloads):
            served += 3
            assert wait_until(lambda n=served: outcomes.count("ok") >= n, RPC_TIMEOUT_S)
            c.load_model("mlp", client_timeout=RPC_TIMEOUT_S)
            assert _ready(c, "mlp")
        served += 3
        assert wait_until(lambda n=served: outcomes.count("ok") >= n, RPC_TIMEOUT_S)
    finally:
        stop.set()
        for t in threads:
            t.join(15)
    assert outcomes.count("ok") > 10
    return outcomes


def test_reload_of_a_loaded_model_keeps_serving(reload_stack: RunningStack) -> None:
    outcomes = _reload_under_load(reload_stack)
    assert [o for o in outcomes if o != "ok"] == []


def test_unload_after_reload_under_load_completes(reload_stack: RunningStack) -> None:
    _reload_under_load(reload_stack)
    c = reload_stack.client()
    c.unload_model("mlp", client_timeout=5)
    assert not _ready(c, "mlp")


# ------------------------------------------------------ control mode none


def test_mode_none_refuses_load_and_unload(mixed: RunningStack) -> None:
    c = mixed.client()
    expect_error(
        c.load_model,
        "simple",
        client_timeout=RPC_TIMEOUT_S,
        status=UNAVAILABLE,
        contains=("explicit",),
    )
    expect_error(
        c.unload_model,
        "simple",
        client_timeout=RPC_TIMEOUT_S,
        status=UNAVAILABLE,
        contains=("explicit",),
    )
    expect_error(c.load_model, "no_such_model", client_timeout=RPC_TIMEOUT_S, status=UNAVAILABLE)
    assert _ready(c, "simple")
    infer_simple(c)


# ------------------------------------------------------------- broken models


def test_broken_models_are_unavailable_with_a_reason(mixed: RunningStack) -> None:
    c = mixed.client()
    states = index_states(c)
    for name in ("broken_config", "corrupt_onnx"):
        assert name in states, states
        assert states[name], name
        for version, (state, reason) in states[name].items():
            assert state == "UNAVAILABLE", (name, version, state)
            assert reason.strip(), (name, version)
        assert not _ready(c, name)
        assert not _ready(c, name, "1")
    assert "parse" in next(iter(states["broken_config"].values()))[1]
    assert list(states["corrupt_onnx"]) == ["1"]
    assert "onnx" in states["corrupt_onnx"]["1"][1].lower()
    # every other model serves
    assert states["simple"] == {"1": ("READY", "")}
    assert _ready(c, "simple")
    infer_simple(c)


def test_requests_to_broken_models_fail_with_the_reason(mixed: RunningStack) -> None:
    c = mixed.client()
    x = np.ones((1, 4), np.float32)
    err = expect_error(
        c.infer,
        "corrupt_onnx",
        [tensor_input("INPUT0", x, "FP32")],
        client_timeout=RPC_TIMEOUT_S,
        status=NOT_FOUND,  # Triton 2.51: "has no available versions"
        contains=("corrupt_onnx",),
    )
    assert "onnx" in err.message().lower()
    xi = np.ones((1, 4), np.int32)
    expect_error(
        c.infer,
        "broken_config",
        [tensor_input("INPUT0", xi, "INT32")],
        client_timeout=RPC_TIMEOUT_S,
        status=NOT_FOUND,  # Triton 2.51: "is not found" (bench/triton_diff.py)
        contains=("broken_config",),
    )
    expect_error(
        c.get_model_metadata, "corrupt_onnx", client_timeout=RPC_TIMEOUT_S, status=NOT_FOUND
    )


def test_server_not_ready_while_a_model_failed_to_load(mixed: RunningStack) -> None:
    # Triton's strict readiness: a model that failed to load makes the server not ready.
    c = mixed.client()
    assert c.is_server_live(client_timeout=RPC_TIMEOUT_S)
    assert not c.is_server_ready(client_timeout=RPC_TIMEOUT_S)


# ------------------------------------------------------------- version policy


def _add(c, model: str, version: str = "") -> tuple[str, np.ndarray]:
    x = np.arange(8, dtype=np.int32).reshape(2, 4)
    result = c.infer(
        model,
        [tensor_input("INPUT0", x, "INT32")],
        model_version=version,
        client_timeout=RPC_TIMEOUT_S,
    )
    return result.get_response().model_version, result.as_numpy("OUTPUT0") - x


@pytest.mark.parametrize(
    ("model", "versions"),
    [
        ("versions_default", ["3"]),
        ("versions_latest2", ["2", "3"]),
        ("versions_all", ["1", "2", "3"]),
        ("versions_specific", ["1", "3"]),
    ],
)
def test_version_policy(mixed: RunningStack, model: str, versions: list[str]) -> None:
    c = mixed.client()
    for v in ("1", "2", "3"):
        assert _ready(c, model, v) == (v in versions), (model, v)
    assert _ready(c, model)
    md = c.get_model_metadata(model, client_timeout=RPC_TIMEOUT_S)
    assert sorted(md.versions) == versions
    ready = {v for v, (state, _) in index_states(c)[model].items() if state == "READY"}
    assert ready == set(versions)

    # no version asked: the highest ready version answers
    answered, added = _add(c, model)
    assert answered == versions[-1]
    assert (added == 100 * int(versions[-1])).all()
    # each ready version answers itself, with its own model file
    for v in versions:
        answered, added = _add(c, model, v)
        assert answered == v
        assert (added == 100 * int(v)).all()
    # versions the policy leaves out are unknown
    for v in {"1", "2", "3"} - set(versions):
        expect_error(_add, c, model, v, status=NOT_FOUND, contains=(model, v))
    # statistics are kept per version
    stats = c.get_inference_statistics(model, client_timeout=RPC_TIMEOUT_S)
    assert sorted(s.version for s in stats.model_stats) == versions
    per_version = {s.version: s.inference_count for s in stats.model_stats}
    assert per_version[versions[-1]] >= 4
    md1 = c.get_model_metadata(model, versions[0], client_timeout=RPC_TIMEOUT_S)
    assert md1.name == model


# -------------------------------------------------- batching and reshape


def test_max_batch_size_zero_takes_exact_shape(mixed: RunningStack) -> None:
    c = mixed.client()
    md = c.get_model_metadata("simple_nobatch", client_timeout=RPC_TIMEOUT_S)
    assert [list(t.shape) for t in md.inputs] == [[1, 16], [1, 16]]
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    out = c.infer("simple_nobatch", simple_inputs(a, a), client_timeout=RPC_TIMEOUT_S)
    np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), 2 * a)
    assert list(out.get_output("OUTPUT0").shape) == [1, 16]
    b = np.ones((2, 16), np.int32)
    expect_error(
        c.infer,
        "simple_nobatch",
        simple_inputs(b, b),
        client_timeout=RPC_TIMEOUT_S,
        status=INVALID,
        contains=("INPUT0",),
    )
    s = model_stats(c, "simple_nobatch")
    assert s.inference_count == s.execution_count == 1


def test_max_batch_size_zero_variable_dims(mixed: RunningStack) -> None:
    c = mixed.client()
    md = c.get_model_metadata("identity_nobatch", client_timeout=RPC_TIMEOUT_S)
    assert [list(t.shape) for t in md.inputs] == [[-1]]
    for n in (1, 5, 33):
        x = np.arange(n, dtype=np.float32)
        out = c.infer(
            "identity_nobatch", [tensor_input("INPUT0", x, "FP32")], client_timeout=RPC_TIMEOUT_S
        )
        np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), x)
    x2 = np.ones((2, 3), np.float32)
    expect_error(
        c.infer,
        "identity_nobatch",
        [tensor_input("INPUT0", x2, "FP32")],
        client_timeout=RPC_TIMEOUT_S,
        status=INVALID,
        contains=("INPUT0",),
    )


def test_max_batch_size_positive_takes_any_batch_up_to_max(mixed: RunningStack) -> None:
    c = mixed.client()
    md = c.get_model_metadata("simple", client_timeout=RPC_TIMEOUT_S)
    assert [list(t.shape) for t in md.inputs] == [[-1, 16], [-1, 16]]
    for batch in (1, 5, 8):
        infer_simple(c, batch=batch)
    b = np.ones((9, 16), np.int32)
    expect_error(
        c.infer,
        "simple",
        simple_inputs(b, b),
        client_timeout=RPC_TIMEOUT_S,
        status=INVALID,
        contains=("batch-size",),
    )


@pytest.mark.parametrize("model", ["reshape_batch", "reshape_nobatch"])
def test_input_reshape(mixed: RunningStack, model: str) -> None:
    """Clients send dims [16]; the ONNX model receives [4,4]."""
    c = mixed.client()
    md = c.get_model_metadata(model, client_timeout=RPC_TIMEOUT_S)
    batch_dim = [-1] if model == "reshape_batch" else []
    assert [list(t.shape) for t in md.inputs] == [batch_dim + [16]]
    shape = [3, 16] if model == "reshape_batch" else [16]
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    result = c.infer(
        model,
        [tensor_input("INPUT0", x, "FP32")],
        outputs=[grpcclient.InferRequestedOutput("OUTPUT0")],
        client_timeout=RPC_TIMEOUT_S,
    )
    out = result.as_numpy("OUTPUT0")
    expected_shape = shape[:-1] + [4, 4]
    assert list(out.shape) == expected_shape
    np.testing.assert_array_equal(out, x.reshape(expected_shape))
    # the unreshaped shape the model sees is not what clients may send
    bad = np.ones(shape[:-1] + [4, 4], np.float32)
    expect_error(
        c.infer,
        model,
        [tensor_input("INPUT0", bad, "FP32")],
        client_timeout=RPC_TIMEOUT_S,
        status=INVALID,
        contains=("INPUT0",),
    )


def test_input_reshape_batches_concurrent_requests(mixed: RunningStack) -> None:
    c = mixed.client()
    results: queue.Queue = queue.Queue()
    xs = [np.full((1, 16), k, np.float32) for k in range(16)]
    for k, x in enumerate(xs):
        c.async_infer(
            "reshape_batch",
            [tensor_input("INPUT0", x, "FP32")],
            outputs=[grpcclient.InferRequestedOutput("OUTPUT0")],
            client_timeout=RPC_TIMEOUT_S,
            callback=lambda result, error, k=k: results.put((k, result, error)),
        )
    for _ in xs:
        k, result, error = results.get(timeout=RPC_TIMEOUT_S)
        assert error is None, error
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), xs[k].reshape(1, 4, 4))


@pytest.mark.parametrize("model", ["reshape_batch", "reshape_nobatch"])
def test_output_reshape(mixed: RunningStack, model: str) -> None:
    """OUTPUT1 has dims [16] reshape [4,4]: the model makes [4,4], clients get [16]."""
    c = mixed.client()
    md = c.get_model_metadata(model, client_timeout=RPC_TIMEOUT_S)
    batch_dim = [-1] if model == "reshape_batch" else []
    assert [list(t.shape) for t in md.outputs] == [batch_dim + [4, 4], batch_dim + [16]]
    shape = [2, 16] if model == "reshape_batch" else [16]
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    result = c.infer(
        model,
        [tensor_input("INPUT0", x, "FP32")],
        outputs=[grpcclient.InferRequestedOutput("OUTPUT1")],
        client_timeout=RPC_TIMEOUT_S,
    )
    assert list(result.get_output("OUTPUT1").shape) == shape
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), 2 * x)


def test_mixed_stack_comes_up_with_everything_listed(mixed: RunningStack, mixed_repo: Path) -> None:
    states = index_states(mixed.client())
    assert sorted(states) == sorted(p.name for p in mixed_repo.iterdir() if p.is_dir())
    assert wait_until(lambda: mixed.client().is_model_ready("simple"), 5)


def test_failed_reload_keeps_the_loaded_model_serving(tmp_path: Path) -> None:
    """Triton keeps serving a loaded model whose reload fails; so do we."""
    write_simple(tmp_path, "simple")
    model_file = tmp_path / "simple" / "1" / "model.onnx"
    good = model_file.read_bytes()
    with stack_retrying(tmp_path, control_mode="explicit", load_models=("simple",)) as s:
        c = s.client()
        infer_simple(c)
        model_file.write_bytes(b"not an onnx model")
        with pytest.raises(InferenceServerException):
            c.load_model("simple", client_timeout=RPC_TIMEOUT_S)
        for _ in range(5):  # still the old, loaded version
            infer_simple(c)
        assert c.is_model_ready("simple")
        model_file.write_bytes(good)
        c.load_model("simple", client_timeout=RPC_TIMEOUT_S)
        infer_simple(c)


def _published(redis_url: str, name: str) -> tuple[int, int]:
    """(generation, max_batch_size) of the model record other stages read from Redis."""
    record = redis.Redis.from_url(redis_url).hgetall(keys.model(name))
    config = mc.ModelConfig.FromString(record[b"config"])
    return int(record[b"generation"]), config.max_batch_size


def test_failed_reload_restores_the_serving_record_for_the_other_stages(tmp_path: Path) -> None:
    """The failed reload's config (here max_batch_size 4 instead of 8) must not
    reach schedulers and workers while the old instances keep serving: the
    gateway puts the serving record back in Redis, generation and all."""
    write_simple(tmp_path, "simple", max_batch_size=8)
    model_file = tmp_path / "simple" / "1" / "model.onnx"
    good = model_file.read_bytes()
    with stack_retrying(tmp_path, control_mode="explicit", load_models=("simple",)) as s:
        c = s.client()
        infer_simple(c)
        serving = _published(s.redis_url, "simple")
        assert serving[1] == 8
        write_simple(tmp_path, "simple", max_batch_size=4)
        model_file.write_bytes(b"not an onnx model")
        with pytest.raises(InferenceServerException, match="load failed for model 'simple'"):
            c.load_model("simple", client_timeout=RPC_TIMEOUT_S)
        assert _published(s.redis_url, "simple") == serving
        assert c.get_model_config("simple").config.max_batch_size == 8
        for _ in range(5):
            infer_simple(c)
        # The next good load replaces it as usual.
        model_file.write_bytes(good)
        c.load_model("simple", client_timeout=RPC_TIMEOUT_S)
        generation, max_batch_size = _published(s.redis_url, "simple")
        assert generation > serving[0] and max_batch_size == 4
        infer_simple(c)
