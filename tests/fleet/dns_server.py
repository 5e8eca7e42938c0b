"""A small real DNS server on loopback for discovery tests (dnslib, UDP and TCP).

Its zone is a dict the test edits while the server runs: name -> list of records, each
`("A", "127.0.0.1")`, `("AAAA", "::1")` or `("SRV", (priority, weight, port, target))`. A name
not in the zone answers NXDOMAIN; `fail = True` makes every answer SERVFAIL.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from dnslib import AAAA, QTYPE, RCODE, RR, SRV, A, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSLogger, DNSServer

from tests.harness import free_port

Record = tuple[str, Any]


class _ZoneResolver(BaseResolver):  # type: ignore[misc]
    def __init__(self, owner: DnsServer) -> None:
        self._owner = owner

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        reply = request.reply()
        if self._owner.fail:
            reply.header.rcode = RCODE.SERVFAIL
            return reply
        qname = str(request.q.qname).rstrip(".")
        qtype = QTYPE[request.q.qtype]
        with self._owner.lock:
            records = self._owner.zone.get(qname)
            if records is None:
                reply.header.rcode = RCODE.NXDOMAIN
                return reply
            for kind, value in records:
                if kind != qtype:
                    continue
                if kind == "A":
                    rdata: Any = A(value)
                elif kind == "AAAA":
                    rdata = AAAA(value)
                else:
                    priority, weight, port, target = value
                    rdata = SRV(priority, weight, port, target)
                reply.add_answer(RR(qname, getattr(QTYPE, kind), rdata=rdata, ttl=1))
        return reply


@dataclass
class DnsServer:
    """Serves `zone` on 127.0.0.1:`port` (UDP) until `stop()`."""

    zone: dict[str, list[Record]] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    fail: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    _server: Any = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, records: list[Record]) -> None:
        with self.lock:
            self.zone[name] = list(records)

    def start(self) -> DnsServer:
        logger = DNSLogger(log="-request,-reply,-truncated,-error,-recv,-send,-data")
        self._server = DNSServer(
            _ZoneResolver(self), port=self.port, address="127.0.0.1", logger=logger
        )
        self._server.start_thread()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server.server.server_close()
            self._server = None
