"""Engine load signals and the routing decisions made from them.

`LoadPoller` scrapes a fake engine's `/metrics` (a real HTTP server on loopback that serves
whatever page the test sets, or fails); `Router` decisions are checked on pools whose readings
the test sets directly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from kvrelay.kvcache_map import KVEntry
from kvrelay.proxy.config import Settings
from kvrelay.proxy.engines import Upstream
from kvrelay.proxy.fleet import LoadPoller, Pool, Route, Router
from kvrelay.proxy.fleet.engine_load import STALE_INTERVALS, fresh_load, load_from_metrics
from kvrelay.proxy.fleet.freed_tokens import MAX_ENTRIES, FreedTokens
from kvrelay.proxy.fleet.load_reading import EngineLoad
from kvrelay.proxy.fleet.policies import TokenCounter, policy_named
from kvrelay.proxy.fleet.routing import kv_usage, uncached_tokens

VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
"""


@dataclass
class FakeMetricsEngine:
    """A fake engine that only serves `/metrics`: the page (or status) the test sets."""

    url: str
    page: str = VLLM_PAGE
    status: int = 200
    scraped: asyncio.Event = field(default_factory=asyncio.Event)


@pytest.fixture
async def fake_engine() -> AsyncIterator[FakeMetricsEngine]:
    engine = FakeMetricsEngine(url="")

    async def metrics(_: web.Request) -> web.Response:
        response = web.Response(text=engine.page, status=engine.status)
        engine.scraped.set()
        return response

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    engine.url = f"http://127.0.0.1:{port}"
    try:
        yield engine
    finally:
        await runner.cleanup()


def test_vllm_gauges_are_summed_over_engine_cores() -> None:
    load = load_from_metrics(VLLM_PAGE, at=5.0)
    assert load == EngineLoad(running=4.0, waiting=7.0, kv_usage=pytest.approx(0.6), at=5.0)
    assert load_from_metrics("# nothing\nother_metric 1\n", at=0.0) is None


# vLLM's cache settings as it serves them: an info gauge whose labels are every CacheConfig
# field as a string (a few of them here, in vLLM's order), one series per engine core.
CACHE_CONFIG_PAGE = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",\
engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="7975",\
prefix_caching_hash_algo="sha256"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",\
engine="1",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="1000",\
prefix_caching_hash_algo="sha256"} 1.0
"""


def test_the_pool_size_comes_from_vllms_cache_config_info() -> None:
    """num_gpu_blocks x block_size, summed over the cores; unknown without the gauge or with a
    core whose pool is not a number (vLLM says "None" before it has profiled memory)."""
    load = load_from_metrics(VLLM_PAGE + CACHE_CONFIG_PAGE, at=5.0)
    assert load is not None and load.pool_tokens == (7975 + 1000) * 16
    assert load_from_metrics(VLLM_PAGE, at=5.0).pool_tokens is None  # type: ignore[union-attr]
    unprofiled = CACHE_CONFIG_PAGE.replace('num_gpu_blocks="1000"', 'num_gpu_blocks="None"')
    load = load_from_metrics(VLLM_PAGE + unprofiled, at=5.0)
    assert load is not None and load.pool_tokens is None


def test_a_ds_kv_usage_reads_lower_by_what_this_workers_turns_freed_since_the_reading() -> None:
    """A D read at 95% of 100,000 tokens is busy; once a turn of this worker ended there and
    left 20,000 tokens free (no hold), it reads 75%: it takes the next turn (its history is
    in its cache). A turn that ended before the reading was taken is in the reading already;
    without the pool's size the reading stands."""
    router, _, decode = _router(decode_max_waiting=4, decode_max_kv_usage=0.9)
    a, b = decode.add("http://a"), decode.add("http://b")
    read_at = time.monotonic() - 0.5
    a.load = EngineLoad(running=8.0, waiting=0.0, kv_usage=0.95, at=read_at, pool_tokens=100_000)
    router.released(a.url, 4_000)  # after the reading, but only 4% of the pool: 91% left
    assert router.busy(a) and router.pick_decode("http://a", set()) is b
    router.released(a.url, 16_000)  # 20% freed since the reading: 75%
    assert not router.busy(a) and router.pick_decode("http://a", set()) is a
    assert kv_usage(a, a.load) == pytest.approx(0.75)
    # The next reading counts those turns itself: nothing freed after it.
    a.load = EngineLoad(
        running=6.0, waiting=0.0, kv_usage=0.93, at=time.monotonic(), pool_tokens=100_000
    )
    assert router.busy(a) and kv_usage(a, a.load) == pytest.approx(0.93)
    # An engine that does not say its pool's size: its reading as it is.
    b.load = EngineLoad(running=8.0, waiting=0.0, kv_usage=0.95, at=read_at)
    router.released(b.url, 50_000)
    assert router.busy(b) and kv_usage(b, b.load) == pytest.approx(0.95)
    router.released("http://not-a-d", 1_000)  # an engine that left the pool: nothing to do


