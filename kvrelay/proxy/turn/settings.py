"""`TurnSettings`: the part of the proxy's settings that a turn's steps read."""

from __future__ import annotations

from typing import NamedTuple

from kvrelay.proxy.config import Settings


class TurnSettings(NamedTuple):
    """The settings a turn reads (`kvrelay.proxy.config.Settings` has the descriptions)."""

    retries: int
    first_byte_timeout: float
    side_channel_timeout: float
    probe_timeout_s: float
    conversation_ttl_s: float
    entry_safety_margin_s: float
    stock_vllm_reuse: bool
    prefix_pull: bool
    prefix_pull_priority: int
    prefix_pull_timeout_s: float
    prefill_priority_tokens: int

    @classmethod
    def of(cls, settings: Settings) -> TurnSettings:
        return cls(*(getattr(settings, name) for name in cls._fields))
