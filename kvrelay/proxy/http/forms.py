"""Multipart form bodies on the pass-through routes (e.g. `/v1/audio/transcriptions`): the
fields the proxy must act on, found without copying the parts.

A form is forwarded as the client sent it, but its `model` field is checked like a JSON body's
(an unknown model is a 404) and a `kv_transfer_params` field is dropped (the proxy alone speaks
to the connector). Only the part headers and the `model` value are read; file parts are never
copied unless a field has to be dropped, when the form is rebuilt once from the parts kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp.multipart import parse_content_disposition

from kvrelay.proxy.base import ProxyError, bad_request

# A model name longer than this is not a model any engine serves; reading it whole is not needed.
MODEL_FIELD_MAX = 1024


@dataclass(frozen=True)
class Part:
    """One part: its field name and where its headers and content lie in the body."""

    name: str | None
    start: int  # first byte of its headers
    content: int  # first byte of its content
    end: int  # one past its content


def _invalid(why: str) -> ProxyError:
    return bad_request(
        f"the multipart body is malformed ({why}); send a multipart/form-data body with its "
        "boundary, or a JSON object",
        code="invalid_multipart",
    )


def parts(raw: bytes | bytearray, boundary: str) -> list[Part]:
    """The parts of a multipart body (RFC 2046), in order; 400 when it is not one."""
    dash = b"--" + boundary.encode("latin-1")
    delimiter = b"\r\n" + dash
    if not raw.startswith(dash):
        raise _invalid("it does not start with its boundary")
    found: list[Part] = []
    pos = len(dash)
    while raw[pos : pos + 2] != b"--":  # the close delimiter ends the parts
        line_end = raw.find(b"\r\n", pos)
        if line_end < 0:
            raise _invalid("a boundary line does not end")
        start = line_end + 2
        end = raw.find(delimiter, start)
        if end < 0:
            raise _invalid("no closing boundary")
        head_end = raw.find(b"\r\n\r\n", start - 2, end)
        if head_end < 0:
            raise _invalid("a part has no blank line after its headers")
        found.append(Part(_field_name(raw[start:head_end]), start, head_end + 4, end))
        pos = end + len(delimiter)
    return found


def _field_name(head: bytes | bytearray) -> str | None:
    for line in bytes(head).split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-disposition":
            _kind, params = parse_content_disposition(value.decode("utf-8", "replace").strip())
            field = params.get("name") or params.get("name*")
            return field if isinstance(field, str) else None
    return None


def field_text(raw: bytes | bytearray, part: Part) -> str:
    """A short text field's value (the model name); 400 when it is not UTF-8."""
    if part.end - part.content > MODEL_FIELD_MAX:
        raise bad_request(f"the form field `{part.name}` is too long", param=part.name)
    try:
        return bytes(raw[part.content : part.end]).decode()
    except UnicodeDecodeError:
        raise bad_request(f"the form field `{part.name}` is not UTF-8", param=part.name) from None


def without(raw: bytes | bytearray, boundary: str, found: list[Part], drop: set[str]) -> bytes:
    """The form rebuilt from its parts whose names are not in `drop`."""
    dash = b"--" + boundary.encode("latin-1")
    view = memoryview(raw)
    pieces: list[bytes | memoryview] = []
    for part in found:
        if part.name not in drop:
            pieces += [dash, b"\r\n", view[part.start : part.end], b"\r\n"]
    pieces += [dash, b"--\r\n"]
    return b"".join(pieces)
