"""vLLM adapter: `KVRelayConnector`, a `KVConnectorBase_V1` that drives kvrelay's connector core.

Load it into vLLM P and D workers with::

    --kv-transfer-config '{"kv_connector": "KVRelayConnector",
                           "kv_connector_module_path": "kvrelay.connector.vllm.adapter",
                           "kv_role": "kv_both", "kv_buffer_device": "cpu",
                           "kv_connector_extra_config": {"lease_seconds": 600}}'

and `KVRELAY_CONNECTOR_SECRET` in the environment. vLLM is imported here and in
`connector/vllm/` only. The mapping of vLLM's hooks onto the core (CONTRACTS §4):

scheduler process (role SCHEDULER)            core
  get_num_new_matched_tokens(req, n)     ->  sched.get_num_new_matched_tokens(view, n)
  update_state_after_alloc(req, blocks, n) -> sched.update_state_after_alloc(view, ids, n)
  build_connector_meta(out)              ->  sched.build_connector_meta()
  update_connector_output(out)           ->  sched.update_connector_output(...)
  request_finished(req, block_ids)       ->  sched.request_finished(view, [ids]) (its params
                                             carry the request's reuse report), or
                                             sched.request_rejected(view) when the request
                                             never got blocks (vLLM's abort_immediately
                                             path for requests D refused before admission)
  set_xfer_handshake_metadata(md)        ->  sched.set_xfer_handshake_metadata({rank: md})
  has_pending_block_frees()              ->  sched.reclaim_holds(1) under block pressure
  (admission of a request that does not fit) -> sched.reclaim_holds(missing blocks)
  has_pending_push_work()                ->  sched.has_pending_work() (keep stepping)
class
  get_required_kvcache_layout(cfg)       ->  "BLHNC" (block-major caches) off the CPU unless
                                             `block_major` is false (settings)
worker process (role WORKER, one per TP rank)
  register_kv_caches(caches)             ->  ConnectorWorker.register_kv_caches(views, layout)
                                             (a block-major buffer: one row per block)
  get_handshake_metadata()               ->  worker.get_handshake_metadata()
  start_load_kv(ctx)                     ->  worker.start_load_kv(meta)
  get_finished(ids)                      ->  worker.get_finished()
  get_block_ids_with_load_errors()       ->  worker.get_block_ids_with_load_errors()
both: get_kv_connector_stats()           ->  changes of sched.stats() / worker.stats()

Reads run between engine steps (asynchronous loads), so the per-layer hooks are no-ops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from kvrelay.connector.holds import HoldEntry
from kvrelay.connector.metadata import ConnectorMetadata
from kvrelay.connector.protocol import (
    REMOTE_BLOCK_IDS,
    KVTransferParams,
)
from kvrelay.connector.scheduler import ConnectorScheduler
from kvrelay.connector.vllm.layout import prepare_caches
from kvrelay.connector.vllm.requests import request_view
from kvrelay.connector.vllm.settings import connector_config, required_kvcache_layout
from kvrelay.connector.vllm.stats import KVRelayPromMetrics, KVRelayStats, StatsDelta
from kvrelay.connector.worker import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

# Finished with every computed token's KV in place: the only requests whose blocks are held.
_COMPLETED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)

__all__ = ["KVRelayConnector"]


@dataclass
class KVRelayConnectorMetadata(KVConnectorMetadata):
    """The core's per-step metadata, shipped to every worker rank."""

    core: ConnectorMetadata = field(default_factory=ConnectorMetadata)


@dataclass
class KVRelayHandshakeMetadata(KVConnectorHandshakeMetadata):
    """One worker rank's NIXL agent metadata and cache geometry (served on the side channel)."""

    data: dict[str, Any] = field(default_factory=dict)


def _route_core_logs() -> None:
    """Send the core's `kvrelay.connector.*` records through vLLM's handlers (same format/file)."""
    core = logging.getLogger("kvrelay.connector")
    if core.handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    for handler in vllm_logger.handlers:
        core.addHandler(handler)
    core.setLevel(vllm_logger.level or logging.INFO)
    core.propagate = False


