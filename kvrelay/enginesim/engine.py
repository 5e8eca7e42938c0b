"""`EngineCore`: the synchronous scheduler + model runner of one simulated engine.

One call to `step()` is one engine step, in vLLM's order:
1. schedule within the step's token budget (`max_num_batched_tokens`, vLLM's chunked
   prefill): one token for every decoding request, then prefill chunks of the running
   requests still prefilling, then admit waiting requests (connector:
   `get_num_new_matched_tokens`, then allocate, then `update_state_after_alloc`) with chunks
   of what budget is left; a long prompt is prefilled over several steps. Blocks are
   allocated per chunk, as vLLM's `allocate_slots` does; requests loading remote KV wait in
   WAITING_FOR_REMOTE_KVS with blocks for what arrives, and compute only the rest;
2. connector metadata to the worker (`start_step`: starts reads, executes frees);
3. compute: the scheduled prefill chunks and one decode token for every decoding request;
   the step then waits its simulated time (flat knobs, or a GPU cost profile's modelled time
   of these prefill chunks and decode contexts: `costs.py`);
4. finished requests: `request_finished` decides free-now or hold-for-remote;
5. poll the worker and feed the scheduler side (`finish_step`): free the blocks of
   `finished_sending`, release `finished_recving` requests to prefill what did not arrive,
   error the requests the `fail` policy failed. With a cost profile, a finished load first
   waits (in `arriving`) the modelled transfer time of the bytes the real GPUs would move.
Not thread-safe: `EngineRunner` drives it from one thread; `reference` drives it inline.

Where vLLM's scheduler asserts on what a connector reports, this engine raises
`EngineInvariantError` (the engine thread dies, as vLLM's engine core would): an unknown or
repeated id in `finished_sending`/`finished_recving`, an asynchronous load of zero tokens, a
request waiting for remote KV longer than `EngineConfig.remote_kv_wait_limit_s`.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import numpy as np

from kvrelay.connector.block_runs import block_runs
from kvrelay.connector.protocol import (
    DO_REMOTE_PREFILL,
    REMOTE_BLOCK_IDS,
    REMOTE_PREFILL_CACHED_TOKENS,
)
from kvrelay.enginesim.config import EngineConfig
from kvrelay.enginesim.costs import CostProfile, get_link, get_profile
from kvrelay.enginesim.histogram import ITL_BUCKETS, Histogram
from kvrelay.enginesim.kv_events import StoredBlock
from kvrelay.enginesim.kvhost import ConnectorOutput, KVHost, NoConnector
from kvrelay.enginesim.kvpool import BlockPool
from kvrelay.enginesim.model import DECODE_WINDOW, SimModel
from kvrelay.enginesim.request import EngineError, Output, ReqState, SimRequest
from kvrelay.enginesim.timeline import GpuTimeline
from kvrelay.enginesim.tokenizer import Tokenizer, get_tokenizer

# What a running request samples this step: the token, its prefix hash and its KV row.
NextKV = tuple[int, int, np.ndarray[Any, Any]]


class EngineInvariantError(RuntimeError):
    """The connector broke a rule vLLM's scheduler asserts (see module docstring)."""


