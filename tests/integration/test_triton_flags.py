"""A tritonserver launch line, as deployment scripts write it, starts `stageserve
up` unchanged, and each flag does what it does in Triton 2.51 where StageServe
has the part it concerns (stageserve/triton_flags.py). The same line runs on
real tritonserver 2.51 too, where it is installed: the same server name, the
same metrics port closed, the same refusals of bad values."""

from __future__ import annotations

import argparse
import contextlib
import random
import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient

from bench.references import ReferenceNotInstalled, find_triton
from stageserve.cli import build_parser
from stageserve.net import free_port
from stageserve_tools.examples import PY_PREPROCESS_SOURCE, identity_model, write_python_model
from tests.integration.helpers import RPC_TIMEOUT_S, skip_if_triton_crashed, triton_grpc
from tests.integration.up_process import UpProcess
from tests.stack import running_stack

# Flags from Triton's docs and deployment examples; --model-store and the
# ports are added per server.
LAUNCH_LINE = [
    "--id=edge-7",
    "--allow-metrics=false",
    "--allow-gpu-metrics=false",
    "--allow-cpu-metrics=false",
    "--metrics-interval-ms=2000",
    "--strict-model-config=false",
    "--backend-config=default-max-batch-size=8",
    "--backend-config=python,shm-default-byte-size=1048576",
    "--pinned-memory-pool-byte-size=268435456",
    "--cuda-memory-pool-byte-size=0:67108864",
    "--exit-timeout-secs=7",
    "--model-load-thread-count=2",
    "--http-thread-count=4",
    "--reuse-grpc-port=true",
    "--reuse-http-port=true",
    "--grpc-keepalive-time=10000",
    "--grpc-keepalive-timeout=5000",
    "--grpc-keepalive-permit-without-calls=true",
    "--grpc-http2-max-pings-without-data=0",
    "--grpc-http2-max-ping-strikes=0",
    "--grpc-infer-response-compression-level=none",
    "--allow-sagemaker=false",
    "--model-load-retry-count=1",
    "--trace-level=OFF",
]

# A bad value of each kind, and the line of tritonserver 2.51's answer that
# names it (it exits 1; `stageserve` exits 2, as any bad flag of its own).
BAD = {
    "--allow-metrics=maybe": "invalid value for bool option: maybe",
    "--exit-timeout-secs=abc": "Invalid option value. Got abc",
    "--backend-config=python,bad": (
        "--backend-config option format is '<backend name>,<setting>=<value>'. Got python,bad"
    ),
    "--cuda-memory-pool-byte-size=abc": (
        "--<pair option> argument requires format <first>:<second>. Found: abc"
    ),
    "--grpc-keepalive-time=abc": "Invalid option value. Got abc",
    "--grpc-infer-response-compression-level=bogus": (
        "invalid argument for --grpc_infer_response_compression_level"
    ),
    "--host-policy=abc": (
        "--host-policy option format is '<policy name>,<setting>=<value>'. Got abc"
    ),
    "--sagemaker-safe-port-range=abc": (
        "--<pair option> argument requires format <first>-<second>. Found: abc"
    ),
    "--trace-level=BOGUS": "invalid value for trace level option: bogus",
    "--model-load-gpu-limit=0:abc": "Invalid option value. Got abc",
}


def tritonserver_flags() -> list[str]:
    """Every flag `tritonserver --help` lists (skips without the reference)."""
    try:
        triton = find_triton()
    except ReferenceNotInstalled as exc:
        pytest.skip(str(exc))
    out = subprocess.run(
        [str(triton.binary), "--help"], env=triton.env(), capture_output=True, text=True, timeout=60
    )
    flags = sorted(set(re.findall(r"^  (--[a-z0-9-]+)", out.stdout + out.stderr, re.M)))
    assert len(flags) > 80, (out.stdout + out.stderr)[-2000:]
    return flags


def test_up_takes_every_flag_tritonserver_has() -> None:
    """A launch script may carry any of them: each is taken (applied, an alias, refused
    with its reason when it cannot be served, or accepted without effect)."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    ours = {flag for action in commands.choices["up"]._actions for flag in action.option_strings}
    missing = [flag for flag in tritonserver_flags() if flag not in ours]
    assert missing == []


def _bare_model(root: Path) -> None:
    d = root / "bare" / "1"
    d.mkdir(parents=True)
    (d / "model.onnx").write_bytes(identity_model("FP32", (3,), 64).SerializeToString())


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports that `pid` and its descendants listen on. (Whether a port
    refuses connections says nothing: a parallel test's process may have
    been given the same port since free_port picked it.)"""
    root = psutil.Process(pid)
    ports = set()
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            ports |= {
                c.laddr.port
                for c in proc.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN
            }
    return ports


