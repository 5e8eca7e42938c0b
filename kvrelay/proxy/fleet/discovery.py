"""DNS discovery: a name per role, resolved every `dns_interval_s`, feeds the fleet sync.

`prefill_dns` / `decode_dns` take either
- `name:port` — A and AAAA records of `name` (a Kubernetes headless Service lists one record
  per ready pod), each address becomes `http://address:port`; or
- `_service._proto.name` (starts with `_`) — SRV records give each engine's host and port
  (the hosts' A/AAAA records are resolved too when the answer did not carry them).

Each resolved set goes to the fleet sync as a `sync` change of source `dns`: engines that
appear join the pool, engines that are gone leave it (in-flight requests on them finish; the
conversations a departed D still holds are released by the next turn, which finds their
holder gone, or freed by the holder's lease). A name that does not exist or has no records
is an empty set; a resolver error (timeout, SERVFAIL) keeps the current set, so a DNS hiccup
does not empty a pool. With `discovery_side_channel_port` each discovered engine's side
channel is its address on that port.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.rdatatype
import dns.resolver

from kvrelay.proxy.base import cancel_and_wait
from kvrelay.proxy.config import Settings, parse_dns_spec
from kvrelay.proxy.fleet.fleet_sync import FleetSync

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Discovered:
    """One engine a discovery source sees: base URL and, when known, its side channel."""

    url: str
    side_channel: str | None = None


def engine_url(address: str, port: int) -> str:
    try:
        if ipaddress.ip_address(address).version == 6:
            return f"http://[{address}]:{port}"
    except ValueError:
        pass  # a host name
    return f"http://{address.rstrip('.')}:{port}"


def side_channel_of(address: str, port: int | None) -> str | None:
    return None if port is None else f"{address.rstrip('.')}:{port}"


class ResolveError(Exception):
    """The resolver could not answer (as opposed to: the name has no records)."""


class DnsSource:
    """Resolves one role's spec into the engines it names."""

    def __init__(
        self, spec: str, resolver: dns.asyncresolver.Resolver, side_channel_port: int | None
    ) -> None:
        self.name, self.port = parse_dns_spec(spec)
        self._resolver = resolver
        self._side_port = side_channel_port

    async def resolve(self) -> list[Discovered]:
        if self.port is None:
            return await self._resolve_srv()
        return [
            Discovered(engine_url(addr, self.port), side_channel_of(addr, self._side_port))
            for addr in await self._addresses(self.name)
        ]

    async def _query(self, name: str, rdtype: str) -> list[str]:
        try:
            answer = await self._resolver.resolve(name, rdtype, search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except dns.exception.DNSException as exc:
            raise ResolveError(f"{rdtype} {name}: {type(exc).__name__}") from exc
        return [rdata.to_text() for rdata in answer]

    async def _addresses(self, name: str) -> list[str]:
        v4, v6 = await asyncio.gather(self._query(name, "A"), self._query(name, "AAAA"))
        return sorted(set(v4 + v6))

    async def _resolve_srv(self) -> list[Discovered]:
        out: set[Discovered] = set()
        for record in await self._query(self.name, "SRV"):
            _priority, _weight, port, target = record.split()
            for addr in await self._addresses(target):
                out.add(
                    Discovered(engine_url(addr, int(port)), side_channel_of(addr, self._side_port))
                )
        return sorted(out, key=lambda d: d.url)


def make_resolver(server: str | None, timeout: float) -> dns.asyncresolver.Resolver:
    """The system resolver, or one that asks only `host:port`."""
    if server is None:
        resolver = dns.asyncresolver.Resolver()
    else:
        host, _, port = server.rpartition(":")
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [host.strip("[]")]
        resolver.port = int(port)
    resolver.lifetime = timeout
    resolver.timeout = timeout
    return resolver


class DiscoveryLoop:
    """Runs discovery sources on an interval and sends each changed set to the fleet sync."""

    def __init__(
        self, sources: dict[str, DnsSource], sync: FleetSync, interval: float, origin: str
    ) -> None:
        self._sources = sources
        self._sync = sync
        self._interval = interval
        self._origin = origin
        self._last: dict[str, list[Discovered]] = {}
        self._task: asyncio.Task[None] | None = None

    async def run_once(self) -> None:
        for role, source in self._sources.items():
            try:
                found = await source.resolve()
            except ResolveError as exc:
                log.warning("%s discovery: %s; keeping the current engines", role, exc)
                continue
            if self._last.get(role) == found:
                continue
            op = {
                "op": "sync",
                "role": role,
                "source": self._origin,
                "urls": [d.url for d in found],
                "side_channels": {d.url: d.side_channel for d in found if d.side_channel},
            }
            try:
                await self._sync.apply(op)
            except Exception as exc:  # the fleet record is unreachable: try again next round
                log.warning("%s discovery: fleet update failed (%s)", role, type(exc).__name__)
                continue
            self._last[role] = found
            log.info("%s discovery (%s): %d engines", role, self._origin, len(found))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvrelay-dns")

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.run_once()
            except Exception:  # a discovery bug must not end discovery
                log.exception("discovery round failed")
            await asyncio.sleep(self._interval)


async def start_discovery(settings: Settings, sync: FleetSync) -> DiscoveryLoop | None:
    """Start DNS discovery for the roles that configure it (after one first round, so the
    pools hold the discovered engines before the proxy reports ready)."""
    specs = {"prefill": settings.prefill_dns, "decode": settings.decode_dns}
    if not any(specs.values()):
        return None
    resolver = make_resolver(settings.dns_server, timeout=min(2.0, settings.dns_interval_s))
    sources = {
        role: DnsSource(spec, resolver, settings.discovery_side_channel_port)
        for role, spec in specs.items()
        if spec
    }
    loop = DiscoveryLoop(sources, sync, settings.dns_interval_s, origin="dns")
    await loop.run_once()
    loop.start()
    return loop
