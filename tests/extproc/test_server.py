"""Server lifecycle: gRPC health, endpoint health checks, live config reload, graceful drain."""

import asyncio
import json

import grpc
import pytest
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc import wire
from extproc.config import load_config, parse_config, replace_config
from extproc.server import ConfigWatcher, ExtprocServer, main
from tests.extproc.health_backend import health_backend
from tests.extproc.test_stream import BODY, body_msg, destination_of, headers_msg

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
async def backend():
    """A real HTTP server answering /health (status switchable)."""
    state = {"status": 200}

    async def health(_request):
        return web.Response(status=state["status"])

    async with health_backend(health) as (address,):
        yield address, state


async def _statuses(port):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {name: (await stub.Check(health_pb2.HealthCheckRequest(service=name))).status
                for name in wire.HEALTH_SERVICE_NAMES}


async def test_health_services_and_endpoint_checks(backend):
    address, state = backend
    config = parse_config({
        "listen": "127.0.0.1:0",
        "health_check": {"interval_s": 0.05, "timeout_s": 0.5, "unhealthy_threshold": 1},
        "endpoints": [{"address": address}, {"address": "127.0.0.1:1"}],  # port 1: nothing listens
    })
    server = ExtprocServer(config)
    port = await server.start()
    try:
        assert set((await _statuses(port)).values()) == {SERVING}
        assert server.pool.is_healthy(address) and not server.pool.is_healthy("127.0.0.1:1")
        state["status"] = 503
        for _ in range(200):
            if not server.pool.is_healthy(address):
                break
            await asyncio.sleep(0.02)
        assert not server.pool.is_healthy(address)
        state["status"] = 200
        for _ in range(200):
            if server.pool.is_healthy(address):
                break
            await asyncio.sleep(0.02)
        assert server.pool.is_healthy(address)
    finally:
        await server.stop()


def _write(path, endpoints, **extra):
    path.write_text(json.dumps({"listen": "127.0.0.1:0", "health_check": {"enabled": False},
                                "endpoints": [{"address": a} for a in endpoints], **extra}))


def _reload_lines(caplog) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith("config reloaded")]


async def test_reload_names_the_changed_keys_and_those_that_need_a_restart(tmp_path, caplog):
    caplog.set_level("INFO", logger="extproc.server")
    path = tmp_path / "extproc.yaml"
    _write(path, ["127.0.0.1:18001"])
    server = ExtprocServer(load_config(path), path)
    watcher = ConfigWatcher(path, server.config, server.pool)
    _write(path, ["127.0.0.1:18002"])
    assert watcher.poll()
    assert _reload_lines(caplog) == [("INFO", "config reloaded: changed endpoints (applied live)")]
    assert "endpoints now 1: added 127.0.0.1:18002; removed 127.0.0.1:18001" in caplog.text
    caplog.clear()
    _write(path, ["127.0.0.1:18002"], drain_delay_s=5, predictor_client={"predict_timeout_s": 0.5})
    assert watcher.poll()
    assert _reload_lines(caplog) == [
        ("WARNING", "config reloaded: changed drain_delay_s, predictor_client.predict_timeout_s; need a restart "
                    "(not applied): drain_delay_s, predictor_client.predict_timeout_s")]
    caplog.clear()  # not applied: still a difference from the running config at the next reload
    _write(path, ["127.0.0.1:18003"], drain_delay_s=5, predictor_client={"predict_timeout_s": 0.5})
    assert watcher.poll()
    assert _reload_lines(caplog) == [
        ("WARNING", "config reloaded: changed endpoints, drain_delay_s, predictor_client.predict_timeout_s; need a "
                    "restart (not applied): drain_delay_s, predictor_client.predict_timeout_s")]
    assert [e.address for e in server.pool.endpoints] == ["127.0.0.1:18003"]


