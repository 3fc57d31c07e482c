"""The Endpoint Picker protocol's points through the real Envoy (gateway-api-inference-extension
docs/proposals/004-endpoint-picker-protocol): the ordered fallback list and the served endpoint, the subset hint,
and FailOpen / FailClose with a dead picker.

Envoy plays the gateway: ``astrolabe envoy --pool`` gives it the pool's endpoints and the override_host policy
(the way Istio and Envoy Gateway wire an InferencePool), which retries down the picker's list and reports the
endpoint that served; a header_to_metadata filter added to the rendered config turns a test header into the
``envoy.lb.subset_hint`` metadata a gateway sets.
"""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from astrolabe.envoy import envoy_binary
from astrolabe.procs import ProcessGroup, free_port
from tests.integration.stack import Stack

pytestmark = [pytest.mark.envoy]
PY = sys.executable
BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}

_SUBSET_FILTER = """          # (test) The gateway's subset hint, from a test header.
          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              request_rules:
              - header: x-test-subset
                on_header_present:
                  metadata_namespace: envoy.lb.subset_hint
                  key: x-gateway-destination-endpoint-subset
                  type: STRING
                remove: true
"""


def _envoy(stack: Stack, *flags: str, extproc_port: int | None = None, patch=None, mode: str = "full-duplex") -> str:
    """Renders ``astrolabe envoy --mode full-duplex FLAGS``, applies ``patch`` to the YAML, runs the real Envoy
    on it; returns its URL once its admin interface says ready."""
    port, admin = free_port(), free_port()
    rendered = subprocess.run(
        [PY, "-m", "astrolabe", "envoy", "--mode", mode, "--listen-port", str(port), "--admin-port",
         str(admin), "--extproc", f"127.0.0.1:{extproc_port or stack.extproc_port}", *flags, "--print-config"],
        capture_output=True, text=True, check=True).stdout
    if patch is not None:
        rendered = patch(rendered)
    path = stack.tmp / f"envoy-{port}.yaml"
    path.write_text(rendered)
    proc = stack.procs.start([str(envoy_binary()), "-c", str(path), "--disable-hot-restart", "--log-level",
                              "warning"], name=f"envoy-{port}", log_path=stack.tmp / f"envoy-{port}.log")
    proc.wait_http(f"http://127.0.0.1:{admin}/ready", timeout_s=20)
    stack.envoy_url = f"http://127.0.0.1:{port}"
    return stack.envoy_url


def _with_subset_filter(rendered: str) -> str:
    marker = "          # (2) The endpoint picker.\n"
    assert marker in rendered
    return rendered.replace(marker, _SUBSET_FILTER + marker)


def _all_served_by(url: str, backend: str, n: int) -> list[str]:
    """Sends ``n`` completions; each must succeed at ``backend``; returns the destination header each carried."""
    lists = []
    for _ in range(n):
        response = httpx.post(f"{url}/v1/completions", json=BODY, timeout=10)
        assert response.status_code == 200, response.text
        assert response.json()["served_by"] == backend
        lists.append(response.json()["destination_header"])
    return lists


def _closed_port() -> str:
    """An ip:port nothing listens on."""
    return f"127.0.0.1:{free_port()}"


