"""Block keys for prefix caching: a hash chain over a prompt's full KV blocks of token ids.

Owns `block_keys` (the keys of a token sequence's full blocks) and `block_key` (one link of the chain). Pure:
imports only the standard library; no I/O.

A block's key is a hash of (its parent block's key, the block's token ids, extra keys on the first block), so two
sequences share the key of block i exactly when they share all tokens up to the end of block i (and the extra
keys). Only FULL blocks have a key: a partial last block is never cached. This is the scheme of vLLM V1
(vllm/v1/core/kv_cache_utils.py `hash_block_tokens`, `hash_request_tokens` / `get_request_block_hasher`:
``hash((parent_block_hash, curr_block_token_ids_tuple, extra_keys))``).

NOTE: these keys are OURS, not vLLM's. vLLM hashes with Python's ``hash`` or sha256 of a pickle/CBOR encoding and
seeds the first block's parent (``NONE_HASH``) from ``os.urandom`` unless ``PYTHONHASHSEED`` is set, so its
block hashes differ between engine processes and cannot be recomputed outside the engine. Here the key is a
64-bit BLAKE2b digest of a fixed byte encoding: stable across processes, machines and Python versions, so a
router and a sidecar that see the same token ids compute the same keys (the approach of llm-d's KV-cache
indexer, which recomputes block keys from token ids instead of trusting the engine's). What must match vLLM is
only WHICH blocks are equal, and that the chain gives: equal prefixes give equal keys, and nothing else does
(up to 64-bit collisions).

Differences from vLLM: extra keys (a LoRA adapter's name, a ``cache_salt``) enter the first block only; vLLM
puts the LoRA name into every block's extra keys and the salt into the first, but in a chain a change to the
first block changes every later key either way. Multimodal inputs are not modelled.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Sequence

logger = logging.getLogger(__name__)

KEY_DIGEST_BYTES = 8
"""Bytes of the BLAKE2b digest that form a key: keys are ints in [0, 2**64)."""

_PERSON = b"astrolabe-kv-v1"
"""BLAKE2b personalisation: a new encoding gets a new value, so old and new keys never collide."""

_FIRST = b"\x00"
_CHAINED = b"\x01"


def _encode_extra_key(value: str | int | bytes) -> bytes:
    """Tagged, length-prefixed bytes of one extra key (so ("ab", "c") and ("a", "bc") differ)."""
    if isinstance(value, bool):
        raise TypeError(f"extra keys must be str, int or bytes, got bool {value!r}")
    if isinstance(value, str):
        tag, data = b"s", value.encode("utf-8")
    elif isinstance(value, int):
        tag, data = b"i", value.to_bytes((value.bit_length() + 8) // 8 or 1, "little", signed=True)
    elif isinstance(value, bytes):
        tag, data = b"b", value
    else:
        raise TypeError(f"extra keys must be str, int or bytes, got {type(value).__name__}")
    return tag + struct.pack("<I", len(data)) + data


def block_key(parent_key: int | None, token_ids: Sequence[int], extra_keys: Sequence[str | int | bytes] = ()) -> int:
    """Key of one full block.

    Args:
        parent_key: The previous block's key; None for the first block of a sequence.
        token_ids: The block's token ids (block_size of them), each in [0, 2**32).
        extra_keys: What else makes the block's KV differ (LoRA name, cache salt); pass them with the first block.

    Returns:
        The key, an int in [0, 2**64).

    Raises:
        ValueError: A token id outside [0, 2**32), or a parent key outside [0, 2**64).
        TypeError: An extra key that is not str, int or bytes.
    """
    digest = hashlib.blake2b(digest_size=KEY_DIGEST_BYTES, person=_PERSON)
    if parent_key is None:
        digest.update(_FIRST)
    else:
        if not 0 <= parent_key < 1 << 64:
            raise ValueError(f"parent_key must be in [0, 2**64), got {parent_key}")
        digest.update(_CHAINED + parent_key.to_bytes(8, "little"))
    try:
        digest.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    except struct.error as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None
    digest.update(struct.pack("<I", len(extra_keys)))
    for value in extra_keys:
        digest.update(_encode_extra_key(value))
    return int.from_bytes(digest.digest(), "little")


def block_keys(token_ids: Sequence[int], block_size: int,
               extra_keys: Sequence[str | int | bytes] = ()) -> tuple[int, ...]:
    """Keys of the full blocks of a token sequence, first block first (the tokens of a partial last block get none).

    Args:
        token_ids: The sequence (a prompt, or a prompt and its output), each id in [0, 2**32).
        block_size: Tokens per KV block (vLLM `block_size`), >= 1.
        extra_keys: Extra keys of the sequence (LoRA name, cache salt), hashed into the first block.

    Returns:
        ``len(token_ids) // block_size`` keys; key i covers tokens [i * block_size, (i + 1) * block_size).

    Raises:
        ValueError: block_size < 1, or a token id out of range (see `block_key`).
        TypeError: As `block_key`.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    keys: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start:start + block_size], extra_keys if parent is None else ())
        keys.append(parent)
    return tuple(keys)
