"""`astrolabe bench <name>`: one benchmark per module, each with its own `main(argv) -> int` and parser.

Importing this module loads no benchmark; the chosen one is imported on dispatch.
"""

from __future__ import annotations

from astrolabe.cli import dispatch

# benchmark name -> (module, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "tagger": ("bench.tagger_bench", "per-request latency of both length taggers at 1 and 16 concurrent"),
    "predictor": ("bench.predictor_bench", "latency of one prediction (predictor.sim.predict) versus instance size"),
    "cluster": ("bench.cluster", "dispatch policies on a simulated fleet in virtual time: capacity, P99 TTFT"),
    "goodput": ("bench.goodput", "latency objectives and admission under overload on the simulated fleet: goodput"),
    "plugin-overhead": ("bench.plugin_overhead", "cost of the vLLM state plugin: per publish, and throughput A/B"),
    "accuracy": ("bench.accuracy", "predicted vs actual E2E and Po2 hindsight agreement on 2 real vLLM servers"),
    "tracing": ("bench.tracing_cost", "cost of OpenTelemetry tracing per routing decision: off vs on, same run"),
    "extproc": ("bench.extproc_bench", "the extproc's own cost: decisions/s per core, latency added through Envoy, profile"),
    "replicas": ("bench.replicas", "1 vs 2 extproc replicas behind one Envoy: P99 TTFT, herding, a replica killed"),
    "streams": ("bench.streams", "thousands of open streams through Envoy + one extproc: memory per stream, long quiet ones"),
    "kv-events": ("bench.kv_events_bench", "a sidecar's CPU per vLLM KV cache event batch, event and block (decode + index)"),
    "prompt-keys": ("bench.prompt_keys", "block keys per request (tokenize, hash) at 200/4,000/32,000 tokens; state bytes"),
    "sglang-model": ("bench.sglang_model", "SGLang instance predicted with the vLLM V1 vs the SGLang scheduler model: APE, cost"),
}

COMMANDS: dict[str, str] = {name: help_ for name, (_, help_) in BENCHMARKS.items()}
"""Benchmark name -> one-line help, for ``astrolabe --help`` (``astrolabe.cli.NESTED``)."""


def main(argv: list[str]) -> int:
    """Dispatch `argv` to a benchmark; returns its exit status (2 on an unknown name or none)."""
    return dispatch("astrolabe bench", BENCHMARKS, argv)
