"""A holder's NIXL metadata must be the agent its signed handshake names: a reader never loads
another agent's metadata in its place (in one process, two real NIXL agents on CPU memory)."""

from __future__ import annotations

import pytest
import torch

from kvrelay.connector import CacheLayout, ConnectorConfig, ConnectorWorker
from kvrelay.connector.metadata import RecvSpec
from kvrelay.connector.protocol import ClaimResponse, HandshakeResponse, RankHandshake
from kvrelay.connector.worker import LoadFailure, _Prepared
from kvrelay.devtools import nixl_peer

pytestmark = pytest.mark.nixl


def _worker(engine_id: str) -> ConnectorWorker:
    config = ConnectorConfig(engine_id=engine_id, secret=nixl_peer.SECRET, block_size=4, model="m")
    worker = ConnectorWorker(config, rank=0, tp_size=1)
    worker.register_kv_caches({"l0": torch.zeros(2, 8, 4, 2, 4)}, CacheLayout(block_dim=1))
    return worker


def test_metadata_of_another_agent_than_the_handshake_names_is_refused() -> None:
    reader, holder, other = _worker("reader"), _worker("holder"), _worker("other")
    try:
        named = holder.get_handshake_metadata()
        swapped = {
            **named,
            "agent_metadata_b64": other.get_handshake_metadata()["agent_metadata_b64"],
        }
        spec = RecvSpec("r1", (0,), (0,), "holder", "h1", "127.0.0.1", 1, 1, None)
        claim = ClaimResponse(status="held", block_ids=[[0]], instance_id="i1")

        def prepared(rank: dict[str, object]) -> _Prepared:
            handshake = HandshakeResponse(
                engine_id="holder", compat_hash=reader.config.compat_hash(), tp_size=1,
                ranks={0: RankHandshake.model_validate(rank)}, instance_id="i1",
            )  # fmt: skip
            return _Prepared(spec, claim, handshake, 0.0)

        with pytest.raises(LoadFailure, match="handshake says"):
            reader._remote_engine(prepared(swapped))
        assert reader.stats()["remote_agents_added"] == 0
        remote = reader._remote_engine(prepared(named))  # the true metadata loads
        assert remote.agents[0] == named["agent_name"]
    finally:
        for worker in (reader, holder, other):
            worker.shutdown()
