"""Chunked prefill, as vLLM's V1 scheduler does it: each step schedules the running decodes
(one token each) first, then prefill chunks within what is left of `max_num_batched_tokens`.

A long prompt is prefilled over several steps while the engine's decoding requests keep
producing a token every step; answers do not depend on the chunking; the cost model is fed
each chunk with the context before it; remote KV is loaded once and only the remainder is
computed, in chunks; preemption and aborts in the middle of a prefill free the blocks once.
Time is the engine's modelled clock (a fake `wait` that advances a fake `clock`), never sleeps.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvrelay.devtools import EngineFactory
from kvrelay.enginesim.cli import build_parser, config_from_args
from kvrelay.enginesim.config import EngineConfig
from kvrelay.enginesim.costs import get_profile
from kvrelay.enginesim.engine import EngineCore, run_to_completion
from kvrelay.enginesim.reference import reference_completion
from kvrelay.enginesim.request import Output, SamplingParams, SimRequest
from tests.enginesim.fakes import FakeLoadingHost, ModelledClock
from tests.enginesim.test_pd import PROMPT, Delta, decode, prefill, text_of

PROFILE = "llama3-8b-h100"


class Recorder:
    """A request's sink: its outputs, each with the modelled time it was produced at."""

    def __init__(self, clock: ModelledClock) -> None:
        self.clock = clock
        self.outputs: list[Output] = []
        self.times: list[float] = []

    def __call__(self, out: Output) -> None:
        self.outputs.append(out)
        self.times.append(self.clock.now)

    @property
    def finished(self) -> bool:
        return bool(self.outputs) and self.outputs[-1].finished

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)


def _request(rid: str, prompt: list[int], max_tokens: int, sink: Any) -> SimRequest:
    return SimRequest(
        request_id=rid, client_request_id=rid, prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        kv_transfer_params=None, sink=sink,
    )  # fmt: skip


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(i * 7 + seed) % 200 + 3 for i in range(n)]


def _core(clock: ModelledClock, budget: int, **kw: Any) -> EngineCore:
    cfg = EngineConfig(
        cost_profile=PROFILE, num_blocks=kw.pop("num_blocks", 512),
        max_model_len=kw.pop("max_model_len", 4096),
        max_num_batched_tokens=budget, max_num_seqs=kw.pop("max_num_seqs", 8), **kw,
    )  # fmt: skip
    return EngineCore(cfg, wait=clock.wait, clock=clock.clock)


def _step(core: EngineCore) -> None:
    core.step()
    core.deliver_outputs()


def test_a_long_prompt_alone_is_prefilled_over_ceil_n_over_budget_steps() -> None:
    clock, budget, n = ModelledClock(), 256, 1000
    core = _core(clock, budget)
    out = Recorder(clock)
    core.add_request(_request("long", _prompt(n), 1, out))
    steps = 0
    while not out.outputs:
        _step(core)
        steps += 1
    assert steps == math.ceil(n / budget) == 4
    # Each step fed the cost model its chunk and the context already in KV before it.
    profile = get_profile(PROFILE)
    chunks = [(256, 0), (256, 256), (256, 512), (232, 768)]
    assert clock.waits == pytest.approx([profile.prefill_time(c, ctx) for c, ctx in chunks])
    assert out.finished and core.pool.num_free == 512
    assert core.counters["prompt_tokens_computed"] == n
    assert core.counters["prefill_chunks"] == 4


def test_decodes_keep_a_token_every_step_while_a_long_prompt_prefills() -> None:
    clock, budget, n = ModelledClock(), 256, 1000
    core = _core(clock, budget)
    short, long = Recorder(clock), Recorder(clock)
    short_prompt = _prompt(40, 1)
    core.add_request(_request("short", short_prompt, 12, short))
    _step(core)  # prefilled, first token out
    assert len(short.outputs) == 1
    clock.waits.clear()
    core.add_request(_request("long", _prompt(n), 1, long))
    prefill_steps = 0
    while not long.outputs:
        _step(core)
        prefill_steps += 1
        # The decoding request got its token in every one of these steps.
        assert len(short.outputs) == 1 + prefill_steps
    # The decode takes one token of the budget each step; the prompt gets the rest.
    assert prefill_steps == math.ceil(n / (budget - 1)) == 4
    profile = get_profile(PROFILE)
    expected = [
        profile.step_time([(255, 0)], [41]),
        profile.step_time([(255, 255)], [42]),
        profile.step_time([(255, 510)], [43]),
        profile.step_time([(235, 765)], [44]),
    ]
    assert clock.waits == pytest.approx(expected)
    # The short request's inter-token gaps were one step each, never the whole prefill.
    gaps = [b - a for a, b in zip(short.times, short.times[1:], strict=False)]
    assert gaps == pytest.approx(expected)
    assert max(gaps) < profile.prefill_time(n) / 2
    run_to_completion(core, lambda: short.finished and long.finished)
    assert short.text == reference_completion(short_prompt, 12, ignore_eos=True)
    assert long.text == reference_completion(_prompt(n), 1, ignore_eos=True)


