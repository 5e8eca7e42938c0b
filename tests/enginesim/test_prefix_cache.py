"""The engine's local prefix cache, driven inline (no HTTP, no connector): a prompt that
extends an earlier request computes only its new part, and answers stay the reference's."""

from __future__ import annotations

from kvrelay.enginesim.config import EngineConfig
from kvrelay.enginesim.engine import EngineCore, run_to_completion
from kvrelay.enginesim.reference import reference_completion
from kvrelay.enginesim.request import Output, SamplingParams, SimRequest
from kvrelay.enginesim.tokenizer import get_tokenizer

HISTORY = "The cache keeps whole blocks of the prompt so that the next turn can skip them. " * 4


def _complete(
    core: EngineCore, rid: str, prompt: str, max_tokens: int = 8, salt: str | None = None
) -> str:
    outputs: list[Output] = []
    core.add_request(SimRequest(
        request_id=rid, client_request_id=rid, prompt_token_ids=get_tokenizer().encode(prompt),
        sampling=SamplingParams(max_tokens=max_tokens), kv_transfer_params=None,
        sink=outputs.append, cache_salt=salt,
    ))  # fmt: skip
    run_to_completion(core, lambda: bool(outputs) and outputs[-1].finished)
    return "".join(o.text for o in outputs)


def test_a_prompt_extending_a_cached_one_computes_only_the_rest() -> None:
    config = EngineConfig(prefix_cache_blocks=64)
    core = EngineCore(config)
    bs = config.block_size
    first = _complete(core, "r1", HISTORY)
    assert first == reference_completion(HISTORY, 8)
    n_first = len(get_tokenizer().encode(HISTORY))
    assert core.counters["prompt_tokens_cached"] == 0
    follow_up = HISTORY + first + " And then?"
    n_follow = len(get_tokenizer().encode(follow_up))
    computed = core.counters["prompt_tokens_computed"]
    assert _complete(core, "r2", follow_up) == reference_completion(follow_up, 8)
    cached = core.counters["prompt_tokens_cached"]
    # At least the first prompt's full blocks were found; everything else was computed.
    assert cached >= (n_first // bs) * bs and cached % bs == 0
    assert core.counters["prompt_tokens_computed"] - computed == n_follow - cached
    assert core.pool.num_free == config.num_blocks  # the cache holds copies, not pool blocks


def test_the_cache_is_bounded_and_off_by_default() -> None:
    core = EngineCore(EngineConfig())
    _complete(core, "r1", HISTORY)
    _complete(core, "r2", HISTORY + "more")
    assert core.counters["prompt_tokens_cached"] == 0 and len(core.prefix_cache) == 0
    small = EngineCore(EngineConfig(prefix_cache_blocks=2))
    _complete(small, "r1", HISTORY)
    assert len(small.prefix_cache) == 2


def test_requests_share_cached_blocks_only_under_the_same_cache_salt() -> None:
    # vLLM's cache_salt: one tenant's prompt never hits another's blocks, and the answer does
    # not depend on the salt (only what is cached does).
    core = EngineCore(EngineConfig(prefix_cache_blocks=64))
    answer = _complete(core, "a1", HISTORY, salt="tenant-a")
    assert _complete(core, "b1", HISTORY, salt="tenant-b") == answer
    assert _complete(core, "n1", HISTORY) == answer
    assert core.counters["prompt_tokens_cached"] == 0
    assert _complete(core, "a2", HISTORY, salt="tenant-a") == answer
    assert core.counters["prompt_tokens_cached"] > 0
