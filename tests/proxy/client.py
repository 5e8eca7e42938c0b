"""Small HTTP client helpers the proxy tests share (real HTTP through httpx)."""

from __future__ import annotations

from typing import Any

import httpx

from kvrelay.devtools import sse

MODEL = "kvrelay-sim"


def post(
    base: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> httpx.Response:  # fmt: skip
    return httpx.post(base + path, json=body, headers=headers or {}, timeout=timeout)


def stream(
    base: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> tuple[int, list[dict[str, Any]], bytes]:  # fmt: skip
    """A streamed request: (status, parsed data events, raw bytes)."""
    with httpx.stream(
        "POST", base + path, json={**body, "stream": True}, headers=headers or {},
        timeout=timeout,
    ) as resp:  # fmt: skip
        raw = resp.read()
    return resp.status_code, sse.events(raw), raw


def streamed_text(events: list[dict[str, Any]], chat: bool) -> str:
    return sse.text_of(events, chat)


def chat_body(messages: list[dict[str, Any]], max_tokens: int = 12) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens}


def reply_of(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    content: str = resp.json()["choices"][0]["message"]["content"]
    return content
