"""`ConnectorScheduler`: the engine-wide half of the connector (one per engine).

It decides how many tokens to pull for a request (verified against the holder's block hashes,
whole blocks only, none below `kv_recompute_threshold`), turns allocations into reads for the
workers, keeps finished requests' blocks for remote readers under a lease (`holds.HoldTable`),
serves the side channel, and releases holders it will not read from (rejections, short or
mismatching prefixes) through the side channel on a background thread.

The call order is written once, in docs/CONTRACTS.md §4. All methods except `stats` are
called from the engine's scheduler thread; the side-channel thread only touches `HoldTable`.
Frees decided here (release, expiry, reclaim) reach the engine as
`ConnectorMetadata.reqs_to_free`: the workers echo them in `finished_sending`, which is the
only way the engine frees held blocks. Only held requests are ever reported finished-sending,
each once; a request is reported finished-receiving only after its load was planned, once.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.connector.accounting import ReuseReport
from kvrelay.connector.allowlist import HolderAllowlist
from kvrelay.connector.block_hash import block_hashes, matching_prefix_blocks, tail_hash
from kvrelay.connector.config import ConnectorConfig
from kvrelay.connector.holds import HoldEntry, HoldTable
from kvrelay.connector.metadata import ConnectorMetadata, RecvSpec, RequestView
from kvrelay.connector.protocol import (
    HOLD_DECLINED,
    REFUSED_FAILED,
    REFUSED_HASH,
    REFUSED_LOCAL,
    REFUSED_PARTIAL,
    REFUSED_THRESHOLD,
    REFUSED_UNVERIFIED,
    REMOTE_BLOCKS_EXPIRY_TIME,
    REMOTE_TAIL_HASH,
    TP_SIZE,
    KVTransferParams,
)
from kvrelay.connector.releases import Release, ReleaseSender
from kvrelay.connector.sidechannel_client import SideChannelClient
from kvrelay.connector.sidechannel_server import FINISHED_WAIT_S, SideChannelServer
from kvrelay.connector.stats import Counters

log = logging.getLogger(__name__)


@dataclass
class _PendingLoad:
    params: KVTransferParams
    start_tokens: int
    end_tokens: int


@dataclass
class _Loading:
    start_tokens: int
    end_tokens: int
    first_block: int
    local_block_ids: tuple[int, ...]
    # Invalid blocks reported by any rank, possibly steps before the last rank finished.
    bad: set[int] = field(default_factory=set)
    # Failed before any read started (see `ConnectorMetadata.reqs_to_fail`).
    failed: bool = False


class ConnectorScheduler:
    """Scheduler-side connector (see module docstring and CONTRACTS §4)."""

    def __init__(self, config: ConnectorConfig, num_blocks: int | None = None) -> None:
        """`num_blocks`: the engine's KV blocks (the hold budget is a share of them; None:
        unknown, no budget)."""
        self.config = config
        self.counters = Counters(
            "held",
            "held_blocks",
            "freed_by_read",
            "freed_by_release",
            "freed_by_expiry",
            "freed_by_reclaim",
            "freed_by_budget",
            "holds_over_budget",
            "holds_brief",
            "tokens_loaded",
            "loads_started",
            "loads_failed",
            "loads_skipped",
            "releases_sent",
            "releases_failed",
            "early_releases",
            "auth_rejected",
            "prefix_mismatch_blocks",
        )
        self.holds = HoldTable(
            self.counters,
            claim_timeout_s=config.claim_timeout_s,
            finished_ttl_s=config.finished_params_ttl_s,
            finished_max=config.finished_params_max,
        )
        self._compat = config.compat_hash()
        self._hold_budget: int | None = None
        self._hold_max: int | None = None  # the most blocks one next-turn hold may pin
        self._brief_max: int | None = None  # ... and brief holds, one or together
        if num_blocks is not None:
            if config.hold_budget_fraction < 1.0:
                self._hold_budget = int(config.hold_budget_fraction * num_blocks)
            if config.hold_max_fraction < 1.0:
                self._hold_max = int(config.hold_max_fraction * num_blocks)
                self._brief_max = int(config.hold_brief_max_fraction * num_blocks)
        self._handshake_md: dict[int, dict[str, Any]] | None = None
        self._server: SideChannelServer | None = None
        self._pending: dict[str, _PendingLoad] = {}
        self._loading: dict[str, _Loading] = {}
        self._loaded: dict[str, int] = {}
        self._failed: list[str] = []
        self._recvs: dict[str, RecvSpec] = {}
        self._new_holds: dict[str, float] = {}
        self._doomed: dict[str, tuple[int, ...]] = {}
        # Loads whose request finished (aborted) while NIXL was still writing its blocks: the
        # engine frees them when the load is reported in finished_recving; nothing else to do.
        self._orphaned: set[str] = set()
        # Requests whose remote hold was dealt with (load started or holder released), so
        # `request_finished` knows whether it still owes the holder a release.
        self._settled: set[str] = set()
        # What the connector did for each live request, returned by `request_finished`.
        self._reports: dict[str, ReuseReport] = {}
        self._releases: ReleaseSender | None = None
        self._client: SideChannelClient | None = None

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        secret = self.config.require_secret()
        self._client = SideChannelClient(
            secret,
            timeout_s=self.config.release_timeout_s,
            allowlist=HolderAllowlist(self.config.allowed_holders),
        )
        self._server = SideChannelServer(
            self.config.side_channel_host,
            self.config.side_channel_port,
            secret,
            self.holds,
            self.counters,
            self._handshake_payload,
            # Nothing is ever published: answer "unknown" at once instead of waiting.
            finished_wait_s=FINISHED_WAIT_S if self.config.publish_finished_params else 0.0,
            aliases=(self.config.public_host, *self.config.side_channel_aliases),
        )
        self._server.start()
        self._releases = ReleaseSender(
            self._client,
            self.counters,
            attempts=self.config.release_attempts,
            per_holder=self.config.release_concurrency_per_holder,
        )

    def shutdown(self) -> None:
        if self._releases is not None:
            self._releases.close()
            self._releases = None
        if self._server is not None:
            self._server.shutdown()
            self._server = None
        if self._client is not None:
            self._client.close()
            self._client = None

    @property
    def side_channel_port(self) -> int:
        if self._server is None:
            raise RuntimeError("start() the scheduler first")
        return self._server.port

    @property
    def instance_id(self) -> str:
        return self._server.instance_id if self._server is not None else ""

    def set_xfer_handshake_metadata(self, metadata: dict[int, dict[str, Any]]) -> None:
        if sorted(metadata) != list(range(self.config.tp_size)):
            raise ValueError(f"need handshake metadata for ranks 0..{self.config.tp_size - 1}")
        self._handshake_md = dict(metadata)

    def _handshake_payload(self) -> dict[str, Any] | None:
        if self._handshake_md is None:
            return None
        return {
            "engine_id": self.config.engine_id,
            "compat_hash": self._compat,
            TP_SIZE: self.config.tp_size,
            "ranks": self._handshake_md,
        }

    # --- reader side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, req: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens to load from the holder named in the request's params (async when > 0).

        Asked again before the engine allocated (allocation failed, retried with another
        local prefix hit), the answer is planned afresh from that hit. A request whose load
        already ran or whose holder was already released never loads again (preempted, or
        recomputing after a failed load): its hold is consumed. Never answers `(0, True)`.
        """
        rid = req.request_id
        report = self._reports.get(rid)
        if report is None:
            report = self._reports[rid] = ReuseReport(len(req.prompt_token_ids))
        if not report.admitted:
            report.local_hit_tokens = num_computed_tokens
        params = self._params(req)
        if params is None or not params.has_remote_blocks:
            return 0, False
        if rid in self._settled:
            return 0, False
        pending = self._pending.get(rid)
        if pending is not None:
            end = pending.end_tokens
        else:
            end = self._loadable_tokens(req, params)
            report.verified_blocks = math.ceil(end / self.config.block_size)
        n = end - num_computed_tokens
        # Verified blocks wholly inside the local hit need no load.
        local = min(num_computed_tokens // self.config.block_size, report.verified_blocks)
        report.refused[REFUSED_LOCAL] = local
        if n <= 0 or n < self.config.kv_recompute_threshold:
            report.refused[REFUSED_LOCAL if n <= 0 else REFUSED_THRESHOLD] += (
                report.verified_blocks - local
            )
            self._pending.pop(rid, None)
            self.counters.inc("loads_skipped")
            self._settled.add(rid)
            self._release(params)
            return 0, False
        self._pending[rid] = _PendingLoad(params, num_computed_tokens, end)
        return n, True

    def _loadable_tokens(self, req: RequestView, params: KVTransferParams) -> int:
        """Tokens at the start of the prompt whose remote KV is verified to be ours; the
        offered blocks that are not are counted in the request's report, by reason."""
        bs = self.config.block_size
        assert params.remote_block_ids is not None
        report = self._reports[req.request_id]
        report.offered_blocks = sum(len(group) for group in params.remote_block_ids)
        report.refused.clear()
        if len(params.remote_block_ids) != 1:
            report.refused[REFUSED_UNVERIFIED] = report.offered_blocks
            return 0  # one KV-cache group only
        remote_ids = params.remote_block_ids[0]
        claimed = params.remote_num_tokens if params.remote_num_tokens is not None else 0
        remote_tokens = min(max(claimed, 0), len(remote_ids) * bs)
        prompt = list(req.prompt_token_ids)
        beyond = REFUSED_PARTIAL
        if params.remote_block_hashes is not None:
            local_h = block_hashes(prompt, bs, self._compat, req.lora_name, req.cache_salt)
            matched = matching_prefix_blocks(local_h, params.remote_block_hashes)
            verified = min(matched * bs, remote_tokens)
            self.counters.inc("prefix_mismatch_blocks", len(params.remote_block_hashes) - matched)
            if matched < len(params.remote_block_hashes):
                beyond = REFUSED_HASH
            # Same-request P->D leg: every full block matched and the holder's partial tail
            # block hashes like our tokens at its place, so it belongs to this prompt too.
            full_remote = remote_tokens // bs
            if (
                params.do_remote_prefill
                and matched == full_remote == len(params.remote_block_hashes)
                and remote_tokens <= len(prompt)
                and params.remote_tail_hash is not None
                and params.remote_tail_hash
                == tail_hash(
                    prompt[:remote_tokens], bs, self._compat, req.lora_name, req.cache_salt
                )
            ):
                verified = remote_tokens
        elif self.config.require_block_hashes:
            verified = 0
            beyond = REFUSED_UNVERIFIED
        else:
            verified = min(remote_tokens, len(prompt))
        # The engine always computes at least the last prompt token itself (its logits).
        verified = max(0, min(verified, len(prompt) - 1))
        report.refused[beyond] = max(0, len(remote_ids) - math.ceil(verified / bs))
        return verified

    def update_state_after_alloc(
        self, req: RequestView, block_ids: list[list[int]], num_external_tokens: int
    ) -> None:
        report = self._reports.get(req.request_id)
        if report is not None:
            report.admitted = True
        pending = self._pending.pop(req.request_id, None)
        if pending is None:
            return
        self._settled.add(req.request_id)
        params = pending.params
        bs = self.config.block_size
        first = pending.start_tokens // bs
        if num_external_tokens <= 0:
            # The engine did not take the load it was offered: it kept its own (sub-block)
            # local hit instead, or it reads no cache at all for this request (vLLM's prompt
            # logprobs need every prompt token computed): "local" only with a local hit.
            if report is not None:
                reason = REFUSED_LOCAL if report.local_hit_tokens else REFUSED_THRESHOLD
                report.refused[reason] += report.verified_blocks - first
            self._release(params)
            return
        end = min(pending.end_tokens, pending.start_tokens + num_external_tokens)
        last = math.ceil(end / bs)
        if report is not None:
            # Planned but not accepted by the engine (it took fewer tokens): recomputed.
            report.refused[REFUSED_THRESHOLD] += report.verified_blocks - last
        assert params.remote_block_ids is not None
        remote = params.remote_block_ids[0]
        local = block_ids[0] if block_ids else []
        if last > len(local) or last > len(remote):
            # The engine already waits for this load (async): it must still end through the
            # workers' finished_recving, with the blocks it allocated for it invalid.
            log.warning("request %s: not enough blocks for the load; recomputing", req.request_id)
            self._release(params)
            doomed = tuple(local[first:])
            self._doomed[req.request_id] = doomed
            self._loading[req.request_id] = _Loading(
                pending.start_tokens, end, first, doomed, failed=True
            )
            return
        assert params.remote_engine_id and params.remote_request_id
        assert params.remote_host and params.remote_port
        spec = RecvSpec(
            request_id=req.request_id,
            local_block_ids=tuple(local[first:last]),
            remote_block_ids=tuple(remote[first:last]),
            remote_engine_id=params.remote_engine_id,
            remote_request_id=params.remote_request_id,
            remote_host=params.remote_host,
            remote_port=params.remote_port,
            remote_tp_size=params.tp_size or 1,
            hold=params.hold_ref,
            remote_first_block=first,
        )
        self._recvs[req.request_id] = spec
        self._loading[req.request_id] = _Loading(
            pending.start_tokens, end, first, spec.local_block_ids
        )
        self.counters.inc("loads_started")

    def _failed_load(self, request_id: str, loaded: int) -> None:
        self._loaded[request_id] = loaded
        self.counters.inc("loads_failed")
        if self.config.kv_load_failure_policy == "fail":
            self._failed.append(request_id)

    # --- per step --------------------------------------------------------------------------
    def build_connector_meta(self) -> ConnectorMetadata:
        self.holds.reap()
        meta = ConnectorMetadata(
            reqs_to_recv=self._recvs,
            reqs_to_hold=self._new_holds,
            reqs_to_free=set(self.holds.take_frees()),
            reqs_to_fail=self._doomed,
        )
        self._recvs, self._new_holds, self._doomed = {}, {}, {}
        return meta

    def update_connector_output(
        self,
        finished_sending: set[str] | None,
        finished_recving: set[str] | None,
        invalid_block_ids: set[int] | None = None,
    ) -> None:
        invalid = invalid_block_ids or set()
        if invalid:
            for pending_load in self._loading.values():
                pending_load.bad |= invalid.intersection(pending_load.local_block_ids)
        for rid in finished_sending or ():
            self.holds.finalize(rid)
        bs = self.config.block_size
        for rid in finished_recving or ():
            loading = self._loading.pop(rid, None)
            if loading is None:
                continue
            if rid in self._orphaned:
                self._orphaned.discard(rid)
                continue
            bad = [i for i, b in enumerate(loading.local_block_ids) if b in loading.bad]
            if loading.failed:
                self._failed_load(rid, loading.start_tokens)
            elif bad:
                # Tokens before the first bad block arrived intact; the rest is recomputed.
                good_end = max(loading.start_tokens, (loading.first_block + bad[0]) * bs)
                self._failed_load(rid, min(good_end, loading.end_tokens))
            else:
                self._loaded[rid] = loading.end_tokens
            loaded = self._loaded[rid] - loading.start_tokens
            self.counters.inc("tokens_loaded", loaded)
            report = self._reports.get(rid)
            if report is not None:
                report.loaded_tokens = loaded
                planned = math.ceil(loading.end_tokens / bs) - loading.first_block
                arrived = math.ceil(self._loaded[rid] / bs) - loading.first_block
                report.refused[REFUSED_FAILED] += planned - arrived

    def failed_requests(self) -> list[str]:
        """Requests whose load failed under policy `fail` (drained: each reported once)."""
        out, self._failed = self._failed, []
        return out

    def loaded_tokens(self, request_id: str) -> int:
        """Prompt tokens whose KV is now valid locally after the load (pop on read)."""
        return self._loaded.pop(request_id, 0)

    # --- finishing -------------------------------------------------------------------------
    def request_finished(
        self, req: RequestView, block_ids: list[list[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """(delay_free, params): hold the blocks for a remote reader when the request asks.

        The params returned carry the request's reuse report (`ReuseReport.to_params`)."""
        rid = req.request_id
        report = self._reports.pop(rid, None) or ReuseReport(len(req.prompt_token_ids))
        if rid in self._loading:
            # Finished (aborted) while NIXL may still write into its blocks. The engine keeps
            # them until the load shows up in finished_recving (vLLM does so by itself); they
            # must never be reported in finished_sending as well (vLLM has forgotten the id by
            # then). The holder is released by the read's notification or its failure.
            self._orphaned.add(rid)
            self._settled.discard(rid)
            self._loaded.pop(rid, None)
            return False, None
        pending = self._pending.pop(rid, None)
        params = self._params(req)
        if pending is not None:
            self._release(pending.params)
        elif rid not in self._settled and params is not None and params.has_remote_blocks:
            # Finished (aborted, errored) before the connector was asked about it: the holder
            # would otherwise wait for its lease.
            self.counters.inc("early_releases")
            self._release(params)
        self._settled.discard(rid)
        self._loaded.pop(rid, None)
        if params is None or not (params.do_remote_decode or params.hold_blocks):
            return False, None
        bs = self.config.block_size
        all_tokens = list(req.all_token_ids)
        # KV exists for every token except the last sampled one.
        prompt_len = len(req.prompt_token_ids)
        num_tokens = len(all_tokens) - 1 if len(all_tokens) > prompt_len else prompt_len
        group = block_ids[0] if block_ids else []
        nblocks = min(math.ceil(num_tokens / bs), len(group))
        if nblocks == 0 or len(block_ids) != 1:
            return False, None
        lease = self.config.lease_seconds
        brief = False
        if self._hold_max is not None and nblocks > self._hold_max and not params.do_remote_decode:
            # Over the share one hold may pin: kept only as a brief hold, where the proxy expects
            # the next turn within seconds, and within the larger share such a hold may pin.
            if not params.hold_brief or self._brief_max is None or nblocks > self._brief_max:
                return False, self._declined(req, report)
            lease, brief = min(lease, self.config.hold_brief_lease_s), True
            self.counters.inc("holds_brief")
        num_tokens = min(num_tokens, nblocks * bs)
        held = [list(group[:nblocks])]
        now_wall, now_mono = time.time(), time.monotonic()
        entry = HoldEntry(
            request_id=rid,
            client_request_id=req.client_request_id,
            block_ids=held,
            num_tokens=num_tokens,
            expires_at=now_mono + lease,
            release_token=secrets.token_urlsafe(24),
            next_turn=not params.do_remote_decode,
            owner=params.hold_owner or "",
            brief=brief,
        )
        scope = (req.lora_name, req.cache_salt)
        tail = tail_hash(all_tokens[:num_tokens], bs, self._compat, *scope)
        out = KVTransferParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_engine_id=self.config.engine_id,
            remote_request_id=rid,
            remote_host=self.config.public_host,
            remote_port=self.side_channel_port,
            remote_block_ids=held,
            remote_num_tokens=num_tokens,
            tp_size=self.config.tp_size,
            remote_blocks_expiry_time=now_wall + lease,
            remote_block_hashes=block_hashes(all_tokens[:num_tokens], bs, self._compat, *scope),
            **({REMOTE_TAIL_HASH: tail} if tail is not None else {}),
            release_token=entry.release_token,
            **report.to_params(),
        ).to_wire()
        self.holds.add(entry)
        if brief and self._brief_max is not None:
            # Brief holds have a bound of their own: the oldest go past it.
            self.holds.trim(self._brief_max, keep=rid, brief=True)
        elif self._hold_budget is not None and entry.next_turn:
            # Frees go out with the next step's metadata, as a reclaim's or an expiry's do.
            self.holds.trim(self._hold_budget, keep=rid)
        self._new_holds[rid] = out[REMOTE_BLOCKS_EXPIRY_TIME]
        self._publish_finished(req, out)
        return True, out

    def _declined(self, req: RequestView, report: ReuseReport) -> dict[str, Any]:
        """A next-turn hold larger than `hold_max_fraction` of the pool: not kept (one hold
        that size would pin past the share the operator allows one). Its blocks go back to the
        prefix cache, where the proxy's routing can still find them; the params say so
        (published as a hold's are, for a stream's lookup)."""
        self.counters.inc("holds_over_budget")
        out = {HOLD_DECLINED: True, **report.to_params()}
        self._publish_finished(req, out)
        return out

    def _publish_finished(self, req: RequestView, out: dict[str, Any]) -> None:
        """D's final params, for the proxy's side-channel lookup (a stream carries none)."""
        if self.config.publish_finished_params and req.client_request_id:
            self.holds.publish_finished(req.client_request_id, out)
            if self._server is not None:
                self._server.notify_finished(req.client_request_id)

    def request_rejected(self, req: RequestView) -> None:
        """Refused before admission: the holder it would have read from is released now."""
        self._pending.pop(req.request_id, None)
        self._settled.discard(req.request_id)
        self._reports.pop(req.request_id, None)
        params = self._params(req)
        if params is not None and params.has_remote_blocks:
            self.counters.inc("early_releases")
            self._release(params)

    def reclaim_holds(
        self, num_blocks: int, freeable: Callable[[HoldEntry], int] | None = None
    ) -> int:
        """Under block pressure: free the oldest unclaimed holds until `num_blocks` blocks come
        back (if possible); `freeable(entry)` says how many of a hold's blocks would (see
        `HoldTable.reclaim`). Returns the blocks that come back."""
        return self.holds.reclaim(num_blocks, freeable=freeable)

    def has_pending_work(self) -> bool:
        """Whether the engine must keep stepping although it may have no request left: a
        load's READ is in flight, or a reader's READ of a hold freed unread may still be (over
        TCP a READ completes only while the holder's worker progresses NIXL)."""
        return bool(self._loading) or self.holds.draining()

    def release_hold(self, request_id: str) -> bool:
        """Engine-internal release of one of this engine's holds (no token needed)."""
        return self.holds.release(request_id, None).value == "released"

    def stats(self) -> dict[str, int]:
        snap = self.counters.snapshot()
        snap["held"] = self.holds.held_count()
        snap["held_blocks"] = self.holds.held_blocks()
        snap["loads_in_flight"] = len(self._loading)
        return snap

    # --- helpers ---------------------------------------------------------------------------
    def _params(self, req: RequestView) -> KVTransferParams | None:
        try:
            return KVTransferParams.from_wire(req.kv_transfer_params)
        except ValueError:
            log.warning("request %s: malformed kv_transfer_params ignored", req.request_id)
            return None

    def _release(self, params: KVTransferParams) -> None:
        """Let the holder free blocks we will not read (background, never blocks the step)."""
        hold = params.hold_ref if params.has_remote_blocks else None
        if hold is None or self._releases is None:
            return
        self._releases.submit(Release(hold))
