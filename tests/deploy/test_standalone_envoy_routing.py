"""overlays/standalone-envoy's routing when Envoy's DNS lags behind the picker's discovery, with the real Envoy.

In that overlay the picker learns the vLLM pods from its Kubernetes watch (at once) and Envoy from the headless
Service's DNS records (its `backends` cluster, STRICT_DNS, re-resolved every 5 s): for a few seconds after a pod
becomes Ready the picker may name a pod that Envoy does not know yet. deploy/kubernetes/README.md says what
happens then; this checks it on loopback, with `astrolabe envoy --pool` given only the endpoints "already
resolved" (IP literals: a STATIC cluster, the same override_host policy): the unknown endpoint is skipped and
the request is served, by the next listed endpoint (the overlay lists one fallback), where the picker then counts
it, or by Envoy's least-request when no listed endpoint is known (the picker ignores a served endpoint it did not
list: its count stays on its choice until the request ends; not checked here).
"""

from __future__ import annotations

import time

import httpx
import pytest

from astrolabe.procs import ProcessGroup
from tests.integration.stack import Stack

pytestmark = [pytest.mark.envoy]
BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}


def _standalone_fallback_endpoints() -> int:
    from tests.deploy.test_kubernetes_manifests import _extproc_config, build

    config, _, _ = _extproc_config(build("overlays/standalone-envoy"))
    return config.fallback_endpoints


@pytest.mark.parametrize("fallbacks", [0, _standalone_fallback_endpoints()], ids=["no-fallback", "overlay"])
def test_a_pod_envoy_does_not_know_yet_is_skipped(tmp_path, fallbacks):
    with ProcessGroup() as procs:
        stack = Stack(procs, tmp_path, "full-duplex")
        known, not_yet = stack.start_echo(), stack.start_echo()
        stack.write_config([{"address": known}, {"address": not_yet}], policy="round-robin",
                           fallback_endpoints=fallbacks, health_check={"enabled": False})
        stack.start_extproc()
        stack.start_envoy("--pool", known, "--failure-mode", "closed")
        before = stack.metric("astrolabe_extproc_served_elsewhere_total")  # the readiness GETs count too
        firsts = []
        for _ in range(8):
            response = httpx.post(f"{stack.envoy_url}/v1/completions", json=BODY, timeout=10)
            assert response.status_code == 200, response.text
            assert response.json()["served_by"] == known
            header = response.json()["destination_header"].split(",")
            assert len(header) == 1 + fallbacks
            firsts.append(header[0])
        assert set(firsts) == {known, not_yet}  # the picker did name the pod Envoy does not know
        if not fallbacks:
            return
        deadline = time.monotonic() + 5
        while (stack.metric("astrolabe_extproc_served_elsewhere_total") - before < firsts.count(not_yet)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert stack.metric("astrolabe_extproc_served_elsewhere_total") - before == firsts.count(not_yet)
        while (stack.in_flight(known) or stack.in_flight(not_yet)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stack.in_flight(known) == 0 and stack.in_flight(not_yet) == 0
