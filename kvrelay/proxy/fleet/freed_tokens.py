"""What this worker's turns freed on an engine since its last load reading: `FreedTokens`.

An engine's KV usage (`vllm:kv_cache_usage_perc`) is read every `load_poll_interval_s` and acted
on for up to `STALE_INTERVALS` of them (`engine_load.py`). A D that has just finished a long
turn still reads as nearly full until the next scrape, though the turn's blocks are free now
(vLLM counts a free block as free whether or not its prefix cache still keeps it). That D is
exactly where the conversation's next turn finds its history, sent as soon as the answer came:
judged busy on the old reading, the turn went to another D and computed the history again
(bench/RESULTS.md, `## trace compare (conversation)`, runs BA-BF; with this, run BG). So each
turn that ends on a D without a hold there says how many tokens it left free (`freed`), and the
router takes the tokens freed after a reading off that reading (`since`, over the engine's pool
size).

Only this worker's turns are known: other workers' and other clients' leave the reading as it
was (an over-estimate, as before). A turn's whole prompt is counted freed, though a prefix it
shared with requests still running on that D stays taken by them: where many requests share a
long prefix on one D, the usage reads lower than it is until the next reading (at most
`load_poll_interval_s`); the answer's own blocks, freed too, are not counted (run SPk in
`## trace compare (shared prefix)` saw no cost). Entries at or before a reading are dropped once
a reading that new is asked about (readings of one engine only move forward); at most
`MAX_ENTRIES` are kept should the readings stop.
"""

from __future__ import annotations

from collections import deque

MAX_ENTRIES = 4096  # a worker ends far fewer turns on one engine between two readings


class FreedTokens:
    """Tokens this worker's turns freed on one engine, by when."""

    __slots__ = ("_freed",)

    def __init__(self) -> None:
        self._freed: deque[tuple[float, int]] = deque(maxlen=MAX_ENTRIES)

    def freed(self, tokens: int, at: float) -> None:
        """A turn that ended at `at` (time.monotonic()) left `tokens` of KV free."""
        if tokens > 0:
            self._freed.append((at, tokens))

    def since(self, at: float) -> int:
        """Tokens freed after `at` (a reading's time); those before are forgotten."""
        freed = self._freed
        while freed and freed[0][0] <= at:
            freed.popleft()
        return sum(tokens for _, tokens in freed) if freed else 0
