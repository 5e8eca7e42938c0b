"""Real NIXL transfers between engine processes whose KV caches live in GPU memory.

The same engine peers as `test_transfer.py` (`kvrelay/devtools/nixl_peer.py`, each its own
process with its own NIXL agent and CUDA context), with their paged caches on the one CUDA
device, made as vLLM hands them to a connector and registered the way the vLLM adapter
registers them. UCX moves the bytes with its CUDA transports (`cuda_ipc` between processes on
one GPU). Each test is the GPU twin of a CPU test: the bytes a reader pulls equal the holder's,
the block hashes decide what is pulled, a read frees the holder's claim, a rejection frees it
early, and a holder killed mid-read ends the read as each load-failure policy says.

Skipped where no CUDA device is present (CI); `scripts/gpu-check.sh` runs them on a GPU machine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvrelay.devtools import nixl_peer
from tests.connector.test_transfer import (
    BS,
    StartPeer,
    assert_idle,
    for_p,
    hold,
    same_tp_equal,
    toks,
)
from tests.harness import wait_until


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
    return nixl_peer.PeerSpec(engine_id, device="cuda", **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def gpu_pair() -> Iterator[tuple[nixl_peer.Peer, nixl_peer.Peer]]:
    """A holder and a reader with FlashAttention-shaped caches in VRAM."""
    holder = nixl_peer.Peer.start(gpu_spec("gpu-holder", seed=1, num_blocks=96), timeout=120)
    try:
        reader = nixl_peer.Peer.start(gpu_spec("gpu-reader", seed=2, num_blocks=96), timeout=120)
    except BaseException:
        holder.stop()
        raise
    try:
        yield holder, reader
    finally:
        reader.stop()
        holder.stop()


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
    holder, reader = idle_gpu_pair
    reader.call("coalesce", on=coalesce)
    prompt = toks(7 * BS + 5)
    scattered = [40, 41, 42, 10, 11, 60, 3, 4]  # runs of 3, 2, 1 and 2 blocks
    params = hold(holder, f"h-{coalesce}", prompt, blocks=scattered)
    freed = holder.stats()["sched"]["freed_by_read"]
    out = reader.call("load", rid=f"r-{coalesce}", prompt=[*prompt, 1, 2, 3], params=for_p(params))
    assert out["n"] == 7 * BS and out["loaded"] == 7 * BS and not out["failed"]
    assert same_tp_equal(holder, scattered[:7], reader, out["blocks"][:7])
    # The block past the loaded prefix was not written.
    assert not same_tp_equal(holder, scattered[7:], reader, out["blocks"][7:8])
    # The read released the holder's claim: its blocks went back to its pool.
    wait_until(
        lambda: holder.stats()["sched"]["freed_by_read"] == freed + 1, 20, what="free by read"
    )


@pytest.mark.parametrize("layout", ["split_hnd", "joint"])
def test_byte_exact_read_for_other_backend_layouts(peers: StartPeer, layout: str) -> None:
    holder = peers(gpu_spec(f"gpu-holder-{layout}", layout=layout, seed=3))
    reader = peers(gpu_spec(f"gpu-reader-{layout}", layout=layout, seed=4))
    prompt = toks(3 * BS + 1)
    params = hold(holder, "h", prompt)
    out = reader.call("load", rid="r", prompt=prompt, params=for_p(params))
    assert out["loaded"] == 3 * BS
    assert same_tp_equal(holder, params["remote_block_ids"][0][:3], reader, out["blocks"][:3])
    assert_idle(holder, reader)


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
    holder, reader = idle_gpu_pair
    history = toks(4 * BS + 6)
    params = hold(holder, f"hv-{diverge_at}", history)
    prompt = [*history, 5, 6, 7]
    if diverge_at is not None:
        prompt[diverge_at] = 1
    freed_before = holder.stats()["sched"]
    blocks_before = reader.stats()["workers"][0]["blocks_read"]
    out = reader.call("load", rid=f"rv-{diverge_at}", prompt=prompt, params=for_p(params))
    assert out["n"] == expected_blocks * BS and out["loaded"] == expected_blocks * BS
    assert reader.stats()["workers"][0]["blocks_read"] - blocks_before == expected_blocks
    if expected_blocks:
        hb = params["remote_block_ids"][0][:expected_blocks]
        assert same_tp_equal(holder, hb, reader, out["blocks"][:expected_blocks])
        key, before = "freed_by_read", freed_before["freed_by_read"]
    else:
        key, before = "freed_by_release", freed_before["freed_by_release"]  # released, not read
    wait_until(lambda: holder.stats()["sched"][key] == before + 1, 20, what=key)


def test_rejection_before_admission_frees_the_vram_holder_early(
    idle_gpu_pair: tuple[nixl_peer.Peer, nixl_peer.Peer],
) -> None:
    holder, reader = idle_gpu_pair
    prompt = toks(2 * BS + 3)
    params = hold(holder, "h-rej", prompt)
    before = holder.stats()["sched"]["freed_by_release"]
    reader.call("reject", rid="r-rej", prompt=prompt, params=params)
    wait_until(
        lambda: holder.stats()["sched"]["freed_by_release"] == before + 1, 20, what="early release"
    )
    assert reader.stats()["sched"]["early_releases"] >= 1


def test_vram_holder_killed_mid_read_applies_each_policy(peers: StartPeer) -> None:
    holder = peers(gpu_spec("gpu-doomed", seed=10, ucx_tls=STAGED_TLS))
    fast_fail = {"transfer_timeout_s": 3.0, "handshake_retries": 1}
    recompute = peers(gpu_spec("gpu-r-recompute", config=fast_fail, ucx_tls=STAGED_TLS))
    fail = peers(
        gpu_spec(
            "gpu-r-fail",
            config={**fast_fail, "kv_load_failure_policy": "fail"},
            ucx_tls=STAGED_TLS,
        )
    )
    prompt = toks(4 * BS)
    p1, p2 = hold(holder, "h1", prompt), hold(holder, "h2", prompt)
    # The holder stops driving NIXL, so the staged reads cannot finish: they stay in flight...
    holder.call("polling", on=False)
    c1 = recompute.send("load", rid="a", prompt=[*prompt, 1], params=for_p(p1))
    c2 = fail.send("load", rid="b", prompt=[*prompt, 1], params=for_p(p2))
    for reader in (recompute, fail):
        wait_until(
            lambda r=reader: r.stats()["workers"][0]["reads_in_flight"] == 1,
            20,
            what="read in flight",
        )
    holder.kill()  # ...until the holder dies under them.
    out1, out2 = recompute.result(c1, timeout=30), fail.result(c2, timeout=30)
    assert out1["loaded"] == 0 and not out1["failed"] and out1["invalid"] == out1["blocks"][:4]
    assert out2["failed"] and out2["invalid"] == out2["blocks"][:4]
    for reader in (recompute, fail):
        w = reader.stats()["workers"][0]
        assert w["failures"] == 1
        assert w.get("failures_transfer", 0) + w.get("failures_timeout", 0) == 1
    assert_idle(recompute, fail)