async def test_reload_does_not_report_a_key_the_command_line_set(tmp_path, caplog):
    caplog.set_level("INFO", logger="extproc.server")
    path = tmp_path / "extproc.yaml"
    _write(path, ["127.0.0.1:18001"])
    overrides = {"policy": "random", "log_level": "DEBUG"}
    server = ExtprocServer(replace_config(load_config(path), **overrides), path, overrides=overrides)
    watcher = ConfigWatcher(path, server.config, server.pool, overrides)
    path.write_text(path.read_text() + "\n")  # new content, same keys
    assert watcher.poll()
    assert _reload_lines(caplog) == [("INFO", "config reloaded: no key changed")]


async def test_reload_applies_endpoints_and_rejects_bad_files(tmp_path):
    path = tmp_path / "extproc.yaml"
    _write(path, ["127.0.0.1:18001"])
    server = ExtprocServer(load_config(path), path)
    watcher = ConfigWatcher(path, server.config, server.pool)
    server.pool.acquire("127.0.0.1:18001")
    assert not watcher.poll()  # unchanged
    _write(path, ["127.0.0.1:18002", "127.0.0.1:18003"])
    assert watcher.poll()
    assert [e.address for e in server.pool.endpoints] == ["127.0.0.1:18002", "127.0.0.1:18003"]
    # a request routed before the reload still releases its slot
    assert server.pool.in_flight("127.0.0.1:18001") == 1
    server.pool.release("127.0.0.1:18001")
    assert server.pool.in_flight("127.0.0.1:18001") == 0
    path.write_text("endpoints: [")
    assert not watcher.poll()
    assert len(server.pool.endpoints) == 2


async def test_reload_while_serving(tmp_path):
    path = tmp_path / "extproc.yaml"
    _write(path, ["127.0.0.1:18001"], reload_interval_s=0.05)
    server = ExtprocServer(load_config(path), path)
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)

            async def route_once():
                call = stub.Process()
                await call.write(headers_msg())
                await call.read()
                await call.write(body_msg(BODY))
                dest = destination_of((await call.read()).request_body.response)
                await call.done_writing()
                return dest

            assert await route_once() == "127.0.0.1:18001"
            _write(path, ["127.0.0.1:18009"], reload_interval_s=0.05)
            for _ in range(200):
                if server.pool.endpoints[0].address == "127.0.0.1:18009":
                    break
                await asyncio.sleep(0.02)
            assert await route_once() == "127.0.0.1:18009"
    finally:
        await server.stop()


async def test_graceful_shutdown_drains_in_flight_stream():
    config = parse_config({"listen": "127.0.0.1:0", "grace_period_s": 5, "health_check": {"enabled": False},
                           "endpoints": [{"address": "127.0.0.1:18001"}]})
    server = ExtprocServer(config)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ExternalProcessorStub(channel)
    call = stub.Process()
    await call.write(headers_msg())
    await call.read()
    stopping = asyncio.create_task(server.stop())
    await asyncio.sleep(0.2)
    assert not stopping.done()  # waiting for the open stream
    # the in-flight stream still completes during the drain
    await call.write(body_msg(BODY))
    assert destination_of((await call.read()).request_body.response) == "127.0.0.1:18001"
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
    await asyncio.wait_for(stopping, 5)
    assert server.pool.in_flight("127.0.0.1:18001") == 0
    await channel.close()


async def test_a_stream_before_the_first_health_round_is_unavailable_then_routed():
    """Until its first health round is in the extproc knows no healthy endpoint: a stream then (Envoy's panic
    routing sends one to a restarted, listening extproc) is aborted with UNAVAILABLE, so that Envoy applies its
    failure mode (fail-open: its own load balancing), not answered 503 for a fleet that is up; once ready, routed."""
    answer = asyncio.Event()

    async def health(_request):
        await answer.wait()
        return web.Response(status=200)

    async with health_backend(health) as (address,):
        config = parse_config({"listen": "127.0.0.1:0", "health_check": {"interval_s": 5, "timeout_s": 30},
                               "endpoints": [{"address": address}]})
        server = ExtprocServer(config)
        starting = asyncio.create_task(server.start())
        try:
            for _ in range(500):
                if server.port:
                    break
                await asyncio.sleep(0.01)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = pb_grpc.ExternalProcessorStub(channel)
                assert (await _statuses(server.port))["readiness"] == NOT_SERVING
                call = stub.Process()
                await call.write(headers_msg())
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await call.read()
                assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "not ready" in raised.value.details()
                assert not starting.done()
                answer.set()
                await asyncio.wait_for(starting, 10)
                call = stub.Process()
                await call.write(headers_msg())
                await call.read()
                await call.write(body_msg(BODY))
                assert destination_of((await call.read()).request_body.response) == address
                await call.done_writing()
        finally:
            answer.set()
            if not starting.done():
                await starting
            await server.stop()


