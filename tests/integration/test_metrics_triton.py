"""Our metrics port against real Triton 2.51's, family by family: the same
names, types and help texts for every family Triton shows on this host (no
GPU) after a model's first requests, the same labels for the failure
counter (one series per reason), and a loaded model's counters at 0 before
its first request."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from bench.references import wait_ready
from stageserve.launcher import Stack, start_services
from stageserve.net import free_port
from tests.integration.helpers import triton_grpc, write_echo
from tests.stack import wait_until

REASONS = {"OTHER", "BACKEND", "CANCELED", "REJECTED"}


def _scrape(metrics_port: int) -> str:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    return urllib.request.urlopen(url, timeout=10).read().decode()


def _counters(text: str) -> dict[tuple[str, frozenset], str]:
    """The per-model counters' samples: (family, labels) -> value."""
    out = {}
    for line in text.splitlines():
        sample = re.match(r"(nv_inference_\w+)\{(.*)\} (\S+)$", line)
        if sample and sample[1] != "nv_inference_pending_request_count":
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', sample[2]))
            out[(sample[1], labels)] = sample[3]
    return out


def _families(grpc_url: str, metrics_port: int) -> dict[str, dict[str, str]]:
    """After three inferences: family -> HELP, TYPE, and the failure
    counter's reasons (with their values)."""
    with grpcclient.InferenceServerClient(grpc_url) as client:
        inp = grpcclient.InferInput("IN", [1, 1], "INT32")
        inp.set_data_from_numpy(np.array([[7]], np.int32))
        for _ in range(3):
            assert client.infer("echo", [inp]).as_numpy("OUT")[0][0] == 7
    out: dict[str, dict[str, str]] = {}
    for line in _scrape(metrics_port).splitlines():
        meta = re.match(r"# (HELP|TYPE) (\S+) (.*)", line)
        if meta:
            out.setdefault(meta[2], {})[meta[1]] = meta[3]
        elif line.startswith("nv_inference_request_failure{"):
            reason = re.search(r'reason="(\w+)"', line)
            assert reason is not None
            out["nv_inference_request_failure"][reason[1]] = line.rsplit(" ", 1)[1]
    return out


def test_every_family_triton_shows_is_ours_with_its_type_help_and_fixed_values(
    tmp_path: Path,
) -> None:
    repo = write_echo(tmp_path / "repo", max_batch_size=4)
    port = free_port()
    extra = ("--allow-metrics=true", f"--metrics-port={port}")
    with triton_grpc(repo, tmp_path / "triton", ["echo"], *extra) as url:
        triton_loaded = _counters(_scrape(port))
        triton = _families(url, port)
    assert {k: v for k, v in triton["nv_inference_request_failure"].items() if k in REASONS} == (
        dict.fromkeys(REASONS, "0")
    )
    # a loaded model's counters, before its first request: every one at 0
    assert len(triton_loaded) == 12 and set(triton_loaded.values()) == {"0"}
    stack = Stack()
    try:
        port = free_port()
        services = start_services(stack, repo, device="cpu", metrics_port=port)
        wait_ready(services.gateway.address, ["echo"], 60)
        ours_loaded = _counters(_scrape(port))
        ours = _families(services.gateway.address, port)
    finally:
        stack.stop()
    assert ours_loaded == triton_loaded
    assert {name: ours.get(name) for name in triton} == triton


def _unload_and_load(grpc_url: str, metrics_port: int) -> tuple[dict, dict]:
    """A model's counters after one request and its unload, then after its
    load again."""
    with grpcclient.InferenceServerClient(grpc_url) as client:
        inp = grpcclient.InferInput("IN", [1, 1], "INT32")
        inp.set_data_from_numpy(np.array([[7]], np.int32))
        client.infer("echo", [inp])
        client.unload_model("echo")

        def unloaded_now() -> dict:
            return _counters(_scrape(metrics_port))

        # (Triton takes its counters away once the model is destroyed, a
        # moment after the unload returned)
        wait_until(
            lambda: {name for name, _ in unloaded_now()} == {"nv_inference_request_failure"}, 20
        )
        unloaded = unloaded_now()
        client.load_model("echo")
        return unloaded, _counters(_scrape(metrics_port))


def test_an_unload_and_a_load_again_leave_the_counters_as_triton_does(tmp_path: Path) -> None:
    """Triton 2.51: the unload takes the counters away but for the failure
    counter's; the load again starts every one from 0."""
    repo = write_echo(tmp_path / "repo", max_batch_size=4)
    port = free_port()
    explicit = ("--model-control-mode=explicit", "--load-model=echo")
    extra = ("--allow-metrics=true", f"--metrics-port={port}", *explicit)
    with triton_grpc(repo, tmp_path / "triton", ["echo"], *extra) as url:
        triton = _unload_and_load(url, port)
    unloaded, reloaded = triton
    assert {name for name, _ in unloaded} == {"nv_inference_request_failure"}
    assert len(reloaded) == 12 and set(reloaded.values()) == {"0"}
    stack = Stack()
    try:
        port = free_port()
        services = start_services(
            stack,
            repo,
            control_mode="explicit",
            load_models=["echo"],
            device="cpu",
            metrics_port=port,
        )
        wait_ready(services.gateway.address, ["echo"], 60)
        ours = _unload_and_load(services.gateway.address, port)
    finally:
        stack.stop()
    assert ours == triton
