"""Object-dense JSON bodies: what a body costs once parsed is bounded, not just its bytes.

`{"junk":[{},{},...]}` is 3 bytes per 80-byte object; thirty such 7.7 MiB bodies took a
worker to 1.5-2 GB before the body budget counted parsed size. Here the bound that
`parsed_size_bound` promises is checked against what CPython really allocates for the densest
shapes, and a real proxy process is attacked while its resident memory is read from /proc.
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from pathlib import Path

import httpx
import orjson
import pytest

from kvrelay.devtools import EngineFactory, ProxyFactory, chaos_load
from kvrelay.proxy.base import ProxyError
from kvrelay.proxy.config import load_settings
from kvrelay.proxy.http.body import BodyBudget, HeldBody, parse_json_body, parsed_size_bound

MODEL = "kvrelay-sim"
MIB = 2**20
# The proxy README states this bound (hostile input, body reading): a worker under the
# dense-body attack stays within its idle RSS + inflight_body_bytes + this.
RSS_SLACK = 64 * MIB
BUDGET = 128 * MIB


def _dense(size: int, model: str = "nope") -> bytes:
    head = b'{"model":"' + model.encode() + b'","messages":[{"role":"user","content":"x"}],"junk":['
    count = (size - len(head) - 2) // 3
    return head + b"{}," * (count - 1) + b"{}]}"


def _shapes(size: int) -> dict[str, bytes]:
    """The densest bodies per byte we know of, each about `size` bytes."""
    return {
        "empty-objects": _dense(size),
        "empty-arrays": b'{"a":[' + b"[]," * (size // 3) + b"[]]}",
        "nested-arrays": b'{"a":[' + b"[[1]]," * (size // 6) + b"1]}",
        "one-key-objects": b'{"a":[' + b'{"a":1},' * (size // 8) + b"{}]}",
        "unique-one-key-objects": b'{"a":['
        + b",".join(b'{"%d_0":1}' % i for i in range(size // 11))
        + b"]}",
        "unique-keys": b"{" + b",".join(b'"k%d":[]' % i for i in range(size // 10)) + b"}",
        "floats": b'{"a":[' + b"1.5," * (size // 4) + b"1]}",
        "big-ints": b'{"a":[' + b"100000," * (size // 7) + b"1]}",
        "short-strings": b'{"a":[' + b'"ab",' * (size // 5) + b'"a"]}',
        "astral-text": orjson.dumps({"a": "\U0001f600" + "a" * size}),
        "astral-strings": orjson.dumps({"a": ["\U0001f600a"] * (size // 10)}),
        "cjk-strings": orjson.dumps({"a": ["\u4e2da"] * (size // 8)}),
        "long-number-fallback": b'{"a":[' + b"123456789012345678901234," * (size // 25) + b"1]}",
    }


@pytest.mark.parametrize("shape", list(_shapes(1000)))
def test_the_parsed_size_bound_holds_for_the_densest_shapes(shape: str) -> None:
    raw = _shapes(400_000)[shape]
    settings, held = load_settings({}, env_file=None), HeldBody(BodyBudget(BUDGET))
    gc.collect()
    tracemalloc.start()
    try:
        body = parse_json_body(raw, settings, held)
        allocated = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert body
    assert allocated <= parsed_size_bound(raw), (allocated, parsed_size_bound(raw))


def test_a_body_whose_parsed_bound_cannot_fit_is_a_413_and_never_parsed() -> None:
    settings = load_settings({"inflight_body_bytes": str(64 * MIB)}, env_file=None)
    raw = _dense(int(7.7 * MIB))
    budget = BodyBudget(settings.inflight_body_bytes)
    gc.collect()
    tracemalloc.start()
    try:
        with pytest.raises(ProxyError) as refused:
            parse_json_body(raw, settings, HeldBody(budget))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert refused.value.status == 413 and refused.value.code == "body_too_complex"
    assert "inflight_body_bytes" in refused.value.message
    assert peak < MIB  # counted, not parsed
    assert budget.used == 0


def test_a_parsed_body_holds_its_bound_in_the_budget() -> None:
    settings = load_settings({}, env_file=None)
    raw = _dense(MIB)
    held = HeldBody(BodyBudget(BUDGET))
    parse_json_body(raw, settings, held)
    assert held.held == len(raw) + parsed_size_bound(raw) > 20 * len(raw)
    with pytest.raises(ProxyError) as refused:  # a second such body does not fit beside it
        parse_json_body(raw, settings, HeldBody(held.budget))
    assert refused.value.code == "body_budget_exhausted"


def _long_chat(messages: int) -> bytes:
    text = "Here is what I think, in a few words: the plan works. Next step? {see notes} [1]. "
    history = [
        {"role": "user" if (messages - i) % 2 else "assistant", "content": f"{i}: " + text * 4}
        for i in range(messages)
    ]
    return orjson.dumps({"model": MODEL, "messages": history, "max_tokens": 2})


def test_a_long_punctuated_chat_history_fits_the_budget_twice() -> None:
    raw = _long_chat(20_000)  # ~7 MiB, 20,000 messages, every punctuation mark over-counted
    assert len(raw) > 6 * MIB
    settings = load_settings({}, env_file=None)
    held = HeldBody(BodyBudget(settings.inflight_body_bytes))
    assert len(parse_json_body(raw, settings, held)["messages"]) == 20_000
    assert held.held < settings.inflight_body_bytes // 2


# -- a real proxy process under the attack -------------------------------------------------------


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0]) * 1024
    return out


async def _send_all(url: str, bodies: list[bytes]) -> list[httpx.Response | BaseException]:
    limits = httpx.Limits(max_connections=len(bodies))
    headers = {"Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        calls = [client.post("/v1/chat/completions", content=b, headers=headers) for b in bodies]
        return await asyncio.gather(*calls, return_exceptions=True)


@pytest.mark.timeout(300)
def test_dense_bodies_keep_a_worker_within_its_idle_rss_plus_the_budget(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    # Engines with room for a long history (~220k tokens); the defaults take 4096.
    room = ["--max-model-len", "300000", "--num-blocks", "20000"]
    prefill, decode = engine_factory.many(
        ("P", ["--role", "prefill", *room]), ("D", ["--role", "decode", *room])
    )
    proxy = proxy_factory([prefill], [decode], ready_path="/ready",
                          inflight_body_bytes=str(BUDGET))  # fmt: skip
    assert proxy.process is not None and proxy.process.proc is not None
    pid = proxy.process.proc.pid  # one worker: the serving process itself
    warm = httpx.post(proxy.url + "/v1/chat/completions", content=_long_chat(100), timeout=60,
                      headers={"Content-Type": "application/json"})  # fmt: skip
    assert warm.status_code == 200, warm.text
    idle = _status(pid)["VmRSS"]
    # Thirty 7.7 MiB bodies that could never fit parsed, and thirty 1 MiB ones that fit one
    # at a time (~70 MiB each once parsed): the budget is all that holds them.
    answers = asyncio.run(_send_all(proxy.url, [_dense(int(7.7 * MIB))] * 30))
    answers += asyncio.run(_send_all(proxy.url, [_dense(MIB)] * 30))
    peak = _status(pid)["VmHWM"]
    assert peak - idle <= BUDGET + RSS_SLACK, (idle / MIB, peak / MIB)
    # Every client reads its answer: a body refused unread (503) is drained before the answer,
    # so no client still sending meets a closed connection.
    replies = [a for a in answers if isinstance(a, httpx.Response)]
    assert len(replies) == len(answers), [a for a in answers if a not in replies]
    codes = {(a.status_code, a.json()["error"]["code"]) for a in replies}
    assert all(chaos_load.is_openai_error(a.json()) for a in replies)
    assert codes <= {(413, "body_too_complex"), (503, "body_budget_exhausted"),
                     (404, "model_not_found")}, codes  # fmt: skip
    assert (413, "body_too_complex") in codes and (404, "model_not_found") in codes, codes
    # The budget is back and a long history is still served.
    big = _long_chat(1_000)
    after = httpx.post(proxy.url + "/v1/chat/completions", content=big, timeout=120,
                       headers={"Content-Type": "application/json"})  # fmt: skip
    assert after.status_code == 200, after.text
