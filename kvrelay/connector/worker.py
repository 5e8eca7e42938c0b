"""`ConnectorWorker`: one per TP rank. Handshake, claim, NIXL reads, notifications, failures.

Threads: the engine's thread calls `start_load_kv` / `get_finished` and is the only one that
touches NIXL. Side-channel calls (claim, handshake with bounded retries) run on a pool of the
holder's own (`claim_concurrency_per_holder` threads), so a hung holder delays only the loads
that name it; their results and failures come back through thread-safe queues; releases go
through a `ReleaseSender` (per-holder threads, bounded retries). Only holders in
`allowed_holders` are contacted. A holder whose claims, handshakes or READs timed out is down
(`breaker.HolderBreaker`): loads naming it fail at once until a probe shows it answers again.
Every failure — handshake, incompatible holder or cache layout, claim "gone" or
"claimed", setup, transfer error or timeout, unexpected exception — goes through ONE handler
(`_fail`): the holder is released (our own claim ends) so nothing stays stranded, and once no
READ of the request can still write into its local blocks, the blocks become invalid and the
request is reported finished-receiving (the scheduler applies the failure policy).

A READ that failed or timed out while NIXL still has it in progress is cancelled: it stops
counting as a load, but its handle is kept and polled until NIXL reports it over (done or
failed). Until then the request is not reported, so the engine keeps its blocks (quarantined):
releasing a NIXL handle does not stop data already requested from landing. Past
`cancel_grace_s` the read counts as stuck (`reads_stuck`, logged) and its holder is forgotten:
removing the holder's NIXL agent ends every transfer still posted to it (NIXL reports them
failed, and nothing lands after that), so the blocks come back at the next poll instead of when
the holder progresses again, which a hung holder may never do. A holder that dies ends it too
(NIXL reports the failure). If NIXL refuses to release a handle, handle and blocks are kept and
the release retried (a status error does not prove the DMA stopped). Past
`max_quarantined_blocks` quarantined blocks (those of cancelled reads, and of reads still in
flight from a holder that has one), loads from such a holder are refused at once
(`quarantine` failures); `quarantined_blocks` and `quarantined_block_ms` (blocks x
milliseconds) show what quarantines cost.

One NIXL agent entry per holder instance: loaded at the first read from it and replaced only
when the holder's instance id changes (a restart: the old entry is removed first), dropped once
no read used it for `remote_idle_s` (holders come and go) or when a read from it is stuck. One
read's failure never removes it, so other reads from the same holder are untouched.

What a reader believes of a holder: it is authenticated (signed side channel, allowed
address); the NIXL metadata it loads is the agent its signed handshake names; its claim answers
exactly the blocks the params named, at their places in the hold (a holder answering others,
more or reordered ones is refused: `mismatch`); every block id read lies inside the geometry
its signed handshake declared; and the blocks' tokens are the prompt's (the chained block
hashes, checked by the scheduler). The bytes themselves are the
holder's word: an authenticated engine is trusted with them.

Holder role: each rank counts read notifications per request; a request is reported
`finished_sending` once the expected number of readers (carried in the message) notified, or
when the scheduler's metadata orders it freed (release, expiry, reclaim).
"""

from __future__ import annotations

import base64
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvrelay.connector.allowlist import HolderAllowlist
from kvrelay.connector.breaker import DownReason, Holder, HolderBreaker
from kvrelay.connector.config import ConnectorConfig
from kvrelay.connector.errors import ConnectorError, ConnectorErrorKind
from kvrelay.connector.layout import CacheGeometry, CacheLayout, LayoutError, geometry_from_tensors
from kvrelay.connector.metadata import ConnectorMetadata, RecvSpec
from kvrelay.connector.protocol import ClaimResponse, HandshakeResponse
from kvrelay.connector.releases import Release, ReleaseSender
from kvrelay.connector.sidechannel_client import (
    HolderNotAllowedError,
    SideChannelClient,
    SideChannelError,
)
from kvrelay.connector.stats import Counters
from kvrelay.connector.tp import ReadPiece, ReadPlan, TPMismatchError, plan_reads
from kvrelay.connector.transport import (
    NixlTransport,
    PreparedList,
    TransportError,
    XferHandle,
    block_indices,
    build_descs,
    merged_descs,
)

