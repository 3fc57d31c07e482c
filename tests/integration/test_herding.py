"""Herding through real Envoy -> extproc (policy ``astrolabe``) -> emulated vLLM instances with plugin-mode sidecars.

A router herds when it sends too many of the requests it routes at about the same time to one instance: every
decision sees the same (stale, or not yet updated) picture of the fleet, so the instance that looks best to the
first request looks best to the next ones too, until its state catches up. Users then see one instance's queue
grow while the others idle. These tests count where the router sent each request (its *decisions*: the
destination Envoy was told, read from the extproc's decision log, one JSON record per decision, tagged with the
request's ``x-request-id``) and assert that the load is spread:

1. bursts of 64 simultaneous requests onto 4, then 8, idle instances: max/min requests per instance <= 2 in
   all bursts but at most one, <= 2.25 in every burst (min >= 1; `MAX_OVER_MIN_ANY` says why), and >= 80 % of a
   burst's decisions had every candidate predicted (``astrolabe_extproc_decisions_total{basis="prediction"}``);
2. 8 closed-loop clients sending short requests for 20 s onto 4 instances: max/mean requests per instance <= 1.5;
3. 32 simultaneous one-token requests onto 4 instances whose prefill is slow (TTFT ~2 s: the engine step time
   scaled up), where a request stays in its instance's queue long after it was routed: max/min <= 2 (min >= 1);
4. an instance killed (SIGKILL) under steady load and restarted on its port (its sidecar kept running): once it
   is healthy again, it gets at most twice its fair share (<= 50 % of 4 instances' decisions) over the next 10 s,
   rather than everything because it is the emptiest.

One extproc and one Envoy serve the whole module; each scenario points them at its instances by rewriting the
config file (the extproc reloads ``endpoints`` live). The instances of scenarios 1 (8 instances) and 3 run only
for their test. Scenarios 1 (4 instances) and 2 run again through a second Envoy and an extproc with
``workers: 2`` (extproc/workers.py) onto the same 4 instances: its two worker processes decide without seeing each
other's pending dispatches, only what the sidecars report (the steady scenario for 10 s there, to keep the module
short). ``ProcessGroup`` stops every process at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from astrolabe.procs import ProcessGroup
from tests.integration.stack import Stack, poll_until, signal_process

pytestmark = [pytest.mark.envoy, pytest.mark.slow]

MODEL = "llama-2-7b"
ENGINE = ["--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--num-gpu-blocks", "1024"]
"""Small engines (as in test_burst); each instance's --time-scale is given with them."""
SLOW_TIME_SCALE = 250.0
"""Scenario 3: wall seconds per modelled H200 second. A request's prompt is 64 tokens (chat template included); a
llama-2-7b step of them models ~7 ms, so a lone one-token request takes ~1.8 s to its (only) token (the sidecars
predict 1.79 s), and a fair share of 8 (512 tokens: one step's whole budget) ~3 s."""
BURST_SIZE = 64
MAX_OVER_MIN_ANY = 2.25
"""The bound every burst must keep; the issue's max/min <= 2 must hold in all but one of a module's bursts. On 8
instances a burst at 9/4 (one instance drew few of the k = 2 random probes) came up once in about six runs of this
module in `make test`: the power of two choices with exact counts misses <= 2 in 0.4% of such bursts, this
router on a loaded 2-core machine in a few percent (README "Where Astrolabe stands")."""
BURST_MAX_TOKENS = 64
"""Replies of a burst: long enough (~0.4 s) that all its requests are in flight together. Routing a burst of 64
through Envoy takes up to ~0.3 s on this loaded 2-core machine; 8-token replies ended within it, and the router
then rightly sent more of the burst to the instances whose requests had already finished (it balances requests in
flight, not a count per burst)."""
NUM_BURSTS = 4
PROMPT_WORDS = 30
WARMUP_BURSTS = 5
"""At most this many warm-up bursts (2 one-token requests per instance) before a scenario: until one is decided on
the sidecars' answers only. In `make test` on a loaded 2-core host, 16% of the first burst onto 4 just-started
sidecars fell back once (their first answers missed the decision deadline), which is start-up, not herding."""


