"""Realized reuse: what an engine did with one leg's prompt tokens, as the engine said it.

A map entry, a routing decision or the params the proxy sent are promises; only the engine
knows how many prompt tokens it found in its own prefix cache, read from a holder, or computed
(docs/ACCOUNTING.md). `PromptAccount` is that split for one leg, read from the engine's answer
and nothing else: the connector's report (`kvr_*` in the params it returns), else vLLM's own
per-request figures (`remote_prefill_cached_tokens` on P's params, `usage.prompt_tokens_details`
where the answer is the engine's own). A figure an engine did not give stays None ("unknown"):
it is never guessed from the map.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvrelay.connector.protocol import (
    REFUSED_FAILED,
    REFUSED_HASH,
    REFUSED_LOCAL,
    REFUSED_PARTIAL,
    REFUSED_THRESHOLD,
    REFUSED_UNVERIFIED,
    KVTransferParams,
)

# Headers of a JSON answer that carry the turn's account (the proxy README, "Accounting").
HEADER_PROMPT = "X-Kvrelay-Prompt-Tokens"
HEADER_REUSED = "X-Kvrelay-Reused-Tokens"
HEADER_LOCAL_HIT = "X-Kvrelay-Local-Hit-Tokens"
HEADER_LOADED = "X-Kvrelay-Loaded-Tokens"
HEADER_COMPUTED = "X-Kvrelay-Computed-Tokens"
HEADER_REFUSED = "X-Kvrelay-Refused-Blocks"
HEADER_PREFILLED_BY = "X-Kvrelay-Prefilled-By"
UNKNOWN = "unknown"
# The connector's reasons; any other name an engine sends is counted as "other" (it becomes a
# metric label: an engine must not be able to grow the label set).
REASONS = frozenset({REFUSED_HASH, REFUSED_PARTIAL, REFUSED_UNVERIFIED, REFUSED_LOCAL,
                     REFUSED_THRESHOLD, REFUSED_FAILED})  # fmt: skip


def _int(value: object) -> int | None:
    # `type(...) is int`: one check that also refuses bools (a subclass of int).
    return value if type(value) is int and value >= 0 else None


# Not frozen: a frozen dataclass sets each field through `object.__setattr__`, and several
# accounts are built per turn. Treat it as a value all the same: it is never changed.
@dataclass(slots=True)
class PromptAccount:
    """One leg's prompt tokens split by where their KV came from; None: the engine did not say.

    `reused` = tokens not computed (`local_hit + loaded` when the engine split them; a stock
    engine's usage gives only the sum). `loaded`: read from the holder the params named (D's
    previous turn for P and decode-only D; P's prefill for D on a turn through P).
    """

    prompt_tokens: int | None = None
    reused: int | None = None
    local_hit: int | None = None
    loaded: int | None = None
    refused: tuple[tuple[str, int], ...] = ()  # (reason, blocks) offered but not loaded

    @property
    def known(self) -> bool:
        return self.reused is not None

    @property
    def computed(self) -> int | None:
        if self.prompt_tokens is None or self.reused is None:
            return None
        return max(0, self.prompt_tokens - self.reused)

    @classmethod
    def from_connector(cls, params: KVTransferParams | None) -> PromptAccount | None:
        """The connector's report in the params an engine returned; None without one."""
        if params is None:
            return None
        prompt = _int(params.kvr_prompt_tokens)
        local, loaded = _int(params.kvr_local_hit_tokens), _int(params.kvr_loaded_tokens)
        if prompt is None or local is None or loaded is None:
            return None
        refused: dict[str, int] = {}
        for reason, blocks in (params.kvr_refused_blocks or {}).items():
            if _int(blocks):
                key = reason if reason in REASONS else "other"
                refused[key] = refused.get(key, 0) + blocks
        return cls(prompt, local + loaded, local, loaded, tuple(sorted(refused.items())))

    @classmethod
    def from_cached(cls, prompt_tokens: int | None, cached: object) -> PromptAccount:
        """vLLM's own per-request total of cached tokens (local + loaded, not split)."""
        return cls(prompt_tokens, _int(cached))

    @classmethod
    def from_usage(cls, usage: object) -> PromptAccount:
        """An answer's `usage`: its prompt tokens and, where the engine reports them,
        `prompt_tokens_details.cached_tokens`. Only where the answer is the engine's own
        figure: a D given P's params reports P's cached tokens (ACCOUNTING §1)."""
        if not isinstance(usage, Mapping):
            return cls()
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
        return cls.from_cached(_int(usage.get("prompt_tokens")), cached)

    def or_else(self, other: PromptAccount | None) -> PromptAccount:
        """This account when the engine split it, else `other` when that one knows more; the
        prompt tokens from whichever has them."""
        if other is None:
            return self
        best, rest = (self, other) if self.known or not other.known else (other, self)
        if best.prompt_tokens is None and rest.prompt_tokens is not None:
            return PromptAccount(rest.prompt_tokens, best.reused, best.local_hit, best.loaded,
                                 best.refused)  # fmt: skip
        return best

    def summary(self) -> dict[str, Any]:
        """The account in the turn's log line and the stream's usage extension."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused,
            "local_hit_tokens": self.local_hit,
            "loaded_tokens": self.loaded,
            "computed_tokens": self.computed,
            "refused_blocks": dict(self.refused),
        }

    def headers(self, prefilled_by: str) -> dict[str, str]:
        """The account as response headers (`unknown` where the engine gave no figure)."""

        def text(value: int | None) -> str:
            return UNKNOWN if value is None else str(value)

        out = {
            HEADER_PROMPT: text(self.prompt_tokens),
            HEADER_REUSED: text(self.reused),
            HEADER_LOCAL_HIT: text(self.local_hit),
            HEADER_LOADED: text(self.loaded),
            HEADER_COMPUTED: text(self.computed),
            HEADER_PREFILLED_BY: prefilled_by,
        }
        if self.refused:
            out[HEADER_REFUSED] = ",".join(f"{reason}={n}" for reason, n in self.refused)
        return out


UNKNOWN_ACCOUNT = PromptAccount()