@pytest.mark.parametrize("budget", [8, 50, 300, 8192])
def test_answers_do_not_depend_on_the_chunking(budget: int) -> None:
    clock = ModelledClock()
    core = _core(clock, budget, enable_prefix_caching=True)
    prompts = [_prompt(700, 1), _prompt(90, 2), _prompt(300, 3), _prompt(5, 4)]
    recs = [Recorder(clock) for _ in prompts]
    for i, (prompt, rec) in enumerate(zip(prompts, recs, strict=True)):
        core.add_request(_request(f"r{i}", prompt, 20, rec))
        _step(core)
    run_to_completion(core, lambda: all(r.finished for r in recs))
    # A prompt that starts with a finished one's: its prefix-cache hit, then chunks of the rest.
    prompts.append(_prompt(700, 1) + _prompt(150, 5))
    recs.append(Recorder(clock))
    core.add_request(_request("hit", prompts[-1], 20, recs[-1]))
    run_to_completion(core, lambda: recs[-1].finished)
    assert core.counters["prompt_tokens_cached"] == 688
    for prompt, rec in zip(prompts, recs, strict=True):
        assert rec.text == reference_completion(prompt, 20, ignore_eos=True)
    assert core.pool.num_free == 512 and not core.has_work
    # Every prompt token is counted once, as computed or found in the prefix cache.
    c = core.counters
    assert c["prompt_tokens_computed"] + c["prompt_tokens_cached"] == sum(map(len, prompts))


def test_blocks_are_allocated_for_each_chunk_not_the_whole_prompt() -> None:
    clock = ModelledClock()
    core = _core(clock, 64)
    core.add_request(_request("long", _prompt(1000), 1, Recorder(clock)))
    core.step()
    # 64 tokens computed: 4 blocks of 16, not the prompt's 63.
    assert core.pool.num_free == 512 - 4
    core.step()
    assert core.pool.num_free == 512 - 8


def test_preemption_in_the_middle_of_a_prefill_recomputes_and_frees_once() -> None:
    clock = ModelledClock()
    # 40 blocks (640 tokens): a 300-token decoder and a 500-token prompt do not both fit.
    core = _core(clock, 64, num_blocks=40, max_model_len=640)
    first, second = Recorder(clock), Recorder(clock)
    p1, p2 = _prompt(300, 1), _prompt(500, 2)
    core.add_request(_request("first", p1, 60, first))
    core.add_request(_request("second", p2, 10, second))
    run_to_completion(core, lambda: first.finished and second.finished)
    assert core.counters["preemptions"] >= 1
    assert first.text == reference_completion(p1, 60, ignore_eos=True)
    assert second.text == reference_completion(p2, 10, ignore_eos=True)
    assert core.pool.num_free == 40 and not core.has_work
    # Recomputation after a preemption is not counted as prompt work twice.
    assert core.counters["prompt_tokens_computed"] == 800


def test_an_abort_in_the_middle_of_a_prefill_frees_its_blocks_once() -> None:
    clock = ModelledClock()
    core = _core(clock, 64)
    core.add_request(_request("long", _prompt(1000), 1, Recorder(clock)))
    core.step()
    core.step()
    assert core.pool.num_free < 512
    core.abort("long")
    assert core.pool.num_free == 512 and not core.has_work
    core.step()
    assert core.pool.num_free == 512


def test_loaded_kv_is_not_recomputed_and_the_remainder_is_chunked() -> None:
    clock, loaded = ModelledClock(), 1600
    cfg = EngineConfig(
        cost_profile=PROFILE, num_blocks=512, max_model_len=4096, max_num_batched_tokens=64,
        max_num_seqs=8,
    )  # fmt: skip
    host = FakeLoadingHost(loaded)
    core = EngineCore(cfg, host, wait=clock.wait, clock=clock.clock)
    out = Recorder(clock)
    core.add_request(_request("r", _prompt(1700), 1, out))
    # The load's blocks cover what arrives (100 blocks of 16), not the prompt yet.
    core.step()
    assert host.alloc_blocks == [100]
    for _ in range(1000):
        if out.finished:
            break
        if not core.running:
            clock.now += 0.01  # the engine idles (polls) while the modelled transfer runs
        _step(core)
    profile = get_profile(PROFILE)
    # Modelled transfer waits happen on the clock, not through `wait`: only the two chunks of
    # the 100 tokens beyond the load were computed, on the loaded context.
    assert clock.waits == pytest.approx(
        [profile.prefill_time(64, 1600), profile.prefill_time(36, 1664)]
    )
    assert out.outputs[-1].loaded_tokens == loaded
    assert core.counters["prompt_tokens_computed"] == 100
    assert core.pool.num_free == 512