log = logging.getLogger(__name__)


def _unreachable(exc: SideChannelError) -> bool:
    """No answer at all (timeout, refused connection): the holder may be down. An answer, even
    an error or a forged one, is not; a refused address was never contacted."""
    return exc.status is None and not isinstance(exc, HolderNotAllowedError)


NOTIF_TAG = "kvr1"
_RECENT_MAX = 50_000
_EARLY_NOTIF_TTL_S = 600.0


def notif_message(remote_request_id: str, expected: int) -> bytes:
    """Read/free notification for a holder rank: its request id and how many to expect."""
    return f"{NOTIF_TAG}|{expected}|{remote_request_id}".encode()


def parse_notif(message: bytes) -> tuple[str, int] | None:
    try:
        tag, expected, rid = message.decode().split("|", 2)
        count = int(expected)
    except (UnicodeDecodeError, ValueError):
        return None
    if tag != NOTIF_TAG or count < 1 or not rid:
        return None
    return rid, count


class LoadFailure(ConnectorError):
    """A read could not be done; `kind` labels the failure counter."""

    def __init__(self, kind: ConnectorErrorKind, message: str) -> None:
        super().__init__(message, kind)


@dataclass
class _RemoteEngine:
    engine_id: str
    instance_id: str
    tp_size: int
    agents: dict[int, str]
    geometries: dict[int, CacheGeometry]
    last_used: float = field(default_factory=time.monotonic)
    # Each rank's caches as a prepared descriptor list, made at its first read (`prepared_reads`)
    lists: dict[int, PreparedList] = field(default_factory=dict)


@dataclass
class _Prepared:
    spec: RecvSpec
    claim: ClaimResponse
    handshake: HandshakeResponse | None
    claimed_at: float


@dataclass
class _Read:
    spec: RecvSpec
    handles: list[XferHandle]
    notify_agents: list[str]
    message: bytes
    deadline: float
    pin_deadline: float
    num_blocks: int
    # Set once the read failed: it is being cancelled and is reported when NIXL says it is over.
    failure: LoadFailure | None = None
    failed_at: float = 0.0
    grace_deadline: float = 0.0
    stuck: bool = False

    @property
    def holder(self) -> Holder:
        return (self.spec.remote_host, self.spec.remote_port)


@dataclass
class _Notifs:
    count: int = 0
    expected: int = 1
    first_seen: float = field(default_factory=time.monotonic)