@dataclass(frozen=True)
class Instance:
    emulator: str  # ip:port
    sidecar: str  # ip:port
    state_path: str  # the emulator's --state-path, read by the sidecar (plugin mode)
    engine: tuple[str, ...]  # the emulator's engine flags (to restart it the same)


class Fleet:
    """The module's Envoy + extproc, and the 4 instances most scenarios share."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.base: list[Instance] = []
        self.decision_log = stack.tmp / "decisions.jsonl"
        self._num_instances = 0

    def start_instances(self, num: int, time_scale: float = 1.0) -> list[Instance]:
        """Starts ``num`` emulators (plugin-mode state files) and their sidecars; returns them once all answer."""
        engine = (*ENGINE, "--time-scale", f"{time_scale:g}")
        started = []
        for _ in range(num):
            state_path = str(self.stack.tmp / f"state-{self._num_instances}.json")
            self._num_instances += 1
            emulator = self.stack.start_emulator(*engine, "--state-path", state_path)
            sidecar = self.stack.start_sidecar(emulator, *engine, "--batch-time-model", MODEL, "--state-source",
                                               "vllm-plugin", "--vllm-state-path", state_path)
            started.append(Instance(emulator, sidecar, state_path, engine))
        return started

    def stop_instances(self, instances: list[Instance]) -> None:
        for instance in instances:
            self.stack.backends[instance.emulator].stop()
        sidecar_ports = {instance.sidecar.rsplit(":", 1)[1] for instance in instances}
        for proc in self.stack.procs.processes:  # the sidecars are named sidecar-<port>
            if proc.name.startswith("sidecar-") and proc.name.split("-", 1)[1] in sidecar_ports:
                proc.stop()

    def use(self, instances: list[Instance]) -> None:
        """Points the extproc at ``instances`` (a live reload of ``endpoints``, every other key kept) and waits until
        its pool holds exactly them, all healthy; then routes a few requests to open its channels to new sidecars
        (a cold gRPC channel makes the first Predict late: not what these tests measure) and waits for idle."""
        config = json.loads(self.stack.config_path.read_text())
        endpoints = [{"address": i.emulator, "models": [MODEL], "predictor": i.sidecar} for i in instances]
        if config["endpoints"] != endpoints:
            config["endpoints"] = endpoints
            tmp = self.stack.config_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(config))
            os.replace(tmp, self.stack.config_path)
        wanted = {i.emulator for i in instances}

        def pool_is_wanted() -> bool:
            healthy = {s.labels["endpoint"]: s.value for s in self.stack.samples()
                       if s.name == "astrolabe_extproc_endpoint_healthy"}
            return set(healthy) == wanted and all(v == 1 for v in healthy.values())

        poll_until(pool_is_wanted, 20, "the extproc's pool to hold the scenario's instances, healthy", 0.1)
        for _ in range(WARMUP_BURSTS):  # until a warm-up burst is decided on predictions only (a loaded CI host
            before = self.bases()       # made a new sidecar's first answers miss the decision deadline)
            asyncio.run(_burst(self.stack.envoy_url, f"warmup-{time.monotonic_ns()}", 2 * len(instances),
                               max_tokens=1))
            self.wait_idle(instances)
            if set(self.bases() - before) <= {"prediction"}:
                break

    def wait_idle(self, instances: list[Instance], timeout_s: float = 30.0) -> None:
        """Until the extproc has nothing in flight and no emulator has a request running or waiting."""

        def idle() -> bool:
            if any(self.stack.in_flight(i.emulator) for i in instances):
                return False
            return all(_emulator_queue(i.emulator) == 0 for i in instances)

        poll_until(idle, timeout_s, "the instances to be idle", 0.05)
        time.sleep(0.2)  # the emulators publish their idle state; the sidecars read it

    def decisions(self, prefix: str, expected: int | None = None) -> list[dict]:
        """The decision records of requests whose id starts with ``prefix``; waits (the log is flushed every second)
        until there are ``expected`` of them, if given."""

        def read() -> list[dict]:
            if not self.decision_log.exists():
                return []
            return [r for r in map(json.loads, self.decision_log.read_text().splitlines())
                    if r["request_id"].startswith(prefix)]

        if expected is None:
            time.sleep(1.5)
            return read()
        try:
            return poll_until(lambda: (records := read()) and len(records) >= expected and records, 5,
                              f"{expected} decisions of {prefix}", 0.1)
        except TimeoutError:
            return read()

    def predictor_calls(self) -> Counter:
        """``astrolabe_extproc_predictor_calls_total`` by outcome (all sidecars), now."""
        calls: Counter = Counter()
        for s in self.stack.samples():
            if s.name == "astrolabe_extproc_predictor_calls_total":
                calls[s.labels["outcome"]] += s.value
        return calls

    def bases(self) -> Counter:
        """``astrolabe_extproc_decisions_total`` by basis, now."""
        return Counter({s.labels["basis"]: s.value for s in self.stack.samples()
                        if s.name == "astrolabe_extproc_decisions_total"})


def _emulator_queue(address: str) -> float:
    """Requests running + waiting on an emulator (its vLLM /metrics)."""
    text = httpx.get(f"http://{address}/metrics", timeout=2).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))


def _per_instance(records: list[dict], instances: list[Instance]) -> dict[str, int]:
    """Decisions per instance (every instance listed, 0 if none went there; other destinations kept)."""
    counts = Counter(r["destination"] for r in records)
    return {i.emulator: counts.pop(i.emulator, 0) for i in instances} | dict(counts)


def _basis_shares(before: Counter, after: Counter, total: int) -> dict[str, float]:
    delta = after - before
    return {basis: round(n / total, 3) for basis, n in sorted(delta.items())}


def _body(rid: str, max_tokens: int, prompt_words: int = PROMPT_WORDS) -> dict:
    words = " ".join(f"w{k}" for k in range(prompt_words - 1))
    return {"model": MODEL, "messages": [{"role": "user", "content": f"{rid} {words}"}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


async def _one(client: httpx.AsyncClient, url: str, rid: str, max_tokens: int) -> int:
    """One streamed chat request tagged ``x-request-id: rid``; its status (-1: transport error)."""
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=_body(rid, max_tokens),
                                 headers={"x-request-id": rid}) as response:
            async for _ in response.aiter_lines():
                pass
            return response.status_code
    except httpx.HTTPError:
        return -1


async def _burst(url: str, prefix: str, num: int, max_tokens: int = 8) -> list[int]:
    """``num`` requests at once (ids ``prefix-<i>``); their statuses."""
    limits = httpx.Limits(max_connections=num, max_keepalive_connections=num)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        return await asyncio.gather(*(_one(client, url, f"{prefix}-{i}", max_tokens) for i in range(num)))


async def _steady(url: str, prefix: str, num_clients: int, done: Callable[[], bool], max_tokens: int,
                  max_duration_s: float = 60.0, max_requests_per_client: int = 2000) -> list[int]:
    """``num_clients`` closed-loop clients, each sending requests back to back until ``done()`` (and for at most
    ``max_duration_s`` and ``max_requests_per_client``); the statuses (-1: transport error)."""
    deadline = time.monotonic() + max_duration_s
    statuses: list[int] = []
    limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)

    async def client_loop(client: httpx.AsyncClient, c: int) -> None:
        for k in range(max_requests_per_client):
            if done() or time.monotonic() >= deadline:
                return
            status = await _one(client, url, f"{prefix}-{c}-{k}", max_tokens)
            statuses.append(status)
            if status != 200:
                await asyncio.sleep(0.05)  # an instance down: no tight loop of errors

    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        await asyncio.gather(*(client_loop(client, c) for c in range(num_clients)))
    return statuses


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    with ProcessGroup() as procs:
        stack = Stack(procs, tmp_path_factory.mktemp("herding"), "full-duplex")
        f = Fleet(stack)
        f.base = f.start_instances(4)
        stack.write_config([{"address": i.emulator, "models": [MODEL], "predictor": i.sidecar} for i in f.base],
                           policy="astrolabe", decision_log_path=str(f.decision_log), reload_interval_s=0.2)
        stack.start_extproc()
        stack.start_envoy()
        yield f


@pytest.fixture(scope="module")
def fleet_2w(fleet, tmp_path_factory) -> Fleet:
    """A second Envoy and an extproc with 2 worker processes, onto the module fleet's 4 instances."""
    stack = Stack(fleet.stack.procs, tmp_path_factory.mktemp("herding-2w"), "full-duplex")
    f = Fleet(stack)
    f.base = fleet.base
    stack.write_config([{"address": i.emulator, "models": [MODEL], "predictor": i.sidecar} for i in f.base],
                       policy="astrolabe", decision_log_path=str(f.decision_log), reload_interval_s=0.2)
    stack.start_extproc(workers=2)
    stack.start_envoy()
    return f