def test_freed_tokens_forget_what_a_reading_already_counts() -> None:
    freed = FreedTokens()
    freed.freed(100, at=1.0)
    freed.freed(0, at=1.5)  # nothing freed: not an entry
    freed.freed(200, at=2.0)
    freed.freed(300, at=3.0)
    assert freed.since(0.5) == 600
    assert freed.since(2.0) == 300  # a reading at 2.0 counts the turns that ended by then
    assert freed.since(0.5) == 300  # forgotten: readings of one engine only move forward
    for i in range(MAX_ENTRIES + 10):  # the readings stopped: the oldest go first
        freed.freed(1, at=4.0 + i)
    assert freed.since(0.0) == MAX_ENTRIES


async def test_poller_reads_the_engine_and_survives_failures(
    fake_engine: FakeMetricsEngine,
) -> None:
    pool = Pool("decode", eject_after=1, readmit_after=1)
    backend = pool.add(fake_engine.url)
    dead = pool.add("http://127.0.0.1:9")  # nothing listens: connection refused
    client = Upstream(connect_timeout=1.0)
    try:
        poller = LoadPoller([pool], client, interval=0.05, timeout=1.0)
        await poller.scrape_all()
        assert backend.load is not None and backend.load.waiting == 7.0
        assert dead.load is None and dead.healthy  # a failed scrape is no health verdict
        # The engine starts failing: the last reading stays, ages, and is then ignored.
        old = backend.load
        fake_engine.status = 500
        await poller.scrape_all()
        assert backend.load is old
        assert fresh_load(backend, 0.05, now=old.at) is old
        assert fresh_load(backend, 0.05, now=old.at + STALE_INTERVALS * 0.05 + 0.01) is None
        # Garbage is not a reading either.
        fake_engine.status, fake_engine.page = 200, "not prometheus {{{"
        await poller.scrape_all()
        assert backend.load is old
        # The loop keeps scraping through all of that and picks up a good page again.
        fake_engine.page = VLLM_PAGE.replace("7.0", "2.0")
        fake_engine.scraped.clear()
        poller.start()
        try:
            # A second scrape starts only once the round before it was read in full.
            for _ in range(2):
                await asyncio.wait_for(fake_engine.scraped.wait(), timeout=5.0)
                fake_engine.scraped.clear()
        finally:
            await poller.stop()
        assert backend.load is not None and backend.load.waiting == 2.0
    finally:
        client.close()


async def _no_count(url: str) -> int | None:
    raise AssertionError("a plan through P asks no engine for a count")


def _counting(tokens: int) -> TokenCounter:
    async def count(url: str) -> int | None:
        return tokens

    return count


def _router(**settings: object) -> tuple[Router, Pool, Pool]:
    prefill = Pool("prefill", eject_after=1, readmit_after=1)
    decode = Pool("decode", eject_after=1, readmit_after=1)
    config = Settings(_env_file=None, load_poll_interval_s=1.0, **settings)  # type: ignore[arg-type]
    return Router(config, prefill, decode), prefill, decode


