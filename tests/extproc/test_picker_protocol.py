"""The Endpoint Picker protocol in the router and the stream: the subset hint, the ordered fallback list and the
served endpoint (gateway-api-inference-extension docs/proposals/004-endpoint-picker-protocol). The same points
through the real Envoy: tests/integration/test_picker_protocol.py."""

import asyncio

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc import wire
from tests.extproc.test_router import make_router, request, sidecars  # noqa: F401 (a fixture)
from tests.extproc.test_stream import BODY, body_msg, headers_msg, metadata_of, running_server

ENDPOINTS = [{"address": f"127.0.0.1:1800{i}"} for i in range(1, 5)]


def _with_hint(message: pb.ProcessingRequest, value: struct_pb2.Value) -> pb.ProcessingRequest:
    message.metadata_context.filter_metadata[wire.SUBSET_HINT_NAMESPACE].fields[wire.DESTINATION_SUBSET_HEADER] \
        .CopyFrom(value)
    return message


def _list(*items: str) -> struct_pb2.Value:
    value = struct_pb2.Value()
    value.list_value.values.extend(struct_pb2.Value(string_value=item) for item in items)
    return value


@pytest.fixture
async def stub():
    async with running_server({"policy": "least-requests", "seed": 1, "fallback_endpoints": 2, "drain_delay_s": 0,
                               "health_check": {"enabled": False}, "endpoints": ENDPOINTS}) as running:
        yield running


async def _route(stub, first: pb.ProcessingRequest) -> pb.ProcessingResponse:
    """One buffered request: its body's answer (the route, or an immediate response)."""
    call = stub.Process()
    await call.write(first)
    await call.read()  # the headers' CONTINUE
    await call.write(body_msg(BODY))
    answer = await call.read()
    await call.done_writing()
    return answer


@pytest.mark.parametrize("hint, allowed", [
    (_list("127.0.0.1:18003"), {"127.0.0.1:18003"}),
    (_list("127.0.0.1:18002", "10.9.9.9:1", "junk"), {"127.0.0.1:18002"}),  # unknown and malformed: not eligible
    (struct_pb2.Value(string_value="127.0.0.1:18004, 127.0.0.1:18001"), {"127.0.0.1:18004", "127.0.0.1:18001"}),
    (_list("127.0.0.1"), {f"127.0.0.1:1800{i}" for i in range(1, 5)}),  # a bare IP: any port of it (as GIE)
])
async def test_the_subset_hint_limits_the_choice(stub, hint, allowed):
    _, client = stub
    for _ in range(6):
        answer = await _route(client, _with_hint(headers_msg(), hint))
        assert metadata_of(answer).split(",")[0] in allowed


@pytest.mark.parametrize("hint", [_list(), _list("10.9.9.9:1"), _list("127.0.0.9")], ids=["empty", "no-eligible",
                                                                                    "no-eligible-ip"])
async def test_an_empty_or_ineligible_subset_is_503(stub, hint):
    _, client = stub
    answer = await _route(client, _with_hint(headers_msg(), hint))
    assert answer.immediate_response.status.code == 503
    assert b"subset hint" in answer.immediate_response.body


async def test_the_destination_lists_the_fallbacks_least_loaded_first(stub):
    server, client = stub
    server.pool.acquire("127.0.0.1:18001")
    server.pool.acquire("127.0.0.1:18001")
    server.pool.acquire("127.0.0.1:18002")
    answer = await _route(client, headers_msg())
    listed = metadata_of(answer).split(",")
    (option,) = answer.request_body.response.header_mutation.set_headers
    assert option.header.raw_value.decode() == metadata_of(answer)  # header and metadata agree
    assert len(listed) == 3 and len(set(listed)) == 3
    assert listed[0] in ("127.0.0.1:18003", "127.0.0.1:18004")  # least-requests' choice
    assert listed[1] in ("127.0.0.1:18003", "127.0.0.1:18004") and listed[2] == "127.0.0.1:18002"


async def test_the_served_endpoint_moves_the_in_flight_count(stub):
    server, client = stub
    call = client.Process()
    await call.write(headers_msg())
    await call.read()
    await call.write(body_msg(BODY))
    chosen, fallback, _ = metadata_of(await call.read()).split(",")
    assert server.pool.in_flight(chosen) == 1
    served = pb.ProcessingRequest(response_headers=pb.HttpHeaders())
    served.metadata_context.filter_metadata[wire.LB_METADATA_NAMESPACE].fields[wire.DESTINATION_SERVED_KEY] \
        .string_value = fallback
    await call.write(served)
    assert (await call.read()).HasField("response_headers")
    assert server.pool.in_flight(chosen) == 0 and server.pool.in_flight(fallback) == 1
    assert server.metrics.registry.get_sample_value("astrolabe_extproc_served_elsewhere_total") == 1
    await call.done_writing()
    await call.read()  # the end of the stream
    for _ in range(50):
        if server.pool.in_flight(fallback) == 0:
            break
        await asyncio.sleep(0.01)
    assert server.pool.in_flight(fallback) == 0


