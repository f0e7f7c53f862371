"""Triton's security flags on the public endpoint, through tritonclient: TLS, mutual TLS
and --grpc-restricted-protocol.

Certificates are made for the test with the openssl CLI (a CA, a server
certificate for 127.0.0.1, a client certificate); the test skips without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from stageserve.launcher import Stack, start_services
from stageserve_tools.examples import write_simple
from tests.integration.helpers import infer_simple, make_certs

TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("security_repository")
    write_simple(root, "simple")
    return root


def _stack(repo: Path, flags: list[str], front: str = "address") -> Iterator[str]:
    stack = Stack()
    try:
        services = start_services(
            stack,
            repo,
            control_mode="explicit",
            load_models=("simple",),
            device="cpu",
            gateway_extra=flags,
        )
        yield getattr(services.gateway, front)
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def mtls(repo: Path, certs: Path) -> Iterator[str]:
    """Mutual TLS, repository control and statistics restricted to a header."""
    yield from _stack(
        repo,
        [
            "--grpc-use-ssl=true",
            "--grpc-use-ssl-mutual=true",
            "--grpc-server-cert", str(certs / "server.crt"),
            "--grpc-server-key", str(certs / "server.key"),
            "--grpc-root-cert", str(certs / "ca.crt"),
            "--grpc-restricted-protocol=model-repository,statistics:admin-key=s3cret",
        ],
    )  # fmt: skip


@pytest.fixture(scope="module")
def tls(repo: Path, certs: Path) -> Iterator[str]:
    """Server-side TLS only."""
    yield from _stack(
        repo,
        [
            "--grpc-use-ssl",
            "--grpc-server-cert", str(certs / "server.crt"),
            "--grpc-server-key", str(certs / "server.key"),
        ],
    )  # fmt: skip


def _client(url: str, certs: Path, *, ssl: bool = True, client_cert: bool = True):
    if not ssl:
        return grpcclient.InferenceServerClient(url)
    kwargs = {"root_certificates": str(certs / "ca.crt")}
    if client_cert:
        kwargs |= {
            "private_key": str(certs / "client.key"),
            "certificate_chain": str(certs / "client.crt"),
        }
    return grpcclient.InferenceServerClient(url, ssl=True, **kwargs)


def test_tls_serves_a_client_that_trusts_the_server(tls: str, certs: Path) -> None:
    c = _client(tls, certs, client_cert=False)
    assert c.is_server_live(client_timeout=TIMEOUT_S)
    infer_simple(c)


def test_tls_refuses_plaintext(tls: str, certs: Path) -> None:
    with pytest.raises(InferenceServerException):
        _client(tls, certs, ssl=False).is_server_live(client_timeout=TIMEOUT_S)


def test_mutual_tls_serves_a_client_with_a_certificate(mtls: str, certs: Path) -> None:
    c = _client(mtls, certs)
    assert c.is_server_ready(client_timeout=TIMEOUT_S)
    infer_simple(c, batch=2)


def test_mutual_tls_refuses_a_client_without_a_certificate(mtls: str, certs: Path) -> None:
    with pytest.raises(InferenceServerException):
        _client(mtls, certs, client_cert=False).is_server_live(client_timeout=TIMEOUT_S)
    with pytest.raises(InferenceServerException):
        _client(mtls, certs, ssl=False).is_server_live(client_timeout=TIMEOUT_S)


def test_restricted_protocols_need_the_header(mtls: str, certs: Path) -> None:
    c = _client(mtls, certs)
    expected = "This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'"
    for headers in (None, {"triton-grpc-protocol-admin-key": "wrong"}, {"admin-key": "s3cret"}):
        for call in (
            lambda h: c.get_model_repository_index(headers=h, client_timeout=TIMEOUT_S),
            lambda h: c.get_inference_statistics("simple", headers=h, client_timeout=TIMEOUT_S),
            lambda h: c.load_model("simple", headers=h, client_timeout=TIMEOUT_S),
            lambda h: c.unload_model("simple", headers=h, client_timeout=TIMEOUT_S),
        ):
            with pytest.raises(InferenceServerException) as info:
                call(headers)
            assert info.value.status() == "StatusCode.UNAVAILABLE"
            assert info.value.message() == expected
    good = {"triton-grpc-protocol-admin-key": "s3cret"}
    assert [m.name for m in c.get_model_repository_index(headers=good).models] == ["simple"]
    assert c.get_inference_statistics("simple", headers=good).model_stats
    # what is not restricted needs no header
    assert c.get_model_metadata("simple", client_timeout=TIMEOUT_S).name == "simple"
    assert c.get_model_config("simple", client_timeout=TIMEOUT_S).config.name == "simple"
    assert c.get_system_shared_memory_status(client_timeout=TIMEOUT_S) is not None
    infer_simple(c)


@pytest.fixture(scope="module")
def http_restricted(repo: Path) -> Iterator[str]:
    """The HTTP front with Triton's --http-restricted-api (plaintext gRPC unrestricted)."""
    yield from _stack(
        repo,
        ["--http-restricted-api=model-repository,statistics:admin-key=s3cret"],
        front="http_address",
    )


def test_http_restricted_apis_need_the_header(http_restricted: str) -> None:
    c = httpclient.InferenceServerClient(http_restricted, network_timeout=TIMEOUT_S)
    expected = "This API is restricted, expecting header 'admin-key'"
    for headers in (None, {"admin-key": "wrong"}, {"triton-grpc-protocol-admin-key": "s3cret"}):
        for call in (
            lambda h: c.get_model_repository_index(headers=h),
            lambda h: c.get_inference_statistics("simple", headers=h),
            lambda h: c.load_model("simple", headers=h),
            lambda h: c.unload_model("simple", headers=h),
        ):
            with pytest.raises(InferenceServerException) as info:
                call(headers)
            assert info.value.status() == "403"
            assert info.value.message() == expected
    good = {"Admin-Key": "s3cret"}  # header names are case-insensitive
    assert [m["name"] for m in c.get_model_repository_index(headers=good)] == ["simple"]
    assert c.get_inference_statistics("simple", headers=good)["model_stats"]
    # what is not restricted needs no header
    assert c.is_server_ready()
    assert c.get_model_metadata("simple")["name"] == "simple"
