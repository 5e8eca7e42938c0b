"""FakeStockEngine: a stand-in for a *stock* vLLM NixlConnector engine's kv_transfer_params.

Named fake on purpose. enginesim always speaks kvrelay's connector extras (block hashes,
release tokens); stock vLLM returns params without them. This fake returns exactly that shape
and records what the proxy sent, so the tests can check the proxy's degraded mode (no reuse by
default, capped reuse when opted in). The real stock-vLLM path is tested in `tests/vllm/`.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from aiohttp import web

from kvrelay.devtools import ThreadedApp
from tests.harness import free_port


class FakeStockEngine:
    """Serves `/health` and `/v1/completions` on a background thread's event loop."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.port = free_port()
        self.requests: list[dict[str, Any]] = []
        self._ids = itertools.count()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._completions)
        self._server = ThreadedApp(app, self.port, f"fake-stock-{engine_id}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        params = body.get("kv_transfer_params") or {}
        prompt_tokens = len(str(body.get("prompt", "")).split())
        own = {
            "remote_engine_id": self.engine_id,
            "remote_request_id": f"{self.engine_id}-{next(self._ids)}",
            "remote_host": "127.0.0.1",
            "remote_port": 1,  # never contacted: stock params carry no release token
            "tp_size": 1,
            "remote_blocks_expiry_time": time.time() + 480,
        }
        if params.get("do_remote_decode"):
            out = {**own, "do_remote_prefill": True, "do_remote_decode": False,
                   "remote_block_ids": [[1, 2]], "remote_num_tokens": prompt_tokens}  # fmt: skip
            text, completion = "x", 1
        else:
            completion = 3
            out = {**own, "do_remote_decode": True, "do_remote_prefill": False,
                   "remote_block_ids": [[5, 6, 7]],
                   "remote_num_tokens": prompt_tokens + completion}  # fmt: skip
            text = " a b c"
        return web.json_response(
            {
                "id": "cmpl-fake",
                "object": "text_completion",
                "model": "fake",
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion,
                },
                "kv_transfer_params": out,
            }
        )

    def start(self) -> FakeStockEngine:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()
