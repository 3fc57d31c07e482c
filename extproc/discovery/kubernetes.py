"""Endpoint discovery from the Kubernetes API: the Ready pods of a label selector or of an InferencePool, watched.

``KubernetesSource(config).run(publish)`` lists the pods, then watches them from the list's resourceVersion and
relists every ``resync_interval_s``; each change of the endpoint list it derives is published whole. All API
calls go through the maintained client library ``kubernetes_asyncio`` (``CoreV1Api.list_namespaced_pod``,
``CustomObjectsApi.list_namespaced_custom_object`` and its ``watch.Watch``).

Semantics and where they come from:

- List and watch (Kubernetes API conventions, "Efficient detection of changes" and "Resource versions" in
  https://kubernetes.io/docs/reference/using-api/api-concepts/): a list returns the collection's
  ``metadata.resourceVersion``; a watch from it (``watch=true&resourceVersion=RV&allowWatchBookmarks=true&
  timeoutSeconds=N``) streams ``ADDED`` / ``MODIFIED`` / ``DELETED`` events of the objects newer than RV, and
  ``BOOKMARK`` events that only advance RV. A watch ending normally (the server's timeout) is resumed from the
  last RV seen, so nothing is lost; an ``ERROR`` event with code 410 (reason ``Expired``, "too old resource
  version": the history was compacted) means the client must list again. The full relist every
  ``resync_interval_s`` repairs anything a watch could have missed, as client-go's informers do.
- Which pods are endpoints (the Gateway API Inference Extension's Endpoint Picker, ``pkg/epp``: a pod is in the
  datastore while it is Ready, not being deleted, and matches the pool's selector): phase ``Running``, condition
  ``Ready`` ``True``, no ``metadata.deletionTimestamp``, a ``status.podIP``. Each of the pool's target ports
  gives one endpoint ``podIP:port`` (its ``targetPorts`` list, 1 to 8 entries).
- The InferencePool (``inference.networking.k8s.io/v1``, the Inference Extension's ``api/v1`` types,
  ``InferencePoolSpec``): ``spec.selector.matchLabels`` (pods of the pool's namespace) and
  ``spec.targetPorts[].number``. It is listed by ``fieldSelector=metadata.name=<name>`` and watched the same
  way; a change of its selector or ports relists the pods; a missing pool means no endpoints.

Failures (connection refused, a timeout of ``timeout_s``, HTTP 5xx, 401, 403, a malformed answer) are logged,
the last published list is kept, and the list + watch is retried after `Backoff`. Only ``asyncio.CancelledError``
and, at the start of ``run``, a ``ConfigError`` for an unloadable kubeconfig leave ``run``.

Permissions: get, list and watch on ``pods`` and, with ``inference_pool``, on
``inferencepools.inference.networking.k8s.io``, in the namespace (deploy/kubernetes/base/extproc/rbac.yaml).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes_asyncio.client import (
    ApiClient,
    Configuration,
    CoreV1Api,
    CustomObjectsApi,
)
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import (
    ConfigException,
    list_kube_config_contexts,
    load_incluster_config,
    load_kube_config,
)
from kubernetes_asyncio.watch import Watch

from extproc.config import ConfigError, DiscoveryConfig, EndpointConfig
from extproc.discovery import (
    MAX_RETRY_S,
    MIN_RETRY_S,
    Backoff,
    Publish,
    endpoint_address,
)

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
"""The pod's own namespace, as the service account mount gives it (the default ``namespace_path``)."""

DEFAULT_KUBECONFIG = "~/.kube/config"
"""The kubeconfig read when ``discovery.kubeconfig`` is null, $KUBECONFIG is unset and not in a cluster."""

MIN_WATCH_S = 1.0
"""A watch that ends sooner than this with no event counts as a failure (backs off), as client-go's reflector
treats a "very short watch"."""

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
POOL_PLURAL = "inferencepools"

_EXPIRED = 410
"""HTTP status of a watch from a resourceVersion older than the compacted history (reason Expired / Gone)."""


class _Expired(Exception):
    """A watch answered 410: the resourceVersion is too old; list again."""


class _BadAnswer(Exception):
    """The API server answered something that is not a watch event (e.g. a non-JSON error page)."""


