"""The layout the connector asks vLLM for, against vLLM itself: the hook it calls
(`KVConnectorBase_V1.get_required_kvcache_layout`) and the block-outermost layout kvrelay names
(`KVCacheLayout.BLHNC`) still exist, and the CPU build keeps its per-layer layout (its attention
backend reads no other), so the CPU P/D suite runs per-layer pages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm


def test_vllm_asks_the_connector_class_for_a_layout_kvrelay_can_name() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvrelay.connector.vllm.adapter import KVRelayConnector
    from kvrelay.connector.vllm.settings import BLOCK_MAJOR_LAYOUT

    assert isinstance(vars(KVConnectorBase_V1)["get_required_kvcache_layout"], classmethod)
    layout = KVCacheLayout[BLOCK_MAJOR_LAYOUT]
    assert layout.is_block_outermost and layout.is_block_contiguous
    cuda = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}),
        device_config=SimpleNamespace(device_type="cuda"),
    )
    assert KVRelayConnector.get_required_kvcache_layout(cuda) == BLOCK_MAJOR_LAYOUT
    # The CPU backend reads per-layer pages only: asking it for BLHNC would only log a warning.
    assert layout not in CPUAttentionBackend.supported_kv_cache_layouts()
    cuda.device_config.device_type = "cpu"
    assert KVRelayConnector.get_required_kvcache_layout(cuda) is None
