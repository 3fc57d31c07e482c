"""DNS discovery: the A/AAAA records of a headless Kubernetes Service, re-resolved every ``dns_interval_s``.

Semantics (Kubernetes DNS-Based Service Discovery, section 2.4.1, "Records for a Headless Service":
https://github.com/kubernetes/dns/blob/master/docs/specification.md): the name ``<service>.<ns>.svc.<zone>`` of a
headless Service (no ClusterIP) has one ``A`` record per *ready* endpoint IPv4 address (``AAAA`` for IPv6), and
the answer is ``NXDOMAIN`` when the Service has no ready endpoint. So each record address is one Ready pod, and
each becomes the endpoint ``ip:target_ports[0]`` with its predictor sidecar at ``ip:predictor_port``.

Lookups go through dnspython's asyncio stub resolver (no DNS client of our own; UDP, with the TCP retry on a
truncated answer), A and AAAA concurrently, each with a deadline of ``timeout_s``. With no ``dns_nameservers``
the resolver is configured as a pod's libc resolver is, from ``/etc/resolv.conf``: its nameservers (port 53), its
search domains and ``ndots`` (a relative name such as ``vllm`` or ``vllm.default`` is tried with each search
domain, in the order glibc uses), ``options timeout/rotate``. With ``dns_nameservers`` set, queries go to those
and the name is looked up as given (relative = below the root), unless ``resolv_conf`` is passed, whose search
domains and options then still apply.

Outcomes of one lookup:

- records (of either family): the endpoints, de-duplicated and sorted by address, published when they differ
  from the last published list (the first success always publishes: the first sync);
- NXDOMAIN or no record (NoAnswer) for both families: the empty list (published like any other; logged as a
  WARNING when the list becomes empty, since every request then gets 503); NoAnswer for one family only leaves
  that family out;
- a timeout, no usable nameserver (SERVFAIL, REFUSED, malformed answers, connection errors) or any other error
  in either family: the last published list stays (none before the first sync, so the extproc stays not ready),
  one WARNING per failure streak, and the next try comes after `extproc.discovery.Backoff` (0.5 s doubling to
  30 s), not after ``dns_interval_s``.
"""

from __future__ import annotations

import asyncio
import io
import ipaddress
import logging
from collections.abc import Iterable
from pathlib import Path

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver

from extproc.config import ConfigError, DiscoveryConfig, EndpointConfig, parse_nameserver
from extproc.discovery import Backoff, Publish, endpoint_address

logger = logging.getLogger(__name__)

DEFAULT_RESOLV_CONF = "/etc/resolv.conf"
"""The resolver configuration read when ``dns_nameservers`` is empty and no ``resolv_conf`` is given."""


_RDTYPES = (dns.rdatatype.A, dns.rdatatype.AAAA)
_MAX_LOGGED = 10  # addresses named per log line; the rest are counted


def to_endpoints(ips: Iterable[str], config: DiscoveryConfig) -> tuple[EndpointConfig, ...]:
    """The endpoints of the record addresses ``ips``: one per distinct IP, sorted by address.

    Args:
        ips: IPv4 and IPv6 addresses as text, in any valid form (normalised, so ``fd00::1`` and ``fd00:0::1`` are
            one address), repeats allowed.
        config: gives ``target_ports[0]`` (the model server's port), ``predictor_port`` (a number or None) and
            ``models``.

    Returns:
        ``EndpointConfig(address='ip:port', models=config.models, predictor='ip:predictor_port' or None)`` per
        distinct IP (IPv6 bracketed, ``[fd00::1]:8000``; an IPv4-mapped IPv6 address as its IPv4), sorted by the
        address string; unspecified (0.0.0.0, ::), multicast, broadcast and link-local addresses are skipped
        (logged), since no pod has one.

    Raises:
        ValueError: an entry is not an IP address.
        TypeError: ``predictor_port`` is a (container port) name.
    """
    port = config.target_ports[0]
    predictor_port = config.predictor_port
    if isinstance(predictor_port, str):
        raise TypeError(f"dns discovery needs a numeric predictor_port, got {predictor_port!r}")
    endpoints: dict[str, EndpointConfig] = {}
    for text in ips:
        parsed = ipaddress.ip_address(text)
        if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
            parsed = parsed.ipv4_mapped  # ::ffff:10.0.0.5 is 10.0.0.5
        if parsed.is_unspecified or parsed.is_multicast or parsed.is_link_local or \
                parsed == ipaddress.IPv4Address("255.255.255.255"):
            logger.warning("dns record %s is no pod address (unspecified, multicast, broadcast or link-local): "
                           "skipped", text)
            continue
        ip = str(parsed)
        address = endpoint_address(ip, port)
        endpoints[address] = EndpointConfig(
            address=address, models=config.models,
            predictor=None if predictor_port is None else endpoint_address(ip, predictor_port))
    return tuple(endpoints[address] for address in sorted(endpoints))


