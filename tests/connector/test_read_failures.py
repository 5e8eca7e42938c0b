"""Failure paths of reads over real NIXL between engine processes (UCX over loopback).

One holder instance is one NIXL agent entry for every read from it, so one read's failure never
disturbs another; a read that failed or timed out is over before its blocks go back to the
engine; a holder whose cache bytes mean something else is refused, never copied.
"""

from __future__ import annotations

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

pytestmark = pytest.mark.nixl


def test_concurrent_first_loads_from_one_holder_both_succeed(peers: StartPeer) -> None:
    holder = peers(nixl_peer.PeerSpec("h-first", seed=21))
    reader = peers(nixl_peer.PeerSpec("r-first", seed=22))
    prompt = toks(3 * BS + 1)
    p1, p2 = hold(holder, "h1", prompt), hold(holder, "h2", prompt)
    # Both loads are planned in the same engine step: both prepare a first contact at once.
    c1 = reader.send("load", rid="r1", prompt=[*prompt, 1], params=for_p(p1))
    c2 = reader.send("load", rid="r2", prompt=[*prompt, 1], params=for_p(p2))
    out1, out2 = reader.result(c1), reader.result(c2)
    for out, params in ((out1, p1), (out2, p2)):
        assert out["loaded"] == 3 * BS and not out["invalid"] and not out["failed"]
        assert same_tp_equal(holder, params["remote_block_ids"][0][:3], reader, out["blocks"][:3])
    w = reader.stats()["workers"][0]
    assert w["failures"] == 0 and w["transfers"] == 2 and w["remote_agents_added"] == 1
    assert_idle(holder, reader)


def test_one_failed_read_leaves_other_reads_from_the_holder_alone(peers: StartPeer) -> None:
    holder = peers(nixl_peer.PeerSpec("h-iso", seed=23))
    reader = peers(nixl_peer.PeerSpec("r-iso", seed=24, config={"kv_load_failure_policy": "fail"}))
    prompt = toks(3 * BS + 1)
    warm = reader.call(
        "load", rid="r0", prompt=[*prompt, 1], params=for_p(hold(holder, "h0", prompt))
    )
    assert warm["loaded"] == 3 * BS
    good, bad = hold(holder, "h1", prompt), hold(holder, "h2", prompt)
    holder.call("polling", on=False)  # keeps the good read in flight
    c_good = reader.send("load", rid="r-good", prompt=[*prompt, 1], params=for_p(good))
    wait_until(
        lambda: reader.stats()["workers"][0]["reads_in_flight"] == 1, 20, what="read in flight"
    )
    # A read that fails at set-up (params name a TP size the holder does not have).
    out_bad = reader.call(
        "load", rid="r-bad", prompt=[*prompt, 1], params={**for_p(bad), "tp_size": 2}
    )
    assert out_bad["failed"] and out_bad["invalid"] == out_bad["blocks"][:3]
    holder.call("polling", on=True)
    out_good = reader.result(c_good)
    assert out_good["loaded"] == 3 * BS and not out_good["failed"] and not out_good["invalid"]
    assert same_tp_equal(holder, good["remote_block_ids"][0][:3], reader, out_good["blocks"][:3])
    w = reader.stats()["workers"][0]
    assert w["failures"] == 1 and w["failures_setup"] == 1 and w["remote_agents_added"] == 1
    assert_idle(holder, reader)


