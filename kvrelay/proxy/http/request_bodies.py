"""What the completion routes accept of a request body, declared once: `ChatRequest` and
`CompletionRequest`, the fields the proxy itself reads or refuses (the rest of OpenAI's and
vLLM's fields pass through to the engines, which check them).

These declarations are the source of the bodies' schemas in `/openapi.json`
(`request_schemas`). The request path does not validate with them: `validation.py` checks the
same rules by hand, because pydantic, which copies every message of a chat into a new dict, is
slower on every body measured, 3.6x on a chat of 41 messages (bench/request_checks.py). A test
holds the two to the same verdict on generated bodies (tests/proxy/test_request_bodies.py).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, NotRequired

from pydantic import (
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    TypeAdapter,
    with_config,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema
from typing_extensions import TypedDict

from kvrelay.proxy.tenants import MAX_SALT_CHARS, SALT_PATTERN
from kvrelay.proxy.turn import FINGERPRINT_PREFIX, MAX_ID_LEN

# Token ids are packed as signed 64-bit integers where the proxy digests a prompt; no
# vocabulary comes near this, and the engine refuses ids outside its own.
TOKEN_ID_LIMIT = 1 << 63


class _Refused:
    """A field no client may send: any value is refused (JSON Schema `not: {}`)."""

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        def refuse(value: Any) -> Any:
            raise PydanticCustomError("refused", "set by the proxy; clients cannot send it")

        return core_schema.no_info_plain_validator_function(refuse)

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {"not": {}}


_STRICT = ConfigDict(extra="allow", strict=True)
_Count = Annotated[int, Field(ge=1)]
_TokenId = Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]
_Salt = Annotated[str, Field(min_length=1, max_length=MAX_SALT_CHARS, pattern=SALT_PATTERN)]


@with_config(_STRICT)
class _Common(TypedDict):
    model: NotRequired[Annotated[str, Field(description="Checked against the engines' models.")]]
    stream: NotRequired[bool | None]
    stream_options: NotRequired[dict[str, Any] | None]
    max_tokens: NotRequired[_Count | None]
    max_completion_tokens: NotRequired[_Count | None]
    n: NotRequired[_Count | None]
    cache_salt: NotRequired[
        Annotated[
            _Salt | None,
            Field(description="The engines' prefix-cache salt; combined with the tenant's."),
        ]
    ]
    kv_transfer_params: NotRequired[
        Annotated[_Refused, Field(description="Set by the proxy; refused from clients.")]
    ]
    conversation_id: NotRequired[
        Annotated[
            str | None,
            Field(
                description=(
                    "Conversation id (below X-Conversation-Id, above X-Session-ID); not "
                    f"forwarded. Not blank; trimmed, at most {MAX_ID_LEN} characters, not "
                    f"starting with {FINGERPRINT_PREFIX!r}."
                )
            ),
        ]
    ]


@with_config(_STRICT)
class Message(TypedDict):
    """One chat message: the proxy reads its role; the engine checks the rest."""

    role: str


@with_config(_STRICT)
class ChatRequest(_Common):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[Message], Field(min_length=1)]


@with_config(_STRICT)
class CompletionRequest(_Common):
    """`POST /v1/completions`: a text, texts, token ids, or token-id prompts."""

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[_TokenId], Field(min_length=1)]
        | Annotated[list[list[_TokenId]], Field(min_length=1)]
    )


@functools.cache
def adapters() -> dict[str, TypeAdapter[Any]]:
    """The declarations as pydantic adapters, by schema name (built once, on first use)."""
    return {
        "ChatRequest": TypeAdapter(ChatRequest),
        "CompletionRequest": TypeAdapter(CompletionRequest),
    }


def request_schemas() -> dict[str, Any]:
    """JSON Schemas of the request bodies and what they refer to, by name, for the OpenAPI
    document's `components.schemas`."""
    schemas: dict[str, Any] = {}
    for name, adapter in adapters().items():
        schema = adapter.json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[name] = schema
    return schemas
