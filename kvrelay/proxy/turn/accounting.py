"""Realized reuse: what an engine did with one leg's prompt tokens, as the engine said it.

A map entry, a routing decision or the params the proxy sent are promises; only the engine
knows how many prompt tokens it found in its own prefix cache, read from a holder, or computed
(docs/ACCOUNTING.md). `PromptAccount` is that split for one leg, read from the engine's answer
and nothing else: the connector's report (`kvr_*` in the params it returns), else vLLM's own
per-request figures (`remote_prefill_cached_tokens` on P's params, `usage.prompt_tokens_details`
where the answer is the engine's own). A figure an engine did not give stays None ("unknown"):
it is never guessed from the map. A figure no prompt can have (`count_or_none`: absurd,
negative, a split larger than its prompt) is unknown too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrelay.connector.protocol import (
    KVR_LOADED_TOKENS,
    KVR_LOCAL_HIT_TOKENS,
    KVR_PROMPT_TOKENS,
    KVR_REFUSED_BLOCKS,
    REFUSED_REASONS,
    KVTransferParams,
)
from kvrelay.proxy.base import MAX_ENGINE_COUNT, count_or_none

# Headers of a JSON answer that carry the turn's account (the proxy README, "Accounting").
HEADER_PROMPT = "X-Kvrelay-Prompt-Tokens"
HEADER_REUSED = "X-Kvrelay-Reused-Tokens"
HEADER_LOCAL_HIT = "X-Kvrelay-Local-Hit-Tokens"
HEADER_LOADED = "X-Kvrelay-Loaded-Tokens"
HEADER_COMPUTED = "X-Kvrelay-Computed-Tokens"
HEADER_REFUSED = "X-Kvrelay-Refused-Blocks"
HEADER_PREFILLED_BY = "X-Kvrelay-Prefilled-By"
UNKNOWN = "unknown"


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
    def computed(self) -> int | None:
        if self.prompt_tokens is None or self.reused is None:
            return None
        return max(0, self.prompt_tokens - self.reused)

    @classmethod
    def from_connector(cls, params: KVTransferParams | None) -> PromptAccount | None:
        """The connector's report in the params an engine returned; None without one."""
        if params is None:
            return None
        # Fields read from the instance's dict, each count checked inline: this runs for both legs
        # of every turn (dict reads pinned in tests/test_private_apis.py).
        values = params.__dict__
        prompt, local = values[KVR_PROMPT_TOKENS], values[KVR_LOCAL_HIT_TOKENS]
        loaded = values[KVR_LOADED_TOKENS]
        if type(prompt) is not int or type(local) is not int or type(loaded) is not int:
            return None
        if not 0 <= local + loaded <= prompt <= MAX_ENGINE_COUNT or local < 0 or loaded < 0:
            return None  # absurd, or more reused than the prompt has: no report
        offered = values[KVR_REFUSED_BLOCKS]
        refused = _refused(offered) if offered else ()
        return cls(prompt, local + loaded, local, loaded, refused)

    @classmethod
    def from_usage(cls, usage: object, cached: object = None) -> PromptAccount:
        """An answer's `usage`: its prompt tokens and the tokens not computed: `cached` where
        the engine gave that total elsewhere (P's `remote_prefill_cached_tokens`), else the
        usage's `prompt_tokens_details.cached_tokens`. Only where the answer is the engine's
        own figure: a D given P's params reports P's cached tokens (ACCOUNTING §1)."""
        prompt, in_usage = usage_figures(usage)
        reused = count_or_none(cached)
        if reused is None:
            reused = in_usage
        if reused is not None and prompt is not None and reused > prompt:
            reused = None  # more cached than the prompt has: not a figure to believe
        return cls(prompt, reused)

    def or_else(self, other: PromptAccount | None) -> PromptAccount:
        """This account when the engine split it, else `other` when that one knows more; the
        prompt tokens from whichever has them."""
        if other is None:
            return self
        best, rest = (
            (self, other) if self.reused is not None or other.reused is None else (other, self)
        )
        if best.prompt_tokens is None and rest.prompt_tokens is not None:
            return PromptAccount(
                rest.prompt_tokens, best.reused, best.local_hit, best.loaded, best.refused
            )
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
        prompt, reused, computed = self.prompt_tokens, self.reused, self.computed
        local, loaded = self.local_hit, self.loaded
        out = {
            HEADER_PROMPT: UNKNOWN if prompt is None else str(prompt),
            HEADER_REUSED: UNKNOWN if reused is None else str(reused),
            HEADER_LOCAL_HIT: UNKNOWN if local is None else str(local),
            HEADER_LOADED: UNKNOWN if loaded is None else str(loaded),
            HEADER_COMPUTED: UNKNOWN if computed is None else str(computed),
            HEADER_PREFILLED_BY: prefilled_by,
        }
        if self.refused:
            out[HEADER_REFUSED] = ",".join(f"{reason}={n}" for reason, n in self.refused)
        return out