async def test_a_served_report_naming_no_endpoint_of_the_pool_is_ignored():
    router = make_router([None, None, None], policy="least-requests")
    router._num_fallbacks = 1
    decision = await router.route(request())
    assert router.served(decision, "10.9.9.9:8000") is decision  # no endpoint of the pool: a foreign report
    assert router.served(decision, decision.destination) is decision
    unlisted = next(e.address for e in router.pool.endpoints
                    if e.address not in (decision.destination, *decision.fallbacks))
    gateway_choice = router.served(decision, unlisted)  # the gateway chose past the list: the count follows
    assert gateway_choice.destination == unlisted and router.pool.in_flight(unlisted) == 1
    router.release(gateway_choice)
    moved = router.served(decision, decision.fallbacks[0])
    assert moved.destination == decision.fallbacks[0] and moved.served_elsewhere
    assert router.pool.in_flight(decision.destination) == 0 and router.pool.in_flight(moved.destination) == 1
    await router.predictors.close()


async def test_predicted_fallbacks_are_the_other_candidates_best_first(sidecars):
    started = await sidecars(4)
    router = make_router([f"127.0.0.1:{s.port}" for s in started], params={"k": 4, "metric": "ttft"})
    router._num_fallbacks = 3
    try:
        for i in range(8):  # load the instances unevenly, so the predictions differ
            decision = await router.route(request(i))
        assert len(decision.fallbacks) == 3
        predicted = {address: p.ttft_s for address, p in decision.candidates if p is not None}
        assert [predicted[a] for a in decision.fallbacks] == sorted(predicted[a] for a in decision.fallbacks)
        assert decision.destination not in decision.fallbacks
    finally:
        await router.predictors.close()


def test_no_subset_is_not_an_empty_subset():
    """A request without a hint may go anywhere; an empty hint allows nothing (503); a hint that is neither a list
    nor a string is ignored, as the reference pickers ignore it."""
    from extproc.stream import _subset_hint  # noqa: PLC0415

    assert _subset_hint(headers_msg()) is None
    assert _subset_hint(_with_hint(headers_msg(), _list())) == frozenset()
    assert _subset_hint(_with_hint(headers_msg(), struct_pb2.Value(number_value=3))) is None
    assert _subset_hint(_with_hint(headers_msg(), _list("[0:0::1]:8000", " ::1 ", "x"))) == {"[::1]:8000", "::1"}


async def test_repeated_request_headers_do_not_route_twice(stub):
    """Envoy sends the request headers once; a client of the gRPC port that sends them again must not add a second
    in-flight count (a break-it pass: 100 streams x 5 headers left 400 phantom requests)."""
    server, client = stub
    call = client.Process()
    for _ in range(5):
        await call.write(headers_msg(method="GET", path="/v1/models", eos=True))
        await call.read()
    assert sum(server.pool.in_flight(e["address"]) for e in ENDPOINTS) == 1
    await call.done_writing()
    await call.read()
    for _ in range(50):
        if sum(server.pool.in_flight(e["address"]) for e in ENDPOINTS) == 0:
            break
        await asyncio.sleep(0.01)
    assert sum(server.pool.in_flight(e["address"]) for e in ENDPOINTS) == 0


@pytest.mark.parametrize("passive", [True, False])
async def test_a_fallback_serving_ejects_the_chosen_endpoint_only_with_active_checks(passive):
    router = make_router([None, None, None], policy="least-requests")
    router._num_fallbacks, router._passive_ejection = 1, passive
    decision = await router.route(request())
    router.served(decision, decision.fallbacks[0])
    assert router.pool.is_healthy(decision.destination) is not passive
    await router.predictors.close()


def _response_headers(code_details: str, upstream: str | None = None) -> pb.ProcessingRequest:
    """Response headers with the attributes Envoy sends (the filter's ``response_attributes``)."""
    message = pb.ProcessingRequest(response_headers=pb.HttpHeaders())
    attributes = message.attributes["envoy.filters.http.ext_proc"]
    attributes.fields["response.code_details"].string_value = code_details
    if upstream is not None:
        attributes.fields["upstream.address"].string_value = upstream
    return message


REFUSED = "upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}"


