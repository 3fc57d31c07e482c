"""TLS and mutual TLS of the gRPC servers and clients (astrolabe/tls.py), with certificates made by trustme.

Real gRPC servers on loopback: the standard health service over `add_port`, the extproc (`ExtprocServer`) and a
real predictor sidecar process beside a real emulator, dialled by the extproc's `PredictorClient`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import sys
import time
from pathlib import Path

import aiohttp
import grpc
import pytest
import trustme
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from astrolabe.tls import BackendTls, ClientTls, ServerTls, TlsError, add_port, channel_credentials, channel_options, \
    server_credentials
from astrolabe.procs import ProcessGroup, free_port
from extproc.config import ConfigError, EndpointConfig, HealthCheckConfig, load_config, parse_config
from extproc.pool import EndpointPool, HealthChecker
from extproc.server import ExtprocServer
from predictor.server import Sidecar, SidecarConfig, add_arguments, backend_tls_from_args, tls_from_args
from predictor.sim import EngineConfig
from tests.extproc.test_stream import body_msg, headers_msg

PY = sys.executable


class Certs:
    """A CA, a server certificate for localhost / 127.0.0.1 and a client certificate, as PEM files in ``root``;
    ``other_*``: a second CA's, which the first does not trust."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = trustme.CA()
        self.other = trustme.CA()
        self.ca_file = self._write("ca.crt", self.ca.cert_pem.bytes())
        self.other_ca_file = self._write("other-ca.crt", self.other.cert_pem.bytes())
        self.cert_file, self.key_file = self.issue(self.ca, "server", "localhost", "127.0.0.1")
        self.client_cert_file, self.client_key_file = self.issue(self.ca, "client", "astrolabe-extproc")
        self.other_client_cert_file, self.other_client_key_file = self.issue(self.other, "other-client", "intruder")

    def _write(self, name: str, data: bytes) -> str:
        path = self.root / name
        path.write_bytes(data)
        return str(path)

    def issue(self, ca: trustme.CA, name: str, *identities: str) -> tuple[str, str]:
        cert = ca.issue_cert(*identities)
        return (self._write(f"{name}.crt", b"".join(blob.bytes() for blob in cert.cert_chain_pems)),
                self._write(f"{name}.key", cert.private_key_pem.bytes()))


@pytest.fixture
def certs(tmp_path) -> Certs:
    return Certs(tmp_path)


async def _health_server(tls: ServerTls | None):
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = add_port(server, "127.0.0.1:0", tls)
    await server.start()
    return server, port


async def _check(port: int, tls: ClientTls | None) -> bool:
    """True when a Check call over a new channel succeeds; False when the connection (handshake) fails."""
    address = f"127.0.0.1:{port}"
    channel = (grpc.aio.insecure_channel(address) if tls is None else
               grpc.aio.secure_channel(address, channel_credentials(tls), options=channel_options(tls)))
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return True
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        return False
    finally:
        await channel.close()


async def test_tls_server_verifies_and_refuses_plaintext(certs):
    server, port = await _health_server(ServerTls(certs.cert_file, certs.key_file))
    try:
        assert await _check(port, ClientTls(ca_file=certs.ca_file))
        assert not await _check(port, None)  # plaintext to a TLS port
        assert not await _check(port, ClientTls(ca_file=certs.other_ca_file))  # a CA that did not sign it
        # The certificate names localhost and 127.0.0.1: another name fails verification ...
        assert not await _check(port, ClientTls(ca_file=certs.ca_file, server_name="vllm.example"))
        # ... and the override is how a client dialling an IP checks a Service name
        assert await _check(port, ClientTls(ca_file=certs.ca_file, server_name="localhost"))
    finally:
        await server.stop(0)


async def test_mutual_tls_requires_a_client_certificate_the_ca_signed(certs):
    server, port = await _health_server(ServerTls(certs.cert_file, certs.key_file, client_ca_file=certs.ca_file))
    try:
        assert await _check(port, ClientTls(certs.ca_file, certs.client_cert_file, certs.client_key_file))
        assert not await _check(port, ClientTls(ca_file=certs.ca_file))  # no client certificate
        assert not await _check(port, ClientTls(certs.ca_file, certs.other_client_cert_file,
                                                certs.other_client_key_file))  # signed by a CA it does not trust
    finally:
        await server.stop(0)