@dataclass(frozen=True, slots=True)
class _Target:
    """What the pods are selected by, and which of their ports are endpoints."""

    label_selector: str
    ports: tuple[int, ...]


class KubernetesSource:
    """Discovers the endpoints from the Kubernetes API (``discovery.source: kubernetes``).

    Args:
        config: the ``discovery`` section; ``label_selector`` or ``inference_pool`` (exactly one), ``namespace``,
            ``target_ports`` (ignored with a pool), ``predictor_port`` (a number, a container port's name, or
            None), ``models``, ``kubeconfig``, ``resync_interval_s`` (seconds), ``timeout_s`` (seconds, per list
            and per watch connect).
        namespace_path: where the pod's own namespace is read when ``config.namespace`` is null (tests point it
            elsewhere); a missing or empty file means ``default``.
        min_retry_s, max_retry_s: the `Backoff` after failures, seconds.

    Client configuration: ``config.kubeconfig`` if set; else in-cluster (the service account token and CA) when
    ``KUBERNETES_SERVICE_HOST`` is set; else ``$KUBECONFIG`` (``:``-separated files) or ``~/.kube/config``.
    Files are parsed here and their credentials loaded at the start of ``run``.

    Raises:
        ConfigError: no client configuration can be loaded (the file is missing or invalid, the in-cluster
            token or CA is missing), or neither ``label_selector`` nor ``inference_pool`` is set.
    """

    def __init__(self, config: DiscoveryConfig, *, namespace_path: str = SERVICE_ACCOUNT_NAMESPACE_PATH,
                 min_retry_s: float = MIN_RETRY_S, max_retry_s: float = MAX_RETRY_S) -> None:
        if (config.label_selector is None) == (config.inference_pool is None):
            raise ConfigError("discovery.label_selector: kubernetes discovery needs exactly one of label_selector "
                              "and inference_pool")
        self._config = config
        self._retry_s = (min_retry_s, max_retry_s)
        self._kubeconfig: str | None = None
        self._client_config: Configuration | None = None
        context_namespace = None  # the kubeconfig's current context's, as kubectl uses it
        if config.kubeconfig is not None:
            self._kubeconfig, context_namespace = _check_kubeconfig(config.kubeconfig, "discovery.kubeconfig")
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            client_config = Configuration()
            try:
                load_incluster_config(client_configuration=client_config)
            except (ConfigException, OSError) as exc:
                raise ConfigError(f"discovery.kubeconfig: KUBERNETES_SERVICE_HOST is set but the in-cluster "
                                  f"configuration cannot be loaded ({exc}); mount the service account token "
                                  f"(automountServiceAccountToken: true) or set discovery.kubeconfig") from None
            self._client_config = client_config
        else:
            self._kubeconfig, context_namespace = _check_kubeconfig(
                os.environ.get("KUBECONFIG") or DEFAULT_KUBECONFIG,
                "discovery.kubeconfig (null: not in a cluster, so $KUBECONFIG or ~/.kube/config)")
        self.namespace = config.namespace or context_namespace or _read_namespace(namespace_path)
        """The namespace of the pods (and of the InferencePool): ``discovery.namespace``, else the kubeconfig's
        current context's (as kubectl), else the pod's own (its service account's), else ``default``."""
        self._publish: Publish | None = None
        self._published: tuple[EndpointConfig, ...] | None = None
        self._warned_named_port: set[str] = set()
        self._api: ApiClient | None = None
        # inference_pool: the pods and ports the pool names (None: missing or malformed), once it was listed,
        # and the pod discovery of that target.
        self._pool_target: _Target | None = None
        self._pool_known = False
        self._pods_task: asyncio.Task[None] | None = None

    @property
    def published(self) -> tuple[EndpointConfig, ...] | None:
        """The last list handed to ``publish`` (None before the first sync)."""
        return self._published

    async def run(self, publish: Publish) -> None:
        """Lists and watches until cancelled, calling ``publish`` at the first sync and on each change.

        The first call comes after the first successful list (of the pods, or of the InferencePool when it does
        not exist), even with no endpoints; later calls only when the list differs from the last one. API
        failures are logged and retried with `Backoff`, keeping the last list.

        Raises:
            ConfigError: the kubeconfig's credentials cannot be loaded (e.g. an exec plugin fails).
            asyncio.CancelledError: when cancelled (the API client is closed first).
        """
        client_config = self._client_config
        if client_config is None:
            client_config = Configuration()
            try:
                await load_kube_config(config_file=self._kubeconfig, client_configuration=client_config,
                                       persist_config=False)
            except Exception as exc:  # noqa: BLE001 (the loader raises many kinds; all mean an unusable file)
                raise ConfigError(f"discovery.kubeconfig: cannot load {self._kubeconfig}: "
                                  f"{type(exc).__name__}: {exc}") from None
        self._publish = publish
        async with ApiClient(configuration=client_config) as api:
            self._api = api
            try:
                if self._config.inference_pool is not None:
                    await self._run_pool(self._config.inference_pool)
                else:
                    await self._run_pods(_Target(self._config.label_selector, tuple(self._config.target_ports)))
            finally:
                self._api = None

    # -----------------------------------------------------------------------------------------------------------
    # Pods

    async def _run_pods(self, target: _Target) -> None:
        """List + watch the pods of ``target`` until cancelled, publishing the endpoints they give."""
        assert self._api is not None
        core = CoreV1Api(self._api)
        pods: dict[str, Any] = {}

        async def list_pods() -> str:
            listed = await core.list_namespaced_pod(self.namespace, label_selector=target.label_selector,
                                                    _request_timeout=self._config.timeout_s)
            pods.clear()
            pods.update({pod.metadata.uid: pod for pod in listed.items or ()})
            self._emit(self._endpoints(pods.values(), target.ports), target)
            return listed.metadata.resource_version

        async def watch_pods(rv: str, remaining_s: float) -> str:
            return await self._watch_pods(core, target, pods, rv, remaining_s)

        await self._list_and_watch("pods", "pod watch", list_pods, watch_pods)

    async def _list_and_watch(self, resource: str, what: str, list_once, watch_once) -> None:
        """Until cancelled: ``list_once() -> rv``, then ``watch_once(rv, remaining_s) -> rv`` again and again until
        the relist is due (``resync_interval_s`` after the list); a 410 Expired lists again at once (after a backoff
        when it repeats); any other failure is logged (``_failed``) and retried after the backoff, which a watch
        that ran cleanly resets."""
        loop = asyncio.get_running_loop()
        backoff = Backoff(*self._retry_s)
        expired_in_a_row = 0
        while True:
            try:
                rv = await list_once()
                deadline = loop.time() + self._config.resync_interval_s
                while (remaining := deadline - loop.time()) > 0:
                    started_s = loop.time()
                    new_rv = await watch_once(rv, remaining)
                    if new_rv == rv and loop.time() - started_s < MIN_WATCH_S:
                        # A watch the server (or a proxy) ended at once with nothing in it: not a success, or
                        # this would spin (client-go's "very short watch"); wait as after a failure.
                        logger.debug("%s in namespace %s ended at once, empty; retrying after a backoff", what,
                                     self.namespace)
                        await asyncio.sleep(backoff.next_s())
                        continue
                    rv = new_rv
                    backoff.reset()
                    expired_in_a_row = 0
            except _Expired as exc:
                expired_in_a_row += 1
                logger.info("%s in namespace %s: %s; listing again", what, self.namespace, exc)
                if expired_in_a_row > 1:
                    await asyncio.sleep(backoff.next_s())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (any API or network failure: keep the list, retry)
                await self._failed(resource, exc, backoff)

    async def _watch_pods(self, core: CoreV1Api, target: _Target, pods: dict[str, Any], rv: str,
                          remaining_s: float) -> str:
        """One watch from ``rv``, applying its events to ``pods``; returns the last resourceVersion seen."""
        async with self._watch(rv, remaining_s, core.list_namespaced_pod, self.namespace,
                               label_selector=target.label_selector) as events:
            async for event in events:
                kind, rv = event["type"], _resource_version(event, rv)
                if kind in ("ADDED", "MODIFIED"):
                    pod = event["object"]
                    pods[pod.metadata.uid] = pod
                elif kind == "DELETED":
                    pods.pop(event["object"].metadata.uid, None)
                else:  # BOOKMARK: only the resourceVersion
                    continue
                self._emit(self._endpoints(pods.values(), target.ports), target)
        return rv

    @contextlib.asynccontextmanager
    async def _watch(self, rv: str, remaining_s: float, list_function, *args: Any, **kwargs: Any):
        """The events (dicts) of one watch of ``list_function(*args, **kwargs)`` from ``rv``, bookmarks on, ending
        after ``remaining_s`` (rounded up to whole seconds, at least 1) on the server's side."""
        timeout_seconds = max(1, math.ceil(remaining_s))
        async with Watch() as watch:
            stream = watch.stream(list_function, *args, resource_version=rv, allow_watch_bookmarks=True,
                                  timeout_seconds=timeout_seconds, _request_timeout=self._watch_timeout(timeout_seconds),
                                  **kwargs)
            async with contextlib.aclosing(_events(stream)) as events:
                yield events

    def _endpoints(self, pods: Iterable[Any], ports: tuple[int, ...]) -> tuple[EndpointConfig, ...]:
        """The endpoints of the Ready ``pods``: one per target port, sorted by address, distinct addresses."""
        by_address: dict[str, EndpointConfig] = {}
        pods = sorted(pods, key=lambda p: (p.metadata.name or "", p.metadata.uid or ""))
        for pod in pods:
            for endpoint in self._pod_endpoints(pod, ports):
                by_address.setdefault(endpoint.address, endpoint)  # two pods, one IP (hostNetwork): the first
        self._warned_named_port.intersection_update(p.metadata.uid for p in pods)
        return tuple(by_address[a] for a in sorted(by_address))

    def _pod_endpoints(self, pod: Any, ports: tuple[int, ...]) -> list[EndpointConfig]:
        if not is_pod_ready(pod):
            return []
        ip = pod.status.pod_ip
        base = self._predictor_base_port(pod)
        endpoints = []
        for i, port in enumerate(ports):
            predictor = endpoint_address(ip, base + i) if base is not None and base + i <= 65535 else None
            try:
                endpoints.append(EndpointConfig(address=endpoint_address(ip, port), models=self._config.models,
                                                predictor=predictor))
            except ValueError as exc:
                logger.warning("pod %s/%s: skipping endpoint %s: %s", pod.metadata.namespace, pod.metadata.name,
                               endpoint_address(ip, port), exc)
        return endpoints

    def _predictor_base_port(self, pod: Any) -> int | None:
        """``predictor_port`` as a number for ``pod`` (a name is looked up in its containers' ports)."""
        wanted = self._config.predictor_port
        if wanted is None or isinstance(wanted, int):
            return wanted
        spec = pod.spec
        # Native sidecars (init containers with restartPolicy Always) count: the predictor sidecar is one
        # (deploy/kubernetes/base/vllm/deployment.yaml).
        for container in [*(spec.containers or ()), *(spec.init_containers or ())] if spec else ():
            for port in container.ports or ():
                if port.name == wanted:
                    return port.container_port
        if pod.metadata.uid not in self._warned_named_port:
            self._warned_named_port.add(pod.metadata.uid)
            logger.warning("pod %s/%s has no container port named %r: its endpoints get no predictor sidecar",
                           pod.metadata.namespace, pod.metadata.name, wanted)
        return None

    # -----------------------------------------------------------------------------------------------------------
    # InferencePool

    async def _run_pool(self, name: str) -> None:
        """List + watch the InferencePool ``name``; (re)start the pod discovery its selector and ports define."""
        assert self._api is not None
        custom = CustomObjectsApi(self._api)

        async def list_pool() -> str:
            listed = await custom.list_namespaced_custom_object(
                POOL_GROUP, POOL_VERSION, self.namespace, POOL_PLURAL, field_selector=f"metadata.name={name}",
                _request_timeout=self._config.timeout_s)
            items = [item for item in listed.get("items") or () if item["metadata"]["name"] == name]
            await self._apply_pool(name, items[0] if items else None)
            return listed["metadata"]["resourceVersion"]

        async def watch_pool(rv: str, remaining_s: float) -> str:
            return await self._watch_pool(custom, name, rv, remaining_s)

        try:
            await self._list_and_watch("inferencepools", f"InferencePool watch {name}", list_pool, watch_pool)
        finally:
            await self._stop_pods_task()

    async def _watch_pool(self, custom: CustomObjectsApi, name: str, rv: str, remaining_s: float) -> str:
        async with self._watch(rv, remaining_s, custom.list_namespaced_custom_object, POOL_GROUP, POOL_VERSION,
                               self.namespace, POOL_PLURAL, field_selector=f"metadata.name={name}") as events:
            async for event in events:
                kind, rv = event["type"], _resource_version(event, rv)
                if kind in ("ADDED", "MODIFIED"):
                    await self._apply_pool(name, event["raw_object"])
                elif kind == "DELETED":
                    await self._apply_pool(name, None)
        return rv

    async def _apply_pool(self, name: str, pool: dict[str, Any] | None) -> None:
        """A (re)read InferencePool: restarts the pod discovery when its selector or ports changed."""
        target = None
        if pool is None:
            if self._pool_target is not None or not self._pool_known:
                logger.warning("InferencePool %s/%s not found: no endpoints until it exists", self.namespace, name)
        else:
            target = self._target_of(name, pool)
        if self._pool_known and target == self._pool_target:
            return
        self._pool_known = True
        self._pool_target = target
        await self._stop_pods_task()
        if target is None:
            self._emit((), None)
            return
        logger.info("InferencePool %s/%s: pods %r, target ports %s", self.namespace, name, target.label_selector,
                    list(target.ports))
        self._pods_task = asyncio.get_running_loop().create_task(self._run_pods(target),
                                                                 name=f"discovery-pods-{name}")

    async def _stop_pods_task(self) -> None:
        task, self._pods_task = self._pods_task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # we are being cancelled too
        except Exception:
            logger.exception("pod discovery task failed")

    def _target_of(self, name: str, pool: dict[str, Any]) -> _Target | None:
        """The pods and ports an InferencePool object names (api/v1 InferencePoolSpec); None if malformed."""
        spec = pool.get("spec") or {}
        labels = (spec.get("selector") or {}).get("matchLabels") or {}
        ports = tuple(p.get("number") for p in spec.get("targetPorts") or () if isinstance(p, dict))
        if not labels or not ports or not all(isinstance(p, int) and 1 <= p <= 65535 for p in ports):
            logger.warning("InferencePool %s/%s has no usable spec.selector.matchLabels or spec.targetPorts "
                           "(%s): no endpoints", self.namespace, name, json.dumps(spec)[:300])
            return None
        selector = ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
        return _Target(selector, ports)

    # -----------------------------------------------------------------------------------------------------------
    # Publishing and failures

    def _emit(self, endpoints: tuple[EndpointConfig, ...], target: _Target | None) -> None:
        """Publishes ``endpoints`` if they differ from the last published list, logging the change."""
        previous = self._published
        if endpoints == previous:
            return
        self._published = endpoints
        where = f"namespace {self.namespace}" + (f", pods {target.label_selector!r}" if target else "")
        if previous is None:
            logger.info("discovered %d endpoints (%s)%s", len(endpoints), where,
                        ": " + _first(_describe(e) for e in endpoints) if endpoints else "")
        else:
            old = {e.address: e for e in previous}
            new = {e.address: e for e in endpoints}
            parts = []
            if added := [_describe(new[a]) for a in new if a not in old]:
                parts.append("added " + _first(added))
            if removed := [a for a in old if a not in new]:
                parts.append("removed " + _first(removed))
            if changed := [_describe(new[a]) for a in new if a in old and old[a] != new[a]]:
                parts.append("changed " + _first(changed))
            logger.info("endpoints now %d (%s): %s", len(endpoints), where, "; ".join(parts))
        assert self._publish is not None
        self._publish(endpoints)

    def _watch_timeout(self, timeout_seconds: int) -> aiohttp.ClientTimeout:
        """Client-side limits of one watch: connect within ``timeout_s``; no silence past the server's timeout."""
        return aiohttp.ClientTimeout(total=None, connect=self._config.timeout_s, sock_connect=self._config.timeout_s,
                                     sock_read=timeout_seconds + self._config.timeout_s)

    async def _failed(self, resource: str, exc: BaseException, backoff: Backoff) -> None:
        delay_s = backoff.next_s()
        kept = "no endpoints published yet" if self._published is None else \
            f"keeping the last {len(self._published)} endpoints"
        error = _describe_error(exc)
        if isinstance(exc, TimeoutError):
            error = f"no answer within {self._config.timeout_s:g} s (discovery.timeout_s)"
        message = f"Kubernetes API: {resource} in namespace {self.namespace}: {error}"
        if isinstance(exc, ApiException) and exc.status == 403:
            resources = "pods and on inferencepools.inference.networking.k8s.io" if self._config.inference_pool \
                else "pods"
            message += (f" (forbidden: the identity the extproc uses (in a pod, its service account) needs a "
                        f"Role with get, list and watch on "
                        f"{resources} in namespace {self.namespace}, and a RoleBinding of the account to it; see "
                        f"deploy/kubernetes/base/extproc/rbac.yaml)")
        elif isinstance(exc, ApiException) and exc.status == 404 and resource == "inferencepools":
            message += " (is the InferencePool CRD, inference.networking.k8s.io/v1, installed?)"
        logger.warning("%s; %s; retrying in %.1f s", message, kept, delay_s)
        await asyncio.sleep(delay_s)


