"""Tracing of ``astrolabe demo``: where every process exports, what is sampled, the traced phase and its report.

Owns the demo's tracing flags (``--otlp-endpoint``, ``--trace-file``, ``--trace-sampling-ratio``,
``--trace-requests``), the ``OTEL_*`` variables and Envoy flags each demo process gets from them, the bundled
receiver's start, the requests of the traced phase (``bench.demo`` replays them like any policy's) and the lines
printed about the traces. Nothing imports this module but ``bench.demo``.

NOTE: what is traced, and why not the comparison. Tracing costs the router: every decision sampled makes it ~21%
slower at the median and adds ~0.7 ms of extproc CPU, and even 1% sampling ~8% (the SDK on the request path;
``astrolabe bench tracing``, README "Tracing"); on a 2-core machine the exports also take CPU from every other
process. The demo measures policies against each other, so its comparison runs as without tracing (no Envoy
tracer, no SDK in the extprocs), and the traces come from a short **traced phase** after the tables: the first
``--trace-requests`` requests of the first trace sent once more (same prompts, gaps and replicas) through a new
router tier of astrolabe (else of the first policy) whose Envoys sample ``--trace-sampling-ratio`` of them (all by
default) and whose extprocs follow Envoy's decision. The phase's requests carry UUIDs as ``x-request-id``, as
clients commonly do: Envoy makes a tracing decision only for a request whose id it can read as a UUID (or that
has none, when it makes one), and marks a sampled one in the id (its 15th character becomes ``9``), so the
extproc and the backend see that id. The comparison's ids (``s0-12:<sharegpt id>``) are no UUIDs: Envoy would trace
none of them (``UUIDRequestIDExtension``, Envoy 1.40).

Every process exports over OTLP/gRPC to one receiver: the Envoys with their own tracer (``astrolabe envoy
--otlp-endpoint``), the extprocs, sidecars and emulators with the SDK (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
which wins over an ``OTEL_*`` endpoint in the caller's environment). The sidecars and emulators, started once for
the whole demo, run ``parentbased_always_off``: they record exactly the requests the router sampled, and an
untraced call costs them one non-recording span (during the comparison, every call). Spans leave every process
within `EXPORT_DELAY_S` (the SDK's batch delay, Envoy's flush interval), and each one exports what is left when
it stops.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import uuid
from collections.abc import Sequence
from pathlib import Path

from astrolabe.tracing import TracingConfigError, normalize_endpoint
from bench import otlp_receiver
from bench.demo_fleet import RouterTracing
from astrolabe.procs import ProcessGroup
from bench.workloads import TraceRequest

logger = logging.getLogger(__name__)

EXPORT_DELAY_S = 0.2
"""Longest time a finished span waits in a demo process before it is exported, seconds: the SDK's batch delay
(``OTEL_BSP_SCHEDULE_DELAY``, 5 s by default) and Envoy's flush interval (``--trace-flush-interval-s``)."""

FLUSH_WAIT_S = 5 * EXPORT_DELAY_S
"""How long a traced router tier is kept after its requests finished, seconds: Envoy exports on its flush timer
only (the SDK services also export what is left when they stop)."""

DEFAULT_PHASE_REQUESTS = 20
"""Requests of the traced phase unless ``--trace-requests`` says otherwise."""


