"""Endpoint discovery end to end: the real extproc process with no endpoint list behind the real Envoy, fed by a
DNS server on loopback (the records of a headless Service) or by a loopback Kubernetes API that serves real
list/watch responses to the real client library (no API server can run here: tests/extproc/discovery/kube_api.py).
Pods that appear get traffic and pods that go away stop getting it, with no config edit."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from astrolabe.procs import ProcessGroup, free_port
from tests.extproc.discovery.dns_server import DnsTestServer
from tests.extproc.discovery.kube_api import FakeKubeApi
from tests.extproc.discovery.test_kubernetes import NS, POOL, inference_pool, pod, write_kubeconfig
from tests.integration.loop_thread import LoopThread
from tests.integration.stack import Stack

pytestmark = [pytest.mark.envoy]
NAME = "vllm.astrolabe.svc.cluster.local."
BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}
PODS = ("127.0.0.2", "127.0.0.3")  # two "pods" on one port, as behind a Service


def _pods(procs: ProcessGroup, stack: Stack, port: int) -> dict[str, str]:
    """Echo backends on 127.0.0.2 and 127.0.0.3, the same port; pod IP -> ip:port."""
    backends = {}
    for ip in PODS:
        proc = procs.start([sys.executable, "-m", "tests.integration.echo_backend", "--host", ip, "--port", str(port)],
                           name=f"echo-{ip}", log_path=stack.tmp / f"echo-{ip}.log")
        proc.wait_http(f"http://{ip}:{port}/health", timeout_s=20)
        backends[ip] = f"{ip}:{port}"
    return backends


def _write(stack: Stack, discovery: dict) -> None:
    """The extproc's config with ``discovery`` and no ``endpoints`` key at all."""
    stack.write_config([], policy="least-requests", discovery=discovery)
    config = json.loads(stack.config_path.read_text())
    del config["endpoints"]
    stack.config_path.write_text(json.dumps(config))


def _start(stack: Stack, discovery: dict) -> str:
    """The extproc with ``discovery`` and no ``endpoints`` key, then Envoy; returns Envoy's URL."""
    _write(stack, discovery)
    stack.start_extproc()
    return stack.start_envoy()


def _served(url: str, n: int) -> set[str]:
    counts = Counter()
    for _ in range(n):
        response = httpx.post(f"{url}/v1/completions", json=BODY, timeout=10)
        assert response.status_code == 200, response.text
        counts[response.json()["served_by"]] += 1
    return set(counts)


def _until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def _status(url: str) -> int:
    return httpx.post(f"{url}/v1/completions", json=BODY, timeout=10).status_code


def test_dns_discovery_follows_the_headless_service(tmp_path):
    port = free_port()
    with LoopThread() as loop:
        dns = DnsTestServer()
        loop.run(dns.start())
        try:
            with ProcessGroup() as procs:
                def set_a(*ips: str) -> None:
                    loop.call(lambda: dns.set(NAME, "A", ips) if ips else dns.delete(NAME))

                stack = Stack(procs, tmp_path, "full-duplex")
                backends = _pods(procs, stack, port)
                set_a(PODS[0])
                url = _start(stack, {"source": "dns", "dns_name": NAME, "dns_nameservers": [dns.address],
                                     "dns_interval_s": 0.2, "target_ports": [port], "predictor_port": None})
                assert _served(url, 6) == {backends[PODS[0]]}
                set_a(*PODS)  # a pod became ready
                _until(lambda: _served(url, 6) == set(backends.values()))
                set_a(PODS[1])  # the first went away
                _until(lambda: _served(url, 4) == {backends[PODS[1]]})
                assert _served(url, 10) == {backends[PODS[1]]}
                set_a()  # NXDOMAIN: no ready pod
                _until(lambda: _status(url) == 503)
                log = (tmp_path / "extproc.log").read_text()
                assert "no records" in log and "endpoints now" in log
        finally:
            loop.run(dns.close())


def test_kubernetes_discovery_follows_the_inference_pool(tmp_path):
    """The Inference Extension's way: the picker is told only the InferencePool's name; the pool's selector and
    targetPorts, and the readiness of the pods it selects, decide the endpoints."""
    port = free_port()
    with LoopThread() as loop:
        api = loop.call(FakeKubeApi)
        loop.run(api.start())
        try:
            with ProcessGroup() as procs:
                stack = Stack(procs, tmp_path, "full-duplex")
                backends = _pods(procs, stack, port)
                loop.call(lambda: api.put("inferencepools", inference_pool({"app": "vllm"}, [port])))
                loop.call(lambda: api.put("pods", pod("vllm-0", PODS[0])))
                loop.call(lambda: api.put("pods", pod("vllm-1", PODS[1], ready=False)))
                kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
                url = _start(stack, {"source": "kubernetes", "kubeconfig": str(kubeconfig), "namespace": NS,
                                     "inference_pool": POOL, "predictor_port": None, "timeout_s": 2.0})
                assert _served(url, 6) == {backends[PODS[0]]}  # the unready pod gets nothing
                loop.call(lambda: api.put("pods", pod("vllm-1", PODS[1])))  # it became ready: a watch event
                _until(lambda: _served(url, 6) == set(backends.values()))
                loop.call(lambda: api.delete("pods", "vllm-0", NS))  # scaled down
                _until(lambda: _served(url, 4) == {backends[PODS[1]]})
                assert _served(url, 10) == {backends[PODS[1]]}
                # The pool's selector now matches no pod: every request 503 until pods match again.
                loop.call(lambda: api.put("inferencepools", inference_pool({"app": "other"}, [port])))
                _until(lambda: _status(url) == 503)
                assert api.watch_count("pods") >= 1 and api.watch_count("inferencepools") >= 1
        finally:
            loop.run(api.stop())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_picker_still_waiting_for_its_first_list_stops_cleanly(tmp_path, sig):
    """No answer from discovery (a DNS server that is not there): readiness stays NOT_SERVING; a SIGTERM (the
    kubelet giving up on the pod) or Ctrl-C then ends the process at once, with status 0 and no traceback."""
    with ProcessGroup() as procs:
        stack = Stack(procs, tmp_path, "full-duplex")
        _write(stack, {"source": "dns", "dns_name": NAME, "dns_nameservers": [f"127.0.0.1:{free_port()}"],
                       "timeout_s": 0.2})
        proc = procs.start([sys.executable, "-m", "astrolabe", "extproc", "--config", str(stack.config_path)],
                           name="extproc", log_path=tmp_path / "extproc.log")
        proc.wait_tcp("127.0.0.1", stack.extproc_port, timeout_s=20)
        channel = grpc.insecure_channel(f"127.0.0.1:{stack.extproc_port}")
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="readiness"),
                                                           timeout=5).status
        channel.close()
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        os.kill(proc.pid, sig)
        assert proc.wait(timeout_s=10) == 0
        log = (tmp_path / "extproc.log").read_text()
        assert "not ready until the first endpoint list" in log and "before the extproc was ready" in log
        assert "Traceback" not in log
