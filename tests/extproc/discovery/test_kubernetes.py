"""Kubernetes endpoint discovery (extproc/discovery/kubernetes.py) against a fake API server.

No real Kubernetes API server runs here. ``kube_api.FakeKubeApi`` serves the real REST paths and list/watch
semantics on 127.0.0.1 (resourceVersions, selectors, chunked watch streams, bookmarks, 410 Expired, timeouts);
the source reaches it through the real client library, configured from a kubeconfig file each test writes (a
server URL and a bearer token the fake checks). Every pod the fake serves is checked against Kubernetes' own
schema (``kubernetes-validate``, strict) and every InferencePool against its CRD's schema
(tests/deploy/crd_schemas/inferencepool-v1.json, unknown fields rejected), so the objects have the real shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import socket
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.watch import watch as kubernetes_watch

from extproc.config import ConfigError, DiscoveryConfig, EndpointConfig
from extproc.discovery import build_source
from extproc.discovery import kubernetes as kubernetes_source
from extproc.discovery.kubernetes import KubernetesSource
from tests.deploy.test_kubernetes_manifests import _strict as strict_crd_schema
from tests.extproc.discovery.kube_api import FakeKubeApi, parse_bool

kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

NS = "llm"
POOL = "astrolabe-vllm"
MODELS = ("llama-2-7b",)
KUBERNETES_VERSION = "1.37.0"
CRD_SCHEMA = Path(__file__).resolve().parents[2] / "deploy" / "crd_schemas" / "inferencepool-v1.json"
TIMESTAMP = "2025-06-01T12:00:05Z"
LOGGER = "extproc.discovery.kubernetes"


# ---------------------------------------------------------------------------------------------------------------
# Object shapes and their schemas


POOL_SCHEMA = jsonschema.Draft7Validator(strict_crd_schema(json.loads(CRD_SCHEMA.read_text())))


def validate_object(obj: dict[str, Any]) -> None:
    if (obj["apiVersion"], obj["kind"]) == ("v1", "Pod"):
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    elif (obj["apiVersion"], obj["kind"]) == ("inference.networking.k8s.io/v1", "InferencePool"):
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in POOL_SCHEMA.iter_errors(obj)]
        assert not errors, f"InferencePool {obj['metadata']['name']}: {errors}"
        ports = [p["number"] for p in obj["spec"]["targetPorts"]]
        assert len(set(ports)) == len(ports), "CEL rule: port number must be unique"
    else:
        raise AssertionError(f"unexpected object {obj['apiVersion']} {obj['kind']}")


def pod(name: str, ip: str | None = "10.0.0.1", *, ready: bool = True, phase: str = "Running",
        labels: dict[str, str] | None = None, deleting: bool = False, predictor: str | None = "sidecar",
        predictor_port: int = 9100, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod as the API server returns it: vLLM, plus the predictor as a native sidecar ("sidecar"), as a
    regular container ("container") or absent (None)."""
    port = {"name": "grpc-predictor", "containerPort": predictor_port, "protocol": "TCP"}
    spec: dict[str, Any] = {
        "nodeName": "node-1",
        "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
                        "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]}],
    }
    if predictor == "sidecar":
        spec["initContainers"] = [{"name": "predictor", "image": "astrolabe-predictor", "restartPolicy": "Always",
                                   "ports": [port]}]
    elif predictor == "container":
        spec["containers"].append({"name": "predictor", "image": "astrolabe-predictor", "ports": [port]})
    scheduled = phase != "Pending" or ip is not None
    conditions = [{"type": "PodScheduled", "status": "True" if scheduled else "False",
                   "lastTransitionTime": TIMESTAMP}]
    if phase != "Pending":
        conditions += [{"type": t, "status": "True" if ready or t == "Initialized" else "False",
                        "lastTransitionTime": TIMESTAMP} for t in ("Initialized", "ContainersReady", "Ready")]
    status: dict[str, Any] = {"phase": phase, "conditions": conditions, "qosClass": "BestEffort"}
    if ip is not None:
        status |= {"podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "192.168.0.10", "startTime": TIMESTAMP}
    metadata: dict[str, Any] = {"name": name, "namespace": NS, "labels": labels or {"app": "vllm"}}
    if annotations:
        metadata["annotations"] = annotations
    if deleting:
        metadata |= {"deletionTimestamp": TIMESTAMP, "deletionGracePeriodSeconds": 30}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec, "status": status}