class DnsSource:
    """Discovers endpoints from the A/AAAA records of ``config.dns_name`` (an `EndpointSource`).

    Args:
        config: the discovery section; reads ``dns_name``, ``dns_nameservers`` (``'ip'`` or ``'ip:port'``, IPv6 as
            ``'::1'`` or ``'[::1]:53'``; port 53 by default), ``dns_interval_s`` (seconds between two successful
            lookups), ``timeout_s`` (deadline of one lookup, both families, seconds), ``target_ports`` (the first),
            ``predictor_port`` (a number or None) and ``models``.
        resolv_conf: a file in resolv.conf format giving the search domains, ``ndots``, ``options timeout`` /
            ``rotate`` and, when ``dns_nameservers`` is empty, the nameservers (port 53). None: `DEFAULT_RESOLV_CONF`
            when ``dns_nameservers`` is empty, no file otherwise (the name is then looked up as given).

    Raises:
        ConfigError: ``dns_name`` is missing or not a valid DNS name; ``predictor_port`` is a name; a
            ``dns_nameservers`` entry is not ``ip`` / ``ip:port``; the resolv.conf file cannot be read, or lists
            no nameserver while ``dns_nameservers`` is empty.
    """

    def __init__(self, config: DiscoveryConfig, *, resolv_conf: str | None = None) -> None:
        if config.dns_name is None:
            raise ConfigError("discovery.dns_name: required when discovery.source is dns")
        if isinstance(config.predictor_port, str):
            raise ConfigError("discovery.predictor_port: dns discovery cannot read a named container port; give a "
                              "number")
        try:
            self._name = dns.name.from_text(config.dns_name, origin=None)
        except dns.exception.DNSException as exc:
            raise ConfigError(f"discovery.dns_name: {config.dns_name!r} is not a DNS name ({exc})") from None
        self._config = config
        self._resolver = _make_resolver(config, resolv_conf)
        self._resolver.timeout = min(self._resolver.timeout, config.timeout_s)

    @property
    def name(self) -> str:
        """The name looked up, as configured."""
        return self._config.dns_name or ""

    async def lookup(self) -> tuple[EndpointConfig, ...]:
        """One lookup of A and AAAA (concurrently, within ``timeout_s``): the endpoints, sorted by address.

        Returns:
            The endpoints (see `to_endpoints`); empty for NXDOMAIN or no record of either family.

        Raises:
            dns.exception.DNSException: a timeout (``dns.resolver.LifetimeTimeout``), no usable nameserver
                (``dns.resolver.NoNameservers``) or another resolver error, in either family.
            OSError: a network error the resolver did not absorb.
        """
        results = await asyncio.gather(
            *(self._resolver.resolve(self._name, rdtype, search=True, lifetime=self._config.timeout_s)
              for rdtype in _RDTYPES),
            return_exceptions=True)
        ips: list[str] = []
        for rdtype, result in zip(_RDTYPES, results, strict=True):
            if isinstance(result, (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer)):
                logger.debug("dns discovery of %s: no %s record (%s)", self.name, rdtype.name, type(result).__name__)
                continue
            if isinstance(result, BaseException):
                raise result
            ips.extend(rdata.address for rdata in result)
        return to_endpoints(ips, self._config)

    async def run(self, publish: Publish) -> None:
        """Looks up every ``dns_interval_s`` until cancelled; ``publish`` gets the whole list at the first successful
        lookup and whenever it changes.

        A failed lookup keeps the last list, logs one WARNING per failure streak and retries after `Backoff`.
        Raises only ``asyncio.CancelledError`` (an error in ``publish`` is logged and counts as a failure).
        """
        backoff = Backoff()
        published: tuple[EndpointConfig, ...] | None = None
        failing = False
        while True:
            try:
                endpoints = await self.lookup()
                if endpoints != published:
                    publish(endpoints)
                    self._log_change(published, endpoints)
                    published = endpoints
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # run must survive any failure: logged (with a traceback if unexpected), retried
                if not failing:
                    expected = isinstance(exc, (dns.exception.DNSException, OSError))
                    logger.warning(
                        "dns discovery of %s: lookup failed (%s: %s); %s, retrying with backoff", self.name,
                        type(exc).__name__, exc,
                        "no endpoints yet" if published is None else f"keeping the last {len(published)} endpoints",
                        exc_info=not expected)
                failing = True
                await asyncio.sleep(backoff.next_s())
                continue
            if failing:
                logger.info("dns discovery of %s: lookups work again", self.name)
                failing = False
            backoff.reset()
            await asyncio.sleep(self._config.dns_interval_s)

    def _log_change(self, old: tuple[EndpointConfig, ...] | None, new: tuple[EndpointConfig, ...]) -> None:
        old_addresses = {endpoint.address for endpoint in old or ()}
        new_addresses = [endpoint.address for endpoint in new]
        added = [address for address in new_addresses if address not in old_addresses]
        removed = sorted(old_addresses.difference(new_addresses))
        logger.info("dns discovery of %s: %sendpoints now %d: added %s; removed %s", self.name,
                    "first sync, " if old is None else "", len(new), _addresses(added), _addresses(removed))
        if not new and old != ():
            logger.warning("dns discovery of %s: no records: every request gets 503 until pods are ready",
                           self.name)


