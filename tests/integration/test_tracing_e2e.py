"""One trace per request through real processes: Envoy -> extproc -> sidecars -> emulated vLLM, all exporting over
OTLP/gRPC to a real receiver.

The receiver (``bench.otlp_receiver``) is the OTLP ``TraceService`` from opentelemetry-proto's service definitions
on a loopback gRPC server in this process: every component exports to it with its real exporter (the SDK's OTLP
exporter in ours, Envoy's own OpenTelemetry tracer). One extproc serves two Envoys, one with its tracer on and one
without, so both ways a context can arrive (gRPC metadata from Envoy, the client's headers) run against the same
processes.
"""

from __future__ import annotations

import httpx
import pytest

from bench.otlp_receiver import OtlpReceiver, ReceivedSpan
from astrolabe.procs import ProcessGroup
from tests.integration.stack import Stack

pytestmark = [pytest.mark.envoy]

MODEL = "llama-2-7b"
TIME_SCALE = "10"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"
WAIT_S = 15.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with OtlpReceiver() as receiver, ProcessGroup() as procs:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        s = Stack(procs, tmp_path_factory.mktemp("tracing"), "full-duplex", env=env)
        engine = ["--time-scale", TIME_SCALE, "--max-num-seqs", "4", "--num-gpu-blocks", "256"]
        emulators = [s.start_emulator(*engine) for _ in range(2)]
        sidecars = {e: s.start_sidecar(e, *engine) for e in emulators}
        s.write_config([{"address": e, "models": [MODEL], "predictor": p} for e, p in sidecars.items()],
                       policy="astrolabe", policy_params={"k": 2}, predictor_client={"predict_timeout_s": 0.5, "mode": "predict"})
    # Predict mode: the trace is followed into the sidecars' Predict and simulation spans
        s.start_extproc()
        s.plain_url = s.start_envoy()
        s.traced_url = s.start_envoy("--otlp-endpoint", f"127.0.0.1:{receiver.port}",
                                     "--trace-flush-interval-s", "0.1")
        s.receiver = receiver
        yield s


