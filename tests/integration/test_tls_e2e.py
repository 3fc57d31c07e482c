"""TLS on every hop through the real Envoy binary (issue 14, security): client -> Envoy (plain) -> extproc over
mutual TLS (``astrolabe envoy --extproc-tls-*``, the extproc's ``tls`` section) and Envoy -> backends over HTTPS
(``--backend-tls-ca``; the extproc's health checks over HTTPS too, ``backend_tls``). Certificates by trustme.

Asserted: requests are routed and served over TLS in both body modes; an Envoy without the client certificate
(or without TLS) gets no answer from the extproc (503, fail-closed); an Envoy speaking plain HTTP to the TLS
backends gets none from them.
"""

from __future__ import annotations

import json
import sys
import time

import httpx
import pytest

from astrolabe.procs import ProcessGroup, free_port
from tests.integration.stack import Stack, poll_until
from tests.test_tls import Certs

pytestmark = [pytest.mark.envoy, pytest.mark.slow]

PY = sys.executable
MODEL = "m"


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    certs = Certs(tmp)
    with ProcessGroup() as procs:
        stack = Stack(procs, tmp, "full-duplex")
        backends = []
        for _ in range(2):
            port = free_port()
            proc = procs.start([PY, "-m", "tests.integration.echo_backend", "--port", str(port), "--tls-cert",
                                certs.cert_file, "--tls-key", certs.key_file], name=f"echo-{port}",
                               log_path=tmp / f"echo-{port}.log")
            proc.wait_tcp("127.0.0.1", port, timeout_s=20)
            backends.append(f"127.0.0.1:{port}")
        stack.write_config([{"address": a, "models": [MODEL]} for a in backends], policy="round-robin",
                           tls={"cert_file": certs.cert_file, "key_file": certs.key_file,
                                "client_ca_file": certs.ca_file},
                           backend_tls={"ca_file": certs.ca_file, "server_name": "localhost"})
        stack.start_extproc()
        yield stack, certs, backends


def _envoy(stack: Stack, mode: str, *flags: str) -> str:
    return Stack(stack.procs, stack.tmp, mode, extproc_port=stack.extproc_port).start_envoy(*flags,
                                                                                           wait_routable=False)


def _post(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", content=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                      headers={"content-type": "application/json"}, timeout=20)


def _wait_served(url: str, timeout_s: float = 20.0) -> httpx.Response:
    """The first 200 (Envoy's health check must first see the extproc over TLS), or the last answer."""
    replies = []
    poll_until(lambda: replies.append(_post(url)) or replies[-1].status_code == 200, timeout_s=timeout_s,
               what="a request served over TLS")
    return replies[-1]


@pytest.mark.parametrize("mode", ["full-duplex", "buffered"])
def test_every_hop_over_tls(tls_stack, mode):
    stack, certs, backends = tls_stack
    url = _envoy(stack, mode, "--extproc-tls-ca", certs.ca_file, "--extproc-tls-cert", certs.client_cert_file,
                 "--extproc-tls-key", certs.client_key_file, "--extproc-tls-server-name", "localhost",
                 "--backend-tls-ca", certs.ca_file, "--backend-tls-server-name", "localhost")
    _wait_served(url)
    served = set()
    for _ in range(6):
        reply = _post(url)
        assert reply.status_code == 200, reply.text[:200]
        echo = reply.json()
        assert echo["destination_header"] == echo["served_by"]
        served.add(echo["served_by"])
    assert served == set(backends)  # round robin over both, each healthy through its HTTPS health check


@pytest.mark.parametrize("flags", [
    ("--extproc-tls-ca", "{ca}", "--backend-tls-ca", "{ca}"),  # TLS to the extproc, but no client certificate
    ("--backend-tls-ca", "{ca}"),  # plaintext to the mutual-TLS extproc
    ("--extproc-tls-ca", "{ca}", "--extproc-tls-cert", "{other_cert}", "--extproc-tls-key", "{other_key}",
     "--backend-tls-ca", "{ca}"),  # a client certificate another CA signed
], ids=["no-client-cert", "plaintext", "foreign-client-cert"])
def test_an_envoy_the_extproc_does_not_trust_is_refused(tls_stack, flags):
    stack, certs, _ = tls_stack
    values = {"ca": certs.ca_file, "other_cert": certs.other_client_cert_file,
              "other_key": certs.other_client_key_file}
    url = _envoy(stack, "full-duplex", *(flag.format(**values) for flag in flags))
    deadline_s = time.monotonic() + 2.5  # Envoy health-checks the extproc every second: several checks fail
    while time.monotonic() < deadline_s:
        assert _post(url).status_code == 503  # the picker cannot be reached: fail-closed


def test_plain_http_to_tls_backends_is_not_served(tls_stack):
    stack, certs, _ = tls_stack
    url = _envoy(stack, "full-duplex", "--extproc-tls-ca", certs.ca_file, "--extproc-tls-cert",
                 certs.client_cert_file, "--extproc-tls-key", certs.client_key_file)
    reply = _wait_until_routed(url)
    assert reply.status_code in (502, 503), reply.text[:200]


def _wait_until_routed(url: str) -> httpx.Response:
    """The first answer that is not the fail-closed 503 of an extproc Envoy has not health-checked yet."""
    replies = []
    poll_until(lambda: replies.append(_post(url)) or "upstream" in replies[-1].text, timeout_s=20,
               what="a request routed")
    return replies[-1]
