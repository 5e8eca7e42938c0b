"""Malformed HTTP answered like any other bad input: an OpenAI-shaped JSON error.

aiohttp's parser refuses a malformed request (a request line or query past its limits, control
bytes in a header, Content-Length with Transfer-Encoding, an unknown method, a body encoding it
cannot decode) before any route or middleware runs, and its connection handler answers with a
text/plain 400. The proxy's handler keeps aiohttp's logging (one WARNING line through
`server.ProtocolErrorFilter`) and closing of the connection and changes only the body.
`install()` makes aiohttp's server build this handler; it runs once in each worker process,
which serves nothing but the proxy.
"""

from __future__ import annotations

from aiohttp import web_protocol, web_server
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

from kvrelay.proxy.base import ProxyError

_DETAIL_MAX = 200


class ShapedErrorsRequestHandler(web_protocol.RequestHandler):
    """aiohttp's connection handler, with its own error answers OpenAI-shaped."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if already answering
        if 400 <= status < 500:
            detail = " ".join(str(message or "").split())[:_DETAIL_MAX]
            error = ProxyError(
                status,
                "malformed HTTP request"
                + (f" ({detail})" if detail else "")
                + "; send a well-formed HTTP/1.1 request",
                code="malformed_request",
            )
        else:
            error = ProxyError(
                status,
                "the proxy failed on this request; retry, or report it",
                code="internal_error",
            )
        response = error.response()
        response.force_close()
        return response


def install() -> None:
    """Have aiohttp's server in this process use `ShapedErrorsRequestHandler`."""
    # Server.__call__ builds its handler from this module-level name at each connection; aiohttp
    # has no public hook for its own error pages (pinned by tests/test_private_apis.py).
    setattr(web_server, "RequestHandler", ShapedErrorsRequestHandler)  # noqa: B010
