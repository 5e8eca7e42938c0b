"""The aiohttp OpenAI-compatible front end of one simulated engine.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (SSE streams and plain JSON),
`GET /v1/models`, `GET /health`, `GET /version` (as vLLM answers it), `POST /tokenize`,
`/detokenize`, `/v1/embeddings`, `/v1/responses` (`kvrelay.enginesim.extras`), `GET /metrics`,
`GET|POST /admin/faults`, `POST /admin/corrupt_blocks` (tests). Validation and faults act before
admission; a refused request that carried `do_remote_prefill` params is reported to the
connector (`request_rejected`) so the holder frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kvrelay import __version__
from kvrelay.connector.protocol import DO_REMOTE_PREFILL, KV_TRANSFER_PARAMS
from kvrelay.enginesim import extras
from kvrelay.enginesim.engine import EngineCore
from kvrelay.enginesim.faults import Faults
from kvrelay.enginesim.mailbox import Mailbox
from kvrelay.enginesim.metrics import render_metrics
from kvrelay.enginesim.openai_api import (
    ApiError,
    ParsedRequest,
    kv_params_of,
    parse_chat,
    parse_completion,
)
from kvrelay.enginesim.request import Output, SamplingParams, SimRequest
from kvrelay.enginesim.runner import EngineRunner
from kvrelay.enginesim.tokenizer import Tokenizer
from kvrelay.enginesim.tokenizer_process import EncodingProcess

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024
Parser = Callable[..., ParsedRequest]


def _error(exc: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=headers)


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class EngineServer:
    """HTTP handlers around one `EngineRunner`."""

    def __init__(self, runner: EngineRunner) -> None:
        self.runner = runner
        self.core: EngineCore = runner.core
        self.config = runner.core.config
        self.faults = Faults()
        # What the HTTP side encodes prompts with: the engine's own tokenizer, or the same in a
        # child process (`tokenizer_process`; decoding stays on the engine's).
        self.tokenizer: Tokenizer = (
            EncodingProcess() if self.config.tokenizer_process else runner.core.tokenizer
        )
        self._ids = itertools.count()
        self._mailbox: Mailbox | None = None
        self._metrics = render_metrics(
            lambda: {**self.runner.snapshot, "extra_waiting": self.faults.extra_waiting},
            self.config.model,
        )
        self.app = web.Application(client_max_size=MAX_BODY_BYTES)
        self.app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/version", self.version),
                web.get("/metrics", self.metrics),
                web.get("/admin/faults", self.get_faults),
                web.post("/admin/faults", self.set_faults),
                web.post("/admin/corrupt_blocks", self.corrupt_blocks),
            ]
        )
        extras.add_routes(
            self.app,
            self.tokenizer,
            self.config.model,
            self.config.max_model_len,
            self.config.chat_template_first_line,
        )

    def close(self) -> None:
        """Stop what the server started beside the engine: the tokenizer's process, if any."""
        if isinstance(self.tokenizer, EncodingProcess):
            self.tokenizer.close()

    # ----- simple endpoints --------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if not self.runner.alive:
            return web.json_response({"status": "engine dead"}, status=503)
        return web.json_response({"status": "ok"})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": f"enginesim-{__version__}"})

    async def models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.config.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "enginesim",
            "root": self.config.model,
            "parent": None,
            "max_model_len": self.config.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics(), content_type="text/plain", charset="utf-8")

    async def get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(self.faults.as_dict())

    async def set_faults(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            was_dropped = self.faults.drop_nixl_agent
            self.faults.update(body)
        except ApiError as exc:
            return _error(exc)
        if self.faults.drop_nixl_agent and not was_dropped:
            self.runner.call(self.core.kv.drop_agent)
        return web.json_response(self.faults.as_dict())

    async def corrupt_blocks(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            ids = body.get("block_ids") if isinstance(body, dict) else None
            if not isinstance(ids, list) or not all(
                isinstance(b, int) and 0 <= b < self.config.num_blocks for b in ids
            ):
                raise ApiError(400, "block_ids must be a list of block ids", param="block_ids")
        except ApiError as exc:
            return _error(exc)
        done = asyncio.get_running_loop().create_future()

        def corrupt() -> None:
            for block in ids:
                self.core.pool.corrupt(block)
            done.get_loop().call_soon_threadsafe(done.set_result, None)

        self.runner.call(corrupt)
        await asyncio.wait_for(done, timeout=10)
        return web.json_response({"corrupted": ids})

    # ----- generation --------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        first_line = self.config.chat_template_first_line
        return await self._generate(
            request, functools.partial(parse_chat, first_line=first_line), chat=True
        )

    async def _json(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "request body is not valid JSON") from None
        except RecursionError:
            raise ApiError(400, "request body nests too deeply") from None

    def _sink(
        self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue[Output], stream: bool
    ) -> Callable[[Output], None]:
        """Deliver outputs to the handler's loop, a step's together (`Mailbox`); non-streaming
        requests only cross threads once, at the end (per-token hops cost the engine thread and
        the loop alike)."""
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = Mailbox(loop)
        post = self._mailbox.post
        pending: list[str] = []

        def deliver(out: Output) -> None:
            if not stream:
                pending.append(out.text)
                if not out.finished:
                    return
                out.text = "".join(pending)
            post(q.put_nowait, out)

        return deliver

    def _reject(self, client_id: str, body: Any, prompt_ids: list[int]) -> None:
        """Tell the connector about a refused request that would have read remote KV."""
        params = kv_params_of(body)
        if not params or not params.get(DO_REMOTE_PREFILL):
            return
        req = SimRequest(
            request_id=f"rej-{client_id}-{next(self._ids):x}",
            client_request_id=client_id,
            prompt_token_ids=prompt_ids,
            sampling=SamplingParams(max_tokens=1),
            kv_transfer_params=params,
            sink=lambda _out: None,
        )
        self.runner.reject(req)

    async def _generate(
        self, request: web.Request, parse: Parser, *, chat: bool
    ) -> web.StreamResponse:
        client_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        headers = {"X-Request-Id": client_id}
        body: Any = None
        try:
            body = await self._json(request)
            parsed = parse(body, self.tokenizer, self.config.model, self.config.max_model_len)
        except ApiError as exc:
            self._reject(client_id, body, [])
            return _error(exc, headers)
        if self.faults.delay_ms:
            await asyncio.sleep(self.faults.delay_ms / 1000)
        status = self.faults.take_failure(await request.read())
        refusal: ApiError | None = None
        if status is not None:
            refusal = ApiError(status, "injected failure (enginesim fault)", type_="InjectedFault")
        elif self.faults.refuse_admission or not self.runner.alive:
            refusal = ApiError(503, "engine is not admitting requests", type_="ServiceUnavailable")
        if refusal is not None:
            self._reject(client_id, body, parsed.prompt_token_ids)
            return _error(refusal, headers)

        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[Output] = asyncio.Queue()
        req = SimRequest(
            request_id=f"{client_id}-{next(self._ids):x}",
            client_request_id=client_id,
            prompt_token_ids=parsed.prompt_token_ids,
            sampling=parsed.sampling,
            kv_transfer_params=parsed.kv_transfer_params,
            cache_salt=parsed.cache_salt,
            priority=parsed.priority,
            sink=self._sink(loop, outputs, parsed.stream),
        )
        response_id = ("chatcmpl-" if chat else "cmpl-") + client_id
        finished = False
        self.runner.submit(req)
        try:
            if parsed.stream:
                stream = web.StreamResponse(
                    headers={
                        **headers,
                        "Content-Type": "text/event-stream",
                        "Cache-Control": "no-cache",
                    },
                )
                await stream.prepare(request)
                finished = await self._stream(stream, outputs.get, parsed, response_id, chat)
                return stream
            text: list[str] = []
            while True:
                out = await outputs.get()
                text.append(out.text)
                if out.finished:
                    finished = True
                    break
            if out.error is not None:
                return _error(
                    ApiError(out.error.status, out.error.message, type_=out.error.type), headers
                )
            return web.json_response(
                self._full_response(response_id, chat, "".join(text), out), headers=headers
            )
        finally:
            if not finished:
                # Client gone (handler cancelled or stream write failed): free its blocks.
                self.runner.abort(req.request_id)

    def _full_response(
        self, response_id: str, chat: bool, text: str, out: Output
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": out.finish_reason,
            "stop_reason": None,
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        else:
            choice["text"] = text
        return {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.config.model,
            "choices": [choice],
            "usage": self._usage(out, chat, stream=False),
            KV_TRANSFER_PARAMS: out.kv_transfer_params,
        }

    def _usage(self, out: Output, chat: bool, *, stream: bool) -> dict[str, Any]:
        """vLLM 0.32's usage: `prompt_tokens_details` only with `--enable-prompt-tokens-details`
        (`cached_tokens` = the request's `num_cached_tokens`; chat adds
        `created_cache_tokens`); a JSON answer writes absent details as null, a stream's usage
        event leaves them out."""
        usage: dict[str, Any] = {
            "prompt_tokens": out.prompt_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "completion_tokens": out.completion_tokens,
        }
        details: dict[str, Any] | None = None
        if self.config.enable_prompt_tokens_details:
            details = {"cached_tokens": out.num_cached_tokens}
            if chat:
                details["created_cache_tokens"] = out.cache_creation_tokens
            elif not stream:
                details["created_cache_tokens"] = None
            if not stream:
                details["multimodal_tokens"] = None
        if details is not None or not stream:
            usage["prompt_tokens_details"] = details
        if not stream:
            usage["completion_tokens_details"] = None
        return usage

    async def _stream(
        self,
        stream: web.StreamResponse,
        next_output: Callable[[], Awaitable[Output]],
        parsed: ParsedRequest,
        response_id: str,
        chat: bool,
    ) -> bool:
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(
            delta_text: str | None, finish: str | None, first: bool = False
        ) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
            if chat:
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if delta_text is not None:
                    delta["content"] = delta_text
                choice["delta"] = delta
                if finish is not None:
                    choice["stop_reason"] = None  # vLLM sets it on a chat stream's last choice
            else:
                choice["text"] = delta_text or ""
                choice["stop_reason"] = None
            return {
                "id": response_id,
                "object": kind,
                "created": created,
                "model": self.config.model,
                "choices": [choice],
            }

        # vLLM sends a chat stream's role event with the request's first output, not when the
        # stream opens: nothing reaches the client while the request waits or prefills (a
        # router reads the first event as "prefill done"); an error before any output is the
        # stream's first event.
        role_sent = not chat
        while True:
            out = await next_output()
            if out.error is not None:
                error = ApiError(out.error.status, out.error.message, type_=out.error.type)
                await stream.write(_sse(error.body()))
                await stream.write(_sse("[DONE]"))
                return True
            if not role_sent:
                await stream.write(_sse(chunk("", None, first=True)))
                role_sent = True
            if not out.finished:
                if out.text:
                    await stream.write(_sse(chunk(out.text, None)))
                continue
            last = chunk(out.text, out.finish_reason)
            tail: dict[str, Any] = last
            if parsed.include_usage:
                await stream.write(_sse(last))
                tail = {
                    "id": response_id,
                    "object": kind,
                    "created": created,
                    "model": self.config.model,
                    "choices": [],
                    "usage": self._usage(out, chat, stream=True),
                }
            if self.config.params_in_stream and out.kv_transfer_params is not None:
                # Opt-in kvrelay extra: the params ride on the last chunk. Stock vLLM sends
                # none (nor does enginesim by default): they are on the side channel.
                tail[KV_TRANSFER_PARAMS] = out.kv_transfer_params
            await stream.write(_sse(tail))
            await stream.write(_sse("[DONE]"))
            with contextlib.suppress(ConnectionResetError):
                await stream.write_eof()
            return True


async def serve(server: EngineServer, host: str, port: int) -> None:
    """Serve until cancelled; the runner and its connector are stopped on the way out."""
    app_runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None)
    await app_runner.setup()
    site = web.TCPSite(app_runner, host, port)
    await site.start()
    log.info("enginesim %s listening on http://%s:%d", server.config.model, host, port)
    try:
        await asyncio.Event().wait()
    finally:
        await app_runner.cleanup()
