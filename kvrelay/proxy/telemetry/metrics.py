"""Prometheus metrics (`kvrelay_` prefix).

With several worker processes the parent sets `PROMETHEUS_MULTIPROC_DIR` before the workers
start, every worker writes its samples there, and `/metrics` on any worker aggregates all of
them (prometheus-client multiprocess mode). Gauges declare how they combine across processes.
Labels never carry API keys, conversation ids or request ids. No `_created` series: they
would double the series count with creation timestamps nobody queries (most exporters turn them
off the same way).
"""

from __future__ import annotations

import bisect
import math
import os
import warnings
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)
from prometheus_client.values import MutexValue

disable_created_metrics()  # type: ignore[no-untyped-call]


class Labelled:
    """A labelled metric whose children are looked up once per label values.

    prometheus-client's `labels()` validates, builds a tuple and takes a lock on every call;
    the request path calls it several times per turn with a handful of distinct values. The
    children handed out update the client's value stores directly (see `_fast_child`)."""

    def __init__(self, metric: Any) -> None:  # prometheus-client is untyped here
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _fast_child(self.metric.labels(*values))
        return child

    def remove(self, *values: str) -> None:
        """Drop the series of these label values from this process's registry."""
        if self._children.pop(values, None) is None:
            return
        with warnings.catch_warnings():
            # Multiprocess mode warns that it cannot remove: `render` filters those out.
            warnings.simplefilter("ignore", UserWarning)
            self.metric.remove(*values)


# A turn updates about a dozen metrics. prometheus-client's own `inc` and `observe` re-check
# on every call that the child may be observed and (histograms) walk the buckets in Python,
# which cost about 6% of a proxy-bound turn's instructions. These wrappers keep only the
# update itself on the child's value stores, bound once; a histogram finds its bucket by
# bisection. In one process a store is a float behind a lock, and the wrappers add to the float
# directly (see `_direct`): the lock and its call were another 3%. In multiprocess mode they
# call the mmap-backed store's own `inc`. They rely on the client's internal attribute names, so
# `_fast_child` falls back to the child itself when those are missing, a test compares the
# exposition both ways, and tests/test_private_apis.py fails when the fast path is lost.


def _direct(store: Any) -> bool:
    """Whether the wrappers may add to `store` without taking its lock: prometheus-client's
    in-process float (`MutexValue`), not the mmap-backed value of multiprocess mode. The proxy
    updates its metrics only from its event loop's thread, so no two updates interleave; a
    scrape reads under the lock, and a float attribute is replaced whole, so it sees the value
    from before an update or after it."""
    return type(store) is MutexValue


class _FastCounter:
    __slots__ = ("_direct", "_store")

    def __init__(self, child: Any) -> None:
        self._store = child._value
        self._direct = _direct(self._store)

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        if self._direct:
            self._store._value += amount
        else:
            self._store.inc(amount)


class _FastGauge:
    __slots__ = ("_child", "_direct", "_store")

    def __init__(self, child: Any) -> None:
        self._store = child._value
        self._direct = _direct(self._store)
        self._child = child

    def inc(self, amount: float = 1) -> None:
        if self._direct:
            self._store._value += amount
        else:
            self._store.inc(amount)

    def dec(self, amount: float = 1) -> None:
        if self._direct:
            self._store._value -= amount
        else:
            self._store.inc(-amount)

    def set(self, value: float) -> None:
        self._child.set(value)


class _FastHistogram:
    __slots__ = ("_bounds", "_buckets", "_direct", "_sum")

    def __init__(self, child: Any) -> None:
        self._bounds = list(child._upper_bounds)
        self._buckets = list(child._buckets)
        self._sum = child._sum
        self._direct = _direct(self._sum) and all(map(_direct, self._buckets))
        if len(self._bounds) != len(self._buckets) or self._bounds[-1] != math.inf:
            raise AttributeError("unexpected histogram layout")

    def observe(self, amount: float) -> None:
        # The first bucket whose upper bound is >= amount: the client's own rule. NaN falls in
        # no bucket, as with the client's own `observe`.
        if self._direct:
            self._sum._value += amount
            if amount == amount:
                self._buckets[bisect.bisect_left(self._bounds, amount)]._value += 1
        else:
            self._sum.inc(amount)
            if amount == amount:
                self._buckets[bisect.bisect_left(self._bounds, amount)].inc(1)


