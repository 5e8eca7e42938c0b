"""The connector's one root exception and the kinds of failure it names.

Every exception the connector raises on purpose derives from `ConnectorError` and carries a
`ConnectorErrorKind`, so callers branch on an enum member instead of comparing strings or
exception messages. A kind's `value` is what counters and logs show (`failures_<kind>` in the
worker's stats, hence the engine's metrics): those values are part of the metrics surface and
must not change.
"""

from __future__ import annotations

from enum import Enum


class ConnectorErrorKind(Enum):
    """What failed. Load failures label the worker's `failures_<value>` counters."""

    # A KV load (reader side), by the step that failed.
    SETUP = "setup"  # the read could not be planned (TP sizes, block ids, NIXL set-up)
    CLAIM = "claim"  # the claim call to the holder failed
    CLAIMED = "claimed"  # another reader request claimed the blocks first
    GONE = "gone"  # the holder no longer holds these blocks (or restarted)
    HANDSHAKE = "handshake"  # the holder's NIXL metadata could not be fetched
    INCOMPATIBLE = "incompatible"  # the holder serves another model, dtype, layout or version
    TRANSFER = "transfer"  # a NIXL READ failed
    TIMEOUT = "timeout"  # a READ outlasted its deadline
    EXCEPTION = "exception"  # an unexpected error inside the load
    MISMATCH = "mismatch"  # the claim answered other blocks than the params named
    HOLDER_DOWN = "holder_down"  # the holder's breaker is open: its claims or reads timed out
    QUARANTINE = "quarantine"  # too many of this reader's blocks wait on the holder's reads
    # The other parts.
    SIDE_CHANNEL = "side_channel"  # the holder's side channel was unreachable or answered badly
    HOLDER_NOT_ALLOWED = "holder_not_allowed"  # the holder's address is outside the allowlist
    TRANSPORT = "transport"  # NIXL registration, metadata, transfer posting or state
    TP_MISMATCH = "tp_mismatch"  # two engines' TP sizes or geometries do not map
    LAYOUT = "layout"  # KV cache tensors do not match the declared layout
    UNSUPPORTED_CONFIG = "unsupported_config"  # the engine is configured in a way not served
    UNSUPPORTED_CACHE = "unsupported_cache"  # the engine's KV tensors cannot be described

    @property
    def releases_holder(self) -> bool:
        """Whether a reader whose load failed this way should release the holder's blocks.

        Not for `GONE` (nothing is held any more) or `CLAIMED` (another reader owns them now).
        A load refused because the holder is down (`HOLDER_DOWN`) releases too: a holder whose
        READs timed out may still answer its side channel, and one that comes back would
        otherwise keep the blocks for their whole lease (the release is sent in the background
        with bounded retries, so a dead holder costs nothing but those tries).
        """
        return self not in (ConnectorErrorKind.GONE, ConnectorErrorKind.CLAIMED)


class ConnectorError(Exception):
    """Root of the connector's exceptions; `kind` says what failed.

    Subclasses set a class-level default `kind`; a caller may pass another one.
    """

    kind: ConnectorErrorKind = ConnectorErrorKind.EXCEPTION

    def __init__(self, message: str, kind: ConnectorErrorKind | None = None) -> None:
        super().__init__(message)
        if kind is not None:
            self.kind = kind
