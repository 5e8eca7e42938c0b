"""The engine routes beside generation, in the shapes vLLM answers them, for the proxy's
pass-through tests: `POST /tokenize`, `POST /detokenize`, `POST /v1/embeddings` and a minimal
`POST /v1/responses`.

Embeddings are fake but deterministic: a unit vector derived from a hash of the input's token
ids (the same input always gives the same vector). A response's text is a fixed sentence that
names how many input tokens it read; streamed, it arrives as Responses API events, one word a
delta.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import time
import uuid
from typing import Any

from aiohttp import web

from kvrelay.enginesim.chat import ChatTemplateError, render_chat
from kvrelay.enginesim.openai_api import ApiError, encode_text
from kvrelay.enginesim.tokenizer import Tokenizer

DEFAULT_DIMENSIONS = 16


def add_routes(
    app: web.Application,
    tokenizer: Tokenizer,
    model: str,
    max_model_len: int,
    first_line: str = "",
) -> None:
    """Register the four routes for one engine serving `model` (`first_line`: the chat
    template's, as the chat route renders it)."""
    extras = Extras(tokenizer, model, max_model_len, first_line)
    app.add_routes(
        [
            web.post("/tokenize", extras.tokenize),
            web.post("/detokenize", extras.detokenize),
            web.post("/v1/embeddings", extras.embeddings),
            web.post("/v1/responses", extras.responses),
        ]
    )


def _error(exc: ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


class Extras:
    """Handlers of one engine (its tokenizer and served model)."""

    def __init__(
        self, tokenizer: Tokenizer, model: str, max_model_len: int, first_line: str = ""
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.max_model_len = max_model_len
        self.first_line = first_line  # the chat template's: /tokenize renders as chat does

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        model = body.get("model", self.model)
        if model is not None and model != self.model:
            raise ApiError(
                404, f"The model `{model}` does not exist.", type_="NotFoundError", param="model"
            )
        return body

    def _ids(self, value: Any, param: str) -> list[int]:
        if isinstance(value, str):
            return encode_text(self.tokenizer, value, param)
        if isinstance(value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.tokenizer.vocab_size
            for t in value
        ):
            return list(value)
        raise ApiError(400, f"{param} must be a string or a list of token ids", param=param)

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            if "messages" in body:
                try:
                    generation = body.get("add_generation_prompt", True) is not False
                    text = render_chat(body["messages"], generation, first_line=self.first_line)
                except ChatTemplateError as exc:
                    raise ApiError(400, str(exc), param="messages") from None
                ids = encode_text(self.tokenizer, text, "messages")
            else:
                ids = self._ids(body.get("prompt"), "prompt")
        except ApiError as exc:
            return _error(exc)
        return web.json_response(
            {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list):
                raise ApiError(400, "tokens must be a list of token ids", param="tokens")
            ids = self._ids(tokens, "tokens")
        except ApiError as exc:
            return _error(exc)
        return web.json_response({"prompt": self.tokenizer.decode(ids)})

    async def embeddings(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            inputs = body.get("input")
            # One string or token list, or a batch of them (as OpenAI accepts).
            batch = (
                inputs
                if isinstance(inputs, list)
                and inputs
                and all(isinstance(i, str | list) for i in inputs)
                else [inputs]
            )
            dims = body.get("dimensions", DEFAULT_DIMENSIONS)
            if isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= 4096:
                raise ApiError(
                    400, "dimensions must be an integer in [1, 4096]", param="dimensions"
                )
            ids = [self._ids(item, "input") for item in batch]
        except ApiError as exc:
            return _error(exc)
        data = [
            {"object": "embedding", "index": i, "embedding": fake_embedding(tokens, dims)}
            for i, tokens in enumerate(ids)
        ]
        used = sum(len(t) for t in ids)
        return web.json_response(
            {
                "id": f"embd-{uuid.uuid4().hex}",
                "object": "list",
                "created": int(time.time()),
                "model": self.model,
                "data": data,
                "usage": {"prompt_tokens": used, "total_tokens": used, "completion_tokens": 0},
            }
        )

    async def responses(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            input_tokens = len(self._response_input(body.get("input")))
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise ApiError(400, "stream must be a boolean", param="stream")
        except ApiError as exc:
            return _error(exc)
        text = f"enginesim read {input_tokens} input tokens and answers briefly."
        words = text.split(" ")
        response_id = f"resp_{uuid.uuid4().hex}"
        item_id = f"msg_{uuid.uuid4().hex}"
        done = self._response(response_id, item_id, text, input_tokens, len(words), "completed")
        if not stream:
            return web.json_response(done)
        out = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await out.prepare(request)
        created = self._response(response_id, item_id, "", input_tokens, 0, "in_progress")
        await out.write(_event("response.created", {"response": created}))
        for i, word in enumerate(words):
            delta = word if i == 0 else " " + word
            event = {"item_id": item_id, "output_index": 0, "content_index": 0, "delta": delta}
            await out.write(_event("response.output_text.delta", event))
        await out.write(_event("response.completed", {"response": done}))
        await out.write_eof()
        return out

    def _response_input(self, value: Any) -> list[int]:
        if isinstance(value, str):
            return encode_text(self.tokenizer, value, "input")
        if isinstance(value, list):
            messages = [
                {"role": m.get("role", "user"), "content": m.get("content", "")}
                for m in value
                if isinstance(m, dict)
            ]
            try:
                text = render_chat(messages, add_generation_prompt=True)
            except ChatTemplateError as exc:
                raise ApiError(400, str(exc), param="input") from None
            return encode_text(self.tokenizer, text, "input")
        raise ApiError(400, "input must be a string or a list of messages", param="input")

    def _response(
        self,
        response_id: str,
        item_id: str,
        text: str,
        input_tokens: int,
        output_tokens: int,
        status: str,
    ) -> dict[str, Any]:
        output = []
        if text:
            output.append(
                {
                    "type": "message",
                    "id": item_id,
                    "role": "assistant",
                    "status": status,
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            )
        return {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "model": self.model,
            "status": status,
            "output": output,
            "usage": {
                "input_tokens": input_tokens,
                "output_tokens": output_tokens,
                "total_tokens": input_tokens + output_tokens,
            },
        }


def _event(kind: str, data: dict[str, Any]) -> bytes:
    payload = json.dumps({"type": kind, **data}, separators=(",", ":"))
    return f"event: {kind}\ndata: {payload}\n\n".encode()


def fake_embedding(token_ids: list[int], dims: int) -> list[float]:
    """A deterministic unit vector for `token_ids` (a hash stretched to `dims` numbers)."""
    seed = hashlib.sha256(struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()
    values: list[float] = []
    counter = 0
    while len(values) < dims:
        block = hashlib.sha256(seed + counter.to_bytes(4, "little")).digest()
        values.extend((b - 127.5) / 127.5 for b in block)
        counter += 1
    values = values[:dims]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]