def _bursts(fleet: Fleet, instances: list[Instance], tag: str) -> None:
    fleet.use(instances)
    bursts = []
    for b in range(NUM_BURSTS):
        prefix = f"{tag}-b{b}"
        before, calls_before = fleet.bases(), fleet.predictor_calls()
        statuses = asyncio.run(_burst(fleet.stack.envoy_url, prefix, BURST_SIZE, max_tokens=BURST_MAX_TOKENS))
        fleet.wait_idle(instances)
        records = fleet.decisions(prefix, BURST_SIZE)
        counts = _per_instance(records, instances)
        shares = _basis_shares(before, fleet.bases(), BURST_SIZE)
        calls = dict(fleet.predictor_calls() - calls_before)
        bursts.append((counts, shares, Counter(statuses), calls))
        print(f"{tag} burst {b}: per instance {list(counts.values())}, bases {shares}, Predicts {calls}, decisions "
              f"per process {dict(Counter(r['pid'] for r in records))}")
    report = "\n".join(f"burst {b}: per instance {c}, decision bases {s}, statuses {dict(st)}, Predict calls {pc}"
                       for b, (c, s, st, pc) in enumerate(bursts))
    within_2 = 0
    for counts, shares, statuses, _ in bursts:
        assert statuses == Counter({200: BURST_SIZE}), report
        assert sum(counts.values()) == BURST_SIZE, f"decisions logged != requests sent\n{report}"
        values = [counts[i.emulator] for i in instances]
        assert min(values) >= 1 and max(values) <= MAX_OVER_MIN_ANY * min(values), \
            f"herding: max/min > {MAX_OVER_MIN_ANY}\n{report}"
        within_2 += max(values) <= 2 * min(values)
        assert shares.get("prediction", 0) >= 0.8, f"< 80 % of decisions on every sidecar's answer\n{report}"
    assert within_2 >= NUM_BURSTS - 1, f"herding: max/min > 2 in more than one burst\n{report}"


