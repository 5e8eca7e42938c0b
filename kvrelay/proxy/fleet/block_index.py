"""Which engine caches which token blocks, as the engines themselves say: `BlockIndex`.

vLLM started with `--kv-events-config` publishes a `BlockStored` event for every block it
caches (the block's tokens, its hash, its parent's hash, the extra keys its hash covered: the
request's `cache_salt` on the first block) and a `BlockRemoved` for every block it evicts
(`kvrelay.proxy.fleet.kv_events` subscribes). This index keeps, for each engine, the blocks it
reported and not yet removed, so a prompt's cached prefix on each engine is known exactly, where
`PrefixIndex` only expects it from the proxy's own routing.

The engines' hashes cannot be recomputed here (vLLM seeds them per process unless every engine
shares `PYTHONHASHSEED`), so each block is named by a key of this index's own, chained over the
blocks before it as vLLM chains its hashes: `key = hash((parent key, tokens, extra keys))`.
An event's parent is found by the engine's hash of it, so each engine's hashes map to the keys
they were given (`BlockRemoved` names only hashes). A prompt is looked up by its token ids
(the engine's own `/tokenize`, so the chat template is the engine's) and its `cache_salt`,
chained the same way. Python's tuple hash is 64 bits: two different blocks share a key about
once in 10^12 lookups at a million blocks, and a shared key only misleads routing (each engine
still verifies its own cache, no KV is ever taken from this index).

A block whose parent the index never saw (the engine cached the prefix before this worker
subscribed, or in a gap) cannot be named from the event alone. A prompt the worker just routed
to that engine can name it (`expect`): when the event's first block lies in that prompt at a
block boundary, the prefix before it is adopted, keyed from the prompt's tokens. The adopted
blocks before the parent have no engine hash here, so their eviction is not seen: they may be
over-reported until the engine's next clear, gap or trim (a wrong guess costs routing, or a pin
that computes; the connector verifies every read). Expected prompts are kept `EXPECT_S` and at
most `EXPECT_MAX` per engine, 8 bytes a token (64 engines x 32 prompts of 8k tokens: 128 MB).

Memory: each (engine, block) costs an entry in that engine's map and a bit in the block's
holder mask, about 200 bytes (tests/proxy/test_kv_events.py bounds it; bench/block_index_memory.py
measures a fleet of 64 engines caching 100,000 distinct blocks each). `max_blocks` bounds the
pairs kept: over it, the oldest reported blocks of the engines holding the most are forgotten,
down to `TRIM_SLACK` under it.
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

# An engine's hash of a block as its events carry it: vLLM's bytes digest or its 64-bit int.
EngineHash = bytes | int
# How long a prompt routed to an engine may name a prefix its events leave unnamed, and how
# many such prompts are kept per engine.
EXPECT_S = 10.0
EXPECT_MAX = 32
# Over its bound, the index is trimmed to this share of the bound under it (1/64).
TRIM_SLACK = 64
# Adopted blocks have no engine hash here: each is kept under a made-up one, past any 64-bit
# hash an event can carry.
_ADOPTED = 1 << 65
_U64 = (1 << 64) - 1


def _hash_key(engine_hash: EngineHash) -> int:
    """An engine's block hash as a small int (the digest's last 8 bytes, as vLLM's int form)."""
    if isinstance(engine_hash, int):
        return engine_hash
    return int.from_bytes(engine_hash[-8:], "big")


def _chained(parent: int, block: Sequence[int], extra: tuple[Any, ...] | None) -> int:
    """A block's key: its parent's key, its tokens and its extra keys, hashed together."""
    return hash((parent, tuple(block), extra))


def _record_held(
    found: dict[str, int], engines: list[str], bits: dict[str, int], mask: int, tokens: int
) -> None:
    """Record `tokens` for each of `engines` whose bit is in `mask` (none for 0 tokens)."""
    if mask and tokens:
        for url in engines:
            if mask >> bits[url] & 1:
                found[url] = tokens


def block_keys(
    tokens: Sequence[int], block_size: int, salt: str | None, parent: int = 0
) -> list[int]:
    """The keys of the whole blocks of `tokens` (this index's names; `salt`: the request's
    `cache_salt`, which vLLM hashes into the first block only)."""
    keys: list[int] = []
    extra: tuple[Any, ...] | None = (salt,) if salt and parent == 0 else None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = _chained(parent, tokens[start : start + block_size], extra)
        keys.append(parent)
        extra = None
    return keys