def _fast_child(child: Any) -> Any:
    """`child` wrapped to update its value stores directly, or as is when unknown."""
    kinds = ((Histogram, _FastHistogram), (Counter, _FastCounter), (Gauge, _FastGauge))
    for metric_type, fast in kinds:
        if isinstance(child, metric_type):
            try:
                return fast(child)
            except AttributeError:  # another prometheus-client layout: the child's own path
                return child
    return child


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

REQUESTS = Labelled(
    Counter("kvrelay_requests_total", "Client requests by route and outcome.", ["route", "outcome"])
)
LEG_LATENCY = Labelled(
    Histogram(
        "kvrelay_leg_latency_seconds",
        "Time of one engine leg (prefill: whole response; decode: to the last byte).",
        ["leg", "outcome"],
        buckets=_LATENCY_BUCKETS,
    )
)
TTFT = Labelled(
    Histogram(
        "kvrelay_ttft_seconds",
        "Time from the client's request to the first byte of D's answer sent to the client.",
        ["route"],
        buckets=_LATENCY_BUCKETS,
    )
)
REUSE = Labelled(
    Counter(
        "kvrelay_reuse_total",
        "Map lookups (a lookup is not a reuse: see kvrelay_tokens_reused_total): hit (an "
        "entry offered to the turn), miss, refused (history check failed), expired (too close "
        "to expiry), unverifiable (engine without block hashes), holder_unavailable (the D "
        "that holds the blocks is ejected or gone), map_unavailable.",
        ["result"],
    )
)
TOKENS_OFFERED = Counter(
    "kvrelay_tokens_offered_total",
    "Tokens of D's held KV offered to P on lookup hits (an offer, not a reuse).",
)
TOKENS_REUSED = Labelled(
    Counter(
        "kvrelay_tokens_reused_total",
        "Prompt tokens a turn did not compute, as the engine that prefilled it reported (its "
        "local prefix hit + tokens loaded from D's hold): leg prefill (turns through P) or "
        "decode (decode-only turns). Legs whose engine gave no figure count nothing here.",
        ["leg"],
    )
)
TURN_PROMPT_TOKENS = Labelled(
    Counter(
        "kvrelay_turn_prompt_tokens_total",
        "Prompt tokens of turns whose prefilling engine reported what it reused, by that leg "
        "(kvrelay_tokens_reused_total over this: the realized reuse rate).",
        ["leg"],
    )
)
PROMPT_TOKENS = Labelled(
    Counter(
        "kvrelay_prompt_tokens_total",
        "Each leg's prompt tokens by where their KV came from, as its engine reported: "
        "local_hit (its prefix cache), loaded (read from the holder: D's hold for P and "
        "decode-only D, P's blocks for D on a turn through P), cached (a stock engine's "
        "total of the two), computed, unknown (the engine gave no figure).",
        ["leg", "source"],
    )
)
REFUSED_BLOCKS = Labelled(
    Counter(
        "kvrelay_refused_blocks_total",
        "Offered blocks an engine's connector did not load, by reason: hash, partial, "
        "unverified, local, threshold, failed (docs/ACCOUNTING.md).",
        ["leg", "reason"],
    )
)
LEG_ACCOUNTS = Labelled(
    Counter(
        "kvrelay_leg_accounts_total",
        "Legs by whether their engine reported what it reused: engine, or unknown.",
        ["leg", "result"],
    )
)
REUSE_STANDING = Labelled(
    Counter(
        "kvrelay_reuse_standing_changes_total",
        "Engines withdrawn from (or restored to) decode-only turns (role decode; turn "
        "decode_only_cached: those sent by D's expected prefix cache) or affinity turns (role "
        "prefill) because those turns showed no cached tokens (or show some again).",
        ["role", "turn", "change"],
    )
)
RELEASES = Labelled(
    Counter(
        "kvrelay_releases_total",
        "Side-channel releases by holder role and result (released, already_free, failed, "
        "unsupported = no release token / no secret).",
        ["holder", "result"],
    )
)
RETRIES = Labelled(Counter("kvrelay_retries_total", "Leg attempts on another engine.", ["leg"]))
FALLBACKS = Labelled(
    Counter(
        "kvrelay_fallbacks_total", "Degraded paths taken (decode_only: no P answered).", ["kind"]
    )
)
ROUTING = Labelled(
    Counter(
        "kvrelay_routing_decisions_total",
        "How turns were routed: decode_only (straight to the holding D), spilled (straight to "
        "a D off a backed-up P), prefill_affinity (the conversation's previous P), "
        "prefill_chosen (P by load).",
        ["decision"],
    )
)
PREFIX_ROUTING = Labelled(
    Counter(
        "kvrelay_prefix_routing_total",
        "P choices with prefix_routing: cached (the P chosen is expected to cache a prefix of "
        "the prompt), pull (another P's events show a longer prefix, which the chosen P pulls "
        "from it: prefix_pull), elsewhere (a P caches one, but another's queue made it "
        "cheaper to compute it), none (no P is expected to cache any).",
        ["result"],
    )
)
PREFIX_CACHED_CHARS = Counter(
    "kvrelay_prefix_cached_chars_total",
    "Prompt characters the chosen P was expected to serve from its prefix cache "
    "(prefix_routing's estimate; the engines' own counts are in kvrelay_tokens_reused_total).",
)
PREFIX_WAITS = Labelled(
    Counter(
        "kvrelay_prefix_waits_total",
        "Turns that waited for another turn computing most of their prompt (prefix_wait_max_s): "
        "computed (it was done in time) or timeout (the turn went on without it).",
        ["result"],
    )
)
PREFIX_PULLS = Labelled(
    Counter(
        "kvrelay_prefix_pulls_total",
        "Prefix pulls from the engine caching a prompt's prefix (prefix_pull), by the leg that "
        "pulls (prefill: the turn's P; decode: a spilled turn's D, from a pin or from the "
        "conversation's holder) and what came of them: "
        "pinned (the holder kept the prefix for the pull), pulled (the engine reported "
        "loading it), not_pulled (the engine loaded none of it: its own cache held it, or "
        "the blocks were refused), pin_failed (the holder answered no hold), pin_timeout (no "
        "answer within prefix_pull_timeout_s).",
        ["leg", "result"],
    )
)
PREFIX_PULLED_TOKENS = Counter(
    "kvrelay_prefix_pulled_tokens_total",
    "Prompt tokens the turns' Ps (and spilled turns' Ds) reported loading from a pinned "
    "prefix (their connectors' own counts).",
)
PREFIX_PINS = Labelled(
    Counter(
        "kvrelay_prefix_pins_total",
        "Prefixes pinned for a pull (kvrelay_prefix_pulls_total's pinned), by the pool of the "
        "engine whose cache held them: prefill, or decode (a D's cache keeps the prompts it "
        "decoded: a history whose hold was declined or ended).",
        ["holder"],
    )
)
PREFIX_PIN_SECONDS = Labelled(
    Histogram(
        "kvrelay_prefix_pin_seconds",
        "From a pin's request to the holder's answer (prefix_pull), by the pool of the engine "
        "asked (prefill or decode): what a pulled turn waits before its pull can start. A pin "
        "answering after prefix_pull_timeout_s is observed when it answers; one that fails "
        "without an answer is not.",
        ["holder"],
        buckets=_LATENCY_BUCKETS,
    )
)
PROMPT_TOKENIZE = Labelled(
    Counter(
        "kvrelay_prompt_tokenize_total",
        "Prompts tokenized for the KV events' index before routing: ok (a P's /tokenize "
        "answered, or the prompt was token ids), failed (no P answered within probe_timeout_s: "
        "the turn was routed without the Ps' events).",
        ["result"],
    )
)
PREFILL_PACE = Gauge(
    "kvrelay_prefill_pace_tokens_per_second",
    "Prompt tokens the P engines computed per second of being busy with this worker's legs "
    "(from their answers, over about the last minute): the rate at which the routing turns a "
    "holder's measured pin wait into tokens of work (0: not measured yet; several workers: "
    "the highest, the one least diluted by the others' requests).",
    multiprocess_mode="livemax",
)
PREFIX_INDEX_ENTRIES = Gauge(
    "kvrelay_prefix_index_entries",
    "Prompt prefixes in the prefix-routing index (prefix_index_max_entries bounds it).",
    multiprocess_mode="livesum",
)
PREFIX_INDEX_BLOCKS = Gauge(
    "kvrelay_prefix_index_blocks",
    "(engine, block) pairs the engines' KV events put in the block index "
    "(kv_events_max_blocks bounds it).",
    multiprocess_mode="livesum",
)
KV_EVENTS_CONNECTED = Gauge(
    "kvrelay_kv_events_connected",
    "Engines whose KV events this proxy is connected to (summed over its workers: each "
    "worker subscribes to every engine of the P and D pools with an events endpoint).",
    multiprocess_mode="livesum",
)
KV_EVENTS = Labelled(
    Counter(
        "kvrelay_kv_events_total",
        "KV cache events applied to the block index: stored, adopted (stored after a prefix "
        "the index had not seen, named through a prompt routed to that engine), orphaned "
        "(stored after a prefix nothing named: skipped), removed, cleared (an engine cleared "
        "its cache), malformed (a message that could not be decoded: its engine is "
        "forgotten).",
        ["kind"],
    )
)
KV_EVENTS_GAPS = Labelled(
    Counter(
        "kvrelay_kv_events_gaps_total",
        "Breaks in an engine's event sequence after which all it had in the index was "
        "forgotten: gap (batches missed), restart (its numbering began again).",
        ["kind"],
    )
)
KV_EVENTS_REPLAYING = Gauge(
    "kvrelay_kv_events_replaying",
    "Replays of engines' KV events being read now (summed over workers: each reads a few at "
    "once, the rest wait their turn with their live events kept back; docs/OPERATIONS.md).",
    multiprocess_mode="livesum",
)
KV_EVENTS_REPLAYS = Labelled(
    Counter(
        "kvrelay_kv_events_replays_total",
        "Replays of an engine's KV event batches asked for (on connecting, and for a gap) "
        "and how they ended: answered, timeout (the engine did not answer: it is forgotten), "
        "short (it no longer kept every batch missed: it is forgotten, then learnt again).",
        ["result"],
    )
)
KV_EVENTS_LAG = Histogram(
    "kvrelay_kv_events_lag_seconds",
    "From an engine's stamp on a KV event batch to its application to the block index.",
    buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0),
)
HOLD_DECISIONS = Labelled(
    Counter(
        "kvrelay_hold_decisions_total",
        "Whether a turn that could continue asked D to hold (hold_min_use): kept (the "
        "tenant's holds are read often enough), declined (they are not), cache_keeps (not "
        "asked: the conversation's last turn came back sooner than the D that served it "
        "keeps a block nobody uses, so its cache most likely keeps the history), probe (declined "
        "share, held to see whether that changed), released (a hold counted unused, given "
        "back before its lease ended because the tenant's holds do not pay, counted when D "
        "freed its blocks; one D had already ended is D's to count), over_budget (asked, and D "
        "kept nothing: the turn alone is over D's hold_max_fraction of its pool), read (a "
        "hold its next turn took and an engine read, as its report says), unread (one its "
        "next turn took but no engine read: the turn went to another D, P's own cache had "
        "the history, or D's blocks were gone; counted unused), cache_kept (read, but taken "
        "sooner than the holder's prefix cache lately keeps a block nobody uses, by its "
        "vllm:kv_block_idle_before_evict_seconds: the cache would have kept the history "
        "unheld; counted unused).",
        ["decision"],
    )
)
HELD_READS = Labelled(
    Counter(
        "kvrelay_held_reads_total",
        "Reads of a conversation's held history by an engine other than its holder (P on a "
        "turn through P, or a spilled turn's D), as the reader reported them: found (it loaded "
        "some of the blocks) or gone (its read failed: the holder had ended the hold, for its "
        "hold budget or block pressure, before the next turn came). Per holder the share found "
        "weighs a later spill's read from it; a high gone share says D's hold budget is too "
        "small for its conversations' think times.",
        ["result"],
    )
)
PREFILL_SPILLED = Labelled(
    Counter(
        "kvrelay_prefill_spilled_total",
        "Turns sent straight to a D that prefilled them itself because P's queue would have "
        "taken longer (prefill_spill_factor): turn=first (no held history) or later.",
        ["turn"],
    )
)
DECODE_ONLY_CHECKS = Labelled(
    Counter(
        "kvrelay_decode_only_checks_total",
        "Decode-only turns the estimate from characters allowed, checked on D's own count of "
        "the prompt's tokens: fits (sent to D), too_long (through P) or uncounted (D could not "
        "count it in time: through P).",
        ["result"],
    )
)
FINISHED_PARAMS = Labelled(
    Counter(
        "kvrelay_finished_params_total",
        "Where D's final params came from: response, stream, side_channel, or missing.",
        ["source"],
    )
)
FINISHED_CALLS = Labelled(
    Counter(
        "kvrelay_finished_calls_total",
        "Side-channel calls fetching D's finished params: batch (the ids of several streams, "
        "answered at once) or single (one id; the holder waits for its publication).",
        ["call"],
    )
)
FINISHED_BATCH_IDS = Histogram(
    "kvrelay_finished_batch_ids",
    "Request ids per batch call for finished params (one holder's streams coalesced).",
    buckets=(1, 2, 4, 8, 16, 32),
)
MAP_ERRORS = Labelled(
    Counter(
        "kvrelay_map_unavailable_total",
        "Map operations that failed (served without reuse).",
        ["op"],
    )
)
UNCONFIRMED_PUTS = Labelled(
    Counter(
        "kvrelay_map_unconfirmed_puts_total",
        "Map writes whose outcome was unknown, by how they were settled (stored: the hold is "
        "kept for the entry; not_stored: released; unsettled: left to the holder's lease).",
        ["result"],
    )
)
TENANT_LIMITS = Labelled(
    Counter(
        "kvrelay_tenant_limit_total",
        "Per-tenant limit checks: admitted, rejected_rps, rejected_inflight, unchecked (Redis "
        "unreachable, admitted).",
        ["outcome"],
    )
)
PASSTHROUGH = Labelled(
    Counter(
        "kvrelay_passthrough_total",
        "Pass-through requests by route (one of passthrough_routes) and outcome (ok, "
        "client_error, upstream_error, upstream_cut (the engine broke mid-answer), unavailable, "
        "client_disconnected).",
        ["route", "outcome"],
    )
)
BACKEND_HEALTHY = Labelled(
    Gauge(
        "kvrelay_backend_healthy",
        "1 when the engine is in its pool, 0 when ejected.",
        ["role", "backend"],
        multiprocess_mode="livemax",
    )
)
INFLIGHT = Labelled(
    Gauge(
        "kvrelay_inflight_requests",
        "Client requests being served.",
        ["route"],
        multiprocess_mode="livesum",
    )
)


