"""vLLM `Request` -> the core's `RequestView`, and the client-visible request id.

vLLM's serving layer names an engine request `<prefix><X-Request-Id>[-<n>]-<8 random chars>`
(`cmpl-` for completions with a prompt index, `chatcmpl-` for chat). The proxy knows only the
X-Request-Id, and the holder publishes finished params under it, so we recover it here. Duck
typed: no vLLM import.
"""

from __future__ import annotations

import re
from typing import Any

from kvrelay.connector.metadata import RequestView

_SUFFIX = re.compile(r"-[0-9A-Za-z]{8}$")
_COMPLETION = re.compile(r"^cmpl-(?P<rid>.+)-\d+$")
_PREFIXES = ("chatcmpl-", "cmpl-", "resp_", "resp-")


def client_request_id(engine_request_id: str) -> str:
    """Best-effort X-Request-Id behind a vLLM engine request id (itself when unrecognised)."""
    external = _SUFFIX.sub("", engine_request_id)
    if external == engine_request_id:
        return engine_request_id
    match = _COMPLETION.match(external)
    if match:
        return match.group("rid")
    for prefix in _PREFIXES:
        if external.startswith(prefix):
            return external[len(prefix) :]
    return external


def request_view(request: Any) -> RequestView:
    """Snapshot what the core needs from a vLLM `Request` (token lists are vLLM's own)."""
    prompt = request.prompt_token_ids if request.prompt_token_ids is not None else []
    params = request.kv_transfer_params
    lora = getattr(request, "lora_request", None)
    return RequestView(
        request_id=request.request_id,
        client_request_id=client_request_id(request.request_id),
        prompt_token_ids=prompt,
        all_token_ids=request.all_token_ids,
        kv_transfer_params=params if isinstance(params, dict) else None,
        lora_name=str(lora.lora_name) if lora is not None else None,
        cache_salt=_salt(getattr(request, "cache_salt", None)),
    )


def _salt(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
