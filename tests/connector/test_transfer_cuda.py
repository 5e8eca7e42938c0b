"""Real NIXL transfers between engine processes whose KV caches live in GPU memory.

The same engine peers as `test_transfer.py` (`kvrelay/devtools/nixl_peer.py`, each its own
process with its own NIXL agent and CUDA context), with their paged caches on the one CUDA
device, made as vLLM hands them to a connector and registered the way the vLLM adapter
registers them. UCX moves the bytes with its CUDA transports (`cuda_ipc` between processes on
one GPU). Each test is the GPU twin of a CPU test: the bytes a reader pulls equal the holder's,
the block hashes decide what is pulled, a read frees the holder's claim, a rejection frees it
early, a block-major cache is read one descriptor per run of blocks, and a holder killed
mid-read ends the read as each load-failure policy says.

Skipped where no CUDA device is present (CI); `scripts/gpu-check.sh` runs them on a GPU machine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvrelay.devtools import nixl_peer
from tests.connector.test_transfer import (
    StartPeer,
    assert_idle,
    holder_killed_mid_read,
    pull_matching_prefix,
    read_block_major_pull,
    read_scattered_blocks,
    read_whole_blocks,
    reject_before_admission,
    running_pair,
)


def _cuda_device_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


pytestmark = [
    pytest.mark.nixl,
    pytest.mark.gpu,
    pytest.mark.skipif(
        not _cuda_device_present(), reason="no CUDA device here (scripts/gpu-check.sh on a GPU)"
    ),
]

# Without `cuda_ipc` UCX stages device memory through host buffers over TCP, a path that needs
# the holder's own progress, as a read between nodes does; the killed-holder test uses it to
# hold a read in flight (over `cuda_ipc` the reader copies alone and a read cannot be caught).
STAGED_TLS = "tcp,self,sm,cuda_copy"


def gpu_spec(engine_id: str, **kw: object) -> nixl_peer.PeerSpec:
    return nixl_peer.PeerSpec(f"gpu-{engine_id}", device="cuda", **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def gpu_pair() -> Iterator[tuple[nixl_peer.Peer, nixl_peer.Peer]]:
    """A holder and a reader with per-layer caches in VRAM whose block pages hold K and V
    together, as vLLM 0.32's FlashAttention hands them over (one page per block and layer)."""
    with running_pair(
        gpu_spec("holder", seed=1, num_blocks=96, layout="joint"),
        gpu_spec("reader", seed=2, num_blocks=96, layout="joint"),
        120,
    ) as peers:
        yield peers


@pytest.fixture
def idle_gpu_pair(
    gpu_pair: tuple[nixl_peer.Peer, nixl_peer.Peer],
) -> Iterator[tuple[nixl_peer.Peer, nixl_peer.Peer]]:
    yield gpu_pair
    assert_idle(*gpu_pair)


def test_caches_are_registered_as_device_memory_with_the_cuda_transports(
    gpu_pair: tuple[nixl_peer.Peer, nixl_peer.Peer],
) -> None:
    for peer in gpu_pair:
        assert peer.info["mem_type"] == "VRAM"
        ucx = peer.info["ucx"]
        assert {"cuda_copy", "cuda_ipc"} <= set(ucx["UCX_TLS"].split(","))
        # Without NVLink UCX turns cuda_ipc's GET off and reads crawl through TCP staging.
        assert ucx["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"


@pytest.mark.parametrize("coalesce", [True, False], ids=["coalesced", "per-block"])
def test_byte_exact_read_of_scattered_vram_blocks(
    idle_gpu_pair: tuple[nixl_peer.Peer, nixl_peer.Peer], coalesce: bool
) -> None:
    read_scattered_blocks(*idle_gpu_pair, coalesce)


@pytest.mark.parametrize("layout", ["split", "split_hnd", "block_major"])
def test_byte_exact_read_for_other_backend_layouts(peers: StartPeer, layout: str) -> None:
    holder = peers(gpu_spec(f"holder-{layout}", layout=layout, seed=3))
    reader = peers(gpu_spec(f"reader-{layout}", layout=layout, seed=4))
    read_whole_blocks(holder, reader)


@pytest.mark.parametrize(
    ("diverge_at", "expected_blocks"),
    [(37, 2), (0, 0), (None, 4)],
    ids=["mid-block", "first-token", "no-divergence"],
)
def test_block_hashes_decide_which_vram_blocks_are_pulled(
    idle_gpu_pair: tuple[nixl_peer.Peer, nixl_peer.Peer],
    diverge_at: int | None,
    expected_blocks: int,
) -> None:
    pull_matching_prefix(*idle_gpu_pair, diverge_at, expected_blocks)


def test_rejection_before_admission_frees_the_vram_holder_early(
    idle_gpu_pair: tuple[nixl_peer.Peer, nixl_peer.Peer],
) -> None:
    reject_before_admission(*idle_gpu_pair)


def test_a_block_major_vram_cache_is_read_one_descriptor_per_run_of_blocks(
    peers: StartPeer,
) -> None:
    read_block_major_pull(peers, gpu_spec)


def test_vram_holder_killed_mid_read_applies_each_policy(peers: StartPeer) -> None:
    holder_killed_mid_read(peers, lambda name, **kw: gpu_spec(name, ucx_tls=STAGED_TLS, **kw))
