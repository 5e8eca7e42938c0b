"""`Turn` driven without a server: fake engine legs, a fake client, a fake releaser.

The fakes stand in for what a turn talks to (`Engines`, `Client`, the releaser's side-channel
calls); everything between them is the proxy's own code: the router, the pools, the legs and
their status handling, the owed holds, the in-process conversation map. Each test checks what
the engines were sent, what the client got, what the map holds and what was released.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import REGISTRY

from kvrelay.connector.protocol import HoldRef
from kvrelay.kvcache_map import ConversationKey, KVEntry, MapUnavailableError, MemoryMap
from kvrelay.proxy.base import ProxyError
from kvrelay.proxy.config import Settings
from kvrelay.proxy.engines import (
    Releaser,
    Upstream,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
)
from kvrelay.proxy.engines.upstream import UpstreamBroken
from kvrelay.proxy.fleet import Fleet, Pool
from kvrelay.proxy.fleet.cache_residence import CacheResidence
from kvrelay.proxy.fleet.load_reading import EngineLoad
from kvrelay.proxy.turn import Turn, TurnContext, TurnCrew, completion_shape
from kvrelay.proxy.turn.attempts import EngineAnswer
from kvrelay.proxy.turn.client import ClientStream

P1, P2 = "http://p1.test:8100", "http://p2.test:8100"
D1, D2 = "http://d1.test:8200", "http://d2.test:8200"
TENANT = "tenant-a"


# -- fakes ---------------------------------------------------------------------------------------


@dataclass
class FakeAnswer:
    """One scripted engine answer: a JSON body, or SSE chunks (maybe broken off after them)."""

    status: int
    body: bytes = b""
    chunks: tuple[bytes, ...] = ()
    breaks: bool = False  # the connection drops after `chunks`
    closed: bool = False  # the leg dropped the connection (what tells an engine to stop)

    def header(self, name: bytes) -> bytes | None:
        if name == b"content-type":
            return b"text/event-stream" if self.chunks else b"application/json"
        return None

    async def read(self) -> bytes:
        return self.body

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        if self.breaks:
            raise UpstreamBroken("connection lost")

    def close(self) -> None:
        self.closed = True

    def release(self) -> None:
        pass


@dataclass
class FakeEngines:
    """The engines' side of the legs: per URL, answers (or errors) handed out in order."""

    script: dict[str, list[FakeAnswer | UpstreamError]]
    sent: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    unhealthy: set[str] = field(default_factory=set)
    probed: list[str] = field(default_factory=list)

    async def post(
        self, url: str, path: str, payload: bytes, headers: tuple[tuple[str, str], ...]
    ) -> EngineAnswer:
        self.sent.append((url, json.loads(payload)))
        answer = self.script[url].pop(0)
        if isinstance(answer, UpstreamError):
            raise answer
        return answer

    async def probe(self, url: str) -> tuple[bool, str]:
        # A timed-out engine that still answers its probe is not charged (the request was slow).
        self.probed.append(url)
        return url not in self.unhealthy, "scripted probe"

    def bodies(self, url: str) -> list[dict[str, Any]]:
        return [body for to, body in self.sent if to == url]


@dataclass
class FakeStream:
    """What the client got of a streamed answer; `leave_at`: the write the client is gone by."""

    writes: list[bytes] = field(default_factory=list)
    ended: bool = False
    leave_at: int | None = None

    async def write(self, data: bytes) -> None:
        if self.leave_at is not None and len(self.writes) >= self.leave_at:
            raise ConnectionResetError("the client left")
        self.writes.append(data)

    async def write_eof(self, data: bytes = b"") -> None:
        await self.write(data)
        self.ended = True