def test_bursts_onto_4_idle_instances_are_spread(fleet):
    _bursts(fleet, fleet.base, "idle4")


def test_bursts_onto_8_idle_instances_are_spread(fleet):
    extra = fleet.start_instances(4)
    try:
        _bursts(fleet, fleet.base + extra, "idle8")
    finally:
        fleet.use(fleet.base)
        fleet.stop_instances(extra)


def test_bursts_onto_4_idle_instances_are_spread_with_2_workers(fleet_2w):
    _bursts(fleet_2w, fleet_2w.base, "w2idle4")


def test_steady_low_concurrency_is_spread(fleet):
    _steady_spread(fleet, "steady", 20.0)


def test_steady_low_concurrency_is_spread_with_2_workers(fleet_2w):
    _steady_spread(fleet_2w, "w2steady", 10.0)


def _steady_spread(fleet: Fleet, tag: str, duration_s: float) -> None:
    """8 closed-loop clients for ``duration_s`` onto the 4 base instances: max/mean requests per instance <= 1.5."""
    fleet.use(fleet.base)
    end = time.monotonic() + duration_s
    statuses = asyncio.run(_steady(fleet.stack.envoy_url, tag, 8, lambda: time.monotonic() >= end, max_tokens=6))
    fleet.wait_idle(fleet.base)
    records = fleet.decisions(tag, len(statuses))
    counts = _per_instance(records, fleet.base)
    values = [counts[i.emulator] for i in fleet.base]
    mean = sum(values) / len(values)
    bases = Counter(r["basis"] for r in records)
    report = f"{len(statuses)} requests, per instance {counts}, bases {dict(bases)}, statuses {dict(Counter(statuses))}"
    print(f"{tag}:", report)
    assert set(statuses) == {200}, report
    assert len(records) == len(statuses), f"decisions logged != requests sent: {report}"
    assert max(values) <= 1.5 * mean, f"herding: max/mean > 1.5: {report}"


