"""UCX's settings for NIXL over loopback: the one copy that every dev fleet uses (the demo,
the tests' engines and vLLM servers, the NIXL peers, the benchmarks). The Makefile exports the
CPU values for the shell; tests/test_devtools.py checks that the two agree.

On a GPU the same loopback wire-up needs UCX's CUDA transports too (`cuda_copy` to move and
detect device memory, `cuda_ipc` for reads between processes on one node), and `cuda_ipc`'s
GET allowed where UCX finds no NVLink (one GPU, or PCIe GPUs): UCX turns it off there by
default, and NIXL's READ is a GET, so reads fall back to staging through TCP (0.5 GB/s against
45-1100 GB/s over `cuda_ipc` on one H200, bench/RESULTS.md `## transfer (GPU)`)."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

LOOPBACK_UCX: dict[str, str] = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self,sm"}
CUDA_TRANSPORTS = "cuda_copy,cuda_ipc"
CUDA_UCX: dict[str, str] = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


def with_loopback_ucx(
    env: MutableMapping[str, str] | None = None, cuda: bool = False
) -> MutableMapping[str, str]:
    """`env` (this process's environment when None) with the loopback UCX settings filled in
    where it has none of its own. With `cuda`, the CUDA transports are added to the loopback
    transport list (an operator's own `UCX_TLS` is kept as it is) and `cuda_ipc`'s GET is
    allowed unless set otherwise."""
    target: MutableMapping[str, str] = os.environ if env is None else env
    for name, value in LOOPBACK_UCX.items():
        target.setdefault(name, value)
    if cuda and target["UCX_TLS"] == LOOPBACK_UCX["UCX_TLS"]:
        target["UCX_TLS"] = f"{LOOPBACK_UCX['UCX_TLS']},{CUDA_TRANSPORTS}"
    if cuda:
        for name, value in CUDA_UCX.items():
            target.setdefault(name, value)
    return target