def _complete(url: str, headers: dict[str, str] | None = None) -> tuple[str, str]:
    """One completion; returns (the x-request-id the backend saw, the instance that answered)."""
    body = {"model": MODEL, "prompt": "tell me about tracing", "max_tokens": 6, "ignore_eos": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["id"].removeprefix("cmpl-"), reply.headers["x-emulator-instance"]


def _trace_of(stack, request_id: str, names: set[str]) -> list[ReceivedSpan]:
    """The spans of the trace whose route span carries ``request_id``, once it holds every one of ``names``."""
    def route_span(spans):
        return next((s for s in spans if s.name == "astrolabe.route"
                     and s.attributes.get("astrolabe.request_id") == request_id), None)

    def complete(spans):
        route = route_span(spans)
        return route is not None and names <= {s.name for s in spans if s.trace_id == route.trace_id}

    spans = stack.receiver.wait_for(complete, timeout_s=WAIT_S)
    trace_id = route_span(spans).trace_id
    return [s for s in spans if s.trace_id == trace_id]


def _one(spans: list[ReceivedSpan], name: str, **where) -> ReceivedSpan:
    found = [s for s in spans if s.name == name and all(getattr(s, k) == v for k, v in where.items())]
    assert len(found) == 1, (name, where, [(s.name, s.service_name) for s in spans])
    return found[0]


ROUTER_CHAIN = {"astrolabe.route", "astrolabe.length_estimate", "astrolabe.predictor.v1.Predictor/Predict",
                "/astrolabe.predictor.v1.Predictor/Predict", "astrolabe.simulate",
                "astrolabe.predictor.v1.Predictor/Admit", "/astrolabe.predictor.v1.Predictor/Admit", "llm_request"}


def _check_router_chain(spans: list[ReceivedSpan], instance: str) -> ReceivedSpan:
    """Router -> Predict x2 -> sidecar -> simulation, Admit to the chosen sidecar; the decision's attributes."""
    by_id = {s.span_id: s for s in spans}
    route = _one(spans, "astrolabe.route")
    assert route.kind == "SERVER" and route.service_name == "astrolabe-extproc"
    a = route.attributes
    assert a["gen_ai.request.model"] == MODEL and a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.max_tokens"] == 6 and a["astrolabe.policy"] == "astrolabe"
    assert a["astrolabe.outcome"] == "routed" and a["astrolabe.destination"] == instance
    assert f"{a['server.address']}:{a['server.port']}" == instance
    candidates = [attrs for name, attrs in route.events if name == "astrolabe.candidate"]
    assert len(candidates) == 2 and [c["astrolabe.candidate.chosen"] for c in candidates].count(True) == 1
    assert all(c["astrolabe.candidate.predicted_ttft_s"] <= c["astrolabe.candidate.predicted_e2e_s"]
               and "astrolabe.candidate.state_age_s" in c for c in candidates)
    predicts = [s for s in spans if s.name == "astrolabe.predictor.v1.Predictor/Predict"]
    assert len(predicts) == 2 and all(s.parent_span_id == route.span_id for s in predicts)
    for simulate in [s for s in spans if s.name == "astrolabe.simulate"]:
        server = by_id[simulate.parent_span_id]
        assert server.service_name == "astrolabe-predictor" and server.kind == "SERVER"
        assert by_id[server.parent_span_id] in predicts
        assert simulate.attributes["astrolabe.num_steps_simulated"] > 0
    assert len([s for s in spans if s.name == "astrolabe.simulate"]) == 2
    assert _one(spans, "astrolabe.length_estimate").parent_span_id == route.span_id
    admit = _one(spans, "/astrolabe.predictor.v1.Predictor/Admit")
    assert by_id[admit.parent_span_id].name == "astrolabe.predictor.v1.Predictor/Admit"
    return route


def test_the_clients_trace_runs_through_router_sidecars_and_backend(stack):
    """Envoy not tracing: the client's traceparent header is the parent; the header mutation carries it on."""
    request_id, instance = _complete(stack.plain_url, {"traceparent": CLIENT_TRACEPARENT})
    spans = _trace_of(stack, request_id, ROUTER_CHAIN)
    assert {s.trace_id for s in spans} == {TRACE_ID}
    route = _check_router_chain(spans, instance)
    assert route.parent_span_id == CLIENT_SPAN_ID
    backend = _one(spans, "llm_request")
    assert backend.service_name == "astrolabe-emulator" and backend.parent_span_id == route.span_id
    assert backend.attributes["gen_ai.usage.completion_tokens"] == 6
    assert 0 <= backend.attributes["gen_ai.latency.time_to_first_token"] <= backend.attributes["gen_ai.latency.e2e"]


def test_envoys_span_is_the_root_when_envoy_traces(stack):
    """Envoy tracing, no client context: Envoy's request span is the root; the extproc continues the context
    Envoy put in the ext_proc stream's metadata; the backend continues Envoy's upstream span."""
    request_id, instance = _complete(stack.traced_url)
    spans = _trace_of(stack, request_id, ROUTER_CHAIN | {"ingress"})
    by_id = {s.span_id: s for s in spans}
    ingress = _one(spans, "ingress", service_name="astrolabe-envoy")
    assert ingress.parent_span_id == "" and ingress.kind == "SERVER"
    route = _check_router_chain(spans, instance)
    ext_proc_call = by_id[route.parent_span_id]
    assert ext_proc_call.service_name == "astrolabe-envoy" and ext_proc_call.parent_span_id == ingress.span_id
    backend = _one(spans, "llm_request")
    upstream = by_id[backend.parent_span_id]  # Envoy's router span: Envoy re-injects its own context upstream
    assert upstream.service_name == "astrolabe-envoy" and upstream.parent_span_id == ingress.span_id


def test_envoy_continues_the_clients_traceparent(stack):
    request_id, _ = _complete(stack.traced_url, {"traceparent": CLIENT_TRACEPARENT.replace("4bf9", "5bf9")})
    spans = _trace_of(stack, request_id, ROUTER_CHAIN | {"ingress"})
    assert {s.trace_id for s in spans} == {TRACE_ID.replace("4bf9", "5bf9")}
    assert _one(spans, "ingress").parent_span_id == CLIENT_SPAN_ID


@pytest.mark.parametrize("traceparent", ["garbage", f"00-{'0' * 32}-{CLIENT_SPAN_ID}-01"],
                         ids=["garbage", "zero-trace-id"])
def test_a_bad_traceparent_is_ignored_not_fatal(stack, traceparent):
    request_id, _ = _complete(stack.plain_url, {"traceparent": traceparent, "tracestate": "=,,==;bad key=1"})
    spans = _trace_of(stack, request_id, {"astrolabe.route", "llm_request"})
    route = _one(spans, "astrolabe.route")
    assert route.parent_span_id == "" and route.trace_id != "0" * 32
    assert _one(spans, "llm_request").parent_span_id == route.span_id
