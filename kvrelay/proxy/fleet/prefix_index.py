"""Which engine's prefix cache is expected to hold which prompt prefix: `PrefixIndex`.

vLLM keeps every finished request's blocks in its prefix cache until memory pressure evicts
them, so the engine that last computed a prompt serves a later prompt sharing its prefix (a
system prompt, tool schemas, a document, a conversation's history) from cache, and any other
engine recomputes it. Choosing the P whose cache holds the longest prefix, weighed against its
queued work (`kvrelay.proxy.fleet.Router.pick_prefill`), is what keeps requests that share a
prefix from being scattered over the P pool.

The index is *approximate* (as the routers that cannot read the engines' own KV events keep
one): it is fed by this worker's own routing, each prompt recorded on the P it is sent to, as it
is sent (a request sharing the prefix that comes while P computes it queues behind it there and
reuses its blocks; what P then reports it reused corrects nothing: having computed the prompt,
P caches it again). An engine's prefixes are taken to be evicted `ttl_s` after they were last
recorded (its cache turns over), and the whole index keeps at most `max_entries` prefixes,
least recently recorded forgotten first: an entry is a prefix key and a small map from engine
URL to expiry, about 420 bytes with its key, so the default 200,000 entries bound a worker's
index near 85 MB.

Prefixes (`PromptPrefixes`) are named within the request's cache scope (its `cache_salt`:
the engines cache per tenant, `kvrelay.proxy.tenants.cache_scope`): a prefix one tenant sent
never routes another's request, so routing shows no tenant what another sent. A chat prompt's
prefixes are its message histories (the chained message fingerprints the proxy computes
anyway, `kvrelay.proxy.turn.conversation`) and, within its last message, that message's
leading runs of `TEXT_CHUNK_CHARS` characters after the history before it (a document or
context that requests share at the start of their new message, with a question after it); a
text prompt's are its leading runs of `TEXT_CHUNK_CHARS` characters. Sizes are in characters,
as the router's other estimates.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

TEXT_CHUNK_CHARS = 512  # a text prompt's prefixes: every 512 characters (about 128 tokens)
DEFAULT_MAX_ENTRIES = 200_000


class PromptPrefixes(NamedTuple):
    """A prompt's prefixes, shortest first: `keys[i]` names the prefix of `chars[i]`
    characters (within the request's cache scope); `total` is the whole prompt's size.
    `tokens` and `salt`: the prompt's token ids as an engine tokenized it and its
    `cache_salt`, when the engines' KV events are followed (`kvrelay.proxy.fleet.block_index`
    looks them up)."""

    keys: tuple[str, ...]
    chars: tuple[int, ...]
    total: int
    tokens: tuple[int, ...] | None = None
    salt: str | None = None

    def with_tokens(self, tokens: Sequence[int], salt: str | None) -> PromptPrefixes:
        return self._replace(tokens=tuple(tokens), salt=salt)

    @classmethod
    def of_chat(
        cls, scope: str, chain: Sequence[str], messages: Sequence[object]
    ) -> PromptPrefixes | None:
        """A chat prompt's prefixes: `chain[i]` fingerprints `messages[:i]` (`chain[0]` the
        empty history, not a prefix), and before the whole prompt the runs of its last
        message's text content (`_runs`). None when there are no messages."""
        if len(chain) < 2:
            return None
        keys, chars, total = [], [], 0
        last = len(chain) - 2  # the index of the last message a fingerprint covers
        for i, (fingerprint, message) in enumerate(zip(chain[1:], messages, strict=False)):
            content = message.get("content") if isinstance(message, dict) else None
            if i == last and isinstance(message, dict) and isinstance(content, str):
                # After the history's fingerprint, what renders before the text: role, name.
                head = f"kvrelay-chat-run-v1\n{chain[i]}\n{message.get('role')}\n"
                head += str(message.get("name", ""))
                for key, end in _runs(head.encode("utf-8", "surrogatepass"), content):
                    keys.append(scope + "\x00" + key)
                    chars.append(total + end)
            total += len(str(content)) if content else 0
            keys.append(scope + "\x00" + fingerprint)
            chars.append(total)
        return cls(tuple(keys), tuple(chars), total)

    @classmethod
    def of_text(cls, scope: str, model: str, text: str) -> PromptPrefixes | None:
        """A text prompt's prefixes: its leading whole runs of `TEXT_CHUNK_CHARS` characters,
        each named by a digest chained over the runs before it (one pass over the text)."""
        if len(text) < TEXT_CHUNK_CHARS:
            return None
        seed = b"kvrelay-text-prefix-v1\n" + model.encode("utf-8", "surrogatepass")
        runs = list(_runs(seed, text, whole=True))
        keys = tuple(scope + "\x00" + key for key, _ in runs)
        return cls(keys, tuple(end for _, end in runs), len(text))


def _runs(seed: bytes, text: str, whole: bool = False) -> Iterator[tuple[str, int]]:
    """`text`'s leading runs of `TEXT_CHUNK_CHARS` characters, each named by a digest chained
    from `seed` over the runs before it, with the characters it ends at; the text itself only
    when `whole` (a chat message's whole text has the message's own key)."""
    digest = hashlib.sha256(seed).digest()
    stop = len(text) + 1 if whole else len(text)
    for end in range(TEXT_CHUNK_CHARS, stop, TEXT_CHUNK_CHARS):
        run = text[end - TEXT_CHUNK_CHARS : end].encode("utf-8", "surrogatepass")
        digest = hashlib.sha256(digest + run).digest()
        yield digest[:16].hex(), end


class PrefixIndex:
    """The engines whose prefix caches are expected to hold each prefix (module docstring)."""

    def __init__(
        self,
        ttl_s: float,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._clock = clock
        # prefix key -> {engine url: when its copy is taken to be evicted}, least recent first
        self._entries: OrderedDict[str, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, url: str, prefixes: PromptPrefixes) -> None:
        """The engine at `url` has just computed (or read) the prompt: it caches every prefix."""
        entries, expires = self._entries, self._clock() + self._ttl_s
        for key in prefixes.keys:
            engines = entries.get(key)
            if engines is None:
                entries[key] = {url: expires}
            else:
                engines[url] = expires
                entries.move_to_end(key)
        while len(entries) > self._max_entries:
            entries.popitem(last=False)

    def cached_chars(self, prefixes: PromptPrefixes) -> dict[str, int]:
        """For each engine expected to cache some prefix of the prompt, the longest one's size
        in characters (engines caching none are absent)."""
        entries, now = self._entries, self._clock()
        best: dict[str, int] = {}
        for key, chars in zip(reversed(prefixes.keys), reversed(prefixes.chars), strict=True):
            engines = entries.get(key)
            if engines is None:
                continue
            for url, expires in engines.items():
                if expires > now and url not in best:
                    best[url] = chars
        return best