def _reading(waiting: float = 0.0, kv: float = 0.1, age: float = 0.0) -> EngineLoad:
    return EngineLoad(running=1.0, waiting=waiting, kv_usage=kv, at=time.monotonic() - age)


def _entry(
    d_url: str, p_url: str | None, num_tokens: int = 400, cpt: float | None = 4.0
) -> KVEntry:
    return KVEntry(
        engine_id="d", host="127.0.0.1", port=5600, url=d_url, request_id="r1",
        block_ids=[list(range(25))], num_tokens=num_tokens, fingerprint="m:3:ab",
        expires_at=time.time() + 60, prefill_url=p_url, chars_per_token=cpt,
    )  # fmt: skip


def test_busy_engines_are_avoided_and_stale_readings_ignored() -> None:
    router, _, decode = _router(decode_max_waiting=4, decode_max_kv_usage=0.9)
    a, b = decode.add("http://a"), decode.add("http://b")
    # Without readings: affinity to the holder.
    assert router.pick_decode("http://a", set()) is a
    a.load = _reading(waiting=5)  # queue past the threshold
    assert router.busy(a) and router.pick_decode("http://a", set()) is b
    a.load = _reading(kv=0.95)  # KV cache nearly full
    assert router.pick_decode("http://a", set()) is b
    a.load = _reading(waiting=50, age=STALE_INTERVALS * 1.0 + 1)  # stale: ignored
    assert not router.busy(a) and router.pick_decode("http://a", set()) is a
    # Without affinity the engine with the shorter queue (its own count) wins.
    a.load, b.load = _reading(waiting=3), _reading(waiting=0)
    assert router.pick_decode(None, set()) is b


def test_prefill_affinity_holds_until_the_p_is_overloaded_busy_or_gone() -> None:
    router, prefill, _ = _router(routing_policy="affinity", prefill_overload_inflight=2)
    p0, p1 = prefill.add("http://p0"), prefill.add("http://p1")
    entry = _entry("http://d", "http://p1")
    previous = entry.prefill_url
    assert router.pick_prefill(previous, set())[:2] == (p1, True)
    assert router.pick_prefill(None, set())[:2] == (p0, False)  # ties: the first P
    p1.inflight = 2
    assert router.pick_prefill(previous, set())[:2] == (p0, False)
    p1.inflight, p1.load = 0, _reading(waiting=9)
    assert router.pick_prefill(previous, set())[:2] == (p0, False)
    p1.load = None
    prefill.drain("http://p1")
    assert router.pick_prefill(previous, set())[:2] == (p0, False)
    # The policies: affinity and conditional prefer the previous P, always_p none.
    for name, prefers in (("affinity", previous), ("conditional", previous), ("always_p", None)):
        plan = asyncio.run(policy_named(name, router).plan(entry, 10, "", _no_count))
        assert plan.route is Route.THROUGH_P and plan.prefill_first == prefers, name


def test_prefill_affinity_yields_to_a_p_whose_queue_is_shorter_by_more_than_the_turn() -> None:
    router, prefill, _ = _router(routing_policy="affinity")
    p0, p1 = prefill.add("http://p0"), prefill.add("http://p1")
    entry = _entry("http://d", "http://p1")
    turn = 1000  # the turn's prompt characters
    p1.outstanding_work = 5000  # the previous P has queued work; p0 none
    previous = entry.prefill_url
    assert router.pick_prefill(previous, set(), turn)[:2] == (p0, False)
    p0.outstanding_work = 4000  # p0 only a turn's worth ahead: not worth losing the local hit
    assert router.pick_prefill(previous, set(), turn)[:2] == (p1, True)
    p0.outstanding_work = 3999
    assert router.pick_prefill(previous, set(), turn)[:2] == (p0, False)
    # Another worker's requests on p1 (its fresh reading shows more than this worker sent)
    # count at this worker's mean per request there.
    p0.outstanding_work, p1.outstanding_work, p1.inflight = 2000, 1000, 1
    assert router.pick_prefill(previous, set(), turn)[:2] == (p1, True)
    p1.load = _reading(waiting=3)  # 1 running + 3 waiting: 3 more requests of 1000 characters
    assert router.pick_prefill(previous, set(), turn)[:2] == (p0, False)
    # A P left out (tried already) is not a reason to yield.
    assert router.pick_prefill(previous, {"http://p0"}, turn)[:2] == (p1, True)