def test_the_fallback_list_is_tried_in_order_and_the_served_endpoint_moves_the_count(tmp_path):
    """Round robin over [dead, alive] with one fallback: every other request lists the dead endpoint first; Envoy
    cannot connect, retries the list's next endpoint, and reports it as served; the extproc moves its in-flight
    count there (every count is back at 0 at the end, and the served-elsewhere counter says how often)."""
    with ProcessGroup() as procs:
        stack = Stack(procs, tmp_path, "full-duplex")
        alive, dead = stack.start_echo(), _closed_port()
        stack.write_config([{"address": dead}, {"address": alive}], policy="round-robin", fallback_endpoints=1,
                           health_check={"enabled": False})
        stack.start_extproc()
        url = _envoy(stack, "--pool", f"{dead},{alive}")
        stack.wait_routable()
        before = stack.metric("astrolabe_extproc_served_elsewhere_total")  # the readiness GETs count too
        lists = _all_served_by(url, alive, 10)
        assert set(lists) == {f"{dead},{alive}", f"{alive},{dead}"}
        dead_first = lists.count(f"{dead},{alive}")
        deadline = time.monotonic() + 5
        while stack.metric("astrolabe_extproc_served_elsewhere_total") - before < dead_first \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stack.metric("astrolabe_extproc_served_elsewhere_total") - before == dead_first
        while (stack.in_flight(alive) or stack.in_flight(dead)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stack.in_flight(alive) == 0 and stack.in_flight(dead) == 0


def test_the_subset_hint_restricts_the_choice_and_an_ineligible_one_is_503(tmp_path):
    with ProcessGroup() as procs:
        stack = Stack(procs, tmp_path, "full-duplex")
        first, second = stack.start_echo(), stack.start_echo()
        stack.write_config([{"address": first}, {"address": second}], policy="round-robin")
        stack.start_extproc()
        url = _envoy(stack, patch=_with_subset_filter)
        stack.wait_routable()
        served = {httpx.post(f"{url}/v1/completions", json=BODY, timeout=10).json()["served_by"] for _ in range(6)}
        assert served == {first, second}
        for _ in range(6):
            response = httpx.post(f"{url}/v1/completions", json=BODY, headers={"x-test-subset": second}, timeout=10)
            assert response.status_code == 200 and response.json()["served_by"] == second
        both = httpx.post(f"{url}/v1/completions", json=BODY, headers={"x-test-subset": f"{first}, {second}"},
                          timeout=10)
        assert both.status_code == 200 and both.json()["served_by"] in (first, second)
        for hint in ("10.9.9.9:8000", "not-an-endpoint"):
            refused = httpx.post(f"{url}/v1/completions", json=BODY, headers={"x-test-subset": hint}, timeout=10)
            assert refused.status_code == 503, refused.text
            assert "subset hint" in refused.json()["error"]["message"]


@pytest.mark.parametrize("mode, failure_mode, pool, statuses", [
    ("full-duplex", "closed", False, (503, 503)),  # FailClose: Envoy's status_on_error
    ("buffered", "closed", False, (503, 503)),
    # FailOpen, FULL_DUPLEX_STREAMED (the Inference Extension's mode): Envoy 1.40 fails open only a request
    # without a body; one with a body gets status_on_error (`ext_proc_error_gRPC_error_14`), pool or not.
    ("full-duplex", "open", True, (503, 200)),
    ("buffered", "open", True, (200, 200)),        # FailOpen, BUFFERED: the pool's least-request picks
    ("full-duplex", "open", False, (503, 503)),    # FailOpen on ORIGINAL_DST: no header, no host
    ("buffered", "open", False, (503, 503)),
], ids=["fail-close-full-duplex", "fail-close-buffered", "fail-open-pool-full-duplex", "fail-open-pool-buffered",
        "fail-open-original-dst-full-duplex", "fail-open-original-dst-buffered"])
def test_a_dead_picker_with_each_failure_mode(tmp_path, mode, failure_mode, pool, statuses):
    """(POST with a body, GET without one) to Envoy whose picker is not running: never a 500."""
    with ProcessGroup() as procs:
        stack = Stack(procs, tmp_path, mode)
        backend = stack.start_echo()
        flags = ["--failure-mode", failure_mode, *(["--pool", backend] if pool else [])]
        url = _envoy(stack, *flags, extproc_port=free_port(), mode=mode)  # no picker listens there
        got = (httpx.post(f"{url}/v1/completions", json=BODY, timeout=10), httpx.get(f"{url}/v1/models", timeout=10))
        assert tuple(r.status_code for r in got) == statuses, [r.text for r in got]
        for response in got:
            if response.status_code == 200:
                assert response.json()["served_by"] == backend
                assert response.json()["destination_header"] is None  # no picker, no header: Envoy chose


def test_a_backend_that_dies_stops_getting_requests_at_once(tmp_path):
    """A backend that dies between two active health checks (30 s apart here) attracted traffic until the check
    noticed (issue 14: 381 of 1,000 requests got 503 in 2.6 s), since its in-flight count falls to 0. With the
    pool known to Envoy and one fallback listed, the first request it fails is served by the fallback, the
    gateway reports that, and the picker takes the dead endpoint out of the pool at once: no request is lost and
    no later request lists it first."""
    with ProcessGroup() as procs:
        stack = Stack(procs, tmp_path, "full-duplex")
        doomed, alive = stack.start_echo(), stack.start_echo()
        stack.write_config([{"address": doomed}, {"address": alive}], policy="least-requests", fallback_endpoints=1,
                           health_check={"interval_s": 30.0, "timeout_s": 1.0, "unhealthy_threshold": 2})
        stack.start_extproc()
        url = _envoy(stack, "--pool", f"{doomed},{alive}")
        stack.wait_routable()
        stack.backends[doomed].stop()  # dies after passing its check; the next one is 30 s away
        lists = _all_served_by(url, alive, 20)
        first_failed = next(i for i, value in enumerate(lists) if value.startswith(doomed))
        assert all(value.startswith(alive) for value in lists[first_failed + 1:]), lists
        assert stack.metric(f'astrolabe_extproc_endpoint_healthy{{endpoint="{doomed}"}}') == 0
