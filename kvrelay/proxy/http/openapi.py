"""The OpenAPI 3.1 document of the proxy's own API, served at `/openapi.json`.

Engine request bodies are OpenAI's and are passed through, so they are described loosely
(`additionalProperties: true`) with the fields the proxy itself reads or refuses, as
`request_bodies` declares them.
"""

from __future__ import annotations

from typing import Any

from kvrelay import __version__
from kvrelay.proxy.http.request_bodies import request_schemas

_ERROR = {"$ref": "#/components/schemas/Error"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {
        400: "Malformed input (bad JSON, JSON nested deeper than json_max_depth, wrong types, "
        "client kv_transfer_params, a header that is not UTF-8).",
        401: "Missing or wrong API key.",
        404: "Not found.",
        408: "The body did not arrive within body_read_timeout_s.",
        413: "Body larger than body_limit_bytes, or too dense in JSON values to fit "
        "inflight_body_bytes once parsed.",
        429: "Over this API key's limits (rate_limit_exceeded, with Retry-After), or the key is "
        "paused: its recent requests made every engine fail (tenant_paused).",
        502: "An engine failed and no other could take over.",
        503: "No healthy engine, the map is unavailable, or inflight_body_bytes is used up.",
    }
    return {str(c): _json(_ERROR, text[c]) for c in codes}


def _request_body(schema: str) -> dict[str, Any]:
    """A required JSON body of the components' `schema`."""
    ref = {"$ref": f"#/components/schemas/{schema}"}
    return {"required": True, "content": {"application/json": {"schema": ref}}}


def _engine_answer(description: str) -> dict[str, Any]:
    """A 200 that is an engine's answer: JSON, or server-sent events."""
    return {
        "description": description,
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }


def _backend_op(summary: str, status: str, description: str) -> dict[str, Any]:
    """An admin operation on one engine named by a BackendRef body."""
    return {
        "summary": summary,
        "security": [{"admin": []}],
        "requestBody": _request_body("BackendRef"),
        "responses": {
            status: _json({"type": "object"}, description),
            **_errors(400, 401, 404, 408, 413),
        },
    }


def _completion_op(summary: str, schema: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "parameters": [
            {"$ref": "#/components/parameters/RequestId"},
            {"$ref": "#/components/parameters/ConversationId"},
            {"$ref": "#/components/parameters/SessionId"},
        ],
        "requestBody": _request_body(schema),
        "responses": {
            "200": _engine_answer(
                "The engine's answer; JSON, or server-sent events when stream=true."
            ),
            **_errors(400, 401, 408, 413, 429, 502, 503),
        },
    }


def _passthrough_op(summary: str) -> dict[str, Any]:
    return {
        "summary": f"{summary} (passed through to an engine; passthrough_routes)",
        "parameters": [{"$ref": "#/components/parameters/RequestId"}],
        "requestBody": _request_body("Body"),
        "responses": {
            "200": _engine_answer("The engine's answer as it sent it (streams stream)."),
            **_errors(400, 401, 404, 408, 413, 429, 502, 503),
        },
    }


def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kvrelay proxy",
            "version": __version__,
            "description": "OpenAI-compatible proxy for prefill/decode disaggregated serving "
            "with multi-turn KV reuse.",
        },
        "paths": {
            "/v1/chat/completions": {"post": _completion_op("Chat completion", "ChatRequest")},
            "/v1/completions": {"post": _completion_op("Text completion", "CompletionRequest")},
            "/v1/models": {
                "get": {
                    "summary": "Models served by the engines",
                    "responses": {
                        "200": _json({"type": "object"}, "OpenAI model list."),
                        **_errors(401, 503),
                    },
                }
            },
            "/v1/embeddings": {"post": _passthrough_op("Embeddings")},
            "/v1/responses": {"post": _passthrough_op("Responses")},
            "/tokenize": {"post": _passthrough_op("Tokenize (vLLM)")},
            "/detokenize": {"post": _passthrough_op("Detokenize (vLLM)")},
            "/v1/conversations/{conversation_id}": {
                "delete": {
                    "summary": "End a conversation and release the KV it holds",
                    "parameters": [
                        {
                            "name": "conversation_id",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {
                        "200": _json({"type": "object"}, "Deleted."),
                        **_errors(401, 404, 503),
                    },
                }
            },
            "/health": {
                "get": {
                    "summary": "Liveness",
                    "responses": {"200": _json({"type": "object"}, "The proxy is running.")},
                }
            },
            "/ready": {
                "get": {
                    "summary": "Readiness: a healthy P and D",
                    "responses": {
                        "200": _json({"type": "object"}, "Ready."),
                        "503": _json({"type": "object"}, "Not ready."),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "security": [{"metrics": []}, {}],
                    "responses": {
                        "200": {
                            "description": "Prometheus text format.",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        },
                        **_errors(401),
                    },
                }
            },
            "/version": {
                "get": {
                    "summary": "Versions: the proxy's, and each usable engine's (vLLM-style)",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["version", "engines"],
                                "properties": {
                                    "version": {"type": "string"},
                                    "engines": {"type": "array", "items": {"type": "object"}},
                                },
                            },
                            "The proxy's version and the engines' answers.",
                        )
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document",
                    "responses": {"200": _json({"type": "object"}, "OpenAPI document.")},
                }
            },
            "/admin/backends": {
                "get": {
                    "summary": "List engines",
                    "security": [{"admin": []}],
                    "responses": {"200": _json({"type": "object"}, "Pools."), **_errors(401, 404)},
                },
                "post": _backend_op("Add an engine", "201", "Added."),
                "delete": {
                    "summary": "Remove an engine",
                    "security": [{"admin": []}],
                    "parameters": [
                        {"name": "role", "in": "query", "schema": {"type": "string"}},
                        {"name": "url", "in": "query", "schema": {"type": "string"}},
                    ],
                    "responses": {
                        "200": _json({"type": "object"}, "Removed."),
                        **_errors(400, 401, 404, 408, 413),
                    },
                },
            },
            "/admin/backends/drain": {
                "post": _backend_op("Drain an engine (no new requests)", "200", "Draining."),
            },
        },
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "admin": {"type": "http", "scheme": "bearer", "description": "admin_key"},
                "metrics": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "metrics_key (when set)",
                },
            },
            "parameters": {
                "RequestId": {
                    "name": "X-Request-Id",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string", "maxLength": 128},
                    "description": "Sent on both legs; generated when absent.",
                },
                "ConversationId": {
                    "name": "X-Conversation-Id",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string"},
                    "description": "Conversation whose KV may be reused.",
                },
                "SessionId": {
                    "name": "X-Session-ID",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string"},
                    "description": (
                        "Conversation id when neither X-Conversation-Id nor the body's "
                        "conversation_id is given."
                    ),
                },
            },
            "schemas": {
                **request_schemas(),
                "Body": {
                    "type": "object",
                    "additionalProperties": True,
                    "properties": {"model": {"type": "string"}},
                },
                "BackendRef": {
                    "type": "object",
                    "required": ["role", "url"],
                    "properties": {
                        "role": {"enum": ["prefill", "decode"]},
                        "url": {"type": "string"},
                    },
                },
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "param": {"type": ["string", "null"]},
                                "code": {"type": ["string", "null"]},
                            },
                        }
                    },
                },
            },
        },
        "security": [{"bearer": []}, {}],
    }
