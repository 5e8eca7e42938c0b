"""In-process, non-disaggregated reference: the same tokenizer, template and model, no HTTP.

Tests compare engine outputs with these. Both run the real `EngineCore` (single engine, no
connector), so "the same as a single engine" is checked against the same code path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvrelay.enginesim.chat import render_chat
from kvrelay.enginesim.config import EngineConfig
from kvrelay.enginesim.engine import EngineCore, run_to_completion
from kvrelay.enginesim.request import Output, SamplingParams, SimRequest
from kvrelay.enginesim.tokenizer import get_tokenizer


def _run(prompt_ids: list[int], max_tokens: int, config: EngineConfig, **sampling: Any) -> str:
    core = EngineCore(config)
    outputs: list[Output] = []
    req = SimRequest(
        request_id="reference",
        client_request_id="reference",
        prompt_token_ids=prompt_ids,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),
        kv_transfer_params=None,
        sink=outputs.append,
    )
    core.add_request(req)
    run_to_completion(core, lambda: bool(outputs) and outputs[-1].finished)
    if outputs[-1].error is not None:
        raise RuntimeError(outputs[-1].error.message)
    return "".join(o.text for o in outputs)


def reference_completion(
    prompt: str | Sequence[int],
    max_tokens: int,
    config: EngineConfig | None = None,
    **sampling: Any,
) -> str:
    """What a single engine answers to `/v1/completions` with this prompt."""
    config = config or EngineConfig()
    ids = get_tokenizer().encode(prompt) if isinstance(prompt, str) else list(prompt)
    return _run(ids, max_tokens, config, **sampling)


def reference_chat(
    messages: Sequence[Mapping[str, Any]],
    max_tokens: int,
    config: EngineConfig | None = None,
    **sampling: Any,
) -> str:
    """What a single engine answers to `/v1/chat/completions` with these messages."""
    config = config or EngineConfig()
    return _run(get_tokenizer().encode(render_chat(messages)), max_tokens, config, **sampling)
