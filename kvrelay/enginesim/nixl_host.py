"""`NixlHost`: hosts kvrelay's real connector (scheduler side + one worker rank) in an engine.

The engine's block pool tensors are registered with the worker's NIXL agent; every engine
step builds the scheduler's metadata, hands it to the worker, polls the worker and feeds the
result back, exactly in the order CONTRACTS §4 defines.
"""

from __future__ import annotations

import logging
from typing import Any

from kvrelay.connector import CacheLayout, ConnectorConfig, ConnectorScheduler, ConnectorWorker
from kvrelay.connector.holds import HoldEntry
from kvrelay.connector.metadata import RequestView
from kvrelay.enginesim.config import EngineConfig
from kvrelay.enginesim.kvhost import ConnectorOutput
from kvrelay.enginesim.kvpool import BlockPool, KVLayout
from kvrelay.enginesim.request import SimRequest

log = logging.getLogger(__name__)


def connector_config(config: EngineConfig) -> ConnectorConfig:
    """The engine's connector settings with the KV identity taken from its pool (validated)."""
    settings = config.connector
    if settings is None:
        raise ValueError("engine has no connector settings")
    identity = {
        "model": config.model,
        "dtype": config.geometry.dtype,
        "block_size": config.block_size,
        "num_layers": config.geometry.num_layers,
        "kv_layout": config.kv_layout.value,
        "tp_size": 1,
    }
    return ConnectorConfig.model_validate({**settings.model_dump(), **identity})


class NixlHost:
    """The real connector behind the engine's `KVHost` interface (single TP rank)."""

    def __init__(self, config: EngineConfig, pool: BlockPool) -> None:
        self.config = connector_config(config)
        self.pool = pool
        self.layout = CacheLayout(
            block_dim=1 if pool.layout is KVLayout.KV_FIRST else 0, name=pool.layout.value
        )
        self.worker = self._new_worker()
        self.sched = ConnectorScheduler(self.config, num_blocks=pool.num_blocks)
        try:
            self.sched.start()
            self.sched.set_xfer_handshake_metadata({0: self.worker.get_handshake_metadata()})
        except BaseException:
            self.sched.shutdown()
            self.worker.shutdown()
            raise
        log.info(
            "connector %s: side channel on %s:%d",
            self.config.engine_id,
            self.config.side_channel_host,
            self.sched.side_channel_port,
        )

    def _new_worker(self) -> ConnectorWorker:
        worker = ConnectorWorker(self.config, rank=0, tp_size=1)
        worker.register_kv_caches(self.pool.caches, self.layout)
        return worker

    @property
    def enabled(self) -> bool:
        return True

    @property
    def side_channel_port(self) -> int:
        return self.sched.side_channel_port

    @staticmethod
    def view(req: SimRequest) -> RequestView:
        """The connector's view of a request; `all_token_ids` is the engine's growing list."""
        if req.connector_view is None:
            req.connector_view = RequestView(
                request_id=req.request_id,
                client_request_id=req.client_request_id,
                prompt_token_ids=req.prompt_token_ids,
                all_token_ids=req.all_token_ids,
                kv_transfer_params=req.kv_transfer_params,
                cache_salt=req.cache_salt,
            )
        view: RequestView = req.connector_view
        return view

    def get_num_new_matched_tokens(self, req: SimRequest, num_computed: int) -> tuple[int, bool]:
        return self.sched.get_num_new_matched_tokens(self.view(req), num_computed)

    def update_state_after_alloc(self, req: SimRequest, block_ids: list[int], n_ext: int) -> None:
        self.sched.update_state_after_alloc(self.view(req), [list(block_ids)], n_ext)

    def start_step(self) -> None:
        self.worker.start_load_kv(self.sched.build_connector_meta())

    def finish_step(self) -> ConnectorOutput:
        sending, recving = self.worker.get_finished()
        invalid = self.worker.get_block_ids_with_load_errors()
        self.sched.update_connector_output(sending, recving, invalid)
        return ConnectorOutput(
            finished_sending=set(sending),
            finished_recving=set(recving),
            failed=set(self.sched.failed_requests()),
        )

    def loaded_tokens(self, req: SimRequest) -> int:
        return self.sched.loaded_tokens(req.request_id)

    def request_finished(
        self, req: SimRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.sched.request_finished(self.view(req), [list(block_ids)])

    def request_rejected(self, req: SimRequest) -> None:
        self.sched.request_rejected(self.view(req))

    def reclaim_holds(self, num_blocks: int) -> int:
        # A held block a running request shares (its prefix hit) stays in use when the hold
        # goes: only the blocks the hold alone uses come back.
        pool = self.pool

        def freeable(entry: HoldEntry) -> int:
            return sum(1 for group in entry.block_ids for b in group if pool.ref_count(b) == 1)

        return self.sched.reclaim_holds(num_blocks, freeable)

    def drop_agent(self) -> None:
        """Lose the NIXL agent (as a crashed worker would) and come back with a fresh one.

        Readers that cached the old agent fail their reads and follow their failure policy;
        holds stay valid (frees still reach the engine through the scheduler's metadata).
        """
        old = self.worker
        self.worker = self._new_worker()
        self.sched.set_xfer_handshake_metadata({0: self.worker.get_handshake_metadata()})
        old.shutdown()

    def stats(self) -> dict[str, int]:
        out = dict(self.sched.stats())
        out.update(self.worker.stats())
        return out

    def shutdown(self) -> None:
        self.sched.shutdown()
        self.worker.shutdown()