def test_slow_prefill_one_token_burst_is_spread(fleet):
    slow = fleet.start_instances(4, time_scale=SLOW_TIME_SCALE)
    try:
        fleet.use(slow)
        bursts = []
        for b in range(2):
            prefix = f"slow-b{b}"
            before, calls_before = fleet.bases(), fleet.predictor_calls()
            t0 = time.monotonic()
            statuses = asyncio.run(_burst(fleet.stack.envoy_url, prefix, 32, max_tokens=1))
            wall_s = time.monotonic() - t0
            fleet.wait_idle(slow)
            counts = _per_instance(fleet.decisions(prefix, 32), slow)
            calls = dict(fleet.predictor_calls() - calls_before)
            bursts.append((counts, _basis_shares(before, fleet.bases(), 32), Counter(statuses), wall_s, calls))
            print(f"slow-prefill burst {b}: per instance {list(counts.values())}, bases {bursts[-1][1]}, "
                  f"Predicts {calls}, {wall_s:.1f} s")
        report = "\n".join(f"burst {b}: per instance {c}, decision bases {s}, statuses {dict(st)}, {w:.1f} s, "
                           f"Predict calls {pc}" for b, (c, s, st, w, pc) in enumerate(bursts))
        for counts, _, statuses, _, _ in bursts:
            assert statuses == Counter({200: 32}), report
            assert sum(counts.values()) == 32, f"decisions logged != requests sent\n{report}"
            values = [counts[i.emulator] for i in slow]
            # max/min <= 2 with min >= 1 (fair share 8 each; reachable: 8/8/8/8), stricter than max <= 16.
            assert min(values) >= 1 and max(values) <= 2 * min(values), f"herding: max/min > 2\n{report}"
    finally:
        fleet.use(fleet.base)
        fleet.stop_instances(slow)


def test_a_restarted_instance_gets_at_most_twice_its_share(fleet):
    fleet.use(fleet.base)
    victim = fleet.base[0]
    port = int(victim.emulator.rsplit(":", 1)[1])
    stack = fleet.stack
    window_s = 10.0
    marks: dict[str, float] = {}

    def healthy(address: str) -> bool:
        return stack.metric(f'astrolabe_extproc_endpoint_healthy{{endpoint="{address}"}}') == 1

    def kill_and_restart() -> None:
        time.sleep(3)  # steady state first
        signal_process(stack.backends[victim.emulator], signal.SIGKILL)
        poll_until(lambda: not healthy(victim.emulator), 10, "the killed instance to be unhealthy", 0.05)
        marks["killed"] = time.time()
        stack.start_emulator(*victim.engine, "--state-path", victim.state_path, port=port)
        poll_until(lambda: healthy(victim.emulator), 20, "the restarted instance to be healthy", 0.05)
        marks["healthy"] = time.time()

    async def scenario() -> list[int]:
        load = asyncio.create_task(_steady(stack.envoy_url, "restart", 10, lambda: "end" in marks, max_tokens=8))
        await asyncio.to_thread(kill_and_restart)
        await asyncio.sleep(window_s)
        marks["end"] = time.time()
        return await load

    statuses = asyncio.run(scenario())
    fleet.wait_idle(fleet.base)
    records = [r for r in fleet.decisions("restart") if marks["healthy"] <= r["time_unix_s"] <= marks["end"]]
    counts = _per_instance(records, fleet.base)
    share = counts[victim.emulator] / max(1, len(records))
    bases = Counter(r["basis"] for r in records)
    report = (f"restarted {victim.emulator}: {counts[victim.emulator]} of {len(records)} decisions ({share:.0%}) in "
              f"the {window_s:g} s after it was healthy again; per instance {counts}, bases {dict(bases)}; "
              f"statuses over the whole run {dict(Counter(statuses))}; down for "
              f"{marks['healthy'] - marks['killed']:.1f} s")
    print(report)
    assert len(records) >= 40, f"too little load to judge: {report}"
    assert share <= 2 * 1 / 4, f"herding onto the restarted instance: {report}"

