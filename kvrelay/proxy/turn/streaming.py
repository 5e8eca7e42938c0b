"""Server-sent events relay: pass D's events through byte for byte, except the one that
carries `kv_transfer_params`, which is parsed, stripped and re-encoded (the only event the
proxy re-encodes), and, when asked, the terminal `data: [DONE]` event, which is kept back so
the relay sends it once the turn is settled, and, when asked, the final usage event (`"choices":
[]` with `usage`, sent when the client asked `stream_options.include_usage`), which is kept back
parsed so the relay can send it, with the turn's account, just before `[DONE]`. Events are
split on the blank line that ends each SSE event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvrelay.proxy.base import jsoncodec

KV_MARKER = b'"kv_transfer_params"'
DONE = b"[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"
_AFTER_EVENT = b"\n\n"
# A choice with a non-null finish reason: the engine finished the request (compact or spaced JSON).
FINISH_MARKERS = (b'"finish_reason":"', b'"finish_reason": "')
# An event with no choices: the final usage event is one (compact or spaced JSON).
USAGE_MARKERS = (b'"choices":[]', b'"choices": []')


@dataclass
class SSEFilter:
    """Feed upstream bytes, get bytes to send on; collects the params events carried.

    With `hold_done`, the `[DONE]` event is not passed on: `done_event` keeps it for the caller;
    with `hold_usage`, neither is the final usage event: `usage_event` keeps it, parsed.
    """

    hold_done: bool = False
    hold_usage: bool = False
    usage_event: dict[str, Any] | None = None
    params: dict[str, Any] | None = None
    saw_done: bool = False
    saw_finish: bool = False  # some choice ended: the engine has finished the request
    done_event: bytes | None = None
    saw_error: bool = False
    events: int = 0
    _buffer: bytearray = field(default_factory=bytearray)

    def feed(self, chunk: bytes) -> bytes:
        if not self._buffer and chunk.endswith(b"\n\n") and b"\r" not in chunk:
            # The common case, one or more whole events with LF endings: no buffer copies.
            return self._process(chunk)
        self._buffer += chunk
        if b"\r" in chunk:
            # CRLF line endings are valid SSE: normalise so events split on a blank line. A
            # trailing CR stays in the buffer until its LF arrives with the next chunk.
            self._buffer[:] = self._buffer.replace(b"\r\n", b"\n")
        end = self._buffer.rfind(b"\n\n")
        if end < 0:
            return b""
        complete = bytes(self._buffer[: end + 2])
        del self._buffer[: end + 2]
        return self._process(complete)

    def flush(self) -> bytes:
        """What is left when the upstream stream ends (an unterminated last event)."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        return self._process(rest) if rest.strip() else b""

    def _process(self, data: bytes) -> bytes:
        self.events += data.count(b"\n\n")
        done = DONE in data
        if done:
            self.saw_done = True
        if not self.saw_finish and (FINISH_MARKERS[0] in data or FINISH_MARKERS[1] in data):
            self.saw_finish = True
        if b'"error"' in data and data.lstrip().startswith(b'data: {"error"'):
            self.saw_error = True
        held = self.hold_done and done
        usage = self.hold_usage and (USAGE_MARKERS[0] in data or USAGE_MARKERS[1] in data)
        if KV_MARKER not in data and not usage:
            if not held:
                return data  # the fast path: no parsing, no re-encoding
            if data == DONE_EVENT or data.endswith(_AFTER_EVENT + DONE_EVENT):
                # The usual end of a stream (the whole answer may arrive in one read): D's
                # terminal event, exactly as D wrote it, last.
                self.done_event = DONE_EVENT
                return data[: -len(DONE_EVENT)]
        out = bytearray()
        for event in data.split(b"\n\n"):
            if not event:
                continue
            if held and _is_done(event):
                self.done_event = event + b"\n\n"
                continue
            if usage and self._held_usage(event):
                continue
            out += self._strip_event(event) + b"\n\n"
        return bytes(out)

    def _held_usage(self, event: bytes) -> bool:
        """Keep `event` back when it is the final usage event (its params taken as usual)."""
        if not (USAGE_MARKERS[0] in event or USAGE_MARKERS[1] in event):
            return False
        obj = _event_json(event)
        if not isinstance(obj, dict) or obj.get("choices") != []:
            return False
        if not isinstance(obj.get("usage"), dict):
            return False
        params = obj.pop("kv_transfer_params", None)
        if isinstance(params, dict):
            self.params = params
        self.usage_event = obj
        return True

    def _strip_event(self, event: bytes) -> bytes:
        if KV_MARKER not in event:
            return event
        # SSE lets one event's data span several `data:` lines, joined with LF: parse them as one.
        lines = event.split(b"\n")
        data = b"\n".join(_field_value(line) for line in lines if line.startswith(b"data:"))
        try:
            obj = jsoncodec.loads(data)
        except (ValueError, RecursionError):
            return event
        if not isinstance(obj, dict) or "kv_transfer_params" not in obj:
            return event
        params = obj.pop("kv_transfer_params")
        if isinstance(params, dict):
            self.params = params
        others = [line for line in lines if not line.startswith(b"data:")]
        return b"\n".join([*others, b"data: " + jsoncodec.dumps(obj)])


def _event_json(event: bytes) -> Any:
    """The JSON an event's `data:` lines carry (joined with LF), None when they are not JSON."""
    lines = event.split(b"\n")
    data = b"\n".join(_field_value(line) for line in lines if line.startswith(b"data:"))
    try:
        return jsoncodec.loads(data)
    except (ValueError, RecursionError):
        return None


def data_event(obj: Any) -> bytes:
    """One SSE event carrying `obj` as JSON."""
    return b"data: " + jsoncodec.dumps(obj) + b"\n\n"


def _is_done(event: bytes) -> bool:
    data = [_field_value(line) for line in event.split(b"\n") if line.startswith(b"data:")]
    return data == [DONE]


def _field_value(line: bytes) -> bytes:
    """The value of an SSE `data:` line (one optional space after the colon is not part of it)."""
    value = line[5:]
    return value[1:] if value.startswith(b" ") else value


def error_event(message: str, type: str = "server_error", code: str | None = None) -> bytes:
    """An OpenAI-style error event for failures after the stream has started."""
    payload = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return b"data: " + jsoncodec.dumps(payload) + b"\n\n"
