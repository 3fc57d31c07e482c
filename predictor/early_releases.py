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

A Release of an id that this sidecar neither holds nor counts (not in its ledger, no plugin-mode admission record)
is remembered for `EARLY_RELEASE_TTL_S`; an Admit of a remembered id is then not counted. A Release also finds
nothing when the request already finished in the simulation or was reconciled away: those ids are remembered too,
harmlessly, since the router gives every decision its own id (``{x-request-id}/{uuid}``, ``extproc/router.py``), so
an id does not come back after its Release. One exception is left out on purpose: a Release that drops a
Predict's hold (a candidate not chosen, protocol v1.1) is not remembered, since the router Admits that same id at
such a candidate when Envoy served the request elsewhere than chosen (``Router.served``); the race a hold leaves
(the chosen instance's confirming Admit handled after the request's Release) stays, and is rarer still, as that
Admit leaves at the decision, a whole request before the Release. Ids are kept as their hash (a fixed 8 bytes
each, whatever a router sends). Runs on one thread (the sidecar's event loop); times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import collections

EARLY_RELEASE_TTL_S = 5.0
"""How long a Release of an unknown id waits for its Admit, seconds: ten times the router's deadline on a unary
Admit (``PredictorClientConfig.notify_timeout_s``, 0.5 s)."""

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
        self._released: collections.OrderedDict[int, float] = collections.OrderedDict()  # hash(id) -> released at
        self.num_ignored_admits = 0

    def __len__(self) -> int:
        return len(self._released)

    def release(self, request_id: str, now_s: float) -> None:
        """Remembers that ``request_id`` was released at ``now_s`` with nothing to end."""
        self._expire(now_s)
        key = hash(request_id)
        self._released[key] = now_s
        self._released.move_to_end(key)
        while len(self._released) > self._max_ids:
            self._released.popitem(last=False)

    def admit_came_late(self, request_id: str, now_s: float) -> bool:
        """Whether ``request_id``'s Release came before this Admit (within the TTL): the Admit must not be counted.
        Forgets the id either way."""
        self._expire(now_s)
        if self._released.pop(hash(request_id), None) is None:
            return False
        self.num_ignored_admits += 1
        return True

    def _expire(self, now_s: float) -> None:
        released = self._released
        while released and next(iter(released.values())) < now_s - self._ttl_s:
            released.popitem(last=False)
