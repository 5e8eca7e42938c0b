"""Per-tenant limits: in flight and per second, per API key.

The limiter itself (in-process, and the Redis scripts on a real Redis with two limiters as two
workers would hold them), then whole proxies: two proxy instances sharing one Redis enforce
one limit together, a rejection is an OpenAI-shaped 429 with Retry-After, the outcome is
counted without naming the key, and a slot comes back on every way out of a request (answer,
engine error, stream cut, client gone).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from kvrelay.devtools import EngineFactory, EngineSim, FaultProxy, ProxyFactory, ProxyServer
from kvrelay.kvcache_map import open_redis_client
from kvrelay.proxy.base import ProxyError
from kvrelay.proxy.config import Settings, SettingsError, load_settings, parse_limit
from kvrelay.proxy.tenants import Limiter
from kvrelay.proxy.tenants.limits import RedisLimiter, TenantLimit, limits_from
from kvrelay.proxy.turn import tenant_of
from tests.harness import RedisServer, wait_until
from tests.proxy.fake_upstream import FakeUpstream

MODEL = "kvrelay-sim"
KEYS = "key-a,key-b"


def _is_429(exc: ProxyError, code: str = "rate_limit_exceeded") -> None:
    assert exc.status == 429 and exc.type == "rate_limit_error" and exc.code == code
    assert int(exc.headers["Retry-After"]) >= 1


# -- settings and the in-process limiter -----------------------------------------------------


def test_limit_specs_parse_and_bad_ones_name_the_setting() -> None:
    assert parse_limit("inflight=4;rps=2.5") == {"max_inflight": 4, "rps": 2.5}
    assert parse_limit("burst=3") == {"burst": 3}
    for bad in ("", "inflight=-1", "rps=x", "speed=3", "inflight=1.5", "rps=inf"):
        with pytest.raises(ValueError):
            parse_limit(bad)
    tenant = tenant_of("key-a")
    with pytest.raises(SettingsError, match="tenant_limits"):
        load_settings({"tenant_limits": f"{tenant}=rps=fast"}, env_file=None)
    with pytest.raises(SettingsError, match="not API keys"):
        load_settings({"tenant_limits": "key-a=rps=1"}, env_file=None)
    settings = load_settings(
        {"tenant_max_inflight": 8, "tenant_rps": 1.5, "tenant_limits": f"{tenant}=inflight=2"},
        env_file=None,
    )
    default, overrides = limits_from(settings)
    assert default == TenantLimit(8, 1.5, 0) and default.capacity == 2
    assert overrides == {tenant: TenantLimit(2, 1.5, 0)}  # unset fields take the default's


def test_memory_limiter_inflight_and_release() -> None:
    async def run() -> None:
        limiter = Limiter(TenantLimit(max_inflight=2), {})
        first, second = await limiter.admit("t1"), await limiter.admit("t1")
        with pytest.raises(ProxyError) as refused:
            await limiter.admit("t1")
        _is_429(refused.value)
        assert "in flight" in refused.value.message
        await limiter.admit("t2")  # another tenant is not affected
        await first.release()
        await first.release()  # idempotent: frees one slot, not two
        third = await limiter.admit("t1")
        with pytest.raises(ProxyError):
            await limiter.admit("t1")
        await second.release()
        await third.release()

    asyncio.run(run())


def test_memory_limiter_token_bucket_refills_at_the_rate() -> None:
    async def run() -> None:
        limiter = Limiter(TenantLimit(rps=20, burst=3), {"tslow": TenantLimit(rps=0.01)})
        for _ in range(3):
            await limiter.admit("t1")
        with pytest.raises(ProxyError) as refused:
            await limiter.admit("t1")
        _is_429(refused.value)
        await limiter.admit("tslow")  # its own bucket (capacity 1)
        with pytest.raises(ProxyError) as slow:
            await limiter.admit("tslow")
        assert slow.value.headers["Retry-After"] == "100"  # 1 token at 0.01/s
        # 20 tokens a second: one is back within a bounded wait.
        deadline = time.monotonic() + 5
        while True:
            try:
                await limiter.admit("t1")
                break
            except ProxyError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)

    asyncio.run(run())


# -- the Redis scripts ------------------------------------------------------------------------


def _redis_limiter(url: str, limit: TenantLimit, lease_s: float = 30.0) -> RedisLimiter:
    client, prefix, _ = open_redis_client(url)
    return RedisLimiter(limit, {}, client, prefix, lease_s=lease_s)


def test_redis_limit_is_shared_and_a_dead_workers_slots_expire(redis: RedisServer) -> None:
    async def run() -> None:
        limit = TenantLimit(max_inflight=2)
        worker_a = _redis_limiter(redis.url, limit, lease_s=1.0)
        worker_b = _redis_limiter(redis.url, limit, lease_s=1.0)
        await worker_b.start()  # b renews its slots; a never does: it "crashed"
        try:
            await worker_a.admit("t1")
            slot_b = await worker_b.admit("t1")
            for worker in (worker_a, worker_b):
                with pytest.raises(ProxyError) as refused:
                    await worker.admit("t1")
                _is_429(refused.value)
            # b's own slot is released on the spot...
            await slot_b.release()
            await _eventually(lambda: worker_b.admit("t1"), within_s=5)
            # ...and a's lapses after its lease (b's, renewed, does not).
            await _eventually(lambda: worker_b.admit("t1"), within_s=5)
            with pytest.raises(ProxyError):
                await worker_b.admit("t1")  # b holds both now, renewed past the lease
            await asyncio.sleep(1.5)  # past one lease: renewal, not luck, keeps them
            with pytest.raises(ProxyError):
                await worker_a.admit("t1")
        finally:
            await worker_b.stop()
            await worker_a.stop()

    asyncio.run(run())


def test_redis_token_bucket_is_shared(redis: RedisServer) -> None:
    async def run() -> None:
        limit = TenantLimit(rps=0.5, burst=3)
        a, b = _redis_limiter(redis.url, limit), _redis_limiter(redis.url, limit)
        try:
            await a.admit("t1")
            await b.admit("t1")
            await a.admit("t1")
            with pytest.raises(ProxyError) as refused:
                await b.admit("t1")
            _is_429(refused.value)
            assert 1 <= int(refused.value.headers["Retry-After"]) <= 2  # 1 token at 0.5/s
            await b.admit("t2")
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(run())


def test_redis_down_admits_unchecked() -> None:
    async def run() -> None:
        limiter = _redis_limiter("redis://127.0.0.1:9/0", TenantLimit(max_inflight=1))
        limiter._timeout = 0.5
        try:
            for _ in range(3):
                await (await limiter.admit("t1")).release()
        finally:
            await limiter.stop()

    asyncio.run(run())


def test_a_redis_stall_leaves_no_slot_behind(redis: RedisServer) -> None:
    """Admissions that time out while Redis stalls still run once it answers; the slots they
    take belong to requests that ended long ago and must not lock the tenant out."""

    async def run() -> None:
        relay = FaultProxy("127.0.0.1", redis.port).start()
        client, prefix, _ = open_redis_client(f"redis://127.0.0.1:{relay.listen_port}/0")
        limiter = RedisLimiter(
            TenantLimit(max_inflight=2), {}, client, prefix, lease_s=30.0, timeout=0.3
        )
        try:
            await (await limiter.admit("t1")).release()  # connected, scripts loaded
            relay.set_delay(1.0)  # replies come long after the limiter's bound
            for _ in range(3):  # more than the limit: each is admitted unchecked and ends
                await (await limiter.admit("t1")).release()
            relay.heal()
            # Everything the stall held back has reached Redis (and its scripts have run).
            # Once the relay has forwarded them, a reply on a direct connection comes after
            # Redis ran them (it answers after handling what it has already received).
            await asyncio.to_thread(wait_until, lambda: relay.counters.holding == 0, 10)
            # At once, not after a lease: the tenant's full limit is there.
            held = [await limiter.admit("t1"), await limiter.admit("t1")]
            with pytest.raises(ProxyError):
                await limiter.admit("t1")
            for slot in held:
                await slot.release()
            assert await _slots(redis, "t1") == 0
        finally:
            await limiter.stop()
            relay.stop()

    asyncio.run(run())


def test_a_release_that_overtakes_its_admission_takes_the_slot_back(redis: RedisServer) -> None:
    """The release of a timed-out admission can reach Redis before the admission itself (two
    connections): it leaves a tombstone, and the late admission takes nothing."""

    async def run() -> None:
        limiter = _redis_limiter(redis.url, TenantLimit(max_inflight=1))
        keys = limiter._keys("t1")
        try:
            await limiter._call(limiter._release_script, keys, [30_000, "late"])
            code, _ = await limiter._call(limiter._admit_script, keys, [1, 0, 1, "late", 30_000])
            assert code == 3  # given up before it ran: nothing taken
            assert await _slots(redis, "t1") == 0
            await (await limiter.admit("t1")).release()  # the tenant's one slot is free
            assert await _slots(redis, "t1") == 0
        finally:
            await limiter.stop()

    asyncio.run(run())


async def _slots(redis: RedisServer, tenant: str) -> int:
    """Slots held in Redis for `tenant`, asked on a connection of its own."""
    client, prefix, _ = open_redis_client(redis.url)
    try:
        return int(await client.zcard(f"{{{prefix}:limit:{tenant}}}:slots"))
    finally:
        await client.aclose()


async def _eventually(admit: object, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while True:
        try:
            await admit()  # type: ignore[operator]
            return
        except ProxyError:
            assert time.monotonic() < deadline, "no slot came back"
            await asyncio.sleep(0.05)


# -- whole proxies sharing Redis --------------------------------------------------------------


@pytest.fixture
def fake() -> Iterator[FakeUpstream]:
    upstream = FakeUpstream().start()
    try:
        yield upstream
    finally:
        upstream.stop()


def _two_proxies(
    proxy_factory: ProxyFactory, fake: FakeUpstream, redis: RedisServer, **settings: str
) -> tuple[ProxyServer, ProxyServer]:
    common = {"map_url": redis.url, "api_keys": KEYS, **settings}
    return (
        proxy_factory([fake.url], [fake.url], **common),
        proxy_factory([fake.url], [fake.url], **common),
    )


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _inflight_slots(redis: RedisServer, key: str) -> int:
    async def count() -> int:
        client, prefix, _ = open_redis_client(redis.url)
        try:
            return int(await client.zcard(f"{{{prefix}:limit:{tenant_of(key)}}}:slots"))
        finally:
            await client.aclose()

    return asyncio.run(count())


def test_inflight_limit_spans_two_proxies_and_every_way_out_frees_the_slot(
    fake: FakeUpstream, proxy_factory: ProxyFactory, redis: RedisServer
) -> None:
    one, two = _two_proxies(proxy_factory, fake, redis, tenant_max_inflight="1")
    streaming = {"model": MODEL, "input": "x", "stream": True}
    with httpx.Client(timeout=30) as client:
        # A stream held open on proxy one takes key-a's only slot...
        with client.stream(
            "POST", one.url + "/v1/responses", json=streaming, headers=_auth("key-a")
        ) as held:
            assert held.status_code == 200
            assert fake.first_event_sent.wait(10)
            # ...so proxy two refuses key-a (chat and pass-through alike), not key-b.
            refused = client.post(
                two.url + "/v1/embeddings", json={"input": "x"}, headers=_auth("key-a")
            )
            assert refused.status_code == 429, refused.text
            assert refused.headers["Retry-After"] == "1"
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
            refused_chat = client.post(
                two.url + "/v1/chat/completions", json=chat, headers=_auth("key-a")
            )
            assert refused_chat.status_code == 429
            other = client.post(
                two.url + "/v1/embeddings", json={"input": "x"}, headers=_auth("key-b")
            )
            assert other.status_code == 200, other.text
        # The client left mid-stream: its slot comes back.
        wait_until(lambda: _inflight_slots(redis, "key-a") == 0, timeout=10)
        fake.gate.set()
        ok = client.post(two.url + "/v1/embeddings", json={"input": "x"}, headers=_auth("key-a"))
        assert ok.status_code == 200
        # An engine error and a cut stream give the slot back too.
        fake.status = 500
        failed = client.post(
            one.url + "/v1/embeddings", json={"input": "x"}, headers=_auth("key-a")
        )
        assert failed.status_code == 500
        fake.status = 200
        cut = {**streaming, "cut": True}
        with pytest.raises(httpx.RemoteProtocolError):
            client.post(one.url + "/v1/responses", json=cut, headers=_auth("key-a"))
        wait_until(lambda: _inflight_slots(redis, "key-a") == 0, timeout=10)
        assert (
            client.post(
                two.url + "/v1/embeddings", json={"input": "x"}, headers=_auth("key-a")
            ).status_code
            == 200
        )
    # Counted by outcome, never by key.
    for proxy in (one, two):
        text = proxy.metrics_text()
        assert "key-a" not in text and tenant_of("key-a") not in text
    samples = two.metrics()
    assert samples['kvrelay_tenant_limit_total{outcome="rejected_inflight"}'] == 2
    assert samples['kvrelay_tenant_limit_total{outcome="admitted"}'] >= 3


def test_rps_limit_spans_two_proxies_on_chat_and_completions(
    pd_engines: tuple[EngineSim, EngineSim], proxy_factory: ProxyFactory, redis: RedisServer
) -> None:
    p, d = pd_engines
    common = {"map_url": redis.url, "api_keys": KEYS, "tenant_rps": "0.01", "tenant_burst": "2"}
    one = proxy_factory([p], [d], **common)
    two = proxy_factory([p], [d], **common)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    completion = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    with httpx.Client(timeout=30) as client:
        a = _auth("key-a")
        assert (
            client.post(one.url + "/v1/chat/completions", json=chat, headers=a).status_code == 200
        )
        assert (
            client.post(two.url + "/v1/completions", json=completion, headers=a).status_code == 200
        )
        refused = client.post(one.url + "/v1/completions", json=completion, headers=a)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) > 10  # a token every 100 s
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        b = _auth("key-b")
        assert (
            client.post(two.url + "/v1/chat/completions", json=chat, headers=b).status_code == 200
        )
    assert one.metrics()['kvrelay_tenant_limit_total{outcome="rejected_rps"}'] == 1


def test_per_key_override_beats_the_default(
    fake: FakeUpstream, proxy_factory: ProxyFactory
) -> None:
    proxy = proxy_factory(
        [fake.url], [fake.url], api_keys=KEYS, tenant_rps="0.01",
        tenant_limits=f"{tenant_of('key-b')}=rps=0",
    )  # fmt: skip
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        assert client.post("/tokenize", json={}, headers=_auth("key-a")).status_code == 200
        assert client.post("/tokenize", json={}, headers=_auth("key-a")).status_code == 429
        for _ in range(5):  # key-b is unlimited
            assert client.post("/tokenize", json={}, headers=_auth("key-b")).status_code == 200


def test_settings_defaults_are_unlimited() -> None:
    default, overrides = limits_from(Settings.model_construct())
    assert default.unlimited and overrides == {}


def test_tenant_id_command_prints_the_id_tenant_limits_uses() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvrelay.proxy.cli", "tenant-id"],
        input="key-a\n", capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == tenant_of("key-a")


def test_a_chat_stream_the_client_leaves_gives_its_slot_back(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory, redis: RedisServer
) -> None:
    p = engine_factory("LP", "--role", "prefill")
    d = engine_factory("LD", "--role", "decode", "--decode-us-per-step", "20000")  # 50 tokens/s
    proxy = proxy_factory(
        [p], [d], ready_path="/ready", map_url=redis.url, api_keys=KEYS, tenant_max_inflight="1"
    )
    long_chat = {"model": MODEL, "messages": [{"role": "user", "content": "tell me"}],
                 "max_tokens": 1000, "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        with client.stream(
            "POST", "/v1/chat/completions", json=long_chat, headers=_auth("key-a")
        ) as resp:
            assert resp.status_code == 200
            chunks = resp.iter_bytes()  # kept: a dropped iterator closes the response
            next(chunks)  # the answer is under way: the slot is taken
            assert _inflight_slots(redis, "key-a") == 1
            refused = client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                headers=_auth("key-a"),
            )
            assert refused.status_code == 429
        wait_until(lambda: _inflight_slots(redis, "key-a") == 0, timeout=10)
        ok = client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 2},
            headers=_auth("key-a"),
        )
        assert ok.status_code == 200, ok.text
    p.wait_idle(20)
    d.wait_idle(20)
