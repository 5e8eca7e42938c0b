"""Reading an OpenAI-style server-sent event stream as a client does.

Events end at a blank line (LF or CRLF); an event's `data:` lines are joined with newlines; the
stream's end is the `[DONE]` sentinel. `EventReader` reads a stream as its chunks arrive (a
client that times each event), `data_fields` a whole body; `events` gives the decoded JSON
payloads in order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class EventReader:
    """The `data` of a stream's events as its chunks arrive, cut anywhere: `feed` returns the
    events each chunk completes (at their blank line), `end` the one a stream left unended.
    Events without data (comments, `event:` lines alone) are skipped."""

    def __init__(self) -> None:
        self._partial = b""  # a line whose end has not arrived
        self._data: list[bytes] = []  # the `data:` lines of the event being read

    def feed(self, chunk: bytes) -> list[str]:
        """The data of each event that `chunk` completes, in order."""
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        out: list[str] = []
        for line in lines:
            self._line(line.rstrip(b"\r"), out)
        return out

    def end(self) -> list[str]:
        """The data of the event the stream ended in without its blank line, if any."""
        out: list[str] = []
        if self._partial:
            self._line(self._partial.rstrip(b"\r"), out)
            self._partial = b""
        self._line(b"", out)
        return out

    def _line(self, line: bytes, out: list[str]) -> None:
        if not line:
            if self._data:
                out.append(b"\n".join(self._data).decode("utf-8", errors="replace"))
                self._data = []
        elif line.startswith(b"data:"):
            self._data.append(line[5:].removeprefix(b" "))


def data_fields(raw: bytes) -> list[str]:
    """The `data` of every event in `raw`, in order (events without data are skipped)."""
    reader = EventReader()
    return reader.feed(raw) + reader.end()


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
