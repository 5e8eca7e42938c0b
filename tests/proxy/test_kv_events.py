"""The engines' KV cache events and the block index they feed: blocks named by their tokens and
cache salt, events applied in order, gaps and restarts forgetting an engine, the memory bound,
vLLM's own message bytes decoded, and a real ZMQ stream from enginesim followed by the feed."""

from __future__ import annotations

import asyncio
import json
import random
import time
import tracemalloc
from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY

from kvrelay import kv_events_wire as wire
from kvrelay.devtools import FaultProxy, free_port
from kvrelay.enginesim.kv_events import KVEventPublisher, StoredBlock, parse_events_config
from kvrelay.proxy.fleet import BlockIndex, KVEventsFeed, Pool, events_endpoint
from kvrelay.proxy.fleet.block_index import EXPECT_S
from kvrelay.proxy.fleet.kv_events import (
    HEARTBEATS_MISSED,
    MIN_HEARTBEAT_S,
    REPLAY_CHUNK,
    REPLAYS_AT_ONCE,
    EngineEvents,
    _Replay,
)

P0, P1 = "http://p0:8000", "http://p1:8000"
D0 = "http://d0:8000"
BS = 4


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def _store(
    index: BlockIndex, url: str, tokens: list[int], salt: str | None = None, first: int = 0
) -> list[int]:
    """`url` caches the whole blocks of `tokens` (hashes: distinct per engine, as when each
    engine seeds its own); returns the hashes."""
    n = len(tokens) // BS
    hashes = [hash((url, salt, tuple(tokens[: (i + 1) * BS]))) & (2**64 - 1) for i in range(n)]
    extra = [[salt] if salt and i == 0 else None for i in range(n)] if salt else None
    index.stored(
        url,
        hashes[first:],
        hashes[first - 1] if first else None,
        tokens[first * BS : n * BS],
        BS,
        extra[first:] if extra else None,
    )
    return hashes


def test_each_of_many_engines_is_named_with_the_prefix_it_holds() -> None:
    """Engines holding different lengths of one prompt's prefix (two the same length, one
    none of it, one all of it, one a later block without the first): each is named with its
    own leading blocks, whatever the others hold."""
    index = BlockIndex(1000)
    prompt = _tokens(40)  # ten blocks of 4
    held = {f"http://e{i}:8000": n for i, n in enumerate((0, 8, 8, 20, 40, 36))}
    for url, n in held.items():
        if n:
            _store(index, url, prompt[:n])
    late = _store(index, "http://late:8000", prompt[:12])
    index.removed("http://late:8000", late[:1])  # its first block evicted: no prefix left
    expected = {url: n for url, n in held.items() if n}
    assert index.cached_tokens(prompt, None) == expected


def test_a_prompts_cached_prefix_is_found_on_each_engine_that_reported_it() -> None:
    index = BlockIndex(1000)
    prompt = _tokens(40)
    _store(index, P0, prompt[:40])
    _store(index, P1, prompt[:16])
    assert index.cached_tokens([*prompt, 7, 7, 7], None) == {P0: 40, P1: 16}
    # A prompt that differs in its second block shares only the first.
    other = [*prompt[:4], 999, *prompt[5:]]
    assert index.cached_tokens(other, None) == {P0: 4, P1: 4}
    assert index.cached_tokens(_tokens(40, seed=1), None) == {}
    assert index.pairs == 14


def test_blocks_are_scoped_by_the_cache_salt_as_the_engines_hash_them() -> None:
    index = BlockIndex(1000)
    prompt = _tokens(24)
    _store(index, P0, prompt, salt="tenant-a")
    assert index.cached_tokens(prompt, "tenant-a") == {P0: 24}
    assert index.cached_tokens(prompt, "tenant-b") == {}
    assert index.cached_tokens(prompt, None) == {}


def test_a_block_added_after_the_first_chains_on_its_parent_hash() -> None:
    index = BlockIndex(1000)
    prompt = _tokens(32)
    _store(index, P0, prompt[:16])  # the first 4 blocks
    _store(index, P0, prompt, first=4)  # the rest, parent = the 4th block's hash
    assert index.cached_tokens(prompt, None) == {P0: 32}
    # A block whose parent the index never saw cannot be named: skipped, not guessed.
    fresh = BlockIndex(1000)
    _store(fresh, P0, prompt, first=4)
    assert fresh.cached_tokens(prompt, None) == {} and fresh.pairs == 0


