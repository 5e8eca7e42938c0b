"""How clients, logs and metrics name an engine: its role and a keyed hash of its URL.

`decode-1a2b3c4d`: the same in every worker and replica and across restarts (the key is derived
from the deployment's own secret), and it reveals no address. An unkeyed hash would: engine URLs
come from a small space (an internal subnet and a port), and every name can be hashed back from
it in well under a second. The key is derived from the first secret the proxy is configured
with, the connector secret first (every replica of a fleet has the same one, and it rarely
changes), else the admin key, the metrics key or the API keys; a proxy configured with none of
them is open to anyone anyway and names engines by a plain hash of the URL.
"""

from __future__ import annotations

import hashlib
import hmac

from kvrelay.proxy.config import Settings

_key = b""  # set once per process at start-up (`use_name_key`)


def name_key(settings: Settings) -> bytes:
    """The naming key of a deployment with these settings (empty: none configured)."""
    for secret in (settings.connector_secret, settings.admin_key, settings.metrics_key):
        if secret is not None and secret.get_secret_value():
            return _derive(secret.get_secret_value())
    keys = sorted(k.get_secret_value() for k in settings.api_keys)
    return _derive("\n".join(keys)) if keys else b""


def use_name_key(key: bytes) -> None:
    """Name engines with `key` in this process from now on."""
    global _key
    _key = key


def engine_name(role: str, url: str, key: bytes | None = None) -> str:
    """`decode-1a2b3c4d` for the engine at `url` (under `key`, else this process's key)."""
    key = _key if key is None else key
    data = url.encode()
    digest = hmac.new(key, data, hashlib.sha256) if key else hashlib.sha256(data)
    return f"{role}-{digest.hexdigest()[:8]}"


def _derive(secret: str) -> bytes:
    return hmac.new(secret.encode(), b"kvrelay-engine-names-v1", hashlib.sha256).digest()
