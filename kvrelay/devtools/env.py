"""The environment every process of a dev fleet runs with: the one builder (demo, tests, bench).

It holds what the engines and the proxy must agree on (the side channels' shared secret), how
NIXL reaches a peer on one machine (UCX over loopback, `ucx.py`) and, for a fleet started from a
source tree, where `kvrelay` is imported from (`PYTHONPATH`).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from kvrelay.devtools.ucx import with_loopback_ucx

SECRET_VAR = "KVRELAY_CONNECTOR_SECRET"
# A fleet given no secret and finding none set shares this one: fresh for each run of the
# process that starts it, so it never has to be written down anywhere.
_RUN_SECRET = secrets.token_hex(16)


def fleet_env(
    secret: str | None = None,
    *,
    pythonpath: Path | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The whole environment of one fleet process: `base` (this process's environment when None)
    with the loopback UCX settings where it has none of its own, the side channels' secret
    (`secret` when given; else the one set, or this run's own) and `pythonpath` put first on
    `PYTHONPATH` when given."""
    env = dict(with_loopback_ucx(dict(os.environ if base is None else base)))
    if secret is not None:
        env[SECRET_VAR] = secret
    elif not env.get(SECRET_VAR):
        env[SECRET_VAR] = _RUN_SECRET
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(pythonpath), env.get("PYTHONPATH", "")) if p
        )
    return env