@dataclasses.dataclass(frozen=True, slots=True)
class DemoTracing:
    """The demo's tracing flags, validated.

    Attributes:
        endpoint: the OTLP/gRPC receiver, ``host:port``; None until the bundled receiver of ``trace_file`` runs
            (`start`).
        trace_file: where the bundled receiver writes every span (JSON lines, the file replaced); None when
            ``--otlp-endpoint`` names a receiver of the user's.
        sampling_ratio: share of the traced phase's requests that Envoy samples, in [0, 1].
        num_phase_requests: requests of the traced phase, >= 1.
    """

    endpoint: str | None
    trace_file: Path | None
    sampling_ratio: float = 1.0
    num_phase_requests: int = DEFAULT_PHASE_REQUESTS

    def _export_env(self) -> dict[str, str]:
        assert self.endpoint is not None, "start() resolves the bundled receiver's endpoint first"
        return {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://{self.endpoint}",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_SDK_DISABLED": "", "OTEL_BSP_SCHEDULE_DELAY": f"{EXPORT_DELAY_S * 1000:.0f}"}

    def service_env(self) -> dict[str, str]:
        """The variables of the sidecars and emulators: export, and record only what a sampled caller sends."""
        return {**self._export_env(), "OTEL_TRACES_SAMPLER": "parentbased_always_off"}

    def router_tracing(self) -> RouterTracing:
        """The tracing of the traced phase's router tier: Envoy samples `sampling_ratio` of the requests, the
        extprocs follow its decision (and sample that share of requests reaching them without one)."""
        assert self.endpoint is not None, "start() resolves the bundled receiver's endpoint first"
        return RouterTracing(
            extproc_env={**self._export_env(), "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                         "OTEL_TRACES_SAMPLER_ARG": f"{self.sampling_ratio:g}"},
            envoy_args=("--otlp-endpoint", self.endpoint, "--trace-sampling-percent",
                        f"{self.sampling_ratio * 100:g}", "--trace-flush-interval-s", f"{EXPORT_DELAY_S:g}"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The tracing flags of ``astrolabe demo`` (defaults suppressed: `from_args` tells given from absent)."""
    group = parser.add_argument_group("tracing (off unless --otlp-endpoint or --trace-file; README \"Tracing\")")
    where = group.add_mutually_exclusive_group()
    where.add_argument("--otlp-endpoint", metavar="HOST:PORT", default=argparse.SUPPRESS,
                       help="every process of the demo (Envoys, extprocs, sidecars, emulators) exports its spans "
                            "over OTLP/gRPC (plain text) to this receiver (default: none, no tracing)")
    where.add_argument("--trace-file", metavar="FILE", type=Path, default=argparse.SUPPRESS,
                       help="start the bundled OTLP/gRPC receiver (bench.otlp_receiver), write every span it "
                            "receives to FILE (JSON lines; replaced) and print one trace as a tree at the end; "
                            "python -m bench.otlp_receiver --show FILE prints any other (default: none)")
    group.add_argument("--trace-sampling-ratio", type=float, metavar="R", default=argparse.SUPPRESS,
                       help="share of the traced phase's requests traced, in [0, 1] (default 1: all). The comparison "
                            "before the tables is never traced: tracing costs the router (the decision p50 ~21%% "
                            "slower at 1, ~8%% at 0.01: astrolabe bench tracing), which would change its figures")
    group.add_argument("--trace-requests", type=int, metavar="N", default=argparse.SUPPRESS,
                       help=f"requests of the traced phase after the tables (default {DEFAULT_PHASE_REQUESTS}): "
                            "the first N requests of the first trace once more, with UUIDs as x-request-id, "
                            "through a new router tier of astrolabe (else the first policy)")


def from_args(ns: argparse.Namespace, parser: argparse.ArgumentParser, backend: str) -> DemoTracing | None:
    """`DemoTracing` of the parsed flags; None when tracing is off. Exits through ``parser.error`` (status 2) on
    a bad value, on ``--trace-*`` flags without a receiver, and on tracing with ``backend`` ``vllm``."""
    endpoint, trace_file = getattr(ns, "otlp_endpoint", None), getattr(ns, "trace_file", None)
    ratio, num_requests = getattr(ns, "trace_sampling_ratio", None), getattr(ns, "trace_requests", None)
    if endpoint is None and trace_file is None:
        if ratio is not None or num_requests is not None:
            parser.error("--trace-sampling-ratio and --trace-requests need --otlp-endpoint or --trace-file")
        return None
    if backend != "emulator":
        parser.error("tracing flags work with the emulator backend only (a vLLM server traces with its own "
                     "--otlp-traces-endpoint)")
    if trace_file is not None and trace_file.is_dir():
        parser.error(f"--trace-file {trace_file} is a folder")
    if endpoint is not None:
        try:
            url = normalize_endpoint(endpoint, "--otlp-endpoint")
        except TracingConfigError as exc:
            parser.error(str(exc))
        if not url.startswith("http://") or url.rstrip("/").count("/") > 2:
            parser.error(f"--otlp-endpoint: expected HOST:PORT of a plain-text OTLP/gRPC receiver, got {endpoint!r}")
        endpoint = url.removeprefix("http://").rstrip("/")
    ratio = 1.0 if ratio is None else ratio
    if not 0.0 <= ratio <= 1.0:
        parser.error(f"--trace-sampling-ratio must be in [0, 1], got {ratio:g}")
    num_requests = DEFAULT_PHASE_REQUESTS if num_requests is None else num_requests
    if num_requests < 1:
        parser.error("--trace-requests must be >= 1")
    return DemoTracing(endpoint, trace_file.resolve() if trace_file is not None else None, ratio, num_requests)


def start(procs: ProcessGroup, tracing: DemoTracing, log_dir: Path) -> DemoTracing:
    """Start the bundled receiver when ``tracing`` has a trace file (first in ``procs``, so it stops last and
    receives what the others export as they stop); returns ``tracing`` with its endpoint.

    Raises:
        astrolabe.procs.ProcessStartError: the receiver did not start.
        OSError: the trace file's folder cannot be made.
    """
    if tracing.trace_file is None:
        return tracing
    tracing.trace_file.parent.mkdir(parents=True, exist_ok=True)
    tracing.trace_file.unlink(missing_ok=True)
    endpoint = otlp_receiver.start_process(procs, tracing.trace_file, log_dir / "otlp-receiver.log")
    logger.info("OTLP/gRPC receiver on %s, spans to %s", endpoint, tracing.trace_file)
    return dataclasses.replace(tracing, endpoint=endpoint)


def phase_policy(policies: Sequence[str]) -> str:
    """The policy whose router tier the traced phase runs: astrolabe when the demo runs it, else the first."""
    return "astrolabe" if "astrolabe" in policies else policies[0]


def phase_requests(trace: Sequence[TraceRequest], num_requests: int, seed: int) -> list[TraceRequest]:
    """The traced phase's requests: the first ``num_requests`` of ``trace`` (arrival order, offsets kept), each
    with a UUID4 as id (seeded by ``seed``), which Envoy can sample (module NOTE)."""
    rng = random.Random(seed)
    return [dataclasses.replace(r, id=str(uuid.UUID(int=rng.getrandbits(128), version=4)))
            for r in trace[:num_requests]]


def report(tracing: DemoTracing, policy: str) -> str:
    """The lines printed after the tables: what was traced, where it went; with a trace file, its count of traces
    and spans and the tree of the fullest trace (`bench.otlp_receiver.select_trace`)."""
    lines = [(f"traces: {tracing.num_phase_requests} requests through a new {policy} router tier after the tables, "
              f"{tracing.sampling_ratio:.0%} sampled (the comparison untraced); Envoys, extprocs, sidecars and "
              f"emulators exporting over OTLP/gRPC to {tracing.endpoint}")]
    if tracing.trace_file is not None:
        lines += _file_lines(tracing.trace_file)
    return "\n".join(lines)


def _file_lines(trace_file: Path) -> list[str]:
    try:
        spans = otlp_receiver.read_spans(trace_file)
    except (OSError, ValueError) as exc:
        return [f"traces: cannot read {trace_file}: {exc}"]
    lines = [f"traces: {len(otlp_receiver.group_traces(spans))} traces, {len(spans)} spans in {trace_file}"]
    if spans:
        show = f"python -m bench.otlp_receiver --show {trace_file} [--list | --trace-id ID | --request-id ID]"
        lines += ["the trace with the most spans:", otlp_receiver.format_trace(otlp_receiver.select_trace(spans)),
                  f"any trace with its attributes: {show}"]
    return lines
