"""bench.tracing_cost: the pure parts (prompts, span attribution, report) and one quick real run."""

import json

import pytest

from bench import tracing_cost
from bench.tracing_cost import ModeResult, format_report, off_hook_cost_us, prompts, spans_per_mode


def test_prompts_are_seeded_chat_bodies():
    bodies = prompts(5, seed=3)
    assert bodies == prompts(5, seed=3) and bodies != prompts(5, seed=4)
    body = json.loads(bodies[0])
    assert body["model"] == tracing_cost.MODEL and body["max_tokens"] == 256
    assert 40 <= len(body["messages"][0]["content"].split()) <= 200


def test_spans_are_attributed_to_the_mode_of_their_route_span(tmp_path):
    def span(trace_id, name, request_id=None):
        attributes = {} if request_id is None else {"astrolabe.request_id": request_id}
        return json.dumps({"trace_id": trace_id, "name": name, "attributes": attributes})

    path = tmp_path / "spans.jsonl"
    path.write_text("\n".join([span("a", "astrolabe.route", "on-0-1"), span("a", "astrolabe.simulate"),
                               span("b", "astrolabe.route", "warm-on-3"), span("b", "x"),
                               span("c", "astrolabe.simulate")]) + "\n")
    counts = spans_per_mode(path)
    assert counts["on"] == 2 and counts["off"] == 0 and counts["warm"] == 2 and counts[None] == 1


def test_report_gives_ratios_of_the_same_run():
    off = ModeResult([0.002] * 60, [0.001] * 60, cpu_s=0.12, num_spans=0)
    on = ModeResult([0.003] * 60, [0.0015] * 60, cpu_s=0.18, num_spans=600)
    text = format_report(off, on, hooks_us=0.9)
    assert "on / off: decision p50 1.500" in text and "CPU per decision 1.500" in text
    assert "0.90 us per decision" in text


def test_the_off_hooks_cost_microseconds():
    assert 0 < off_hook_cost_us(repeats=200) < 1000


@pytest.mark.slow
def test_a_quick_real_run_traces_the_on_mode_only():
    off, on = tracing_cost.run(num_requests=8, num_rounds=1, concurrency=2, seed=0)
    assert len(off.latency_s) == len(on.latency_s) == 8 and len(off.routing_s) == len(on.routing_s) == 8
    # route, length, 2x the local prediction (predictions in the router), Admit's client and server spans
    assert off.num_spans == 0 and on.num_spans == 8 * 6