class EngineCore:
    """Block pool, waiting queue, running batch and the model, driven one step at a time."""

    def __init__(
        self,
        config: EngineConfig,
        kv_host: KVHost | None = None,
        pool: BlockPool | None = None,
        *,
        wait: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config.validate()
        self.config = config
        # Modelled time is waited out on the engine thread (two cores simulate a fleet), the
        # steps laid end to end (`timeline`); tests pass their own `wait` and `clock` to check
        # what is waited, not how long.
        self.timeline = GpuTimeline(wait, clock)
        self._clock = clock
        self.costs: CostProfile | None = (
            get_profile(config.cost_profile) if config.cost_profile else None
        )
        self.link = get_link(config.kv_link)
        self.tokenizer: Tokenizer = get_tokenizer()
        self.model = SimModel(
            config.model,
            config.geometry,
            self.tokenizer.output_vocab(),
            self.tokenizer.eos_id,
            config.eos_period,
        )
        self.pool = pool or config.new_pool()
        # KV events, in order (see `follow_cache`): blocks cached and the keys of those evicted.
        self._stored: list[StoredBlock | Hashable] | None = None
        self.kv: KVHost = kv_host or NoConnector()
        self.waiting: deque[SimRequest] = deque()
        self.loading: dict[str, SimRequest] = {}
        # Loads the connector finished, waiting out their modelled transfer time: id -> (request,
        # when it may run).
        self.arriving: dict[str, tuple[SimRequest, float]] = {}
        self.running: dict[str, SimRequest] = {}
        # Finished requests whose blocks the connector holds for a remote reader, oldest first.
        self.held: OrderedDict[str, list[int]] = OrderedDict()
        self._reclaim_pending = 0
        # When this engine's link is free of the modelled transfers queued on it.
        self._link_free_at = 0.0
        # Outputs of the current step, delivered by `deliver_outputs()` after the step so that
        # a client never sees a result before the engine's published state includes it.
        self._outbox: list[tuple[SimRequest, Output]] = []
        # vLLM's `vllm:inter_token_latency_seconds`: the gap before each output token after a
        # request's first, as the engine's clock saw it when the step ended.
        self.token_gaps = Histogram(ITL_BUCKETS)
        self._step_end = 0.0
        self.counters: dict[str, int] = {
            "requests_finished": 0,
            "requests_failed": 0,
            "requests_aborted": 0,
            "requests_rejected": 0,
            "prompt_tokens_computed": 0,
            "prompt_tokens_loaded": 0,
            "prompt_tokens_cached": 0,
            "generation_tokens": 0,
            "preemptions": 0,
            "prefill_chunks": 0,
            "prefill_tokens_computed": 0,  # every chunk's tokens, recomputation included
            "reclaim_requests": 0,
            # vLLM's prompt token counters (`PromptTokenStats`): counted when a request's first
            # output is emitted, from what its first admission planned, as vLLM counts them.
            "vllm_prompt_tokens": 0,
            "vllm_prompt_local_compute": 0,
            "vllm_prompt_local_cache_hit": 0,
            "vllm_prompt_external_kv_transfer": 0,
            "vllm_prompt_tokens_cached": 0,
        }

    # ----- entry points (engine thread) -------------------------------------------------------
    def add_request(self, req: SimRequest) -> None:
        req.hashes = self.model.prefix_hashes(req.prompt_token_ids, 0, None)
        waiting = self.waiting
        if self.config.scheduling_policy == "priority" and waiting:
            # vLLM's priority queue: by (priority, arrival), so behind every request of the
            # same or a lower priority value, ahead of the first with a higher one.
            for at, queued in enumerate(waiting):
                if queued.priority > req.priority:
                    waiting.insert(at, req)
                    return
        waiting.append(req)

    def abort(self, request_id: str) -> None:
        """The client went away: drop the request wherever it is, freeing what it holds."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                self.counters["requests_aborted"] += 1
                if req.external is None and not req.preempted:
                    # Never seen by the connector: like a rejection, its holder is freed now.
                    self.kv.request_rejected(req)
                else:
                    self._release(req, hold=False)
                return
        loading = self.loading.get(request_id)
        if loading is not None and not loading.aborted:
            # vLLM's order: the connector hears of the finish now; the blocks the reads may
            # still write into are freed when the load is reported finished-receiving.
            loading.aborted = True
            loading.state = ReqState.FINISHED
            self.counters["requests_aborted"] += 1
            self.kv.request_finished(loading, [])
            return
        arriving = self.arriving.pop(request_id, None)
        if arriving is not None:
            # The connector is done with it: like a running request, finish and free.
            self.counters["requests_aborted"] += 1
            self._release(arriving[0], hold=False)
            return
        running = self.running.pop(request_id, None)
        if running is not None:
            self.counters["requests_aborted"] += 1
            self._release(running, hold=False)

    def reject(self, req: SimRequest) -> None:
        """Refused before admission (validation, faults): the connector frees the holder now."""
        self.counters["requests_rejected"] += 1
        self.kv.request_rejected(req)

    @property
    def busy(self) -> bool:
        """Requests in flight (queued, loading, arriving or running), holds aside."""
        return bool(self.waiting or self.loading or self.arriving or self.running)

    @property
    def has_work(self) -> bool:
        return self.busy or bool(self.held)

    def num_held_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.held.values())

    # ----- one step ---------------------------------------------------------------------------
    def step(self) -> None:
        self.timeline.begin()
        self._check_loads_progress()
        self._release_arrived()
        decoding, chunks = self._schedule()
        self.kv.start_step()
        computed = self._compute(decoding, chunks)
        self._process_connector(self.kv.finish_step())
        # With requests running the runner steps again at once: the GPU does not idle.
        self.timeline.end(computed, bool(self.running))

    def deliver_outputs(self) -> None:
        """Hand this step's outputs to their requests' sinks."""
        outbox, self._outbox = self._outbox, []
        for req, out in outbox:
            req.sink(out)

    def _allocate(self, n: int) -> list[int] | None:
        blocks = self.pool.allocate(n)
        if blocks is None and self.held and self._reclaim_pending == 0:
            # Holds are cache: ask the connector to give the oldest back instead of refusing.
            self.counters["reclaim_requests"] += 1
            self._reclaim_pending = self.kv.reclaim_holds(n - self.pool.num_free)
        return blocks

    def _schedule(self) -> tuple[list[SimRequest], list[tuple[SimRequest, int]]]:
        """This step's work within `max_num_batched_tokens`, in vLLM's order: a token for each
        decoding request, then chunks of the prefills in progress, then new admissions.
        Returns the decoding requests and the (request, new tokens) prefill chunks."""
        total = self.config.max_num_batched_tokens
        decoding = [r for r in self.running.values() if r.state is ReqState.RUNNING]
        chunks: list[tuple[SimRequest, int]] = []
        preempted = self.counters["preemptions"]
        for req in [r for r in self.running.values() if r.state is ReqState.PREFILL]:
            if req.request_id not in self.running:
                continue  # preempted for an earlier chunk's blocks
            budget = total - len(decoding) - sum(n for _, n in chunks)
            remaining = len(req.all_token_ids) - req.num_computed
            n = min(remaining, budget)
            if n <= 0 < remaining:
                break
            grown = self._grow(req, req.num_computed + n + int(n == remaining))
            # A preemption may have taken a request scheduled earlier in this step.
            chunks = [(r, k) for r, k in chunks if r.request_id in self.running]
            decoding = [r for r in decoding if r.request_id in self.running]
            if not grown:
                break
            chunks.append((req, n))
        if self.counters["preemptions"] == preempted:
            # vLLM admits nothing in a step that had to preempt.
            self._admit(total - len(decoding) - sum(n for _, n in chunks), chunks)
        return decoding, chunks

    def _grow(self, req: SimRequest, tokens: int) -> bool:
        """Blocks for the first `tokens` positions of a running request; under pressure
        reclaim holds, then preempt the newest running request (perhaps this one)."""
        while True:
            need = self.pool.blocks_for(tokens) - len(req.block_ids)
            if need <= 0:
                return True
            extra = self._allocate(need)
            if extra is not None:
                req.block_ids.extend(extra)
                return True
            if self._reclaim_pending or self._preempt_newest() is req:
                return False

    def _admit(self, budget: int, chunks: list[tuple[SimRequest, int]]) -> None:
        """Admit waiting requests while budget is left; each prefills a first chunk of it
        (appended to `chunks`), or waits for its remote KV (no budget, as in vLLM)."""
        while (
            self.waiting
            and budget > 0
            and len(self.running) + len(self.loading) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            n = self._admit_one(req, budget)
            if n is None:
                return
            if req.request_id in self.running:
                chunks.append((req, n))
                budget -= n

    def _first_chunk_blocks(self, req: SimRequest, computed: int, budget: int) -> tuple[int, int]:
        """(first chunk's tokens, positions its blocks must cover) for a request that starts
        prefilling at `computed`: the final chunk also covers the first sampled token's KV."""
        remaining = len(req.all_token_ids) - computed
        n = min(remaining, budget)
        return n, computed + n + int(n == remaining)

    def _admit_one(self, req: SimRequest, budget: int) -> int | None:
        """Admit the head of the queue, new or preempted; returns its first chunk (0 when it
        loads), or None when the pool cannot take it now. vLLM admits both alike, as a request
        with nothing computed: local prefix hit first (a preempted request's own full blocks,
        cached when it was preempted, over its prompt and output so far), then the connector
        asked for what lies beyond it; the rest is computed (recomputed: same values). What a
        request reports it reused is its first admission's split."""
        first = not req.preempted
        # Asked on every admission attempt, as vLLM does (a retry after a failed allocation
        # may see a different local hit). The connector is told the local hit, so it loads
        # only what lies beyond it. The last prompt token is always computed (its logits).
        usable = (len(req.all_token_ids) - 1) // self.pool.block_size
        # Keys made as the lookup goes: it stops at the first miss, and a request the pool
        # cannot take yet is looked up again every step.
        hit = self.pool.cached_prefix(self._each_cache_key(req, 0, usable))
        local = len(hit) * self.pool.block_size
        n_ext, is_async = self._ask_connector(req, local)
        if first:
            req.external = (n_ext, is_async)
        computed = local + n_ext
        if is_async:
            # Blocks for what arrives; the rest is allocated chunk by chunk after it.
            n, tokens = 0, computed
        else:
            n, tokens = self._first_chunk_blocks(req, computed, budget)
        # The hit blocks are shared, not copied: they leave the free queue before the new
        # blocks are taken, so the allocation cannot evict them.
        self.pool.share(hit)
        new = self._allocate(self.pool.blocks_for(tokens) - len(hit))
        if new is None:
            self.pool.free(hit)
            return None
        blocks = [*hit, *new]
        self.waiting.popleft()
        req.block_ids = blocks
        req.prefill_start = None
        req.cached_tokens = local
        if first:
            req.admitted_local, req.admitted_external = local, n_ext
        self.kv.update_state_after_alloc(req, blocks, n_ext)
        if is_async:
            self._start_loading(req)
            return 0
        req.num_computed = computed
        if first:
            req.loaded_tokens = n_ext
        req.state = ReqState.PREFILL
        self.running[req.request_id] = req
        return n

    def _cache_keys(self, req: SimRequest, first: int, last: int) -> list[tuple[str | None, int]]:
        """Prefix-cache keys of the request's full blocks [first, last): the prefix hash of
        each block's last position, under the request's `cache_salt` (vLLM seeds its block
        hashes with it, so requests of different salts share nothing)."""
        return list(self._each_cache_key(req, first, last))

    def _each_cache_key(
        self, req: SimRequest, first: int, last: int
    ) -> Iterator[tuple[str | None, int]]:
        bs, hashes, salt = self.pool.block_size, req.hashes, req.cache_salt
        return ((salt, hashes[(b + 1) * bs - 1]) for b in range(first, last))

    def _cache_computed(self, req: SimRequest, start: int, end: int) -> None:
        """Register the full blocks whose KV positions [start, end) just completed (and, with
        KV events on, note the newly cached ones: `take_kv_events`)."""
        if not self.pool.prefix_caching:
            return
        bs = self.pool.block_size
        first, last = start // bs, end // bs
        if first == last:
            return  # no block completed (most decode steps)
        for b, key in zip(range(first, last), self._cache_keys(req, first, last), strict=True):
            if self.pool.cache(req.block_ids[b], key) and self._stored is not None:
                self._stored.append(
                    StoredBlock(
                        key,
                        self._cache_keys(req, b - 1, b)[0] if b else None,
                        req.all_token_ids[b * bs : (b + 1) * bs],
                        req.cache_salt if b == 0 else None,
                    )
                )

    def follow_cache(self) -> None:
        """Start noting what the prefix cache stores and evicts (`take_kv_events`): one list,
        the pool appending the keys it evicts where this engine appends the blocks it caches,
        so the two stay in the order they happened."""
        self._stored = []
        self.pool.evicted_keys = self._stored

    def take_kv_events(self) -> list[StoredBlock | Hashable]:
        """Since the last call, in order: a `StoredBlock` for each block cached, the key of
        each block evicted."""
        changes = self._stored
        if changes is None:
            return []
        self._stored = []
        self.pool.evicted_keys = self._stored
        return list(changes)

    def _ask_connector(self, req: SimRequest, local_hit: int = 0) -> tuple[int, bool]:
        n_ext, is_async = self.kv.get_num_new_matched_tokens(req, local_hit)
        if is_async and n_ext <= 0:
            # vLLM: `assert num_external_computed_tokens > 0` for an async load.
            raise EngineInvariantError(
                f"request {req.request_id}: asynchronous load of {n_ext} tokens"
            )
        return n_ext, is_async

    def _start_loading(self, req: SimRequest) -> None:
        req.state = ReqState.WAITING_FOR_REMOTE_KVS
        req.loading_since = self._clock()
        self.loading[req.request_id] = req

    def _check_loads_progress(self) -> None:
        limit = self.config.remote_kv_wait_limit_s
        now = self._clock()
        for req in self.loading.values():
            if now - req.loading_since > limit:
                raise EngineInvariantError(
                    f"request {req.request_id} waited {now - req.loading_since:.0f}s for "
                    f"remote KV (limit {limit:.0f}s): its load was never reported finished"
                )

    def _release_arrived(self) -> None:
        now = self._clock()
        for request_id, (req, ready_at) in list(self.arriving.items()):
            if ready_at <= now:
                del self.arriving[request_id]
                self.running[request_id] = req

    def _compute(self, decoding: list[SimRequest], chunks: list[tuple[SimRequest, int]]) -> bool:
        """Compute the step's chunks and decode tokens; True when it waited out modelled time."""
        # Decode contexts are read before prefill: a request prefilled now decodes next step.
        waited = False
        contexts = [len(r.all_token_ids) for r in decoding]
        computed = 0
        work: list[tuple[int, int]] = []
        for req, n in chunks:
            if n > 0:
                work.append((n, req.num_computed))
            if not req.preempted:
                computed += n
            self._prefill_chunk(req, n)
        if chunks or decoding:
            if self.costs is not None:
                # A preempted request's recomputation is real work on a GPU: the chunks count
                # it, though the prompt counters do not.
                cost_s = self.costs.step_time(work, contexts)
            else:
                cost_us = computed * self.config.prefill_us_per_token
                if decoding:
                    cost_us += self.config.decode_us_per_step
                cost_s = cost_us / 1e6
            if cost_s > 0:
                self.timeline.compute(cost_s)
                waited = True
        self._step_end = self._clock()
        sampled = [req for req, _ in chunks if req.state is ReqState.RUNNING] + decoding
        next_kv = self._next_kv(sampled)
        for req, _ in chunks:
            if req.request_id in self.running and req.state is ReqState.RUNNING:
                self._sample(req, next_kv)
        for req in decoding:
            if req.request_id in self.running and self._ensure_slot(req):
                self._sample(req, next_kv)
        return waited

    def _next_kv(self, reqs: list[SimRequest]) -> dict[SimRequest, NextKV]:
        """The token each of `reqs` would sample now, its prefix hash and its KV, computed for
        all of them in one pass of the model (per request, the numpy calls of `kv_for` cost
        more than the rest of a decode step). Every request that is running has its digest, so
        each one `_sample` is given has its entry. The token follows from the request's state
        alone, so a request preempted before its turn in the step only leaves its entry
        unused."""
        picks: list[tuple[SimRequest, int, int]] = []
        for req in reqs:
            if req.digest is None:
                continue
            token = self._choose(req)
            picks.append((req, token, self.model.prefix_hashes((token,), 0, req.hashes[-1])[0]))
        if not picks:
            return {}
        kv = self.model.kv_for([h for _, _, h in picks])
        return {req: (token, h, kv[i : i + 1]) for i, (req, token, h) in enumerate(picks)}

    def _choose(self, req: SimRequest) -> int:
        assert req.digest is not None
        return self.model.choose(
            req.digest, req.num_output_tokens, req.sampling.min_tokens, req.sampling.ignore_eos
        )

    def _prefill_chunk(self, req: SimRequest, n: int) -> None:
        """Compute the KV of the request's next `n` positions; the chunk that completes the
        prompt (or a preempted request's tokens) makes it ready to sample."""
        start = req.num_computed
        end = start + n
        if req.prefill_start is None:
            req.prefill_start = start
        if n > 0:
            self.pool.write(req.block_ids, start, self.model.kv_for(req.hashes[start:end]))
            self.counters["prefill_chunks"] += 1
            self.counters["prefill_tokens_computed"] += n
            self._cache_computed(req, start, end)
        req.num_computed = end
        if end < len(req.all_token_ids):
            return
        req.state = ReqState.RUNNING
        was_preempted, req.preempted = req.preempted, False
        if was_preempted and req.digest is not None:
            # Recomputed after a preemption: the model's state carries on from where it was.
            return
        first = req.prefill_start
        cached = min(req.cached_tokens, first)
        self.counters["prompt_tokens_computed"] += end - first
        self.counters["prompt_tokens_loaded"] += first - cached
        self.counters["prompt_tokens_cached"] += cached
        req.loaded_tokens = first - cached
        # The request's state after prefill: every prompt position's KV, read back.
        req.digest = self.model.prompt_digest(self.pool.read(req.block_ids, 0, end))

    def _ensure_slot(self, req: SimRequest) -> bool:
        """A block for the next token's KV; under pressure reclaim holds, then preempt."""
        if self.pool.blocks_for(len(req.all_token_ids) + 1) <= len(req.block_ids):
            return True
        extra = self._allocate(1)
        if extra is not None:
            req.block_ids.extend(extra)
            return True
        if self._reclaim_pending == 0:
            self._preempt_newest()
        return False

    def _preempt_newest(self) -> SimRequest:
        """The newest running request goes back to the queue head, its blocks freed. Its full
        blocks stay in the prefix cache (cached as they were computed; a freed block keeps its
        key until an allocation takes it), so when it is resumed only what lies beyond the
        ones still there is recomputed (or loaded again), and counted as computed."""
        victim = next(reversed(self.running.values()))
        del self.running[victim.request_id]
        self.pool.free(victim.block_ids)
        victim.block_ids = []
        victim.num_computed = 0
        victim.prefill_start = None
        victim.preempted = True
        victim.state = ReqState.WAITING
        self.waiting.appendleft(victim)
        self.counters["preemptions"] += 1
        return victim

    def _sample(self, req: SimRequest, next_kv: dict[SimRequest, NextKV]) -> None:
        assert req.digest is not None  # running, so prefilled: `_next_kv` gave it an entry
        token, prefix_hash, kv = next_kv[req]
        if req.num_output_tokens == 0:
            self._first_output(req)
        else:  # after a preemption the gap includes the recomputation, as in vLLM
            self.token_gaps.observe(self._step_end - req.last_token_at)
        req.last_token_at = self._step_end
        pos = len(req.all_token_ids)
        req.all_token_ids.append(token)
        req.hashes.append(prefix_hash)
        # Every token's KV is written at once, so the blocks always cover all_token_ids.
        self.pool.write(req.block_ids, pos, kv)
        self._cache_computed(req, pos, pos + 1)
        req.num_computed = pos + 1
        window = self.pool.read(req.block_ids, max(0, pos + 1 - DECODE_WINDOW), pos + 1)
        req.digest = self.model.step_digest(req.digest, window)
        self.counters["generation_tokens"] += 1
        self._emit_progress(req, token)

    def _first_output(self, req: SimRequest) -> None:
        """vLLM's `PrefillStats` at a request's first output: the prompt token counters, and
        the request's `num_cached_tokens` for its usage (a D given P's
        `remote_prefill_cached_tokens` reports those instead, as vLLM's output processor does)."""
        if req.num_cached_tokens is not None:
            return
        prompt = req.num_prompt_tokens
        local, external = req.admitted_local or 0, req.admitted_external
        cached = local + external
        c = self.counters
        c["vllm_prompt_tokens"] += prompt
        c["vllm_prompt_local_compute"] += prompt - cached
        c["vllm_prompt_local_cache_hit"] += local
        c["vllm_prompt_external_kv_transfer"] += external
        c["vllm_prompt_tokens_cached"] += cached
        # vLLM's estimate: prompt tokens in full blocks its prefix cache now knows, less the
        # cached ones (0 without a prefix cache).
        if self.pool.prefix_caching:
            full = prompt // self.config.block_size * self.config.block_size
            req.cache_creation_tokens = max(0, full - cached)
        req.num_cached_tokens = cached
        params = req.kv_transfer_params
        if params and params.get(DO_REMOTE_PREFILL):
            remote = params.get(REMOTE_PREFILL_CACHED_TOKENS)
            if isinstance(remote, int):
                req.num_cached_tokens = remote

    def _emit_progress(self, req: SimRequest, token: int) -> None:
        reason: str | None = None
        if token == self.tokenizer.eos_id and not req.sampling.ignore_eos:
            reason = "stop"
        else:
            req.text += self.tokenizer.decode([token])
        stop_at = -1
        for stop in req.sampling.stop:
            found = req.text.find(stop)
            if found >= 0 and (stop_at < 0 or found < stop_at):
                stop_at = found
        if stop_at >= 0:
            req.text = req.text[:stop_at]
            reason = "stop"
        if reason is None and (
            req.num_output_tokens >= req.sampling.max_tokens
            or len(req.all_token_ids) >= self.config.max_model_len
        ):
            reason = "length"
        if reason is None:
            # Hold back text that could still turn out to be the start of a stop string.
            holdback = max((len(s) - 1 for s in req.sampling.stop), default=0)
            upto = max(req.emitted_chars, len(req.text) - holdback)
            delta = req.text[req.emitted_chars : upto]
            req.emitted_chars = upto
            self._outbox.append((req, Output(text=delta, token_ids=[token])))
            return
        delta = req.text[req.emitted_chars :]
        req.emitted_chars = len(req.text)
        del self.running[req.request_id]
        params = self._release(req, hold=True)
        if params is not None and params.get(DO_REMOTE_PREFILL) and req.num_output_tokens == 1:
            # vLLM adds this when the request ends at its first output (P's answer): its
            # cached prompt tokens, for D to report as its own.
            params[REMOTE_PREFILL_CACHED_TOKENS] = (req.admitted_local or 0) + req.admitted_external
        self.counters["requests_finished"] += 1
        final = Output(
            text=delta,
            token_ids=[token],
            finished=True,
            finish_reason=reason,
            kv_transfer_params=params,
            prompt_tokens=req.num_prompt_tokens,
            completion_tokens=req.num_output_tokens,
            loaded_tokens=req.loaded_tokens,
            num_cached_tokens=req.num_cached_tokens or 0,
            cache_creation_tokens=req.cache_creation_tokens,
        )
        self._outbox.append((req, final))

    def _release(self, req: SimRequest, *, hold: bool) -> dict[str, object] | None:
        """Tell the connector the request finished; free its blocks now or keep them held."""
        req.state = ReqState.FINISHED
        # An aborted or failed request offers no blocks: nothing of it is worth holding.
        offered = req.block_ids if hold else []
        delay_free, params = self.kv.request_finished(req, offered)
        if delay_free:
            keep = list(offered)
            groups = params.get(REMOTE_BLOCK_IDS) if params else None
            if isinstance(groups, list) and len(groups) == 1 and isinstance(groups[0], list):
                # Keep exactly what the connector advertises (it may hold fewer blocks than
                # the request used, e.g. not the one with only the last token's KV).
                advertised = set(groups[0])
                keep = [b for b in offered if b in advertised]
            kept = set(keep)
            self.held[req.request_id] = keep
            self.pool.free([b for b in req.block_ids if b not in kept])
        else:
            self.pool.free(req.block_ids)
        req.block_ids = []
        return params

    def _process_connector(self, out: ConnectorOutput) -> None:
        for request_id in out.finished_sending:
            blocks = self.held.pop(request_id, None)
            if blocks is None:
                # vLLM: `assert req_id in self.requests` (freed already, or never held).
                raise EngineInvariantError(
                    f"finished_sending reports {request_id}, which holds no blocks here"
                )
            self.pool.free(blocks)
            self._reclaim_pending = max(0, self._reclaim_pending - len(blocks))
        if not self.held:
            self._reclaim_pending = 0
        for request_id in out.finished_recving:
            req = self.loading.pop(request_id, None)
            if req is None:
                # vLLM: the request must exist and be waiting for remote KV (or finished).
                raise EngineInvariantError(
                    f"finished_recving reports {request_id}, which is not loading here"
                )
            if req.aborted:
                # Finished mid-load (the connector already heard of it): free the blocks now.
                self.pool.free(req.block_ids)
                req.block_ids = []
                continue
            if request_id in out.failed:
                self._fail(req, EngineError(502, "KV transfer from the remote engine failed"))
                continue
            arrived = self.kv.loaded_tokens(req)
            ready_at = self._modelled_arrival(req, req.cached_tokens, arrived)
            req.num_computed = max(arrived, req.cached_tokens)
            # What arrived intact is this prompt's KV (the connector verified its tokens).
            self._cache_computed(req, req.cached_tokens, req.num_computed)
            req.state = ReqState.PREFILL
            if ready_at is not None:
                # The real read moved the scaled-down pool's bytes; a GPU's take this long more.
                self.arriving[request_id] = (req, ready_at)
            else:
                self.running[request_id] = req
        for request_id in out.failed - out.finished_recving:
            req = self.loading.pop(request_id, None) or self.running.pop(request_id, None)
            if req is not None:
                self._fail(req, EngineError(502, "KV transfer from the remote engine failed"))

    def _modelled_arrival(self, req: SimRequest, start: int, end: int) -> float | None:
        """When the KV of positions [start, end), just read, would have arrived on the
        modelled GPUs (None without a cost profile, or nothing read): one transfer of those
        tokens in as many descriptors as the blocks' runs make (the blocks this engine read
        into and the holder's they came from, consecutive on both sides), queued on this
        engine's link behind the loads before it."""
        if self.costs is None or end <= start:
            return None
        bs = self.pool.block_size
        first, last = start // bs, -(-end // bs)
        groups = (req.kv_transfer_params or {}).get(REMOTE_BLOCK_IDS)
        remote = groups[0][first:last] if isinstance(groups, list) and groups else []
        local = req.block_ids[first:last]
        runs = len(block_runs(local, remote, True)) if len(remote) == len(local) else None
        duration = self.costs.transfer_time(
            end - start, self.link, runs, self.config.kv_transfer_layout
        )
        self._link_free_at = max(self._clock(), self._link_free_at) + duration
        return self._link_free_at

    def _fail(self, req: SimRequest, error: EngineError) -> None:
        self.counters["requests_failed"] += 1
        self._release(req, hold=False)
        self._outbox.append(
            (req, Output(text="", token_ids=[], finished=True, finish_reason=None, error=error))
        )


def run_to_completion(core: EngineCore, done: Callable[[], bool], max_steps: int = 10**7) -> None:
    """Step `core` inline until `done()` (the in-process reference uses this)."""
    for _ in range(max_steps):
        if done():
            return
        core.step()
        core.deliver_outputs()
    raise RuntimeError("engine did not finish the request")
