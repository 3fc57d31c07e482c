"""`astrolabe bench tracing`: what tracing costs a routing decision, tracing off against on, in the same run.

Setup, all real processes on loopback: 2 emulated instances, each with its predictor sidecar (tracing on with
``OTEL_TRACES_SAMPLER=parentbased_always_off``: a sidecar records exactly the traces a sampled caller sends it), an
OTLP/gRPC receiver process (``bench.otlp_receiver``, spans to a file), and two extproc processes (astrolabe policy,
k = 2, the shipped light tagger) identical but for their ``tracing:`` section: one off, one exporting every trace
(``sampler_ratio: 1``) to the receiver. The bench is the ext_proc client, as Envoy is: a decision is one
``Process`` stream in BUFFERED mode (headers, then a chat body), timed from sending the headers to receiving the
routing answer; the stream is then closed (the request's Release). Rounds alternate an off block and an on block
of the same requests in the same order, so the two modes pair by position and the machine's drift cancels.

Figures, per mode: p50 / p99 decision latency (client side, ms), the extproc's own routing time (its decision
log's ``routing_s``: headers to decision), CPU per decision of the extproc process (user + system from /proc over
its blocks, ms), and spans received per decision; then the on/off ratio of each, the p50 ratio with its 95% paired
moving-block bootstrap interval (`bench.stats`). Last, the cost of the tracing hooks while off, timed in process
(the stream's calls on the no-op span, per decision, µs). Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
import timeit
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from astrolabe.cli import HelpFormatter
from astrolabe.logs import setup_logging
from bench import otlp_receiver
from bench.decisions import read_decisions
from bench.demo_fleet import cpu_seconds
from bench.extproc_drive import (MODEL, START_TIMEOUT_S, drive_block, prompts,  # noqa: F401 (MODEL: re-exported)
                                 start_extproc, start_fleet)
from astrolabe.procs import ProcessGroup
from bench.stats import p50, p99, paired_ratio_ci

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModeResult:
    """One mode's decisions, pooled over its blocks (position order within each block, blocks in order).

    Attributes:
        latency_s: client-side decision latency per decision, seconds.
        routing_s: the extproc's headers-to-decision time per decision (its decision log), seconds.
        cpu_s: the extproc process's CPU over its blocks, seconds.
        num_spans: spans received in the traces of this mode's decisions (the extproc's and the sidecars').
    """

    latency_s: list[float]
    routing_s: list[float]
    cpu_s: float
    num_spans: int


def spans_per_mode(spans_file: Path) -> Counter:
    """Spans of each mode's traces in the receiver's file: a trace belongs to the mode its route span's request id
    starts with (``off-`` / ``on-``; warm-up traces and traces without a route span are not counted)."""
    records = [json.loads(line) for line in spans_file.read_text(encoding="utf-8").splitlines() if line]
    mode_of_trace = {r["trace_id"]: r["attributes"].get("astrolabe.request_id", "").split("-", 1)[0]
                     for r in records if r["name"] == "astrolabe.route"}
    return Counter(mode_of_trace.get(r["trace_id"]) for r in records)


def run(num_requests: int, num_rounds: int, concurrency: int, seed: int, trace_sidecars: bool = True,
        sampler_ratio: float = 1.0, control: bool = False) -> tuple[ModeResult, ModeResult]:
    """Runs the A/B (module docstring); returns (off, on). ``trace_sidecars`` False leaves the sidecars untraced
    (only the extproc's own cost is compared); ``sampler_ratio`` is the traced extproc's ``tracing.sampler_ratio``;
    ``control`` leaves the "on" extproc untraced too (an A/A run: the set-up's own noise).

    Raises:
        astrolabe.procs.ProcessStartError: a process did not start.
        RuntimeError: a decision was answered with an error.
    """
    bodies = prompts(num_requests, seed)
    with tempfile.TemporaryDirectory(prefix="astrolabe-tracing-cost-") as folder, ProcessGroup() as procs:
        tmp = Path(folder)
        spans_file = tmp / "spans.jsonl"
        endpoint = "http://" + otlp_receiver.start_process(procs, spans_file, tmp / "receiver.log", START_TIMEOUT_S)
        fleet, sidecars = start_fleet(procs, tmp, endpoint if trace_sidecars else None)
        tracing = None if control else {"tracing": {"endpoint": endpoint, "sampler_ratio": sampler_ratio}}
        extprocs = {"off": start_extproc(procs, tmp, "extproc-off", fleet),
                    "on": start_extproc(procs, tmp, "extproc-on", fleet, tracing)}
        drive_block(extprocs["off"][1], bodies[:8], "warm-off", 1)  # connections, tokenizer, first refit
        drive_block(extprocs["on"][1], bodies[:8], "warm-on", 1)
        latency = {"off": [], "on": []}
        cpu_s = {"off": 0.0, "on": 0.0}
        for round_index in range(num_rounds):
            for mode in ("off", "on"):
                proc, address, _ = extprocs[mode]
                cpu_before_s = cpu_seconds(proc.pid)
                latency[mode] += drive_block(address, bodies, f"{mode}-{round_index}", concurrency)
                cpu_s[mode] += cpu_seconds(proc.pid) - cpu_before_s
        for proc in [p for p, _, _ in extprocs.values()] + sidecars:
            proc.stop()  # SIGTERM: decision logs flushed, queued spans exported
        time.sleep(0.5)  # the receiver writes the last exports
        routing = {mode: [r["routing_s"] for r in read_decisions([log]) if not r["request_id"].startswith("warm")]
                   for mode, (_, _, log) in extprocs.items()}
        spans = spans_per_mode(spans_file)
    return tuple(ModeResult(latency[m], routing[m], cpu_s[m], spans[m]) for m in ("off", "on"))


def off_hook_cost_us(repeats: int = 20000) -> float:
    """The stream's tracing calls while off (`extproc.spans.NO_SPAN`), per decision, microseconds (in process)."""
    from extproc.decision import Decision  # noqa: PLC0415
    from extproc.request import RoutingRequest  # noqa: PLC0415
    from extproc.spans import NO_SPAN  # noqa: PLC0415

    headers = {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": "x"}
    request, decision = RoutingRequest("x", "POST", "/v1/chat/completions"), Decision("127.0.0.1:1", "astrolabe")

    def hooks() -> None:
        NO_SPAN.start(headers, "x")
        NO_SPAN.request(request)
        with NO_SPAN.activated():
            pass
        NO_SPAN.decision(decision, "astrolabe")
        NO_SPAN.upstream_headers()
        NO_SPAN.end("abandoned")

    return min(timeit.repeat(hooks, number=repeats, repeat=5)) / repeats * 1e6


def format_report(off: ModeResult, on: ModeResult, hooks_us: float) -> str:
    """The table of the module docstring, as text."""
    n = len(off.latency_s)
    rows = []
    for name, result in (("off", off), ("on", on)):
        lat, routing = np.array(result.latency_s), np.array(result.routing_s)
        rows.append(f"{name:<12} {n:>9} {p50(lat) * 1e3:>14.3f} {p99(lat) * 1e3:>14.3f} "
                    f"{p50(routing) * 1e3:>15.3f} {result.cpu_s / n * 1e3:>13.3f} {result.num_spans / n:>10.2f}")
    ratio = paired_ratio_ci(on.latency_s, off.latency_s, p50)
    lines = [
        f"{'tracing':<12} {'decisions':>9} {'decision p50':>14} {'decision p99':>14} {'routing_s p50':>15} "
        f"{'CPU ms/dec':>13} {'spans/dec':>10}",
        *rows,
        f"on / off: decision p50 {ratio.value:.3f} [95% interval {ratio.low:.3f}, {ratio.high:.3f}], "
        f"p99 {p99(np.array(on.latency_s)) / p99(np.array(off.latency_s)):.3f}, "
        f"routing_s p50 {p50(np.array(on.routing_s)) / p50(np.array(off.routing_s)):.3f}, "
        f"CPU per decision {on.cpu_s / off.cpu_s:.3f}",
        f"tracing off: the stream's no-op span calls cost {hooks_us:.2f} us per decision (in process)",
        "decision = ext_proc headers sent -> routing answer received (ms, client side, as Envoy sees it); routing_s = "
        "the extproc's own headers-to-decision time (decision log); CPU = the extproc process's user+system time "
        "over its blocks; spans/dec = spans the OTLP receiver got per decision (extproc, sidecars)",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Entry point of `astrolabe bench tracing`; prints the report; returns 0."""
    parser = argparse.ArgumentParser(prog="astrolabe bench tracing", description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--num-requests", type=int, default=200, help="decisions per block (default 200)")
    parser.add_argument("--rounds", type=int, default=5, help="off/on block pairs (default 5)")
    parser.add_argument("--concurrency", type=int, default=1, help="streams in flight at once (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts (default 0)")
    parser.add_argument("--untraced-sidecars", action="store_true",
                        help="sidecars without tracing: compare the extproc's own cost only (default: traced)")
    parser.add_argument("--sampler-ratio", type=float, default=1.0,
                        help="the traced extproc's tracing.sampler_ratio (default 1.0: every trace)")
    parser.add_argument("--control", action="store_true",
                        help="A/A: the second extproc untraced too, to see the set-up's own noise (default: off)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 20 decisions (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.rounds = 20, 2
    if args.num_requests < 8 or args.rounds < 1 or args.concurrency < 1 or not 0 <= args.sampler_ratio <= 1:
        parser.error("--num-requests must be >= 8, --rounds and --concurrency >= 1, --sampler-ratio in [0, 1]")
    setup_logging("WARNING")
    off, on = run(args.num_requests, args.rounds, args.concurrency, args.seed, not args.untraced_sidecars,
                  args.sampler_ratio, args.control)
    print(f"tracing cost: {args.rounds} rounds x {args.num_requests} decisions per mode, concurrency "
          f"{args.concurrency}, astrolabe k=2 over 2 emulated instances with sidecars "
          f"({'untraced' if args.untraced_sidecars else 'traced, following the extproc'}); "
          + ("CONTROL: both extprocs untraced" if args.control else
             f"on = traces sampled at ratio {args.sampler_ratio:g}, exported over OTLP/gRPC to a local receiver"))
    print(format_report(off, on, off_hook_cost_us()))
    return 0