def test_the_budget_is_an_engine_flag_with_vllms_default() -> None:
    parser = build_parser()
    assert config_from_args(parser.parse_args([])).max_num_batched_tokens == 8192
    told = config_from_args(parser.parse_args(["--max-num-batched-tokens", "512"]))
    assert told.max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0).validate()
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_batched_tokens=32, max_num_seqs=64).validate()


# ----- P and D over real NIXL, both chunking -----------------------------------------------------
@pytest.mark.nixl
def test_p_and_d_both_chunking_answer_as_one_engine_with_reuse(
    engine_factory: EngineFactory,
) -> None:
    args = ["--max-num-batched-tokens", "32", "--max-num-seqs", "8"]
    d_args = [*args, "--enable-prefix-caching"]
    p, d = engine_factory.many(("P-chunk", args), ("D-chunk", d_args))
    prompt = " ".join([PROMPT] * 3)
    body = {"prompt": prompt, "max_tokens": 40, "ignore_eos": True}
    dp, dd = Delta(p), Delta(d)
    params = prefill(p, "c1", body)
    status, resp = decode(d, "c1", body, {**params, "hold_blocks": True})
    assert status == 200, resp
    assert text_of(resp) == reference_completion(prompt, 40, ignore_eos=True)
    n = resp["usage"]["prompt_tokens"]
    # P computed the prompt in chunks of the budget; D loaded all but the last token.
    assert dp("enginesim_prompt_tokens_computed_total") == n
    assert dp("enginesim_prefill_chunks_total") == math.ceil(n / 32)
    assert dd("enginesim_prompt_tokens_loaded_total") == n - 1

    # Turn two: P pulls the first turn's KV back from D's hold and computes only the new
    # tokens, in chunks, then D loads it all again.
    held = resp["kv_transfer_params"]
    prompt2 = prompt + text_of(resp) + " " + " ".join([PROMPT] * 2)
    body2 = {"prompt": prompt2, "max_tokens": 20, "ignore_eos": True}
    dp2 = Delta(p)
    p_leg = {**held, "do_remote_decode": True, "do_remote_prefill": False}
    params2 = prefill(p, "c2", {**body2, "kv_transfer_params": p_leg})
    status, resp2 = decode(d, "c2", body2, params2)
    assert status == 200, resp2
    long_context = EngineConfig(num_blocks=2048, max_model_len=8192)
    assert text_of(resp2) == reference_completion(prompt2, 20, long_context, ignore_eos=True)
    pulled = dp2("enginesim_prompt_tokens_loaded_total")
    computed = dp2("enginesim_prompt_tokens_computed_total")
    n2 = resp2["usage"]["prompt_tokens"]
    assert pulled > 0 and pulled + computed == n2
    assert computed > 32  # the remainder really spans several chunks
    assert dp2("enginesim_prefill_chunks_total") == math.ceil(computed / 32)

    # Turn three straight to D (a decode-only turn): its prefix cache has turn two's prompt,
    # and D computes the rest in chunks.
    prompt3 = prompt2 + text_of(resp2) + " " + PROMPT
    dd3 = Delta(d)
    status, resp3 = d.request("/v1/completions", {"prompt": prompt3, "max_tokens": 10,
                                                  "ignore_eos": True})  # fmt: skip
    assert status == 200, resp3
    assert text_of(resp3) == reference_completion(prompt3, 10, long_context, ignore_eos=True)
    cached = dd3("enginesim_prompt_tokens_cached_total")
    computed3 = dd3("enginesim_prompt_tokens_computed_total")
    assert cached > 0 and cached + computed3 == resp3["usage"]["prompt_tokens"]
    assert computed3 > 32
    assert dd3("enginesim_prefill_chunks_total") == math.ceil(computed3 / 32)
    p.wait_idle(timeout=10)
    d.wait_idle(timeout=10)


