"""astrolabe.tracing: which settings win, tracing off costs no SDK, propagation helpers never raise."""

import json
import os
import subprocess
import sys
import threading

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from astrolabe.tracing import (ResolvedTracing, Tracing, TracingConfig, TracingConfigError, context_from,
                               grpc_metadata, inject_headers, normalize_endpoint, resolve, setup_tracing)

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{SPAN_ID}-01"


def _bsp_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("OtelBatch")]


@pytest.mark.parametrize("config, environ, exporters", [
    (None, {}, ()),
    (TracingConfig(), {"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, ()),
    (TracingConfig(endpoint="127.0.0.1:4317"), {}, ("otlp",)),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, ("otlp",)),
    (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317"}, ("otlp",)),
    (None, {"OTEL_TRACES_EXPORTER": "console"}, ("console",)),
    (None, {"OTEL_TRACES_EXPORTER": "otlp, console"}, ("otlp", "console")),
    (TracingConfig(endpoint="127.0.0.1:4317"), {"OTEL_TRACES_EXPORTER": "none"}, ()),
    (TracingConfig(endpoint="127.0.0.1:4317"), {"OTEL_SDK_DISABLED": "TRUE"}, ()),
    (TracingConfig(endpoint="127.0.0.1:4317"), {"OTEL_SDK_DISABLED": "false"}, ("otlp",)),
], ids=["nothing", "no-endpoint", "config-endpoint", "env-endpoint", "env-traces-endpoint", "env-console",
        "env-two-exporters", "env-none-wins", "sdk-disabled-wins", "sdk-disabled-false"])
def test_when_tracing_is_on(config, environ, exporters):
    assert resolve("svc", config, environ).exporters == exporters


def test_environment_wins_over_the_config_key_by_key():
    config = TracingConfig(endpoint="10.0.0.1:4317", protocol="grpc", sampler_ratio=0.25, service_name="file")
    assert resolve("svc", config, {}) == ResolvedTracing(
        ("otlp",), "http://10.0.0.1:4317", "grpc", "parentbased_traceidratio", 0.25, "file")
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5", "OTEL_SERVICE_NAME": "env"}
    resolved = resolve("svc", config, env)
    # the exporter reads an endpoint from the environment itself (and appends /v1/traces for http/protobuf)
    assert resolved.endpoint is None and resolved.protocol == "http/protobuf"
    assert (resolved.sampler, resolved.sampler_ratio, resolved.service_name) == ("traceidratio", 0.5, "env")
    assert resolve("svc", config, {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                                   "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}).protocol == "http/protobuf"


@pytest.mark.parametrize("environ, config, name", [
    ({}, TracingConfig(), "svc"),
    ({}, TracingConfig(service_name="file"), "file"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "team=a,service.name=res%20name"}, TracingConfig(service_name="file"), "res name"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=res", "OTEL_SERVICE_NAME": "env"}, TracingConfig(), "env"),
], ids=["default", "config", "resource-attributes", "service-name-variable"])
def test_service_name_precedence(environ, config, name):
    assert resolve("svc", config, environ).service_name == name


def test_http_protobuf_endpoint_from_the_config_gets_the_traces_path():
    resolved = resolve("svc", TracingConfig(endpoint="https://collector:4318/", protocol="http/protobuf"), {})
    assert resolved.endpoint == "https://collector:4318/v1/traces"


@pytest.mark.parametrize("environ, fragment", [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "PROTOCOL"),
    ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"}, "OTEL_TRACES_SAMPLER_ARG"),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"},
     "OTEL_TRACES_SAMPLER_ARG"),
], ids=["exporter", "protocol", "sampler", "ratio-range", "ratio-text"])
def test_bad_environment_values_raise(environ, fragment):
    with pytest.raises(TracingConfigError, match=fragment):
        resolve("svc", TracingConfig(endpoint="127.0.0.1:4317"), environ)


@pytest.mark.parametrize("kwargs", [{"protocol": "http/json"}, {"sampler_ratio": -0.1}, {"sampler_ratio": 1.01},
                                    {"endpoint": "collector"}, {"endpoint": "ftp://x:1"}, {"endpoint": "h:99999"}],
                         ids=["protocol", "ratio-low", "ratio-high", "no-port", "scheme", "port-range"])
def test_bad_config_values_raise(kwargs):
    with pytest.raises(TracingConfigError):
        TracingConfig(**kwargs)


@pytest.mark.parametrize("text, url", [("127.0.0.1:4317", "http://127.0.0.1:4317"),
                                       ("collector.svc:4317", "http://collector.svc:4317"),
                                       ("[::1]:4317", "http://[::1]:4317"),
                                       ("https://collector:443", "https://collector:443"),
                                       ("http://collector", "http://collector")])
def test_normalize_endpoint(text, url):
    assert normalize_endpoint(text, "endpoint") == url


def test_bsp_sizes_the_sdk_refuses_are_a_config_error(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "8")  # the SDK reads these from os.environ itself
    with pytest.raises(TracingConfigError, match="OTEL_BSP_"):
        setup_tracing("svc", environ={}, exporter=InMemorySpanExporter())


def test_off_means_no_sdk_no_thread_no_interceptor():
    before = len(_bsp_threads())
    tracing = setup_tracing("svc", TracingConfig(), environ={})
    assert not tracing.enabled and tracing.provider is None
    assert isinstance(tracing.tracer("x"), trace.NoOpTracer)
    assert tracing.server_interceptors(["/a.B/C"]) == []
    span = tracing.tracer("x").start_span("s")
    assert not span.get_span_context().is_valid and inject_headers(span) == [] and grpc_metadata(span) is None
    assert len(_bsp_threads()) == before
    tracing.shutdown()  # nothing to do, no error


def test_on_records_and_exports_with_the_resolved_sampler_and_name():
    exporter = InMemorySpanExporter()
    tracing = setup_tracing("svc", TracingConfig(service_name="named"), environ={}, exporter=exporter)
    try:
        assert tracing.enabled and len(tracing.server_interceptors(["/a.B/C"])) == 1
        with tracing.tracer("t").start_as_current_span("work") as span:
            headers = dict(inject_headers(span))
        assert headers["traceparent"].split("-")[2] == format(span.get_span_context().span_id, "016x")
    finally:
        tracing.shutdown()
    (finished,) = exporter.get_finished_spans()
    assert finished.name == "work" and finished.resource.attributes["service.name"] == "named"
    tracing.shutdown()  # idempotent


def test_ratio_zero_samples_no_new_trace_but_follows_a_sampled_parent():
    exporter = InMemorySpanExporter()
    tracing = setup_tracing("svc", TracingConfig(sampler_ratio=0.0), environ={}, exporter=exporter)
    tracer = tracing.tracer("t")
    tracer.start_span("new root").end()
    tracer.start_span("child", context=context_from({"traceparent": TRACEPARENT})).end()
    tracing.shutdown()
    assert [s.name for s in exporter.get_finished_spans()] == ["child"]


def test_shutdown_with_an_unreachable_receiver_is_bounded():
    tracing = setup_tracing("svc", TracingConfig(endpoint="127.0.0.1:1"), environ={})
    tracing.tracer("t").start_span("lost").end()
    tracing.shutdown(timeout_s=0.5)  # returns; the spans are dropped (logged), nothing raises
    assert tracing.provider is None


@pytest.mark.parametrize("carrier", [
    {}, {"traceparent": "garbage"}, {"traceparent": f"00-{'0' * 32}-{SPAN_ID}-01"},
    {"traceparent": f"00-{TRACE_ID}-{'0' * 16}-01"}, {"traceparent": f"ff-{TRACE_ID}-{SPAN_ID}-01"},
    {"traceparent": f"00-{TRACE_ID.upper()}-{SPAN_ID}-01"}, {"traceparent": TRACEPARENT + "-extra"},
    {"traceparent": "00-" + "a" * 10_000}, {"traceparent": "\x00\xff"},
], ids=["absent", "garbage", "zero-trace-id", "zero-span-id", "version-ff", "upper-case", "extra-field", "huge",
        "binary"])
def test_malformed_contexts_are_ignored(carrier):
    assert context_from(carrier) is None


def test_a_valid_context_is_extracted_with_its_tracestate():
    context = context_from({"traceparent": TRACEPARENT, "tracestate": "vendor=1,bad entry,other=2"})
    span_context = trace.get_current_span(context).get_span_context()
    assert format(span_context.trace_id, "032x") == TRACE_ID and span_context.is_remote
    assert format(span_context.span_id, "016x") == SPAN_ID


def test_off_resolves_nothing():
    tracing = Tracing.off()
    assert not tracing.enabled and tracing.resolved is None and tracing.tracer("x") is tracing.tracer("y")


@pytest.mark.parametrize("args", [
    ["extproc", "--config", "{config}"],
    ["predictor", "serve", "--backend", "127.0.0.1:9", "--listen", "127.0.0.1:0"],
    ["emulator", "--port", "0"],
    ["tagger", "serve", "--listen", "127.0.0.1:0"],
], ids=["extproc", "sidecar", "emulator", "tagger"])
def test_every_service_refuses_a_bad_otel_value_at_start(tmp_path, args):
    config = tmp_path / "extproc.yaml"
    config.write_text(json.dumps({"listen": "127.0.0.1:0", "policy": "least-requests",
                                  "health_check": {"enabled": False}, "endpoints": [{"address": "127.0.0.1:9"}]}))
    done = subprocess.run([sys.executable, "-m", "astrolabe", *(a.format(config=config) for a in args)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                               "OTEL_TRACES_SAMPLER": "sometimes"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "invalid tracing configuration: OTEL_TRACES_SAMPLER" in done.stderr and "Traceback" not in done.stderr


def test_exporter_settings_it_refuses_are_a_config_error(monkeypatch):
    """The OTLP exporter reads OTEL_EXPORTER_OTLP_TIMEOUT etc. itself (from os.environ): a bad one is a clear
    TracingConfigError (the services exit 2 with it), not a traceback."""
    from astrolabe.tracing import TracingConfigError

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "abc")
    with pytest.raises(TracingConfigError, match="OTEL_EXPORTER_OTLP"):
        setup_tracing("svc", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"})
