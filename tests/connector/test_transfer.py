"""Real NIXL transfers between engine processes on CPU memory (UCX over loopback).

Each peer is a separate process (`kvrelay/devtools/nixl_peer.py`) running the connector exactly
as an engine does. After every test the holder holds nothing and every block is back in its pool.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvrelay.devtools import nixl_peer
from tests.harness import wait_until

pytestmark = pytest.mark.nixl

BS = 16
StartPeer = Callable[[nixl_peer.PeerSpec], nixl_peer.Peer]


def toks(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


def hold(
    peer: nixl_peer.Peer, rid: str, prompt: list[int], blocks: list[int] | None = None
) -> dict[str, Any]:
    """Finish a P-leg request on `peer` so that it holds its prompt blocks; return its params."""
    res = peer.call(
        "hold", rid=rid, prompt=prompt, all_tokens=[*prompt, 7], params={"do_remote_decode": True},
        blocks=blocks,
    )  # fmt: skip
    assert res["params"] is not None
    return dict(res["params"])


def for_p(params: dict[str, Any]) -> dict[str, Any]:
    """The proxy's next-turn form: P pulls the holder's blocks and holds its own afterwards."""
    return {**params, "do_remote_decode": True, "do_remote_prefill": False}


def assert_idle(*peers: nixl_peer.Peer) -> None:
    """Nothing held, nothing in flight, every block back in the pool."""
    for peer in peers:
        peer.call("free_all")

        def idle(peer: nixl_peer.Peer = peer) -> bool:
            s = peer.stats()
            return s["sched"]["held"] == 0 and s["free_blocks"] == s["total_blocks"]

        wait_until(idle, 20, what=f"{peer.spec.engine_id} to hold nothing")


def same_tp_equal(
    holder: nixl_peer.Peer, hblocks: list[int], reader: nixl_peer.Peer, rblocks: list[int]
) -> bool:
    hd = holder.call("block_data", blocks=hblocks)
    rd = reader.call("block_data", blocks=rblocks)
    return all(
        np.array_equal(h, r)
        for hr, rr in zip(hd, rd, strict=True)
        for h, r in zip(hr, rr, strict=True)
    )


@contextlib.contextmanager
def running_pair(
    holder_spec: nixl_peer.PeerSpec, reader_spec: nixl_peer.PeerSpec, timeout: float = 60.0
) -> Iterator[tuple[nixl_peer.Peer, nixl_peer.Peer]]:
    """A holder and a reader peer, both stopped afterwards (the holder too if the reader
    never starts)."""
    holder = nixl_peer.Peer.start(holder_spec, timeout)
    try:
        reader = nixl_peer.Peer.start(reader_spec, timeout)
    except BaseException:
        holder.stop()
        raise
    try:
        yield holder, reader
    finally:
        reader.stop()
        holder.stop()


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[nixl_peer.Peer, nixl_peer.Peer]]:
    """A holder and a reader (K/V split planes) shared by this module's simple tests."""
    with running_pair(
        nixl_peer.PeerSpec("holder", seed=1, num_blocks=96),
        nixl_peer.PeerSpec("reader", seed=2, num_blocks=96),
    ) as peers:
        yield peers


@pytest.fixture
def idle_pair(
    pair: tuple[nixl_peer.Peer, nixl_peer.Peer],
) -> Iterator[tuple[nixl_peer.Peer, nixl_peer.Peer]]:
    yield pair
    assert_idle(*pair)