def test_conditional_skips_p_only_for_short_uncached_parts_on_a_free_holder() -> None:
    router, _, decode = _router(
        routing_policy="conditional", conditional_max_uncached_tokens=50,
        conditional_max_inflight_tokens=120, decode_max_waiting=4,
    )  # fmt: skip
    d = decode.add("http://d")
    entry = _entry("http://d", "http://p0", num_tokens=400, cpt=4.0)
    # 1,800 chars / 4 chars per token = 450 tokens; D holds 400: 50 uncached.
    assert uncached_tokens(entry, 1800) == 50
    assert router.decode_only_tokens(entry, 1800) == 50
    assert router.decode_only_tokens(entry, 1804) is None  # 51 uncached
    assert router.decode_only_tokens(None, 10) is None
    assert router.decode_only_tokens(_entry("http://d", None, cpt=None), 1600) is None
    # D's prefill budget: decode-only turns in flight there count their tokens.
    with decode.busy(d, 1 + 50), decode.busy(d, 1):
        assert router.decode_only_tokens(entry, 1800) == 50  # 50 + 50 <= 120
        with decode.busy(d, 1 + 30):
            assert router.decode_only_tokens(entry, 1800) is None  # 80 + 50 > 120
    d.load = _reading(waiting=5)  # the holder is busy: through P as usual
    assert router.decode_only_tokens(entry, 1800) is None
    d.load = None
    decode.drain("http://d")
    assert router.decode_only_tokens(entry, 1800) is None
    # Only the conditional policy plans a decode-only turn (confirmed on D's count).
    counted = _counting(450)
    for name, route in (
        ("conditional", Route.DECODE_ONLY),
        ("affinity", Route.THROUGH_P),
        ("always_p", Route.THROUGH_P),
    ):
        other, _, decode2 = _router(
            routing_policy=name, conditional_max_uncached_tokens=50, prefill_spill_factor=0
        )
        decode2.add("http://d")
        plan = asyncio.run(policy_named(name, other).plan(entry, 1800, "", counted))
        assert plan.route is route, name


ITL_PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} COUNT
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} COUNT
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} SUM
"""


def _itl_page(count: float, total: float) -> str:
    return ITL_PAGE.replace("COUNT", str(count)).replace("SUM", str(total))


def test_the_mean_inter_token_gap_comes_from_two_readings_of_the_histogram() -> None:
    first = load_from_metrics(_itl_page(100, 2.0), at=1.0)
    assert first is not None and first.inter_token_s is None  # nothing to compare with yet
    assert (first.itl_count, first.itl_sum) == (100, 2.0)
    # 50 tokens in 4 s of gaps since: 80 ms each, whatever the running mean was.
    second = load_from_metrics(_itl_page(150, 6.0), at=2.0, previous=first)
    assert second is not None and second.inter_token_s == pytest.approx(0.08)
    # No token decoded in between: no pace to report.
    idle = load_from_metrics(_itl_page(150, 6.0), at=3.0, previous=second)
    assert idle is not None and idle.inter_token_s is None
    # A restarted engine's counters start again: no negative or mixed-up mean.
    restarted = load_from_metrics(_itl_page(10, 0.1), at=4.0, previous=idle)
    assert restarted is not None and restarted.inter_token_s is None
    # A page without the histogram (an older engine) reads as before.
    plain = load_from_metrics(VLLM_PAGE, at=5.0, previous=restarted)
    assert plain is not None and plain.itl_count is None and plain.inter_token_s is None


def _paced(inter_token_s: float | None, age: float = 0.0) -> EngineLoad:
    return EngineLoad(
        running=4.0, waiting=0.0, kv_usage=0.2, at=time.monotonic() - age,
        itl_sum=10.0, itl_count=100.0, inter_token_s=inter_token_s,
    )  # fmt: skip


def test_a_spill_goes_to_the_holder_unless_another_d_would_be_done_with_the_turn_sooner() -> None:
    """The holder prefills only what it does not hold (4,400 characters at 4 per token: 1,100
    tokens, 400 held, 700 to compute), another D the whole turn (1,100) when it cannot pull the
    history (`prefix_pull` off); the turn goes to the D done with it soonest counting each
    one's decode-only tokens queued, the holder on a tie."""
    router, prefill, decode = _router(routing_policy="conditional", prefix_pull=False)
    p = prefill.add("http://p")
    holder, other = decode.add("http://holder"), decode.add("http://other")
    entry = _entry(holder.url, p.url, num_tokens=400, cpt=4.0)
    with prefill.busy(p, 400_000):  # P's queue: far longer than any D's
        spill = router.spill(entry, 4400)
        assert spill is not None and spill.backend is holder and spill.holder
        assert spill.tokens == 700
        # The holder queued 400 decode-only tokens: 400 + 700 = 1,100, as the other D's 1,100.
        holder.inflight, holder.outstanding_work = 1, 1 + 400
        spill = router.spill(entry, 4400)
        assert spill is not None and spill.backend is holder
        # 401 queued: the other D, computing the whole prompt, is done with it sooner.
        holder.outstanding_work = 1 + 401
        spill = router.spill(entry, 4400)
        assert spill is not None and spill.backend is other and not spill.holder
        assert spill.tokens == 1100 and spill.source is None