async def test_renewed_certificate_files_apply_to_new_connections(certs):
    """A renewed Secret (new files in place) is served at the next handshake without a restart."""
    server, port = await _health_server(ServerTls(certs.cert_file, certs.key_file))
    try:
        assert await _check(port, ClientTls(ca_file=certs.ca_file))
        renewed = certs.other.issue_cert("localhost", "127.0.0.1")  # now signed by the other CA
        Path(certs.key_file).write_bytes(renewed.private_key_pem.bytes())
        Path(certs.cert_file).write_bytes(b"".join(blob.bytes() for blob in renewed.cert_chain_pems))
        os.utime(certs.cert_file, ns=(1, 1))  # a distinct stamp even within the file system's time resolution
        assert await _check(port, ClientTls(ca_file=certs.other_ca_file))
        assert not await _check(port, ClientTls(ca_file=certs.ca_file))
        Path(certs.cert_file).write_text("half-written")  # a broken renewal keeps the certificate in use
        os.utime(certs.cert_file, ns=(2, 2))
        assert await _check(port, ClientTls(ca_file=certs.other_ca_file))
    finally:
        await server.stop(0)


def test_tls_errors_name_the_file_and_its_role(certs, tmp_path):
    with pytest.raises(TlsError, match=r"server certificate .*missing\.crt: No such file"):
        server_credentials(ServerTls(str(tmp_path / "missing.crt"), certs.key_file))
    (tmp_path / "junk.key").write_text("not a key")
    with pytest.raises(TlsError, match=r"server private key .*junk\.key: not a PEM file"):
        server_credentials(ServerTls(certs.cert_file, str(tmp_path / "junk.key")))
    with pytest.raises(TlsError, match="client CA"):
        server_credentials(ServerTls(certs.cert_file, certs.key_file, str(tmp_path / "none.crt")))
    with pytest.raises(TlsError, match="cert_file and key_file must be set together"):
        ClientTls(ca_file=certs.ca_file, cert_file=certs.client_cert_file)


def test_config_tls_sections_name_the_key(certs, monkeypatch):
    endpoints = [{"address": "127.0.0.1:8000"}]
    with pytest.raises(ConfigError, match=r"^tls\.key_file: required"):
        parse_config({"endpoints": endpoints, "tls": {"cert_file": certs.cert_file}})
    with pytest.raises(ConfigError, match=r"^predictor_tls\.key_file: cert_file and key_file must be set together"):
        parse_config({"endpoints": endpoints, "predictor_tls": {"cert_file": certs.client_cert_file}})
    with pytest.raises(ConfigError, match=r"^tls: unknown key\(s\) \['client_cfile'\]"):
        parse_config({"endpoints": endpoints, "tls": {"cert_file": "a", "key_file": "b", "client_cfile": "c"}})
    config = parse_config({"endpoints": endpoints})
    assert config.tls is None and config.predictor_tls is None


def test_tls_environment_overrides(certs, tmp_path):
    path = tmp_path / "extproc.yaml"
    path.write_text(json.dumps({"endpoints": [{"address": "127.0.0.1:8000"}]}))
    config = load_config(path, {"ASTROLABE_EXTPROC_TLS__CERT_FILE": certs.cert_file,
                                "ASTROLABE_EXTPROC_TLS__KEY_FILE": certs.key_file,
                                "ASTROLABE_EXTPROC_PREDICTOR_TLS__CA_FILE": certs.ca_file})
    assert (config.tls.cert_file, config.tls.key_file, config.tls.client_ca_file) == (certs.cert_file,
                                                                                       certs.key_file, None)
    assert config.predictor_tls.ca_file == certs.ca_file


def test_extproc_refuses_to_start_on_an_unusable_tls_file(certs, tmp_path):
    endpoints = [{"address": "127.0.0.1:8000"}]
    with pytest.raises(ConfigError, match=r"^tls: server certificate .*gone\.crt"):
        ExtprocServer(parse_config({"endpoints": endpoints,
                                    "tls": {"cert_file": str(tmp_path / "gone.crt"), "key_file": certs.key_file}}))
    with pytest.raises(ConfigError, match=r"^predictor_tls: CA .*gone-ca\.crt"):
        ExtprocServer(parse_config({"endpoints": endpoints, "predictor_tls": {"ca_file": str(tmp_path / "gone-ca.crt")}}))


def _sidecar_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--backend", "127.0.0.1:1", *argv])


