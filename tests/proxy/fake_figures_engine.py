"""FakeFiguresEngine: a stand-in engine whose reuse figures the test chooses, absurd ones too.

Named fake on purpose: enginesim and vLLM only report figures they computed, and a test of what
the proxy does with an engine that lies (a count past a float's range, a negative one, more
reused than the prompt has) needs an engine that says whatever it is told. It plays P or D for
`/v1/chat/completions` as vLLM with kvrelay's connector answers:

- P (`do_remote_decode` in the request): JSON, one token, `kv_transfer_params` with
  `prefill_params` merged in, `usage` merged with `prefill_usage`;
- D: JSON with `decode_usage` merged into its usage, or a stream of two content events, a final
  usage event (when asked `stream_options.include_usage`) carrying `decode_usage` and
  `kv_transfer_params` with `decode_params`, then `data: [DONE]`.

`GET /health`, `/v1/models` and an empty `/metrics` answer the proxy's probes.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from kvrelay.devtools import ThreadedApp
from tests.harness import free_port

MODEL = "kvrelay-sim"
PROMPT_TOKENS = 20


class FakeFiguresEngine:
    """An aiohttp server on a background thread (`ThreadedApp`), figures set per test."""

    def __init__(self) -> None:
        self.port = free_port()
        self.prefill_params: dict[str, Any] = {}
        self.prefill_usage: dict[str, Any] = {}
        self.decode_params: dict[str, Any] = {}
        self.decode_usage: dict[str, Any] = {}
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._server = ThreadedApp(app, self.port, "fake-figures")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeFiguresEngine:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="", content_type="text/plain")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        params = body.get("kv_transfer_params") or {}
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1,
                 "total_tokens": PROMPT_TOKENS + 1}  # fmt: skip
        if params.get("do_remote_decode"):
            own = {"do_remote_prefill": True, "do_remote_decode": False,
                   "remote_engine_id": "fake-p", "remote_request_id": "r1",
                   "remote_host": "127.0.0.1", "remote_port": 1, "remote_block_ids": [[1, 2]],
                   "remote_num_tokens": PROMPT_TOKENS}  # fmt: skip
            return _raw_json({
                "id": "p", "object": "chat.completion", "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"},
                             "finish_reason": "length"}],
                "usage": {**usage, **self.prefill_usage},
                "kv_transfer_params": {**own, **self.prefill_params},
            })  # fmt: skip
        usage = {**usage, "completion_tokens": 2, **self.decode_usage}
        if not body.get("stream"):
            return _raw_json({
                "id": "d", "object": "chat.completion", "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                             "finish_reason": "stop"}],
                "usage": usage, "kv_transfer_params": self.decode_params or None,
            })  # fmt: skip
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for text, finish in (("o", None), ("k", "stop")):
            chunk = {"id": "d", "object": "chat.completion.chunk", "model": MODEL,
                     "choices": [{"index": 0, "delta": {"content": text},
                                  "finish_reason": finish}]}  # fmt: skip
            await out.write(_event(chunk))
        if (body.get("stream_options") or {}).get("include_usage"):
            final = {"id": "d", "object": "chat.completion.chunk", "model": MODEL,
                     "choices": [], "usage": usage}  # fmt: skip
            if self.decode_params:
                final["kv_transfer_params"] = self.decode_params
            await out.write(_event(final))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


def _raw_json(doc: dict[str, Any]) -> web.Response:
    # `json` writes integers of any size, as an engine's JSON may carry them.
    return web.Response(body=json.dumps(doc).encode(), content_type="application/json")


def _event(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"