def test_a_spill_past_a_queued_holder_reads_the_held_history_from_it() -> None:
    """With `prefix_pull` another D reads the 400 held tokens from the holder (at `PULL_COST`,
    0.4 a token: 160, no pin to wait for) and computes the other 700: 860 against the holder's
    700 plus its queue. It reads them past a busy holder too, but not from an unhealthy one,
    nor a history under `prefix_pull_min_tokens`."""
    router, prefill, decode = _router(routing_policy="conditional")
    p = prefill.add("http://p")
    holder, other = decode.add("http://holder"), decode.add("http://other")
    entry = _entry(holder.url, p.url, num_tokens=400, cpt=4.0)
    with prefill.busy(p, 400_000):  # P's queue: far longer than any D's
        holder.inflight, holder.outstanding_work = 1, 1 + 160  # 860 each: the holder
        spill = router.spill(entry, 4400)
        assert spill is not None and spill.backend is holder and spill.source is None
        holder.outstanding_work = 1 + 161
        spill = router.spill(entry, 4400)
        assert spill is not None and spill.backend is other and not spill.holder
        assert spill.source is not None and spill.source.held
        assert (spill.source.backend, spill.source.tokens) == (holder, 400)
        assert spill.tokens == 700  # what the other D computes; the read is not its compute
        # Judged again on D's count (1,100 tokens, 400 held): still the read.
        counted = spill.counted(1100, 400, 4400)
        assert counted is not None and counted.source == spill.source
        assert counted.tokens == 700
        # A busy holder takes no spill, but its held blocks can still be read.
        holder.load = _reading(waiting=5)
        spill = router.spill(entry, 4400)
        assert spill is not None and spill.backend is other and spill.source is not None
        holder.load = None
        # An unhealthy holder serves no read: the other D computes the whole turn.
        decode.record_failure(holder, "down")
        spill = router.spill(entry, 4400)
        assert spill is not None and spill.backend is other and spill.source is None
        assert spill.tokens == 1100
        # A holder withdrawn from this tenant's decode-only turns may still take the turn as
        # any D would, computing it whole: never reading from itself.
        decode.record_success(holder, probe=True)  # readmitted (readmit_after 1)
        holder.inflight, holder.outstanding_work = 0, 0  # the least loaded D
        other.inflight, other.outstanding_work = 3, 3 + 10_000
        router.decode_only_served(holder.url, 0, "t")
        spill = router.spill(entry, 4400, "t")
        assert spill is not None and spill.backend is holder and not spill.holder
        assert spill.source is None and spill.tokens == 1100
    short, short_p, short_d = _router(routing_policy="conditional", prefix_pull_min_tokens=401)
    sp = short_p.add("http://p")
    held, spare = short_d.add("http://holder"), short_d.add("http://other")
    held.inflight, held.outstanding_work = 1, 1 + 10_000
    with short_p.busy(sp, 400_000):
        spill = short.spill(_entry(held.url, sp.url, num_tokens=400, cpt=4.0), 4400)
        assert spill is not None and spill.backend is spare and spill.source is None