def test_sidecar_tls_flags(certs):
    assert tls_from_args(_sidecar_args()) is None
    tls = tls_from_args(_sidecar_args("--tls-cert-file", certs.cert_file, "--tls-key-file", certs.key_file,
                                      "--tls-client-ca-file", certs.ca_file))
    assert tls == ServerTls(certs.cert_file, certs.key_file, certs.ca_file)
    with pytest.raises(TlsError, match="--tls-client-ca-file needs them"):
        tls_from_args(_sidecar_args("--tls-client-ca-file", certs.ca_file))
    with pytest.raises(TlsError, match="given together"):
        tls_from_args(_sidecar_args("--tls-cert-file", certs.cert_file))
    assert backend_tls_from_args(_sidecar_args()) is None
    assert backend_tls_from_args(_sidecar_args("--backend-tls-ca-file", certs.ca_file)) == BackendTls(certs.ca_file)
    with pytest.raises(TlsError, match="needs --backend-tls-ca-file"):
        backend_tls_from_args(_sidecar_args("--backend-tls-server-name", "vllm"))


@pytest.fixture
def tls_sidecar(certs, tmp_path):
    """A real emulator and its real sidecar serving mutual TLS: (backend, sidecar) addresses."""
    with ProcessGroup() as procs:
        port, sidecar_port = free_port(), free_port()
        emulator = procs.start([PY, "-m", "astrolabe", "emulator", "--port", str(port)], name="emulator",
                               log_path=tmp_path / "emulator.log")
        emulator.wait_http(f"http://127.0.0.1:{port}/health", timeout_s=30)
        sidecar = procs.start([PY, "-m", "astrolabe", "predictor", "serve", "--backend", f"127.0.0.1:{port}",
                               "--listen", f"127.0.0.1:{sidecar_port}", "--tls-cert-file", certs.cert_file,
                               "--tls-key-file", certs.key_file, "--tls-client-ca-file", certs.ca_file],
                              name="sidecar", log_path=tmp_path / "sidecar.log")
        sidecar.wait_tcp("127.0.0.1", sidecar_port, timeout_s=30)
        yield f"127.0.0.1:{port}", f"127.0.0.1:{sidecar_port}"


async def _route_once(srv: ExtprocServer, port: int, certs: Certs) -> None:
    """One buffered completion through the extproc's mTLS port; asserts it was routed."""
    credentials = channel_credentials(ClientTls(certs.ca_file, certs.client_cert_file, certs.client_key_file))
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        call = ext_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers_msg())
        await call.read()
        await call.write(body_msg(json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 4}).encode()))
        answer = await call.read()
        await call.done_writing()
        assert answer.WhichOneof("response") == "request_body", answer


@pytest.mark.slow
@pytest.mark.parametrize("client_side", ["mutual", "no-client-cert", "plaintext"])
@pytest.mark.parametrize("mode", ["watch", "predict"])
async def test_extproc_predicts_over_mutual_tls(certs, tls_sidecar, client_side, mode):
    """The extproc serves mTLS to Envoy's side and watches (or asks) a mTLS sidecar; without the client certificate
    (or TLS) the sidecar refuses, and the request is still routed (a sidecar that cannot be reached is a failed
    probe)."""
    backend, sidecar = tls_sidecar
    predictor_tls = {"mutual": {"ca_file": certs.ca_file, "cert_file": certs.client_cert_file,
                                "key_file": certs.client_key_file},
                     "no-client-cert": {"ca_file": certs.ca_file}, "plaintext": None}[client_side]
    srv = ExtprocServer(parse_config({
        "listen": "127.0.0.1:0", "policy": "astrolabe", "policy_params": {"k": 1}, "seed": 0,
        "health_check": {"enabled": False}, "output_length": {"source": "fixed"},
        # any answer counts (a sidecar just started on a loaded machine may not have scraped its backend yet)
        "predictor_client": {"predict_timeout_s": 2.0, "max_state_age_s": 3600.0, "mode": mode},
        "tls": {"cert_file": certs.cert_file, "key_file": certs.key_file, "client_ca_file": certs.ca_file},
        "predictor_tls": predictor_tls, "endpoints": [{"address": backend, "predictor": sidecar}]}))
    port = await srv.start()
    try:
        assert not await _check(port, ClientTls(ca_file=certs.ca_file))  # Envoy's side is mutual TLS too
        await _route_once(srv, port, certs)
        outcomes = srv.predictors.outcomes[sidecar] if mode == "predict" else srv.fleet.outcomes[sidecar]
        if client_side == "mutual":  # an answer (a sidecar that has not reconciled yet answers from a stale state)
            assert outcomes["ok"] + outcomes["stale_state"] == 1, outcomes
        elif mode == "predict":
            assert outcomes["ok"] == 0 and outcomes["down"] == 1, outcomes
        else:  # its state stream could not be opened
            assert outcomes["ok"] == 0 and outcomes["no_state"] == 1, outcomes
    finally:
        await srv.stop()


