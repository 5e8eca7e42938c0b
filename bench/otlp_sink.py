"""A fake OTLP/HTTP trace collector for benchmarks: `python -m bench.otlp_sink --port N`.

A fake, and named so: it accepts `POST /v1/traces` (OTLP protobuf), counts the spans of each
export and answers success, storing nothing, so a router that exports its traces has somewhere
to send them and the benchmark can show the spans really left. `GET /stats` answers
`{"exports": n, "spans": n, "bytes": n}`; `GET /health` answers 200.
"""

from __future__ import annotations

import argparse
import gzip

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

COUNTS: web.AppKey[dict[str, int]] = web.AppKey("counts", dict)
EMPTY_RESPONSE = ExportTraceServiceResponse().SerializeToString()


async def traces(request: web.Request) -> web.Response:
    raw = await request.read()
    counts = request.app[COUNTS]
    counts["bytes"] += len(raw)
    if request.headers.get("Content-Encoding") == "gzip":
        raw = gzip.decompress(raw)
    export = ExportTraceServiceRequest.FromString(raw)
    counts["exports"] += 1
    counts["spans"] += sum(
        len(scope.spans) for rs in export.resource_spans for scope in rs.scope_spans
    )
    return web.Response(body=EMPTY_RESPONSE, content_type="application/x-protobuf")


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[COUNTS])


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[COUNTS] = {"exports": 0, "spans": 0, "bytes": 0}
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/stats", stats)
    app.router.add_get("/health", health)
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