@pytest.mark.parametrize("deadline", ["transfer_timeout", "claim_pin"])
def test_timed_out_read_keeps_its_blocks_until_the_transfer_is_over(
    peers: StartPeer, deadline: str
) -> None:
    holder_cfg = {"claim_timeout_s": 2.0} if deadline == "claim_pin" else {}
    reader_cfg = {"transfer_timeout_s": 2.0} if deadline == "transfer_timeout" else {}
    holder = peers(nixl_peer.PeerSpec(f"h-late-{deadline}", seed=25, config=holder_cfg))
    reader = peers(nixl_peer.PeerSpec(f"r-late-{deadline}", seed=26, config=reader_cfg))
    prompt = toks(3 * BS + 1)
    params = hold(holder, "h1", prompt)
    holder.call("polling", on=False)  # the holder stops serving the READ: it cannot finish...
    cid = reader.send("load", rid="r1", prompt=[*prompt, 1], params=for_p(params))
    wait_until(lambda: reader.stats()["workers"][0]["failures"] == 1, 20, what="read given up")
    # ...so although the reader gave up, the blocks must not go back to the engine: the
    # holder's data could still land in them.
    with pytest.raises(TimeoutError):
        reader.result(cid, timeout=1.0)
    w = reader.stats()["workers"][0]
    assert w["reads_cancelling"] == 1 and w["reads_in_flight"] == 0
    holder.call("polling", on=True)  # the transfer now ends; only then is the load reported
    out = reader.result(cid)
    assert out["loaded"] == 0 and out["invalid"] == out["blocks"][:3]
    assert reader.stats()["workers"][0]["reads_cancelling"] == 0
    assert_idle(holder, reader)


def test_a_read_stuck_past_the_grace_ends_once_its_holder_is_forgotten(
    peers: StartPeer,
) -> None:
    # The holder's side channel lives but its worker stops polling NIXL (a hung engine loop):
    # the READ can never finish. Past the grace the reader forgets the holder (removes its NIXL
    # agent), which ends the transfer: the blocks come back, invalid, with the holder still up
    # and still hung (it used to take the holder's death).
    holder = peers(nixl_peer.PeerSpec("h-stuck", seed=27))
    reader = peers(
        nixl_peer.PeerSpec(
            "r-stuck", seed=28, config={"transfer_timeout_s": 1.0, "cancel_grace_s": 1.0}
        )
    )
    prompt = toks(2 * BS + 1)
    params = hold(holder, "h1", prompt)
    holder.call("polling", on=False)
    out = reader.call("load", rid="r1", prompt=[*prompt, 1], params=for_p(params))
    assert out["loaded"] == 0 and out["invalid"] == out["blocks"][:2]
    w = reader.stats()["workers"][0]
    assert w["reads_stuck"] == 1 and w["remote_agents_removed"] == 1
    assert w["quarantined_blocks"] == 0
    assert_idle(reader)


def test_same_compat_hash_but_other_cache_layout_is_refused(peers: StartPeer) -> None:
    # Both say kv_layout "vllm-cpu" (same compatibility hash) but one is NHD, one HND: the
    # bytes of a block mean different things, so copying them verbatim would be wrong KV.
    same = {"kv_layout": "vllm-cpu"}
    holder = peers(nixl_peer.PeerSpec("h-nhd", seed=29, layout="split", config=same))
    reader = peers(nixl_peer.PeerSpec("r-hnd", seed=30, layout="split_hnd", config=same))
    assert holder.info["compat_hash"] == reader.info["compat_hash"]
    prompt = toks(2 * BS + 1)
    params = hold(holder, "h1", prompt)
    out = reader.call("load", rid="r1", prompt=[*prompt, 1], params=for_p(params))
    assert out["loaded"] == 0 and out["invalid"] == out["blocks"][:2]
    w = reader.stats()["workers"][0]
    assert w["failures_incompatible"] == 1 and w["transfers"] == 0
    wait_until(lambda: holder.stats()["sched"]["held"] == 0, 20, what="holder released")
    assert_idle(holder, reader)


def test_reader_never_contacts_a_holder_outside_its_allowlist(peers: StartPeer) -> None:
    holder = peers(nixl_peer.PeerSpec("h-far", seed=31))
    reader = peers(
        nixl_peer.PeerSpec("r-fenced", seed=32, config={"allowed_holders": ["10.9.0.0/16"]})
    )
    prompt = toks(2 * BS + 1)
    params = hold(holder, "h1", prompt)
    out = reader.call("load", rid="r1", prompt=[*prompt, 1], params=for_p(params))
    assert out["loaded"] == 0 and out["invalid"] == out["blocks"][:2]
    assert reader.stats()["workers"][0]["failures_claim"] == 1
    s = holder.stats()["sched"]
    assert s.get("claims_held", 0) == 0 and s.get("handshakes_served", 0) == 0 and s["held"] == 1
    assert holder.call("release", rid="h1")  # nobody else will: the reader never got through
    assert_idle(holder, reader)