def inference_pool(match_labels: dict[str, str], ports: list[int], name: str = POOL) -> dict[str, Any]:
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": NS, "generation": 1},
            "spec": {"selector": {"matchLabels": match_labels}, "targetPorts": [{"number": p} for p in ports],
                     "endpointPickerRef": {"name": "astrolabe-extproc", "port": {"number": 9002},
                                           "failureMode": "FailClose"}}}


def endpoint(ip: str, port: int = 8000, predictor: int | None = 9100) -> EndpointConfig:
    def address(p: int) -> str:
        return f"[{ip}]:{p}" if ":" in ip else f"{ip}:{p}"

    return EndpointConfig(address=address(port), models=MODELS,
                          predictor=address(predictor) if predictor is not None else None)


# ---------------------------------------------------------------------------------------------------------------
# Fixtures and helpers


@pytest.fixture(autouse=True)
def _environment(monkeypatch, caplog):
    """No cluster or proxy settings from the environment; every API client the source opens must be closed."""
    for name in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "KUBECONFIG", "HTTP_PROXY", "HTTPS_PROXY",
                 "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    caplog.set_level(logging.INFO, logger=LOGGER)
    clients: list[ApiClient] = []

    class TrackedApiClient(ApiClient):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            clients.append(self)

    # The source's own client and the one each kubernetes_asyncio Watch makes (to deserialize events).
    monkeypatch.setattr(kubernetes_source, "ApiClient", TrackedApiClient)
    monkeypatch.setattr(kubernetes_watch, "ApiClient", TrackedApiClient)
    yield
    assert all(c.rest_client.pool_manager.closed for c in clients), "an ApiClient was left open"
    gc.collect()
    leaks = [r.getMessage() for r in caplog.records if "Unclosed" in r.getMessage()
             or (r.name == "asyncio" and r.levelno >= logging.ERROR)]
    assert not leaks, leaks


@pytest.fixture
async def api():
    list_errors: list[str] = []

    def validate_list(body: dict[str, Any]) -> None:
        try:
            if body["kind"] == "PodList":
                kubernetes_validate.validate(body, KUBERNETES_VERSION, strict=True)
            else:
                for item in body["items"]:
                    validate_object(item)
        except Exception as exc:  # noqa: BLE001 (reported at teardown; raising here would only give a 500)
            list_errors.append(f"{body['kind']}: {exc}")

    fake = FakeKubeApi(validate=validate_object, validate_list=validate_list)
    await fake.start()
    yield fake
    await fake.stop()
    assert not list_errors, list_errors


def write_kubeconfig(path: Path, server: str, token: str = "test-token") -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "extproc", "user": {"token": token}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "extproc", "namespace": NS}}],
    }))
    return path


@pytest.fixture
def kubeconfig(tmp_path, api) -> Path:
    return write_kubeconfig(tmp_path / "kubeconfig", api.url)


def make_config(kubeconfig: Path | None, **changes: Any) -> DiscoveryConfig:
    values: dict[str, Any] = {"source": "kubernetes", "namespace": NS, "label_selector": "app=vllm",
                              "models": MODELS, "kubeconfig": str(kubeconfig) if kubeconfig else None,
                              "resync_interval_s": 300.0,
                              "timeout_s": 1.0}
    values |= changes
    if "inference_pool" in changes:
        values.pop("label_selector")
    return DiscoveryConfig(**values)


def make_source(config: DiscoveryConfig, **kwargs: Any) -> KubernetesSource:
    return KubernetesSource(config, min_retry_s=0.05, max_retry_s=0.2, **kwargs)


class Published:
    """The lists a source published, in order."""

    def __init__(self) -> None:
        self.lists: list[tuple[EndpointConfig, ...]] = []

    def __call__(self, endpoints: tuple[EndpointConfig, ...]) -> None:
        assert isinstance(endpoints, tuple)
        assert list(endpoints) == sorted(endpoints, key=lambda e: e.address)
        if self.lists:
            assert endpoints != self.lists[-1], "published an unchanged list"
        self.lists.append(endpoints)

    @property
    def last(self) -> tuple[EndpointConfig, ...] | None:
        return self.lists[-1] if self.lists else None

    async def until(self, expected: tuple[EndpointConfig, ...] | list[EndpointConfig],
                    timeout_s: float = 5.0) -> None:
        expected = tuple(expected)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.last != expected:
            if asyncio.get_running_loop().time() > deadline:
                pytest.fail(f"expected {expected}, last published {self.last} ({len(self.lists)} lists)")
            await asyncio.sleep(0.01)


