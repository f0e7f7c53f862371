"""Mutual TLS between stages (STAGESERVE_STAGE_TLS_*, stageserve/stage_tls.py).

The whole stack runs with stage TLS: inference through every stage works, and
an internal stage refuses a plaintext client and a TLS client without a
certificate, while one with a CA-signed certificate gets through.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stageserve.launcher import Stack, StackServices, start_services
from stageserve.stage_tls import ENV_CA, ENV_CERT, ENV_KEY
from stageserve_tools.examples import write_simple
from tests.integration.helpers import infer_simple, make_certs

TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("stage_certs"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, certs: Path) -> Iterator[StackServices]:
    repo = tmp_path_factory.mktemp("stage_tls_repository")
    write_simple(repo, "simple")
    env = {
        ENV_CERT: str(certs / "server.crt"),
        ENV_KEY: str(certs / "server.key"),
        ENV_CA: str(certs / "ca.crt"),
    }
    with pytest.MonkeyPatch.context() as patch:  # the children inherit it
        for name, value in env.items():
            patch.setenv(name, value)
        stack = Stack()
        try:
            services = start_services(
                stack, repo, control_mode="explicit", load_models=("simple",), device="cpu"
            )
        except BaseException:
            stack.stop()
            raise
    try:
        yield services
    finally:
        stack.stop()


def _health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S).status


def test_inference_crosses_every_stage_over_mutual_tls(stack: StackServices) -> None:
    client = grpcclient.InferenceServerClient(stack.gateway.address)
    result = infer_simple(client, batch=2)  # checks the sums and differences itself
    assert result.as_numpy("OUTPUT0").shape == (2, 16)


@pytest.mark.parametrize("stage", ["scheduler", "ratelimiter", "worker"])
def test_a_stage_refuses_plaintext_and_clients_without_a_certificate(
    stack: StackServices, certs: Path, stage: str
) -> None:
    child = stack.workers[0] if stage == "worker" else getattr(stack, stage)
    address = child.address
    with grpc.insecure_channel(address) as plain, pytest.raises(grpc.RpcError):
        _health(plain)
    ca = (certs / "ca.crt").read_bytes()
    anonymous = grpc.ssl_channel_credentials(root_certificates=ca)
    with grpc.secure_channel(address, anonymous) as channel, pytest.raises(grpc.RpcError):
        _health(channel)
    mutual = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=(certs / "client.key").read_bytes(),
        certificate_chain=(certs / "client.crt").read_bytes(),
    )
    with grpc.secure_channel(address, mutual) as channel:
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING


def test_a_half_configured_stage_tls_is_refused_at_start(certs: Path, tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", ENV_CERT: str(certs / "server.crt")}
    proc = subprocess.run(
        [sys.executable, "-m", "stageserve.cli", "scheduler", "--listen", "127.0.0.1:0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 2
    assert f"missing {ENV_KEY}, {ENV_CA}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_container_health_check_uses_the_stage_certificate(
    stack: StackServices, certs: Path
) -> None:
    """docker/healthcheck.py (the image's HEALTHCHECK and k8s exec probe)."""
    script = Path(__file__).resolve().parents[2] / "docker" / "healthcheck.py"
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(script.parents[1]),
        ENV_CERT: str(certs / "client.crt"),
        ENV_KEY: str(certs / "client.key"),
        ENV_CA: str(certs / "ca.crt"),
    }
    address = stack.scheduler.address

    def probe(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(script), address, *flags],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    ok = probe()
    assert ok.returncode == 0, ok.stderr
    assert "SERVING" in ok.stdout
    assert probe("--plaintext").returncode == 1
