"""The approximate prefix-cache index of the cache-aware baselines: which endpoint was sent which KV blocks.

Routers that run without the engines' KV events (llm-d's ``approx-prefix-cache-producer``, the Inference
Extension's ``prefix-cache-scorer``, SGLang's ``cache_aware`` approximate tree, Dynamo's ``ApproxKvIndexer``)
guess each engine's prefix cache from their own routing decisions: the blocks of a request are recorded at the
endpoint it was sent to, and forgotten by a bound on the index. This module is that record, shared by the
baseline policies (``llmd_baseline``, ``gie_prefix``, ``sglang_cache_aware``); each policy states how it reads it.

Keys are ``RoutingRequest.block_keys``: chain hashes of the prompt's full KV blocks, so a key names its whole
prefix and a run of present keys from the first one is a cached prefix.

Shape: ``key -> set of endpoint addresses`` for lookups, and per endpoint an LRU (``OrderedDict``, least recently
used first) bounded by a capacity in entries, set when the endpoint is first recorded (as the upstream LRUs
``github.com/hashicorp/golang-lru`` are sized at creation). Every operation is O(keys touched); memory is
O(sum of capacities).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

from extproc.request import RoutingRequest

CHARS_PER_TOKEN = 4
"""Characters per token of llm-d's tokenizer-free ``estimate`` backend and of GIE's 64-character hash block
(kubernetes-sigs/gateway-api-inference-extension ``pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go``:
"a good guess of average characters per token is 4")."""


class ApproxPrefixIndex:
    """Per-endpoint LRU sets of block keys with a reverse map from key to endpoints.

    Args:
        default_capacity: entries each endpoint's LRU keeps when ``add`` gives no capacity, >= 1.

    Raises:
        ValueError: ``default_capacity`` < 1.
    """

    def __init__(self, default_capacity: int) -> None:
        if default_capacity < 1:
            raise ValueError(f"index capacity must be >= 1, got {default_capacity}")
        self.default_capacity = default_capacity
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    def add(self, keys: Iterable[int], address: str, capacity: int | None = None) -> None:
        """Records ``keys`` at ``address``, each becoming its most recently used entry in the order given, then
        evicts the least recently used entries over the endpoint's capacity.

        Args:
            keys: block keys; their order is the recency order (the last one ends most recent).
            address: the endpoint.
            capacity: the endpoint's LRU size when this is its first record (later calls keep the first size);
                None or < 1 = ``default_capacity``.
        """
        lru = self._lru.get(address)
        if lru is None:
            lru = self._lru[address] = OrderedDict()
            self._capacity[address] = capacity if capacity is not None and capacity >= 1 else self.default_capacity
        holders = self._holders
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                holders.setdefault(key, set()).add(address)
        limit = self._capacity[address]
        while len(lru) > limit:
            evicted, _ = lru.popitem(last=False)
            owners = holders[evicted]
            owners.discard(address)
            if not owners:
                del holders[evicted]

    def holders(self, key: int) -> set[str]:
        """Endpoints whose LRU holds ``key`` (a live view: do not modify); empty when none."""
        return self._holders.get(key, _EMPTY)

    def match_counts(self, keys: Sequence[int]) -> dict[str, int]:
        """GIE's ``matchLongestPrefix``: walks ``keys`` from the first while some endpoint holds the key, counting
        for each endpoint the walked keys it holds (not necessarily a contiguous run of its own).

        Returns:
            address -> number of matched keys; endpoints with none are absent.
        """
        counts: dict[str, int] = {}
        for key in keys:
            owners = self._holders.get(key)
            if not owners:
                break
            for address in owners:
                counts[address] = counts.get(address, 0) + 1
        return counts

    def size(self, address: str) -> int:
        """Entries the endpoint's LRU holds."""
        lru = self._lru.get(address)
        return 0 if lru is None else len(lru)

    def capacity(self, address: str) -> int | None:
        """The endpoint's LRU size, None when it was never recorded."""
        return self._capacity.get(address)


_EMPTY: set[str] = set()


def leading_run(keys: Sequence[int], held: Container[int]) -> int:
    """How many of ``keys``, from the first, ``held`` contains, by bisection: O(log len(keys)) lookups.

    Exact when ``held`` is a set of whole prefixes (with each key, the keys of its prefix), as the blocks of a set of
    requests are: ``keys`` are chain hashes, so a key held means its prefix's keys are held too. For a set that is
    not (an LRU that evicted a prefix's first blocks), it is some run boundary, not necessarily the first.
    """
    low, high = 0, len(keys)
    while low < high:
        middle = (low + high) // 2
        if keys[middle] in held:
            low = middle + 1
        else:
            high = middle
    return low


def prompt_tokens(request: RoutingRequest, block_size: int) -> int:
    """The request's prompt length in tokens as the baselines count it.

    ``len(block_keys) * block_size`` when the request has block keys (the partial last block, fewer than
    ``block_size`` tokens, is not counted); else the token-id prompt's length; else the prompt text's characters
    / ``CHARS_PER_TOKEN`` (llm-d's ``estimate`` token backend); 0 without any of them.
    """
    if request.block_keys is not None:
        return len(request.block_keys) * block_size
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    return len(request.prompt_text or "") // CHARS_PER_TOKEN