METRICS_TEXT = ('vllm:num_requests_running{model_name="m"} 0\nvllm:num_requests_waiting{model_name="m"} 0\n'
                'vllm:kv_cache_usage_perc{model_name="m"} 0.0\n'
                'vllm:cache_config_info{block_size="16",num_gpu_blocks="777"} 1.0\n')


@pytest.fixture
async def https_backend(certs):
    """An HTTPS server with vLLM's /metrics (777 KV blocks): its address."""
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=METRICS_TEXT)

    async def healthy(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", healthy)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs.cert_file, certs.key_file)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    yield f"127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


@pytest.mark.parametrize("tls", ["verified", "plaintext"])
async def test_sidecar_scrapes_an_https_backend(certs, https_backend, tls):
    backend_tls = BackendTls(certs.ca_file, "localhost") if tls == "verified" else None
    sidecar = Sidecar(SidecarConfig(backend=https_backend, listen="127.0.0.1:0", backend_tls=backend_tls,
                                    engine=EngineConfig(num_gpu_blocks=100)))
    await sidecar.start()
    try:
        if tls == "verified":  # the KV cache comes from the backend's /metrics, read over HTTPS
            await _until(lambda: sidecar.last_reconciled_s is not None)
            assert sidecar.ledger.scheduler.config.num_gpu_blocks == 777
        else:  # plain HTTP to an HTTPS port reads nothing: the flags' KV cache stays
            await asyncio.sleep(0.5)
            assert sidecar.last_reconciled_s is None and sidecar.ledger.scheduler.config.num_gpu_blocks == 100
    finally:
        await sidecar.stop()


async def test_extproc_health_checks_an_https_backend(certs, https_backend):
    for tls, healthy in ((BackendTls(certs.ca_file, "localhost"), True), (None, False),
                         (BackendTls(certs.other_ca_file), False), (BackendTls(certs.ca_file, "vllm.other"), False)):
        pool = EndpointPool([EndpointConfig(address=https_backend)], new_endpoints_healthy=not healthy)
        checker = HealthChecker(pool, HealthCheckConfig(unhealthy_threshold=1), tls)
        async with aiohttp.ClientSession() as session:
            await checker.run_once(session)
        assert pool.is_healthy(https_backend) is healthy, tls


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, "condition not reached"
        await asyncio.sleep(0.05)


def test_a_key_that_is_not_the_certificates_is_named(certs):
    """A mismatched pair would otherwise surface as gRPC's "Failed to bind" (or each handshake failing)."""
    with pytest.raises(TlsError, match=r"server certificate .*server\.crt and its key .*client\.key do not load"):
        server_credentials(ServerTls(certs.cert_file, certs.client_key_file))
    with pytest.raises(TlsError, match=r"client certificate .*client\.crt and its key .*server\.key do not load"):
        channel_credentials(ClientTls(certs.ca_file, certs.client_cert_file, certs.key_file))
    with pytest.raises(ConfigError, match=r"^tls: server certificate .* do not load together"):
        ExtprocServer(parse_config({"endpoints": [{"address": "127.0.0.1:8000"}],
                                    "tls": {"cert_file": certs.cert_file, "key_file": certs.client_key_file}}))


async def test_a_port_in_use_is_refused_not_shared():
    """gRPC's default SO_REUSEPORT would let a second extproc start on a port in use and split its connections."""
    first = ExtprocServer(parse_config({"listen": "127.0.0.1:0", "policy": "least-requests", "drain_delay_s": 0,
                                        "health_check": {"enabled": False},
                                        "endpoints": [{"address": "127.0.0.1:8000"}]}))
    port = await first.start()
    try:
        second = ExtprocServer(parse_config({"listen": f"127.0.0.1:{port}", "policy": "least-requests",
                                             "health_check": {"enabled": False},
                                             "endpoints": [{"address": "127.0.0.1:8000"}]}))
        with pytest.raises(ConfigError, match=f"^listen: cannot listen on 127.0.0.1:{port}"):
            await second.start()
    finally:
        await first.stop()
