"""The client-facing HTTP side: the aiohttp application and its routes, admin API, pass-through
routes, keys and admission, body and header reading, request validation, OpenAPI, and the
server process (uvloop, workers, supervisor). `app` is exported as a module too: the bench's
feature switches replace its collaborators by name (`bench/_features_off.py`).
"""

from kvrelay.proxy.http import app
from kvrelay.proxy.http.app import create_app
from kvrelay.proxy.http.auth import key_matches, presented_key
from kvrelay.proxy.http.body import (
    BodyBudget,
    HeldBody,
    nesting_exceeds,
    parse_json_body,
    parse_json_object,
    parsed_size_bound,
)
from kvrelay.proxy.http.openapi import openapi_document
from kvrelay.proxy.http.protocol_errors import ShapedErrorsRequestHandler
from kvrelay.proxy.http.server import GC_YOUNG_THRESHOLD, ProtocolErrorFilter, serve, tune_gc
from kvrelay.proxy.http.validation import validate_chat, validate_completion

__all__ = [
    "GC_YOUNG_THRESHOLD",
    "BodyBudget",
    "HeldBody",
    "ProtocolErrorFilter",
    "ShapedErrorsRequestHandler",
    "app",
    "create_app",
    "key_matches",
    "nesting_exceeds",
    "openapi_document",
    "parse_json_body",
    "parse_json_object",
    "parsed_size_bound",
    "presented_key",
    "serve",
    "tune_gc",
    "validate_chat",
    "validate_completion",
]
