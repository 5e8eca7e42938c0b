"""Zero-work fake vLLM engine for proxy-bound benchmarks: `python -m bench.fake_engine`.

A fake, and named so: it does no model work at all, so that in front of it a router's own cost
is all that limits throughput. On the wire it answers like vLLM 0.32 with kvrelay's connector:

- prefill (`--role prefill`): one token and `kv_transfer_params` carrying the connector's fields
  (engine id, request id, side-channel host/port, block ids, block hashes, lease expiry,
  release token), as P returns them for `do_remote_decode`;
- decode (`--role decode`): JSON with `max_tokens` tokens, or that many SSE chunks then
  `data: [DONE]`. Stock vLLM streams carry no params, so a streamed request that asked D to
  hold (`hold_blocks`) publishes its params on the side channel instead, under the request's
  `X-Request-Id`, as kvrelay's connector does; a JSON answer carries them in the body (and
  `kv_transfer_params: null` when nobody asked to hold, like stock D);
- `POST /tokenize`: the prompt's token count by the same stand-in rule (no token ids), as
  kvrelay asks D before a decode-only or spilled turn;
- a side channel on its own port: `GET /v1/finished/{id}`, `POST /v1/finished` (several ids,
  no wait) and `POST /v1/release`, each request
  checked and each answer signed with `kvrelay.connector.auth` (the helpers of whichever
  protocol version the checkout has), so the proxy's side-channel client does its real work.
  No handshake or claim endpoints: nothing reads KV from a fake.

Both servers are aiohttp's low-level server (no router, no middlewares) on uvloop, with orjson,
so the fake costs as little CPU per request as Python allows. `GET /health`, `/metrics` and
`/v1/models` answer what vllm-router and kvrelay probe at start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import signal
import time
from collections import OrderedDict
from typing import Any

import orjson
from aiohttp import web, web_server
from aiohttp.web_request import BaseRequest

from kvrelay.connector import auth, protocol

BLOCK_SIZE = 16
# Bounded like the connector's own tables: a fake must not grow for the length of a run.
MAX_PUBLISHED = 65536
LEASE_S = 300.0
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
_JSON = "application/json"


class FakeSideChannel:
    """Checks a side-channel request and signs its answer with `kvrelay.connector.auth`, as
    a holder does: the fake re-implements none of the scheme."""

    def __init__(self, secret: bytes, host: str, port: int) -> None:
        self.secret = secret
        dest = auth.destination(host, port)
        self._destinations = frozenset({dest, dest.replace("127.0.0.1", "localhost")})

    def authentic(self, request: BaseRequest, body: bytes) -> bool:
        failure = auth.verify(
            self.secret, request.headers, request.method, request.raw_path, body,
            destinations=self._destinations,
        )  # fmt: skip
        return failure is None

    def answer(self, request: BaseRequest, status: int, body: bytes) -> web.Response:
        nonce = request.headers.get(protocol.HEADER_NONCE, "")
        signature = auth.response_signature(self.secret, nonce, status, body)
        headers = {protocol.HEADER_SIGNATURE: signature}
        return web.Response(status=status, body=body, content_type=_JSON, headers=headers)


class FakeEngine:
    """One fake engine: its OpenAI-style server and its side channel."""

    def __init__(self, role: str, engine_id: str, host: str, side_port: int, secret: bytes) -> None:
        self.role = role
        self.engine_id = engine_id
        self.host = host
        self.side_port = side_port
        self.side = FakeSideChannel(secret, host, side_port)
        self._ids = itertools.count()
        self._published: OrderedDict[str, bytes] = OrderedDict()
        self._holds: OrderedDict[str, str] = OrderedDict()
        self.requests = 0

    # --- the OpenAI-style server --------------------------------------------------------------
    async def handle(self, request: BaseRequest) -> web.StreamResponse:
        path = request.path
        if request.method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            body = orjson.loads(await request.read())
            self.requests += 1
            chat = path == "/v1/chat/completions"
            if self.role == "prefill":
                return self._prefill(body, chat)
            return await self._decode(request, body, chat)
        if request.method == "POST" and path == "/tokenize":
            # vLLM's answer, counted by the same stand-in rule the completions use.
            body = orjson.loads(await request.read())
            count = _prompt_tokens(body, "messages" in body)
            answer = {"count": count, "max_model_len": 131072, "tokens": []}
            return web.Response(body=orjson.dumps(answer), content_type=_JSON)
        if path == "/health":
            return web.Response()
        if path == "/metrics":
            return web.Response(text=f"fake_engine_requests_total {self.requests}\n")
        if path == "/v1/models":
            data = [{"id": "fake", "object": "model", "owned_by": "kvrelay-bench"}]
            return web.Response(
                body=orjson.dumps({"object": "list", "data": data}), content_type=_JSON
            )
        return web.Response(status=404, body=b'{"error":"not found"}', content_type=_JSON)

    def _params(self, prompt_tokens: int) -> dict[str, Any]:
        """The connector's fields for a hold of `prompt_tokens` tokens on this engine."""
        n = next(self._ids)
        request_id = f"{self.engine_id}-{n}"
        blocks = -(-prompt_tokens // BLOCK_SIZE)
        token = f"tok-{n:x}"
        self._holds[request_id] = token
        if len(self._holds) > MAX_PUBLISHED:
            self._holds.popitem(last=False)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.host,
            "remote_port": self.side_port,
            "remote_block_ids": [list(range(n % 4096, n % 4096 + blocks))],
            "remote_num_tokens": prompt_tokens,
            "tp_size": 1,
            "remote_blocks_expiry_time": time.time() + LEASE_S,
            # One 16-hex-digit hash per full block, as the connector computes them.
            "remote_block_hashes": [
                f"{(n << 16 | i) & 0xFFFF_FFFF_FFFF_FFFF:016x}"
                for i in range(prompt_tokens // BLOCK_SIZE)
            ],
            "release_token": token,
        }

    def _prefill(self, body: dict[str, Any], chat: bool) -> web.Response:
        prompt_tokens = _prompt_tokens(body, chat)
        out = _completion(body, chat, 1, prompt_tokens)
        out["kv_transfer_params"] = self._params(prompt_tokens)
        return web.Response(body=orjson.dumps(out), content_type=_JSON)

    async def _decode(
        self, request: BaseRequest, body: dict[str, Any], chat: bool
    ) -> web.StreamResponse:
        tokens = int(body.get("max_tokens") or 16)
        prompt_tokens = _prompt_tokens(body, chat)
        kv = body.get("kv_transfer_params")
        hold = isinstance(kv, dict) and kv.get("hold_blocks") is True
        params = self._params(prompt_tokens + tokens - 1) if hold else None
        if not body.get("stream"):
            out = _completion(body, chat, tokens, prompt_tokens)
            out["kv_transfer_params"] = params
            return web.Response(body=orjson.dumps(out), content_type=_JSON)
        if params is not None:
            self._publish(request.headers.get("X-Request-Id", ""), params)
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        for event in _sse_events(body, chat, tokens):
            await resp.write(event)
        await resp.write_eof()
        return resp

    def _publish(self, client_request_id: str, params: dict[str, Any]) -> None:
        if not client_request_id:
            return
        self._published[client_request_id] = orjson.dumps(params)
        if len(self._published) > MAX_PUBLISHED:
            self._published.popitem(last=False)

    # --- the side channel -----------------------------------------------------------------------
    async def handle_side(self, request: BaseRequest) -> web.StreamResponse:
        body = await request.read()
        if not self.side.authentic(request, body):
            return web.Response(status=401, body=b'{"error":"unauthenticated"}', content_type=_JSON)
        path = request.path
        if request.method == "GET" and path.startswith(protocol.PATH_FINISHED_PREFIX):
            published = self._published.get(path[len(protocol.PATH_FINISHED_PREFIX) :])
            if published is None:
                return self.side.answer(request, 404, b'{"error":"unknown request id"}')
            return self.side.answer(request, 200, published)
        if request.method == "POST" and path == protocol.PATH_FINISHED_BATCH:
            ids = orjson.loads(body).get("request_ids") or []
            found = [
                orjson.dumps(rid) + b":" + self._published[rid]
                for rid in dict.fromkeys(ids)
                if isinstance(rid, str) and rid in self._published
            ]
            return self.side.answer(request, 200, b'{"finished":{' + b",".join(found) + b"}}")
        if request.method == "POST" and path == protocol.PATH_RELEASE:
            msg = orjson.loads(body)
            token = self._holds.get(str(msg.get("request_id")))
            if token is not None and token != msg.get("release_token"):
                return self.side.answer(request, 403, b'{"error":"wrong release token"}')
            released = self._holds.pop(str(msg.get("request_id")), None) is not None
            return self.side.answer(request, 200, orjson.dumps({"released": released}))
        return self.side.answer(request, 404, b'{"error":"not found"}')


def _prompt_tokens(body: dict[str, Any], chat: bool) -> int:
    """A cheap stand-in for tokenization: about one token per four characters."""
    if chat:
        chars = sum(len(str(m.get("content") or "")) for m in body.get("messages") or ())
    else:
        chars = len(str(body.get("prompt") or ""))
    return chars // 4 + 1


def _completion(
    body: dict[str, Any], chat: bool, tokens: int, prompt_tokens: int
) -> dict[str, Any]:
    """A vLLM-shaped non-streaming answer of `tokens` tokens."""
    text = " a" * tokens
    choice: dict[str, Any]
    if chat:
        choice = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": text,
                "reasoning_content": None,
                "tool_calls": [],
            },
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": None,
        }
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + os.urandom(8).hex(),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": body.get("model", "fake"),
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + tokens,
            "completion_tokens": tokens,
            "prompt_tokens_details": None,
        },
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def _sse_events(body: dict[str, Any], chat: bool, tokens: int) -> list[bytes]:
    """`tokens` vLLM-shaped SSE chunks (the last one finishes), then `[DONE]`."""
    rid = ("chatcmpl-" if chat else "cmpl-") + os.urandom(8).hex()
    head = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": body.get("model", "fake"),
    }
    events = []
    for i in range(tokens):
        finish = "length" if i == tokens - 1 else None
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": " a"},
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            choice = {
                "index": 0,
                "text": " a",
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
        events.append(b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


async def serve(args: argparse.Namespace) -> None:
    secret = auth.secret_from_env()
    if secret is None:
        raise SystemExit(f"{protocol.SECRET_ENV} must be set (the proxy signs with it)")
    engine = FakeEngine(args.role, args.engine_id, args.host, args.side_channel_port, secret)
    loop = asyncio.get_running_loop()
    main = await loop.create_server(
        web_server.Server(engine.handle, access_log=None), args.host, args.port, backlog=4096
    )
    side = await loop.create_server(
        web_server.Server(engine.handle_side, access_log=None),
        args.host,
        args.side_channel_port,
        backlog=4096,
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in (main, side):
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--side-channel-port", type=int, required=True)
    p.add_argument("--engine-id", required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args))
    else:
        uvloop.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
