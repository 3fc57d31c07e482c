"""Early releases: Releases that arrived before their request's Admit, so that the late Admit is not counted.

Why: a router sends a request's Admit and, when the request ends, its Release, without waiting for either
(``extproc/predictor_client.py``). They can travel on different gRPC calls: a sampled (traced) request's Admit is
always a unary call while its Release rides the Notify stream, an Admit sent while that stream opens goes unary, and
with ``notices: unary`` each is its own call. The sidecar serves calls concurrently, so a request that ends within a
few milliseconds (an error answer, one token) can have its Release handled first: the Release finds nothing to end,
and the Admit that follows adds a request nothing will ever release. The ledger counts an admitted request as
running until its Release (its output length is open-ended), so without this the sidecar counts a ghost until
reconciliation with the engine's ``/metrics`` removes it, and for ever with no engine to reconcile with (seen in
tests/extproc/test_prefix_keys_routing.py).

A Release of an id that is neither held nor in the ledger is remembered for `EARLY_RELEASE_TTL_S`; an Admit of a
remembered id is then not counted. A Release also finds nothing when the request already finished in the
simulation or was reconciled away: those ids are remembered too, harmlessly, since request ids are not reused (a
client that reuses an ``x-request-id`` within the TTL after such a Release loses one request from the count).
Runs on one thread (the sidecar's event loop); times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import collections

EARLY_RELEASE_TTL_S = 30.0
"""How long a Release of an unknown id waits for its Admit, seconds (an Admit is a notice that takes milliseconds;
the router's notify timeout is seconds)."""

MAX_EARLY_RELEASES = 4096
"""Most ids remembered at once; beyond it the oldest is forgotten first (a flood of Releases of unknown ids must not
grow the sidecar's memory without bound)."""


class EarlyReleases:
    """Ids released before any Admit, oldest first, each for `EARLY_RELEASE_TTL_S` seconds.

    Attributes:
        num_ignored_admits: Admits not counted because their Release came first (a running total).
    """

    def __init__(self, ttl_s: float = EARLY_RELEASE_TTL_S, max_ids: int = MAX_EARLY_RELEASES) -> None:
        self._ttl_s = ttl_s
        self._max_ids = max_ids
        self._released: collections.OrderedDict[str, float] = collections.OrderedDict()  # id -> released at
        self.num_ignored_admits = 0

    def __len__(self) -> int:
        return len(self._released)

    def release(self, request_id: str, now_s: float) -> None:
        """Remembers that ``request_id`` was released at ``now_s`` with nothing to end."""
        self._expire(now_s)
        self._released[request_id] = now_s
        self._released.move_to_end(request_id)
        while len(self._released) > self._max_ids:
            self._released.popitem(last=False)

    def admit_came_late(self, request_id: str, now_s: float) -> bool:
        """Whether ``request_id``'s Release came before this Admit (within the TTL): the Admit must not be counted.
        Forgets the id either way."""
        self._expire(now_s)
        if self._released.pop(request_id, None) is None:
            return False
        self.num_ignored_admits += 1
        return True

    def _expire(self, now_s: float) -> None:
        released = self._released
        while released and next(iter(released.values())) < now_s - self._ttl_s:
            released.popitem(last=False)