# (role, backend) of engines that left the fleet: multiprocess mode keeps every series a
# worker ever wrote in its file, so the page leaves these out (an engine that comes back is
# taken off this set). Every worker reconciles its pools with the fleet, so each knows.
_gone_backends: set[tuple[str, str]] = set()


def backend_health(role: str, backend: str, healthy: bool) -> None:
    """`kvrelay_backend_healthy` of an engine in its pool."""
    _gone_backends.discard((role, backend))
    BACKEND_HEALTHY.labels(role, backend).set(1 if healthy else 0)


def backend_gone(role: str, backend: str) -> None:
    """An engine left the fleet: its health series leaves the page."""
    _gone_backends.add((role, backend))
    BACKEND_HEALTHY.remove(role, backend)


class _WithoutGone:
    """The multiprocess collector's output less the health series of departed engines."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def collect(self) -> Iterator[Any]:
        for metric in self._inner.collect():
            if metric.name == "kvrelay_backend_healthy" and _gone_backends:
                metric.samples = [
                    sample
                    for sample in metric.samples
                    if (sample.labels.get("role"), sample.labels.get("backend"))
                    not in _gone_backends
                ]
            yield metric


def render() -> tuple[bytes, str]:
    """The metrics page, aggregated over worker processes when in multiprocess mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        inner = multiprocess.MultiProcessCollector(None)  # type: ignore[no-untyped-call]
        registry.register(_WithoutGone(inner))
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST
