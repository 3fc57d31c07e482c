"""KV-cache block accounting for the simulated engine, by count only.

Owns `BlockPool` (how many of the instance's GPU KV blocks are free) and `blocks_for_tokens`, the ONLY
place in the code base where a token count becomes a block count. Imports only the standard library.

Source: vllm/v1/core/kv_cache_manager.py `KVCacheManager.allocate_slots` and vllm/v1/core/block_pool.py
(vLLM V1). Differences: no block identities (a request's blocks are a count, held by the scheduler), so no
prefix caching and no eviction order; one KV-cache group. `predictor.sim.prefix_cache.PrefixCachePool` extends
it with prefix caching (the scheduler's pool).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Number of KV blocks needed to hold `num_tokens` tokens.

    Args:
        num_tokens: Tokens to hold, >= 0.
        block_size: Tokens per KV block, >= 1.

    Returns:
        ceil(num_tokens / block_size) blocks (vLLM `cdiv`).

    Raises:
        ValueError: If num_tokens < 0 or block_size < 1.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return -(-num_tokens // block_size)


class BlockPool:
    """Free/used counts of an instance's GPU KV blocks.

    Args:
        num_gpu_blocks: Total KV blocks of the instance (vLLM `num_gpu_blocks`), >= 1.

    Raises:
        ValueError: If num_gpu_blocks < 1.
    """

    __slots__ = ("_num_gpu_blocks", "_num_free_blocks")

    def __init__(self, num_gpu_blocks: int) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {num_gpu_blocks}")
        self._num_gpu_blocks = num_gpu_blocks
        self._num_free_blocks = num_gpu_blocks

    @property
    def num_gpu_blocks(self) -> int:
        """Total blocks."""
        return self._num_gpu_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request."""
        return self._num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests."""
        return self._num_gpu_blocks - self._num_free_blocks

    def allocate(self, num_blocks: int) -> bool:
        """Take `num_blocks` blocks if that many are free (all or nothing).

        Args:
            num_blocks: Blocks to take, >= 0.

        Returns:
            True if taken; False (nothing changed) if fewer are free.

        Raises:
            ValueError: If num_blocks < 0.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self._num_free_blocks:
            return False
        self._num_free_blocks -= num_blocks
        return True

    def free(self, num_blocks: int) -> None:
        """Return `num_blocks` blocks to the pool.

        Args:
            num_blocks: Blocks to return, >= 0.

        Raises:
            ValueError: If num_blocks < 0 or more blocks would be free than exist (a double free).
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if self._num_free_blocks + num_blocks > self._num_gpu_blocks:
            raise ValueError(
                f"freeing {num_blocks} blocks would exceed num_gpu_blocks={self._num_gpu_blocks} "
                f"(free={self._num_free_blocks})"
            )
        self._num_free_blocks += num_blocks
