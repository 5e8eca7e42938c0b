"""`HeldReads`: per holder D, the share of reads of its held blocks that found them, which the
spill's planning weighs a held history by."""

from __future__ import annotations

from kvrelay.proxy.fleet.held_reads import HeldReads


def test_a_holder_counts_as_holding_until_four_reads_say_otherwise() -> None:
    reads = HeldReads()
    assert reads.share("http://d") == 1.0  # never read: its holds count as there
    for _ in range(3):
        reads.read("http://d", found=False)
    assert reads.share("http://d") == 1.0  # three reads are not evidence yet
    reads.read("http://d", found=False)
    assert reads.share("http://d") == 0.0


def test_a_holder_read_less_than_four_times_takes_every_holders_share() -> None:
    reads = HeldReads()
    for url in ("http://a", "http://b", "http://c", "http://d"):
        reads.read(url, found=url != "http://a")  # a's hold was gone, the others' there
    every = reads.share("http://e")  # never read: the pool's share
    assert 0.7 < every < 0.8
    assert reads.share("http://a") == every  # one read of its own is not evidence yet
    for _ in range(3):
        reads.read("http://e", found=True)
    assert reads.share("http://e") < 1.0  # three of its own: still the pool's
    reads.read("http://e", found=True)
    assert reads.share("http://e") == 1.0  # four of its own: its share


def test_the_share_follows_the_recent_reads() -> None:
    reads = HeldReads()
    for _ in range(4):
        reads.read("http://d", found=True)
    assert reads.share("http://d") == 1.0
    reads.read("http://d", found=False)
    after_one = reads.share("http://d")
    assert 0.7 < after_one < 0.85  # the newest read weighs most: 1 of about 4.4 decayed
    for _ in range(40):
        reads.read("http://d", found=False)
    assert reads.share("http://d") < 0.02  # the old reads have decayed away
    for _ in range(80):
        reads.read("http://d", found=True)
    assert reads.share("http://d") > 0.98  # and back, as the holder's holds last again


def test_the_holders_followed_are_bounded() -> None:
    reads = HeldReads(limit=2)
    for url in ("http://a", "http://b"):
        for _ in range(4):
            reads.read(url, found=False)
    for _ in range(4):
        reads.read("http://a", found=False)  # a is the most recently read
    reads.read("http://c", found=True)  # over the bound: b, the least recently read, goes
    assert reads.share("http://a") == 0.0
    assert reads.share("http://b") == reads.share("http://d")  # forgotten: the pool's share
