"""`ConnectorConfig`: everything one engine's connector needs, for scheduler and workers alike.

The compatibility hash binds a holder and a reader: blocks move only between engines that agree
on model, dtype, cache layout kind, block size, layer count, MLA and connector version.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvrelay.connector.auth import secret_from_env
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

    # Holder side.
    lease_seconds: float = Field(default=120.0, gt=0)
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
    coalesce: bool = True

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

    def compat_hash(self) -> str:
        """Short stable hash of everything that must agree for KV blocks to be reusable."""
        ident = {
            "model": self.model,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "kv_layout": self.kv_layout,
            "use_mla": self.use_mla,
            "version": CONNECTOR_VERSION,
        }
        blob = json.dumps(ident, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
