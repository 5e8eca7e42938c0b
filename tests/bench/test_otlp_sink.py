"""The proxy-bound benchmark's fake OTLP collector counts what the real exporter sends.

`bench/otlp_sink.py` is where traced proxies export in `proxy_overhead.py --proxy-bound
--tracing`; its span count is the benchmark's evidence that tracing really ran, so it is
checked against the SDK's own OTLP/HTTP exporter.
"""

from __future__ import annotations

import json
import sys
import urllib.request

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from tests.harness import REPO_ROOT, ServerProcess, free_port, http_ready


def test_sink_counts_the_spans_the_otlp_exporter_sends() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, str(REPO_ROOT / "bench" / "otlp_sink.py"), "--port", str(port)]
    with ServerProcess(argv, http_ready(url + "/health"), ready_timeout=30, name="otlp-sink"):
        provider = TracerProvider()
        provider.add_span_processor(
            SimpleSpanProcessor(OTLPSpanExporter(endpoint=url + "/v1/traces", timeout=5))
        )
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("outer"), tracer.start_as_current_span("inner"):
            pass
        with tracer.start_as_current_span("alone"):
            pass
        provider.shutdown()
        with urllib.request.urlopen(url + "/stats", timeout=5) as resp:
            stats = json.loads(resp.read())
    # SimpleSpanProcessor exports each span on its own.
    assert stats["spans"] == 3 and stats["exports"] == 3 and stats["bytes"] > 0
