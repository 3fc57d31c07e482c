"""A fake Kubernetes API server (aiohttp, 127.0.0.1) with the REST paths and list/watch semantics discovery uses.

No real Kubernetes API server can run here, so ``extproc.discovery.kubernetes`` is tested against this: the real
client library (``kubernetes_asyncio``, configured from a kubeconfig file) talks HTTP to it. What it implements,
following the Kubernetes API conventions (https://kubernetes.io/docs/reference/using-api/api-concepts/):

- ``GET /api/v1/namespaces/{ns}/pods`` and
  ``GET /apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools``: a list (``PodList``,
  ``InferencePoolList``) with the collection's ``metadata.resourceVersion`` (one counter for all objects, as
  etcd's revision), filtered by ``labelSelector`` (equality terms ``k=v``, ``k==v``, ``k!=v``, and ``k`` / ``!k``)
  and ``fieldSelector`` (``metadata.name``, ``metadata.namespace``); built-in list items carry no kind/apiVersion,
  custom ones do, as the real server answers.
- The same paths with ``watch=true``: a chunked stream of newline-delimited watch events ``{"type", "object"}``
  (``ADDED`` / ``MODIFIED`` / ``DELETED`` from the history after ``resourceVersion``; an object that stops or
  starts matching the selector arrives as ``DELETED`` / ``ADDED``); ``BOOKMARK`` events (an object with only
  ``metadata.resourceVersion``) every ``bookmark_interval_s`` when ``allowWatchBookmarks=true``; an
  ``ERROR`` event with a 410 ``Expired`` Status when ``resourceVersion`` is older than the compaction point
  (`FakeKubeApi.compact`); the stream ends after ``timeoutSeconds`` (or the server's own cap,
  ``watch_cap_s``). Without ``resourceVersion`` (or with "0") a watch first sends the current objects as
  ``ADDED``.
- Bearer-token authentication (401 otherwise), a delay before every answer (``delay_s``), a 403 for the resources in ``forbidden``, any failure status
  in ``failure``, and `stop` / `start` for an API server that goes away (connections dropped) and comes back
  on the same port. Errors are ``Status`` objects, as the real server's.

Every object stored (so every object served, in lists and watch events) is passed to ``validate`` first (the
tests check pods against Kubernetes' own schema and InferencePools against their CRD's), and every list
response to ``validate_list``.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

RESOURCES = {
    "pods": ("v1", "Pod", "PodList", True),
    "inferencepools": ("inference.networking.k8s.io/v1", "InferencePool", "InferencePoolList", False),
}
"""resource -> (apiVersion, kind, list kind, built-in: list items carry no apiVersion/kind)."""

CREATION_TIMESTAMP = "2025-06-01T12:00:00Z"


@dataclass
class Call:
    """One request the fake answered."""

    resource: str
    namespace: str
    query: dict[str, str]

    @property
    def watch(self) -> bool:
        return parse_bool(self.query.get("watch", ""))


@dataclass
class _Change:
    rv: int
    resource: str
    old: dict[str, Any] | None
    new: dict[str, Any] | None  # None: deleted (old is the last state, with the deletion's resourceVersion)


@dataclass
class FakeKubeApi:
    """The fake server; objects are changed with `put` / `delete`, the server with the attributes below."""

    token: str = "test-token"
    validate: Callable[[dict[str, Any]], None] | None = None
    validate_list: Callable[[dict[str, Any]], None] | None = None
    watch_cap_s: float | None = None
    """The server's own limit on one watch, seconds (as the API server's --min-request-timeout); None: none."""
    bookmark_interval_s: float | None = None
    """BOOKMARK events this often on watches that allow them; None: never."""
    failure: tuple[int, str] | None = None
    """(code, reason): every request is answered with this Status, e.g. (503, 'ServiceUnavailable')."""
    forbidden: set[str] = field(default_factory=set)
    """Resources answered 403 Forbidden (a missing RBAC rule)."""
    delay_s: float = 0.0
    """Every answer waits this long first (a slow or hung API server)."""
    stall_watches: bool = False
    """Open watches send nothing (a stalled connection) until it is cleared or they end; nothing is dropped."""
    calls: list[Call] = field(default_factory=list)
    expired_sent: int = 0
    """How many watches were answered 410 Expired."""
    bookmarks_sent: list[int] = field(default_factory=list)
    """The resourceVersion of each BOOKMARK sent."""
    port: int = 0

    def __post_init__(self) -> None:
        self._objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {r: {} for r in RESOURCES}
        self._history: list[_Change] = []
        self._rv = 1000
        self._compacted_rv = 0
        self._uids = itertools.count(1)
        self._tick = asyncio.Event()
        self._end_watches = asyncio.Event()
        self._runner: web.AppRunner | None = None

    # -- the server --------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def resource_version(self) -> int:
        """The latest resourceVersion (of the last change)."""
        return self._rv

    async def start(self) -> None:
        """Serves on ``port`` (0: a free one, then kept, so a restart is at the same address)."""
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        app.router.add_get("/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools",
                           self._pools)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._end_watches = asyncio.Event()

    async def stop(self) -> None:
        """Goes away: stops listening and drops every connection (open watches break mid-stream)."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def end_watches(self) -> None:
        """Ends every open watch normally, as when its timeout expires (clients resume from their last rv)."""
        self._end_watches.set()
        self._end_watches = asyncio.Event()

    def compact(self) -> None:
        """Compacts the history up to now: a watch from an older resourceVersion gets 410 Expired."""
        self._compacted_rv = self._rv

    def watch_count(self, resource: str = "pods") -> int:
        return sum(1 for c in self.calls if c.resource == resource and c.watch)

    def list_count(self, resource: str = "pods") -> int:
        return sum(1 for c in self.calls if c.resource == resource and not c.watch)

    # -- objects -----------------------------------------------------------------------------------------------

    def put(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Creates or replaces an object (by namespace and name); fills in the server-set metadata; returns it."""
        api_version, kind, _, _ = RESOURCES[resource]
        obj = copy.deepcopy(obj)
        obj.setdefault("apiVersion", api_version)
        obj.setdefault("kind", kind)
        meta = obj["metadata"]
        meta.setdefault("namespace", "default")
        key = (meta["namespace"], meta["name"])
        old = self._objects[resource].get(key)
        meta["uid"] = old["metadata"]["uid"] if old else f"00000000-0000-4000-8000-{next(self._uids):012d}"
        meta["creationTimestamp"] = old["metadata"]["creationTimestamp"] if old else CREATION_TIMESTAMP
        self._rv += 1
        meta["resourceVersion"] = str(self._rv)
        if self.validate is not None:
            self.validate(obj)
        self._objects[resource][key] = obj
        self._history.append(_Change(self._rv, resource, old, obj))
        self._wake()
        return copy.deepcopy(obj)

    def get(self, resource: str, name: str, namespace: str = "default") -> dict[str, Any]:
        return copy.deepcopy(self._objects[resource][(namespace, name)])

    def delete(self, resource: str, name: str, namespace: str = "default") -> None:
        """Removes an object now (a pod's graceful deletion is a `put` with deletionTimestamp first)."""
        old = self._objects[resource].pop((namespace, name))
        self._rv += 1
        last = copy.deepcopy(old)
        last["metadata"]["resourceVersion"] = str(self._rv)
        self._history.append(_Change(self._rv, resource, last, None))
        self._wake()

    def _wake(self) -> None:
        self._tick.set()
        self._tick = asyncio.Event()

    # -- handlers ----------------------------------------------------------------------------------------------

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        return await self._collection(request, "pods")

    async def _pools(self, request: web.Request) -> web.StreamResponse:
        return await self._collection(request, "inferencepools")

    async def _not_found(self, request: web.Request) -> web.StreamResponse:
        return _status(404, "NotFound", f"the server could not find the requested resource ({request.path})")

    async def _collection(self, request: web.Request, resource: str) -> web.StreamResponse:
        namespace = request.match_info["namespace"]
        query = dict(request.query)
        self.calls.append(Call(resource, namespace, query))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return _status(401, "Unauthorized", "Unauthorized")
        if self.failure is not None:
            code, reason = self.failure
            return _status(code, reason, f"fake API server failing with {code}")
        if resource in self.forbidden:
            verb = "watch" if parse_bool(query.get("watch", "")) else "list"
            group = "" if resource == "pods" else "inference.networking.k8s.io"
            return _status(403, "Forbidden", f'{resource} is forbidden: User "system:serviceaccount:{namespace}:'
                                             f'astrolabe-extproc" cannot {verb} resource "{resource}" in API group '
                                             f'"{group}" in the namespace "{namespace}"')
        try:
            matches = _matcher(namespace, query.get("labelSelector", ""), query.get("fieldSelector", ""))
        except ValueError as exc:
            return _status(400, "BadRequest", str(exc))
        if parse_bool(query.get("watch", "")):
            return await self._watch(request, resource, query, matches)
        api_version, _, list_kind, builtin = RESOURCES[resource]
        items = []
        for key in sorted(self._objects[resource]):
            obj = self._objects[resource][key]
            if matches(obj):
                item = copy.deepcopy(obj)
                if builtin:
                    del item["apiVersion"], item["kind"]
                items.append(item)
        body = {"kind": list_kind, "apiVersion": api_version, "metadata": {"resourceVersion": str(self._rv)},
                "items": items}
        if self.validate_list is not None:
            self.validate_list(body)
        return web.json_response(body)

    async def _watch(self, request: web.Request, resource: str, query: dict[str, str],
                     matches: Callable[[dict[str, Any] | None], bool]) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        limits = [float(query["timeoutSeconds"])] if "timeoutSeconds" in query else []
        if self.watch_cap_s is not None:
            limits.append(self.watch_cap_s)
        deadline = loop.time() + min(limits) if limits else None
        bookmarks = parse_bool(query.get("allowWatchBookmarks", "")) and self.bookmark_interval_s is not None
        ended = self._end_watches
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        api_version, kind, _, _ = RESOURCES[resource]

        async def send(event_type: str, obj: dict[str, Any]) -> None:
            await response.write(json.dumps({"type": event_type, "object": obj}).encode() + b"\n")

        since = query.get("resourceVersion", "")
        if since in ("", "0"):
            sent = self._rv
            for key in sorted(self._objects[resource]):
                if matches(self._objects[resource][key]):
                    await send("ADDED", self._objects[resource][key])
        else:
            sent = int(since)
            if sent < self._compacted_rv:
                await send("ERROR", {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                     "message": f"too old resource version: {sent} ({self._compacted_rv})",
                                     "reason": "Expired", "code": 410})
                self.expired_sent += 1
                await response.write_eof()
                return response
        next_bookmark = loop.time() + (self.bookmark_interval_s or 0)
        while True:
            if self.stall_watches:
                await asyncio.sleep(0.01)
                if ended.is_set() or (deadline is not None and loop.time() >= deadline):
                    break
                continue
            tick = self._tick  # before the snapshot: a change made while we write wakes the wait below
            upto = self._rv
            for change in list(self._history):
                if change.rv <= sent or change.rv > upto or change.resource != resource:
                    continue
                was, now = matches(change.old), matches(change.new)
                if now:
                    await send("MODIFIED" if was else "ADDED", change.new)
                elif was:
                    # Deleted, or no longer matching the selector: the watcher sees it go.
                    last = change.old if change.new is None else change.new
                    await send("DELETED", last)
            sent = upto
            now_s = loop.time()
            if deadline is not None and now_s >= deadline:
                break
            if bookmarks and now_s >= next_bookmark:
                await send("BOOKMARK", {"kind": kind, "apiVersion": api_version,
                                        "metadata": {"resourceVersion": str(upto), "creationTimestamp": None}})
                self.bookmarks_sent.append(upto)
                next_bookmark = now_s + self.bookmark_interval_s
            waits = [1.0]
            if deadline is not None:
                waits.append(deadline - now_s)
            if bookmarks:
                waits.append(next_bookmark - now_s)
            wait_s = max(min(waits), 0)
            waiters = [asyncio.ensure_future(tick.wait()), asyncio.ensure_future(ended.wait())]
            try:
                await asyncio.wait(waiters, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
            if ended.is_set():
                break
        await response.write_eof()
        return response


def parse_bool(text: str) -> bool:
    """A boolean query parameter as the API server reads it (Go's strconv.ParseBool; the client sends "True")."""
    return text in ("1", "t", "T", "TRUE", "true", "True")


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": message, "reason": reason, "code": code}, status=code)


def _matcher(namespace: str, label_selector: str, field_selector: str) -> Callable[[dict[str, Any] | None], bool]:
    """A predicate for the objects a list or watch in ``namespace`` with these selectors returns."""
    label_terms = []
    for term in filter(None, (t.strip() for t in label_selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            label_terms.append((key.strip(), "!=", value.strip()))
        elif "=" in term:
            key, value = term.split("==", 1) if "==" in term else term.split("=", 1)
            label_terms.append((key.strip(), "=", value.strip()))
        elif term.startswith("!"):
            label_terms.append((term[1:].strip(), "absent", ""))
        elif " in " in term or " notin " in term or "(" in term:
            raise ValueError(f"unable to parse requirement: set-based selector {term!r} not supported by the fake")
        else:
            label_terms.append((term, "exists", ""))
    field_terms = []
    for term in filter(None, (t.strip() for t in field_selector.split(","))):
        key, sep, value = term.partition("=")
        key = key.rstrip("=!")
        if not sep or key not in ("metadata.name", "metadata.namespace"):
            raise ValueError(f'"{term}" is not a known field selector: only "metadata.name", "metadata.namespace"')
        field_terms.append((key.split(".")[1], value.lstrip("="), "!=" in term))

    def matches(obj: dict[str, Any] | None) -> bool:
        if obj is None or obj["metadata"].get("namespace") != namespace:
            return False
        labels = obj["metadata"].get("labels") or {}
        for key, op, value in label_terms:
            if op == "=" and labels.get(key) != value:
                return False
            if op == "!=" and labels.get(key) == value:
                return False
            if op == "exists" and key not in labels:
                return False
            if op == "absent" and key in labels:
                return False
        for key, value, negated in field_terms:
            if (obj["metadata"].get(key) == value) == negated:
                return False
        return True

    return matches
