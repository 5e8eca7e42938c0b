"""Failures around the proxy: engines down, failing, refusing or slow, clients leaving, Redis
stopping. Each request either answers what a single engine would, or fails with a clear error,
and afterwards no engine holds any block (engines' /metrics)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import redis as redis_py

from kvrelay.devtools import EngineFactory, FaultProxy, ProxiedPair, ProxyFactory
from kvrelay.enginesim.reference import reference_chat, reference_completion
from tests.harness import RedisServer, wait_until
from tests.proxy.client import MODEL, chat_body, post, reply_of

PROMPT = "Disaggregated serving splits prefill and decode. " * 4


def _complete(url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return post(url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 8},
                headers)  # fmt: skip


def test_prefill_down_falls_back_to_decode_only(pd_fleet: ProxiedPair) -> None:
    pd_fleet.prefill.kill()
    resp = _complete(pd_fleet.proxy.url)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == reference_completion(PROMPT, 8)
    assert pd_fleet.proxy.metrics()['kvrelay_fallbacks_total{kind="decode_only"}'] >= 1
    pd_fleet.proxy.stop()
    pd_fleet.decode.wait_idle()


def test_failing_prefill_is_retried_on_another(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    p1, p2 = engine_factory("P1", "--role", "prefill"), engine_factory("P2", "--role", "prefill")
    d = engine_factory("D", "--role", "decode")
    proxy = proxy_factory([p1, p2], [d], ready_path="/ready")
    assert p1.request("/admin/faults", {"fail_next_n": 1, "fail_status": 500})[0] == 200
    resp = _complete(proxy.url)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == reference_completion(PROMPT, 8)
    assert proxy.metrics()['kvrelay_retries_total{leg="prefill"}'] == 1
    assert p2.metric("enginesim_prompt_tokens_computed_total") > 0
    proxy.stop()
    for engine in (p1, p2, d):
        engine.wait_idle()


def test_decode_down_or_refusing_moves_to_another_decode(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    p = engine_factory("P", "--role", "prefill")
    d1, d2 = engine_factory("D1", "--role", "decode"), engine_factory("D2", "--role", "decode")
    proxy = proxy_factory([p], [d1, d2], ready_path="/ready", eject_after_failures="50")
    # D1 refuses admission: the same P params go to D2.
    assert d1.request("/admin/faults", {"refuse_admission": True})[0] == 200
    resp = _complete(proxy.url)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == reference_completion(PROMPT, 8)
    assert proxy.metrics()['kvrelay_retries_total{leg="decode"}'] == 1
    assert p.metric("enginesim_prompt_tokens_computed_total") > 0
    # D1 dies: the next request is served by D2 as well.
    d1.kill()
    resp = _complete(proxy.url)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == reference_completion(
        PROMPT, 8
    )
    proxy.stop()
    p.wait_idle()
    d2.wait_idle()


def test_decode_refusing_alone_is_a_clear_error_and_frees_prefill_blocks(
    pd_fleet: ProxiedPair,
) -> None:
    assert pd_fleet.decode.request("/admin/faults", {"refuse_admission": True})[0] == 200
    resp = _complete(pd_fleet.proxy.url)
    assert resp.status_code in (502, 503)
    err = resp.json()["error"]
    assert "decode engine" in err["message"] and err["code"] == "decode_unavailable"
    # P prefilled and held its blocks for D; nobody took them, so they are released now.
    pd_fleet.prefill.wait_idle()
    assert pd_fleet.decode.request("/admin/faults", {"refuse_admission": False})[0] == 200
    pd_fleet.finish()


def test_decode_client_error_is_passed_on_and_frees_prefill_blocks(pd_fleet: ProxiedPair) -> None:
    assert (
        pd_fleet.decode.request("/admin/faults", {"fail_next_n": 1, "fail_status": 422})[0] == 200
    )
    resp = _complete(pd_fleet.proxy.url)
    assert resp.status_code == 422
    assert resp.json()["error"]["message"]
    pd_fleet.finish()


def test_slow_decode_times_out_and_another_serves(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    p = engine_factory("P", "--role", "prefill")
    d1, d2 = engine_factory("D1", "--role", "decode"), engine_factory("D2", "--role", "decode")
    proxy = proxy_factory([p], [d1, d2], ready_path="/ready", first_byte_timeout="1.0")
    assert d1.request("/admin/faults", {"delay_ms": 5000})[0] == 200
    resp = _complete(proxy.url)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == reference_completion(PROMPT, 8)
    assert proxy.metrics()['kvrelay_retries_total{leg="decode"}'] == 1
    assert d1.request("/admin/faults", {"delay_ms": 0})[0] == 200
    proxy.stop()
    for engine in (p, d1, d2):
        engine.wait_idle()


def test_slow_everything_gives_a_timeout_error(
    pd_fleet: ProxiedPair, proxy_factory: ProxyFactory
) -> None:
    proxy = proxy_factory([pd_fleet.prefill], [pd_fleet.decode], first_byte_timeout="0.5",
                          retries="0")  # fmt: skip
    assert pd_fleet.decode.request("/admin/faults", {"delay_ms": 3000})[0] == 200
    resp = _complete(proxy.url)
    # D is healthy (its probe passes), only slow: a timeout of this request, not D's failure.
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == "decode_timeout"
    assert "first_byte_timeout" in resp.json()["error"]["message"]
    assert pd_fleet.decode.request("/admin/faults", {"delay_ms": 0})[0] == 200
    proxy.stop()
    pd_fleet.finish()


def test_client_disconnect_mid_stream_cancels_and_releases(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    p = engine_factory("P", "--role", "prefill")
    d = engine_factory("D", "--role", "decode", "--decode-us-per-step", "30000", "--eos-period",
                       "100000")  # fmt: skip
    proxy = proxy_factory([p], [d], ready_path="/ready")
    body = {**chat_body([{"role": "user", "content": PROMPT}], max_tokens=400), "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body,
                      headers={"X-Conversation-Id": "leaver"}, timeout=30) as resp:  # fmt: skip
        assert resp.status_code == 200
        for chunk in resp.iter_bytes():
            if b"content" in chunk:
                break  # the client goes away after the first tokens
    wait_until(lambda: d.metric("enginesim_requests_running") == 0, 15,
               what="D to stop the abandoned request")  # fmt: skip
    wait_until(
        lambda: proxy.metrics().get(
            'kvrelay_requests_total{outcome="client_disconnected",route="chat"}', 0) == 1,
        10, what="the proxy to count the disconnect",
    )  # fmt: skip
    p.wait_idle()
    d.wait_idle()


def test_redis_stopping_mid_run_serves_without_reuse(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory, redis: RedisServer
) -> None:
    lease = ("--lease-seconds", "8")
    p = engine_factory("P", "--role", "prefill", *lease)
    d = engine_factory("D", "--role", "decode", *lease)
    proxy = proxy_factory([p], [d], ready_path="/ready", entry_safety_margin_s="1",
                          map_url=redis.url + "?timeout_ms=200")  # fmt: skip
    headers = {"X-Conversation-Id": "redis-conv"}
    msgs = [{"role": "user", "content": PROMPT}]
    first = reply_of(post(proxy.url, "/v1/chat/completions", chat_body(msgs), headers))
    msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "Go on."}]
    loaded = p.metric("enginesim_prompt_tokens_loaded_total")
    second = reply_of(post(proxy.url, "/v1/chat/completions", chat_body(msgs), headers))
    assert second == reference_chat(msgs, 12)
    assert p.metric("enginesim_prompt_tokens_loaded_total") > loaded  # reuse via Redis
    redis.stop()
    msgs += [{"role": "assistant", "content": second}, {"role": "user", "content": "More."}]
    loaded = p.metric("enginesim_prompt_tokens_loaded_total")
    third = reply_of(post(proxy.url, "/v1/chat/completions", chat_body(msgs), headers))
    assert third == reference_chat(msgs, 12)
    assert p.metric("enginesim_prompt_tokens_loaded_total") == loaded
    metrics = proxy.metrics()
    assert metrics['kvrelay_reuse_total{result="map_unavailable"}'] == 1
    assert metrics['kvrelay_map_unavailable_total{op="take"}'] == 1
    # The entry Redis lost is freed by D's lease (the last resort); nothing else is held.
    proxy.stop()
    p.wait_idle(20)
    d.wait_idle(20)


def test_decode_dying_mid_stream_ends_with_an_error_event(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    p = engine_factory("P", "--role", "prefill")
    d = engine_factory("D", "--role", "decode", "--decode-us-per-step", "30000", "--eos-period",
                       "100000")  # fmt: skip
    proxy = proxy_factory([p], [d], ready_path="/ready")
    body = {**chat_body([{"role": "user", "content": PROMPT}], max_tokens=400), "stream": True}
    received = b""
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body,
                      headers={"X-Conversation-Id": "crash"}, timeout=30) as resp:  # fmt: skip
        assert resp.status_code == 200
        for chunk in resp.iter_bytes():
            received += chunk
            if b"content" in chunk and d.process is not None:
                d.kill()
    assert b'"error"' in received and b"decode_failed" in received
    p.wait_idle()


def test_decode_down_releases_prefill_blocks_through_the_side_channel(
    pd_fleet: ProxiedPair,
) -> None:
    # No D can tell P anything: only the proxy's release frees P's blocks before the lease.
    pd_fleet.decode.kill()
    resp = _complete(pd_fleet.proxy.url)
    assert resp.status_code in (502, 503)
    assert "decode engine" in resp.json()["error"]["message"]
    assert pd_fleet.prefill.metric("enginesim_prompt_tokens_computed_total") > 0
    pd_fleet.prefill.wait_idle(10)  # the lease is 600 s: this is the proxy's release
    wait_until(
        lambda: pd_fleet.proxy.metrics().get(
            'kvrelay_releases_total{holder="prefill",result="released"}', 0) >= 1,
        10, what="the proxy's release of P's blocks",
    )  # fmt: skip


def test_a_map_write_that_timed_out_but_landed_keeps_its_hold(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory, redis: RedisServer
) -> None:
    """Redis answers the turn's put after the proxy's bound, but stores it: D's hold must
    outlive the timeout, so the next turn reuses the blocks the entry points at."""
    lease = ("--lease-seconds", "8")  # the entries left in Redis are freed by D's lease
    p = engine_factory("P", "--role", "prefill", *lease)
    d = engine_factory("D", "--role", "decode", "--decode-us-per-step", "50000", *lease)
    relay = FaultProxy("127.0.0.1", redis.port).start()
    try:
        map_url = f"redis://127.0.0.1:{relay.listen_port}/0?timeout_ms=100"
        proxy = proxy_factory([p], [d], ready_path="/ready", map_url=map_url,
                              entry_safety_margin_s="1")  # fmt: skip
        msgs = [{"role": "user", "content": PROMPT}]
        # Another conversation first: Redis then knows the map's scripts (a put whose script
        # Redis had to load first would not have run at all when it timed out).
        warm = {"X-Conversation-Id": "warm-up"}
        assert post(proxy.url, "/v1/chat/completions", chat_body(msgs), warm).status_code == 200
        wait_until(lambda: _entries(redis) == 1, 10, what="the warm-up entry")
        headers = {"X-Conversation-Id": "late-put"}
        with ThreadPoolExecutor(1) as pool:
            turn = pool.submit(post, proxy.url, "/v1/chat/completions", chat_body(msgs), headers)
            # D is decoding (the turn's take is done): the put that follows will be late.
            wait_until(lambda: d.metric("enginesim_requests_running") == 1, 15,
                       what="D to decode the first turn")  # fmt: skip
            relay.set_delay(1.0)
            first = reply_of(turn.result(60))
        assert proxy.metrics()['kvrelay_map_unavailable_total{op="put"}'] == 1
        relay.heal()
        # The late put reaches Redis and is stored.
        wait_until(lambda: relay.counters.holding == 0, 15, what="the relay to pass the put on")
        wait_until(lambda: _entries(redis) == 2, 10, what="the late put to be stored")
        msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "Go on."}]
        loaded = p.metric("enginesim_prompt_tokens_loaded_total")
        second = reply_of(post(proxy.url, "/v1/chat/completions", chat_body(msgs), headers))
        assert second == reference_chat(msgs, 12)
        assert p.metric("enginesim_prompt_tokens_loaded_total") > loaded  # reused, not gone
        assert proxy.metrics()['kvrelay_reuse_total{result="hit"}'] == 1
        wait_until(
            lambda: proxy.metrics().get(
                'kvrelay_map_unconfirmed_puts_total{result="stored"}', 0) == 1,
            20, what="the proxy to settle the late put as stored",
        )  # fmt: skip
        proxy.stop()
        p.wait_idle(20)
        d.wait_idle(20)
    finally:
        relay.stop()


def _entries(redis: RedisServer) -> int:
    """Entries in the map's index, asked on a connection of its own."""
    client = redis_py.Redis.from_url(redis.url)
    try:
        return int(client.zcard("kvrelay:idx"))
    finally:
        client.close()
