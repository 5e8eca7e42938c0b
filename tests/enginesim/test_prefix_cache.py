"""The engine's prefix cache, which lives in the KV pool as vLLM's does, driven inline (no HTTP,
no connector): a prompt that extends an earlier request shares its cached blocks and computes
only the new part; cached blocks are free blocks until an allocation takes them; a block in
use (a running or held request's) is never evicted; answers stay the reference's."""

from __future__ import annotations

import random

from kvrelay.enginesim.config import EngineConfig
from kvrelay.enginesim.engine import EngineCore, run_to_completion
from kvrelay.enginesim.kvpool import BlockPool
from kvrelay.enginesim.model import ModelGeometry
from kvrelay.enginesim.reference import reference_completion
from kvrelay.enginesim.request import Output, SamplingParams, SimRequest
from kvrelay.enginesim.residency import BlockResidency
from kvrelay.enginesim.tokenizer import get_tokenizer
from tests.enginesim.fakes import ModelledClock

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
    config = EngineConfig(enable_prefix_caching=True)
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
    # The cache is the pool's free blocks: nothing is held apart from it.
    assert core.pool.num_free == config.num_blocks and core.pool.num_cached > 0


def test_off_by_default_and_bounded_by_the_pool_itself() -> None:
    core = EngineCore(EngineConfig())
    _complete(core, "r1", HISTORY)
    _complete(core, "r2", HISTORY + "more")
    assert core.counters["prompt_tokens_cached"] == 0 and core.pool.num_cached == 0
    # A pool of 8 blocks: whatever one request cached is evicted by the next one's blocks.
    small = EngineCore(EngineConfig(enable_prefix_caching=True, num_blocks=8, max_model_len=120))
    _complete(small, "r1", HISTORY[:200])
    assert small.pool.num_cached > 0
    _complete(small, "r2", "Something else entirely, with nothing in common at all. " * 3)
    _complete(small, "r3", HISTORY[:200])
    assert small.counters["prompt_tokens_cached"] < len(get_tokenizer().encode(HISTORY[:200]))
    assert small.pool.evictions > 0


def test_a_block_in_use_is_shared_never_evicted_and_a_freed_one_is_until_taken() -> None:
    # vLLM's rules, on the pool alone: a hit shares a cached block (reference count), so no
    # allocation can take it while anyone uses it; freed, it stays findable until an
    # allocation takes it, the least recently freed first.
    pool = BlockPool(4, 4, ModelGeometry(), prefix_caching=True)
    a = pool.allocate(2)
    assert a is not None
    pool.cache(a[0], "k0")
    pool.cache(a[1], "k1")
    assert pool.cached_prefix(["k0", "k1", "k2"]) == a
    pool.share(a)  # a second request hits them
    pool.free(a)  # the first one finishes: still used by the second
    assert pool.num_free == 2 and pool.allocate(3) is None
    other = pool.allocate(2)
    assert other is not None and pool.cached_prefix(["k0", "k1"]) == a  # untouched
    pool.free(a)  # the second finishes: free, and still cached
    assert pool.num_free == 2 and pool.cached_prefix(["k0", "k1"]) == a
    taken = pool.allocate(1)  # the request's tail was freed first: k1's block goes first
    assert taken == [a[1]] and pool.cached_prefix(["k0", "k1"]) == [a[0]]
    assert pool.evictions == 1


def test_a_held_block_is_not_free_and_its_holder_hits_it() -> None:
    # What a held block means for the cache (the connector keeps a finished request's blocks
    # for a later turn): it is not free, so no allocation takes it, and a decode-only turn on
    # the holder finds the held history there.
    pool = BlockPool(4, 4, ModelGeometry(), prefix_caching=True)
    held = pool.allocate(2)
    assert held is not None
    pool.cache(held[0], "h0")
    pool.cache(held[1], "h1")
    filler = pool.allocate(2)
    assert filler is not None and pool.allocate(1) is None  # the held blocks are not free
    pool.free(filler)
    again = pool.allocate(2)
    assert again is not None and sorted(again) == sorted(filler)
    assert pool.cached_prefix(["h0", "h1"]) == held


def test_requests_share_cached_blocks_only_under_the_same_cache_salt() -> None:
    # vLLM's cache_salt: one tenant's prompt never hits another's blocks, and the answer does
    # not depend on the salt (only what is cached does).
    core = EngineCore(EngineConfig(enable_prefix_caching=True))
    answer = _complete(core, "a1", HISTORY, salt="tenant-a")
    assert _complete(core, "b1", HISTORY, salt="tenant-b") == answer
    assert _complete(core, "n1", HISTORY) == answer
    assert core.counters["prompt_tokens_cached"] == 0
    assert _complete(core, "a2", HISTORY, salt="tenant-a") == answer
    assert core.counters["prompt_tokens_cached"] > 0


def test_residency_metrics_observe_a_blocks_idle_time_since_its_last_hit_when_it_is_evicted() -> (
    None
):
    # vLLM's `--kv-cache-metrics` at sample 1.0: a block's idle time runs from its allocation
    # or its last prefix-cache hit to the allocation that takes it again.
    clock = ModelledClock()
    pool = BlockPool(2, 4, ModelGeometry(), prefix_caching=True)
    pool.residency = BlockResidency(1.0, clock.clock)
    a = pool.allocate(2)
    assert a is not None
    pool.cache(a[0], "k0")
    pool.cache(a[1], "k1")
    pool.free(a)
    clock.now += 5  # k1 untouched since its allocation; k0 hit 5 s in, freed again
    pool.share([a[0]])
    pool.free([a[0]])
    clock.now += 2
    assert pool.allocate(1) == [a[1]]  # evicted after 7 s idle
    clock.now += 1
    assert pool.allocate(1) == [a[0]]  # evicted 3 s after its hit
    idle = pool.residency.idle_before_evict
    assert idle.count == 2 and idle.sum == 10.0
    assert dict(idle.cumulative())["2.0"] == 0 and dict(idle.cumulative())["5.0"] == 1
    assert dict(idle.cumulative())["10.0"] == 2


def test_residency_metrics_follow_only_the_sampled_share_of_blocks() -> None:
    pool = BlockPool(64, 4, ModelGeometry(), prefix_caching=True)
    pool.residency = BlockResidency(0.25, ModelledClock().clock, random.Random(1))
    for _ in range(40):  # every allocation takes the whole pool again: 64 evictions a round
        blocks = pool.allocate(64)
        assert blocks is not None
        pool.free(blocks)
    observed = pool.residency.idle_before_evict.count
    assert 0.15 * 39 * 64 < observed < 0.35 * 39 * 64