async def _events(stream: Watch):
    """The watch's events, as dicts; a non-event answer raises `_BadAnswer`, a 410 `_Expired`."""
    try:
        async for event in stream:
            if not isinstance(event, dict):
                raise _BadAnswer(f"not a watch event: {str(event)[:200]!r}")
            yield event
    except ApiException as exc:
        if exc.status == _EXPIRED:
            raise _Expired(_describe_error(exc)) from None
        raise


def _resource_version(event: dict[str, Any], previous: str) -> str:
    """The resourceVersion a watch event carries (a BOOKMARK carries only that), else ``previous``."""
    return (event.get("raw_object") or {}).get("metadata", {}).get("resourceVersion") or previous


def is_pod_ready(pod: Any) -> bool:
    """Whether a pod (a ``kubernetes_asyncio`` ``V1Pod``) serves: Running, Ready True, not deleting, with an IP.

    As the Inference Extension's Endpoint Picker admits pods to its datastore (``pkg/epp/util/pod.IsPodReady``:
    no deletionTimestamp and condition Ready True), plus phase Running and a pod IP.
    """
    status = pod.status
    if pod.metadata.deletion_timestamp is not None or status is None:
        return False
    if status.phase != "Running" or not status.pod_ip:
        return False
    for condition in status.conditions or ():
        if condition.type == "Ready":
            return condition.status == "True"
    return False


