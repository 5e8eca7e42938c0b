"""Configurations the vLLM adapter refuses must stop vLLM at start-up with a clear message.

One real server start per case (it exits during engine start-up), plus the support check run
on vLLM's own KV-cache spec classes for the model kinds a tiny test model cannot cover.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvrelay.devtools import vllm_servers
from tests.harness import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_bad_configuration_stops_vllm_with_a_message(tiny_model: Path) -> None:
    # A misspelt knob must not be silently ignored: vLLM exits naming it. (A start that fails
    # takes as long as one that succeeds, so one case runs for real; the rest of the checks
    # run below on vLLM's own classes.)
    config = vllm_servers.kvrelay_transfer_config(free_port(), lease_secs=5)
    server = vllm_servers.VLLMServer("bad-config", tiny_model, cpu=1, transfer_config=config)
    try:
        with pytest.raises(RuntimeError, match="exited with") as failed:
            server.start()
        assert "unknown kv_connector_extra_config key(s) ['lease_secs']" in str(failed.value)
    finally:
        server.stop()


def _vllm_config(**parallel: int) -> Any:
    kv = SimpleNamespace(kv_buffer_device="cpu", kv_connector_extra_config={})
    par = {"pipeline_parallel_size": 1, "decode_context_parallel_size": 1, **parallel}
    return SimpleNamespace(
        kv_transfer_config=kv,
        parallel_config=SimpleNamespace(**par),
        device_config=SimpleNamespace(device_type="cpu"),
    )


def _kv_cache_config(*specs: Any) -> Any:
    groups = [SimpleNamespace(kv_cache_spec=s, layer_names=["l"]) for s in specs]
    return SimpleNamespace(kv_cache_groups=groups, num_blocks=8)


def test_support_check_on_vllm_spec_classes() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvrelay.connector.vllm.settings import UnsupportedConfigError, check_supported

    full = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32)
    window = SlidingWindowSpec(
        block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32, sliding_window=128
    )
    assert check_supported(_vllm_config(), _kv_cache_config(full)) is full
    with pytest.raises(UnsupportedConfigError, match="only models whose layers all use full"):
        check_supported(_vllm_config(), _kv_cache_config(full, window))
    with pytest.raises(UnsupportedConfigError, match="only models whose layers all use full"):
        check_supported(_vllm_config(), _kv_cache_config(window))
    with pytest.raises(UnsupportedConfigError, match="pipeline parallelism"):
        check_supported(_vllm_config(pipeline_parallel_size=2), _kv_cache_config(full))
    cuda_on_cpu = _vllm_config()
    cuda_on_cpu.kv_transfer_config.kv_buffer_device = "cuda"
    with pytest.raises(UnsupportedConfigError, match='needs "kv_buffer_device": "cpu"'):
        check_supported(cuda_on_cpu, _kv_cache_config(full))