def _port_no_process_is_given() -> int:
    """A free TCP port below the kernel's ephemeral range: no bind to port 0
    (the stack's own internal ports, its stages' metrics servers, a parallel
    test's free_port) can be handed it, so finding it listened on means
    somebody was told to listen there. (A port free_port picked can be
    handed to a stage that binds port 0 after it.)"""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        port = random.randrange(max(1024, low - 12_000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    raise AssertionError("no free port below the ephemeral range")


def test_a_triton_launch_line_starts_the_stack_with_tritons_effects(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    _bare_model(repository)
    elsewhere = tmp_path / "empty"  # UpProcess's --model-repository; --model-store wins
    elsewhere.mkdir()
    metrics_port = _port_no_process_is_given()
    args = ["--model-store", str(repository), *LAUNCH_LINE, "--metrics-port", str(metrics_port)]
    with UpProcess(elsewhere, args) as up:
        assert up.wait(240) is not None, "".join(up.err[-40:])
        c = grpcclient.InferenceServerClient(up.grpc_url())
        assert c.get_server_metadata(client_timeout=RPC_TIMEOUT_S).name == "edge-7"
        # --backend-config=default-max-batch-size: what auto-complete gives
        config = c.get_model_config("bare", client_timeout=RPC_TIMEOUT_S).config
        assert config.max_batch_size == 8
        listening = _listening_ports(up.proc.pid)
        assert up.grpc_url().rsplit(":", 1)[1] in {str(p) for p in listening}, listening
        assert metrics_port not in listening  # --allow-metrics=false
        ignored = [e["flag"] for e in up.logs("flag accepted, no effect in StageServe")]
        assert any(f.startswith("--pinned-memory-pool-byte-size (") for f in ignored), ignored
        unused = [e["config"] for e in up.logs("--backend-config not used by StageServe")]
        assert unused == ["python,shm-default-byte-size=1048576"]
        c.close()
        assert up.stop() == 0
    # --exit-timeout-secs: the gateway's wait for requests in flight at shutdown
    graces = [e["grace_s"] for e in up.logs("stopping") if e.get("service") == "gateway"]
    assert graces == [7], graces


@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_bad_value_is_refused_with_tritons_words(tmp_path: Path, bad: str) -> None:
    up = subprocess.run(
        [*UpProcess.command(tmp_path), bad], capture_output=True, text=True, timeout=60
    )
    assert up.returncode == 2, up.stderr[-2000:]
    assert BAD[bad] in up.stderr


def _triton(repository: Path, extra: list[str]) -> tuple[subprocess.Popen, int, int]:
    triton = find_triton()
    http, grpc_port, metrics = free_port(), free_port(), _port_no_process_is_given()
    cmd = [
        str(triton.binary),
        f"--model-store={repository}",
        f"--http-port={http}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics}",
        *extra,
    ]
    proc = subprocess.Popen(
        cmd, env=triton.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return proc, http, metrics


def test_triton_takes_the_same_line_and_refuses_the_same_values(tmp_path: Path) -> None:
    try:
        find_triton()
    except ReferenceNotInstalled as exc:
        pytest.skip(str(exc))
    proc, http, metrics = _triton(tmp_path, LAUNCH_LINE)
    try:
        deadline = time.monotonic() + 60
        name = None
        while name is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2", timeout=5) as r:
                    name = r.read().decode()
            except OSError:
                time.sleep(0.2)
        assert name is not None and '"name":"edge-7"' in name, proc.poll()
        listening = _listening_ports(proc.pid)
        assert http in listening and metrics not in listening, listening
    finally:
        proc.terminate()
        proc.wait(30)
    for bad, line in BAD.items():
        proc, _, _ = _triton(tmp_path, [bad])
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 1 and line in out, (bad, out[-500:])


def _py_config(max_batch_size: int) -> str:
    return f"""
name: "pym"
backend: "python"
max_batch_size: {max_batch_size}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""


def test_model_config_name_reads_the_named_config_as_triton_does(tmp_path: Path) -> None:
    """--model-config-name=custom: the model's configs/custom.pbtxt, not its config.pbtxt,
    on StageServe and on real Triton (a Python-backend model: the referee here has no
    ONNX Runtime backend)."""
    root = tmp_path / "repository"
    model_dir = write_python_model(root, "pym", PY_PREPROCESS_SOURCE, _py_config(8))
    (model_dir / "configs").mkdir()
    (model_dir / "configs" / "custom.pbtxt").write_text(_py_config(2))
    x = np.full((2, 4), 1.5, dtype=np.float32)

    def check(url: str) -> int:
        with grpcclient.InferenceServerClient(url) as client:
            config = client.get_model_config("pym", client_timeout=RPC_TIMEOUT_S).config
            inp = grpcclient.InferInput("INPUT0", [2, 4], "FP32")
            inp.set_data_from_numpy(x)
            out = client.infer("pym", [inp], client_timeout=RPC_TIMEOUT_S).as_numpy("OUTPUT0")
            assert out.tolist() == ((x - 0.5) * 2).tolist()
            return int(config.max_batch_size)

    with running_stack(root, gateway_extra=("--model-config-name", "custom")) as stack:
        ours = check(stack.url)
    assert ours == 2
    with (
        triton_grpc(root, tmp_path / "triton", ["pym"], "--model-config-name=custom") as url,
        skip_if_triton_crashed(url),
    ):
        assert check(url) == ours


def _other_address() -> str | None:
    """This host's address toward the outside (no packet is sent), or None."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.mark.parametrize("gateways", ["1", "2"])
def test_metrics_address_is_what_the_metrics_port_binds(tmp_path: Path, gateways: str) -> None:
    """--metrics-address=127.0.0.1: the Triton metrics port answers on the loopback
    address only (one gateway binds it; with two, `up`'s merged port does)."""
    other = _other_address()
    if other is None:
        pytest.skip("this host has no address besides the loopback one")
    repository = tmp_path / "models"
    _bare_model(repository)
    port = free_port()
    args = ["--metrics-address=127.0.0.1", "--metrics-port", str(port), "--gateways", gateways]
    with UpProcess(repository, args) as up:
        assert up.wait(240) is not None, "".join(up.err[-40:])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert b"nv_cpu_memory_used_bytes" in r.read()
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{other}:{port}/metrics", timeout=5)
        assert up.stop() == 0
