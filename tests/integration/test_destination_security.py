"""A client-supplied destination never steers traffic (issue 14, security), through the real Envoy binary.

Every combination of the Envoy configs (ORIGINAL_DST on the header, and ``--pool``: the override_host policy),
both body modes, both failure modes, with the extproc up and with it down (Envoy pointed at a port where nothing
listens). The client names a destination in ``x-gateway-destination-endpoint`` (an echo backend outside what the
extproc would choose) and in ``x-gateway-destination-endpoint-subset``. Asserted at the backend (the echo backends
report what reached them): no response comes from the client's choice, and the destination header a backend
sees is the extproc's or none, never the client's. With the extproc down a request is refused (503) unless
FailOpen lets Envoy's own least-request pick inside the pool
(buffered mode, or a request without a body: Envoy 1.40 fails open nothing else in full-duplex mode).
"""

from __future__ import annotations

import itertools
import json
import sys

import httpx
import pytest

from astrolabe.procs import ProcessGroup, ProcessStartError, free_port
from tests.integration.stack import Stack

pytestmark = [pytest.mark.envoy, pytest.mark.slow]

PY = sys.executable
MODEL = "m"
NUM_REQUESTS = 6
COMBINATIONS = list(itertools.product(("original-dst", "pool"), ("buffered", "full-duplex"), ("closed", "open"),
                                      ("up", "down")))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """3 echo backends (the pool), one more outside it, the extproc choosing only the first; an Envoy per
    combination, all started at once."""
    with ProcessGroup() as procs:
        tmp = tmp_path_factory.mktemp("destination")
        stack = Stack(procs, tmp, "full-duplex")
        pool = [stack.start_echo() for _ in range(3)]
        outsider = stack.start_echo()
        stack.write_config([{"address": pool[0], "models": [MODEL]}], policy="round-robin")
        stack.start_extproc()
        dead_extproc = f"127.0.0.1:{free_port()}"
        envoys = {}

        def start(combination, attempt):
            cluster, mode, failure, extproc = combination
            port, admin = free_port(), free_port()
            args = [PY, "-m", "astrolabe", "envoy", "--mode", mode, "--listen-port", str(port), "--admin-port",
                    str(admin), "--failure-mode", failure, "--extproc",
                    f"127.0.0.1:{stack.extproc_port}" if extproc == "up" else dead_extproc]
            if cluster == "pool":
                args += ["--pool", ",".join(pool)]
            name = f"envoy-{'-'.join(combination)}-{attempt}"
            envoys[combination] = f"http://127.0.0.1:{port}"
            return procs.start(args, name=name, log_path=tmp / f"{name}.log"), admin

        # All at once; one whose free port was taken meanwhile (16 start together) is started again on others.
        starting = {combination: start(combination, 0) for combination in COMBINATIONS}
        for combination, (proc, admin) in starting.items():
            for attempt in range(1, 4):
                try:
                    proc.wait_http(f"http://127.0.0.1:{admin}/ready", timeout_s=60)
                    break
                except ProcessStartError:
                    if attempt == 3:
                        raise
                    proc, admin = start(combination, attempt)
        for key, url in envoys.items():
            if key[3] == "up":
                Stack(procs, tmp, key[1], envoy_url=url).wait_routable(timeout_s=30)
        yield {"pool": pool, "outsider": outsider, "envoys": envoys}


@pytest.mark.parametrize("cluster, mode, failure, extproc", COMBINATIONS,
                         ids=["-".join(c) for c in COMBINATIONS])
def test_client_destination_never_steers(fleet, cluster, mode, failure, extproc):
    url = fleet["envoys"][cluster, mode, failure, extproc]
    pool, outsider = fleet["pool"], fleet["outsider"]
    # The client names the outsider, then a pool endpoint the extproc would not choose.
    for target in (outsider, pool[1]):
        steer = {"x-gateway-destination-endpoint": target, "x-gateway-destination-endpoint-subset": target,
                 "content-type": "application/json"}
        for method in ("POST", "GET"):
            # Served: by the extproc's choice, or (FailOpen through --pool) by Envoy's least-request, which Envoy
            # 1.40 applies in full-duplex mode only to a request without a body (envoy/README.md).
            served = extproc == "up" or (cluster, failure) == ("pool", "open") and (mode, method) != ("full-duplex",
                                                                                                       "POST")
            content = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}) if method == "POST" else None
            for _ in range(NUM_REQUESTS):
                reply = httpx.request(method, f"{url}/v1/completions", headers=steer, content=content, timeout=20)
                if not served:  # refused, never sent where the client asked: the picker's 503, or Envoy's (no host)
                    assert reply.status_code == 503, (reply.status_code, reply.text[:200])
                    continue
                assert reply.status_code == 200, reply.text[:200]
                echo = reply.json()
                assert echo["served_by"] != outsider
                if extproc == "up":  # the extproc chose, as it always does here
                    assert echo["served_by"] == pool[0]
                    assert (echo["destination_header"] or "").split(",")[0] == pool[0]
                else:  # Envoy's least-request chose; the client's header never reached the backend
                    assert echo["served_by"] in pool and echo["destination_header"] is None