def test_a_spill_weighs_a_held_read_by_how_often_the_holders_holds_were_still_there() -> None:
    """The entry names the blocks the holder held when the turn ended; the holder may have ended
    that hold since (its hold budget, block pressure), and readers then report the read failed.
    Once four reads of a holder's blocks found them gone, another D is not expected to read its
    held history: it would compute all 1,100 tokens, and the holder (its 700 plus 300 queued)
    takes the turn. Reads that find their blocks again bring the read back, weighed by the
    share found (`HeldReads`)."""
    router, prefill, decode = _router(routing_policy="conditional")
    p = prefill.add("http://p")
    holder, other = decode.add("http://holder"), decode.add("http://other")
    entry = _entry(holder.url, p.url, num_tokens=400, cpt=4.0)
    with prefill.busy(p, 400_000):  # P's queue: far longer than any D's
        holder.inflight, holder.outstanding_work = 1, 1 + 300  # 700 + 300 = 1,000
        for _ in range(3):
            router.held_read(holder.url, False)
        # Three reads are not evidence yet: the other D reads 400 (1,100 - 400 + 160 = 860).
        spill = router.spill(entry, 4400)
        assert spill is not None and spill.backend is other and spill.source is not None
        assert spill.source.tokens == 400
        router.held_read(holder.url, False)
        spill = router.spill(entry, 4400)
        assert spill is not None and spill.backend is holder and spill.holder
        assert spill.source is None and spill.tokens == 700
        for _ in range(12):
            router.held_read(holder.url, True)
        share = router.held_reads.share(holder.url)
        assert 0.5 < share < 1
        spill = router.spill(entry, 4400)
        assert spill is not None and spill.backend is other and spill.source is not None
        assert spill.source.tokens == round(400 * share)
        assert spill.tokens == 1100 - round(400 * share)  # what D computes after the read
        # Judged again on D's count, P's side still reads the history only that often.
        counted = spill.counted(1100, 400, 4400)
        assert counted is not None and counted.held_share == share
        assert counted.source == spill.source


def test_a_d_decoding_slower_than_the_bound_takes_no_spilled_prefill() -> None:
    router, prefill, decode = _router(
        routing_policy="conditional", prefill_spill_max_inter_token_ms=50.0
    )
    p, d = prefill.add("http://p"), decode.add("http://d")
    with prefill.busy(p, 100_000):  # P's queue: far longer than D prefilling 1,000 chars
        spill = router.spill(None, 1000)
        assert spill is not None and spill.backend is d
        d.load = _paced(0.08)  # D's tokens came 80 ms apart since its last reading
        assert router.spill(None, 1000) is None
        d.load = _paced(0.03)
        assert router.spill(None, 1000) is not None
        d.load = _paced(0.08, age=STALE_INTERVALS * 1.0 + 1)  # an old reading says nothing
        assert router.spill(None, 1000) is not None
        # The holder of a conversation is skipped alike, and so is every other slow D.
        d.load = _paced(0.08)
        assert router.spill(_entry("http://d", "http://p", cpt=4.0), 4000) is None
    unbounded, prefill2, decode2 = _router(routing_policy="conditional")
    p2, d2 = prefill2.add("http://p"), decode2.add("http://d")
    d2.load = _paced(0.5)
    with prefill2.busy(p2, 100_000):  # the default bound (0): pace is not weighed
        assert unbounded.spill(None, 1000) is not None
