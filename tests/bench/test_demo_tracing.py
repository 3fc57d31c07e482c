"""bench/demo_tracing.py: the demo's tracing flags, what each process gets from them (checked against the code that
reads it: ``astrolabe.tracing.resolve`` and ``astrolabe envoy --print-config``), the traced phase's requests and
the report. The demo's real run with tracing is in test_demo.py."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from astrolabe import envoy
from astrolabe.tracing import resolve
from bench import demo, demo_tracing
from bench.demo_tracing import DemoTracing
from bench.workloads import TraceRequest


def test_no_tracing_flag_means_no_tracing() -> None:
    assert demo._parse_args([]).tracing is None


@pytest.mark.parametrize(
    ("argv", "expected"),
    [(["--otlp-endpoint", "127.0.0.1:4317"], DemoTracing("127.0.0.1:4317", None, 1.0, 20)),
     (["--otlp-endpoint", "http://collector:4317/"], DemoTracing("collector:4317", None, 1.0, 20)),
     (["--otlp-endpoint", "127.0.0.1:4317", "--trace-sampling-ratio", "0.5", "--trace-requests", "3"],
      DemoTracing("127.0.0.1:4317", None, 0.5, 3))],
    ids=["endpoint", "url", "ratio-and-requests"],
)
def test_tracing_flags(argv: list[str], expected: DemoTracing) -> None:
    assert demo._parse_args(argv).tracing == expected


def test_a_trace_file_starts_without_an_endpoint(tmp_path: Path) -> None:
    tracing = demo._parse_args(["--trace-file", str(tmp_path / "spans.jsonl")]).tracing
    assert tracing == DemoTracing(None, tmp_path / "spans.jsonl", 1.0, demo_tracing.DEFAULT_PHASE_REQUESTS)


@pytest.mark.parametrize(
    "argv",
    [["--trace-sampling-ratio", "0.5"], ["--trace-requests", "3"],
     ["--otlp-endpoint", "127.0.0.1:1", "--trace-file", "x.jsonl"],
     ["--otlp-endpoint", "127.0.0.1:1", "--trace-sampling-ratio", "1.5"],
     ["--otlp-endpoint", "127.0.0.1:1", "--trace-sampling-ratio", "-0.1"],
     ["--otlp-endpoint", "127.0.0.1:1", "--trace-requests", "0"],
     ["--otlp-endpoint", "nowhere"], ["--otlp-endpoint", "https://collector:4317"],
     ["--otlp-endpoint", "http://collector:4317/v1/traces"],
     ["--otlp-endpoint", "127.0.0.1:1", "--backend", "vllm"]],
    ids=["ratio-alone", "requests-alone", "endpoint-and-file", "ratio-above-1", "ratio-below-0", "no-requests",
         "no-port", "tls", "path", "vllm-backend"],
)
def test_bad_tracing_flags_exit_with_usage_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo._parse_args(argv)
    assert exc.value.code == 2


def test_sidecars_and_emulators_export_and_follow_the_routers_sampling() -> None:
    env = DemoTracing("127.0.0.1:4317", None).service_env()
    # a caller's environment that points elsewhere or turns tracing off loses to the demo's variables
    resolved = resolve("astrolabe-predictor", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://elsewhere:1",
                                                       "OTEL_SDK_DISABLED": "true", **env})
    assert resolved.exporters == ("otlp",) and resolved.protocol == "grpc"
    assert resolved.sampler == "parentbased_always_off"
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://127.0.0.1:4317"
    assert float(env["OTEL_BSP_SCHEDULE_DELAY"]) == demo_tracing.EXPORT_DELAY_S * 1000


def test_the_traced_tier_samples_the_ratio_in_envoy_and_follows_it_in_the_extprocs(capsys) -> None:
    tier = DemoTracing("127.0.0.1:4317", None, sampling_ratio=0.25).router_tracing()
    resolved = resolve("astrolabe-extproc", environ=tier.extproc_env)
    assert (resolved.exporters, resolved.sampler, resolved.sampler_ratio) == (
        ("otlp",), "parentbased_traceidratio", 0.25)
    # the Envoy flags as `astrolabe envoy` renders them
    assert envoy.main(["--mode", "full-duplex", "--extproc", "127.0.0.1:9002", *tier.envoy_args,
                       "--print-config"]) == 0
    config = capsys.readouterr().out
    assert "random_sampling: { value: 25 }" in config
    assert f"tracing.opentelemetry.flush_interval_ms: {demo_tracing.EXPORT_DELAY_S * 1000:.0f}" in config
    assert 'socket_address: { address: "127.0.0.1", port_value: 4317 }' in config


def test_a_folder_is_no_trace_file(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        demo._parse_args(["--trace-file", str(tmp_path)])


def test_an_unstarted_receiver_has_no_environment_yet(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="start"):
        DemoTracing(None, tmp_path / "spans.jsonl").service_env()


def _request(i: int) -> TraceRequest:
    return TraceRequest(arrival_offset_s=0.5 * i, prompt=f"p{i}", num_prompt_tokens=3, num_output_tokens=4,
                        id=f"s0-{i}:x", max_tokens=8, router=i % 2)


def test_phase_requests_are_the_first_of_the_trace_with_uuid_ids() -> None:
    trace = [_request(i) for i in range(5)]
    phase = demo_tracing.phase_requests(trace, 3, seed=7)
    assert [(r.prompt, r.arrival_offset_s, r.router) for r in phase] == [
        (r.prompt, r.arrival_offset_s, r.router) for r in trace[:3]]
    assert all(uuid.UUID(r.id).version == 4 and len(r.id) == 36 for r in phase)  # what Envoy samples
    assert len({r.id for r in phase}) == 3
    assert [r.id for r in demo_tracing.phase_requests(trace, 3, seed=7)] == [r.id for r in phase]  # seeded
    assert len(demo_tracing.phase_requests(trace, 10, seed=7)) == 5


@pytest.mark.parametrize(("policies", "expected"),
                         [(("gie", "astrolabe"), "astrolabe"), (("envoy-least-request", "gie"), "envoy-least-request")],
                         ids=["astrolabe-when-run", "else-the-first"])
def test_phase_policy(policies: tuple[str, ...], expected: str) -> None:
    assert demo_tracing.phase_policy(policies) == expected


def _record(trace_id: str, span_id: str, parent: str, name: str, start_ns: int) -> dict:
    return {"trace_id": trace_id, "span_id": span_id, "parent_span_id": parent, "name": name, "kind": "SERVER",
            "service_name": "svc", "start_time_unix_ns": start_ns, "end_time_unix_ns": start_ns + 2_000_000,
            "attributes": {}, "events": [], "links": [], "status_code": "UNSET"}


def test_the_report_counts_the_file_and_prints_its_fullest_trace(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    records = [_record("a" * 32, "1" * 16, "", "lonely", 0),
               _record("b" * 32, "2" * 16, "", "root", 10), _record("b" * 32, "3" * 16, "2" * 16, "child", 20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = demo_tracing.report(DemoTracing("127.0.0.1:1", path, 0.5, 4), "astrolabe").splitlines()
    assert lines[0].startswith("traces: 4 requests through a new astrolabe router tier after the tables, 50% sampled")
    assert lines[1] == f"traces: 2 traces, 3 spans in {path}"
    assert lines[3:6] == ["start ms   dur ms  span", "     0.00      2.00  svc: root (SERVER)",
                          "     0.00      2.00    svc: child (SERVER)"]
    assert lines[-1].startswith(f"any trace with its attributes: python -m bench.otlp_receiver --show {path}")


def test_the_report_without_a_file_says_where_the_spans_went(tmp_path: Path) -> None:
    assert demo_tracing.report(DemoTracing("collector:4317", None), "gie").count("\n") == 0
    missing = demo_tracing.report(DemoTracing("127.0.0.1:1", tmp_path / "none.jsonl"), "gie")
    assert "cannot read" in missing.splitlines()[1]
