"""The grammars of the settings written as small strings: a tenant's limit and a DNS discovery
name. The settings check them at start-up and the limiter and the resolver read them; they sit
here, below all three, so the settings import nothing that imports the settings."""

from __future__ import annotations

import math


def parse_limit(spec: str, where: str = "tenant") -> dict[str, float]:
    """`inflight=N;rps=R;burst=B` (any subset) as the fields it sets; ValueError otherwise."""
    out: dict[str, float] = {}
    names = {"inflight": "max_inflight", "rps": "rps", "burst": "burst"}
    for item in spec.split(";"):
        if not item.strip():
            continue
        name, sep, raw = item.partition("=")
        field = names.get(name.strip())
        try:
            value = float(raw) if sep else math.nan
        except ValueError:
            value = math.nan
        if field is None or not math.isfinite(value) or value < 0:
            raise ValueError(
                f"limit {spec!r} of {where!r}: expected inflight=N;rps=R;burst=B (numbers >= 0)"
            )
        if field != "rps" and value != int(value):
            raise ValueError(f"limit {spec!r} of {where!r}: {name.strip()} must be an integer")
        out[field] = value
    if not out:
        raise ValueError(f"limit of {where!r} is empty: expected inflight=N;rps=R;burst=B")
    return out


def parse_dns_spec(spec: str) -> tuple[str, int | None]:
    """(`name`, port) for `name:port`, (`_srv._tcp.name`, None) for SRV."""
    spec = spec.strip()
    if spec.startswith("_"):
        if ":" in spec:
            raise ValueError(f"{spec!r}: an SRV name carries no port")
        return spec, None
    name, sep, port = spec.rpartition(":")
    if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{spec!r} is neither name:port nor an _service._proto.name SRV name")
    return name, int(port)