@dataclass
class FakeClient:
    """The client's side of a turn, recorded."""

    stream_out: FakeStream = field(default_factory=FakeStream)
    json_status: int | None = None
    json_body: dict[str, Any] | None = None
    json_headers: Mapping[str, str] | None = None

    @property
    def headers(self) -> Mapping[str, str]:
        return {}

    def send_json(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        self.json_status, self.json_body = status, json.loads(body)
        self.json_headers = headers

    async def open_stream(self, status: int, headers: Mapping[str, str]) -> ClientStream:
        return self.stream_out


class FakeReleaser(Releaser):
    """Records releases instead of calling side channels; D's finished params are scripted."""

    def __init__(self) -> None:
        super().__init__(None, Upstream(connect_timeout=1.0), 1.0)
        self.released: list[tuple[str, HoldRef | None]] = []
        self.finished: dict[str, dict[str, Any]] = {}  # request id -> D's published params
        # Release tokens of holds the holder had already ended: it answers that it freed nothing.
        self.already_free: set[str] = set()

    async def release(self, holder: str, ref: HoldRef | None) -> bool:
        self.released.append((holder, ref))
        return ref is None or ref.release_token not in self.already_free

    async def finished_params(
        self, host: str, port: int, client_request_id: str
    ) -> dict[str, Any] | None:
        return self.finished.get(client_request_id)


class FakeUnavailableMap(MemoryMap):
    """A conversation map whose every call fails as Redis down does."""

    async def take(self, key: ConversationKey) -> Any:
        raise MapUnavailableError("fake: the map is down")

    async def put(self, key: ConversationKey, entry: Any, ttl: float) -> None:
        raise MapUnavailableError("fake: the map is down")


# -- engine answers ------------------------------------------------------------------------------


def p_params(request_id: str) -> dict[str, Any]:
    """P's answer params: its blocks for D."""
    return {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-engine",
        "remote_request_id": request_id, "remote_host": "10.0.0.1", "remote_port": 5600,
        "remote_block_ids": [[7, 8]], "release_token": f"p-token-{request_id}",
    }  # fmt: skip


def d_params(request_id: str, tokens: int = 40) -> dict[str, Any]:
    """D's final params: the hold it keeps for the next turn."""
    return {
        "remote_engine_id": "d-engine", "remote_request_id": request_id,
        "remote_host": "10.0.0.2", "remote_port": 5700, "remote_block_ids": [[1, 2, 3]],
        "remote_num_tokens": tokens, "remote_blocks_expiry_time": time.time() + 600,
        "remote_block_hashes": ["0123456789abcdef"] * 3, "release_token": f"d-token-{request_id}",
    }  # fmt: skip


def prefill_ok(request_id: str) -> FakeAnswer:
    body = {"kv_transfer_params": p_params(request_id), "usage": {"prompt_tokens": 40}}
    return FakeAnswer(200, json.dumps(body).encode())


def decode_ok(request_id: str, text: str = "answer") -> FakeAnswer:
    body = {"choices": [{"text": text}], "kv_transfer_params": d_params(request_id)}
    return FakeAnswer(200, json.dumps(body).encode())


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


# -- the fleet -----------------------------------------------------------------------------------


@dataclass
class Rig:
    fleet: Fleet
    releaser: FakeReleaser
    kvmap: MemoryMap

    def turn(
        self, prompt: str, request_id: str, engines: FakeEngines, client: FakeClient, **body: Any
    ) -> Turn:
        request = {"model": "m", "prompt": prompt, "max_tokens": 8, **body}
        ctx = TurnContext.of(
            route="completions", body=request, request_id=request_id, tenant=TENANT,
            shape=completion_shape(request), conversation_id="conv-1",
        )  # fmt: skip
        return Turn(TurnCrew.of(self.fleet, engines), client, ctx)

    def released(self) -> list[tuple[str, str]]:
        """(holder, release token) of every release so far."""
        return [(holder, ref.release_token) for holder, ref in self.releaser.released if ref]


async def _rig(kvmap: MemoryMap) -> AsyncGenerator[Rig, None]:
    # `affinity`: every turn goes through P (`conditional` would send a short follow-up
    # straight to its D), and back to the conversation's previous P.
    settings = Settings(
        _env_file=None, prefill=[P1, P2], decode=[D1, D2], retries=1, routing_policy="affinity"
    )
    prefill = Pool("prefill", eject_after=3, readmit_after=1)
    decode = Pool("decode", eject_after=3, readmit_after=1)
    for url in (P1, P2):
        prefill.add(url)
    for url in (D1, D2):
        decode.add(url)
    releaser = FakeReleaser()
    # The fleet's engine client is never used: every engine call goes through `FakeEngines`.
    fleet = Fleet(settings, prefill, decode, kvmap, Upstream(connect_timeout=1.0), releaser)
    try:
        yield Rig(fleet, releaser, kvmap)
    finally:
        await releaser.drain()
        await kvmap.close()


@pytest.fixture
async def rig() -> AsyncGenerator[Rig, None]:
    async for made in _rig(MemoryMap()):
        yield made


@pytest.fixture
async def rig_without_map() -> AsyncGenerator[Rig, None]:
    async for made in _rig(FakeUnavailableMap()):
        yield made


async def _stored(rig: Rig) -> Any:
    """What the map holds for the conversation (taken, so it is gone afterwards)."""
    return await rig.kvmap.take(ConversationKey(TENANT, "conv-1"))


# -- the tests -----------------------------------------------------------------------------------


async def test_a_miss_then_a_hit_pulls_the_first_turns_blocks(rig: Rig) -> None:
    first = "You are terse. Tell me about otters."
    engines = FakeEngines({P1: [prefill_ok("r1")], D1: [decode_ok("r1", "Otters swim.")]})
    client = FakeClient()
    turn = rig.turn(first, "r1", engines, client)
    await turn.run()
    assert turn.report.reuse == "miss"
    assert client.json_status == 200 and client.json_body is not None
    assert "kv_transfer_params" not in client.json_body  # the params stay with the proxy
    p_sent = engines.bodies(P1)[0]["kv_transfer_params"]
    assert p_sent["do_remote_decode"] is True and p_sent["remote_engine_id"] is None
    d_sent = engines.bodies(D1)[0]["kv_transfer_params"]
    assert d_sent["do_remote_prefill"] is True and d_sent["hold_blocks"] is True
    assert d_sent["remote_block_ids"] == [[7, 8]] and d_sent["remote_url"] == P1

    # The second turn extends the first prompt: P pulls D1's blocks, D1 (the holder) decodes.
    engines.script.update({P1: [prefill_ok("r2")], D1: [decode_ok("r2")]})
    turn2 = rig.turn(first + " Otters swim. And beavers?", "r2", engines, FakeClient())
    await turn2.run()
    assert turn2.report.reuse == "hit" and turn2.report.tokens_offered == 40
    p_sent = engines.bodies(P1)[1]["kv_transfer_params"]
    assert p_sent["remote_engine_id"] == "d-engine" and p_sent["release_token"] == "d-token-r1"
    stored = await _stored(rig)
    assert stored is not None and stored.release_token == "d-token-r2" and stored.url == D1
    assert stored.prefill_url == P1  # P affinity for the next turn
    # P read turn 1's hold and D read P's blocks: their connectors freed them, not the proxy.
    await rig.releaser.drain()
    assert rig.released() == []


async def test_p_failing_falls_back_to_decode_only(rig: Rig) -> None:
    engines = FakeEngines(
        {
            P1: [UpstreamConnectError("refused")],
            P2: [FakeAnswer(500, b"boom")],
            D1: [decode_ok("r1")],
            D2: [decode_ok("r1")],
        }
    )
    client = FakeClient()
    turn = rig.turn("Hello there", "r1", engines, client)
    await turn.run()
    assert len(engines.bodies(P1)) + len(engines.bodies(P2)) == 2  # both P tried
    (d_url, d_body) = next((url, body) for url, body in engines.sent if url in (D1, D2))
    params = d_body["kv_transfer_params"]
    assert "do_remote_prefill" not in params and params["hold_blocks"] is True  # D prefills
    assert client.json_status == 200
    assert turn.prefill is None and turn.report.prefill_leg.attempts == 2
    # P's connect error is P's fault at once; its 5xx is disputed (D prefilled another way).
    p_failed = [b for b in rig.fleet.prefill.backends.values() if b.failures]
    assert len(p_failed) == 1 and p_failed[0].last_error is not None
    stored = await _stored(rig)
    assert stored is not None and stored.url == d_url and stored.prefill_url is None
    await rig.releaser.drain()
    assert rig.released() == []


def _with_usage(answer: FakeAnswer, cached: int, **params: Any) -> FakeAnswer:
    body = json.loads(answer.body)
    body["usage"] = {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": cached}}
    body["kv_transfer_params"].update(params)
    return FakeAnswer(answer.status, json.dumps(body).encode())


async def test_ds_cached_tokens_are_read_only_when_d_got_no_p_params(rig: Rig) -> None:
    # vLLM's D reports P's cached tokens as its own (ACCOUNTING §1): on a turn through P the
    # account is P's report, and D's usage is not taken for D's own figure.
    report = {"kvr_prompt_tokens": 40, "kvr_local_hit_tokens": 16, "kvr_loaded_tokens": 16,
              "kvr_offered_blocks": 3, "kvr_refused_blocks": {"hash": 1}}  # fmt: skip
    engines = FakeEngines({P1: [_with_usage(prefill_ok("r1"), 32, **report)],
                           D1: [_with_usage(decode_ok("r1"), 32)]})  # fmt: skip
    client = FakeClient()
    turn = rig.turn("Hello there", "r1", engines, client)
    await turn.run()
    assert client.json_headers is not None
    headers = dict(client.json_headers)
    assert headers["X-Kvrelay-Reused-Tokens"] == "32"
    assert headers["X-Kvrelay-Local-Hit-Tokens"] == headers["X-Kvrelay-Loaded-Tokens"] == "16"
    assert headers["X-Kvrelay-Refused-Blocks"] == "hash=1"
    assert headers["X-Kvrelay-Prefilled-By"] == "prefill"
    d_account = turn.accounts.decode
    assert d_account is not None and d_account.reused is None  # P's figure, not D's
    # Without P (both failed), D got no P params: its usage is its own figure.
    engines = FakeEngines({P1: [UpstreamConnectError("refused")],
                           P2: [UpstreamConnectError("refused")],
                           D1: [_with_usage(decode_ok("r2"), 24)],
                           D2: [_with_usage(decode_ok("r2"), 24)]})  # fmt: skip
    client = FakeClient()
    turn = rig.turn("Good morning", "r2", engines, client)
    await turn.run()
    assert client.json_headers is not None
    assert client.json_headers["X-Kvrelay-Reused-Tokens"] == "24"
    assert client.json_headers["X-Kvrelay-Local-Hit-Tokens"] == "unknown"
    assert client.json_headers["X-Kvrelay-Prefilled-By"] == "decode"


async def test_d_failing_before_the_first_byte_is_retried_on_another_d(rig: Rig) -> None:
    engines = FakeEngines(
        {P1: [prefill_ok("r1")], P2: [prefill_ok("r1")],
         D1: [FakeAnswer(503, b"overloaded")], D2: [decode_ok("r1")]}
    )  # fmt: skip
    # D1 is the first choice (the less loaded), D2 the retry.
    rig.fleet.decode.backends[D2].inflight = 1
    client = FakeClient()
    turn = rig.turn("Hello there", "r1", engines, client)
    await turn.run()
    d1, d2 = engines.bodies(D1), engines.bodies(D2)
    assert len(d1) == 1 and len(d2) == 1
    assert d1[0]["kv_transfer_params"] == d2[0]["kv_transfer_params"]  # the same P params
    assert client.json_status == 200 and turn.report.decode_leg.attempts == 2
    # D2 served the request that D1 refused: the 503 was D1's fault.
    assert rig.fleet.decode.backends[D1].failures == 1
    stored = await _stored(rig)
    assert stored is not None and stored.url == D2


async def test_every_d_failing_is_a_shaped_502_and_frees_ps_blocks(rig: Rig) -> None:
    engines = FakeEngines(
        {P1: [prefill_ok("r1")], P2: [prefill_ok("r1")],
         D1: [UpstreamConnectError("refused")], D2: [UpstreamConnectError("refused")]}
    )  # fmt: skip
    turn = rig.turn("Hello there", "r1", engines, FakeClient())
    with pytest.raises(ProxyError) as raised:
        await turn.run()
    assert raised.value.status == 502 and raised.value.code == "decode_unavailable"
    await rig.releaser.drain()
    assert rig.released() == [("prefill", "p-token-r1")]  # no D took P's blocks


async def test_a_slow_d_that_answers_its_probe_is_not_charged_one_that_fails_it_is(
    rig: Rig,
) -> None:
    engines = FakeEngines(
        {P1: [prefill_ok("r1")], P2: [prefill_ok("r1")],
         D1: [UpstreamTimeout("no first byte")], D2: [UpstreamTimeout("no first byte")]},
        unhealthy={D2},
    )  # fmt: skip
    turn = rig.turn("Hello there", "r1", engines, FakeClient())
    with pytest.raises(ProxyError) as raised:
        await turn.run()
    assert sorted(engines.probed) == [D1, D2]  # each timeout asked the engine's health at once
    # D1 still answers its probe: a slow answer is the request's timeout, not D1's failure.
    assert rig.fleet.decode.backends[D1].failures == 0
    assert rig.fleet.decode.backends[D2].failures == 1
    assert raised.value.status in (502, 504)


async def test_a_client_leaving_mid_stream_frees_ds_hold_and_ps_blocks(rig: Rig) -> None:
    stream = (
        sse({"choices": [{"text": "Ot", "finish_reason": None}]}),
        sse({"choices": [{"text": "ters", "finish_reason": None}]}),
        sse({"choices": [{"text": " swim", "finish_reason": None}]}),
    )
    engines = FakeEngines({P1: [prefill_ok("r1")], P2: [prefill_ok("r1")]})
    answer = FakeAnswer(200, chunks=stream)
    engines.script[D1] = [answer]
    engines.script[D2] = [answer]
    for backend in rig.fleet.decode.backends.values():
        backend.side_channel = ("10.0.0.2", 5700)  # D's hold can be found after a stream
    rig.releaser.finished["r1"] = d_params("r1")  # what D published when it stopped
    client = FakeClient(stream_out=FakeStream(leave_at=1))
    turn = rig.turn("Hello there", "r1", engines, client, stream=True)
    with pytest.raises(ConnectionResetError):
        await turn.run()
    assert len(client.stream_out.writes) == 1 and not client.stream_out.ended
    assert answer.closed  # the connection to D is dropped: D stops
    await rig.releaser.drain()
    # The answer was cut short: D's hold (looked up on its side channel) and P's blocks go.
    assert sorted(rig.released()) == [("decode", "d-token-r1"), ("prefill", "p-token-r1")]
    assert await _stored(rig) is None


async def test_an_unavailable_map_serves_without_reuse_and_asks_d_for_no_hold(
    rig_without_map: Rig,
) -> None:
    rig = rig_without_map
    body = {"choices": [{"text": "hi"}], "kv_transfer_params": {"remote_num_tokens": 0}}
    engines = FakeEngines(
        {P1: [prefill_ok("r1")], P2: [prefill_ok("r1")],
         D1: [FakeAnswer(200, json.dumps(body).encode())],
         D2: [FakeAnswer(200, json.dumps(body).encode())]}
    )  # fmt: skip
    client = FakeClient()
    turn = rig.turn("Hello there", "r1", engines, client)
    await turn.run()
    assert turn.report.reuse == "map_unavailable" and turn.report.hold is False
    d_body = next(body for url, body in engines.sent if url in (D1, D2))
    assert "hold_blocks" not in d_body["kv_transfer_params"]
    assert client.json_status == 200 and client.json_body == {"choices": [{"text": "hi"}]}
    await rig.releaser.drain()
    assert rig.released() == []


# -- a spilled turn that pulls a prefix pinned on a P ---------------------------------------------

SPILL_SYSTEM = "You pull what another engine caches. " * 16  # 592: a text prefix is 512
PIN_TOKENS = list(range(3000, 3096))  # the prefix as P2's events report it: 6 blocks of 16


class FakeTokenizer(Upstream):
    """The fleet's engine client where only `/tokenize` is asked (by `TurnCrew.with_tokens`):
    the system prompt's tokens, then the rest of the prompt's."""

    async def post_json(
        self, base_url: str, path: str, body: bytes, *, timeout_s: float, max_bytes: int = 0
    ) -> tuple[int, bytes]:
        assert path == "/tokenize", path
        return 200, json.dumps({"tokens": PIN_TOKENS + [7] * 24, "count": 120}).encode()


def pin_params() -> dict[str, Any]:
    """P2's answer to the pin: its cached prefix's blocks, held for a reader."""
    return {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p2-engine",
        "remote_request_id": "pin", "remote_host": "10.0.0.3", "remote_port": 5800,
        "remote_block_ids": [[20, 21, 22, 23, 24, 25]], "remote_num_tokens": 96,
        "remote_block_hashes": ["0123456789abcdef"] * 6, "release_token": "pin-token",
    }  # fmt: skip


def _events_fleet(
    upstream: Upstream, p_work: int = 0, **settings: Any
) -> tuple[Fleet, FakeReleaser, MemoryMap]:
    """Two P (P2's KV events followed) and two D under `conditional`, each P with `p_work`
    queued; `upstream` is the fleet's engine client (it answers `/tokenize`)."""
    config = Settings(
        _env_file=None, prefill=[P1, P2], decode=[D1, D2], retries=1,
        routing_policy="conditional", kv_events_endpoints=f'{{"{P2}": "tcp://127.0.0.1:1"}}',
        prefix_pull_min_tokens=64, **settings,
    )  # fmt: skip
    prefill = Pool("prefill", eject_after=3, readmit_after=1)
    decode = Pool("decode", eject_after=3, readmit_after=1)
    for url in (P1, P2):
        prefill.add(url).outstanding_work = p_work
    for url in (D1, D2):
        decode.add(url)
    releaser, kvmap = FakeReleaser(), MemoryMap()
    return Fleet(config, prefill, decode, kvmap, upstream, releaser), releaser, kvmap


async def _spill_rig() -> tuple[Fleet, FakeReleaser, MemoryMap]:
    """Both Ps backed up, P2's events showing the system prompt's blocks: a turn spills to a D,
    which is to pull the prefix pinned on P2."""
    fleet, releaser, kvmap = _events_fleet(
        FakeTokenizer(connect_timeout=1.0), p_work=100_000, prefill_step_tokens=16
    )
    assert fleet.router.blocks is not None
    fleet.router.blocks.stored(P2, list(range(6)), None, PIN_TOKENS, 16, [None] * 6)
    return fleet, releaser, kvmap


def _spill_turn(fleet: Fleet, engines: FakeEngines, client: FakeClient) -> Turn:
    request = {"model": "m", "prompt": SPILL_SYSTEM + "Which engine pulls?", "max_tokens": 8}
    ctx = TurnContext.of(
        route="completions", body=request, request_id="r1", tenant=TENANT,
        shape=completion_shape(request),
    )  # fmt: skip
    return Turn(TurnCrew.of(fleet, engines), client, ctx)


async def test_a_spilled_turn_has_its_d_read_the_prefix_pinned_on_a_p() -> None:
    fleet, releaser, kvmap = await _spill_rig()
    pin = FakeAnswer(200, json.dumps({"kv_transfer_params": pin_params()}).encode())
    engines = FakeEngines({P2: [pin], D1: [decode_ok("r1")], D2: [decode_ok("r1")]})
    client = FakeClient()
    turn = _spill_turn(fleet, engines, client)
    try:
        await turn.run()
        assert turn.routing == "spilled" and client.json_status == 200
        assert engines.bodies(P1) == []  # no P leg
        (pinned,) = engines.bodies(P2)
        assert pinned["prompt"] == PIN_TOKENS and pinned["max_tokens"] == 1
        d_body = next(b for u, b in engines.sent if u in (D1, D2))
        sent = d_body["kv_transfer_params"]
        assert sent["do_remote_prefill"] is True and sent["remote_url"] == P2
        assert sent["release_token"] == "pin-token" and sent["remote_block_ids"] == [
            [20, 21, 22, 23, 24, 25]
        ]
        # D's answer is complete: its connector read (or released) the pin, not the proxy.
        await releaser.drain()
        assert [ref.release_token for _, ref in releaser.released if ref] == []
    finally:
        await releaser.drain()
        await kvmap.close()


async def test_a_spilled_turn_no_d_serves_gives_the_pinned_prefix_back() -> None:
    fleet, releaser, kvmap = await _spill_rig()
    pin = FakeAnswer(200, json.dumps({"kv_transfer_params": pin_params()}).encode())
    engines = FakeEngines(
        {P2: [pin], D1: [FakeAnswer(503, b"busy")], D2: [FakeAnswer(503, b"busy")]}
    )
    turn = _spill_turn(fleet, engines, FakeClient())
    try:
        with pytest.raises(ProxyError):
            await turn.run()
        assert len(engines.bodies(P2)) == 1
        await releaser.drain()
        assert [(holder, ref.release_token) for holder, ref in releaser.released if ref] == [
            ("prefill", "pin-token")
        ]
    finally:
        await releaser.drain()
        await kvmap.close()


async def test_a_hold_given_back_counts_as_released_only_when_d_freed_it(rig: Rig) -> None:
    """`give_back` (holds counted unused) deletes their entries and frees their blocks on D. A
    hold D had already ended (its hold budget, block pressure: D counts that one) frees
    nothing there and is not counted as given back, so no unused hold is counted twice."""
    rig.releaser.already_free = {"d-token-ended"}
    keys = [ConversationKey(TENANT, "kept"), ConversationKey(TENANT, "ended")]
    for key in keys:
        params = d_params(key.conversation_id)
        entry = KVEntry.from_kv_transfer_params(params, url=D1, fingerprint="m:1:abc")
        await rig.kvmap.put(key, entry, 600)
    released = {"decision": "released"}
    before = REGISTRY.get_sample_value("kvrelay_hold_decisions_total", released) or 0.0
    TurnCrew.of(rig.fleet, FakeEngines({})).give_back(keys)
    await rig.releaser.drain()
    assert sorted(token for _, token in rig.released()) == ["d-token-ended", "d-token-kept"]
    assert [await rig.kvmap.take(key) for key in keys] == [None, None]
    after = REGISTRY.get_sample_value("kvrelay_hold_decisions_total", released) or 0.0
    assert after == before + 1


async def test_a_hold_d_declined_stores_no_entry_and_releases_nothing(rig: Rig) -> None:
    """D's connector keeps no hold for a turn alone over its `hold_max_fraction` and says so
    (`hold_declined`, with its reuse report): the map gets no entry pointing at blocks D freed,
    nothing is released, and the decline is counted."""
    declined = {"hold_declined": True, "kvr_prompt_tokens": 40, "kvr_local_hit_tokens": 0}
    body = {"choices": [{"text": "answer"}], "kv_transfer_params": declined}
    engines = FakeEngines(
        {P1: [prefill_ok("r1")], D1: [FakeAnswer(200, json.dumps(body).encode())]}
    )
    over_budget = {"decision": "over_budget"}
    before = REGISTRY.get_sample_value("kvrelay_hold_decisions_total", over_budget) or 0.0
    client = FakeClient()
    await rig.turn("A long document to summarise.", "r1", engines, client).run()
    assert client.json_status == 200
    assert engines.bodies(D1)[0]["kv_transfer_params"]["hold_blocks"] is True
    assert await _stored(rig) is None
    await rig.releaser.drain()
    assert rig.released() == [], "D freed its blocks itself; P's were read by D"
    after = REGISTRY.get_sample_value("kvrelay_hold_decisions_total", over_budget) or 0.0
    assert after == before + 1


class HeldTokenizer(FakeTokenizer):
    """`FakeTokenizer` whose answers wait for `go`: a turn held while it is tokenized."""

    def __init__(self) -> None:
        super().__init__(connect_timeout=1.0)
        self.asked = asyncio.Event()
        self.go = asyncio.Event()

    async def post_json(
        self, base_url: str, path: str, body: bytes, *, timeout_s: float, max_bytes: int = 0
    ) -> tuple[int, bytes]:
        self.asked.set()
        await self.go.wait()
        return await super().post_json(
            base_url, path, body, timeout_s=timeout_s, max_bytes=max_bytes
        )


async def test_a_turn_leads_its_prompt_while_it_is_tokenized() -> None:
    """With `prefix_wait_max_s` a turn leads the prefixes no engine is known to cache as soon as
    it knows its prompt: a turn sharing them that comes while the first is still being
    tokenized (and planned) finds it computing them, instead of being planned beside it."""
    shared = "Every request of this burst shares this document. " * 24  # 1200 characters
    tokenizer = HeldTokenizer()
    fleet, releaser, kvmap = _events_fleet(tokenizer, prefix_wait_max_s=5)
    engines = FakeEngines({P1: [prefill_ok("r1")], P2: [prefill_ok("r1")], D1: [decode_ok("r1")]})
    request = {"model": "m", "prompt": shared + "Who computes it?", "max_tokens": 8}
    ctx = TurnContext.of(
        route="completions", body=request, request_id="r1", tenant=TENANT,
        shape=completion_shape(request),
    )  # fmt: skip
    first = asyncio.create_task(Turn(TurnCrew.of(fleet, engines), FakeClient(), ctx).run())
    try:
        await asyncio.wait_for(tokenizer.asked.wait(), 5)
        second = {"model": "m", "prompt": shared + "Who waits?", "max_tokens": 8}
        follower = completion_shape(second).prefixes("", second)
        assert follower is not None
        assert fleet.router.in_flight.leader_of(follower) is not None
        tokenizer.go.set()
        await asyncio.wait_for(first, 5)
        assert fleet.router.in_flight.leader_of(follower) is None  # the turn is over
    finally:
        tokenizer.go.set()
        await releaser.drain()
        await kvmap.close()


async def test_a_hold_the_next_turn_took_but_no_engine_read_counts_unused(rig: Rig) -> None:
    """The payoff of holds (`hold_min_use`) learns from what the engines read, not from the
    map's take: a next turn whose P loaded none of the held history (the read failed: its blocks
    were gone) counts the hold unused (`decision="unread"`), one whose P loaded it read."""

    def count(decision: str) -> float:
        labels = {"decision": decision}
        return REGISTRY.get_sample_value("kvrelay_hold_decisions_total", labels) or 0.0

    def reads(result: str) -> float:
        labels = {"result": result}
        return REGISTRY.get_sample_value("kvrelay_held_reads_total", labels) or 0.0

    engines = FakeEngines({P1: [prefill_ok("r1")], D1: [decode_ok("r1")]})
    await rig.turn("Hello there", "r1", engines, FakeClient()).run()
    read, unread = count("read"), count("unread")
    found, gone = reads("found"), reads("gone")
    refused = {"kvr_prompt_tokens": 40, "kvr_local_hit_tokens": 0, "kvr_loaded_tokens": 0,
               "kvr_refused_blocks": {"failed": 3}}  # fmt: skip
    engines = FakeEngines({P1: [_with_usage(prefill_ok("r2"), 0, **refused)],
                           D1: [decode_ok("r2")]})  # fmt: skip
    client = FakeClient()
    await rig.turn("Hello there answer. And then?", "r2", engines, client).run()
    assert client.json_status == 200
    assert engines.bodies(P1)[0]["kv_transfer_params"]["remote_request_id"] == "r1"  # taken
    assert (count("read"), count("unread")) == (read, unread + 1)
    # P's report says the read failed: D1's hold was gone (`HeldReads`, a spill's weighing).
    assert (reads("found"), reads("gone")) == (found, gone + 1)
    loaded = {"kvr_prompt_tokens": 40, "kvr_local_hit_tokens": 0, "kvr_loaded_tokens": 32}
    engines = FakeEngines({P1: [_with_usage(prefill_ok("r3"), 32, **loaded)],
                           D1: [decode_ok("r3")]})  # fmt: skip
    await rig.turn("Hello there answer. And then? answer. More?", "r3", engines, client).run()
    assert engines.bodies(P1)[0]["kv_transfer_params"]["remote_request_id"] == "r2"
    assert (count("read"), count("unread")) == (read + 1, unread + 1)
    assert (reads("found"), reads("gone")) == (found + 1, gone + 1)


async def test_a_hold_read_sooner_than_its_holders_cache_keeps_a_block_counts_unused(
    rig: Rig,
) -> None:
    """D1's residency histogram says its cache keeps an unused block about 30 s lately; the
    next turn takes the hold within a second and P loads it: read, but D's cache would have
    kept the history unheld, so the hold counts unused (`decision="cache_kept"`). Without the
    histogram the same read counts as a read."""

    def count(decision: str) -> float:
        labels = {"decision": decision}
        return REGISTRY.get_sample_value("kvrelay_hold_decisions_total", labels) or 0.0

    loaded = {"kvr_prompt_tokens": 40, "kvr_local_hit_tokens": 0, "kvr_loaded_tokens": 32}
    holder = rig.fleet.router.decode.get(D1)
    assert holder is not None
    for residence, decision in (
        (CacheResidence((1.0, 60.0, float("inf")), (0.0, 20.0, 20.0), (0.0, 20.0, 0.0)),
         "cache_kept"),
        (None, "read"),
    ):  # fmt: skip
        holder.load = EngineLoad(
            running=0.0, waiting=0.0, kv_usage=0.1, at=time.monotonic(), residence=residence
        )
        assert rig.fleet.router.cache_keeps_s(D1) == (30.5 if residence else None)
        engines = FakeEngines({P1: [prefill_ok("r1")], D1: [decode_ok("r1")]})
        await rig.turn("Hello there", "r1", engines, FakeClient()).run()
        before = count(decision)
        engines = FakeEngines({P1: [_with_usage(prefill_ok("r2"), 32, **loaded)],
                               D1: [decode_ok("r2")]})  # fmt: skip
        await rig.turn("Hello there answer. And then?", "r2", engines, FakeClient()).run()
        assert engines.bodies(P1)[0]["kv_transfer_params"]["remote_request_id"] == "r1"
        assert count(decision) == before + 1
        await _stored(rig)  # the next round starts a new conversation


@pytest.mark.parametrize("events", [True, False])
async def test_a_conversation_back_sooner_than_its_ds_cache_keeps_a_block_stops_holding(
    events: bool,
) -> None:
    """D's cache keeps an unused block about 30 s lately, and the proxy follows D's cache by the
    engines' KV events (`conditional`, `decode_only_cached`). The first turn holds (nothing is
    known of the conversation); the second comes back within a second, so it asks D for no hold
    and stores no entry (`decision="cache_keeps"`); the third finds no entry, but its
    conversation's last turn ended unheld a moment ago on a D whose cache keeps the history: no
    hold again. Once D's figure is unknown (no histogram), the next turn holds. Without the
    events an unheld history could not be found in D's cache: every turn holds."""
    events_port = {"kv_events_port": 5557} if events else {}
    config = Settings(
        _env_file=None, prefill=[P1], decode=[D1], retries=1, routing_policy="conditional",
        **events_port,
    )  # fmt: skip
    prefill = Pool("prefill", eject_after=3, readmit_after=1)
    decode = Pool("decode", eject_after=3, readmit_after=1)
    prefill.add(P1)
    holder = decode.add(D1)
    releaser, kvmap = FakeReleaser(), MemoryMap()
    # The fleet's engine client answers only `/tokenize` (the events' token lookup).
    fleet = Fleet(config, prefill, decode, kvmap, FakeTokenizer(connect_timeout=1.0), releaser)
    rig = Rig(fleet, releaser, kvmap)
    assert fleet.router.finds_unheld_history is events

    def count(decision: str) -> float:
        labels = {"decision": decision}
        return REGISTRY.get_sample_value("kvrelay_hold_decisions_total", labels) or 0.0

    def keeps(residence: CacheResidence | None) -> None:
        holder.load = EngineLoad(
            running=0.0, waiting=0.0, kv_usage=0.1, at=time.monotonic(), residence=residence
        )

    try:
        keeps(CacheResidence((1.0, 60.0, float("inf")), (0.0, 20.0, 20.0), (0.0, 20.0, 0.0)))
        assert fleet.router.cache_keeps_s(D1) == 30.5
        prompt, held = "Hello there", []
        for i in range(4):
            if i == 3:
                keeps(None)
            before = count("cache_keeps")
            engines = FakeEngines({P1: [prefill_ok(f"r{i}")], D1: [decode_ok(f"r{i}")]})
            await rig.turn(prompt, f"r{i}", engines, FakeClient()).run()
            sent = engines.bodies(D1)[0].get("kv_transfer_params") or {}
            held.append(sent.get("hold_blocks") is True)
            assert count("cache_keeps") == before + (1 if events and i in (1, 2) else 0)
            stored = await _stored(rig)
            assert (stored is not None) == held[-1]
            if stored is not None:
                await kvmap.put(ConversationKey(TENANT, "conv-1"), stored, 600)  # put back
            prompt += f" answer. And then {i}?"
        assert held == ([True, False, False, True] if events else [True] * 4)
    finally:
        await releaser.drain()
        await kvmap.close()


async def test_a_retry_that_lands_on_the_holder_is_not_sent_its_own_blocks() -> None:
    """A turn spills past its busy holder D1 to D2, which is to read the held history from D1.
    D2 refuses, and the retry's only D is the holder itself: it is sent no params naming its
    own blocks (it serves the history from its cache), and the proxy frees the old hold, which
    no connector read."""
    config = Settings(
        _env_file=None, prefill=[P1], decode=[D1, D2], retries=1, routing_policy="conditional",
        prefix_pull_min_tokens=16,
    )  # fmt: skip
    prefill = Pool("prefill", eject_after=3, readmit_after=1)
    decode = Pool("decode", eject_after=3, readmit_after=1)
    prefill.add(P1)
    holder, other = decode.add(D1), decode.add(D2)
    releaser, kvmap = FakeReleaser(), MemoryMap()
    # The fleet's engine client answers only `/tokenize`: the D's count of the spilled turn.
    fleet = Fleet(config, prefill, decode, kvmap, FakeTokenizer(connect_timeout=1.0), releaser)
    rig = Rig(fleet, releaser, kvmap)
    first = "You are terse. Tell me about otters."
    try:
        engines = FakeEngines({P1: [prefill_ok("r1")], D1: [decode_ok("r1", "Otters swim.")]})
        await rig.turn(first, "r1", engines, FakeClient()).run()
        # P is backed up and D1 busy: the next turn spills to D2, which reads D1's hold.
        prefill.backends[P1].outstanding_work = 1_000_000
        holder.load = EngineLoad(running=1.0, waiting=50.0, kv_usage=0.1, at=time.monotonic())
        engines = FakeEngines({D2: [FakeAnswer(503, b"overloaded")], D1: [decode_ok("r2")]})
        client = FakeClient()
        turn = rig.turn(first + " Otters swim. And beavers?", "r2", engines, client)
        await turn.run()
        assert turn.routing == "spilled" and client.json_status == 200
        (to_other,) = engines.bodies(D2)
        assert to_other["kv_transfer_params"]["remote_url"] == D1
        assert to_other["kv_transfer_params"]["release_token"] == "d-token-r1"
        (to_holder,) = engines.bodies(D1)
        sent = to_holder["kv_transfer_params"]
        assert "do_remote_prefill" not in sent and "release_token" not in sent
        assert sent["hold_blocks"] is True
        await releaser.drain()
        assert rig.released() == [("decode", "d-token-r1")]  # freed by the proxy, once
        stored = await _stored(rig)
        assert stored is not None and stored.url == D1 and stored.release_token == "d-token-r2"
        assert other.failures == 1
    finally:
        await releaser.drain()
        await kvmap.close()
