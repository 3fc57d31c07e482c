"""extproc.discovery.dns against a real resolver path: dnspython's stub resolver querying a DNS server on loopback.

The server (``dns_server.DnsTestServer``) is authoritative for a zone the tests edit while the source runs, as
kube-dns/CoreDNS answers for a headless Service: one A/AAAA record per Ready pod, NXDOMAIN with none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable

import dns.asyncquery
import dns.message
import dns.rcode
import pytest

from extproc.config import ConfigError, DiscoveryConfig, EndpointConfig
from extproc.discovery.dns import DnsSource, to_endpoints
from tests.extproc.discovery.dns_server import DnsTestServer

NAME = "vllm.default.svc.cluster.local."
LOGGER = "extproc.discovery.dns"


@pytest.fixture
async def server() -> AsyncIterator[DnsTestServer]:
    async with DnsTestServer() as dns_server:
        yield dns_server


def make_config(nameservers: list[str], **overrides: object) -> DiscoveryConfig:
    values: dict[str, object] = {
        "source": "dns", "dns_name": NAME, "dns_nameservers": nameservers, "dns_interval_s": 0.05,
        "timeout_s": 0.3, "target_ports": [8000, 8001], "predictor_port": 9100, "models": ["llama"]}
    values.update(overrides)
    return DiscoveryConfig(**values)  # type: ignore[arg-type]


def endpoint(ip: str, predictor_port: int | None = 9100) -> EndpointConfig:
    host = f"[{ip}]" if ":" in ip else ip
    return EndpointConfig(address=f"{host}:8000", models=("llama",),
                          predictor=None if predictor_port is None else f"{host}:{predictor_port}")


class Recorder:
    """A ``publish`` that keeps every list it gets."""

    def __init__(self) -> None:
        self.lists: list[tuple[EndpointConfig, ...]] = []

    def __call__(self, endpoints: tuple[EndpointConfig, ...]) -> None:
        self.lists.append(endpoints)

    async def wait_for(self, count: int, timeout_s: float = 3.0) -> tuple[EndpointConfig, ...]:
        """The ``count``-th list published (1-based), waiting for it."""
        await wait_until(lambda: len(self.lists) >= count, timeout_s, f"{count} publishes, got {self.lists}")
        return self.lists[count - 1]


async def wait_until(condition: Callable[[], bool], timeout_s: float = 3.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(source: DnsSource, publish: Callable[[tuple[EndpointConfig, ...]], None]) -> AsyncIterator[None]:
    """Runs ``source.run(publish)`` for the block; checks it never ended by itself and ends on cancel."""
    task = asyncio.create_task(source.run(publish))
    try:
        yield
        await asyncio.sleep(0)
        assert not task.done(), f"run ended by itself: {task.exception()!r}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 2.0)
    assert task.cancelled()


def messages(caplog: pytest.LogCaptureFixture, level: str) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == LOGGER and record.levelname == level]


async def test_first_sync_publishes_every_a_record_with_its_port_predictor_and_models(server, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    server.set(NAME, "A", ["10.0.0.2", "10.0.0.1", "10.0.0.10"])
    publish = Recorder()
    async with running(DnsSource(make_config([server.address])), publish):
        first = await publish.wait_for(1)
        # More lookups with the same answer publish nothing more.
        queries = len(server.queried("A"))
        await wait_until(lambda: len(server.queried("A")) >= queries + 3, what="3 more lookups")
        assert len(publish.lists) == 1
    # Sorted by the address string, as the pool gets every list.
    assert first == (endpoint("10.0.0.10"), endpoint("10.0.0.1"), endpoint("10.0.0.2"))
    assert messages(caplog, "INFO") == [
        (f"dns discovery of {NAME}: first sync, endpoints now 3: added 10.0.0.10:8000, 10.0.0.1:8000, "
         "10.0.0.2:8000; removed none")]
    assert messages(caplog, "WARNING") == []
    assert {query.transport for query in server.queries} == {"udp"}


async def test_added_and_removed_records_update_the_list(server, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    server.set(NAME, "A", ["10.0.0.1", "10.0.0.2"])
    publish = Recorder()
    async with running(DnsSource(make_config([server.address])), publish):
        assert await publish.wait_for(1) == (endpoint("10.0.0.1"), endpoint("10.0.0.2"))
        server.set(NAME, "A", ["10.0.0.2", "10.0.0.3"])
        assert await publish.wait_for(2) == (endpoint("10.0.0.2"), endpoint("10.0.0.3"))
        server.set(NAME, "A", ["10.0.0.3"])
        assert await publish.wait_for(3) == (endpoint("10.0.0.3"),)
    assert messages(caplog, "INFO")[1:] == [
        f"dns discovery of {NAME}: endpoints now 2: added 10.0.0.3:8000; removed 10.0.0.1:8000",
        f"dns discovery of {NAME}: endpoints now 1: added none; removed 10.0.0.2:8000"]


async def test_aaaa_records_give_bracketed_ipv6_endpoints_and_one_family_may_be_empty(server):
    server.set(NAME, "A", ["10.0.0.1"])
    server.set(NAME, "AAAA", ["fd00:0:0::5"])
    publish = Recorder()
    async with running(DnsSource(make_config([server.address])), publish):
        assert await publish.wait_for(1) == (endpoint("10.0.0.1"), endpoint("fd00::5"))
        server.set(NAME, "A", [])  # the name stays, with AAAA only: NoAnswer for A
        assert await publish.wait_for(2) == (endpoint("fd00::5"),)
    assert publish.lists[1][0].address == "[fd00::5]:8000"
    assert publish.lists[1][0].predictor == "[fd00::5]:9100"


async def test_nxdomain_publishes_an_empty_list_and_warns(server, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    publish = Recorder()
    async with running(DnsSource(make_config([server.address])), publish):
        assert await publish.wait_for(1) == ()  # the first sync, with no Ready pod
        server.set(NAME, "A", ["10.0.0.1"])
        assert await publish.wait_for(2) == (endpoint("10.0.0.1"),)
        server.delete(NAME)  # the last pod went unready: NXDOMAIN
        assert await publish.wait_for(3) == ()
        server.set(NAME, "A", [])  # the name without A or AAAA (NoAnswer for both): still empty, no publish
        queries = len(server.queried("A"))
        await wait_until(lambda: len(server.queried("A")) >= queries + 3, what="3 more lookups")
    assert len(publish.lists) == 3
    assert messages(caplog, "WARNING") == [
        f"dns discovery of {NAME}: no records: every request gets 503 until pods are ready"] * 2
    assert {query.name for query in server.queries} == {NAME}


async def test_a_dead_server_keeps_the_last_list_warns_once_backs_off_and_recovers(server, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    server.set(NAME, "A", ["10.0.0.1", "10.0.0.2"])
    publish = Recorder()
    async with running(DnsSource(make_config([server.address], timeout_s=0.2)), publish):
        await publish.wait_for(1)
        server.answering = False
        server.set(NAME, "A", ["10.0.0.3"])  # would be published, were it answered
        dead_at = time.monotonic()
        await wait_until(lambda: len([q for q in server.queried("A") if not q.answered]) >= 2,
                         what="2 unanswered lookups")
        await asyncio.sleep(0.3)
        assert len(publish.lists) == 1
        # Retries follow the backoff (0.5 s, then 1 s after a 0.2 s timeout), not the 0.05 s interval.
        unanswered = [q.at - dead_at for q in server.queried("A") if not q.answered]
        assert len(unanswered) == 2
        assert unanswered[1] - unanswered[0] >= 0.6
        server.answering = True
        assert await publish.wait_for(2) == (endpoint("10.0.0.3"),)
    warnings = messages(caplog, "WARNING")
    assert len(warnings) == 1
    assert warnings[0].startswith(f"dns discovery of {NAME}: lookup failed (LifetimeTimeout: ")
    assert warnings[0].endswith("keeping the last 2 endpoints, retrying with backoff")
    assert f"dns discovery of {NAME}: lookups work again" in messages(caplog, "INFO")


async def test_a_dead_server_before_the_first_sync_publishes_nothing_until_it_answers(server):
    server.set(NAME, "A", ["10.0.0.1"])
    server.answering = False
    publish = Recorder()
    async with running(DnsSource(make_config([server.address], timeout_s=0.1)), publish):
        await wait_until(lambda: len(server.queried("A")) >= 1, what="a lookup")
        await asyncio.sleep(0.2)
        assert publish.lists == []
        server.answering = True
        assert await publish.wait_for(1) == (endpoint("10.0.0.1"),)


async def test_servfail_is_a_failure_not_an_empty_list(server, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    server.set(NAME, "A", ["10.0.0.1"])
    server.rcode = dns.rcode.SERVFAIL
    publish = Recorder()
    async with running(DnsSource(make_config([server.address])), publish):
        await wait_until(lambda: bool(messages(caplog, "WARNING")), what="a warning")
        await asyncio.sleep(0.1)
        assert publish.lists == []
        server.rcode = None
        assert await publish.wait_for(1) == (endpoint("10.0.0.1"),)
    warnings = messages(caplog, "WARNING")
    assert len(warnings) == 1
    assert warnings[0].startswith(f"dns discovery of {NAME}: lookup failed (NoNameservers: ")
    assert "SERVFAIL" in warnings[0]
    assert warnings[0].endswith("no endpoints yet, retrying with backoff")


async def test_no_predictor_port_gives_no_predictor(server):
    server.set(NAME, "A", ["10.0.0.1"])
    server.set(NAME, "AAAA", ["fd00::1"])
    publish = Recorder()
    async with running(DnsSource(make_config([server.address], predictor_port=None, models=[])), publish):
        endpoints = await publish.wait_for(1)
    assert endpoints == (EndpointConfig("10.0.0.1:8000"), EndpointConfig("[fd00::1]:8000"))
    assert [e.predictor for e in endpoints] == [None, None]


async def test_repeated_records_give_one_endpoint_each(server):
    server.set(NAME, "A", ["10.0.0.1", "10.0.0.1", "10.0.0.2"])
    server.set(NAME, "AAAA", ["fd00::1", "fd00::1"])
    # The repeats really are on the wire: one RR each.
    raw = await dns.asyncquery.udp(dns.message.make_query(NAME, "A"), "127.0.0.1", timeout=1.0, port=server.port,
                                   one_rr_per_rrset=True)
    assert sorted(rrset[0].address for rrset in raw.answer) == ["10.0.0.1", "10.0.0.1", "10.0.0.2"]
    publish = Recorder()
    async with running(DnsSource(make_config([server.address])), publish):
        assert await publish.wait_for(1) == (endpoint("10.0.0.1"), endpoint("10.0.0.2"), endpoint("fd00::1"))


def test_to_endpoints_merges_forms_of_one_address_and_sorts():
    config = make_config([], models=["a", "b"])
    endpoints = to_endpoints(["10.0.0.2", "fd00:0::1", "10.0.0.2", "FD00::1", "10.0.0.1"], config)
    assert [(e.address, e.predictor, e.models) for e in endpoints] == [
        ("10.0.0.1:8000", "10.0.0.1:9100", ("a", "b")),
        ("10.0.0.2:8000", "10.0.0.2:9100", ("a", "b")),
        ("[fd00::1]:8000", "[fd00::1]:9100", ("a", "b"))]
    with pytest.raises(ValueError, match="not-an-ip"):
        to_endpoints(["not-an-ip"], config)


async def test_a_large_service_is_read_over_tcp_after_a_truncated_udp_answer(server):
    ips = [f"10.0.{i // 250}.{i % 250 + 1}" for i in range(60)]  # 60 A RRs: more than 512 bytes
    server.set(NAME, "A", ips)
    publish = Recorder()
    async with running(DnsSource(make_config([server.address])), publish):
        endpoints = await publish.wait_for(1)
    assert {e.address for e in endpoints} == {f"{ip}:8000" for ip in ips}
    assert {q.transport for q in server.queried("A")} == {"udp", "tcp"}


async def test_an_ipv6_nameserver_with_a_port():
    try:
        dns_server = DnsTestServer("::1")
        await dns_server.start()
    except OSError as exc:
        # Hosts without IPv6 on loopback (some CI containers) cannot serve on ::1; the form '[::1]:port' is still
        # parsed by tests/extproc/test_config.py::test_nameservers_are_parsed_in_every_documented_form.
        pytest.skip(f"no IPv6 loopback here, so no [::1] nameserver to query: {exc}")
    try:
        dns_server.set(NAME, "A", ["10.0.0.1"])
        publish = Recorder()
        assert dns_server.address.startswith("[::1]:")
        async with running(DnsSource(make_config([dns_server.address])), publish):
            assert await publish.wait_for(1) == (endpoint("10.0.0.1"),)
    finally:
        await dns_server.close()


async def test_search_domains_and_ndots_come_from_resolv_conf(server, tmp_path):
    # resolv.conf cannot give a port, so dns_nameservers points at the test server; the search list and ndots
    # come from the file, as in a pod (kubelet writes both).
    resolv_conf = tmp_path / "resolv.conf"
    resolv_conf.write_text("nameserver 127.0.0.1\nsearch default.svc.cluster.local svc.cluster.local cluster.local\n"
                           "options ndots:5\n")
    server.set("vllm.default.svc.cluster.local", "A", ["10.0.0.1"])
    server.set("vllm.other.svc.cluster.local", "A", ["10.0.0.2"])
    publish = Recorder()
    async with running(DnsSource(make_config([server.address], dns_name="vllm"), resolv_conf=str(resolv_conf)),
                       publish):
        assert await publish.wait_for(1) == (endpoint("10.0.0.1"),)
    assert server.queried("A")[0].name == "vllm.default.svc.cluster.local."

    server.queries.clear()
    publish = Recorder()
    async with running(DnsSource(make_config([server.address], dns_name="vllm.other"),
                                 resolv_conf=str(resolv_conf)), publish):
        assert await publish.wait_for(1) == (endpoint("10.0.0.2"),)
    # 2 labels < ndots 5: the search list first, in order, stopping at the first name that exists.
    assert [q.name for q in server.queried("A")][:2] == ["vllm.other.default.svc.cluster.local.",
                                                          "vllm.other.svc.cluster.local."]

    # Without a resolv.conf, explicit nameservers get the name as given: "vllm." does not exist.
    server.queries.clear()
    publish = Recorder()
    async with running(DnsSource(make_config([server.address], dns_name="vllm")), publish):
        assert await publish.wait_for(1) == ()
    assert {q.name for q in server.queries} == {"vllm."}


async def test_resolv_conf_nameservers_are_used_on_port_53(tmp_path):
    # The path with no dns_nameservers at all, as in a pod: needs port 53 (root) on a loopback address.
    host = f"127.{random.randint(1, 254)}.{random.randint(1, 254)}.{random.randint(1, 254)}"
    dns_server = DnsTestServer(host, 53)
    try:
        await dns_server.start()
    except OSError as exc:
        # Port 53 needs root (or CAP_NET_BIND_SERVICE); this machine and its CI run as root, so it runs there.
        pytest.skip(f"cannot serve on {host}:53 without root, so resolv.conf's port-53 nameservers are untested: "
                    f"{exc}")
    try:
        resolv_conf = tmp_path / "resolv.conf"
        resolv_conf.write_text(f"search default.svc.cluster.local\noptions ndots:5\nnameserver {host}\n")
        dns_server.set(NAME, "A", ["10.0.0.9"])
        publish = Recorder()
        async with running(DnsSource(make_config([], dns_name="vllm"), resolv_conf=str(resolv_conf)), publish):
            assert await publish.wait_for(1) == (endpoint("10.0.0.9"),)
        assert dns_server.queried("A")[0].name == NAME
    finally:
        await dns_server.close()


async def test_an_error_in_publish_is_logged_and_retried(server, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    server.set(NAME, "A", ["10.0.0.1"])
    calls: list[tuple[EndpointConfig, ...]] = []

    def publish(endpoints: tuple[EndpointConfig, ...]) -> None:
        calls.append(endpoints)
        if len(calls) == 1:
            raise RuntimeError("pool is busy")

    async with running(DnsSource(make_config([server.address])), publish):
        await wait_until(lambda: len(calls) >= 2, what="a second publish")
    assert calls == [(endpoint("10.0.0.1"),)] * 2
    assert messages(caplog, "WARNING")[0].startswith(
        f"dns discovery of {NAME}: lookup failed (RuntimeError: pool is busy)")


def test_configuration_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"^discovery\.dns_name: required"):
        DnsSource(DiscoveryConfig())
    with pytest.raises(ConfigError, match=r"^discovery\.dns_nameservers: cannot read the resolver configuration"):
        DnsSource(make_config([]), resolv_conf=str(tmp_path / "missing"))
    empty = tmp_path / "resolv.conf"
    empty.write_text("search default.svc.cluster.local\n")
    with pytest.raises(ConfigError, match="lists no nameserver"):
        DnsSource(make_config([]), resolv_conf=str(empty))
    DnsSource(make_config(["127.0.0.1:5353"]), resolv_conf=str(empty))  # the nameservers come from the config
    with pytest.raises(ConfigError, match=r"^discovery\.dns_name: 'a\.\.b' is not a DNS name"):
        DnsSource(make_config(["127.0.0.1"], dns_name="a..b"))


def test_to_endpoints_skips_addresses_no_pod_has(caplog):
    """0.0.0.0, ::, multicast, broadcast and link-local records are no pod (a break-it pass: 0.0.0.0 even passed
    its health check, on the picker's own host); an IPv4-mapped IPv6 record is its IPv4 address."""
    config = make_config([])
    special = ["0.0.0.0", "::", "224.0.0.1", "255.255.255.255", "169.254.169.254", "ff02::1", "fe80::1"]
    endpoints = to_endpoints([*special, "::ffff:10.0.0.7", "10.0.0.7"], config)
    assert [e.address for e in endpoints] == ["10.0.0.7:8000"]
    assert sum("no pod address" in r.getMessage() for r in caplog.records) == len(special)