# --- checks shared with the GPU twins of these tests (test_transfer_cuda.py) ------------------
def read_scattered_blocks(holder: nixl_peer.Peer, reader: nixl_peer.Peer, coalesce: bool) -> None:
    """Blocks held in scattered runs arrive byte-exact, in as many descriptors as coalescing
    says, and the read frees the holder's claim."""
    reader.call("coalesce", on=coalesce)
    prompt = toks(7 * BS + 5)
    scattered = [40, 41, 42, 10, 11, 60, 3, 4]  # runs of 3, 2, 1 and 2 blocks
    params = hold(holder, f"h-{coalesce}", prompt, blocks=scattered)
    before = reader.stats()["workers"][0]
    freed = holder.stats()["sched"]["freed_by_read"]
    out = reader.call("load", rid=f"r-{coalesce}", prompt=[*prompt, 1, 2, 3], params=for_p(params))
    assert out["n"] == 7 * BS and out["loaded"] == 7 * BS and not out["failed"]
    assert same_tp_equal(holder, scattered[:7], reader, out["blocks"][:7])
    # Blocks past the loaded prefix were not touched.
    assert not same_tp_equal(holder, scattered[7:], reader, out["blocks"][7:8])
    after = reader.stats()["workers"][0]
    descs = after["descs_posted"] - before["descs_posted"]
    # A strip per layer, two (K, V) where the layout keeps K and V in planes of their own.
    spec = reader.spec
    strips = spec.num_layers * (2 if spec.layout in ("split", "split_hnd") else 1)
    # Holder runs 3+2+1+1 (7 blocks) map onto one local run: 4 descriptors per strip.
    assert descs == (4 * strips if coalesce else 7 * strips)
    # Coalescing on, the read named blocks in the lists prepared once (NIXL merged the runs);
    # off, it built its descriptors.
    prepared = after["reads_prepared"] - before["reads_prepared"]
    assert prepared == (1 if coalesce else 0)
    wait_until(
        lambda: holder.stats()["sched"]["freed_by_read"] == freed + 1, 20, what="free by read"
    )


def read_whole_blocks(holder: nixl_peer.Peer, reader: nixl_peer.Peer) -> None:
    """A short hold read whole; both peers idle afterwards."""
    prompt = toks(3 * BS + 1)
    params = hold(holder, "h", prompt)
    out = reader.call("load", rid="r", prompt=prompt, params=for_p(params))
    assert out["loaded"] == 3 * BS
    assert same_tp_equal(holder, params["remote_block_ids"][0][:3], reader, out["blocks"][:3])
    assert_idle(holder, reader)


def pull_matching_prefix(
    holder: nixl_peer.Peer, reader: nixl_peer.Peer, diverge_at: int | None, expected_blocks: int
) -> None:
    """The block hashes decide: exactly the blocks before the first differing token are read,
    and the holder's hold is freed by the read (or released when nothing matched)."""
    history = toks(4 * BS + 6)  # D holds 4 full blocks + a partial one
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


def reject_before_admission(holder: nixl_peer.Peer, reader: nixl_peer.Peer) -> None:
    """A reader that rejects the request before admission frees the holder's blocks early."""
    prompt = toks(2 * BS + 3)
    params = hold(holder, "h-rej", prompt)
    before = holder.stats()["sched"]["freed_by_release"]
    reader.call("reject", rid="r-rej", prompt=prompt, params=params)  # D-leg params
    wait_until(
        lambda: holder.stats()["sched"]["freed_by_release"] == before + 1, 20, what="early release"
    )
    assert reader.stats()["sched"]["early_releases"] >= 1


def holder_killed_mid_read(peers: StartPeer, spec: Callable[..., nixl_peer.PeerSpec]) -> None:
    """Reads held in flight by a holder that stopped driving NIXL, then killed: the reader
    that recomputes loads nothing, the one that fails fails, and both blocks come back."""
    holder = peers(spec("doomed", seed=10))
    fast_fail = {"transfer_timeout_s": 3.0, "handshake_retries": 1}
    recompute = peers(spec("r-recompute", config=fast_fail))
    fail = peers(spec("r-fail", config={**fast_fail, "kv_load_failure_policy": "fail"}))
    prompt = toks(4 * BS)
    p1, p2 = hold(holder, "h1", prompt), hold(holder, "h2", prompt)
    # The holder stops driving NIXL, so the reads cannot finish: they stay in flight...
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


# --- the tests --------------------------------------------------------------------------------
@pytest.mark.parametrize("coalesce", [True, False])
def test_byte_exact_read_of_scattered_blocks(
    idle_pair: tuple[nixl_peer.Peer, nixl_peer.Peer], coalesce: bool
) -> None:
    read_scattered_blocks(*idle_pair, coalesce)


def test_byte_exact_joint_kv_layout(peers: StartPeer) -> None:
    holder = peers(nixl_peer.PeerSpec("holder-joint", layout="joint", seed=3))
    reader = peers(nixl_peer.PeerSpec("reader-joint", layout="joint", seed=4))
    read_whole_blocks(holder, reader)


