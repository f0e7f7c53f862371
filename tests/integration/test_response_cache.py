"""The response cache end to end: a model with `response_cache { enable: true }`
behind two gateways that share the stack's Redis (`--cache-config redis`), each
with its own scheduler, and a third gateway without --cache-config; the
statistics and metrics of a request sequence diffed against real Triton 2.51
(`--cache-config local,size=...`) on the same sequence."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from bench.references import (
    ReferenceNotInstalled,
    _popen,
    find_triton,
    free_port,
    stop_process,
    wait_ready,
)
from stageserve.launcher import Child
from stageserve_tools.examples import write_simple
from tests.integration.helpers import simple_inputs, two_paths
from tests.stack import RunningStack, wait_until

CACHE = "response_cache { enable: true }\n"
MODEL = "simple"
TRITON_MODEL_PY = """
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            a = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(r, "INPUT1").as_numpy()
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
        return out
"""
TENSORS = "\n".join(
    f'{kind} [ {{ name: "{kind.upper()}0" data_type: TYPE_INT32 dims: [ 16 ] }}, '
    f'{{ name: "{kind.upper()}1" data_type: TYPE_INT32 dims: [ 16 ] }} ]'
    for kind in ("input", "output")
)
# Ensembles over the cached model and over one without the cache, the
# ensemble's own cache on or off: Triton 2.51 caches a top-level request to
# an ensemble that enables the cache, and a composing model's cache applies
# inside an ensemble (checked: test_ensembles_and_cache_wide_metrics_match_triton).
INNER_PLAIN = "inner_plain"
ENSEMBLES = {
    "ens_cached": (INNER_PLAIN, True),
    "ens_over_cached": (MODEL, False),
}


def _ensemble_config(name: str, inner: str, cache: bool) -> str:
    maps = "".join(
        f' {kind} {{ key: "{t}" value: "{t}" }}'
        for kind, names in (
            ("input_map", ("INPUT0", "INPUT1")),
            ("output_map", ("OUTPUT0", "OUTPUT1")),
        )
        for t in names
    )
    return (
        f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: 8\n{TENSORS}\n'
        f'ensemble_scheduling {{ step [ {{ model_name: "{inner}" model_version: -1{maps} }} ] }}\n'
        + (CACHE if cache else "")
    )


REFUSED = {
    "dec": "model_transaction_policy { decoupled: true }",
    "seq": "sequence_batching { }",
}


@dataclass
class Stacks:
    running: RunningStack
    scheduler_b: Child
    gateway_b: grpcclient.InferenceServerClient
    gateway_plain: grpcclient.InferenceServerClient
    metrics_url: str


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stacks]:
    root = tmp_path_factory.mktemp("cache_repo")
    model_dir = write_simple(root)
    with (model_dir / "config.pbtxt").open("a") as f:
        f.write(CACHE)
    write_simple(root, INNER_PLAIN)
    for name, (inner, cached) in ENSEMBLES.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(_ensemble_config(name, inner, cached))
    for name, extra in REFUSED.items():  # refused at load, as Triton refuses them
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(TRITON_MODEL_PY)
        (root / name / "config.pbtxt").write_text(
            f'name: "{name}"\nbackend: "python"\nmax_batch_size: 8\n{TENSORS}\n{extra}\n{CACHE}'
        )
    metrics_port = free_port()
    cache = ("--cache-config", "redis")
    keep_going = ("--exit-on-error", "false")  # past the refused models
    with two_paths(
        root,
        cache + keep_going,
        metrics_port=metrics_port,
        gateway_extra=cache,
        scheduler_extra=cache,  # composing models inside ensembles
    ) as (
        running,
        sched_b,
        client_b,
    ):
        plain = running.stack.start_service(
            "gateway-plain",
            [
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--redis-url",
                running.redis_url,
                "--ratelimiter",
                running.ratelimiter.address,
                "--scheduler",
                running.scheduler.address,
                "--model-repository",
                str(root),
                "--allow-http",
                "false",
                *keep_going,
            ],
        )
        yield Stacks(
            running,
            sched_b,
            client_b,
            grpcclient.InferenceServerClient(plain.address),
            f"http://127.0.0.1:{metrics_port}/metrics",
        )


def test_decoupled_and_sequence_models_enabling_the_cache_are_refused(stacks: Stacks) -> None:
    index = {m.name: m for m in stacks.running.client().get_model_repository_index().models}
    for name, kind in (("dec", "with 'decoupled' transaction policy"), ("seq", "with sequence")):
        assert index[name].state == "UNAVAILABLE"
        assert (
            f"Response Cache does not currently support model {name} {kind}" in index[name].reason
        ), index[name].reason


def _ab(seed: int) -> tuple[np.ndarray, np.ndarray]:
    a = np.arange(16, dtype=np.int32).reshape(1, 16) + seed
    return a, np.full((1, 16), 2, dtype=np.int32)


def _infer(
    client,
    seed: int,
    outputs: tuple[str, ...] = (),
    check_names: bool = True,
    model: str = MODEL,
) -> dict[str, np.ndarray]:
    a, b = _ab(seed)
    requested = [grpcclient.InferRequestedOutput(o) for o in outputs] or None
    result = client.infer(model, simple_inputs(a, b), outputs=requested)
    got = {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}
    want = {"OUTPUT0": a + b, "OUTPUT1": a - b}
    assert not check_names or set(got) == (set(outputs) or set(want))
    for name, value in got.items():
        np.testing.assert_array_equal(value, want[name])
    return got


def _stats(client, model: str = MODEL) -> dict[str, int]:
    s = client.get_inference_statistics(model).model_stats[0]
    st = s.inference_stats
    return {
        "success": st.success.count,
        "queue": st.queue.count,
        "cache_hit": st.cache_hit.count,
        "cache_miss": st.cache_miss.count,
        "compute_infer": st.compute_infer.count,
        "inference_count": s.inference_count,
        "execution_count": s.execution_count,
    }


def _metrics(url: str, names: tuple[str, ...]) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        for name in names:
            if line.startswith(name + "{") and f'model="{MODEL}"' in line:
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


#: (seed, gateway) of the sequence both servers run: a miss, a hit, another
#: input's miss, then hits of both.
SEQUENCE = (0, 0, 5, 0, 5)
METRICS = (
    "nv_inference_request_success",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_cache_num_hits_per_model",
    "nv_cache_num_misses_per_model",
)


def test_a_hit_is_answered_by_the_gateway_and_shared_by_every_gateway(stacks: Stacks) -> None:
    a = stacks.running.client()
    before = _stats(a)
    _infer(a, 100)  # miss: the model runs
    _infer(a, 100)  # hit on this gateway
    _infer(stacks.gateway_b, 100)  # hit on the other gateway: the cache is in Redis
    # the scheduler saw one request: one execution, one inference, in the totals
    want = {
        "success": 3,
        "queue": 3,
        "cache_hit": 2,
        "cache_miss": 1,
        "compute_infer": 1,
        "inference_count": 1,
        "execution_count": 1,
    }

    def delta(client: grpcclient.InferenceServerClient) -> dict[str, int]:
        now = _stats(client)
        return {k: now[k] - before[k] for k in want}

    # Each gateway answers its own figures live and the other's as last
    # published (stats_publish_s, ~1 s): both converge on the totals, so the
    # next test's baseline is read once the other gateway's hit is in it.
    for client in (stacks.gateway_b, a):
        assert wait_until(lambda c=client: delta(c) == want), delta(client)


def test_http_front_and_requested_outputs(stacks: Stacks) -> None:
    http = httpclient.InferenceServerClient(stacks.running.gateway.http_address)
    a, b = _ab(200)

    def infer(outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        inputs = []
        for name, value in (("INPUT0", a), ("INPUT1", b)):
            i = httpclient.InferInput(name, list(value.shape), "INT32")
            i.set_data_from_numpy(value, binary_data=True)
            inputs.append(i)
        requested = [httpclient.InferRequestedOutput(o, binary_data=True) for o in outputs]
        result = http.infer(MODEL, inputs, outputs=requested or None)
        return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}

    before = _stats(stacks.running.client())["cache_hit"]
    full = infer(())
    assert set(full) == {"OUTPUT0", "OUTPUT1"}
    only = infer(("OUTPUT1",))  # another set of outputs: its own entry, not the full one
    assert set(only) == {"OUTPUT1"}
    np.testing.assert_array_equal(only["OUTPUT1"], a - b)
    again = infer(("OUTPUT1",))
    assert set(again) == {"OUTPUT1"}
    np.testing.assert_array_equal(again["OUTPUT1"], a - b)
    assert _stats(stacks.running.client())["cache_hit"] - before == 1
    # the gRPC front hits the entry the HTTP front stored
    _infer(stacks.running.client(), 200)
    assert _stats(stacks.running.client())["cache_hit"] - before == 2


def test_without_cache_config_the_model_runs_uncached(stacks: Stacks) -> None:
    """As Triton 2.51: the model loads and every request runs (no cache figures)."""
    plain = stacks.gateway_plain
    assert wait_until(lambda: plain.is_model_ready(MODEL), 30)
    _infer(stacks.running.client(), 300)  # cached by a caching gateway
    executions = _stats(stacks.running.client())["execution_count"]
    _infer(plain, 300)
    _infer(plain, 300)
    assert wait_until(lambda: _stats(stacks.running.client())["execution_count"] - executions == 2)


def _settled(stacks: Stacks) -> None:
    """Until both gateways report the same statistics of MODEL: each publishes
    its own to the stack periodically, so an earlier test's requests on one
    gateway reach the other's figures a moment later (seen as one extra hit
    in a delta taken across that moment)."""
    a = stacks.running.client()
    assert wait_until(lambda: _stats(a) == _stats(stacks.gateway_b), 10)


def test_a_hit_writes_shared_memory_outputs(stacks: Stacks) -> None:
    """Outputs asked into a system shared-memory region get the cached bytes
    there, as a run writes them (Triton 2.51 caches such requests too)."""
    import uuid

    import tritonclient.utils.shared_memory as shm

    client = stacks.running.client()
    _settled(stacks)
    tag = uuid.uuid4().hex[:8]
    a, b = _ab(400)
    region = shm.create_shared_memory_region(f"out-{tag}", f"/ss-cache-{tag}", 2 * a.nbytes)
    client.register_system_shared_memory(f"out-{tag}", f"/ss-cache-{tag}", 2 * a.nbytes)
    try:
        before = _stats(client)["cache_hit"]
        for round_ in range(2):  # a miss, then a hit
            shm.set_shared_memory_region(region, [np.zeros((2, 16), np.int32)])
            outs = [grpcclient.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
            outs[0].set_shared_memory(f"out-{tag}", a.nbytes)
            outs[1].set_shared_memory(f"out-{tag}", a.nbytes, offset=a.nbytes)
            client.infer(MODEL, simple_inputs(a, b), outputs=outs)
            got = shm.get_contents_as_numpy(region, np.int32, [2, 16])
            np.testing.assert_array_equal(got[0], (a + b)[0])
            np.testing.assert_array_equal(got[1], (a - b)[0])
            assert _stats(client)["cache_hit"] - before == round_
        # every output named is the entry of none named (all), as in Triton 2.51
        _infer(client, 400)
        assert _stats(client)["cache_hit"] - before == 2
    finally:
        client.unregister_system_shared_memory(f"out-{tag}")
        shm.destroy_shared_memory_region(region)


# The cache-wide gauges Triton 2.51 exposes with a local cache (checked).
CACHE_WIDE = (
    "nv_cache_util",
    "nv_cache_num_entries",
    "nv_cache_num_hits",
    "nv_cache_num_misses",
    "nv_cache_num_lookups",
    "nv_cache_num_evictions",
    "nv_cache_lookup_duration",
    "nv_cache_insertion_duration",
)


def _cache_wide(url: str) -> dict[str, float]:
    """Every nv_cache_* sample without labels."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("nv_cache_") and "{" not in line:
            name, value = line.split(" ", 1)
            out[name] = float(value)
    return out


@dataclass
class Observed:
    stats: dict[str, int]  # the sequence's statistics of MODEL
    metrics: dict[str, float]  # ... and its per-model metrics
    subset: set[str]  # the outputs a request for OUTPUT1 alone gets, once cached
    cache_before: dict[str, float]  # the cache-wide gauges before the sequence
    cache_after: dict[str, float]  # ... and after it
    ensembles: dict[str, dict[str, int]]  # _ensemble_pairs
    ensemble_lookups: float  # how far they moved nv_cache_num_lookups


def _ensemble_pairs(client) -> dict[str, dict[str, int]]:
    """Each ensemble asked the same twice: how the statistics of every model
    involved moved."""
    models = (*ENSEMBLES, INNER_PLAIN, MODEL)
    before = {m: _stats(client, m) for m in models}
    for seed, name in enumerate(ENSEMBLES):
        for _ in range(2):
            _infer(client, 3000 + seed, model=name)
    keys = ("success", "cache_hit", "cache_miss", "execution_count")

    def delta() -> dict[str, dict[str, int]]:
        now = {m: _stats(client, m) for m in models}
        return {m: {k: now[m][k] - before[m][k] for k in keys} for m in models}

    # Triton's Python backend reports a request's statistics just after answering it
    wait_until(lambda: all(d["success"] >= 2 for m, d in delta().items() if m in ENSEMBLES))
    return delta()


@pytest.fixture(scope="module")
def on_ours(stacks: Stacks) -> Observed:
    """The deltas of the sequence on gateway A, the outputs a request for
    OUTPUT1 alone gets after the full answer was cached, then the ensembles;
    run once."""
    a = stacks.running.client()
    _settled(stacks)
    before, m_before = _stats(a), _metrics(stacks.metrics_url, METRICS)
    cache_before = _cache_wide(stacks.metrics_url)
    for seed in SEQUENCE:
        _infer(a, 1000 + seed)
    after, m_after = _stats(a), _metrics(stacks.metrics_url, METRICS)
    cache_after = _cache_wide(stacks.metrics_url)
    subset = set(_infer(a, 1000 + SEQUENCE[0], ("OUTPUT1",), check_names=False))
    lookups = _cache_wide(stacks.metrics_url)["nv_cache_num_lookups"]
    ensembles = _ensemble_pairs(a)
    return Observed(
        {k: after[k] - before[k] for k in after},
        {k: m_after.get(k, 0) - m_before.get(k, 0) for k in METRICS},
        subset,
        cache_before,
        cache_after,
        ensembles,
        _cache_wide(stacks.metrics_url)["nv_cache_num_lookups"] - lookups,
    )


@pytest.fixture(scope="module")
def on_triton(tmp_path_factory: pytest.TempPathFactory) -> Observed:
    """The same on real Triton 2.51 with `--cache-config local`, run once."""
    try:
        install = find_triton()
    except ReferenceNotInstalled as exc:
        pytest.skip(str(exc))
    tmp = tmp_path_factory.mktemp("cache_triton")
    repo = tmp / "repo"
    for name in (MODEL, INNER_PLAIN):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(TRITON_MODEL_PY)
        (repo / name / "config.pbtxt").write_text(
            f'name: "{name}"\nbackend: "python"\nmax_batch_size: 8\n{TENSORS}\n'
            f"dynamic_batching {{ }}\n{CACHE if name == MODEL else ''}"
        )
    for name, (inner, cached) in ENSEMBLES.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(_ensemble_config(name, inner, cached))
    port, metrics_port = free_port(), free_port()
    cmd = [
        str(install.binary),
        "--model-repository", str(repo),
        "--backend-directory", str(install.make_backend_dir(tmp / "backends")),
        "--cache-directory", str(install.binary.parents[1] / "caches"),
        "--cache-config", "local,size=1048576",
        "--grpc-port", str(port),
        "--grpc-address", "127.0.0.1",
        "--allow-http", "false",
        "--metrics-port", str(metrics_port),
        "--disable-auto-complete-config",
        "--exit-timeout-secs", "2",
    ]  # fmt: skip
    log = tmp / "tritonserver.log"
    proc = _popen(cmd, log, env=install.env(), cwd=tmp)
    try:
        url, metrics_url = f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
        wait_ready(url, [MODEL, INNER_PLAIN, *ENSEMBLES], 120, [proc], log)
        client = grpcclient.InferenceServerClient(url)
        cache_before = _cache_wide(metrics_url)
        for seed in SEQUENCE:
            _infer(client, 1000 + seed)
        # Triton's Python backend reports a request's statistics just after answering it
        assert wait_until(lambda: _stats(client)["success"] == len(SEQUENCE))
        stats = _stats(client)
        metrics = _metrics(metrics_url, METRICS)
        # Triton refreshes its cache-wide gauges every --metrics-interval-ms (2 s)
        assert wait_until(
            lambda: _cache_wide(metrics_url)["nv_cache_num_lookups"] == len(SEQUENCE), 10
        )
        cache_after = _cache_wide(metrics_url)
        subset = set(_infer(client, 1000 + SEQUENCE[0], ("OUTPUT1",), check_names=False))

        def lookups() -> float:
            return _cache_wide(metrics_url)["nv_cache_num_lookups"]

        wait_until(lambda: lookups() == len(SEQUENCE) + 1, 10)
        lookups_before = lookups()
        ensembles = _ensemble_pairs(client)
        # 2 top-level lookups of ens_cached, 2 of ens_over_cached's step (what
        # ours counts); a refresh that does not come leaves the diff to fail
        wait_until(lambda: lookups() == lookups_before + 4, 10)
        return Observed(
            stats,
            metrics,
            subset,
            cache_before,
            cache_after,
            ensembles,
            lookups() - lookups_before,
        )
    finally:
        stop_process(proc)


def test_statistics_and_metrics_match_triton(on_ours: Observed, on_triton: Observed) -> None:
    ours, theirs = on_ours, on_triton
    assert ours.stats == theirs.stats, (ours.stats, theirs.stats)
    assert ours.metrics == theirs.metrics, (ours.metrics, theirs.metrics)
    assert theirs.stats["cache_hit"] == 3 and theirs.stats["cache_miss"] == 2
    # Kept different on purpose (README, Response cache): Triton's key has no
    # requested outputs, so it answers every output the cached request got.
    assert theirs.subset == {"OUTPUT0", "OUTPUT1"} and ours.subset == {"OUTPUT1"}
    # The cache-wide gauges: the same names, moved alike by the sequence
    # (this gateway's lookups; the entries of the Redis cache it shares).
    assert set(ours.cache_after) == set(theirs.cache_after) == set(CACHE_WIDE)
    assert set(theirs.cache_before) == set(CACHE_WIDE)  # there from the start

    def moved(o: Observed) -> dict[str, float]:
        counts = ("nv_cache_num_entries", "nv_cache_num_hits", "nv_cache_num_misses",
                  "nv_cache_num_lookups", "nv_cache_num_evictions")  # fmt: skip
        return {n: o.cache_after[n] - o.cache_before[n] for n in counts}

    assert moved(ours) == moved(theirs), (moved(ours), moved(theirs))
    assert moved(theirs)["nv_cache_num_lookups"] == len(SEQUENCE)
    for o in (ours, theirs):
        assert 0 < o.cache_after["nv_cache_util"] <= 1
        assert o.cache_after["nv_cache_util"] > o.cache_before["nv_cache_util"]


def test_ensembles_match_triton(on_ours: Observed, on_triton: Observed) -> None:
    """An ensemble that enables the cache is cached as a whole (its composing
    model runs once for two equal requests); a composing model that enables
    it is cached inside an ensemble that does not: as Triton 2.51 does."""
    ours = on_ours.ensembles
    assert ours == on_triton.ensembles, (ours, on_triton.ensembles)
    # every lookup counts in the cache-wide gauges, inside an ensemble too
    assert on_ours.ensemble_lookups == on_triton.ensemble_lookups == 4
    assert on_triton.ensembles["ens_cached"] == {
        "success": 2, "cache_hit": 1, "cache_miss": 1, "execution_count": 1,
    }  # fmt: skip
    assert on_triton.ensembles[INNER_PLAIN]["execution_count"] == 1
    assert on_triton.ensembles[MODEL] == {
        "success": 2, "cache_hit": 1, "cache_miss": 1, "execution_count": 1,
    }  # fmt: skip