def test_removed_blocks_cut_that_engines_prefix_only() -> None:
    index = BlockIndex(1000)
    prompt = _tokens(32)
    hashes = _store(index, P0, prompt)
    _store(index, P1, prompt)
    index.removed(P0, [hashes[3]])
    assert index.cached_tokens(prompt, None) == {P0: 12, P1: 32}
    index.removed(P0, hashes)
    index.removed(P0, hashes)  # removing twice is harmless
    assert index.cached_tokens(prompt, None) == {P1: 32}
    assert index.pairs == 8
    index.cleared(P1)
    assert index.cached_tokens(prompt, None) == {} and index.pairs == 0


def test_a_prefix_cached_before_the_index_followed_is_named_by_a_prompt_routed_there() -> None:
    index = BlockIndex(1000)
    system = _tokens(16, seed=5)  # 4 blocks the engine cached before this index followed it
    prompt = system + _tokens(12, seed=6)
    # Alone, the blocks stored after that prefix cannot be named: their parent is unknown.
    _store(index, P0, prompt, salt="s", first=4)
    assert index.cached_tokens(prompt, "s") == {} and index.adopted == 0
    # A prompt just routed to P0 names it: the event's first block lies at its block 4.
    index.expect(P0, prompt, "s")
    hashes = _store(index, P0, prompt, salt="s", first=4)
    assert index.cached_tokens(prompt, "s") == {P0: 28} and index.adopted == 1
    other = system + _tokens(8, seed=7)
    assert index.cached_tokens(other, "s") == {P0: 16}  # the shared prefix, for any prompt
    # The parent's eviction is seen (the event carried its hash); its ancestors' would not be:
    # they stay until the engine's next clear, gap or trim (over-reported, never read).
    index.removed(P0, [hashes[3]])
    assert index.cached_tokens(other, "s") == {P0: 12}
    index.cleared(P0)
    assert index.pairs == 0
    # An expectation too old, or for another engine, names nothing.
    index.expect(P1, prompt, "s", now=time.monotonic() - EXPECT_S - 1)
    index.expect(P0, prompt, "s")
    _store(index, P1, prompt, salt="s", first=4)
    assert index.cached_tokens(prompt, "s") == {}


def test_over_max_blocks_the_largest_engines_oldest_blocks_go_first() -> None:
    index = BlockIndex(10)
    old, new = _tokens(24, seed=1), _tokens(24, seed=2)
    _store(index, P0, old)  # 6 blocks
    _store(index, P1, _tokens(8, seed=3))  # 2 blocks
    _store(index, P0, new)  # 6 more: 14 > 10, P0's 4 oldest forgotten
    assert index.pairs == 10
    assert index.cached_tokens(old, None) == {}  # its first blocks are gone: nothing chains
    assert index.cached_tokens(new, None) == {P0: 24}
    assert index.blocks_of(P1) == 2


def test_memory_per_engine_block_stays_under_200_bytes() -> None:
    index = BlockIndex(10**7)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for e in range(4):
            for p in range(100):
                _store(index, f"http://p{e}:8000", _tokens(25 * BS, seed=e * 1000 + p))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert index.pairs == 10_000
    assert used / index.pairs < 200


# vLLM 0.32's own bytes for a batch (its msgspec structs, encoded with its encoder): two blocks
# with a salt on the first, one block chained on them with a 32-byte digest as its hash, a
# removal and a clear.
VLLM_BATCH = bytes.fromhex(
    "93cb41d954fc40200000948aa474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920b"
    "0cb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc0020000102030405060708090a"
    "0b0c0d0e0f101112131415161718191a1b1c1d1e1faa626c6f636b5f73697a6510a76c6f72615f6964c0a66d"
    "656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b6579739291a673616c742d61c0a96772"
    "6f75705f6964780088a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c4200000"
    "00000000000000000000000000000000000000000000000000000000000db1706172656e745f626c6f636b5f"
    "686173680ca9746f6b656e5f696473dc0010202122232425262728292a2b2c2d2e2faa626c6f636b5f73697a"
    "6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f63"
    "6b52656d6f766564ac626c6f636b5f686173686573910ba66d656469756da347505581a474797065b0416c6c"
    "426c6f636b73436c656172656400"
)