async def eventually(predicate, timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(source: KubernetesSource, published: Published):
    task = asyncio.create_task(source.run(published), name="test-discovery")
    try:
        yield task
    finally:
        assert not task.done(), f"run() ended: {task.exception() if not task.cancelled() else 'cancelled'}"
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        left = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("discovery")]
        assert not left, f"tasks left running: {left}"


def warnings_with(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


# ---------------------------------------------------------------------------------------------------------------
# Label selector: first sync, watch events


async def test_first_sync_publishes_ready_pods_only(api, kubeconfig, caplog):
    api.put("pods", pod("vllm-a", "10.0.0.9"))
    api.put("pods", pod("vllm-b", "10.0.0.10"))
    api.put("pods", pod("not-ready", "10.0.0.3", ready=False))
    api.put("pods", pod("pending", None, phase="Pending", ready=False))
    api.put("pods", pod("terminating", "10.0.0.5", deleting=True))
    api.put("pods", pod("no-ip", None))
    api.put("pods", pod("failed", "10.0.0.7", phase="Failed"))  # evicted; its Ready condition is stale
    api.put("pods", pod("other-app", "10.0.0.8", labels={"app": "other"}))
    published = Published()
    async with running(make_source(make_config(kubeconfig)), published):
        await published.until([endpoint("10.0.0.10"), endpoint("10.0.0.9")])
        await eventually(lambda: api.watch_count() >= 1, what="the watch")
        await asyncio.sleep(0.1)
    assert len(published.lists) == 1
    listed, watched = api.calls[0], next(c for c in api.calls if c.watch)
    assert (listed.resource, listed.namespace, listed.query.get("labelSelector")) == ("pods", NS, "app=vllm")
    assert "watch" not in listed.query
    # The watch starts at the list's resourceVersion (nothing changed in between), with bookmarks.
    assert watched.query["resourceVersion"] == str(api.resource_version)
    assert parse_bool(watched.query["allowWatchBookmarks"])
    assert watched.query["labelSelector"] == "app=vllm"
    assert watched.query["timeoutSeconds"] == "300"
    assert any("discovered 2 endpoints" in r.getMessage() and "10.0.0.9:8000" in r.getMessage()
               for r in caplog.records)


async def test_pods_becoming_ready_unready_and_deleted_update_the_list(api, kubeconfig, caplog):
    api.put("pods", pod("vllm-a", "10.0.0.1"))
    api.put("pods", pod("vllm-b", "10.0.0.2", ready=False))
    published = Published()
    async with running(make_source(make_config(kubeconfig)), published):
        await published.until([endpoint("10.0.0.1")])
        api.put("pods", pod("vllm-b", "10.0.0.2"))
        await published.until([endpoint("10.0.0.1"), endpoint("10.0.0.2")])
        assert any("endpoints now 2" in r.getMessage() and "added 10.0.0.2:8000" in r.getMessage()
                   for r in caplog.records)
        api.put("pods", pod("vllm-a", "10.0.0.1", ready=False))
        await published.until([endpoint("10.0.0.2")])
        assert any("endpoints now 1" in r.getMessage() and "removed 10.0.0.1:8000" in r.getMessage()
                   for r in caplog.records)
        # A change that does not touch the endpoints publishes nothing.
        count = len(published.lists)
        api.put("pods", pod("vllm-b", "10.0.0.2", annotations={"note": "x"}))
        await asyncio.sleep(0.2)
        assert len(published.lists) == count
        # Graceful deletion: the pod leaves as soon as it is terminating, then disappears.
        api.put("pods", pod("vllm-b", "10.0.0.2", deleting=True))
        await published.until([])
        api.delete("pods", "vllm-b", NS)
        api.put("pods", pod("vllm-c", "10.0.0.3"))
        await published.until([endpoint("10.0.0.3")])
        # A pod relabelled out of the selector is gone (the watch sends DELETED for it).
        api.put("pods", pod("vllm-c", "10.0.0.3", labels={"app": "retired"}))
        await published.until([])
        api.put("pods", pod("vllm-d", "10.0.0.4"))
        await published.until([endpoint("10.0.0.4")])
        api.delete("pods", "vllm-d", NS)
        await published.until([])
    assert api.list_count() == 1  # all of it came from the one watch


async def test_watch_410_expired_relists(api, kubeconfig, caplog):
    api.put("pods", pod("vllm-a", "10.0.0.1"))
    published = Published()
    async with running(make_source(make_config(kubeconfig)), published):
        await published.until([endpoint("10.0.0.1")])
        await eventually(lambda: api.watch_count() == 1, what="the watch")
        # The watch stalls while pods change and the history is compacted past the client's resourceVersion.
        api.stall_watches = True
        api.put("pods", pod("vllm-b", "10.0.0.2"))
        api.delete("pods", "vllm-a", NS)
        api.compact()
        api.end_watches()
        api.stall_watches = False
        await published.until([endpoint("10.0.0.2")])
    assert api.expired_sent == 1
    assert api.list_count() == 2
    assert published.lists == [(endpoint("10.0.0.1"),), (endpoint("10.0.0.2"),)]
    assert any("410" in r.getMessage() and "too old resource version" in r.getMessage() for r in caplog.records)


async def test_watch_closed_by_server_resumes_from_last_rv(api, kubeconfig):
    api.put("pods", pod("vllm-a", "10.0.0.1"))
    api.watch_cap_s = 0.2  # the server ends each watch after this, whatever timeoutSeconds says
    published = Published()
    async with running(make_source(make_config(kubeconfig)), published):
        await published.until([endpoint("10.0.0.1")])
        expected = [endpoint("10.0.0.1")]
        for i in range(2, 5):
            await eventually(lambda n=i: api.watch_count() >= n - 1, what="a watch")
            seen_rv, opened = api.resource_version, api.watch_count()
            # The watch ends; the change comes while no watch is open and must arrive on the next one.
            api.end_watches()
            api.put("pods", pod(f"vllm-{i}", f"10.0.0.{i}"))
            expected.append(endpoint(f"10.0.0.{i}"))
            await published.until(sorted(expected, key=lambda e: e.address))
            resumed = [c for c in api.calls if c.watch][opened]
            assert resumed.query["resourceVersion"] == str(seen_rv)
        await asyncio.sleep(0.5)  # two more watches cut by the server's cap
    watch_rvs = [int(c.query["resourceVersion"]) for c in api.calls if c.watch]
    assert len(watch_rvs) >= 5 and watch_rvs == sorted(watch_rvs)
    assert api.list_count() == 1 and api.expired_sent == 0


async def test_bookmarks_advance_the_resource_version(api, kubeconfig):
    api.put("pods", pod("vllm-a", "10.0.0.1"))
    published = Published()
    async with running(make_source(make_config(kubeconfig)), published):
        await published.until([endpoint("10.0.0.1")])
        await eventually(lambda: api.watch_count() == 1, what="the watch")
        list_rv = int(api.calls[-1].query["resourceVersion"])
        # Changes the watch does not match move the resourceVersion on; only a bookmark tells the client.
        for i in range(3):
            api.put("pods", pod(f"other-{i}", f"10.0.1.{i}", labels={"app": "other"}))
        api.bookmark_interval_s = 0.05
        api.end_watches()  # the next watch asks for bookmarks at this interval
        await eventually(lambda: api.bookmarks_sent and api.bookmarks_sent[-1] == api.resource_version,
                         what="a bookmark at the latest resourceVersion")
        api.compact()  # a client still at the list's resourceVersion would now get 410
        api.end_watches()
        await eventually(lambda: api.watch_count() >= 3, what="the third watch")
        await asyncio.sleep(0.1)
    assert int(api.calls[-1].query["resourceVersion"]) == api.resource_version > list_rv
    assert api.expired_sent == 0 and api.list_count() == 1
    assert published.lists == [(endpoint("10.0.0.1"),)]


async def test_periodic_resync_relists_and_repairs_a_stalled_watch(api, kubeconfig):
    api.put("pods", pod("vllm-a", "10.0.0.1"))
    published = Published()
    async with running(make_source(make_config(kubeconfig, resync_interval_s=1.0)), published):
        await published.until([endpoint("10.0.0.1")])
        api.stall_watches = True  # the change below only reaches the client by the next relist
        api.put("pods", pod("vllm-b", "10.0.0.2"))
        await asyncio.sleep(0.3)
        assert published.last == (endpoint("10.0.0.1"),)
        await published.until([endpoint("10.0.0.1"), endpoint("10.0.0.2")], timeout_s=3.0)
        assert api.list_count() == 2
    watches = [c for c in api.calls if c.watch]
    assert {c.query["timeoutSeconds"] for c in watches} == {"1"}


# ---------------------------------------------------------------------------------------------------------------
# Failures


async def test_api_down_at_start_then_up(tmp_path, caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fake = FakeKubeApi(validate=validate_object, port=port)
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", fake.url)
    fake.put("pods", pod("vllm-a", "10.0.0.1"))
    published = Published()
    try:
        async with running(make_source(make_config(kubeconfig)), published):
            await eventually(lambda: len(warnings_with(caplog, "pods in namespace llm")) >= 2, what="retries")
            assert published.lists == []
            assert any("Cannot connect" in m or "Connect" in m for m in warnings_with(caplog, "Kubernetes API"))
            await fake.start()
            assert fake.port == port
            await published.until([endpoint("10.0.0.1")])
    finally:
        await fake.stop()
    assert published.lists == [(endpoint("10.0.0.1"),)]


async def test_api_down_later_keeps_the_last_list_and_recovers(api, kubeconfig, caplog):
    api.put("pods", pod("vllm-a", "10.0.0.1"))
    published = Published()
    async with running(make_source(make_config(kubeconfig)), published):
        await published.until([endpoint("10.0.0.1")])
        await eventually(lambda: api.watch_count() == 1, what="the watch")
        await api.stop()  # drops the open watch mid-stream
        api.put("pods", pod("vllm-b", "10.0.0.2"))  # stored (etcd survives), served once the API is back
        await eventually(lambda: len(warnings_with(caplog, "keeping the last 1 endpoints")) >= 2, what="retries")
        assert published.lists == [(endpoint("10.0.0.1"),)]
        await api.start()
        await published.until([endpoint("10.0.0.1"), endpoint("10.0.0.2")])
        # A 503 from the API server: same, the list stays until it answers again.
        api.failure = (503, "ServiceUnavailable")
        api.end_watches()
        await eventually(lambda: warnings_with(caplog, "HTTP 503"), what="the 503 warning")
        api.failure = None
        api.put("pods", pod("vllm-a", "10.0.0.1", ready=False))
        await published.until([endpoint("10.0.0.2")])
    assert published.lists == [(endpoint("10.0.0.1"),), (endpoint("10.0.0.1"), endpoint("10.0.0.2")),
                               (endpoint("10.0.0.2"),)]


async def test_forbidden_logs_the_rbac_hint_and_keeps_retrying(api, kubeconfig, caplog):
    api.put("pods", pod("vllm-a", "10.0.0.1"))
    api.forbidden = {"pods"}
    published = Published()
    async with running(make_source(make_config(kubeconfig)), published):
        await eventually(lambda: api.list_count() >= 3, what="three list attempts")
        hints = warnings_with(caplog, "HTTP 403")
        assert hints and all("Role" in h and "RoleBinding" in h and "get, list and watch on pods" in h
                             and 'cannot list resource "pods"' in h for h in hints)
        assert published.lists == []
        api.forbidden = set()
        await published.until([endpoint("10.0.0.1")])


async def test_a_hung_api_server_times_out_and_is_retried(api, kubeconfig, caplog):
    api.put("pods", pod("vllm-a", "10.0.0.1"))
    api.delay_s = 10.0
    published = Published()
    async with running(make_source(make_config(kubeconfig, timeout_s=0.2)), published):
        await eventually(lambda: len(warnings_with(caplog, "no answer within 0.2 s")) >= 2, what="two timeouts")
        assert published.lists == []
        api.delay_s = 0.0
        await published.until([endpoint("10.0.0.1")])


async def test_wrong_token_is_rejected_and_retried(api, tmp_path, caplog):
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url, token="stale")
    api.put("pods", pod("vllm-a", "10.0.0.1"))
    published = Published()
    async with running(make_source(make_config(kubeconfig)), published):
        await eventually(lambda: warnings_with(caplog, "HTTP 401"), what="the 401 warning")
        assert published.lists == []


# ---------------------------------------------------------------------------------------------------------------
# InferencePool


async def test_inference_pool_selector_and_target_ports(api, kubeconfig, caplog):
    api.put("inferencepools", inference_pool({"app": "vllm", "tier": "a"}, [8000, 8001]))
    api.put("pods", pod("vllm-a", "10.0.0.1", labels={"app": "vllm", "tier": "a"}))
    api.put("pods", pod("vllm-b", "10.0.0.2", labels={"app": "vllm", "tier": "b"}))
    published = Published()
    config = make_config(kubeconfig, inference_pool=POOL, target_ports=(7000,))  # the pool's ports win
    async with running(make_source(config), published):
        await published.until([endpoint("10.0.0.1", 8000, 9100), endpoint("10.0.0.1", 8001, 9101)])
        pool_list = next(c for c in api.calls if c.resource == "inferencepools")
        assert pool_list.query["fieldSelector"] == f"metadata.name={POOL}" and pool_list.namespace == NS
        pods_list = next(c for c in api.calls if c.resource == "pods")
        assert pods_list.query["labelSelector"] == "app=vllm,tier=a"
        await eventually(lambda: api.watch_count("inferencepools") >= 1, what="the pool watch")
        # The pool's selector changes: the pods are listed again with the new one.
        api.put("inferencepools", inference_pool({"app": "vllm", "tier": "b"}, [8000, 8001]))
        await published.until([endpoint("10.0.0.2", 8000, 9100), endpoint("10.0.0.2", 8001, 9101)])
        assert [c.query["labelSelector"] for c in api.calls if c.resource == "pods" and not c.watch] == \
            ["app=vllm,tier=a", "app=vllm,tier=b"]
        # Its ports change.
        api.put("inferencepools", inference_pool({"app": "vllm", "tier": "b"}, [8002]))
        await published.until([endpoint("10.0.0.2", 8002, 9100)])
        # Pods of the new selector keep being watched.
        api.put("pods", pod("vllm-c", "10.0.0.3", labels={"app": "vllm", "tier": "b"}))
        await published.until([endpoint("10.0.0.2", 8002, 9100), endpoint("10.0.0.3", 8002, 9100)])
        # Deleted: no endpoints; recreated: back.
        api.delete("inferencepools", POOL, NS)
        await published.until([])
        assert warnings_with(caplog, f"InferencePool {NS}/{POOL} not found")
        api.put("inferencepools", inference_pool({"app": "vllm", "tier": "a"}, [8000]))
        await published.until([endpoint("10.0.0.1", 8000, 9100)])
    assert api.list_count("inferencepools") == 1  # every pool change came by its watch


async def test_missing_inference_pool_publishes_empty_then_follows_it(api, kubeconfig, caplog):
    api.put("pods", pod("vllm-a", "10.0.0.1"))
    api.put("inferencepools", inference_pool({"app": "vllm"}, [8000], name="another-pool"))
    published = Published()
    async with running(make_source(make_config(kubeconfig, inference_pool=POOL)), published):
        await published.until([])
        assert warnings_with(caplog, f"InferencePool {NS}/{POOL} not found")
        assert api.list_count("pods") == 0
        api.put("inferencepools", inference_pool({"app": "vllm"}, [8000]))
        await published.until([endpoint("10.0.0.1")])
    assert published.lists == [(), (endpoint("10.0.0.1"),)]


# ---------------------------------------------------------------------------------------------------------------
# Addresses and predictor ports


async def test_named_predictor_port_from_container_ports(api, kubeconfig, caplog):
    api.put("pods", pod("native-sidecar", "10.0.0.1", predictor="sidecar", predictor_port=9200))
    api.put("pods", pod("plain-container", "10.0.0.2", predictor="container", predictor_port=9300))
    api.put("pods", pod("no-sidecar", "10.0.0.3", predictor=None))
    published = Published()
    config = make_config(kubeconfig, predictor_port="grpc-predictor", target_ports=(8000, 8001))
    async with running(make_source(config), published):
        await published.until([
            endpoint("10.0.0.1", 8000, 9200), endpoint("10.0.0.1", 8001, 9201),
            endpoint("10.0.0.2", 8000, 9300), endpoint("10.0.0.2", 8001, 9301),
            endpoint("10.0.0.3", 8000, None), endpoint("10.0.0.3", 8001, None)])
        api.put("pods", pod("no-sidecar", "10.0.0.3", predictor=None, annotations={"a": "b"}))
        api.put("pods", pod("plain-container", "10.0.0.2", ready=False, predictor="container",
                            predictor_port=9300))
        await published.until([
            endpoint("10.0.0.1", 8000, 9200), endpoint("10.0.0.1", 8001, 9201),
            endpoint("10.0.0.3", 8000, None), endpoint("10.0.0.3", 8001, None)])
    warned = warnings_with(caplog, "no container port named 'grpc-predictor'")
    assert len(warned) == 1 and f"{NS}/no-sidecar" in warned[0]


async def test_ipv6_pod_ip_is_bracketed(api, kubeconfig):
    api.put("pods", pod("vllm-v6", "fd00::5"))
    published = Published()
    async with running(make_source(make_config(kubeconfig)), published):
        await published.until([EndpointConfig(address="[fd00::5]:8000", models=MODELS, predictor="[fd00::5]:9100")])
    assert published.last[0].address == "[fd00::5]:8000"


async def test_numeric_predictor_none_and_no_models(api, kubeconfig):
    api.put("pods", pod("vllm-a", "10.0.0.1"))
    published = Published()
    async with running(make_source(make_config(kubeconfig, predictor_port=None, models=())), published):
        await published.until([EndpointConfig(address="10.0.0.1:8000")])


# ---------------------------------------------------------------------------------------------------------------
# Configuration


def test_missing_kubeconfig_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^discovery\.kubeconfig: no kubeconfig file at .*nope"):
        KubernetesSource(make_config(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"^discovery\.kubeconfig: no kubeconfig file at .*nope"):
        build_source(make_config(tmp_path / "nope"))


def test_no_kubeconfig_and_not_in_a_cluster_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match=r"not in a cluster.*no kubeconfig file at .*absent"):
        KubernetesSource(make_config(None))


def test_unusable_kubeconfig_is_a_config_error(tmp_path):
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "Config", "clusters": [], "contexts": [],
                                "users": []}))
    with pytest.raises(ConfigError, match=r"^discovery\.kubeconfig: .* is not a usable kubeconfig"):
        KubernetesSource(make_config(path))


