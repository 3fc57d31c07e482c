"""The sidecar continues the caller's trace on Predict and Admit (gRPC metadata); nothing else is traced."""

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from astrolabe.tracing import setup_tracing
from predictor.api import pb, pb_grpc
from predictor.server import SIMULATION_SPAN, Sidecar, SidecarConfig
from predictor.sim import EngineConfig

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN_ID = "b7ad6b7169203331"
METADATA = (("traceparent", f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"),)
ENGINE = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=512)


async def test_predict_and_admit_continue_the_callers_trace():
    exporter = InMemorySpanExporter()
    tracing = setup_tracing("astrolabe-predictor", environ={}, exporter=exporter)
    sidecar = Sidecar(SidecarConfig(backend="127.0.0.1:1", listen="127.0.0.1:0", engine=ENGINE), tracing)
    port = await sidecar.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.PredictorStub(channel)
            await stub.Admit(pb.AdmitRequest(request_id="r1", num_prompt_tokens=100, num_predicted_output_tokens=50),
                             timeout=5, metadata=METADATA)
            reply = await stub.Predict(pb.PredictRequest(request_id="r2", num_prompt_tokens=200,
                                                         num_predicted_output_tokens=100), timeout=5,
                                       metadata=METADATA)
            await stub.Predict(pb.PredictRequest(request_id="r3", num_prompt_tokens=1,
                                                 num_predicted_output_tokens=1), timeout=5)  # no caller context
            await stub.Release(pb.ReleaseRequest(request_id="r1"), timeout=5, metadata=METADATA)
            await stub.State(pb.StateRequest(), timeout=5)
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    finally:
        await sidecar.stop()
        tracing.shutdown()
    spans = exporter.get_finished_spans()
    names = sorted(s.name for s in spans)
    assert names == sorted(["/astrolabe.predictor.v1.Predictor/Admit", "/astrolabe.predictor.v1.Predictor/Predict",
                            "/astrolabe.predictor.v1.Predictor/Predict", SIMULATION_SPAN, SIMULATION_SPAN])
    traced = [s for s in spans if format(s.context.trace_id, "032x") == TRACE_ID]
    servers = [s for s in traced if s.kind == SpanKind.SERVER]
    assert len(servers) == 2 and all(format(s.parent.span_id, "016x") == CALLER_SPAN_ID for s in servers)
    (simulate,) = [s for s in traced if s.name == SIMULATION_SPAN]
    predict_server = next(s for s in servers if s.name.endswith("/Predict"))
    assert simulate.parent.span_id == predict_server.context.span_id
    a = simulate.attributes
    assert a["astrolabe.admit_id"] == "r2" and a["astrolabe.num_prompt_tokens"] == 200
    assert a["astrolabe.state_source"] == "ledger" and a["astrolabe.num_running"] + a["astrolabe.num_waiting"] == 1
    assert a["astrolabe.num_steps_simulated"] == reply.num_steps_simulated > 0
    assert a["astrolabe.predicted_e2e_s"] == reply.e2e_s and a["astrolabe.num_gpu_blocks"] == 512
    # a Predict without a caller context is a root of its own (the default sampler samples it)
    (untraced,) = [s for s in spans if s not in traced and s.kind == SpanKind.SERVER]
    assert untraced.parent is None


async def test_tracing_off_installs_no_interceptor():
    sidecar = Sidecar(SidecarConfig(backend="127.0.0.1:1", listen="127.0.0.1:0", engine=ENGINE))
    assert not sidecar.tracing.enabled and sidecar.tracing.server_interceptors(["/x.Y/Z"]) == []
    port = await sidecar.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await pb_grpc.PredictorStub(channel).Predict(
                pb.PredictRequest(request_id="r", num_prompt_tokens=10, num_predicted_output_tokens=10), timeout=5,
                metadata=METADATA)
        assert reply.e2e_s > 0
    finally:
        await sidecar.stop()