def test_inter_token_gaps_count_the_prefill_steps_a_decode_shared() -> None:
    """vLLM's `vllm:inter_token_latency_seconds`: one gap per output token after a request's
    first, as long as the step that produced it; a prefill chunk in the step lengthens it."""
    clock, budget = ModelledClock(), 2048
    core = _core(clock, budget)
    short, long = Recorder(clock), Recorder(clock)
    core.add_request(_request("short", _prompt(40, 1), 6, short))
    _step(core)  # first token: no gap yet
    assert core.token_gaps.count == 0
    _step(core)
    decode_only = clock.waits[-1]
    core.add_request(_request("long", _prompt(3000), 1, long))
    _step(core)  # a decode sharing its step with a 2047-token chunk
    shared = clock.waits[-1]
    assert shared > 5 * decode_only
    assert core.token_gaps.count == 2
    assert core.token_gaps.sum == pytest.approx(decode_only + shared)
    # Prometheus' cumulative buckets: the decode-only gap under 10 ms, the shared one not.
    buckets = dict(core.token_gaps.cumulative())
    assert decode_only < 0.01 < shared
    assert buckets["0.01"] == 1 and buckets["+Inf"] == 2


def test_a_preempted_prefill_resumes_from_the_full_blocks_it_had_computed() -> None:
    """vLLM caches a prefill's full blocks as they are computed and admits a preempted request
    again like a new one, local prefix hit first: only what lay beyond its last full block is
    computed again. Recomputed from the start, a long prompt preempted over and over (its
    engine's decoders keep growing) would never get through its prefill, and every request
    queued behind it would wait with it."""
    clock = ModelledClock()
    # 40 blocks (640 tokens): a 300-token decoder and a 500-token prompt do not both fit.
    core = _core(clock, 64, num_blocks=40, max_model_len=640, enable_prefix_caching=True)
    first, second = Recorder(clock), Recorder(clock)
    p1, p2 = _prompt(300, 1), _prompt(500, 2)
    core.add_request(_request("first", p1, 60, first))
    req = _request("second", p2, 10, second)
    core.add_request(req)
    computed = 0  # positions of `second` in KV after the last step it ran
    resumed: list[tuple[int, int]] = []  # (computed when preempted, computed once resumed)
    preempted_at: int | None = None
    for _ in range(10_000):
        if first.finished and second.finished:
            break
        _step(core)
        if req.preempted and preempted_at is None:
            preempted_at = computed
        elif preempted_at is not None and "second" in core.running:
            resumed.append((preempted_at, req.num_computed))
            preempted_at = None
        computed = req.num_computed
    assert core.counters["preemptions"] >= 1 and resumed
    for lost_at, after in resumed:
        # Its full blocks came back from the prefix cache; the step that resumed it then
        # computed the next chunk beyond them.
        assert lost_at >= 64 and after > lost_at // 16 * 16
    assert first.text == reference_completion(p1, 60, ignore_eos=True)
    assert second.text == reference_completion(p2, 10, ignore_eos=True)
    assert core.pool.num_free == 40 and not core.has_work


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_waiting_requests_are_admitted_by_priority_only_under_that_policy(policy: str) -> None:
    """vLLM's `--scheduling-policy`: under priority a request of a lower value is admitted ahead
    of those queued before it (same value: arrival order); under fcfs its priority is ignored.
    A long prompt running first fills each step's budget, so the others queue meanwhile."""
    clock = ModelledClock()
    config = EngineConfig(
        max_num_batched_tokens=64,
        max_num_seqs=64,
        scheduling_policy=policy,
        prefill_us_per_token=100.0,  # each step takes modelled time: finishes are ordered
    )
    core = EngineCore(config, wait=clock.wait, clock=clock.clock)
    sinks: dict[str, Recorder] = {}

    def add(name: str, priority: int, length: int) -> None:
        sinks[name] = Recorder(clock)
        core.add_request(
            SimRequest(
                request_id=name,
                client_request_id=name,
                prompt_token_ids=list(range(1, length + 1)),
                sampling=SamplingParams(max_tokens=1),
                kv_transfer_params=None,
                sink=sinks[name],
                priority=priority,
            )
        )

    add("long", 0, 256)
    core.step()  # its first chunk: it runs, and fills every step's budget for three more
    for name, priority in (("a", 0), ("b", 0), ("urgent", -1)):
        add(name, priority, 63)  # a step each (with the sampled token's slot)
    order = [r.request_id for r in core.waiting]
    assert order == (["a", "b", "urgent"] if policy == "fcfs" else ["urgent", "a", "b"])
    run_to_completion(core, lambda: all(s.finished for s in sinks.values()))
    done = sorted(sinks, key=lambda name: sinks[name].times[-1])
    assert done == (
        ["long", "a", "b", "urgent"] if policy == "fcfs" else ["long", "urgent", "a", "b"]
    )


def test_the_scheduling_policy_flag_reaches_the_config_and_is_checked() -> None:
    args = build_parser().parse_args(["--scheduling-policy", "priority"])
    assert config_from_args(args).scheduling_policy == "priority"
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo").validate()
