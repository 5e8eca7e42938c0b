"""The chat template shared by every enginesim instance (ChatML-like).

Rendered to text and then tokenized (special-token strings become special ids), the way
`apply_chat_template(..., tokenize=True)` works, so the text of an earlier assistant reply is
re-tokenized from scratch when it comes back as history.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class ChatTemplateError(ValueError):
    """A message the template cannot render (bad role or content)."""


def message_text(content: Any) -> str:
    """The text of a message's `content`: a string, null, or a list of `{"type": "text"}` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ChatTemplateError("only text content parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatTemplateError("a text content part needs a string 'text'")
            texts.append(text)
        return "".join(texts)
    raise ChatTemplateError("message content must be a string, a list of parts or null")


def render_chat(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, first_line: str = ""
) -> str:
    """Render `messages` to the prompt text (special tokens as their strings); `first_line`
    ("{messages}": their number) comes first, as a template that prints the date puts it."""
    if not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    out: list[str] = (
        [first_line.replace("{messages}", str(len(messages))) + "\n"] if first_line else []
    )
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError("each message must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"unknown message role {role!r}")
        out.append(f"<|im_start|>{role}\n{message_text(message.get('content'))}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)