async def test_credentials_that_fail_to_load_raise_config_error_from_run(tmp_path):
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "extproc", "user": {"exec": {"apiVersion": "client.authentication.k8s.io/v1",
                                                         "command": str(tmp_path / "no-such-plugin"),
                                                         "interactiveMode": "Never"}}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "extproc"}}],
    }))
    source = make_source(make_config(path))  # the file parses; its exec plugin runs in run()
    published = Published()
    with pytest.raises(ConfigError, match=r"^discovery\.kubeconfig: cannot load .*kubeconfig"):
        await asyncio.wait_for(source.run(published), 5.0)
    assert published.lists == []


def test_in_cluster_without_a_token_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(ConfigError, match=r"in-cluster configuration cannot be loaded .*token"):
        KubernetesSource(make_config(None))


async def test_namespace_from_the_kubeconfig_context_as_kubectl(api, kubeconfig, tmp_path):
    (tmp_path / "namespace").write_text("team-a\n")
    source = make_source(make_config(kubeconfig, namespace=None), namespace_path=str(tmp_path / "namespace"))
    assert source.namespace == NS  # the current context's namespace wins over the pod's
    assert make_source(make_config(kubeconfig, namespace="other")).namespace == "other"


async def test_namespace_from_the_service_account_file(api, tmp_path):
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
    config = json.loads(kubeconfig.read_text())
    del config["contexts"][0]["context"]["namespace"]
    kubeconfig.write_text(json.dumps(config))
    (tmp_path / "namespace").write_text("team-a\n")
    source = make_source(make_config(kubeconfig, namespace=None), namespace_path=str(tmp_path / "namespace"))
    assert source.namespace == "team-a"
    assert make_source(make_config(kubeconfig, namespace=None),
                       namespace_path=str(tmp_path / "absent")).namespace == "default"
    published = Published()
    async with running(source, published):
        await published.until([])
    assert {c.namespace for c in api.calls} == {"team-a"}


async def test_watches_that_end_at_once_back_off_instead_of_spinning(api, kubeconfig):
    """A server (or a proxy) that ends every watch at once, empty: each such watch counts as a failure and waits a
    backoff (client-go's "very short watch"), instead of watching again at once (a break-it pass: 468 watches in
    10 s, 98% of a core, nothing logged)."""
    api.put("pods", pod("vllm-0", "10.0.0.1"))
    api.watch_cap_s = 0.0
    published = Published()
    source = make_source(make_config(kubeconfig))
    async with running(source, published):
        await published.until([endpoint("10.0.0.1")])
        await asyncio.sleep(2.0)
    assert 1 <= api.watch_count("pods") <= 25, api.watch_count("pods")  # backoffs of 0.05-0.2 s: ~12 in 2 s
