"""Conversations driven by the real `openai` SDK, for the enginesim and the real-vLLM suites.

Each turn is sent the moment the previous one returned: a streamed turn returns when the SDK
saw `[DONE]` (it then hangs up at once), so the proxy must have stored the turn's entry by
then. Turns cycle through streamed with usage, not streamed, and streamed without usage.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openai import AsyncOpenAI, OpenAI

# (stream, stream_options.include_usage) per turn, cycled.
MODES: tuple[tuple[bool, bool], ...] = ((True, True), (False, False), (True, False))


@dataclass
class TurnResult:
    """What one turn returned through the proxy."""

    stream: bool
    include_usage: bool
    answer: str
    usage: Any = None


@dataclass
class SDKConversation:
    """One chat through the proxy with `OpenAI` or `AsyncOpenAI`."""

    base_url: str
    model: str
    system: str
    max_tokens: int
    conversation_id: str | None = None  # None: the proxy matches the history
    use_async: bool = False
    messages: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": self.system}]

    def _kwargs(self, stream: bool, include_usage: bool) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": self.model,
            "messages": list(self.messages),
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }
        if self.conversation_id is not None:
            kwargs["extra_headers"] = {"X-Conversation-Id": self.conversation_id}
        if stream:
            kwargs["stream"] = True
            if include_usage:
                kwargs["stream_options"] = {"include_usage": True}
        return kwargs

    def run(self, questions: list[str], after_turn: Callable[[int, TurnResult], None]) -> None:
        """Ask every question in turn, no pause in between; `after_turn` checks each turn
        before the next is sent (it must not wait: checks that wait use the next turn)."""
        if self.use_async:
            asyncio.run(self._run_async(questions, after_turn))
            return
        client = OpenAI(base_url=self.base_url, api_key="sdk-test", max_retries=0, timeout=120)
        try:
            for turn, question in enumerate(questions):
                stream, usage = MODES[turn % len(MODES)]
                self.messages.append({"role": "user", "content": question})
                result = self._sync_turn(client, stream, usage)
                self.messages.append({"role": "assistant", "content": result.answer})
                after_turn(turn, result)
        finally:
            client.close()

    def _sync_turn(self, client: OpenAI, stream: bool, include_usage: bool) -> TurnResult:
        kwargs = self._kwargs(stream, include_usage)
        result = TurnResult(stream, include_usage, "")
        if not stream:
            full = client.chat.completions.create(**kwargs)
            result.answer = full.choices[0].message.content or ""
            result.usage = full.usage
            return result
        for chunk in client.chat.completions.create(**kwargs):
            for choice in chunk.choices:
                result.answer += choice.delta.content or ""
            if chunk.usage is not None:
                result.usage = chunk.usage
        return result

    async def _run_async(
        self, questions: list[str], after_turn: Callable[[int, TurnResult], None]
    ) -> None:
        client = AsyncOpenAI(base_url=self.base_url, api_key="sdk-test", max_retries=0,
                             timeout=120)  # fmt: skip
        try:
            for turn, question in enumerate(questions):
                stream, usage = MODES[turn % len(MODES)]
                self.messages.append({"role": "user", "content": question})
                result = await self._async_turn(client, stream, usage)
                self.messages.append({"role": "assistant", "content": result.answer})
                after_turn(turn, result)
        finally:
            await client.close()

    async def _async_turn(
        self, client: AsyncOpenAI, stream: bool, include_usage: bool
    ) -> TurnResult:
        kwargs = self._kwargs(stream, include_usage)
        result = TurnResult(stream, include_usage, "")
        if not stream:
            full = await client.chat.completions.create(**kwargs)
            result.answer = full.choices[0].message.content or ""
            result.usage = full.usage
            return result
        async for chunk in await client.chat.completions.create(**kwargs):
            for choice in chunk.choices:
                result.answer += choice.delta.content or ""
            if chunk.usage is not None:
                result.usage = chunk.usage
        return result
