"""Conversation identity: tenant, conversation id, request id and message fingerprints.

A conversation's map key is `(tenant, conversation_id)`. The id is the first of, in this order:

1. the `X-Conversation-Id` header (kvrelay's own);
2. the body's `conversation_id` (removed before forwarding);
3. the `X-Session-ID` header (vLLM's multi-turn benchmark and several gateways send it; a
   gateway may set it for a whole session, so the client's own choices above win);
4. for chat without any of them, a fingerprint of the message history, so stock OpenAI
   clients get reuse too.

Whichever is used is checked the same way (non-empty, bounded, outside the fingerprint
namespace); the ones not used are ignored.

Fingerprints are chained per message: `f_i = sha256(f_{i-1} || canonical(msg_i))`, which lets
the proxy check "the new request extends what D holds" in one pass.

The stored entry's fingerprint covers the *prompt* of the turn D served, not D's reply: the
reply's text may re-tokenize differently (docs/DESIGN.md §1), so only P's token-level block
hashes can judge it. The message check here is the cheap early filter for edited history.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from kvrelay.proxy.base import bad_request, jsoncodec
from kvrelay.proxy.fleet import PromptPrefixes

MAX_ID_LEN = 200
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
FINGERPRINT_PREFIX = "fp:"

# Message fields that shape the prompt; everything else (ids, refusal: null…) is ignored.
_MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")
_MESSAGE_FIELD_SET = frozenset(_MESSAGE_FIELDS)


def tenant_of(api_key: str | None) -> str:
    """A tenant id from the API key: a hash, so keys are never stored or logged."""
    if not api_key:
        return "anonymous"
    return "t" + hashlib.sha256(b"kvrelay-tenant\n" + api_key.encode()).hexdigest()[:24]


class _RandomBytes:
    """Random bytes from the OS, read 4 KiB at a time: one system call per 256 request ids
    rather than one per request, and as unpredictable (the ids are shown to clients)."""

    _CHUNK = 4096

    def __init__(self) -> None:
        self._buffer = b""
        self._at = 0
        # A forked child must not hand out the ids its parent has left in the buffer.
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self._buffer = b""
        self._at = 0

    def hex(self, n: int) -> str:
        at = self._at
        if at + n > len(self._buffer):
            self._buffer = os.urandom(self._CHUNK)
            at = 0
        self._at = at + n
        return self._buffer[at : at + n].hex()


_RANDOM = _RandomBytes()


def request_id_from(header: str | None) -> str:
    """The client's `X-Request-Id` when it is a sane token, otherwise a fresh one."""
    if header and _REQUEST_ID_RE.match(header):
        return header
    return "kvr-" + _RANDOM.hex(16)  # as random as uuid4, without building a UUID


def upstream_request_id(client_request_id: str, supplied: bool) -> str:
    """The id sent to P and D (the same on both legs).

    A client-chosen id gets a random suffix: D publishes finished params under this id, and a
    client must not be able to make the proxy fetch another request's params by reusing its
    id. The client's id stays a prefix, so engine logs still correlate.
    """
    if not supplied:
        return client_request_id
    return f"{client_request_id}-{_RANDOM.hex(4)}"


CONVERSATION_HEADER = "X-Conversation-Id"
SESSION_HEADER = "X-Session-ID"


def conversation_id_from(
    header: str | None, body: dict[str, Any], session_header: str | None = None
) -> str | None:
    """Explicit conversation id, in the order of precedence above (`header`:
    X-Conversation-Id, then the body, then `session_header`: X-Session-ID); pops
    `conversation_id` from the body."""
    from_body = body.pop("conversation_id", None)
    value: Any = header
    if value is None:
        value = from_body if from_body is not None else session_header
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise bad_request("conversation_id must be a non-empty string", param="conversation_id")
    text = str(value).strip()
    if len(text) > MAX_ID_LEN:
        raise bad_request(
            f"conversation_id is longer than {MAX_ID_LEN} characters", param="conversation_id"
        )
    if text.startswith(FINGERPRINT_PREFIX):
        # That namespace belongs to history fingerprints; a client must not collide with it.
        raise bad_request(
            f"conversation_id must not start with {FINGERPRINT_PREFIX!r}",
            param="conversation_id",
        )
    return text


def _prompt_fields(msg: Any) -> Any:
    """What of a message shapes the prompt: its known fields that are set (a non-object as
    it is, for the engine to refuse)."""
    if isinstance(msg, dict):
        return {k: msg[k] for k in _MESSAGE_FIELDS if msg.get(k) is not None}
    return msg


def chained_fingerprints(messages: list[Any], context: bytes = b"") -> list[str]:
    """`out[i]` is the fingerprint of `messages[:i]` (so `out[0]` is the empty history)."""
    sha256 = hashlib.sha256
    h = sha256(b"kvrelay-msgs-v1\n" + context).digest()
    out = [h[:16].hex()]  # the first 32 hex digits
    # The usual message (known fields, none null) is encoded as it is: no call per message.
    kept = [
        m
        if type(m) is dict and m.keys() <= _MESSAGE_FIELD_SET and None not in m.values()
        else _prompt_fields(m)
        for m in messages
    ]
    for encoded in jsoncodec.canonical_all(kept):
        h = sha256(h + encoded).digest()
        out.append(h[:16].hex())
    return out