def test_a_claim_answering_other_blocks_than_the_params_named_is_refused(
    peers: StartPeer,
) -> None:
    # A lying (or confused) holder: the params name blocks a, c of its hold while it holds
    # a, b, c. The claim answers its real list; a reader that only checked "a subset of what
    # is held" would read block c into the place of b, the wrong bytes for those tokens.
    holder = peers(nixl_peer.PeerSpec("h-lie", seed=33))
    reader = peers(nixl_peer.PeerSpec("r-lie", seed=34))
    prompt = toks(3 * BS + 1)
    params = hold(holder, "h1", prompt)
    a, b, c = params["remote_block_ids"][0][:3]
    for lie in ([a, c, b], [b, a, c], [c, b, a]):
        forged = {**for_p(params), "remote_block_ids": [lie]}
        out = reader.call("load", rid=f"r-{lie}", prompt=[*prompt, 1], params=forged)
        assert out["loaded"] == 0 and out["invalid"] == out["blocks"][:3], out
        params = hold(holder, f"h-{lie}", prompt)  # the refusal released the hold it claimed
    w = reader.stats()["workers"][0]
    assert w["failures_mismatch"] == 3 and w["transfers"] == 0
    # The truth still loads, byte for byte.
    out = reader.call("load", rid="r-true", prompt=[*prompt, 1], params=for_p(params))
    assert out["loaded"] == 3 * BS
    assert same_tp_equal(holder, params["remote_block_ids"][0][:3], reader, out["blocks"][:3])
    assert_idle(holder, reader)


def test_a_load_refused_while_its_holder_is_down_releases_the_hold(peers: StartPeer) -> None:
    # The holder's READs time out (its worker stopped polling NIXL) but its side channel
    # answers: loads naming it are refused at once, and each releases the hold it named,
    # instead of leaving it to the lease.
    holder = peers(nixl_peer.PeerSpec("h-down", seed=35))
    reader = peers(nixl_peer.PeerSpec(
        "r-down", seed=36,
        config={"transfer_timeout_s": 1.0, "cancel_grace_s": 1.0, "holder_retry_s": 600.0},
    ))  # fmt: skip
    prompt = toks(2 * BS + 1)
    first = hold(holder, "h1", prompt)
    holder.call("polling", on=False)
    assert reader.call("load", rid="r1", prompt=[*prompt, 1], params=for_p(first))["loaded"] == 0
    assert reader.stats()["workers"][0]["holders_down"] == 1
    holder.call("polling", on=True)
    second = hold(holder, "h2", prompt)
    out = reader.call("load", rid="r2", prompt=[*prompt, 1], params=for_p(second))
    assert out["loaded"] == 0 and reader.stats()["workers"][0]["failures_holder_down"] == 1
    wait_until(lambda: not holder.stats()["sched"]["held"], 20, what="the refused hold released")
    assert_idle(holder, reader)


def test_a_holder_no_read_used_for_a_while_is_forgotten(peers: StartPeer) -> None:
    # Holders come and go (a new engine id per vLLM process): an idle one's NIXL agent is
    # dropped, and a later read from it handshakes again.
    holder = peers(nixl_peer.PeerSpec("h-idle", seed=37))
    reader = peers(nixl_peer.PeerSpec("r-idle", seed=38, config={"remote_idle_s": 0.5}))
    prompt = toks(2 * BS + 1)
    out = reader.call(
        "load", rid="r1", prompt=[*prompt, 1], params=for_p(hold(holder, "h1", prompt))
    )
    assert out["loaded"] == 2 * BS
    wait_until(lambda: reader.stats()["workers"][0]["remote_agents_removed"] == 1, 10,
               what="the idle holder forgotten")  # fmt: skip
    out = reader.call(
        "load", rid="r2", prompt=[*prompt, 1], params=for_p(hold(holder, "h2", prompt))
    )
    assert out["loaded"] == 2 * BS
    assert reader.stats()["workers"][0]["remote_agents_added"] == 2
    assert_idle(holder, reader)
