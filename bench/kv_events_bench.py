"""`astrolabe bench kv-events`: what vLLM's KV cache events cost a sidecar, per batch, per event and per block.

Builds batches shaped like vLLM's (one engine step's events: ``BlockStored`` per request whose prefill filled
blocks, ``BlockRemoved`` for evicted ones) in the map encoding vLLM 0.32 publishes and the positional encoding
of earlier releases, encodes them with msgpack once, then times `predictor.kv_events.KvEventIndex.on_message`
(decode + key recomputation + index update) over them: the sidecar's CPU per message. Prints a table; no
processes, no network (the ZMQ receive itself is pyzmq's C code and not timed here).

What it does not measure: the engine's side (vLLM encodes each step's batch with msgspec and sends it from a
publisher thread; ``vllm/distributed/kv_events.py`` ``ZmqEventPublisher``).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence

import msgpack

from astrolabe.cli import HelpFormatter
from predictor.kv_events import KvEventIndex


def _batches(num_batches: int, blocks_per_event: int, events_per_batch: int, block_size: int, positional: bool,
             rng: random.Random) -> list[bytes]:
    """Payloads of ``num_batches`` steps: each stores ``events_per_batch`` new chains of ``blocks_per_event`` blocks
    and removes the blocks stored two steps before (a cache at steady state)."""
    payloads = []
    stored: list[list[int]] = []
    next_hash = 1
    for _ in range(num_batches):
        events: list = []
        step_hashes = []
        for _ in range(events_per_batch):
            hashes = list(range(next_hash, next_hash + blocks_per_event))
            next_hash += blocks_per_event
            tokens = [rng.randrange(32_000) for _ in range(blocks_per_event * block_size)]
            step_hashes.extend(hashes)
            if positional:
                events.append(["BlockStored", hashes, None, tokens, block_size, None, "GPU"])
            else:
                events.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                               "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": "GPU",
                               "lora_name": None})
        stored.append(step_hashes)
        if len(stored) > 2:
            old = stored.pop(0)
            events.append(["BlockRemoved", old, "GPU"] if positional else
                          {"type": "BlockRemoved", "block_hashes": old, "medium": "GPU"})
        payloads.append(msgpack.packb([time.time(), events, 0]))
    return payloads


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="astrolabe bench kv-events", description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--batches", type=int, default=2000, help="batches (engine steps) per case (default 2000)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids (default 0)")
    args = parser.parse_args(argv)
    if args.batches < 1 or args.block_size < 1:
        parser.error("--batches and --block-size must be >= 1")
    return args


def main(argv: Sequence[str]) -> int:
    args = _parse_args(argv)
    rng = random.Random(args.seed)
    print(f"KV event batches decoded and applied by one KvEventIndex, {args.batches} batches per case, "
          f"block size {args.block_size}; CPU time (time.process_time)")
    print("(each batch after the second also removes the blocks stored two batches before: one BlockRemoved more)")
    print(f"{'encoding':<11} {'stored/batch':>12} {'blocks/event':>12} {'us/batch':>9} {'us/event':>9} "
          f"{'us/block':>9}")
    for positional in (False, True):
        for events_per_batch, blocks_per_event in ((1, 1), (4, 8), (16, 32)):
            payloads = _batches(args.batches, blocks_per_event, events_per_batch, args.block_size, positional, rng)
            index = KvEventIndex(args.block_size)
            start = time.process_time()
            for seq, payload in enumerate(payloads):
                index.on_message(seq, payload)
            elapsed = time.process_time() - start
            assert index.exact and index.counts.undecodable == 0, index.counts
            num_events = index.counts.events
            num_blocks = args.batches * events_per_batch * blocks_per_event
            print(f"{'positional' if positional else 'map':<11} {events_per_batch:>12} {blocks_per_event:>12} "
                  f"{elapsed / args.batches * 1e6:>9.1f} {elapsed / num_events * 1e6:>9.1f} "
                  f"{elapsed / num_blocks * 1e6:>9.2f}")
    return 0