def _addresses(addresses: list[str]) -> str:
    if not addresses:
        return "none"
    shown = ", ".join(addresses[:_MAX_LOGGED])
    return shown if len(addresses) <= _MAX_LOGGED else f"{shown} (+{len(addresses) - _MAX_LOGGED} more)"


def _make_resolver(config: DiscoveryConfig, resolv_conf: str | None) -> dns.asyncresolver.Resolver:
    """The stub resolver: resolv.conf settings (if any file applies), then ``dns_nameservers`` over its servers."""
    resolver = dns.asyncresolver.Resolver(configure=False)
    path = resolv_conf if resolv_conf is not None else None if config.dns_nameservers else DEFAULT_RESOLV_CONF
    if path is None:
        resolver.domain = dns.name.root  # no search list at all, not even the host name's domain
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"discovery.dns_nameservers: cannot read the resolver configuration {path} "
                              f"({exc.strerror or exc})") from None
        try:
            resolver.read_resolv_conf(io.StringIO(text))  # search, ndots, options first; nameservers last
        except dns.resolver.NoResolverConfiguration:
            if not config.dns_nameservers:
                raise ConfigError(f"discovery.dns_nameservers: empty, and {path} lists no nameserver") from None
        except (dns.exception.DNSException, ValueError) as exc:
            raise ConfigError(f"discovery.dns_nameservers: cannot use {path}: {exc}") from None
    if config.dns_nameservers:
        resolver.nameservers = [_nameserver(text, i) for i, text in enumerate(config.dns_nameservers)]
    return resolver


def _nameserver(text: str, index: int) -> dns.nameserver.Do53Nameserver:
    """A ``dns_nameservers`` entry (`extproc.config.parse_nameserver`) as a UDP/TCP nameserver."""
    try:
        return dns.nameserver.Do53Nameserver(*parse_nameserver(text))
    except ValueError as exc:
        raise ConfigError(f"discovery.dns_nameservers[{index}]: {exc}") from None
