"""Reading an OpenAI-style server-sent event stream as a client does.

Events end at a blank line (LF or CRLF); an event's `data:` lines are joined with newlines; the
stream's end is the `[DONE]` sentinel. `events` gives the decoded JSON payloads in order.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_EVENT_END = re.compile(rb"\r?\n\r?\n")


def data_fields(raw: bytes) -> list[str]:
    """The `data` of every event in `raw`, in order (events without data are skipped)."""
    out: list[str] = []
    for block in _EVENT_END.split(raw):
        lines = [line.rstrip(b"\r") for line in block.split(b"\n")]
        data = [line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:")]
        if data:
            out.append(b"\n".join(data).decode("utf-8", errors="replace"))
    return out


@dataclass
class Stream:
    """A parsed stream: its JSON events, whether `[DONE]` came, what was not JSON."""

    events: list[Any] = field(default_factory=list)
    done: bool = False
    not_json: list[str] = field(default_factory=list)


def parse(raw: bytes | str) -> Stream:
    """Parse a whole stream body."""
    stream = Stream()
    for data in data_fields(raw.encode() if isinstance(raw, str) else raw):
        if data.strip() == "[DONE]":
            stream.done = True
            continue
        try:
            stream.events.append(json.loads(data))
        except ValueError:
            stream.not_json.append(data)
    return stream


def events(raw: bytes | str) -> list[Any]:
    """The JSON payloads of a stream, `[DONE]` left out."""
    return parse(raw).events


def text_of(stream_events: list[Any], chat: bool) -> str:
    """The generated text of a chat (`delta.content`) or completion (`text`) stream."""
    parts: list[str] = []
    for event in stream_events:
        for choice in event.get("choices", []) if isinstance(event, dict) else []:
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if piece:
                parts.append(piece)
    return "".join(parts)
