"""Cache layout description and the block regions derived from registered tensors' geometry.

A cache tensor's dimension `block_dim` indexes blocks. Dimensions before it are planes (for
example K and V kept apart), dimensions after it are the bytes of one block. So every (tensor,
plane) pair gives a "region strip": block b of that strip starts at
`base + b * block_stride` and is `region_len` bytes long. Holder and reader describe their strips
in the same order, which is what lets a reader compute remote addresses.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvrelay.connector.errors import ConnectorError, ConnectorErrorKind

if TYPE_CHECKING:
    import torch


class LayoutError(ConnectorError, ValueError):
    """The cache tensors do not fit the declared layout."""

    kind = ConnectorErrorKind.LAYOUT


@dataclass(frozen=True)
class CacheLayout:
    """How blocks sit in the engine's KV cache tensors (see module docstring)."""

    block_dim: int = 0
    head_major: bool = False
    name: str = "default"


@dataclass(frozen=True)
class Strip:
    base_addr: int
    block_stride: int
    region_len: int


@dataclass(frozen=True)
class CacheGeometry:
    """Every block strip of one worker's caches, plus what a peer must know to read them."""

    strips: tuple[Strip, ...]
    num_blocks: int
    mem_type: str
    device_id: int
    dtype: str
    head_major: bool
    layout_name: str

    @property
    def region_len(self) -> int:
        return self.strips[0].region_len

    def to_dict(self) -> dict[str, Any]:
        return {
            "strips": [[s.base_addr, s.block_stride, s.region_len] for s in self.strips],
            "num_blocks": self.num_blocks,
            "mem_type": self.mem_type,
            "device_id": self.device_id,
            "dtype": self.dtype,
            "head_major": self.head_major,
            "layout_name": self.layout_name,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CacheGeometry:
        try:
            strips = tuple(Strip(int(a), int(b), int(c)) for a, b, c in data["strips"])
            geom = cls(
                strips=strips,
                num_blocks=int(data["num_blocks"]),
                mem_type=str(data["mem_type"]),
                device_id=int(data["device_id"]),
                dtype=str(data["dtype"]),
                head_major=bool(data["head_major"]),
                layout_name=str(data["layout_name"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise LayoutError(f"malformed remote layout: {exc}") from exc
        if not strips:
            raise LayoutError("remote layout has no block strips")
        return geom


def geometry_from_tensors(caches: Mapping[str, torch.Tensor], layout: CacheLayout) -> CacheGeometry:
    """Derive block strips from tensor shapes/strides (dict order = strip order)."""
    if not caches:
        raise LayoutError("no KV cache tensors given")
    tensors = list(caches.values())
    first = tensors[0]
    if not 0 <= layout.block_dim < first.dim():
        raise LayoutError(
            f"block_dim {layout.block_dim} out of range for shape {tuple(first.shape)}"
        )
    strips: list[Strip] = []
    for name, t in caches.items():
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise LayoutError(f"cache {name!r} differs in shape/dtype/device from the first one")
        if not t.is_contiguous():
            raise LayoutError(f"cache {name!r} is not contiguous")
        elem = t.element_size()
        bd = layout.block_dim
        region_len = math.prod(t.shape[bd + 1 :]) * elem
        block_stride = t.stride(bd) * elem
        for plane in itertools.product(*(range(n) for n in t.shape[:bd])):
            offset = sum(i * t.stride(d) for d, i in enumerate(plane)) * elem
            strips.append(Strip(t.data_ptr() + offset, block_stride, region_len))
    is_cuda = first.device.type == "cuda"
    return CacheGeometry(
        strips=tuple(strips),
        num_blocks=int(first.shape[layout.block_dim]),
        mem_type="VRAM" if is_cuda else "DRAM",
        device_id=(first.device.index or 0) if is_cuda else 0,
        dtype=str(first.dtype).removeprefix("torch."),
        head_major=layout.head_major,
        layout_name=layout.name,
    )
