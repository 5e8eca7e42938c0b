"""`ConnectorConfig`: everything one engine's connector needs, for scheduler and workers alike.

The compatibility hash binds a holder and a reader: blocks move only between engines that agree
on model, dtype, cache layout kind, block size, layer count, KV heads, head size, MLA and
connector version. (The per-block layout the workers register is compared at read time too.)
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvrelay.connector.allowlist import DEFAULT_ALLOWED_HOLDERS, parse_entries
from kvrelay.connector.auth import destination, secret_from_env
from kvrelay.connector.protocol import CONNECTOR_VERSION

FailurePolicy = Literal["recompute", "fail"]


class ConnectorConfig(BaseModel):
    """Per-engine connector settings (validated, immutable)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine_id: str = Field(min_length=1, max_length=200)
    # Side channel served by the scheduler process; port 0 picks a free one (see
    # `ConnectorScheduler.side_channel_port`). `advertise_host` is what goes into params.
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = Field(default=0, ge=0, le=65535)
    advertise_host: str | None = None
    # Other host names or addresses clients use to reach this side channel (a request is
    # signed for the address it is sent to; the side channel accepts only its own addresses).
    side_channel_aliases: tuple[str, ...] = ()
    # Shared HMAC secret; None means "read KVRELAY_CONNECTOR_SECRET" (required to start).
    secret: str | None = Field(default=None, repr=False)

    # Identity of the KV format (compatibility hash inputs).
    model: str = "unknown"
    dtype: str = "float16"
    block_size: int = Field(default=16, ge=1)
    num_layers: int = Field(default=1, ge=1)
    kv_layout: str = "default"
    use_mla: bool = False
    tp_size: int = Field(default=1, ge=1)
    # Model-wide KV heads and head size (None where the engine does not say; then only the
    # model name and the registered block geometry tell layouts apart).
    num_kv_heads: int | None = Field(default=None, ge=1)
    head_dim: int | None = Field(default=None, ge=1)

    # Holder side.
    # Measured on the Mooncake conversation trace (bench/trace_replay_notes.md, "Hold policy"):
    # a 600 s lease outlasts 95% of its think times (120 s: half). The budget: a tenth of the
    # pool. Blocks a hold lets go stay in the engine's prefix cache, which the proxy's routing
    # follows (a turn whose history a D decoded goes back to that D), so pinning more of the
    # pool bought no reuse there and cost the prefix cache room (bench/RESULTS.md, "trace
    # compare (conversation)": half the pool pinned 25-30%, most of it unused).
    # The proxy's conversation_ttl_s (600 s) must not be shorter than the lease.
    lease_seconds: float = Field(default=600.0, gt=0)
    # Share of the engine's KV blocks that holds for a later turn may pin; past it the least
    # recently used are freed (reason `budget`). 1.0: only block pressure bounds them (reclaim).
    hold_budget_fraction: float = Field(default=0.1, gt=0, le=1)
    # The largest share of the pool one hold for a later turn may pin; a turn larger than that
    # is not held (its blocks stay in the prefix cache) and its params say so
    # (`hold_declined`). 1.0: the newest hold is always kept, even alone over the budget. At
    # the budget's share (the default) the budget is a hard bound. Alone it lost reuse (0.82-0.88
    # of the LRU bound; bench/RESULTS.md, "Holds no larger than the budget"), as nothing sent a
    # turn to the history a D no longer held; with the proxy's decode_only_cached, which sends
    # it to that D's prefix cache, it kept reuse (0.92-0.97) and cut D's pool pinned by unused
    # holds from 11-16% to 5-6% ("One hold no larger than D's hold budget", runs K and L).
    hold_max_fraction: float = Field(default=0.1, gt=0, le=1)
    # A hold the proxy asks to be brief (`hold_brief`: the conversation answers at once, as an
    # agent's loop does) is kept over `hold_max_fraction` for `hold_brief_lease_s` (never past
    # the lease). Brief holds pin at most this share of the pool together (past it the least
    # recently used go, reason `budget`; one alone past it is declined); the hold budget neither
    # counts nor frees them, and block pressure still reclaims them. Measured on the
    # conversation trace (bench/RESULTS.md, "trace compare (conversation)"). The proxy uses no
    # hold within its entry_safety_margin_s (5 s) of expiry: 10 s leaves the next turn 5 s.
    hold_brief_max_fraction: float = Field(default=0.5, gt=0, le=1)
    hold_brief_lease_s: float = Field(default=10.0, gt=0)
    claim_timeout_s: float = Field(default=30.0, gt=0)
    publish_finished_params: bool = True
    finished_params_ttl_s: float = Field(default=600.0, gt=0)
    finished_params_max: int = Field(default=10_000, ge=1)

    # Reader side.
    kv_recompute_threshold: int = Field(default=0, ge=0)
    kv_load_failure_policy: FailurePolicy = "recompute"
    require_block_hashes: bool = True
    handshake_timeout_s: float = Field(default=5.0, gt=0)
    handshake_retries: int = Field(default=3, ge=1)
    transfer_timeout_s: float = Field(default=30.0, gt=0)
    # After a failed or timed-out READ: how long to wait for NIXL to report it over before the
    # read counts as stuck. A stuck read's holder is then forgotten (its NIXL agent removed,
    # which ends every transfer still posted to it), so its blocks come back with the next
    # poll; until NIXL reports a read over they never go back while data may still land.
    cancel_grace_s: float = Field(default=30.0, gt=0)
    # A holder's NIXL agent (and its UCX endpoints) is dropped once no read used it for this
    # long: holders come and go (each vLLM process has an engine id of its own), and the next
    # read from one that is still there costs one handshake.
    remote_idle_s: float = Field(default=120.0, gt=0)
    coalesce: bool = True
    # Reads name blocks by index in descriptor lists NIXL prepared once per side (this rank's
    # caches at registration, a holder rank's at its first read) instead of descriptors built
    # in Python per read; whole-block reads only (a TP slice of each block is built per read).
    prepared_reads: bool = True
    # UCX worker threads of each rank's NIXL agent: they move a read's bytes off the engine's
    # thread (bench/transfer_descs.py: 56 -> 6 ms of a 24,000-descriptor read on it); 0: none,
    # UCX progresses on the engine's polls.
    nixl_threads: int = Field(default=2, ge=0, le=64)
    # Claims and handshakes run on threads of their holder's own (at most this many per
    # holder), so a hung holder delays only loads that name it.
    claim_concurrency_per_holder: int = Field(default=2, ge=1, le=16)
    # A holder whose claims, handshakes or READs timed out gets no new loads (they recompute at
    # once) until a probe load, one per this many seconds, shows it answers again.
    holder_retry_s: float = Field(default=10.0, gt=0)
    # Blocks this reader (per worker rank) may have quarantined: behind cancelled READs that
    # NIXL has not reported over, and behind READs still in flight from a holder with such a
    # read. Past it, new loads from a holder with such reads are refused (recomputed) instead
    # of adding more.
    max_quarantined_blocks: int = Field(default=256, ge=0)
    # Holder addresses a reader contacts at all (allowlist.py); the fleet's own engines.
    allowed_holders: tuple[str, ...] = DEFAULT_ALLOWED_HOLDERS
    # Releases to holders: attempts per release (network failures only) and each one's timeout;
    # each holder gets its own sender threads so a dead one delays nobody else.
    release_attempts: int = Field(default=3, ge=1, le=10)
    release_timeout_s: float = Field(default=2.0, gt=0)
    release_concurrency_per_holder: int = Field(default=2, ge=1, le=16)

    @field_validator("allowed_holders")
    @classmethod
    def _allowed_holders(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(parse_entries(value))

    def secret_bytes(self) -> bytes | None:
        """The configured secret, falling back to the environment."""
        return self.secret.encode() if self.secret else secret_from_env()

    def require_secret(self) -> bytes:
        secret = self.secret_bytes()
        if not secret:
            raise ValueError(
                "connector side channel needs a shared secret: set KVRELAY_CONNECTOR_SECRET "
                "(or ConnectorConfig.secret)"
            )
        return secret

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.side_channel_host

    def own_destinations(self, port: int) -> frozenset[str]:
        """Every `host:port` a signed request may name to reach this engine's side channel."""
        hosts = {self.side_channel_host, self.public_host, *self.side_channel_aliases}
        return frozenset(destination(h, port) for h in hosts)

    def compat_hash(self) -> str:
        """Short stable hash of everything that must agree for KV blocks to be reusable."""
        ident = {
            "model": self.model,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "kv_layout": self.kv_layout,
            "use_mla": self.use_mla,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "version": CONNECTOR_VERSION,
        }
        blob = json.dumps(ident, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