@pytest.mark.parametrize(
    ("diverge_at", "expected_blocks"),
    [(37, 2), (32, 2), (0, 0), (None, 4)],
    ids=["mid-block", "block-boundary", "first-token", "no-divergence"],
)
def test_prefix_verification_pulls_exactly_the_matching_blocks(
    idle_pair: tuple[nixl_peer.Peer, nixl_peer.Peer], diverge_at: int | None, expected_blocks: int
) -> None:
    pull_matching_prefix(*idle_pair, diverge_at, expected_blocks)


def test_rejection_before_admission_frees_the_holder(
    idle_pair: tuple[nixl_peer.Peer, nixl_peer.Peer],
) -> None:
    reject_before_admission(*idle_pair)


def test_compat_hash_mismatch_is_a_clear_failure(
    idle_pair: tuple[nixl_peer.Peer, nixl_peer.Peer], peers: StartPeer
) -> None:
    holder, _ = idle_pair
    other = peers(
        nixl_peer.PeerSpec(
            "reader-other-model", config={"model": "another-model", "require_block_hashes": False}
        )
    )
    prompt = toks(2 * BS + 3)
    before = holder.stats()["sched"]["freed_by_release"]
    # The block hashes are seeded with the compat hash: nothing matches, nothing is pulled.
    params = hold(holder, "h-compat0", prompt)
    out = other.call("load", rid="r-compat0", prompt=[*prompt, 9], params=for_p(params))
    assert out["n"] == 0
    # Without hashes the handshake's compat check is what stops the read.
    params = hold(holder, "h-compat", prompt)
    del params["remote_block_hashes"]
    out = other.call("load", rid="r-compat", prompt=[*prompt, 9], params=for_p(params))
    # Policy recompute: nothing counts as loaded, the blocks are marked invalid.
    assert out["n"] == len(prompt) and out["loaded"] == 0 and not out["failed"]
    assert out["invalid"] == out["blocks"][:3]
    w = other.stats()["workers"][0]
    assert w["failures_incompatible"] == 1 and w["transfers"] == 0
    wait_until(
        lambda: holder.stats()["sched"]["freed_by_release"] == before + 2, 20, what="release"
    )
    assert_idle(other)


def _heads(data: list[list[np.ndarray]], rank: int) -> list[np.ndarray]:
    return data[rank]


def test_heterogeneous_tp_both_directions(peers: StartPeer) -> None:
    tp2_holder = peers(nixl_peer.PeerSpec("tp2-holder", tp_size=2, layout="split_hnd", seed=5))
    tp1 = peers(nixl_peer.PeerSpec("tp1", tp_size=1, layout="split_hnd", seed=6))
    tp2_reader = peers(nixl_peer.PeerSpec("tp2-reader", tp_size=2, layout="split_hnd", seed=7))
    prompt = toks(3 * BS + 2)
    # Holder TP 2 -> reader TP 1: the reader's block = both holder ranks' heads side by side.
    params = hold(tp2_holder, "h21", prompt)
    out = tp1.call("load", rid="r21", prompt=[*prompt, 1], params=for_p(params))
    assert out["loaded"] == 3 * BS
    hd = tp2_holder.call("block_data", blocks=params["remote_block_ids"][0][:3])
    rd = tp1.call("block_data", blocks=out["blocks"][:3])
    for layer in range(2):  # (2, blocks, heads, bs, dim): heads are dim 2
        joined = np.concatenate([hd[0][layer], hd[1][layer]], axis=2)
        assert np.array_equal(rd[0][layer], joined)
    s = tp2_holder.stats()
    wait_until(lambda: tp2_holder.stats()["sched"]["held"] == 0, 20, what="tp2 holder free")
    s = tp2_holder.stats()
    assert s["sched"]["freed_by_read"] == 1
    assert [w["read_reported"] for w in s["workers"]] == [1, 1]
    # Holder TP 1 -> reader TP 2: each reader rank reads its half of the heads.
    params = hold(tp1, "h12", prompt)
    out = tp2_reader.call("load", rid="r12", prompt=[*prompt, 1], params=for_p(params))
    assert out["loaded"] == 3 * BS
    hd = tp1.call("block_data", blocks=params["remote_block_ids"][0][:3])
    rd = tp2_reader.call("block_data", blocks=out["blocks"][:3])
    half = hd[0][0].shape[2] // 2
    for rank in range(2):
        for layer in range(2):
            assert np.array_equal(
                rd[rank][layer], hd[0][layer][:, :, rank * half : (rank + 1) * half]
            )
    # The TP-1 holder expected two readers (one per reader rank) before freeing.
    wait_until(lambda: tp1.stats()["sched"]["freed_by_read"] == 1, 20, what="tp1 holder free")
    assert tp1.stats()["workers"][0]["notifs_received"] == 2
    assert_idle(tp2_holder, tp1, tp2_reader)