def test_vllms_own_batch_bytes_decode_and_apply() -> None:
    batch = wire.DECODER.decode(VLLM_BATCH)
    assert [type(e).__name__ for e in batch.events] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    index = BlockIndex(100)
    stream = EngineEvents(P0, index)
    # Without the last event (the clear) the three blocks chain: 48 tokens under the salt.
    partial = wire.KVEventBatch(ts=batch.ts, events=batch.events[:2])
    stream.take(list(wire.frames(b"", 0, partial)))
    assert index.cached_tokens(list(range(48)), "salt-a") == {P0: 48}
    stream.take([b"", (1).to_bytes(8, "big"), VLLM_BATCH])
    assert index.pairs == 0  # the removal, then the clear


def _batch(*events: object) -> bytes:
    return wire.ENCODER.encode(wire.KVEventBatch(ts=0.0, events=list(events)))


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> wire.BlockStored:
    return wire.BlockStored(
        block_hashes=list(hashes), parent_block_hash=parent, token_ids=tokens, block_size=BS
    )


@pytest.mark.parametrize("next_seq", [7, 2], ids=["gap", "restart"])
def test_a_break_in_the_sequence_forgets_what_the_engine_had(next_seq: int) -> None:
    index = BlockIndex(100)
    stream = EngineEvents(P0, index)
    prompt = _tokens(16)
    stream.take([b"", (2).to_bytes(8, "big"), _batch(_stored([1, 2], None, prompt[:8]))])
    stream.take([b"", (3).to_bytes(8, "big"), _batch(_stored([3, 4], 2, prompt[8:]))])
    assert index.cached_tokens(prompt, None) == {P0: 16}
    # Batches 4..6 were missed (or the engine restarted and counts again): whatever they
    # removed may still be listed, so all of it is forgotten; what follows is learnt again.
    stream.take([b"", next_seq.to_bytes(8, "big"), _batch(_stored([9], None, prompt[:4]))])
    assert index.cached_tokens(prompt, None) == {P0: 4}


def _msg(seq: int, payload: bytes) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload]


async def test_with_replay_a_gap_is_filled_from_the_engines_kept_batches() -> None:
    """With a replay endpoint, a gap asks for the missed batches: the messages after it wait,
    then the replayed ones and those are applied in order, nothing forgotten, a block chained
    on a missed one named."""
    index = BlockIndex(100)
    stream = EngineEvents(P0, index, replays=True)
    prompt = _tokens(24)
    batches = [
        _batch(_stored([1, 2], None, prompt[:8])),
        _batch(_stored([3, 4], 2, prompt[8:16])),
        _batch(_stored([5, 6], 4, prompt[16:])),
    ]
    stream.take(_msg(4, batches[0]))
    stream.take(_msg(6, batches[2]))  # batch 5 missed
    assert stream.replaying and stream.replay_from == 5
    removal = _batch(wire.BlockRemoved(block_hashes=[6]))
    stream.take(_msg(7, removal))  # kept back meanwhile
    assert index.cached_tokens(prompt, None) == {P0: 8}
    # The engine sends back what it kept from 5 on: 6 and 7 again too, applied once.
    await stream.replayed([(5, batches[1]), (6, batches[2]), (7, removal)])
    assert not stream.replaying and stream.replay_from is None
    assert index.cached_tokens(prompt, None) == {P0: 20}  # 24 stored, the last block removed


async def test_a_replay_that_falls_short_or_times_out_forgets_the_engine() -> None:
    """The engine no longer keeps the missed batch (its buffer moved on), or never answers:
    then, as without replay, what the index had of it is forgotten and learnt again after."""
    prompt = _tokens(16)
    first, second = (
        _batch(_stored([1, 2], None, prompt[:8])),
        _batch(_stored([9], None, prompt[:4])),
    )
    for answer in ([(6, _batch())], None):
        index = BlockIndex(100)
        stream = EngineEvents(P0, index, replays=True)
        stream.take(_msg(3, first))
        stream.take(_msg(7, second))  # 4, 5 and 6 missed
        assert stream.replay_from == 4
        await stream.replayed(answer)  # only 6 kept by the engine, or no answer at all
        assert index.cached_tokens(prompt, None) == {P0: 4}, answer
        stream.take(_msg(8, _batch(_stored([10], 9, prompt[4:8]))))
        assert index.cached_tokens(prompt, None) == {P0: 8}, answer