class BlockIndex:
    """The token blocks each engine reported cached and not removed (module docstring)."""

    def __init__(self, max_blocks: int) -> None:
        self._max_blocks = max_blocks
        self._bits: dict[str, int] = {}  # engine URL -> its bit in a holder mask
        self._free_bits: list[int] = []
        self._by_engine: dict[str, dict[int, int]] = {}  # URL -> {engine hash: key}, oldest first
        self._holders: dict[int, int] = {}  # key -> mask of the engines holding it
        self._block_sizes: dict[str, int] = {}  # URL -> its block size
        # URL -> prompts just routed there: (when, token ids as int64 bytes, cache_salt),
        # oldest first (bytes: a block is found in a prompt by one search in C).
        self._expected: dict[str, deque[tuple[float, bytes, str | None]]] = {}
        self._pairs = 0
        self.adopted = 0  # prefixes named from an expected prompt (`expect`)

    @property
    def pairs(self) -> int:
        """(engine, block) entries kept: what `max_blocks` bounds."""
        return self._pairs

    def engines(self) -> list[str]:
        return list(self._by_engine)

    def blocks_of(self, url: str) -> int:
        return len(self._by_engine.get(url, ()))

    def _bit(self, url: str) -> int:
        bit = self._bits.get(url)
        if bit is None:
            bit = self._free_bits.pop() if self._free_bits else len(self._bits)
            self._bits[url] = bit
            self._by_engine[url] = {}
        return bit

    def stored(
        self,
        url: str,
        engine_hashes: Sequence[EngineHash],
        parent: EngineHash | None,
        tokens: Sequence[int],
        block_size: int,
        extra_keys: Sequence[Sequence[Any] | None] | None = None,
    ) -> int:
        """The engine at `url` caches these blocks (one `BlockStored`); the number recorded.
        A block whose parent this index does not know (stored before it subscribed, or lost
        in a gap) cannot be named and is skipped, with every block after it."""
        mask = 1 << self._bit(url)
        mine = self._by_engine[url]
        self._block_sizes[url] = block_size
        if parent is None:
            key = 0
        else:
            known = mine.get(_hash_key(parent))
            if known is None:
                known = self._adopt(url, parent, tokens[:block_size], block_size)
                if known is None:
                    return 0
            key = known
        recorded = 0
        for i, engine_hash in enumerate(engine_hashes):
            block = tokens[i * block_size : (i + 1) * block_size]
            if len(block) < block_size:
                break
            extra = extra_keys[i] if extra_keys and i < len(extra_keys) else None
            key = _chained(key, block, _extra(extra))
            hk = _hash_key(engine_hash)
            old = mine.pop(hk, None)
            if old is None:
                self._pairs += 1
            elif old != key:
                self._drop(old, mask)
            mine[hk] = key  # re-stored: now the newest
            self._holders[key] = self._holders.get(key, 0) | mask
            recorded += 1
        if self._pairs > self._max_blocks:
            self._trim()
        return recorded

    def expect(
        self, url: str, tokens: Sequence[int], salt: str | None, now: float | None = None
    ) -> None:
        """A prompt (its token ids and `cache_salt`) was just routed to the engine at `url`:
        the blocks it stores after a prefix it cached before this index followed it name that
        prefix through this prompt (module docstring)."""
        queue = self._expected.get(url)
        if queue is None:
            queue = self._expected[url] = deque(maxlen=EXPECT_MAX)
        raw = array("q", tokens).tobytes()
        queue.append((time.monotonic() if now is None else now, raw, salt))

    def _adopt(
        self, url: str, parent: EngineHash, first: Sequence[int], block_size: int
    ) -> int | None:
        """The key of `parent` (a hash the engine at `url` never reported) named through a
        prompt routed there whose block after it holds `first`; that prompt's blocks up to the
        parent are recorded as cached there. None when no expected prompt names it."""
        queue = self._expected.get(url)
        if not queue or len(first) < block_size:
            return None
        now = time.monotonic()
        while queue and now - queue[0][0] > EXPECT_S:
            queue.popleft()
        wanted = array("q", first).tobytes()
        stride = 8 * block_size  # a block's bytes
        for _, raw, salt in reversed(queue):
            at = raw.find(wanted, stride)
            while at > 0 and at % stride:  # only at a block boundary, past the first block
                at = raw.find(wanted, at + 1)
            if at <= 0:
                continue
            tokens = array("q")
            tokens.frombytes(raw[:at])
            keys = block_keys(tokens, block_size, salt)
            mine, mask = self._by_engine[url], 1 << self._bits[url]
            named = [(_ADOPTED + (k & _U64), k) for k in keys[:-1]]
            named.append((_hash_key(parent), keys[-1]))
            for hk, key in named:
                if mine.pop(hk, None) is None:
                    self._pairs += 1
                mine[hk] = key
                self._holders[key] = self._holders.get(key, 0) | mask
            self.adopted += 1
            return keys[-1]
        return None

    def removed(self, url: str, engine_hashes: Iterable[EngineHash]) -> None:
        """The engine at `url` evicted these blocks (one `BlockRemoved`)."""
        mine = self._by_engine.get(url)
        if mine is None:
            return
        mask = 1 << self._bits[url]
        for engine_hash in engine_hashes:
            key = mine.pop(_hash_key(engine_hash), None)
            if key is not None:
                self._pairs -= 1
                self._drop(key, mask)

    def cleared(self, url: str) -> None:
        """Forget every block of the engine at `url` (`AllBlocksCleared`, a gap in its events,
        its restart, or its leaving the fleet)."""
        mine = self._by_engine.pop(url, None)
        bit = self._bits.pop(url, None)
        self._block_sizes.pop(url, None)
        if mine is None or bit is None:
            return
        mask = 1 << bit
        for key in mine.values():
            self._drop(key, mask)
        self._pairs -= len(mine)
        self._free_bits.append(bit)

    def cached_tokens(self, tokens: Sequence[int], salt: str | None) -> dict[str, int]:
        """For each engine caching a prefix of the prompt (`tokens`, its `cache_salt`), that
        prefix's length in tokens (engines caching none are absent)."""
        found: dict[str, int] = {}
        holders, bits = self._holders, self._bits
        for size in set(self._block_sizes.values()):
            engines = [url for url, s in self._block_sizes.items() if s == size]
            alive = 0
            for url in engines:
                alive |= 1 << bits[url]
            # The engines are named only where the set still holding every block so far
            # shrinks, and at the end: one pass over the blocks, not one per engine and block.
            held = 0  # whole blocks every engine in `alive` holds
            for key in block_keys(tokens, size, salt):
                still = alive & holders.get(key, 0)
                if still != alive:
                    _record_held(found, engines, bits, alive & ~still, held * size)
                    alive = still
                    if not alive:
                        break
                held += 1
            _record_held(found, engines, bits, alive, held * size)
        return found

    def _drop(self, key: int, mask: int) -> None:
        left = self._holders.get(key, 0) & ~mask
        if left:
            self._holders[key] = left
        else:
            self._holders.pop(key, None)

    def _trim(self) -> None:
        """Over `max_blocks`: forget the oldest reported blocks of whichever engine holds the
        most (an engine's cache turns over oldest first, and no engine crowds the others out).
        As if one block at a time went from the largest: the largest engines are cut to one
        level, found in one pass over their sizes (a pass over every engine for each block
        forgotten cost seconds when a replay filled the index: bench/kv_events_replay.py),
        down to `TRIM_SLACK` under the bound, so that a full index trims once in so many
        blocks stored rather than at every event."""
        excess = self._pairs - self._max_blocks + self._max_blocks // TRIM_SLACK
        if excess <= 0:
            return
        sizes = sorted((len(mine) for mine in self._by_engine.values()), reverse=True)
        # The highest level that cutting the `k` largest engines down to frees the excess.
        total, k, level = 0, 0, 0
        for k, size in enumerate(sizes, 1):
            total += size
            level = (total - excess) // k
            if level >= (sizes[k] if k < len(sizes) else 0):
                break
        spare = total - k * level - excess  # freed past the excess: these keep one more
        for url, mine in self._by_engine.items():
            cut = len(mine) - level
            if cut <= 0:
                continue
            if spare > 0:
                cut, spare = cut - 1, spare - 1
            mask = 1 << self._bits[url]
            for engine_hash in list(itertools.islice(mine, cut)):  # the oldest reported
                self._drop(mine.pop(engine_hash), mask)
            self._pairs -= cut


def _extra(extra: Sequence[Any] | None) -> tuple[Any, ...] | None:
    """An event's extra keys for a block as a prompt's lookup can rebuild them: a text-only
    block's are at most its `cache_salt`; anything else (a LoRA name, images) is kept whole,
    so such blocks never match a text prompt's lookup."""
    return tuple(extra) if extra else None
