"""The vLLM adapter's vLLM-free helpers (run in the main suite: no vLLM needed).

`kvrelay.connector.vllm.requests` recovers the client's X-Request-Id from vLLM's engine request ids;
`kvrelay.connector.vllm.layout` finds the block dimension and memory order of vLLM's cache tensors
(and a block-major buffer behind per-layer views); `kvrelay.connector.vllm.settings` says which
layout to ask vLLM for.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvrelay.connector.vllm.layout import (
    BLOCK_MAJOR_NAME,
    BLOCK_MAJOR_SUFFIX,
    UnsupportedCacheError,
    physical_view,
    prepare_caches,
)
from kvrelay.connector.vllm.requests import client_request_id, request_view
from kvrelay.connector.vllm.settings import required_kvcache_layout


@pytest.mark.parametrize(
    ("engine_id", "client_id"),
    [
        (
            "chatcmpl-kvr-2b20cd1bd3cd4744a49c9e24e8a2edc9-abc5d3a4",
            "kvr-2b20cd1bd3cd4744a49c9e24e8a2edc9",
        ),
        ("cmpl-req-1-0-a7414993", "req-1"),
        ("cmpl-req-1-3-a7414993", "req-1"),
        ("b790b765887fefe9", "b790b765887fefe9"),
    ],
)
def test_client_request_id(engine_id: str, client_id: str) -> None:
    assert client_request_id(engine_id) == client_id


def test_request_view_copies_what_the_core_needs() -> None:
    req = SimpleNamespace(
        request_id="cmpl-abc-0-12345678",
        prompt_token_ids=[1, 2, 3],
        all_token_ids=[1, 2, 3, 4],
        kv_transfer_params={"do_remote_decode": True},
    )
    view = request_view(req)
    assert view.client_request_id == "abc"
    assert list(view.prompt_token_ids) == [1, 2, 3]
    assert list(view.all_token_ids) == [1, 2, 3, 4]
    assert view.kv_transfer_params == {"do_remote_decode": True}


def test_cpu_attention_layout_is_blocks_first() -> None:
    # vLLM CPU attention: [num_blocks, kv_heads, block_size, 2 * head_size] per layer.
    caches = {f"layer{i}": torch.zeros(10, 2, 32, 128) for i in range(2)}
    prepared = prepare_caches(caches, num_blocks=10, block_size=32, num_kv_heads=2, name="x")
    assert prepared.layout.block_dim == 0
    assert prepared.layout.head_major
    assert all(t.is_contiguous() for t in prepared.tensors.values())


def test_permuted_view_is_read_in_memory_order() -> None:
    # FlashAttention-style logical shape (2, blocks, block_size, heads, dim) over an HND buffer.
    physical = torch.zeros(2, 7, 4, 16, 8)  # (2, blocks, heads, block_size, dim)
    logical = physical.permute(0, 1, 3, 2, 4)
    assert not logical.is_contiguous()
    prepared = prepare_caches(
        {"l0": logical}, num_blocks=7, block_size=16, num_kv_heads=4, name="x"
    )
    view = prepared.tensors["l0"]
    assert view.data_ptr() == physical.data_ptr()
    assert tuple(view.shape) == (2, 7, 4, 16, 8)
    assert prepared.layout.block_dim == 1
    assert prepared.layout.head_major


def test_shared_layers_are_registered_once() -> None:
    shared = torch.zeros(5, 1, 32, 64)
    prepared = prepare_caches(
        {"a": shared, "b": shared}, num_blocks=5, block_size=32, num_kv_heads=1, name="x"
    )
    assert list(prepared.tensors) == ["a"]


def test_strided_cache_is_refused() -> None:
    padded = torch.zeros(6, 2, 32, 80)[..., :64]
    with pytest.raises(UnsupportedCacheError, match="not a permutation"):
        physical_view(padded)


def test_missing_block_dimension_is_refused() -> None:
    with pytest.raises(UnsupportedCacheError, match="block dimension"):
        prepare_caches({"l": torch.zeros(3, 32, 64)}, 9, 32, 1, name="x")


def _block_major(blocks: int = 6, layers: int = 3, pad: int = 0) -> torch.Tensor:
    """vLLM's BLHNC buffer: per block, every layer's [heads, tokens, K and V] page, then `pad`."""
    page = 2 * 4 * 8  # 2 heads x 4 tokens x 8 values
    flat = torch.arange(blocks * (layers * page + pad), dtype=torch.float32)
    return flat.view(blocks, layers * page + pad)


def _layer_views(buffer: torch.Tensor, layers: int = 3) -> dict[str, torch.Tensor]:
    """One strided view per layer into the block-major buffer, as vLLM hands them over."""
    page = 2 * 4 * 8
    return {
        f"l{i}": buffer[:, i * page : (i + 1) * page].unflatten(1, (2, 4, 8)) for i in range(layers)
    }


@pytest.mark.parametrize("pad", [0, 16])
def test_a_block_major_cache_is_registered_as_one_row_per_block(pad: int) -> None:
    buffer = _block_major(pad=pad)
    prepared = prepare_caches(_layer_views(buffer), 6, 4, 2, name="vllm-cuda")
    assert list(prepared.tensors) == [BLOCK_MAJOR_NAME]
    rows = prepared.tensors[BLOCK_MAJOR_NAME]
    assert rows.shape == (6, buffer.shape[1] * 4) and rows.dtype == torch.uint8
    assert rows.data_ptr() == buffer.data_ptr()
    assert torch.equal(rows[4].view(torch.float32), buffer[4])  # the same memory, whole blocks
    assert prepared.layout.block_dim == 0 and not prepared.layout.head_major
    assert prepared.layout.name == "vllm-cuda" + BLOCK_MAJOR_SUFFIX


def test_strided_views_that_do_not_tile_a_block_are_refused() -> None:
    views = _layer_views(_block_major())
    del views["l1"]  # a gap between the layers' pages: not a block-major buffer
    with pytest.raises(UnsupportedCacheError, match="not a permutation"):
        prepare_caches(views, 6, 4, 2, name="x")


def _vllm_config(device: str, extra: dict[str, object]) -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        device_config=SimpleNamespace(device_type=device),
    )


def test_the_connector_asks_for_block_major_caches_except_on_the_cpu_or_when_told_not() -> None:
    assert required_kvcache_layout(_vllm_config("cuda", {})) == "BLHNC"
    assert required_kvcache_layout(_vllm_config("cuda", {"block_major": False})) is None
    assert required_kvcache_layout(_vllm_config("cpu", {})) is None