def test_mla_reads_one_holder_rank_and_notifies_the_others(peers: StartPeer) -> None:
    holder = peers(nixl_peer.PeerSpec("mla-holder", tp_size=2, layout="mla", seed=8))
    reader = peers(nixl_peer.PeerSpec("mla-reader", tp_size=1, layout="mla", seed=9))
    prompt = toks(2 * BS + 9)
    params = hold(holder, "h-mla", prompt)
    out = reader.call("load", rid="r-mla", prompt=prompt, params=for_p(params))
    assert out["loaded"] == 2 * BS
    hd = holder.call("block_data", blocks=params["remote_block_ids"][0][:2])
    rd = reader.call("block_data", blocks=out["blocks"][:2])
    assert all(np.array_equal(h, r) for h, r in zip(hd[0], rd[0], strict=True))
    w = reader.stats()["workers"][0]
    assert w["transfers"] == 1 and w["descs_posted"] == 2  # one rank, 2 layers, 1 run
    # Rank 1 was never read but got the free-notification under the HOLDER's request id.
    wait_until(lambda: holder.stats()["sched"]["held"] == 0, 20, what="mla holder free")
    s = holder.stats()
    assert s["sched"]["freed_by_read"] == 1
    assert [w["notifs_received"] for w in s["workers"]] == [1, 1]
    assert [w["read_reported"] for w in s["workers"]] == [1, 1]
    assert_idle(holder, reader)


def test_holder_killed_mid_read_applies_each_policy(peers: StartPeer) -> None:
    holder_killed_mid_read(peers, nixl_peer.PeerSpec)


def test_restarted_holder_is_handshaken_again(
    idle_pair: tuple[nixl_peer.Peer, nixl_peer.Peer], peers: StartPeer
) -> None:
    _, reader = idle_pair
    spec = nixl_peer.PeerSpec("restartable", seed=11)
    first = peers(spec)
    prompt = toks(2 * BS + 1)
    out = reader.call("load", rid="rs1", prompt=prompt, params=for_p(hold(first, "h", prompt)))
    assert out["loaded"] == 2 * BS
    before = reader.stats()["workers"][0]
    handshakes = before["handshakes"]
    first.kill()
    second = peers(spec)  # same engine id, new process, new NIXL agent
    assert second.info["instance_id"] != first.info["instance_id"]
    params = hold(second, "h", prompt)
    out = reader.call("load", rid="rs2", prompt=prompt, params=for_p(params))
    assert out["loaded"] == 2 * BS and not out["invalid"]
    assert same_tp_equal(second, params["remote_block_ids"][0][:2], reader, out["blocks"][:2])
    after = reader.stats()["workers"][0]
    assert after["handshakes"] == handshakes + 1
    # The dead instance's agent entry went before the new instance's was loaded.
    assert after["remote_agents_removed"] == before["remote_agents_removed"] + 1
    assert after["remote_agents_added"] == before["remote_agents_added"] + 1
    assert_idle(second)


