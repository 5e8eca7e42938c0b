"""UCX's settings for NIXL over loopback on CPU: the one copy that every dev fleet uses (the demo,
the tests' engines and vLLM servers, the NIXL peers, the benchmarks). The Makefile exports the
same values for the shell; tests/test_devtools.py checks that the two agree."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

LOOPBACK_UCX: dict[str, str] = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self,sm"}


def with_loopback_ucx(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """`env` (this process's environment when None) with the loopback UCX settings filled in
    where it has none of its own."""
    target: MutableMapping[str, str] = os.environ if env is None else env
    for name, value in LOOPBACK_UCX.items():
        target.setdefault(name, value)
    return target
