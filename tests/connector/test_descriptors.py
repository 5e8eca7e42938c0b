"""Descriptor building: coalescing changes how many descriptors, never which bytes go where."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.connector.layout import CacheGeometry, CacheLayout, Strip, geometry_from_tensors
from kvrelay.connector.tp import ReadPiece
from kvrelay.connector.transport import block_runs, build_descs


def _byte_map(local: np.ndarray, remote: np.ndarray, unit: int) -> set[tuple[int, int]]:
    """(local address, remote address) of every `unit`-sized chunk the descriptors move."""
    pairs: set[tuple[int, int]] = set()
    for (la, ln, _), (ra, rn, _) in zip(local.tolist(), remote.tolist(), strict=True):
        assert ln == rn and ln % unit == 0
        pairs.update((la + off, ra + off) for off in range(0, ln, unit))
    return pairs


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 40)),
        min_size=1,
        max_size=30,
        unique_by=(lambda t: t[0], lambda t: t[1]),
    )
)
def test_coalescing_moves_exactly_the_same_bytes(ids: list[tuple[int, int]]) -> None:
    local_ids = [a for a, _ in ids]
    remote_ids = [b for _, b in ids]
    region = 64
    strips_l = (Strip(1_000_000, region, region), Strip(2_000_000, region, region))
    strips_r = (Strip(5_000_000, region, region), Strip(6_000_000, region, region))
    geom_l = CacheGeometry(strips_l, 41, "DRAM", 0, "float32", False, "t")
    geom_r = CacheGeometry(strips_r, 41, "DRAM", 0, "float32", False, "t")
    piece = ReadPiece(0, 0, 0, region)
    on = build_descs(geom_l, geom_r, local_ids, remote_ids, piece, True)
    off = build_descs(geom_l, geom_r, local_ids, remote_ids, piece, False)
    assert len(off[0]) == 2 * len(ids)
    assert len(on[0]) == 2 * len(block_runs(local_ids, remote_ids, True)) <= len(off[0])
    assert _byte_map(*on, region) == _byte_map(*off, region)


def test_sliced_pieces_never_merge_and_kv_planes_are_separate_strips() -> None:
    caches = {"l0": torch.zeros(2, 8, 4, 3, 2), "l1": torch.zeros(2, 8, 4, 3, 2)}
    geom = geometry_from_tensors(caches, CacheLayout(block_dim=1, head_major=True))
    assert len(geom.strips) == 4 and geom.num_blocks == 8  # (layer, K|V)
    assert geom.region_len == 4 * 3 * 2 * 4
    k, v = geom.strips[0], geom.strips[1]
    assert v.base_addr - k.base_addr == 8 * geom.region_len
    half = ReadPiece(0, 0, geom.region_len // 2, geom.region_len // 2)
    local, _ = build_descs(geom, geom, [0, 1, 2], [3, 4, 5], half, True)
    assert len(local) == 3 * 4  # three blocks x four strips: no merging of half regions
