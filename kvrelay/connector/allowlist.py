"""Which holder addresses a reader will contact at all (the `allowed_holders` setting). Torch-free.

A request's `kv_transfer_params` name the holder to read from; whoever can reach an engine's API
could name their own server. The reader therefore talks only to allowed holders. Each entry is
an IP address, an IP network in CIDR form, or a host name (matched exactly, case-insensitive).
Host names are never resolved for the check: an engine advertising a name must be listed by
that name. The default admits loopback and the private address ranges a fleet runs on, and
refuses everything public. Link-local addresses and cloud metadata services (which live in
link-local ranges, and in AWS's case also at `fd00:ec2::254`, inside the private `fc00::/7`)
are never holders, whatever the setting lists.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

DEFAULT_ALLOWED_HOLDERS: tuple[str, ...] = (
    "localhost",
    "127.0.0.0/8",
    "::1/128",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "fc00::/7",
)

# Never contacted, even when an entry covers them.
NEVER_HOLDERS: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "169.254.0.0/16",  # IPv4 link-local: instance metadata (169.254.169.254) and others
        "fe80::/10",  # IPv6 link-local
        "fd00:ec2::254/128",  # AWS instance metadata over IPv6
        "0.0.0.0/8",  # "this host": connects to local services on some systems
        "::/128",
    )
)


class HolderAllowlist:
    """Parsed `allowed_holders`; `allows(host)` is the only question it answers."""

    def __init__(self, entries: Iterable[str]) -> None:
        self._networks: list[IPNetwork] = []
        self._names: set[str] = set()
        for raw in entries:
            entry = raw.strip()
            if not entry:
                continue
            try:
                self._networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                self._names.add(entry.lower().rstrip("."))

    def allows(self, host: str) -> bool:
        name = host.strip().strip("[]").lower().rstrip(".")
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return name in self._names
        if isinstance(address, ipaddress.IPv6Address):
            if address.scope_id is not None:
                return False  # a zone index only means something on a link-local address
            if address.ipv4_mapped is not None:
                address = address.ipv4_mapped
        if any(address in net for net in NEVER_HOLDERS):
            return False
        return any(address in net for net in self._networks)


def parse_entries(entries: Iterable[str]) -> list[str]:
    """Validate entries at configuration time (every entry is a network or a plausible name)."""
    out: list[str] = []
    for raw in entries:
        entry = raw.strip()
        if not entry:
            raise ValueError("empty allowed_holders entry")
        try:
            ipaddress.ip_network(entry.strip("[]"), strict=False)
        except ValueError:
            if any(c.isspace() or c in "/:@" for c in entry):
                raise ValueError(
                    f"allowed_holders entry {entry!r} is neither a network nor a host name"
                ) from None
        out.append(entry)
    return out
