"""OpenAI request parsing and validation, done before admission (as vLLM does).

`parse_completion` / `parse_chat` turn a JSON body into a `ParsedRequest` (prompt token ids +
sampling settings + kv_transfer_params) or raise `ApiError`, which renders as an
OpenAI-shaped error body `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvrelay.connector.protocol import (
    KV_TRANSFER_PARAMS,
)
from kvrelay.enginesim.chat import ChatTemplateError, render_chat
from kvrelay.enginesim.request import SamplingParams
from kvrelay.enginesim.tokenizer import Tokenizer

DEFAULT_COMPLETION_MAX_TOKENS = 16


class ApiError(Exception):
    """A request refused with an OpenAI-shaped error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass
class ParsedRequest:
    """A validated request, ready for the engine."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    kv_transfer_params: dict[str, Any] | None
    model: str
    # vLLM's `cache_salt`: the prefix-cache scope of the request (None: the shared one).
    cache_salt: str | None = None
    # vLLM's request `priority` (lower runs earlier under --scheduling-policy priority).
    priority: int = 0


def kv_params_of(body: Any) -> dict[str, Any] | None:
    """The body's kv_transfer_params if it is an object (read even from invalid requests)."""
    if isinstance(body, dict):
        params = body.get(KV_TRANSFER_PARAMS)
        if isinstance(params, dict):
            return params
    return None


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ApiError(400, f"{name} must be a number", param=name)
    return float(value)


def _int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer", param=name)
    return value


_INT64 = 2**63


def _priority(body: dict[str, Any]) -> int:
    """vLLM 0.32's `priority` field: an integer within int64, 0 when absent."""
    value = _int(body, "priority")
    if value is None:
        return 0
    if not -_INT64 <= value < _INT64:
        raise ApiError(400, "priority must fit in a signed 64-bit integer", param="priority")
    return value


def _cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM 0.32's check of `cache_salt` (`validate_cache_salt`): absent, or a non-empty
    string of at most 128 characters without '@', '/', '\\' or NUL."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ApiError(
            400,
            "Parameter 'cache_salt' must be a non-empty string if provided.",
            param="cache_salt",
        )
    if len(salt) > 128 or any(c in "@/\\\x00" for c in salt):
        raise ApiError(
            400,
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL.",
            param="cache_salt",
        )
    return salt


def _check_common(body: Any, served_model: str) -> tuple[str, bool, bool]:
    """The checks every route makes: a JSON object, the served model, sampling values."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model")
    if model is None:
        model = served_model
    if model != served_model:
        raise ApiError(
            404, f"The model `{model}` does not exist.", type_="NotFoundError", param="model"
        )
    temperature = _number(body, "temperature")
    if temperature is not None and temperature < 0:
        raise ApiError(
            400, f"temperature must be non-negative, got {temperature}.", param="temperature"
        )
    top_p = _number(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}.", param="top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name)
        if value is not None and not -2 <= value <= 2:
            raise ApiError(400, f"{name} must be in [-2, 2], got {value}.", param=name)
    n = _int(body, "n")
    if n is not None and n != 1:
        raise ApiError(400, "enginesim supports n=1 only.", param="n")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object", param="stream_options")
        if not stream:
            raise ApiError(
                400,
                "Stream options can only be defined when `stream=True`.",
                param="stream_options",
            )
        include_usage = bool(options.get("include_usage", False))
    params = body.get(KV_TRANSFER_PARAMS)
    if params is not None and not isinstance(params, dict):
        raise ApiError(400, "kv_transfer_params must be an object", param=KV_TRANSFER_PARAMS)
    return model, stream, include_usage


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a non-empty string or a list of them", param="stop")
    return tuple(stop)


def _sampling(
    body: dict[str, Any],
    max_tokens: int | None,
    prompt_len: int,
    max_model_len: int,
    default_max: int | None,
) -> SamplingParams:
    if prompt_len == 0:
        raise ApiError(400, "The prompt is empty.", param="prompt")
    if prompt_len >= max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input.",
            param="messages" if "messages" in body else "prompt",
        )
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len if default_max is None else default_max
        max_tokens = min(max_tokens, max_model_len - prompt_len)
    if prompt_len + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the input, "
            f"{max_tokens} in the completion). Please reduce the length of the input or "
            "completion.",
            param="max_tokens",
        )
    min_tokens = _int(body, "min_tokens") or 0
    if min_tokens < 0 or min_tokens > max_tokens:
        raise ApiError(400, "min_tokens must be between 0 and max_tokens", param="min_tokens")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "ignore_eos must be a boolean", param="ignore_eos")
    return SamplingParams(
        max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos, stop=_stop(body)
    )


def encode_text(tokenizer: Tokenizer, text: str, param: str) -> list[int]:
    """Token ids of `text`; text that is not encodable (a lone surrogate, which JSON can carry
    as `\\ud800`) is the client's error, a 400 as vLLM answers (its tokenizer's
    UnicodeEncodeError is a ValueError, which vLLM's server maps to 400 BadRequestError)."""
    try:
        return tokenizer.encode(text)
    except UnicodeEncodeError as exc:
        raise ApiError(400, str(exc), param=param) from None


def _prompt_ids(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return encode_text(tokenizer, prompt, "prompt")
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        if not all(0 <= t < tokenizer.vocab_size for t in prompt):
            raise ApiError(400, "prompt token id out of vocabulary", param="prompt")
        return list(prompt)
    raise ApiError(
        400, "prompt must be a string, a list of token ids, or a batch of one", param="prompt"
    )


def _parsed(
    body: dict[str, Any],
    ids: list[int],
    sampling: SamplingParams,
    stream: bool,
    include_usage: bool,
    model: str,
) -> ParsedRequest:
    """A validated request: its tokens and sampling, and the body's fields every route reads
    the same way (connector params, `cache_salt`, `priority`)."""
    return ParsedRequest(
        ids,
        sampling,
        stream,
        include_usage,
        kv_params_of(body),
        model,
        _cache_salt(body),
        _priority(body),
    )


def parse_completion(
    body: Any, tokenizer: Tokenizer, served_model: str, max_model_len: int
) -> ParsedRequest:
    """Validate a /v1/completions body."""
    model, stream, include_usage = _check_common(body, served_model)
    if "prompt" not in body:
        raise ApiError(400, "prompt is required", param="prompt")
    ids = _prompt_ids(body["prompt"], tokenizer)
    sampling = _sampling(
        body, _int(body, "max_tokens"), len(ids), max_model_len, DEFAULT_COMPLETION_MAX_TOKENS
    )
    return _parsed(body, ids, sampling, stream, include_usage, model)


def parse_chat(
    body: Any, tokenizer: Tokenizer, served_model: str, max_model_len: int, first_line: str = ""
) -> ParsedRequest:
    """Validate a /v1/chat/completions body (the chat template renders, then tokenizes)."""
    model, stream, include_usage = _check_common(body, served_model)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ApiError(400, "messages must be a list", param="messages")
    try:
        text = render_chat(messages, add_generation_prompt=True, first_line=first_line)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    ids = encode_text(tokenizer, text, "messages")
    max_tokens = _int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens")
    sampling = _sampling(body, max_tokens, len(ids), max_model_len, None)
    return _parsed(body, ids, sampling, stream, include_usage, model)
