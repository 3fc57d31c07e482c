"""Holds: requests a Predict counted on this instance before the router chose where they go.

Why: concurrent routing decisions must see each other. A decision asks k sidecars, waits for their answers and only
then chooses; without holds every decision of a burst is answered from the state before any of them is admitted,
and they all pick the same idle-looking instance (measured through Envoy: 26 of 64 simultaneous requests on one of
8 idle instances). With holds, a Predict that asks for one (``PredictRequest.hold_s`` > 0, protocol v1.1) counts its
request here as admitted and waiting from the moment it is answered, so every later Predict of this sidecar (from
any extproc replica or worker process) is answered with it included. The router then confirms the hold at the
instance it chose (``Admit``: the request stays counted, from the Predict's time) and drops it at the others
(``Release``); a hold nobody confirms or drops (a lost notice, a router that died) ends after ``hold_s`` seconds.

A two-phase (tentative, then confirmed) admission: it over-counts the k - 1 instances not chosen for the few
milliseconds between their answer and the router's Release, the same for every candidate of a decision, so it
does not bias a choice.

Each hold remembers which router asked (``router_id``): a router's own holds are left out of the answers to that
router, which knows its own decisions exactly (``PredictResponse.admits_seen``, extproc/router.py); counted
there as well, a burst from one router would be answered with every concurrent decision's k probes counted as
load, noise that no choice can learn from.

This module only keeps the bookkeeping (which ids are held, by whom, since when, until when); the sidecar
(``predictor/server.py``) adds a held request to its state and removes it. Runs on one thread (the sidecar's event
loop); times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_HOLDS = 4096
"""Most holds kept at once; beyond it the oldest is dropped first (a router flooding Predicts that it never
confirms must not grow the sidecar's state without bound: the ledger holds at most 4,096 requests too)."""

MAX_HOLD_S = 10.0
"""Longest hold honoured, seconds: a larger ``hold_s`` is cut to it (a hold is meant to span one decision)."""


@dataclass(frozen=True, slots=True)
class Hold:
    """One held request.

    Attributes:
        held_s: when its Predict was answered, seconds (monotonic): the request counts from then.
        until_s: when the hold ends unless confirmed, seconds (monotonic).
        router_id: the router that asked (``PredictRequest.router_id``; 0 = anonymous).
    """

    held_s: float
    until_s: float
    router_id: int = 0


class Holds:
    """Held request ids in the order they were held (expiry is checked oldest first).

    Attributes:
        num_held: holds taken so far (a running total).
        num_confirmed: holds an Admit confirmed.
        num_dropped: holds a Release dropped (the router chose another instance).
        num_expired: holds that ended unconfirmed (or were pushed out by `MAX_HOLDS`).
    """

    def __init__(self, max_holds: int = MAX_HOLDS) -> None:
        self._max_holds = max_holds
        self._holds: dict[str, Hold] = {}
        self._by_router: dict[int, set[str]] = {}
        self.num_held = self.num_confirmed = self.num_dropped = self.num_expired = 0

    def __len__(self) -> int:
        return len(self._holds)

    def num_held_for_others(self, router_id: int) -> int:
        """Holds not taken for ``router_id`` (all of them for 0)."""
        return len(self._holds) - len(self.held_by(router_id))

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._holds

    def held_by(self, router_id: int) -> frozenset[str] | set[str]:
        """The ids held for ``router_id`` now (empty for 0: anonymous holds are everyone's). Do not modify."""
        return self._by_router.get(router_id, frozenset()) if router_id else frozenset()

    def hold(self, request_id: str, now_s: float, hold_s: float, router_id: int = 0) -> list[str]:
        """Holds ``request_id`` from ``now_s`` for ``hold_s`` seconds (cut to `MAX_HOLD_S`) for ``router_id``.

        Returns:
            Ids pushed out to keep at most ``max_holds`` (oldest first): the caller stops counting them.

        Raises:
            ValueError: ``hold_s`` is not a finite number > 0, or ``request_id`` is already held.
        """
        if not 0 < hold_s < float("inf"):
            raise ValueError(f"hold_s must be a finite number > 0, got {hold_s!r}")
        if request_id in self._holds:
            raise ValueError(f"request {request_id!r} is already held")
        self._holds[request_id] = Hold(now_s, now_s + min(hold_s, MAX_HOLD_S), router_id)
        if router_id:
            self._by_router.setdefault(router_id, set()).add(request_id)
        self.num_held += 1
        pushed = []
        while len(self._holds) > self._max_holds:
            pushed.append(next(iter(self._holds)))
            self._pop(pushed[-1])
        self.num_expired += len(pushed)
        return pushed

    def _pop(self, request_id: str) -> Hold | None:
        hold = self._holds.pop(request_id, None)
        if hold is not None and hold.router_id:
            ids = self._by_router[hold.router_id]
            ids.discard(request_id)
            if not ids:
                del self._by_router[hold.router_id]
        return hold

    def confirm(self, request_id: str) -> Hold | None:
        """The router chose this instance: the hold ends, the request stays. Returns the hold, or None if
        ``request_id`` is not held (never held, expired or dropped)."""
        hold = self._pop(request_id)
        if hold is not None:
            self.num_confirmed += 1
        return hold

    def drop(self, request_id: str) -> bool:
        """The router chose another instance (or the request ended): the hold ends and the caller stops counting
        the request. Returns whether it was held."""
        if self._pop(request_id) is None:
            return False
        self.num_dropped += 1
        return True

    def expired(self, now_s: float) -> list[str]:
        """Removes and returns the holds that ended unconfirmed by ``now_s`` (oldest first). Holds are checked in
        the order they were taken and the scan stops at the first one still in force, so a hold with a longer
        ``hold_s`` behind it may outlive a shorter one after it by at most the difference (one router uses one
        ``hold_s``)."""
        gone = []
        for request_id, hold in self._holds.items():
            if hold.until_s > now_s:
                break
            gone.append(request_id)
        for request_id in gone:
            self._pop(request_id)
        self.num_expired += len(gone)
        return gone

    def as_dict(self) -> dict:
        """Counts for the sidecar's ``State`` (JSON-ready)."""
        return {"held_now": len(self._holds), "held": self.num_held, "confirmed": self.num_confirmed,
                "dropped": self.num_dropped, "expired": self.num_expired}