def test_a_replays_frames_read_as_vllm_sends_them() -> None:
    """vLLM 0.32's ROUTER answers `[client, b"", topic, seq, payload]` per batch and ends with
    `[client, b"", b"", -1, b""]`; the DEALER sees them without the client. Earlier vLLM sent no
    topic frame."""
    assert wire.replay_request(7) == [b"", (7).to_bytes(8, "big")]
    answer = [b"", b"kv", (5).to_bytes(8, "big"), b"payload"]
    assert list(wire.replay_answer(b"kv", 5, b"payload")) == answer
    assert wire.replayed_batch(answer) == (5, b"payload")
    end = [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert wire.replayed_batch(end) == (wire.REPLAY_END, b"")
    assert wire.replayed_batch([b"", (5).to_bytes(8, "big"), b"payload"]) == (5, b"payload")
    assert wire.replayed_batch([b"odd"]) is None


async def test_relearning_on_a_new_connection_asks_for_everything_kept() -> None:
    index = BlockIndex(100)
    stream = EngineEvents(P0, index, replays=True)
    prompt = _tokens(8)
    stream.take(_msg(0, _batch(_stored([1, 2], None, prompt))))
    stream.relearn()
    assert index.pairs == 0 and stream.replay_from == 0
    stream.take(_msg(12, _batch()))  # live, kept back
    await stream.replayed([(10, _batch(_stored([1, 2], None, prompt))), (11, _batch())])
    assert index.cached_tokens(prompt, None) == {P0: 8}
    without = EngineEvents(P1, index)
    without.relearn()
    assert without.replay_from is None and not without.replaying


def test_offloaded_and_malformed_messages_are_not_taken_for_gpu_blocks() -> None:
    index = BlockIndex(100)
    stream = EngineEvents(P0, index)
    prompt = _tokens(8)
    cpu = wire.BlockStored(
        block_hashes=[1, 2], parent_block_hash=None, token_ids=prompt, block_size=BS, medium="CPU"
    )
    stream.take([b"", (0).to_bytes(8, "big"), _batch(cpu)])
    assert index.pairs == 0
    stream.take([b"", (1).to_bytes(8, "big"), _batch(_stored([1, 2], None, prompt))])
    assert index.pairs == 2
    stream.take([b"", (2).to_bytes(8, "big"), b"\x93not msgpack"])
    assert index.pairs == 0
    stream.take([b"only two frames", b""])  # ignored, counted as malformed
    assert index.pairs == 0


def test_an_engines_endpoint_is_its_listed_one_or_its_host_at_the_port() -> None:
    endpoints = {P0: "tcp://10.0.0.9:7000"}
    assert events_endpoint(P0, endpoints, 5557) == "tcp://10.0.0.9:7000"
    assert events_endpoint(P1, endpoints, 5557) == "tcp://p1:5557"
    assert events_endpoint("http://[::1]:8000", {}, 5557) == "tcp://[::1]:5557"
    assert events_endpoint(P1, endpoints, 0) is None


def test_enginesim_reads_vllms_events_flag() -> None:
    on = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:6000", "topic": "kv"})
    assert parse_events_config(on) == ("tcp://*:6000", "kv", None, 10_000)
    replayed = {"enable_kv_cache_events": True, "replay_endpoint": "tcp://*:6001"}
    assert parse_events_config(json.dumps(replayed | {"buffer_steps": 50})) == (
        "tcp://*:5557",
        "",
        "tcp://*:6001",
        50,
    )
    assert parse_events_config(json.dumps({"enable_kv_cache_events": False})) is None
    with pytest.raises(ValueError, match="only 'zmq'"):
        parse_events_config(json.dumps({"enable_kv_cache_events": True, "publisher": "null"}))


async def until(check: Callable[[], bool], what: str, within_s: float = 5.0) -> None:
    """Poll `check` on the event loop (the feed runs on it) until true, for at most
    `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def resent_until(
    publisher: KVEventPublisher, sent: list[StoredBlock], done: Callable[[], bool]
) -> Callable[[], bool]:
    """For `until`: publish `sent` again on each poll until `done` (a subscriber misses what
    was sent before it joined, ZMQ's slow joiner)."""

    def check() -> bool:
        publisher.publish(sent)
        return done()

    return check


async def test_the_feed_follows_a_real_publisher_and_the_pool() -> None:
    """enginesim's publisher on a real ZMQ socket, the feed subscribed through the pool: what
    it stores and evicts reaches the index; the engine leaving the pool is forgotten."""
    port = free_port()
    publisher = KVEventPublisher(f"tcp://*:{port}", "", BS)
    pool = Pool("prefill", 3, 2)
    pool.add(P0)
    index = BlockIndex(1000)
    feed = KVEventsFeed((pool,), index, lambda url: f"tcp://127.0.0.1:{port}", 0.05)
    prompt = _tokens(12)
    keys = [("s", i) for i in range(3)]
    blocks = [
        StoredBlock(
            keys[i],
            keys[i - 1] if i else None,
            prompt[i * BS : (i + 1) * BS],
            "salt-1" if i == 0 else None,
        )
        for i in range(3)
    ]
    feed.start()
    try:
        # A subscriber misses what was sent before it joined (ZMQ's slow joiner), so the first
        # block is sent until it arrives; the index then learns the rest in order.
        first_arrived = resent_until(publisher, blocks[:1], lambda: index.blocks_of(P0) == 1)
        await until(first_arrived, "the first block")
        publisher.publish(blocks[1:])
        await until(lambda: index.blocks_of(P0) == 3, "the chained blocks")
        assert index.cached_tokens(prompt, "salt-1") == {P0: 12}
        publisher.publish([keys[1]])
        await until(lambda: index.cached_tokens(prompt, "salt-1") == {P0: 4}, "the eviction")
        # One step's changes in the order they happened: blocks 1 and 2 stored again, then
        # block 2 evicted, then stored once more; what the index keeps is the last word.
        publisher.publish([blocks[1], blocks[2], keys[2], blocks[2]])
        await until(lambda: index.cached_tokens(prompt, "salt-1") == {P0: 12}, "the re-store")
        publisher.publish([blocks[1], keys[1]])  # stored, then evicted in the same step
        await until(lambda: index.cached_tokens(prompt, "salt-1") == {P0: 4}, "the last eviction")
        pool.remove(P0)
        await until(lambda: index.pairs == 0, "the engine forgotten")
        assert feed.subscribed() == []
    finally:
        await feed.stop()
        publisher.close()


async def test_the_feed_follows_the_d_pool_too() -> None:
    """A D's events reach the index beside a P's (a D's cache keeps the prompts it decoded, for
    a P to pull): each engine on its own publisher, each learnt under its own URL, and a D
    leaving its pool forgotten while the P stays."""
    ports = {P0: free_port(), D0: free_port()}
    publishers = {url: KVEventPublisher(f"tcp://*:{port}", "", BS) for url, port in ports.items()}
    prefill, decode = Pool("prefill", 3, 2), Pool("decode", 3, 2)
    prefill.add(P0)
    decode.add(D0)
    index = BlockIndex(1000)
    feed = KVEventsFeed((prefill, decode), index, lambda url: f"tcp://127.0.0.1:{ports[url]}", 0.05)
    prompt = _tokens(8)
    keys = [("s", i) for i in range(2)]
    blocks = [
        StoredBlock(keys[i], keys[i - 1] if i else None, prompt[i * BS : (i + 1) * BS], None)
        for i in range(2)
    ]

    def arrived(url: str, sent: list[StoredBlock], n: int) -> Callable[[], bool]:
        return resent_until(publishers[url], sent, lambda: index.blocks_of(url) == n)

    feed.start()
    try:
        await until(arrived(P0, blocks[:1], 1), "P's block")
        await until(arrived(D0, blocks, 2), "D's blocks")
        assert index.cached_tokens(prompt, None) == {P0: 4, D0: 8}
        assert sorted(feed.subscribed()) == sorted([P0, D0])
        decode.remove(D0)
        await until(lambda: index.blocks_of(D0) == 0, "the D forgotten")
        assert index.cached_tokens(prompt, None) == {P0: 4}
    finally:
        await feed.stop()
        for publisher in publishers.values():
            publisher.close()


async def test_the_feed_says_whether_it_reached_each_engine() -> None:
    """An endpoint where nothing publishes yet (wrong, or the engine still starting): ZMQ
    retries in silence, so the feed says it is not connected, and the gauge counts it out. Once
    a publisher is there the handshake is done and said; when it goes away (an engine's
    restart), the feed says so again and forgets what the engine had cached (its evictions
    meanwhile would be missed), and then reconnects by itself."""

    def gauge() -> float:
        return REGISTRY.get_sample_value("kvrelay_kv_events_connected") or 0.0

    port = free_port()
    pool = Pool("decode", 3, 2)
    pool.add(D0)
    index = BlockIndex(1000)
    feed = KVEventsFeed((pool,), index, lambda url: f"tcp://127.0.0.1:{port}", 0.05)
    block = StoredBlock(("s", 0), None, _tokens(BS), None)
    before = gauge()
    feed.start()
    publisher: KVEventPublisher | None = None
    try:
        await until(lambda: feed.subscribed() == [D0], "the subscription")
        # Not a wait for something to happen but time for it not to: ZMQ retries a refused
        # connection every 0.1 s, so three tries have failed by now.
        await asyncio.sleep(0.3)
        assert not feed.connected(D0)
        assert gauge() == before
        publisher = KVEventPublisher(f"tcp://*:{port}", "", BS)
        await until(lambda: feed.connected(D0), "the handshake")
        assert gauge() == before + 1
        assert not feed.connected(P0)  # not followed
        await until(resent_until(publisher, [block], lambda: index.blocks_of(D0) == 1), "the block")
        publisher.close()
        publisher = None
        await until(lambda: not feed.connected(D0), "the disconnection")
        assert gauge() == before
        assert index.blocks_of(D0) == 0  # its evictions from now on would be missed
        publisher = KVEventPublisher(f"tcp://*:{port}", "", BS)
        await until(lambda: feed.connected(D0), "the reconnection")
    finally:
        await feed.stop()
        if publisher is not None:
            publisher.close()
    assert gauge() == before  # a stopped feed is connected to nothing


async def test_a_link_gone_silent_is_dropped_by_its_heartbeats_and_the_engine_forgotten() -> None:
    """The publisher stays up but its link stops carrying anything, without closing (a hung
    host, a partition: a fault relay holds every byte). No event would say so; the
    subscription's heartbeats go unanswered, the feed drops the connection and forgets the
    engine's blocks, then reconnects once the link carries bytes again."""
    port = free_port()
    publisher = KVEventPublisher(f"tcp://*:{port}", "", BS)
    relay = FaultProxy("127.0.0.1", port).start()
    pool = Pool("decode", 3, 2)
    pool.add(D0)
    index = BlockIndex(1000)
    feed = KVEventsFeed((pool,), index, lambda url: f"tcp://127.0.0.1:{relay.listen_port}", 0.05)
    block = StoredBlock(("s", 0), None, _tokens(BS), None)
    stored = resent_until(publisher, [block], lambda: index.blocks_of(D0) == 1)

    feed.start()
    try:
        await until(stored, "the block")
        assert feed.connected(D0)
        relay.set_delay(3600.0)  # every byte either way is held: the link is silent
        silent = time.monotonic()
        await until(lambda: not feed.connected(D0), "the heartbeats to give up")
        assert time.monotonic() - silent >= HEARTBEATS_MISSED * MIN_HEARTBEAT_S - 0.5
        assert index.blocks_of(D0) == 0
        relay.set_delay(0.0)  # new connections carry bytes again (the held ones stay held)
        await until(lambda: feed.connected(D0), "the reconnection", 10)
        await until(stored, "the block again")
    finally:
        await feed.stop()
        relay.stop()
        publisher.close()


def _replayed() -> float:
    return (
        REGISTRY.get_sample_value("kvrelay_kv_events_replays_total", {"result": "answered"}) or 0.0
    )


async def test_replay_teaches_a_late_feed_the_engines_cache_and_fills_a_real_gap() -> None:
    """enginesim's publisher keeps its batches for replay, as vLLM's does with
    `replay_endpoint`. A feed that subscribes after the engine cached a prompt asks for them
    on connecting and learns the prompt with nothing sent again; a batch the PUB socket then
    loses (past its high-water mark) is asked for at the gap, and the block chained on it
    is named."""
    port, replay_port = free_port(), free_port()
    publisher = KVEventPublisher(f"tcp://*:{port}", "", BS, f"tcp://*:{replay_port}")
    # More batches than the feed applies between two turns of its loop (`REPLAY_CHUNK`).
    n = 2 * REPLAY_CHUNK + 2
    prompt = _tokens(BS * (n + 2))
    keys = [("r", i) for i in range(n + 2)]
    blocks = [
        StoredBlock(keys[i], keys[i - 1] if i else None, prompt[i * BS : (i + 1) * BS], None)
        for i in range(n + 2)
    ]
    for block in blocks[:n]:  # before anyone follows, one batch each
        publisher.publish([block])
    pool = Pool("prefill", 3, 2)
    pool.add(P0)
    index = BlockIndex(1000)
    feed = KVEventsFeed(
        (pool,),
        index,
        lambda url: f"tcp://127.0.0.1:{port}",
        0.05,
        lambda url: f"tcp://127.0.0.1:{replay_port}",
    )
    answered = _replayed()
    feed.start()
    try:
        learnt = {P0: BS * n}
        await until(lambda: index.cached_tokens(prompt, None) == learnt, "the replayed blocks")
        assert _replayed() == answered + 1
        publisher.drop_next(1)
        publisher.publish(blocks[n : n + 1])  # lost on the way
        publisher.publish(blocks[n + 1 :])  # chained on the lost one
        whole = {P0: len(prompt)}
        await until(lambda: index.cached_tokens(prompt, None) == whole, "the gap filled")
        assert _replayed() == answered + 2
    finally:
        await feed.stop()
        publisher.close()


async def test_a_replays_socket_takes_a_whole_answer_while_the_feed_is_busy() -> None:
    """vLLM sends a whole replay in one loop, and its ROUTER socket drops what it cannot queue
    for a reader whose own queue is full (ZMQ's 1000 messages by default, as vLLM leaves it):
    a busy feed would find gaps, or no end mark. The feed's replay socket queues without
    limit. Here the engine's side is a ROUTER that refuses instead of dropping
    (`ROUTER_MANDATORY`) with a short queue of its own: 6000 batches of 3 kB (18 MB, more than
    the default queue and the kernel's socket buffers hold) all go out while nothing reads,
    then all arrive, in order, end mark included. With the default queue the engine's side
    stops after 2000-2400 (checked)."""
    import zmq
    import zmq.asyncio

    n, payload = 6000, b"x" * 3000
    ctx, actx = zmq.Context(), zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, 100)
    router.bind_to_random_port("tcp://127.0.0.1")
    asked = _Replay(actx, router.getsockopt_string(zmq.LAST_ENDPOINT), 0)

    def send(frames: tuple[bytes, ...], what: str) -> None:
        deadline = time.monotonic() + 5
        while True:
            try:
                router.send_multipart(frames, flags=zmq.NOBLOCK)
                return
            except zmq.Again:  # refused: its queue and the reader's are full
                if time.monotonic() > deadline:
                    raise AssertionError(f"the feed's socket stopped taking {what}") from None
                router.poll(10, zmq.POLLOUT)

    try:
        assert router.poll(5000), "no replay request came"
        client, _, first = router.recv_multipart()
        assert int.from_bytes(first, "big") == 0
        for seq in range(n):
            send((client, *wire.replay_answer(b"", seq, payload)), f"batch {seq}")
        send((client, *wire.replay_answer(b"", wire.REPLAY_END, b"")), "the end mark")
        batches = None
        deadline = time.monotonic() + 10
        while batches is None and time.monotonic() < deadline:
            batches = await asked.read()
        assert batches is not None, "the end mark was sent but never read"
        assert [seq for seq, _ in batches] == list(range(n))
    finally:
        asked.close()
        actx.destroy(linger=0)
        ctx.destroy(linger=0)


async def test_a_feed_reads_a_few_replays_at_once_and_an_unanswered_one_frees_its_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Six engines connected at once, none answering its replay request (a ROUTER that only
    counts them): the feed asks `REPLAYS_AT_ONCE` of them, the gauge says so, and the others
    wait their turn; each unanswered one times out, forgets its engine, and frees its turn, so
    every engine is asked in the end."""
    import zmq

    from kvrelay.proxy.fleet import kv_events

    monkeypatch.setattr(kv_events, "REPLAY_TIMEOUT_S", 1.0)
    ctx = zmq.Context()
    urls = [f"http://p{i}:8000" for i in range(6)]
    pubs, routers = {}, {}  # each engine's PUB socket (it publishes nothing) and its ROUTER
    for url in urls:
        pubs[url], routers[url] = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
        pubs[url].bind_to_random_port("tcp://127.0.0.1")
        routers[url].bind_to_random_port("tcp://127.0.0.1")
    asked: dict[str, int] = dict.fromkeys(urls, 0)

    def count_requests() -> int:
        for url, router in routers.items():
            while router.poll(0):
                router.recv_multipart()
                asked[url] += 1
        return sum(1 for n in asked.values() if n)

    pool = Pool("prefill", 3, 2)
    for url in urls:
        pool.add(url)
    feed = KVEventsFeed(
        (pool,),
        BlockIndex(100),
        lambda url: pubs[url].getsockopt_string(zmq.LAST_ENDPOINT),
        0.05,
        lambda url: routers[url].getsockopt_string(zmq.LAST_ENDPOINT),
    )

    def replaying() -> float:
        return REGISTRY.get_sample_value("kvrelay_kv_events_replaying") or 0.0

    timeouts = REGISTRY.get_sample_value("kvrelay_kv_events_replays_total", {"result": "timeout"})
    before = replaying()
    feed.start()
    try:
        await until(lambda: count_requests() >= REPLAYS_AT_ONCE, "the first replay requests")
        assert (
            REGISTRY.get_sample_value("kvrelay_kv_events_replays_total", {"result": "timeout"})
            == timeouts
        ), "a replay timed out before the check: the test ran too slowly to tell"
        assert count_requests() == REPLAYS_AT_ONCE
        assert replaying() == before + REPLAYS_AT_ONCE
        await until(lambda: count_requests() == len(urls), "every engine's turn", within_s=10)
        await until(lambda: replaying() == before, "the last replays to time out", within_s=5)
    finally:
        await feed.stop()
        ctx.destroy(linger=0)


def test_over_max_blocks_the_largest_engines_are_cut_to_one_level() -> None:
    """Over the bound, as if one block at a time went from whichever engine holds the most:
    the largest are cut to a common level, each losing its oldest blocks, the smaller ones
    untouched, and exactly the excess goes."""
    index = BlockIndex(30)
    sizes = {"http://a:8000": 6, "http://b:8000": 14, "http://c:8000": 9, "http://d:8000": 3}
    prompts = {url: _tokens(BS * n, seed=i) for i, (url, n) in enumerate(sizes.items())}
    for url, tokens in prompts.items():
        _store(index, url, tokens)
    # 32 > 30 only once d's blocks come: two go, both b's (14 -> 12), its oldest first.
    assert index.pairs == 30
    assert [index.blocks_of(url) for url in sizes] == [6, 12, 9, 3]
    assert index.cached_tokens(prompts["http://b:8000"], None) == {}  # its first blocks gone
    index.stored("http://e:8000", list(range(10)), None, _tokens(BS * 10, seed=9), BS)
    # 40 > 30: ten go, as one at a time from the largest would take them: b 12 -> 7 (5),
    # e 10 -> 7 (3), c 9 -> 7 (2); a (6) and d (3) untouched.
    assert index.pairs == 30
    assert [index.blocks_of(url) for url in [*sizes, "http://e:8000"]] == [6, 7, 7, 3, 7]
