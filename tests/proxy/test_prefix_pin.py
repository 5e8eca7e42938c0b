"""`PrefixPin`: the request that has a prefix's holder keep it for another P, its answer read,
and what happens to a hold that answers late or not at all (fake engines, a fake releaser)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from prometheus_client import REGISTRY

from kvrelay.connector.protocol import HoldRef
from kvrelay.proxy.config import Settings
from kvrelay.proxy.engines import Releaser, Upstream, UpstreamConnectError
from kvrelay.proxy.fleet import Backend, Pool, PrefixSource, Router
from kvrelay.proxy.turn import TurnContext, chat_shape
from kvrelay.proxy.turn.prefix_pin import PrefixPin, pin_body

HOLDER = "http://p1.test:8100"
PARAMS = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p1-engine",
    "remote_request_id": "r1-pin", "remote_host": "10.0.0.1", "remote_port": 5600,
    "remote_block_ids": [[3, 4, 5]], "remote_block_hashes": ["0123456789abcdef"] * 3,
    "release_token": "pin-token",
}  # fmt: skip


class Answer:
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status = status
        self._raw = json.dumps(body).encode()

    async def read(self) -> bytes:
        return self._raw

    def release(self) -> None:
        pass


class Engines:
    """The holder: answers each pin once `go` is set (at once when it starts set)."""

    def __init__(self, answer: Answer | Exception, go: bool = True) -> None:
        self.answer = answer
        self.go = asyncio.Event()
        if go:
            self.go.set()
        self.sent: list[tuple[str, str, dict[str, Any], dict[str, str]]] = []
        self.asked = asyncio.Event()

    async def post(
        self, url: str, path: str, payload: bytes, headers: tuple[tuple[str, str], ...]
    ) -> Any:
        self.sent.append((url, path, json.loads(payload), dict(headers)))
        self.asked.set()
        await self.go.wait()
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    async def probe(self, url: str) -> tuple[bool, str]:
        return True, ""


class Released(Releaser):
    def __init__(self) -> None:
        super().__init__(None, Upstream(connect_timeout=1.0), 1.0)
        self.tokens: list[str | None] = []
        self.any = asyncio.Event()

    async def release(self, holder: str, ref: HoldRef | None) -> bool:
        self.tokens.append(ref.release_token if ref else None)
        self.any.set()
        return True


def _ctx(**body: Any) -> TurnContext:
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    return TurnContext.of(
        route="chat", body=request, request_id="r1", tenant="t", shape=chat_shape(request)
    )


def _pin(
    engines: Engines, released: Released, timeout_s: float = 5.0, leg: str = "prefill"
) -> tuple[PrefixPin, Router, Backend]:
    prefill = Pool("prefill", eject_after=2, readmit_after=2)
    holder = prefill.add(HOLDER)
    router = Router(Settings(_env_file=None), prefill, Pool("decode", 1, 1))
    pin = PrefixPin(_ctx(cache_salt="tenant-salt"), engines, router, released, -1, timeout_s, leg)
    return pin, router, holder


def test_the_pin_is_the_prefixs_tokens_under_the_turns_model_and_salt() -> None:
    body = pin_body(_ctx(cache_salt="s"), [5, 6, 7], -1)
    assert body == {
        "model": "m", "prompt": [5, 6, 7], "max_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        "cache_salt": "s", "priority": -1,
    }  # fmt: skip
    plain = pin_body(_ctx(), [5], 0)
    assert "priority" not in plain and "cache_salt" not in plain


def _pulls(leg: str, result: str) -> float:
    """`kvrelay_prefix_pulls_total` of this process (0 before the first)."""
    labels = {"leg": leg, "result": result}
    return REGISTRY.get_sample_value("kvrelay_prefix_pulls_total", labels) or 0.0


async def test_a_pin_answered_in_time_gives_the_holders_params() -> None:
    engines, released = Engines(Answer(200, {"kv_transfer_params": PARAMS})), Released()
    # A spilled turn's pin: counted as the decode leg's.
    pin, router, holder = _pin(engines, released, leg="decode")
    router.pin_rests.late(HOLDER)
    router.pin_rests.late(HOLDER)  # two late pins in a row before this one
    before = _pulls("decode", "pinned"), _pulls("prefill", "pinned")
    params = await pin.pin(PrefixSource(holder, 3), list(range(100)))
    assert params is not None and params.release_token == "pin-token"
    assert router.pin_rests.late(HOLDER) == 2.0  # on time: its next late pin starts anew
    assert (_pulls("decode", "pinned"), _pulls("prefill", "pinned")) == (before[0] + 1, before[1])
    url, path, body, headers = engines.sent[0]
    assert (url, path, body["prompt"]) == (HOLDER, "/v1/completions", [0, 1, 2])
    assert headers["X-Request-Id"] == "r1-pin"
    await released.drain()
    assert released.tokens == []  # the turn owes it now, not the pin


@pytest.mark.parametrize(
    "answer",
    [
        Answer(503, {"error": "busy"}),
        Answer(200, {"choices": []}),  # no params: the engine holds nothing
        UpstreamConnectError("refused"),
    ],
)
async def test_a_pin_that_holds_nothing_gives_none(answer: Answer | Exception) -> None:
    released = Released()
    pin, _, holder = _pin(Engines(answer), released)
    failed = _pulls("prefill", "pin_failed")
    assert await pin.pin(PrefixSource(holder, 3), [1, 2, 3]) is None
    assert _pulls("prefill", "pin_failed") == failed + 1
    await released.drain()
    assert released.tokens == []


async def test_a_late_pin_is_given_up_released_when_it_answers_and_its_holder_rested() -> None:
    engines, released = Engines(Answer(200, {"kv_transfer_params": PARAMS}), go=False), Released()
    pin, router, holder = _pin(engines, released, timeout_s=0.05)
    assert await pin.pin(PrefixSource(holder, 3), [1, 2, 3]) is None
    assert not router.serves_pulls(HOLDER)  # no pulls from it for a while
    assert router.pin_rests.late(HOLDER) == 4.0  # its second late pin in a row: twice the 2 s
    engines.go.set()  # it answers after all: nobody will read it, so it is released
    await asyncio.wait_for(released.any.wait(), 5)  # spawned when the late answer is read
    await released.drain()
    assert released.tokens == ["pin-token"]


async def test_a_pin_whose_turn_ends_while_waiting_is_released_when_it_answers() -> None:
    engines, released = Engines(Answer(200, {"kv_transfer_params": PARAMS}), go=False), Released()
    pin, _, holder = _pin(engines, released)
    waiting = asyncio.ensure_future(pin.pin(PrefixSource(holder, 3), [1, 2, 3]))
    await asyncio.wait_for(engines.asked.wait(), 5)  # the pin is on its way to the holder
    waiting.cancel()  # the client left
    with pytest.raises(asyncio.CancelledError):
        await waiting
    engines.go.set()  # the holder answers after all: nobody will read it, so it is released
    await asyncio.wait_for(released.any.wait(), 5)
    await released.drain()
    assert released.tokens == ["pin-token"]
