"""DNS discovery against a real DNS server on loopback: A/AAAA and SRV answers, NXDOMAIN as
an empty set, resolver failures keeping the current set, and a proxy whose D pool follows the
DNS name under traffic without losing a request or using a departed D's blocks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvrelay.devtools import EngineFactory, ProxyFactory, ProxyServer
from kvrelay.proxy.fleet.discovery import Discovered, DnsSource, ResolveError, make_resolver
from tests.fleet.dns_server import DnsServer
from tests.fleet.workers import Load
from tests.harness import RedisServer, wait_until

ADMIN_KEY = "dns-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture
def dns_server() -> Iterator[DnsServer]:
    server = DnsServer().start()
    try:
        yield server
    finally:
        server.stop()


def _source(dns_server: DnsServer, spec: str, side_port: int | None = None) -> DnsSource:
    return DnsSource(spec, make_resolver(dns_server.address, timeout=1.0), side_port)


async def test_a_aaaa_and_srv_answers(dns_server: DnsServer) -> None:
    dns_server.set("p.test", [("A", "10.0.0.2"), ("A", "10.0.0.1"), ("AAAA", "fd00::1")])
    assert await _source(dns_server, "p.test:8000", side_port=5600).resolve() == [
        Discovered("http://10.0.0.1:8000", "10.0.0.1:5600"),
        Discovered("http://10.0.0.2:8000", "10.0.0.2:5600"),
        Discovered("http://[fd00::1]:8000", "fd00::1:5600"),
    ]
    dns_server.set("_kv._tcp.d.test", [("SRV", (0, 0, 9001, "d0.test")),
                                       ("SRV", (0, 0, 9002, "d1.test"))])  # fmt: skip
    dns_server.set("d0.test", [("A", "10.1.0.1")])
    dns_server.set("d1.test", [("A", "10.1.0.2")])
    assert [d.url for d in await _source(dns_server, "_kv._tcp.d.test").resolve()] == [
        "http://10.1.0.1:9001",
        "http://10.1.0.2:9002",
    ]


async def test_missing_name_is_empty_and_failures_raise(dns_server: DnsServer) -> None:
    assert await _source(dns_server, "nothing.test:8000").resolve() == []
    dns_server.set("empty.test", [])
    assert await _source(dns_server, "empty.test:8000").resolve() == []
    dns_server.fail = True
    with pytest.raises(ResolveError):
        await _source(dns_server, "p.test:8000").resolve()


def test_bad_specs_are_refused_at_start() -> None:
    from kvrelay.proxy.config import SettingsError, load_settings

    for spec in ("p.test", "p.test:0", "_kv._tcp.d.test:80"):
        with pytest.raises(SettingsError, match="decode_dns"):
            load_settings({"decode_dns": spec}, env_file=None)


def _decode_urls(proxy: ProxyServer) -> set[str]:
    status, body, _ = proxy.call("GET", "/admin/backends", headers=ADMIN)
    assert status == 200, body
    return {b["url"] for b in body["decode"]}


def _everywhere(proxy: ProxyServer, urls: set[str]) -> bool:
    return all(_decode_urls(proxy) == urls for _ in range(16))  # new connections: both workers


def test_decode_pool_follows_dns_under_traffic(
    dns_server: DnsServer,
    engine_factory: EngineFactory,
    redis: RedisServer,
    proxy_factory: ProxyFactory,
) -> None:
    p0, d0, d1 = engine_factory.many(
        ("P0", ["--role", "prefill"]), ("D0", ["--role", "decode"]), ("D1", ["--role", "decode"])
    )
    srv = "_kv._tcp.d.test"
    dns_server.set("d.local", [("A", "127.0.0.1")])
    dns_server.set(srv, [("SRV", (0, 0, d0.port, "d.local"))])
    side = ",".join(f"{e.url}=127.0.0.1:{e.side_channel_port}" for e in (p0, d0, d1))
    proxy = proxy_factory(
        [p0], [], ready_path="/ready", workers="2", map_url=redis.url, admin_key=ADMIN_KEY,
        decode_dns=srv, dns_server=dns_server.address, dns_interval_s="0.2",
        side_channels=side,
    )  # fmt: skip
    assert _everywhere(proxy, {d0.url})

    # A conversation whose blocks D0 holds when D0 leaves the pool.
    conv = {"X-Conversation-Id": "dns-conv"}
    turn = {"model": "kvrelay-sim", "prompt": "a long enough first turn " * 8, "max_tokens": 4}
    status, _, _ = proxy.call("POST", "/v1/completions", turn, headers=conv)
    assert status == 200
    wait_until(lambda: d0.metric("enginesim_blocks_held_for_remote") > 0, 10,
               what="D0 to hold the conversation")  # fmt: skip

    load = Load(proxy.url, threads=4).start()
    try:
        wait_until(lambda: load.count() >= 10, 60, what="traffic on D0")
        dns_server.set(srv, [("SRV", (0, 0, d0.port, "d.local")),
                             ("SRV", (0, 0, d1.port, "d.local"))])  # fmt: skip
        wait_until(lambda: _everywhere(proxy, {d0.url, d1.url}), 15, interval=0.1,
                   what="D1 to join every worker")  # fmt: skip
        wait_until(lambda: d1.metric("enginesim_requests_total") > 0, 30,
                   what="traffic on D1")  # fmt: skip
        dns_server.set(srv, [("SRV", (0, 0, d1.port, "d.local"))])
        wait_until(lambda: _everywhere(proxy, {d1.url}), 15, interval=0.1,
                   what="D0 to leave every worker")  # fmt: skip
        served = load.count()
        wait_until(lambda: load.count() >= served + 10, 60, what="traffic after D0 left")
        # A resolver outage keeps the pool as it is.
        dns_server.fail = True
        served = load.count()
        wait_until(lambda: load.count() >= served + 10, 60, what="traffic during DNS failure")
        assert _everywhere(proxy, {d1.url})
    finally:
        outcomes = load.stop()
    assert outcomes and all(o == "200" for o in outcomes), sorted(set(outcomes))

    # The next turn finds its holder gone: D0's blocks are released, never used.
    before = proxy.metrics()
    turn["prompt"] = str(turn["prompt"]) + " and a second turn"
    status, _, _ = proxy.call("POST", "/v1/completions", turn, headers=conv)
    assert status == 200
    after = proxy.metrics()
    key = 'kvrelay_reuse_total{result="holder_unavailable"}'
    assert after.get(key, 0) == before.get(key, 0) + 1
    d0.wait_idle(15)