def _chat_context(body: dict[str, Any]) -> bytes:
    """Request fields that change the rendered prompt, so they scope the fingerprint."""
    ctx = {k: body.get(k) for k in ("model", "tools", "chat_template", "chat_template_kwargs")}
    return json.dumps(ctx, sort_keys=True, separators=(",", ":"), default=str).encode()


# Not frozen: a frozen dataclass sets each field through `object.__setattr__`, and a shape is
# made for every request. Treat it as a value all the same: it is never changed.
@dataclass(slots=True)
class PromptShape:
    """What the proxy knows about a request's prompt for matching and storing.

    `store_fingerprint` describes this turn's prompt (saved with D's params);
    `lookup_key_id` is the fingerprint-derived conversation id under which the previous
    turn was stored (chat without an explicit id), if the history has an assistant turn.
    """

    kind: str  # "chat" | "text" | "tokens" | "none"
    store_fingerprint: str | None
    history_fingerprint: str | None
    lookup_key_id: str | None
    _chain: tuple[str, ...] = ()
    _text: str | None = None
    _tokens: tuple[int, ...] | None = None
    # Completions: the model (a LoRA adapter is a model name) scopes text/token digests.
    _model: str = ""

    def prefixes(self, scope: str, body: dict[str, Any]) -> PromptPrefixes | None:
        """The prompt's prefixes for the P routing's index, named within `scope` (the
        request's cache scope): a chat's message histories and its last message's runs of
        characters, a text prompt's runs of characters (token-id prompts and batches: None)."""
        if self.kind == "chat":
            return PromptPrefixes.of_chat(scope, self._chain, body["messages"])
        if self.kind == "text" and self._text is not None:
            return PromptPrefixes.of_text(scope, self._model, self._text)
        return None

    def extends(self, stored: str) -> bool:
        """True when this prompt strictly extends the prompt `stored` was taken from."""
        kind, _, rest = stored.partition(":")
        count_s, _, digest = rest.partition(":")
        if not count_s.isdigit():
            return False
        count = int(count_s)
        if kind == "m" and self.kind == "chat":
            return count < len(self._chain) - 1 and self._chain[count] == digest
        if kind == "t" and self.kind == "text" and self._text is not None:
            prefix = self._text[:count]
            return count < len(self._text) and _text_digest(prefix, self._model) == digest
        if kind == "k" and self.kind == "tokens" and self._tokens is not None:
            head = self._tokens[:count]
            return count < len(self._tokens) and _tokens_digest(head, self._model) == digest
        return False


def prompt_chars(route: str, body: dict[str, Any]) -> int:
    """Characters of a validated request's prompt: the chat's non-empty message contents (as
    text), or the completion's prompt as text."""
    if route == "chat":
        contents = [m.get("content") for m in body["messages"]]
        return sum(map(len, map(str, filter(None, contents))))  # passes in C
    return len(str(body.get("prompt")))


def _text_digest(text: str, model: str) -> str:
    # surrogatepass: a prompt may carry lone surrogates (valid JSON escapes); the engine
    # refuses those, but the digest must not fail first.
    data = text.encode("utf-8", "surrogatepass")
    seed = b"kvrelay-text-v2\n" + model.encode("utf-8", "surrogatepass") + b"\n"
    return hashlib.sha256(seed + data).hexdigest()[:32]


def _tokens_digest(tokens: tuple[int, ...], model: str) -> str:
    raw = b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens)
    seed = b"kvrelay-tokens-v2\n" + model.encode() + b"\n"
    return hashlib.sha256(seed + raw).hexdigest()[:32]


def chat_shape(body: dict[str, Any]) -> PromptShape:
    messages = body["messages"]
    chain = chained_fingerprints(messages, _chat_context(body))
    last_assistant = max(
        (i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
        default=None,
    )
    lookup = None
    history = None
    if last_assistant is not None:
        # Turn N was stored under the fingerprint of its prompt = everything before its reply.
        history = chain[last_assistant]
        lookup = FINGERPRINT_PREFIX + history
    return PromptShape(
        kind="chat",
        store_fingerprint=f"m:{len(messages)}:{chain[-1]}",
        history_fingerprint=history,
        lookup_key_id=lookup,
        _chain=tuple(chain),
    )


def chat_store_key_id(shape: PromptShape) -> str | None:
    """Fingerprint-derived id under which this turn is stored for the next one."""
    if shape.kind != "chat" or not shape._chain:
        return None
    return FINGERPRINT_PREFIX + shape._chain[-1]


def _single_prompt(
    kind: str,
    store_fingerprint: str,
    model: str,
    text: str | None = None,
    tokens: tuple[int, ...] | None = None,
) -> PromptShape:
    """A completion's one prompt (text or token ids): no history, so no lookup by fingerprint."""
    return PromptShape(
        kind, store_fingerprint, None, None, _text=text, _tokens=tokens, _model=model
    )


def completion_shape(body: dict[str, Any]) -> PromptShape:
    model = body.get("model")
    model = model if isinstance(model, str) else ""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        fingerprint = _text_digest(prompt, model)
        return _single_prompt("text", f"t:{len(prompt)}:{fingerprint}", model, text=prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        tokens = tuple(prompt)
        fingerprint = _tokens_digest(tokens, model)
        return _single_prompt("tokens", f"k:{len(tokens)}:{fingerprint}", model, tokens=tokens)
    # Batches of prompts: several outputs, no single conversation to continue.
    return PromptShape("none", None, None, None)
