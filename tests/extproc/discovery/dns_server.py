"""A small authoritative DNS server for tests, on loopback, speaking the real wire format (built with dnspython).

It serves UDP and TCP on one port of ``host`` (a free one by default), in the running event loop. The zone is a
mapping the test edits while the server runs: ``set(name, 'A', [...])`` gives a name its records of one type
(``[]``: the name exists without such records, a NODATA answer), ``delete(name)`` makes it unknown (NXDOMAIN);
every record goes on the wire as its own RR, so repeated values are repeated in the answer. ``answering = False``
makes it drop every query (a dead server: the client times out); ``rcode = dns.rcode.SERVFAIL`` (or another
rcode) answers every query with that rcode and no records (a server that cannot resolve, e.g. CoreDNS cut off
from the Kubernetes API). UDP answers are cut at 512 bytes (or the
query's EDNS payload) with the TC flag set, as a real server does, so a large answer makes the client retry over
TCP. ``queries`` logs every query received.

Usage::

    async with DnsTestServer() as server:
        server.set("vllm.default.svc.cluster.local", "A", ["10.0.0.1"])
        ... DiscoveryConfig(dns_nameservers=[server.address], ...)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import struct
import time
from collections.abc import Iterable
from typing import Self

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

UDP_MAX_SIZE = 512
"""Largest UDP answer to a query without EDNS (RFC 1035 4.2.1); larger ones are truncated with TC set."""


@dataclasses.dataclass(frozen=True, slots=True)
class Query:
    """One query received: ``name`` absolute (``vllm.default.svc.cluster.local.``), ``rdtype`` as text (``A``),
    ``transport`` ``udp`` or ``tcp``, ``answered`` False when the server was not answering, ``at`` monotonic s."""

    name: str
    rdtype: str
    transport: str
    answered: bool
    at: float


class DnsTestServer:
    """Authoritative DNS server on ``host:port`` (UDP and TCP); ``port=0`` picks a free port."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, ttl: int = 5) -> None:
        self.host = host
        self.port = port
        self.ttl = ttl
        self.answering = True
        self.rcode: dns.rcode.Rcode | None = None
        self.queries: list[Query] = []
        self._zone: dict[dns.name.Name, dict[dns.rdatatype.RdataType, list[str]]] = {}
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        """``ip:port`` (IPv6 bracketed), as ``dns_nameservers`` takes it."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    # The zone ------------------------------------------------------------------------------------------------

    def set(self, name: str, rdtype: str, values: Iterable[str]) -> None:
        """Gives ``name`` (absolute; a trailing dot is optional) exactly these ``rdtype`` records (text form)."""
        self._zone.setdefault(dns.name.from_text(name), {})[dns.rdatatype.from_text(rdtype)] = list(values)

    def delete(self, name: str) -> None:
        """Removes ``name`` and all its records: queries for it get NXDOMAIN."""
        self._zone.pop(dns.name.from_text(name), None)

    def queried(self, rdtype: str | None = None) -> list[Query]:
        """The queries received, of one type if given."""
        return [query for query in self.queries if rdtype is None or query.rdtype == rdtype]

    # Serving --------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Binds UDP and TCP on the same port (retrying with another free port if TCP's is taken)."""
        loop = asyncio.get_running_loop()
        for _attempt in range(20):
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _UdpProtocol(self), local_addr=(self.host, self.port))
            port = transport.get_extra_info("sockname")[1]
            try:
                self._tcp = await asyncio.start_server(self._serve_tcp, self.host, port)
            except OSError:
                transport.close()
                if self.port:
                    raise
                continue
            self._udp, self.port = transport, port
            return
        raise OSError(f"no port free for both UDP and TCP on {self.host}")

    async def close(self) -> None:
        """Stops serving and closes every socket and connection."""
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
        for writer in list(self._connections):
            writer.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._tcp is not None:
            await self._tcp.wait_closed()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def reply(self, wire: bytes, transport: str) -> bytes | None:
        """The answer to the query ``wire`` in wire format (TCP: length-prefixed), or None to send nothing."""
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return None
        if len(query.question) != 1:
            return None
        question = query.question[0]
        self.queries.append(Query(question.name.to_text(), dns.rdatatype.to_text(question.rdtype), transport,
                                  self.answering, time.monotonic()))
        if not self.answering:
            return None
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        records = self._zone.get(question.name)
        if self.rcode is not None:
            response.set_rcode(self.rcode)
        elif records is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdclass == dns.rdataclass.IN:
            for value in records.get(question.rdtype, ()):
                response.answer.append(dns.rrset.from_text(question.name, self.ttl, "IN", question.rdtype, value))
        if transport == "tcp":
            return response.to_wire(prepend_length=True)
        return response.to_wire(max_size=query.payload if query.edns >= 0 else UDP_MAX_SIZE,
                                prefer_truncation=True)

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._connections.add(writer)
        try:
            while True:
                (length,) = struct.unpack("!H", await reader.readexactly(2))
                answer = self.reply(await reader.readexactly(length), "tcp")
                if answer is not None:
                    writer.write(answer)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._connections.discard(writer)
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, server: DnsTestServer) -> None:
        self._server = server
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # (3.11's UDP transport is no DatagramTransport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        answer = self._server.reply(data, "udp")
        if answer is not None and self._transport is not None:
            self._transport.sendto(answer, addr)