@pytest.mark.parametrize("code_details, upstream, ejected", [
    (REFUSED, "{chosen}", True),  # Envoy's 503 after the endpoint refused the connection
    (REFUSED, None, True),  # no upstream.address: the chosen endpoint
    (REFUSED, "10.9.9.9:80", False),  # an address outside the pool
    ("via_upstream", "{chosen}", False),  # the backend answered (whatever its status)
    ("upstream_reset_before_response_started{connection_termination}", "{chosen}", False),  # reset, not refused
    # Envoy's 504 when a try's deadline fired before the response started: a frozen backend, ejected the same way
    ("upstream_per_try_idle_timeout", "{chosen}", True),
    ("upstream_per_try_timeout", None, True),
    ("upstream_response_timeout", "{chosen}", False),  # the route's overall timeout (ours is off): not the backend's
], ids=["refused", "refused-no-address", "refused-outside", "answered", "terminated", "idle-timeout",
        "per-try-timeout", "route-timeout"])
async def test_a_refused_connection_or_a_per_try_timeout_ejects_the_endpoint(code_details, upstream, ejected):
    """Passive failure detection without --pool (ORIGINAL_DST: no outlier detection, no served endpoint)."""
    async with running_server({"policy": "round-robin", "drain_delay_s": 0, "health_check": {"interval_s": 60},
                               "endpoints": ENDPOINTS}) as (server, stub):
        for e in ENDPOINTS:
            server.pool.set_healthy(e["address"], True)
        call = stub.Process()
        await call.write(headers_msg())
        await call.read()
        await call.write(body_msg(BODY))
        answer = await call.read()
        chosen = next(h.header.raw_value.decode() for h in answer.request_body.response.header_mutation.set_headers
                      if h.header.key == wire.DESTINATION_HEADER)
        await call.write(_response_headers(code_details, upstream and upstream.format(chosen=chosen)))
        await call.read()
        await call.done_writing()
        assert server.pool.is_healthy(chosen) is not ejected
        assert sum(server.pool.is_healthy(e["address"]) for e in ENDPOINTS) == len(ENDPOINTS) - ejected
        assert server.metrics.connect_failures._value.get() == ejected
        if ejected:  # the next requests avoid it
            for _ in range(6):
                assert chosen not in str(await _route(stub, headers_msg()))


async def test_a_refused_connection_ejects_nothing_without_active_checks():
    """With health checks off nothing would bring an ejected endpoint back: the report is ignored."""
    router = make_router([None, None], policy="least-requests")
    decision = await router.route(request())
    router.connect_failed(decision, decision.destination)
    assert router.pool.is_healthy(decision.destination)
    await router.predictors.close()


def _answered(status: int, code_details: str = "via_upstream") -> pb.ProcessingRequest:
    message = _response_headers(code_details)
    message.response_headers.headers.headers.add(key=":status", raw_value=str(status).encode())
    return message


@pytest.mark.parametrize("statuses, ejected", [
    ([500] * 5, True),  # five 5xx answers in a row (Envoy's consecutive_5xx default)
    ([503, 500, 502, 500], False),  # four
    ([500, 500, 200, 500, 500, 500], False),  # a success resets the count
    ([429] * 6, False),  # 4xx is the client's (or a rate limit), not a sick backend
], ids=["five-5xx", "four-5xx", "reset-by-200", "4xx"])
async def test_an_endpoint_answering_5xx_in_a_row_is_ejected(statuses, ejected):
    """A backend that fails fast attracts least-loaded traffic (its in-flight count stays lowest) while its health
    endpoint answers 200 (a break-it pass: 32 of 60 requests)."""
    async with running_server({"policy": "round-robin", "drain_delay_s": 0, "health_check": {"interval_s": 60},
                               "endpoints": ENDPOINTS[:1]}) as (server, stub):
        (address,) = [e["address"] for e in ENDPOINTS[:1]]
        server.pool.set_healthy(address, True)
        for status in statuses:
            call = stub.Process()
            await call.write(headers_msg())
            await call.read()
            await call.write(body_msg(BODY))
            await call.read()
            await call.write(_answered(status))
            await call.read()
            await call.done_writing()
        assert server.pool.is_healthy(address) is not ejected
        assert server.metrics.consecutive_5xx_ejections._value.get() == ejected


async def test_envoys_own_503_is_not_a_backend_answer():
    """Envoy's local replies (no healthy upstream, the route's timeout) are not the backend's 5xx: they do not count
    (a per-try timeout does eject, as a refused connection: `test_a_refused_connection_or_a_per_try_timeout_...`)."""
    async with running_server({"policy": "round-robin", "drain_delay_s": 0, "health_check": {"interval_s": 60},
                               "endpoints": ENDPOINTS[:1]}) as (server, stub):
        address = ENDPOINTS[0]["address"]
        server.pool.set_healthy(address, True)
        for i in range(6):
            call = stub.Process()
            await call.write(headers_msg())
            await call.read()
            await call.write(body_msg(BODY))
            await call.read()
            await call.write(_answered(504, "upstream_response_timeout") if i % 2 else
                             _answered(503, "no_healthy_upstream"))
            await call.read()
            await call.done_writing()
        assert server.pool.is_healthy(address)
