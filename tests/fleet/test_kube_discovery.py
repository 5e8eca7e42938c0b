"""Kubernetes EndpointSlice discovery against a fake API server on loopback (named fake: no
cluster can run here) that serves list and watch with resourceVersions, bookmarks, 410 Gone
and watches dropped mid-way; then a proxy whose D pool follows the slices under traffic."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes_asyncio import client, config

from kvrelay.devtools import EngineFactory, EngineSim, ProxyFactory, ProxyServer
from kvrelay.proxy.fleet import Pool
from kvrelay.proxy.fleet.discovery import Discovered
from kvrelay.proxy.fleet.discovery_kube import KubeRoleWatch, KubeScope, ready_engines
from kvrelay.proxy.fleet.fleet_sync import LocalFleetSync
from tests.fleet.fake_kube_api import FakeEndpointSlices, fake_endpoint_slices
from tests.fleet.workers import Load
from tests.harness import RedisServer, wait_until
from tests.kvcache_map.helpers import eventually

ADMIN_KEY = "kube-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
D_LABELS = {"app": "vllm-d"}


@pytest.fixture
def kube() -> Iterator[FakeEndpointSlices]:
    with fake_endpoint_slices() as server:
        yield server


def test_ready_engines_ports_and_side_channels() -> None:
    slices = {
        "a": {"metadata": {"name": "a"}, "ports": [{"name": "http", "port": 8000},
                                                   {"name": "side-channel", "port": 5600}],
              "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                            {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                            {"addresses": ["10.0.0.3"], "conditions": {}}]},
        "b": {"metadata": {"name": "b", "annotations": {"kvrelay.io/side-channel-port": "7000"}},
              "ports": [{"name": "web", "port": 9000}],
              "endpoints": [{"addresses": ["10.0.1.1"]}]},
        "no-ports": {"metadata": {"name": "c"}, "ports": [], "endpoints": [
            {"addresses": ["10.0.2.1"]}]},
    }  # fmt: skip
    assert ready_engines(slices, "http", "side-channel") == [
        Discovered("http://10.0.0.1:8000", "10.0.0.1:5600"),
        Discovered("http://10.0.0.3:8000", "10.0.0.3:5600"),  # ready unset = ready
        Discovered("http://10.0.1.1:9000", "10.0.1.1:7000"),
    ]


def _engine_slice(kube: FakeEndpointSlices, name: str, engine_port: int, side: int,
                  ready: bool = True, labels: dict[str, str] = D_LABELS) -> None:  # fmt: skip
    ports = {"http": engine_port, "side-channel": side}
    kube.set_slice(name, labels, ports, [("127.0.0.1", ready)])


async def test_watch_follows_slices_through_drops_bookmarks_and_gone(
    kube: FakeEndpointSlices, tmp_path: Path
) -> None:
    _engine_slice(kube, "d0", 9000, 5600)
    _engine_slice(kube, "other", 9100, 5700, labels={"app": "something-else"})
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(kube.kubeconfig(tmp_path)), client_configuration=configuration
    )
    api_client = client.ApiClient(configuration)
    pool = Pool("decode", 3, 2)
    sync = LocalFleetSync({"prefill": Pool("prefill", 3, 2), "decode": pool})
    scope = KubeScope(client.DiscoveryV1Api(api_client), "llm", sync, "http", "side-channel")
    watch = KubeRoleWatch(scope, "decode", "app=vllm-d")
    task = asyncio.create_task(watch.run())

    def urls() -> set[str]:
        return set(pool.backends)

    try:
        await eventually(lambda: urls() == {"http://127.0.0.1:9000"}, what="the first list")
        assert pool.backends["http://127.0.0.1:9000"].side_channel == ("127.0.0.1", 5600)
        await asyncio.to_thread(_engine_slice, kube, "d1", 9001, 5601)
        await eventually(lambda: urls() == {"http://127.0.0.1:9000", "http://127.0.0.1:9001"},
                         what="d1 joining by watch")  # fmt: skip
        assert kube.lists == 1
        # Not ready: leaves. The watch is dropped mid-way and resumed without a new list.
        await asyncio.to_thread(_engine_slice, kube, "d0", 9000, 5600, False)
        await eventually(lambda: urls() == {"http://127.0.0.1:9001"}, what="d0 leaving")
        watches = kube.watches
        await asyncio.to_thread(kube.drop_watches)
        await eventually(lambda: kube.watches > watches, what="the watch to resume")
        await asyncio.to_thread(_engine_slice, kube, "d0", 9000, 5600, True)
        await eventually(lambda: urls() == {"http://127.0.0.1:9000", "http://127.0.0.1:9001"},
                         what="d0 back after the drop")  # fmt: skip
        assert kube.lists == 1
        # Bookmarks keep the watch's version current while only other slices change (events
        # it does not get): after history is compacted, a dropped watch resumes from the
        # bookmark's version with no 410 and no new list.
        await asyncio.to_thread(_engine_slice, kube, "other", 9200, 5700, True, {"app": "x"})
        await eventually(lambda: watch.version == str(kube.version), what="a bookmark")
        await asyncio.to_thread(kube.compact)
        watches = kube.watches
        await asyncio.to_thread(kube.drop_watches)
        await eventually(lambda: kube.watches > watches, what="the watch to resume")
        assert kube.gone_sent == 0 and kube.lists == 1
        # A deletion the watch missed, history gone: 410 Gone, then a fresh list sees it.
        await asyncio.to_thread(kube.delete_unseen, "d1")
        await eventually(lambda: urls() == {"http://127.0.0.1:9000"}, what="d1 deleted")
        assert kube.gone_sent == 1 and kube.lists == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await api_client.close()


def _decode_urls(proxy: ProxyServer) -> set[str]:
    status, body, _ = proxy.call("GET", "/admin/backends", headers=ADMIN)
    assert status == 200, body
    return {b["url"] for b in body["decode"]}


def _everywhere(proxy: ProxyServer, urls: set[str]) -> bool:
    return all(_decode_urls(proxy) == urls for _ in range(16))  # new connections: both workers


def _wait_everywhere(proxy: ProxyServer, urls: set[str], what: str) -> None:
    """Wait until every worker's D pool is `urls`; on a timeout say what the workers showed
    and what the proxy logged (its discovery and fleet-record lines)."""
    try:
        wait_until(lambda: _everywhere(proxy, urls), 15, interval=0.1, what=what)
    except TimeoutError as exc:
        seen = sorted({tuple(sorted(_decode_urls(proxy))) for _ in range(16)})
        log = proxy.process.output() if proxy.process is not None else ""
        raise AssertionError(f"{exc}: wanted {sorted(urls)}, workers show {seen}\n{log}") from exc


def _d_slice(kube: FakeEndpointSlices, name: str, engine: EngineSim, ready: bool = True) -> None:
    _engine_slice(kube, name, engine.port, engine.side_channel_port, ready)


def test_decode_pool_follows_endpoint_slices_under_traffic(
    kube: FakeEndpointSlices,
    engine_factory: EngineFactory,
    redis: RedisServer,
    proxy_factory: ProxyFactory,
    tmp_path: Path,
) -> None:
    p0, d0, d1 = engine_factory.many(
        ("P0", ["--role", "prefill"]), ("D0", ["--role", "decode"]), ("D1", ["--role", "decode"])
    )
    _d_slice(kube, "d0", d0)
    proxy = proxy_factory(
        [p0], [], ready_path="/ready", workers="2", map_url=redis.url, admin_key=ADMIN_KEY,
        decode_selector="app=vllm-d", kube_namespace="llm",
        kube_config=str(kube.kubeconfig(tmp_path)), log_level="INFO",  # discovery's lines
    )  # fmt: skip
    assert _everywhere(proxy, {d0.url})
    load = Load(proxy.url, threads=4).start()
    try:
        wait_until(lambda: load.count() >= 10, 60, what="traffic on D0")
        _d_slice(kube, "d1", d1)  # added
        _wait_everywhere(proxy, {d0.url, d1.url}, "D1 to join every worker")
        wait_until(lambda: d1.metric("enginesim_requests_total") > 0, 30, what="traffic on D1")
        _d_slice(kube, "d0", d0, ready=False)  # flipped to not ready
        _wait_everywhere(proxy, {d1.url}, "D0 to leave every worker")
        kube.drop_watches()  # the API server goes away mid-watch
        _d_slice(kube, "d0", d0, ready=True)
        _wait_everywhere(proxy, {d0.url, d1.url}, "D0 back after the dropped watch")
        kube.delete_unseen("d1")  # removed while nobody watched: 410, list again
        _wait_everywhere(proxy, {d0.url}, "D1 gone after the relist")
        served = load.count()
        wait_until(lambda: load.count() >= served + 10, 60, what="traffic afterwards")
    finally:
        outcomes = load.stop()
    assert outcomes and all(o == "200" for o in outcomes), sorted(set(outcomes))
