"""Turns through the proxy with the `openai` SDK that return what the proxy said each turn
reused (its `X-Kvrelay-*` headers, or a stream's final usage event), for the enginesim and the
real-vLLM accounting suites. Conversations are named by `X-Conversation-Id`, under the key
`SDK_KEY` (their tenant)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from openai import AsyncOpenAI, OpenAI

from kvrelay.devtools import ProxyServer

SDK_KEY = "sdk"
TOKEN_HEADERS = ("prompt_tokens", "reused_tokens", "local_hit_tokens", "loaded_tokens",
                 "computed_tokens")  # fmt: skip


@dataclass
class Result:
    """One turn's answer and what came with it."""

    answer: str
    headers: dict[str, str] | None  # a JSON answer's
    usage: dict[str, Any] | None  # the answer's usage (a stream's only with include_usage)


@dataclass
class Asker:
    """Sends turns of chat to one proxy."""

    proxy: ProxyServer
    model: str
    max_tokens: int
    use_async: bool = False
    timeout: float = 120.0
    api_key: str = SDK_KEY  # the tenant the turns are sent as

    def turn(self, messages: list[dict[str, Any]], conversation: str, stream: bool,
             include_usage: bool, **extra: Any) -> Result:  # fmt: skip
        """One turn (`extra`: more body fields, e.g. `chat_template`)."""
        kwargs: dict[str, Any] = {
            "model": self.model, "messages": list(messages), "max_tokens": self.max_tokens,
            "temperature": 0, "extra_headers": {"X-Conversation-Id": conversation},
        }  # fmt: skip
        if extra:
            kwargs["extra_body"] = extra
        if stream:
            kwargs["stream"] = True
            if include_usage:
                kwargs["stream_options"] = {"include_usage": True}
        if self.use_async:
            return asyncio.run(self._async_turn(kwargs))
        client = OpenAI(base_url=self.proxy.url + "/v1", api_key=self.api_key, max_retries=0,
                        timeout=self.timeout)  # fmt: skip
        try:
            if not stream:
                raw = client.chat.completions.with_raw_response.create(**kwargs)
                full = raw.parse()
                return Result(full.choices[0].message.content or "", dict(raw.headers),
                              full.usage.model_dump() if full.usage else None)  # fmt: skip
            text, usage = "", None
            for chunk in client.chat.completions.create(**kwargs):
                text += "".join(c.delta.content or "" for c in chunk.choices)
                usage = chunk.usage.model_dump() if chunk.usage else usage
            return Result(text, None, usage)
        finally:
            client.close()

    async def _async_turn(self, kwargs: dict[str, Any]) -> Result:
        client = AsyncOpenAI(base_url=self.proxy.url + "/v1", api_key=self.api_key,
                             max_retries=0, timeout=self.timeout)  # fmt: skip
        try:
            if not kwargs.get("stream"):
                raw = await client.chat.completions.with_raw_response.create(**kwargs)
                full = raw.parse()
                return Result(full.choices[0].message.content or "", dict(raw.headers),
                              full.usage.model_dump() if full.usage else None)  # fmt: skip
            text, usage = "", None
            async for chunk in await client.chat.completions.create(**kwargs):
                text += "".join(c.delta.content or "" for c in chunk.choices)
                usage = chunk.usage.model_dump() if chunk.usage else usage
            return Result(text, None, usage)
        finally:
            await client.close()

    def forget(self, conversation: str) -> None:
        """Delete the conversation: D holds nothing for it afterwards."""
        auth = {"Authorization": f"Bearer {self.api_key}"}
        status, _, _ = self.proxy.call("DELETE", f"/v1/conversations/{conversation}", headers=auth)
        assert status == 200


def returned_account(result: Result) -> dict[str, Any] | None:
    """The account the proxy returned with the answer, in the usage extension's names; None
    for a stream without usage."""
    if result.headers is not None:
        h = {k.lower(): v for k, v in result.headers.items()}
        out: dict[str, Any] = {
            name: int(h[f"x-kvrelay-{name.replace('_', '-')}"]) for name in TOKEN_HEADERS
        }
        refused = [part.split("=") for part in h.get("x-kvrelay-refused-blocks", "").split(",")]
        out["refused_blocks"] = {k: int(v) for k, v in (p for p in refused if len(p) == 2)}
        out["prefilled_by"] = h["x-kvrelay-prefilled-by"]
        return out
    if result.usage is not None:
        ext = dict(result.usage["kvrelay"])
        # The standard field says the same as the extension.
        assert result.usage["prompt_tokens_details"]["cached_tokens"] == ext["reused_tokens"]
        assert result.usage["prompt_tokens"] == ext["prompt_tokens"]
        return ext
    return None