def _read_namespace(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def _check_kubeconfig(path: str, key: str) -> tuple[str, str | None]:
    """(``path``, its current context's namespace or None) if a kubeconfig there (``:``-separated files allowed)
    parses and names a usable context."""
    files = [os.path.expanduser(p) for p in path.split(os.pathsep) if p]
    if not any(os.path.isfile(f) for f in files):
        raise ConfigError(f"{key}: no kubeconfig file at {path}")
    try:
        _contexts, active = list_kube_config_contexts(path)
    except Exception as exc:  # noqa: BLE001 (YAML, missing keys, no current context...)
        raise ConfigError(f"{key}: {path} is not a usable kubeconfig: {type(exc).__name__}: {exc}") from None
    namespace = ((active or {}).get("context") or {}).get("namespace")
    return path, namespace if isinstance(namespace, str) and namespace else None


def _first(items, limit: int = 10) -> str:
    """The first ``limit`` of ``items``, comma-separated, and how many more (a log line stays bounded)."""
    items = list(items)
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _describe(endpoint: EndpointConfig) -> str:
    return endpoint.address + (f" (predictor {endpoint.predictor})" if endpoint.predictor else "")


def _describe_error(exc: BaseException) -> str:
    """A one-line account of a failure (an ``ApiException``'s status and the Status message, not its headers)."""
    if isinstance(exc, ApiException):
        detail = exc.reason or ""
        if exc.body:
            try:
                body = json.loads(exc.body)
                detail = body.get("message") or detail
            except (ValueError, AttributeError):
                detail = detail or str(exc.body)[:200]
        return f"HTTP {exc.status}: {detail}".rstrip(": ")
    text = str(exc)
    text = text if len(text) <= 300 else text[:300] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