class ConnectorWorker:
    """Worker-side connector for one rank (see module docstring)."""

    def __init__(self, config: ConnectorConfig, rank: int, tp_size: int) -> None:
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank {rank} out of range for tp_size {tp_size}")
        self.config = config
        self.rank = rank
        self.tp_size = tp_size
        self.agent_name = f"{config.engine_id}-r{rank}-{uuid.uuid4().hex[:8]}"
        self.counters = Counters(
            "transfers",
            "blocks_read",
            "bytes_read",
            "failures",
            "notifs_received",
            "notifs_ignored",
            "freed_reported",
            "read_reported",
            "handshakes",
            "descs_posted",
            "reads_prepared",
            "remote_agents_added",
            "remote_agents_removed",
            "reads_cancelled",
            "reads_stuck",
            "handle_releases_failed",
            "quarantined_block_ms",
        )
        self._transport: NixlTransport | None = None
        self._geometry: CacheGeometry | None = None
        self._client: SideChannelClient | None = None
        self._releases: ReleaseSender | None = None
        self._client_lock = threading.Lock()
        # Claims and handshakes, one pool per holder (engine thread only creates and submits).
        self._pools: dict[Holder, ThreadPoolExecutor] = {}
        self._pool_work: dict[Holder, list[Future[None]]] = {}
        self._breaker = HolderBreaker(config.holder_retry_s)
        # Loads let through to a down holder as its probe (pool threads read, engine writes).
        self._probes: set[str] = set()
        self._prepared: queue.Queue[_Prepared] = queue.Queue()
        self._failures: queue.Queue[tuple[str, LoadFailure]] = queue.Queue()
        # Snapshot of known holder instances, read by pool threads (replaced, never mutated).
        self._known_instances: dict[str, str] = {}
        self._remotes: dict[str, _RemoteEngine] = {}
        self._local_list: PreparedList | None = None  # this rank's caches, prepared once
        self._specs: dict[str, RecvSpec] = {}
        self._reads: dict[str, _Read] = {}
        self._holding: set[str] = set()
        self._notifs: dict[str, _Notifs] = {}
        self._recently_freed: OrderedDict[str, None] = OrderedDict()
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._invalid: set[int] = set()

    # --- setup -----------------------------------------------------------------------------
    def register_kv_caches(self, caches: dict[str, torch.Tensor], layout: CacheLayout) -> None:
        geometry = geometry_from_tensors(caches, layout)
        transport = NixlTransport(self.agent_name, self.config.nixl_threads)
        transport.register(list(caches.values()), geometry.mem_type)
        self._transport, self._geometry = transport, geometry
        if self.config.prepared_reads:
            self._local_list = transport.prepare(geometry)

    def get_handshake_metadata(self) -> dict[str, Any]:
        transport, geometry = self._require()
        return {
            "agent_name": self.agent_name,
            "agent_metadata_b64": base64.b64encode(transport.metadata()).decode(),
            "layout": geometry.to_dict(),
        }

    def _require(self) -> tuple[NixlTransport, CacheGeometry]:
        if self._transport is None or self._geometry is None:
            raise RuntimeError("register_kv_caches() must be called first")
        return self._transport, self._geometry

    def _side_channel(self) -> SideChannelClient:
        # Pool threads ask concurrently: exactly one client (and one release sender) is made.
        with self._client_lock:
            if self._client is None:
                self._client = SideChannelClient(
                    self.config.require_secret(),
                    timeout_s=self.config.handshake_timeout_s,
                    allowlist=HolderAllowlist(self.config.allowed_holders),
                )
                self._releases = ReleaseSender(
                    self._client,
                    self.counters,
                    attempts=self.config.release_attempts,
                    per_holder=self.config.release_concurrency_per_holder,
                    name=f"kvrelay-w{self.rank}-release",
                )
            return self._client

    # --- per step --------------------------------------------------------------------------
    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        """Start this step's reads (side-channel work off-thread) and apply frees/holds."""
        for rid in meta.reqs_to_hold:
            self._holding.add(rid)
            self._maybe_done_sending(rid)
        for rid in meta.reqs_to_free:
            if rid in self._recently_freed:
                continue  # already reported once (its readers' notifications came first)
            self._holding.discard(rid)
            self._notifs.pop(rid, None)
            self._remember_freed(rid)
            self._done_sending.add(rid)
            self.counters.inc("freed_reported")
        for rid, spec in meta.reqs_to_recv.items():
            self._specs[rid] = spec
            holder = (spec.remote_host, spec.remote_port)
            down = self._breaker.is_down(holder)
            refusal = self._refusal(holder)
            if refusal is not None:
                self._fail(rid, refusal)  # recomputed (or failed) now, not after a timeout
                continue
            if down:
                self._probes.add(rid)
            self._submit(holder, spec)
        for rid, local_blocks in meta.reqs_to_fail.items():
            self._invalid.update(local_blocks)
            self._done_recving.add(rid)

    def _refusal(self, holder: Holder) -> LoadFailure | None:
        """Why a new load from `holder` must not start now (None: it may)."""
        if self._quarantine_full(holder):
            return LoadFailure(
                ConnectorErrorKind.QUARANTINE,
                f"{self._quarantined_blocks()} blocks quarantined behind unfinished READs "
                f"(max_quarantined_blocks {self.config.max_quarantined_blocks}); "
                f"holder {holder[0]}:{holder[1]} has some of them",
            )
        if not self._breaker.allow(holder):
            return LoadFailure(
                ConnectorErrorKind.HOLDER_DOWN,
                f"holder {holder[0]}:{holder[1]} timed out recently; retried in the background",
            )
        return None

    def _quarantined_blocks(self, holder: Holder | None = None) -> int:
        """Blocks behind cancelled reads, and behind reads still in flight from a holder with
        a cancelled one (they are likely to follow it), of `holder` or of any."""
        suspect = {r.holder for r in self._reads.values() if r.failure is not None}
        return sum(
            r.num_blocks
            for r in self._reads.values()
            if r.holder in suspect and (holder is None or r.holder == holder)
        )

    def _quarantine_full(self, holder: Holder) -> bool:
        if self._quarantined_blocks() < self.config.max_quarantined_blocks:
            return False
        return self._quarantined_blocks(holder) > 0

    def _submit(self, holder: Holder, spec: RecvSpec) -> None:
        pool = self._pools.get(holder)
        if pool is None:
            self._drop_idle_pools()
            pool = ThreadPoolExecutor(
                max_workers=self.config.claim_concurrency_per_holder,
                thread_name_prefix=f"kvrelay-w{self.rank}-{holder[0]}:{holder[1]}",
            )
            self._pools[holder] = pool
        work = [f for f in self._pool_work.get(holder, []) if not f.done()]
        work.append(pool.submit(self._prepare, spec))
        self._pool_work[holder] = work

    def _drop_idle_pools(self, keep: int = 32) -> None:
        """Holders come and go (restarts on new ports): idle pools beyond `keep` are closed."""
        if len(self._pools) < keep:
            return
        for holder in list(self._pools):
            if all(f.done() for f in self._pool_work.get(holder, [])):
                self._pools.pop(holder).shutdown(wait=False)
                self._pool_work.pop(holder, None)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Drive NIXL; return (finished_sending, finished_recving) since the last call."""
        self._start_prepared()
        self._poll_reads()
        self._poll_notifs()
        self._drain_failures()
        self._forget_idle_remotes()
        sending, self._done_sending = self._done_sending, set()
        recving, self._done_recving = self._done_recving, set()
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def stats(self) -> dict[str, int]:
        snap = self.counters.snapshot()
        cancelling = sum(1 for r in self._reads.values() if r.failure is not None)
        snap["reads_in_flight"] = len(self._reads) - cancelling
        snap["reads_cancelling"] = cancelling
        snap["quarantined_blocks"] = self._quarantined_blocks()
        snap["holders_down"] = self._breaker.down_count()
        snap["holding"] = len(self._holding)
        return snap

    def shutdown(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._pools.clear()
        if self._transport is not None:
            for read in self._reads.values():
                for handle in read.handles:
                    self._transport.release(handle)
            self._reads.clear()
            for engine_id in list(self._remotes):
                self._forget_remote(engine_id)
            if self._local_list is not None:
                self._transport.drop_prepared(self._local_list)
                self._local_list = None
            self._transport.close()
        if self._releases is not None:
            self._releases.close()
        if self._client is not None:
            self._client.close()

    # --- reader: off-thread side-channel work ----------------------------------------------
    def _prepare(self, spec: RecvSpec) -> None:
        holder = (spec.remote_host, spec.remote_port)
        try:
            if spec.request_id not in self._probes and self._breaker.is_down(holder):
                # Queued behind the claim that found the holder down: fail now, not in turn.
                raise LoadFailure(
                    ConnectorErrorKind.HOLDER_DOWN,
                    f"holder {holder[0]}:{holder[1]} timed out while this load waited",
                )
            client = self._side_channel()
            claimed_at = time.monotonic()  # before the holder starts the pin: conservative
            try:
                claim = client.claim(
                    spec.remote_host,
                    spec.remote_port,
                    spec.remote_request_id,
                    self.config.engine_id,
                    spec.request_id,
                )
            except SideChannelError as exc:
                if _unreachable(exc):
                    self._breaker.failed(holder, DownReason.SIDE_CHANNEL)
                raise LoadFailure(ConnectorErrorKind.CLAIM, f"claim failed: {exc}") from exc
            self._breaker.answered(holder)
            if claim.status == "claimed":
                raise LoadFailure(
                    ConnectorErrorKind.CLAIMED, "another reader request claimed these blocks"
                )
            if claim.status != "held":
                raise LoadFailure(ConnectorErrorKind.GONE, "holder no longer holds the blocks")
            first, count = spec.remote_first_block, len(spec.remote_block_ids)
            held = claim.block_ids[0] if claim.block_ids and len(claim.block_ids) == 1 else []
            if tuple(held[first : first + count]) != spec.remote_block_ids:
                # Our claim pins the hold: MISMATCH releases it (GONE would leave it pinned).
                raise LoadFailure(
                    ConnectorErrorKind.MISMATCH,
                    "holder answered other blocks (or in another order) than the params named",
                )
            handshake = None
            if self._known_instances.get(spec.remote_engine_id) != claim.instance_id:
                handshake = self._handshake(spec)
                if handshake.instance_id != claim.instance_id:
                    raise LoadFailure(
                        ConnectorErrorKind.GONE, "holder restarted between claim and handshake"
                    )
            self._prepared.put(_Prepared(spec, claim, handshake, claimed_at))
        except LoadFailure as exc:
            self._failures.put((spec.request_id, exc))
        except Exception as exc:  # anything else still ends in the one failure handler
            self._failures.put(
                (spec.request_id, LoadFailure(ConnectorErrorKind.EXCEPTION, repr(exc)))
            )

    def _handshake(self, spec: RecvSpec) -> HandshakeResponse:
        client = self._side_channel()
        last: Exception | None = None
        for attempt in range(self.config.handshake_retries):
            try:
                hs = client.handshake(spec.remote_host, spec.remote_port)
                self.counters.inc("handshakes")
            except SideChannelError as exc:
                last = exc
                if _unreachable(exc):
                    self._breaker.failed(
                        (spec.remote_host, spec.remote_port), DownReason.SIDE_CHANNEL
                    )
                    break  # the breaker now refuses this holder: no more waiting on it
                time.sleep(min(0.05 * 2**attempt, 1.0))  # retry backoff, not synchronisation
                continue
            if hs.engine_id != spec.remote_engine_id:
                raise LoadFailure(
                    ConnectorErrorKind.HANDSHAKE,
                    f"{spec.remote_host}:{spec.remote_port} is {hs.engine_id}",
                )
            if hs.compat_hash != self.config.compat_hash():
                raise LoadFailure(
                    ConnectorErrorKind.INCOMPATIBLE,
                    f"holder {hs.engine_id} compat hash {hs.compat_hash} != "
                    f"{self.config.compat_hash()} (model/dtype/layout/block size/layers/version)",
                )
            return hs
        raise LoadFailure(ConnectorErrorKind.HANDSHAKE, f"handshake failed after retries: {last}")

    # --- reader: engine thread -------------------------------------------------------------
    def _start_prepared(self) -> None:
        while True:
            try:
                prep = self._prepared.get_nowait()
            except queue.Empty:
                return
            rid = prep.spec.request_id
            if rid not in self._specs:
                continue
            try:
                self._start_read(prep)
            except LoadFailure as exc:
                self._fail(rid, exc)
            except (TransportError, TPMismatchError, LayoutError) as exc:
                self._fail(rid, LoadFailure(ConnectorErrorKind.SETUP, str(exc)))
            except Exception as exc:
                self._fail(rid, LoadFailure(ConnectorErrorKind.EXCEPTION, repr(exc)))

    def _remote_engine(self, prep: _Prepared) -> _RemoteEngine:
        """The holder instance's agent entry: loaded once, replaced only on a new instance."""
        transport, _ = self._require()
        engine_id = prep.spec.remote_engine_id
        current = self._remotes.get(engine_id)
        if current is not None and current.instance_id == prep.claim.instance_id:
            current.last_used = time.monotonic()
            return current  # another read's handshake of the same instance changes nothing
        if prep.handshake is None:
            raise LoadFailure(ConnectorErrorKind.HANDSHAKE, "no cached metadata for the holder")
        if current is not None:
            # A restarted holder: its old agents must go before the new ones are loaded.
            self._forget_remote(engine_id)
        hs = prep.handshake
        remote = _RemoteEngine(engine_id, hs.instance_id, hs.tp_size, {}, {})
        try:
            for rank, info in hs.ranks.items():
                remote.geometries[rank] = CacheGeometry.from_dict(info.layout)
                name = transport.add_remote(base64.b64decode(info.agent_metadata_b64))
                remote.agents[rank] = name
                if name != info.agent_name:
                    # The NIXL metadata is another agent's than the signed handshake names.
                    raise LoadFailure(
                        ConnectorErrorKind.HANDSHAKE,
                        f"holder rank {rank}'s NIXL metadata is agent {name!r}, its handshake "
                        f"says {info.agent_name!r}",
                    )
        except Exception:
            for name in remote.agents.values():
                transport.remove_remote(name)
            raise
        self.counters.inc("remote_agents_added")
        self._remotes[engine_id] = remote
        self._known_instances = {**self._known_instances, engine_id: hs.instance_id}
        return remote

    def _forget_idle_remotes(self) -> None:
        """Drop the agents of holders no read used for `remote_idle_s` and none reads now."""
        if not self._remotes:
            return
        cutoff = time.monotonic() - self.config.remote_idle_s
        reading = {r.spec.remote_engine_id for r in self._reads.values()}
        for engine_id, remote in list(self._remotes.items()):
            if remote.last_used < cutoff and engine_id not in reading:
                self._forget_remote(engine_id)

    def _forget_remote(self, engine_id: str) -> None:
        remote = self._remotes.pop(engine_id, None)
        known = dict(self._known_instances)
        known.pop(engine_id, None)
        self._known_instances = known
        if remote is not None and self._transport is not None:
            self.counters.inc("remote_agents_removed")
            for prepared in remote.lists.values():
                self._transport.drop_prepared(prepared)
            for name in remote.agents.values():
                self._transport.remove_remote(name)

    def _check_layouts(self, local: CacheGeometry, remote: _RemoteEngine) -> None:
        """Refuse a holder whose block bytes mean something else here (never copy verbatim)."""
        for rank, geom in remote.geometries.items():
            mine = (local.dtype, local.head_major, local.layout_name)
            theirs = (geom.dtype, geom.head_major, geom.layout_name)
            if mine != theirs:
                raise LoadFailure(
                    ConnectorErrorKind.INCOMPATIBLE,
                    f"holder rank {rank} cache layout (dtype, head-major, name) {theirs} "
                    f"!= {mine} here",
                )

    def _start_read(self, prep: _Prepared) -> None:
        transport, local = self._require()
        spec = prep.spec
        remote = self._remote_engine(prep)
        if remote.tp_size != spec.remote_tp_size:
            raise LoadFailure(ConnectorErrorKind.SETUP, "holder TP size differs from the params")
        self._check_layouts(local, remote)
        first = remote.geometries[min(remote.geometries)]
        plan: ReadPlan = plan_reads(
            self.rank,
            self.tp_size,
            remote.tp_size,
            self.config.use_mla,
            local.region_len,
            first.region_len,
            local.head_major,
        )
        if max(spec.local_block_ids, default=0) >= local.num_blocks:
            raise LoadFailure(ConnectorErrorKind.SETUP, "local block id out of range")
        message = notif_message(spec.remote_request_id, plan.expected_per_holder_rank)
        read = _Read(
            spec=spec,
            handles=[],
            notify_agents=[remote.agents[r] for r in plan.notify_only_ranks],
            message=message,
            deadline=time.monotonic() + self.config.transfer_timeout_s,
            # Past the claim's pin the holder may reuse the blocks: such a read is worthless.
            pin_deadline=(
                prep.claimed_at + 0.9 * prep.claim.pinned_for_s
                if prep.claim.pinned_for_s > 0
                else float("inf")
            ),
            num_blocks=len(spec.local_block_ids),
        )
        # Registered before posting: a failure after some pieces were posted still waits for
        # those pieces to be over before the blocks go back (see `_fail`).
        self._reads[spec.request_id] = read
        for piece in plan.pieces:
            geom = remote.geometries[piece.remote_rank]
            if max(spec.remote_block_ids, default=0) >= geom.num_blocks:
                raise LoadFailure(ConnectorErrorKind.SETUP, "remote block id out of range")
            agent = remote.agents[piece.remote_rank]
            try:
                if self._reads_prepared(local, geom, piece):
                    moved, descs = self._post_prepared(transport, remote, piece, read)
                else:
                    l_descs, r_descs = build_descs(
                        local,
                        geom,
                        spec.local_block_ids,
                        spec.remote_block_ids,
                        piece,
                        self.config.coalesce,
                    )
                    read.handles.append(transport.read(agent, l_descs, r_descs, message))
                    moved, descs = int(l_descs[:, 1].sum()), len(l_descs)
            except TransportError as exc:
                if exc.pending_handle is not None:
                    read.handles.append(exc.pending_handle)  # kept until NIXL lets it go
                raise
            self.counters.inc("bytes_read", moved)
            self.counters.inc("descs_posted", descs)

    def _reads_prepared(
        self, local: CacheGeometry, remote: CacheGeometry, piece: ReadPiece
    ) -> bool:
        """Whether this piece is read through the prepared lists: they are on, NIXL merges
        (coalescing on), and the piece is whole blocks on both sides (a slice of each block,
        heterogeneous TP, is built per read)."""
        return (
            self._local_list is not None
            and self.config.coalesce
            and piece.length == local.region_len == remote.region_len
        )

    def _post_prepared(
        self, transport: NixlTransport, remote: _RemoteEngine, piece: ReadPiece, read: _Read
    ) -> tuple[int, int]:
        """Post `piece` of `read` by block index in the prepared lists (the holder rank's made
        at its first read); the bytes it moves and the descriptors they take once NIXL has
        merged the runs adjacent on both sides."""
        local, local_list = self._geometry, self._local_list
        assert local is not None and local_list is not None
        rank, spec = piece.remote_rank, read.spec
        geom = remote.geometries[rank]
        descs = merged_descs(local, geom, spec.local_block_ids, spec.remote_block_ids)
        remote_list = remote.lists.get(rank)
        if remote_list is None:
            remote_list = remote.lists[rank] = transport.prepare(geom, remote.agents[rank])
        strips = len(local.strips)
        read.handles.append(
            transport.read_prepared(
                remote.agents[rank],
                local_list,
                block_indices(strips, local.num_blocks, spec.local_block_ids),
                remote_list,
                block_indices(strips, geom.num_blocks, spec.remote_block_ids),
                read.message,
            )
        )
        self.counters.inc("reads_prepared")
        return len(spec.local_block_ids) * strips * piece.length, descs

    def _poll_reads(self) -> None:
        if not self._reads:
            return
        transport, _ = self._require()
        now = time.monotonic()
        for rid, read in list(self._reads.items()):
            states = [transport.state(h) for h in read.handles]
            over = "PROC" not in states
            if read.failure is not None:
                if over:
                    self._finish_failed(rid)
                elif now > read.grace_deadline and not read.stuck:
                    read.stuck = True
                    self.counters.inc("reads_stuck")
                    log.error(
                        "cancelled KV read for %s still in progress after %.0fs: forgetting its "
                        "holder %s, which ends its transfers (the blocks come back once NIXL "
                        "reports them over)",
                        rid,
                        self.config.cancel_grace_s,
                        read.spec.remote_engine_id,
                    )
                    self._forget_remote(read.spec.remote_engine_id)
            elif "ERR" in states:
                self._fail(rid, LoadFailure(ConnectorErrorKind.TRANSFER, "NIXL READ failed"))
            elif now > read.pin_deadline:
                self._fail(
                    rid,
                    LoadFailure(
                        ConnectorErrorKind.TIMEOUT, "READ outlasted the holder's claim pin"
                    ),
                )
            elif over:
                for handle in read.handles:
                    transport.release(handle)  # DONE: the data is in place either way
                del self._reads[rid]
                self._breaker.read_done(read.holder)
                self._probes.discard(rid)
                self._specs.pop(rid, None)
                for agent in read.notify_agents:
                    try:
                        transport.notify(agent, read.message)
                    except TransportError as exc:  # that rank's lease still frees it
                        log.warning("free notification to %s failed: %s", agent, exc)
                self.counters.inc("transfers")
                self.counters.inc("blocks_read", read.num_blocks)
                self._done_recving.add(rid)
            elif now > read.deadline:
                self._fail(rid, LoadFailure(ConnectorErrorKind.TIMEOUT, "NIXL READ timed out"))

    def _drain_failures(self) -> None:
        while True:
            try:
                rid, exc = self._failures.get_nowait()
            except queue.Empty:
                return
            if rid in self._specs:
                self._fail(rid, exc)

    def _fail(self, rid: str, exc: LoadFailure) -> None:
        """The single failure handler (see module docstring)."""
        spec = self._specs.get(rid)
        read = self._reads.get(rid)
        if spec is None or (read is not None and read.failure is not None):
            return
        log.warning("KV load for %s failed (%s): %s", rid, exc.kind.value, exc)
        holder = (spec.remote_host, spec.remote_port)
        if exc.kind is ConnectorErrorKind.TIMEOUT:
            self._breaker.failed(holder, DownReason.READ)
        elif rid in self._probes:
            self._breaker.probe_over(holder)
        self._probes.discard(rid)
        self.counters.inc("failures")
        self.counters.inc(f"failures_{exc.kind.value}")
        if spec.hold is not None and exc.kind.releases_holder:
            # Ends our own claim's pin at once; another reader's claim is not ours to end.
            self._side_channel()
            assert self._releases is not None
            self._releases.submit(Release(spec.hold, self.config.engine_id, rid))
        if read is None:
            self._specs.pop(rid, None)
            self._report_failed(spec)
            return
        # Posted pieces may still write into the local blocks: cancel, report once over.
        self.counters.inc("reads_cancelled")
        read.failure = exc
        read.failed_at = time.monotonic()
        read.grace_deadline = read.failed_at + self.config.cancel_grace_s
        transport, _ = self._require()
        if "PROC" not in [transport.state(h) for h in read.handles]:
            self._finish_failed(rid)

    def _finish_failed(self, rid: str) -> None:
        """A cancelled read is over: free its handles, hand its blocks back as invalid.

        A handle NIXL refuses to release stays, and so do the blocks (retried next poll)."""
        read = self._reads[rid]
        if self._transport is not None:
            kept = [h for h in read.handles if not self._transport.release(h)]
            if kept:
                self.counters.inc("handle_releases_failed", len(kept))
                read.handles = kept
                return
        del self._reads[rid]
        spec = self._specs.pop(rid, None)
        held_ms = 1000 * (time.monotonic() - read.failed_at)
        self.counters.inc("quarantined_block_ms", round(read.num_blocks * held_ms))
        self._report_failed(spec or read.spec)

    def _report_failed(self, spec: RecvSpec) -> None:
        self._invalid.update(spec.local_block_ids)
        self._done_recving.add(spec.request_id)

    # --- holder: notifications -------------------------------------------------------------
    def _poll_notifs(self) -> None:
        if self._transport is None:
            return
        for msgs in self._transport.notifications().values():
            for msg in msgs:
                parsed = parse_notif(msg)
                if parsed is None or parsed[0] in self._recently_freed:
                    self.counters.inc("notifs_ignored")
                    continue
                rid, expected = parsed
                self.counters.inc("notifs_received")
                state = self._notifs.setdefault(rid, _Notifs())
                state.count += 1
                state.expected = expected
                self._maybe_done_sending(rid)
        if self._notifs:
            cutoff = time.monotonic() - _EARLY_NOTIF_TTL_S
            for rid in [r for r, s in self._notifs.items() if s.first_seen < cutoff]:
                if rid not in self._holding:
                    del self._notifs[rid]

    def _maybe_done_sending(self, rid: str) -> None:
        state = self._notifs.get(rid)
        if rid in self._holding and state is not None and state.count >= state.expected:
            self._holding.discard(rid)
            del self._notifs[rid]
            self._remember_freed(rid)
            self._done_sending.add(rid)
            self.counters.inc("read_reported")

    def _remember_freed(self, rid: str) -> None:
        self._recently_freed[rid] = None
        while len(self._recently_freed) > _RECENT_MAX:
            self._recently_freed.popitem(last=False)