def test_bidirectional_multi_turn(idle_pair: tuple[nixl_peer.Peer, nixl_peer.Peer]) -> None:
    """P holds turn 1's prompt, D reads it and keeps its own blocks (hold_blocks), P pulls them
    for turn 2 after verifying the prefix: both directions over the same connector."""
    p_engine, d_engine = idle_pair
    prompt1 = toks(2 * BS + 3)
    p_params = hold(p_engine, "p-turn1", prompt1)
    d_params = {**p_params, "hold_blocks": True}
    out = d_engine.call("load", rid="d-turn1", prompt=prompt1, params=d_params)
    # The same request's tail block comes too (every full block matched): all but the last token.
    assert out["n"] == len(prompt1) - 1 and out["loaded"] == len(prompt1) - 1
    assert same_tp_equal(p_engine, p_params["remote_block_ids"][0][:3], d_engine, out["blocks"][:3])
    wait_until(lambda: p_engine.stats()["sched"]["held"] == 0, 20, what="P freed after D's read")
    reply = toks(12, base=5000)
    finished = d_engine.call(
        "finish", rid="d-turn1", prompt=prompt1, all_tokens=[*prompt1, *reply], params=d_params
    )
    held = finished["params"]
    assert held["remote_engine_id"] == "reader" and held["remote_num_tokens"] == len(prompt1) + 11
    assert len(held["remote_block_hashes"]) == (len(prompt1) + 11) // BS
    # Turn 2 on P: history + reply + new user tokens; P pulls D's matching whole blocks.
    prompt2 = [*prompt1, *reply, 1, 2, 3]
    out2 = p_engine.call("load", rid="p-turn2", prompt=prompt2, params=for_p(held))
    assert out2["loaded"] == 2 * BS
    assert same_tp_equal(d_engine, held["remote_block_ids"][0][:2], p_engine, out2["blocks"][:2])
    wait_until(lambda: d_engine.stats()["sched"]["held"] == 0, 20, what="D freed after P's read")


def _runs(holder_blocks: list[int], reader_blocks: list[int]) -> int:
    """Runs of blocks adjacent on both sides (what one descriptor can move)."""
    return 1 + sum(
        1
        for i in range(1, len(holder_blocks))
        if not (
            holder_blocks[i] == holder_blocks[i - 1] + 1
            and reader_blocks[i] == reader_blocks[i - 1] + 1
        )
    )


def read_block_major_pull(peers: StartPeer, spec: Callable[..., nixl_peer.PeerSpec]) -> None:
    """A 12k-token pull of an 8B-shaped cache in vLLM's block-major layout (32 layers, 750
    blocks of 16 tokens; a byte per head so it fits a test): every block holds all 32 layers,
    so the read posts one descriptor per run of blocks adjacent on both sides, where the
    per-layer layout posts 32 per run; the bytes arrive exact. `spec(name, **kw)` makes a
    peer's spec (its device)."""

    def model(name: str, seed: int, layout: str) -> nixl_peer.PeerSpec:
        return spec(
            name,
            num_blocks=800,
            num_layers=32,
            num_heads=1,
            head_dim=1,
            layout=layout,
            seed=seed,
            config={"kv_layout": "8b-shaped"},
        )

    holder = peers(model("bm-holder", 31, "block_major"))
    reader = peers(model("bm-reader", 32, "block_major"))
    # The holder's blocks in runs of 8 at shuffled places, as a block table scatters them.
    starts = list(range(0, 760, 8))
    random.Random(5).shuffle(starts)
    blocks = [b for s in starts for b in range(s, s + 8)][:751]
    prompt = toks(750 * BS + 5)
    params = hold(holder, "h-bm", prompt, blocks=blocks)
    before = reader.stats()["workers"][0]
    out = reader.call("load", rid="r-bm", prompt=[*prompt, 1], params=for_p(params))
    assert out["loaded"] == 750 * BS and not out["failed"]
    after = reader.stats()["workers"][0]
    runs = _runs(blocks[:750], out["blocks"][:750])
    assert after["descs_posted"] - before["descs_posted"] == runs <= 750
    assert same_tp_equal(holder, blocks[:750], reader, out["blocks"][:750])
    # A per-layer (K and V together) reader of the same model refuses this holder's layout.
    per_layer = peers(model("bm-per-layer", 33, "joint"))
    params = hold(holder, "h-bm2", toks(2 * BS + 3))
    out = per_layer.call("load", rid="r-bm2", prompt=[*toks(2 * BS + 3), 9], params=for_p(params))
    assert out["loaded"] == 0
    w = per_layer.stats()["workers"][0]
    assert w["failures_incompatible"] == 1 and w["transfers"] == 0
    assert_idle(holder, reader, per_layer)


def test_a_block_major_cache_is_read_one_descriptor_per_run_of_blocks(peers: StartPeer) -> None:
    read_block_major_pull(peers, nixl_peer.PeerSpec)
