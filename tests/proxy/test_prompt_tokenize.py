"""The prompt tokenized for the KV events' index before routing (`TurnCrew.with_tokens`): asked
of the least busy P as routing weighs it (its load reading included, not only this worker's
own requests), and counted when no P answers, since that turn is then routed blind to the Ps'
events. Two real HTTP servers on loopback stand in for the Ps' `/tokenize`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from kvrelay.devtools import free_port
from kvrelay.kvcache_map import MemoryMap
from kvrelay.proxy.config import Settings
from kvrelay.proxy.engines import Releaser, Upstream
from kvrelay.proxy.fleet import Fleet, Pool
from kvrelay.proxy.fleet.load_reading import EngineLoad
from kvrelay.proxy.turn import TurnCrew, completion_shape

PROMPT = "You are a careful assistant. " * 20


@dataclass
class FakeTokenizer:
    """A P's `/tokenize`: answers `tokens` (or `status` without them) and counts the asks."""

    tokens: list[int]
    status: int = 200
    asked: list[dict[str, object]] = field(default_factory=list)

    async def tokenize(self, request: web.Request) -> web.Response:
        self.asked.append(await request.json())
        if self.status != 200:
            return web.json_response({"error": "no"}, status=self.status)
        return web.json_response({"tokens": self.tokens, "count": len(self.tokens)})


@dataclass
class Ps:
    busy: FakeTokenizer
    idle: FakeTokenizer
    fleet: Fleet
    busy_url: str
    idle_url: str


@pytest.fixture
async def ps() -> AsyncIterator[Ps]:
    busy, idle = FakeTokenizer([1] * 40), FakeTokenizer([2] * 40)
    runners, urls = [], []
    for fake in (busy, idle):
        app = web.Application()
        app.router.add_post("/tokenize", fake.tokenize)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}")
    settings = Settings(
        _env_file=None, prefill=urls, decode=["http://127.0.0.1:1"], load_poll_interval_s=1.0
    )
    prefill = Pool("prefill", eject_after=3, readmit_after=1)
    decode = Pool("decode", eject_after=3, readmit_after=1)
    for url in urls:  # the busy P first: the order alone would pick it
        prefill.add(url)
    decode.add("http://127.0.0.1:1")
    upstream = Upstream(connect_timeout=1.0)
    kvmap = MemoryMap()
    fleet = Fleet(settings, prefill, decode, kvmap, upstream, Releaser(None, upstream, 1.0))
    try:
        yield Ps(busy, idle, fleet, urls[0], urls[1])
    finally:
        await kvmap.close()
        upstream.close()
        for runner in runners:
            await runner.cleanup()


def _tokenized(result: str) -> float:
    value = REGISTRY.get_sample_value("kvrelay_prompt_tokenize_total", {"result": result})
    return value or 0.0


async def test_the_prompt_is_tokenized_by_the_p_whose_load_reading_is_lightest(ps: Ps) -> None:
    busy = ps.fleet.prefill.get(ps.busy_url)
    assert busy is not None
    # The engine reports a request running that this worker did not send (another worker's,
    # or one sent to it directly): this worker's own count of requests there is 0 for both.
    busy.load = EngineLoad(running=1.0, waiting=0.0, kv_usage=0.1, at=time.monotonic())
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
    prompt = completion_shape(body).prefixes("", body)
    assert prompt is not None and prompt.tokens is None
    ok = _tokenized("ok")
    crew = TurnCrew.of(ps.fleet)
    with_tokens = await crew.with_tokens(prompt, "completions", body)
    assert with_tokens.tokens == tuple(ps.idle.tokens)
    assert len(ps.idle.asked) == 1 and ps.busy.asked == []
    assert ps.idle.asked[0]["prompt"] == PROMPT
    assert _tokenized("ok") == ok + 1


async def test_a_prompt_no_p_tokenizes_is_routed_without_tokens_and_counted(ps: Ps) -> None:
    ps.busy.status = ps.idle.status = 500
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
    prompt = completion_shape(body).prefixes("", body)
    assert prompt is not None
    failed = _tokenized("failed")
    with_tokens = await TurnCrew.of(ps.fleet).with_tokens(prompt, "completions", body)
    assert with_tokens.tokens is None
    assert _tokenized("failed") == failed + 1
