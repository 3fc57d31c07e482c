"""`astrolabe bench prompt-keys`: what block keys cost on the request path, and on the wire.

Per request (``extproc.prompt_tokens.PromptTokenCounter.tokens``, what the router runs before it predicts), for
prompts of about 200, 4,000 and 32,000 tokens (``--tokens``): the milliseconds spent tokenizing the whole prompt
(the served model's tokenizer with ``--tokenizer``, else the shipped WordPiece) and hashing its full blocks
(``predictor.sim.block_hash.block_keys``), each the median and p99 over ``--repeats`` calls on one thread, beside
the count without keys (``prefix_cache.enabled: false``: text past 8,192 characters extrapolated).

``--state``: the bytes of one watched ``InstanceState`` (``predictor.instance_state``) at 64 and 256 requests in
state, without keys, with keys of prompts that share nothing, and with keys of prompts that share a system
prompt (``--shared-prefix`` tokens), each with ``--cached-blocks`` cached free block keys, and what encoding and
decoding one costs. Prompt lengths: ``--state-prompt-tokens`` each (a fixed length: the figure scales with it).

Figures depend on the machine and on what else runs on it; nothing here asserts a target.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from astrolabe.cli import HelpFormatter
from extproc.prompt_tokens import PromptTokenCounter
from extproc.request import RoutingRequest
from predictor.instance_state import Corrections, decode, encode
from predictor.sim import EngineConfig, LinearBatchTimeModel
from predictor.sim.block_hash import block_keys
from predictor.sim.snapshot import InstanceSnapshot, RequestState

DEFAULT_TOKENS = (200, 4000, 32000)
WORDS = ("the model cache prefix block decode prefill token request engine latency queue batch memory answer "
         "question user system assistant document section example code function value error result time first "
         "last many each other which would could should about between through during before after under over "
         "again further then once here there when where why how all any both few more most some such only own "
         "same than too very can will just don now").split()
MODEL = "bench-model"


def prompt_of(num_tokens: int, counter: PromptTokenCounter, rng: random.Random) -> str:
    """A text of about ``num_tokens`` tokens as ``counter`` tokenizes it (words drawn from `WORDS`)."""
    sample = " ".join(rng.choice(WORDS) for _ in range(1000))
    per_word = len(counter.token_ids(RoutingRequest("s", "POST", "/v1/completions", model=MODEL,
                                                    prompt_text=sample))) / 1000
    return " ".join(rng.choice(WORDS) for _ in range(max(round(num_tokens / per_word), 1)))


def _ms(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered) * 1e3, ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3


def request_costs(counter: PromptTokenCounter, plain: PromptTokenCounter, sizes, repeats: int, chat: bool,
                  rng: random.Random) -> list[str]:
    """One table row per size: tokens, tokenize / hash / whole-call / keys-off medians and p99s, ms."""
    rows = []
    for size in sizes:
        text = prompt_of(size, counter, rng)
        request = (RoutingRequest("r", "POST", "/v1/chat/completions", model=MODEL, prompt_text=text,
                                  chat_messages=(("user", text),), last_user_message=text) if chat else
                   RoutingRequest("r", "POST", "/v1/completions", model=MODEL, prompt_text=text))
        tokenize, hashing, whole, off = [], [], [], []
        ids = counter.token_ids(request)
        for _ in range(repeats):
            t0 = time.perf_counter()
            ids = counter.token_ids(request)
            t1 = time.perf_counter()
            block_keys(ids, counter.block_size)
            t2 = time.perf_counter()
            counter.tokens(request)
            t3 = time.perf_counter()
            plain.tokens(request)
            t4 = time.perf_counter()
            tokenize.append(t1 - t0)
            hashing.append(t2 - t1)
            whole.append(t3 - t2)
            off.append(t4 - t3)
        cells = [f"{m:8.3f} / {p:8.3f}" for m, p in map(_ms, (tokenize, hashing, whole, off))]
        rows.append(f"{len(ids):>8} {len(text):>9}  " + "  ".join(cells))
    return rows


def state_sizes(num_requests_list, prompt_tokens: int, shared_prefix: int, cached_blocks: int, block_size: int,
                repeats: int, rng: random.Random) -> list[str]:
    """One row per (requests, kind): bytes of the encoded state, encode and decode medians, ms."""
    config = EngineConfig(block_size=block_size, num_gpu_blocks=max(65536, cached_blocks * 2))
    batch_time = LinearBatchTimeModel("bench", 0.01, 1e-4, 0.0, 1e-5, 1e-4)
    system = [rng.randrange(1 << 15) for _ in range(shared_prefix)]
    cached = tuple(rng.getrandbits(64) for _ in range(cached_blocks))
    rows = []
    for num_requests in num_requests_list:
        for kind in ("no keys", "keys, nothing shared", f"keys, {shared_prefix}-token system prompt"):
            requests = []
            for i in range(num_requests):
                keys = None
                if kind != "no keys":
                    own = [rng.randrange(1 << 15) for _ in range(prompt_tokens - (shared_prefix if "system" in kind
                                                                                  else 0))]
                    keys = block_keys((system if "system" in kind else []) + own, block_size)
                running = i < num_requests // 4
                requests.append(RequestState(f"r{i}", prompt_tokens, 200, num_computed_tokens=prompt_tokens if running
                                             else 0, num_generated_tokens=1 if running else 0, block_keys=keys))
            n_run = num_requests // 4
            snapshot = InstanceSnapshot(config, 0.0, running=tuple(requests[:n_run]), waiting=tuple(requests[n_run:]),
                                        cached_block_keys=cached if kind != "no keys" else ())
            encode_s, decode_s = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                message = encode(snapshot, batch_time, Corrections(), seq=1, lag_s=0.0, state_age_s=0.0,
                                 admits_seen=0, model_error=0.0, state_source="ledger")
                data = message.SerializeToString()
                t1 = time.perf_counter()
                decode(type(message).FromString(data))
                t2 = time.perf_counter()
                encode_s.append(t1 - t0)
                decode_s.append(t2 - t1)
            rows.append(f"{num_requests:>8}  {kind:<34} {len(data):>10,} {statistics.median(encode_s) * 1e3:9.2f} "
                        f"{statistics.median(decode_s) * 1e3:9.2f}")
    return rows


def main(argv: list[str]) -> int:
    """Entry point of `astrolabe bench prompt-keys`: prints the tables; returns 0 (2 on bad arguments)."""
    parser = argparse.ArgumentParser(prog="astrolabe bench prompt-keys", description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS),
                        help="prompt sizes, tokens (approximate: the texts are built to about this many)")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer.json or model directory (with a chat template: --chat renders it); "
                             "default: the shipped WordPiece")
    parser.add_argument("--chat", action="store_true", help="one-message chat requests (the template rendered)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block, tokens")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per size")
    parser.add_argument("--state", action="store_true", help="also the watched state's bytes at 64 and 256 requests")
    parser.add_argument("--state-prompt-tokens", type=int, default=1024, help="each state request's prompt, tokens")
    parser.add_argument("--shared-prefix", type=int, default=512, help="the shared system prompt, tokens")
    parser.add_argument("--cached-blocks", type=int, default=4096, help="cached free block keys in each state")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts' words and the states' token ids")
    args = parser.parse_args(argv)
    if args.block_size < 1 or args.repeats < 1 or min(args.tokens) < 1:
        parser.error("--block-size, --repeats and --tokens must be >= 1")
    if not 0 <= args.shared_prefix <= args.state_prompt_tokens:
        parser.error("--shared-prefix must be in [0, --state-prompt-tokens]")
    rng = random.Random(args.seed)
    tokenizers = {MODEL: args.tokenizer} if args.tokenizer else None
    counter = PromptTokenCounter(tokenizers, block_size=args.block_size, max_keyed_chars=1 << 30)
    plain = PromptTokenCounter(tokenizers)
    print(f"block keys per request ({args.tokenizer or 'shipped WordPiece'}, block_size {args.block_size}, "
          f"{'chat' if args.chat else 'completions'}; median / p99 over {args.repeats} calls, ms)")
    print(f"{'tokens':>8} {'chars':>9}  {'tokenize':>19}  {'hash':>19}  {'tokens() keyed':>19}  {'keys off':>19}")
    for row in request_costs(counter, plain, args.tokens, args.repeats, args.chat, rng):
        print(row)
    if args.state:
        print(f"\nwatched state (InstanceState) size: {args.state_prompt_tokens}-token prompts, a quarter running, "
              f"{args.cached_blocks} cached free block keys with keys; encode / decode median, ms")
        print(f"{'requests':>8}  {'kind':<34} {'bytes':>10} {'encode':>9} {'decode':>9}")
        for row in state_sizes((64, 256), args.state_prompt_tokens, args.shared_prefix, args.cached_blocks,
                               args.block_size, max(args.repeats // 3, 3), rng):
            print(row)
    return 0