class KVRelayConnector(KVConnectorBase_V1):
    """kvrelay's NIXL connector for vLLM (see the module docstring for the hook mapping)."""

    # Loaded tokens come from another vLLM instance: `vllm:prompt_tokens_cached_by_source`
    # counts them as `p2p` (vLLM's default for a connector is `external_unspecified`).
    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _route_core_logs()
        # Raises UnsupportedConfigError (hybrid models, PP, host buffers…) before anything starts.
        self._config = connector_config(vllm_config, kv_cache_config)
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._watermark = float(getattr(vllm_config.scheduler_config, "watermark", 0.0) or 0.0)
        self._num_kv_heads = int(getattr(spec, "num_kv_heads", 1))
        self._sched: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        self._block_pool: Any = None
        self._steps = 0
        self._last_reclaim_step: int | None = None
        # Requests that got blocks from the engine (the rest, finished, were never admitted).
        self._allocated: set[str] = set()
        if role == KVConnectorRole.SCHEDULER:
            self._sched = ConnectorScheduler(self._config, num_blocks=self._num_blocks)
            self._sched.start()
            self._stats = StatsDelta()
            logger.info(
                "kvrelay connector: engine %s scheduler side, side channel on %s:%d, "
                "block size %d, lease %.0fs, load failure policy %s",
                self._config.engine_id,
                self._config.public_host,
                self._sched.side_channel_port,
                self._config.block_size,
                self._config.lease_seconds,
                self._config.kv_load_failure_policy,
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            self._config.require_secret()  # fail at start-up, not at the first read
            self._worker = ConnectorWorker(self._config, rank, self._config.tp_size)
            self._stats = StatsDelta(suffix=f"_r{rank}")
            logger.info(
                "kvrelay connector: engine %s worker rank %d/%d",
                self._config.engine_id,
                rank,
                self._config.tp_size,
            )

    # ==== scheduler side ========================================================================
    def _require_sched(self) -> ConnectorScheduler:
        if self._sched is None:
            raise RuntimeError("scheduler-side hook called on a worker-side connector")
        return self._sched

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        sched = self._require_sched()
        self._make_room(request, num_computed_tokens)
        return sched.get_num_new_matched_tokens(request_view(request), num_computed_tokens)

    def _make_room(self, request: Request, num_computed_tokens: int) -> None:
        """Holds for a next turn are cache, not reservations: when the engine is about to admit
        a request that does not fit in the free blocks, the oldest unclaimed holds go first
        (vLLM asks this hook exactly when it tries to admit a waiting request), enough of them
        for it to be admitted at the next step."""
        if self._block_pool is None or self._sched is None:
            return
        need = self._blocks_to_admit(request, num_computed_tokens)
        free = int(self._block_pool.get_num_free_blocks())
        if free >= need or self._reclaim_in_flight():
            return
        freed = self._reclaim(need - free)
        if freed:
            logger.info(
                "kvrelay: request %s needs %d blocks, %d free: reclaimed %d held blocks",
                request.request_id,
                need,
                free,
                freed,
            )

    def _blocks_to_admit(self, request: Request, num_computed_tokens: int) -> int:
        """Free blocks vLLM's `allocate_slots` wants before it admits `request` whole.

        Its local prefix hit (`num_computed_tokens`) is made of cached blocks; those no running
        request uses sit in the free queue and count as free, but admitting the request takes
        them out of it, so they are needed as well as the blocks past the hit, plus the
        watermark vLLM keeps for admissions.
        """
        pool = self._block_pool
        bs = self._config.block_size
        hit = num_computed_tokens // bs
        evictable = 0
        for block_hash in list(request.block_hashes)[:hit]:
            cached = pool.get_cached_block(block_hash, [0])
            if cached and cached[0].ref_cnt == 0:
                evictable += 1
        new = max(-(-int(request.num_tokens) // bs) - hit, 0)
        watermark = int(self._watermark * self._num_blocks)
        return new + evictable + watermark

    def _freeable(self, entry: HoldEntry) -> int:
        """Blocks of a hold that go back to the pool when it is freed: those only it uses (a
        running decode-only turn may share the history blocks through its prefix hit)."""
        blocks = self._block_pool.blocks
        return sum(1 for group in entry.block_ids for b in group if blocks[b].ref_cnt == 1)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._allocated.add(request.request_id)
        block_ids = [list(group) for group in blocks.get_block_ids()]
        self._require_sched().update_state_after_alloc(
            request_view(request), block_ids, num_external_tokens
        )
        if num_external_tokens > 0:
            logger.debug(
                "kvrelay: request %s loads %d tokens from a remote engine",
                request.request_id,
                num_external_tokens,
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._steps += 1
        return KVRelayConnectorMetadata(core=self._require_sched().build_connector_meta())

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._block_pool = gpu_block_pool

    def has_pending_block_frees(self) -> bool:
        # A running request needs a block and none is free: freeing the oldest unclaimed hold
        # (a next-turn cache entry) beats preempting live work. The blocks come back once the
        # workers echo the free, so the scheduler waits a step instead of preempting.
        if self._sched is None:
            return False
        if self._reclaim_in_flight():
            return True
        freed = self._reclaim(1)
        if freed:
            logger.info("kvrelay: block pressure, reclaimed %d held blocks", freed)
        return freed > 0

    def has_pending_push_work(self) -> bool:
        # vLLM stops stepping an engine with no request; our READs (and a reader's READ of a
        # hold we freed) complete only while the workers poll NIXL.
        return self._sched is not None and self._sched.has_pending_work()

    def _reclaim(self, num_blocks: int) -> int:
        assert self._sched is not None
        freeable = self._freeable if self._block_pool is not None else None
        freed = self._sched.reclaim_holds(num_blocks, freeable)
        if freed:
            self._last_reclaim_step = self._steps
        return freed

    def _reclaim_in_flight(self) -> bool:
        # Reclaimed blocks return to the pool once the workers echoed the free: by the step
        # after the next metadata build at the latest. Until then, reclaiming more would free
        # holds the engine does not need.
        return self._last_reclaim_step is not None and self._steps < self._last_reclaim_step + 2

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        sched = self._require_sched()
        recving = set(connector_output.finished_recving or ())
        sched.update_connector_output(
            set(connector_output.finished_sending or ()),
            recving,
            set(connector_output.invalid_block_ids or ()),
        )
        for rid in recving:
            # vLLM applies kv_load_failure_policy itself from the invalid block ids; the core's
            # per-request view is drained here and reported.
            loaded = sched.loaded_tokens(rid)
            logger.info("kvrelay: request %s loaded %d tokens from a remote engine", rid, loaded)
        for rid in sched.failed_requests():
            logger.warning("kvrelay: KV load for request %s failed (policy fail)", rid)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        sched = self._require_sched()
        view = request_view(request)
        allocated = request.request_id in self._allocated
        self._allocated.discard(request.request_id)
        params = KVTransferParams.from_wire_or_none(view.kv_transfer_params)
        if not allocated and params is not None and params.remote_block_ids:
            # Finished without ever getting blocks: refused before admission (vLLM submits an
            # abort_immediately request for it) or aborted while queued. The holder it would
            # have read from is released now instead of at lease expiry.
            sched.request_rejected(view)
            logger.info(
                "kvrelay: request %s ended before admission; released its blocks on %s",
                request.request_id,
                params.remote_engine_id,
            )
            return False, None
        if request.status not in _COMPLETED:
            # Aborted or failed (possibly mid-prefill): its KV may be incomplete, so nothing is
            # held or advertised. The core still ends any load or pending pull of it.
            view.kv_transfer_params = None
        delay_free, out = sched.request_finished(view, [list(block_ids)])
        if delay_free and out is not None:
            logger.debug(
                "kvrelay: holding %d blocks of request %s for a remote reader",
                len(out.get(REMOTE_BLOCK_IDS, [[]])[0]),
                request.request_id,
            )
        return delay_free, out

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        ranks: dict[int, dict[str, Any]] = {}
        for rank, md in metadata.items():
            if not isinstance(md, KVRelayHandshakeMetadata):
                raise TypeError(f"unexpected handshake metadata {type(md).__name__}")
            ranks[int(rank)] = md.data
        self._require_sched().set_xfer_handshake_metadata(ranks)

    # ==== worker side ===========================================================================
    def _require_worker(self) -> ConnectorWorker:
        if self._worker is None:
            raise RuntimeError("worker-side hook called on a scheduler-side connector")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        prepared = prepare_caches(
            kv_caches,
            self._num_blocks,
            self._config.block_size,
            self._num_kv_heads,
            name=self._config.kv_layout,
        )
        self._require_worker().register_kv_caches(prepared.tensors, prepared.layout)
        first = next(iter(prepared.tensors.values()))
        logger.info(
            "kvrelay: registered %d KV cache tensors (%s, physical shape %s, block dim %d)",
            len(prepared.tensors),
            "VRAM" if first.is_cuda else "DRAM",
            tuple(first.shape),
            prepared.layout.block_dim,
        )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return KVRelayHandshakeMetadata(data=self._require_worker().get_handshake_metadata())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVRelayConnectorMetadata)
        self._require_worker().start_load_kv(meta.core)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete between steps (asynchronous), never inside the forward pass."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing to save: readers pull blocks from this engine's cache."""

    def wait_for_save(self) -> None:
        """Nothing to save: readers pull blocks from this engine's cache."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._require_worker().get_finished()
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._require_worker().get_block_ids_with_load_errors()

    # ==== both ==================================================================================
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._sched is not None:
            data = self._stats.take(self._sched.stats())
        elif self._worker is not None:
            data = self._stats.take(self._worker.stats())
        else:
            return None
        return KVRelayStats(data=data) if data is not None else None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Block-major caches where the engine can have them (`required_kvcache_layout`)."""
        return required_kvcache_layout(vllm_config)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVRelayStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, *args: Any, **kwargs: Any) -> KVRelayPromMetrics:
        return KVRelayPromMetrics(*args, **kwargs)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        if self._sched is not None:
            self._sched.shutdown()
            self._sched = None