def usage_figures(usage: object) -> tuple[int | None, int | None]:
    """An answer's `usage`: its prompt tokens and its `prompt_tokens_details.cached_tokens`
    (None where absent or not a count)."""
    if type(usage) is not dict:  # parsed JSON: a dict or nothing usable
        return None, None
    prompt = count_or_none(usage.get("prompt_tokens"))
    details = usage.get("prompt_tokens_details")
    cached = count_or_none(details.get("cached_tokens") if type(details) is dict else None)
    if prompt is not None and cached is not None and cached > prompt:
        cached = None
    return prompt, cached


def _refused(offered: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """The connector's refused blocks by reason (validated counts), reasons outside its set
    summed under "other", in a stable order."""
    refused: dict[str, int] = {}
    for reason, blocks in offered.items():
        if 0 < blocks <= MAX_ENGINE_COUNT:  # an absurd count says nothing: left out
            # Any other name an engine sends becomes "other": it is a metric label, and an
            # engine must not be able to grow the label set.
            key = reason if reason in REFUSED_REASONS else "other"
            refused[key] = refused.get(key, 0) + blocks
    return tuple(sorted(refused.items()))


UNKNOWN_ACCOUNT = PromptAccount()


class TurnAccounts:
    """What the engines reported each leg of one turn did with its prompt, kept by the turn: its
    learning and its next entry read them here; the turn's `TurnReport` counts and logs them.

    `prefilled_by` is "prefill" once P answered with params for D, else "decode" (D prefilled
    the prompt alone). The turn's account (`settle`) is that leg's. Made blank on every turn: a
    plain class whose blanks are class attributes, so only what the engines report is written."""

    prefill: PromptAccount | None = None
    decode: PromptAccount | None = None
    prefilled_by: str = "decode"
    settled: PromptAccount | None = None  # the turn's account, once settled

    def prefill_answered(self, account: PromptAccount, for_decode: bool) -> None:
        """P answered with this account; `for_decode`: with params D prefills from."""
        self.prefill = account
        if for_decode:
            self.prefilled_by = "prefill"

    def decode_reported(self, account: PromptAccount | None) -> None:
        """D's connector reported its account (in D's params: its answer, its stream or its
        side channel)."""
        if account is not None:
            self.decode = account.or_else(self.decode)

    def decode_usage(self, usage: object) -> None:
        """D's `usage`. Its cached tokens are D's own only when D got no P params: on a turn
        through P they are P's figure (vLLM reports `remote_prefill_cached_tokens`)."""
        known = self.decode
        if known is not None and known.reused is not None and known.prompt_tokens is not None:
            return  # D's connector gave the whole split: its usage adds nothing
        prompt, cached = usage_figures(usage)
        account = PromptAccount(prompt, None if self.prefilled_by == "prefill" else cached)
        self.decode = account if known is None else known.or_else(account)

    def settle(self) -> PromptAccount:
        """The turn's account, fixed at the first call: the account of the leg that prefilled
        the prompt, `unknown` where its engine gave no figure."""
        if self.settled is None:
            p = self.prefill if self.prefilled_by == "prefill" else None
            self.settled = p or self.decode or UNKNOWN_ACCOUNT
        return self.settled