def test_main_rejects_bad_config(tmp_path, caplog):
    path = tmp_path / "bad.yaml"
    path.write_text("endpoints: [{address: nohost}]")
    assert main(["--config", str(path)]) == 2
    assert "endpoints[0].address" in caplog.text
    assert main(["--config", str(tmp_path / "c.yaml"), "--policy", "x"]) == 2
    path.write_text("output_length: {tagger_path: /nonexistent}\nendpoints: [{address: 127.0.0.1:1}]")
    assert main(["--config", str(path)]) == 2
    assert "tagger_path" in caplog.text


async def test_discovered_endpoints_that_leave_take_their_series_and_sidecar_channels_with_them():
    """Pod churn with requests in flight (a break-it pass: 1,000 replacements left 15,000 metric series and 1,016
    open connections to gone sidecars): a request still running when its endpoint leaves ends without observing
    the gone endpoint's series or reopening its sidecar's channel; new endpoints' sidecars are connected once."""
    from extproc.config import EndpointConfig, parse_config  # noqa: PLC0415
    from extproc.decision import Decision  # noqa: PLC0415
    from extproc.policies.base import Prediction  # noqa: PLC0415
    from extproc.server import ExtprocServer  # noqa: PLC0415

    config = parse_config({"listen": "127.0.0.1:0", "health_check": {"enabled": False}, "endpoints": []})
    server = ExtprocServer(config)
    try:
        first = EndpointConfig("10.0.0.1:8000", (), "10.0.0.1:9100")
        second = EndpointConfig("10.0.0.2:8000", (), "10.0.0.2:9100")
        server._publish((first, second))
        decision = Decision(first.address, "astrolabe", "r1", first.predictor, "prediction",
                            ((first.address, Prediction(0.1, 1.0, 0.0)),), decided_at_s=1.0)
        server.pool.acquire(first.address)
        server.router.metrics.prediction_ratio.labels(first.address, "e2e").observe(1.0)
        server._publish((second,))  # the first pod went away with r1 still running there
        server.router.release(decision)
        families = {s.labels.get("endpoint") for m in server.metrics.registry.collect()
                    if m.name == "astrolabe_extproc_prediction_ratio" for s in m.samples}
        assert first.address not in families
        assert first.predictor not in server.predictors._stubs  # not reopened by the Release
        assert server.pool.in_flight(first.address) == 0
    finally:
        await server.predictors.close()


@pytest.mark.parametrize("broken", [b"\xff\xfe not utf-8", b"[" * 20000], ids=["not-utf8", "deep"])
async def test_a_broken_reload_is_rejected_and_the_next_one_applies(tmp_path, caplog, broken):
    """The watcher caught ConfigError only: these ended live reload for good, silently (a break-it pass)."""
    path = tmp_path / "extproc.yaml"
    _write(path, ["127.0.0.1:18001"])
    server = ExtprocServer(load_config(path), path)
    watcher = ConfigWatcher(path, server.config, server.pool)
    path.write_bytes(broken)
    assert not watcher.poll()
    assert "config reload rejected, keeping the previous endpoints" in caplog.text
    _write(path, ["127.0.0.1:18002"])
    assert watcher.poll()
    assert [e.address for e in server.pool.endpoints] == ["127.0.0.1:18002"]
