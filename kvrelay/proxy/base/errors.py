"""OpenAI-shaped error responses.

Every failure the proxy reports has the shape `{"error": {"message", "type", "param", "code"}}`
and a message a person can act on (what was wrong and what to do). `ProxyError` carries that
from wherever it is raised to the route, which turns it into a response.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


class ProxyError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.type = type or default_type(status)
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return json_response(self.body(), self.status, {**self.headers, **(headers or {})})


def default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 413:
        return "request_too_large"
    if status == 429:
        return "rate_limit_error"
    if 400 <= status < 500:
        return "invalid_request_error"
    return "server_error"


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def json_response(
    payload: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=json.dumps(payload, separators=(",", ":")).encode(),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param, code=code)


def upstream_error_from_body(status: int, raw: bytes, role: str) -> ProxyError:
    """An engine's own 4xx error, passed on with its message (it describes the client's input)."""
    message = f"the {role} engine rejected the request (HTTP {status})"
    param = code = None
    try:
        data = json.loads(raw)
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            message = err["message"]
            param = err.get("param") if isinstance(err.get("param"), str) else None
            code = err.get("code") if isinstance(err.get("code"), str) else None
        elif isinstance(err, str):
            message = err
        elif isinstance(data, dict) and isinstance(data.get("message"), str):
            message = data["message"]
    except (ValueError, AttributeError):
        if raw:
            message = f"{message}: {raw[:300].decode(errors='replace')}"
    return ProxyError(status, message, param=param, code=code)
