"""OpenTelemetry traces: starting spans, passing the trace on to engines, exporting.

Tracing is off by default. It is on when the setting `tracing` (KVRELAY_TRACING) is `on`, or
when it is `auto` (the default) and the standard variables ask for traces: OTEL_TRACES_EXPORTER
names an exporter other than `none`, or OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set. OTEL_SDK_DISABLED=true turns it off whatever the
setting says. Everything else comes from the standard OTEL_* variables as the OpenTelemetry SDK
reads them: the exporter (`otlp`, the default, over HTTP/protobuf; `console`), its endpoint,
headers and timeout, the service name (`kvrelay` unless OTEL_SERVICE_NAME or
OTEL_RESOURCE_ATTRIBUTES name one), the sampler, the batch processor's limits and the
propagators (W3C `traceparent` by default). Of an incoming request only the W3C trace context
is continued; its baggage is the client's and is not passed on.

The opentelemetry packages are the optional `otel` extra and are imported only once tracing is
on. While it is off every helper here returns at once: no span objects, no context changes, no
headers added, so the hot path pays one global read per call site.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, Literal

from kvrelay.proxy.config import SettingsError, TracingMode

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.util.types import AttributeValue

log = logging.getLogger(__name__)

SpanKind = Literal["server", "client", "internal"]
INSTRUMENTATION = "kvrelay.proxy"
DEFAULT_SERVICE_NAME = "kvrelay"
_OTLP_MODULE = "opentelemetry.exporter.otlp.proto.http.trace_exporter"

# Set while tracing is on; None is the off switch every helper checks first.
_tracer: Tracer | None = None
_provider: TracerProvider | None = None
_kinds: dict[str, Any] = {}


class TracingConfigError(SettingsError):
    """Tracing is asked for but cannot run: the `otel` extra is missing or an OTEL_* variable
    names an exporter or protocol kvrelay does not ship."""


def wanted(mode: TracingMode, env: Mapping[str, str] | None = None) -> bool:
    """Whether `mode` and the OTEL_* variables in `env` (default: the process's) ask for traces."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if mode != "auto":
        return mode == "on"
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(
        env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    )


def enabled() -> bool:
    """True while spans are recorded."""
    return _tracer is not None


def check(mode: TracingMode) -> list[str]:
    """The exporters tracing will use (none when it is off); raises `TracingConfigError` when
    it is asked for but cannot run. Start-up calls this once, before any worker starts."""
    if not wanted(mode):
        return []
    try:
        for module in ("opentelemetry.sdk.trace", _OTLP_MODULE):
            importlib.import_module(module)
    except ImportError:
        raise TracingConfigError(
            "tracing is on (KVRELAY_TRACING or OTEL_* variables) but the opentelemetry "
            "packages are missing: install kvrelay[otel]"
        ) from None
    names = [
        n.strip().lower()
        for n in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")
        if n.strip() and n.strip().lower() != "none"
    ] or ["otlp"]
    for name in names:
        if name not in ("otlp", "console"):
            raise TracingConfigError(
                f"OTEL_TRACES_EXPORTER={name!r} is not supported: otlp, console or none"
            )
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
    ).strip()
    if "otlp" in names and protocol not in ("", "http/protobuf"):
        raise TracingConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: kvrelay ships the OTLP exporter over "
            "HTTP only (http/protobuf)"
        )
    return names


def configure(mode: TracingMode) -> bool:
    """Turn tracing on in this process when `mode` and the OTEL_* variables ask for it;
    returns whether it is on (raises `TracingConfigError` as `check`)."""
    names = check(mode)
    if not names:
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporters = [_exporter(name) for name in names]
    # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; ours is the fallback.
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    provider = TracerProvider(resource=resource)  # reads OTEL_TRACES_SAMPLER(_ARG)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))  # reads OTEL_BSP_*
    install(provider)
    log.info("tracing on: exporter %s", ",".join(names))
    return True


def _exporter(name: str) -> SpanExporter:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, headers, timeout from OTEL_EXPORTER_OTLP_*


def install(provider: TracerProvider) -> None:
    """Record spans with `provider` from now on (`configure` uses it; tests pass one with an
    in-memory exporter)."""
    global _tracer, _provider
    from opentelemetry.trace import SpanKind as OtelKind

    _kinds.update(server=OtelKind.SERVER, client=OtelKind.CLIENT, internal=OtelKind.INTERNAL)
    _provider = provider
    _tracer = provider.get_tracer(INSTRUMENTATION)


def shutdown() -> None:
    """Export what is buffered and turn tracing off (process exit, tests)."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


# -- spans --------------------------------------------------------------------------------------


class _Off:
    """The context manager every span helper returns while tracing is off: it does nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


OFF = _Off()

Attributes = Mapping[str, "AttributeValue"]


def span(
    name: str,
    *,
    kind: SpanKind = "internal",
    attributes: Attributes | None = None,
    finish: Callable[[], Attributes] | None = None,
    parent_headers: Mapping[str, str] | None = None,
) -> contextlib.AbstractContextManager[Span | None]:
    """A span around a block, current inside it (children and `inject` see it).

    `finish` gives attributes known only at the end; `parent_headers` continues the trace of
    an incoming request (its `traceparent`). While tracing is off this returns `OFF`."""
    if _tracer is None:
        return OFF
    return _recording(_tracer, name, kind, attributes, finish, parent_headers)


@contextlib.contextmanager
def _recording(
    tracer: Tracer,
    name: str,
    kind: SpanKind,
    attributes: Attributes | None,
    finish: Callable[[], Attributes] | None,
    parent_headers: Mapping[str, str] | None,
) -> Iterator[Span]:
    context = None
    if parent_headers is not None:
        # Only the W3C trace context of an incoming request is continued: its baggage is the
        # client's own data and is not passed on to the engines.
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        context = TraceContextTextMapPropagator().extract(parent_headers)
    # Exceptions are recorded by type only: their messages may quote what a client or an
    # engine sent (an engine's 400 can echo the input), which must not leave in a trace.
    with tracer.start_as_current_span(
        name,
        context=context,
        kind=_kinds[kind],
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as current:
        try:
            yield current
        except BaseException as exc:
            from opentelemetry.trace import Status, StatusCode

            current.set_attribute("error.type", type(exc).__name__)
            # A client's mistake (an HTTP status below 500) is not the server span's error.
            status = getattr(exc, "status", None)
            if not (kind == "server" and isinstance(status, int) and status < 500):
                current.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            if finish is not None:
                current.set_attributes(finish())


def annotate(attributes: Attributes) -> None:
    """Set attributes on the current span (nothing while tracing is off)."""
    if _tracer is None:
        return
    from opentelemetry.trace import get_current_span

    get_current_span().set_attributes(attributes)


def event(name: str, attributes: Attributes | None = None) -> None:
    """Add an event to the current span (nothing while tracing is off)."""
    if _tracer is None:
        return
    from opentelemetry.trace import get_current_span

    get_current_span().add_event(name, attributes)


def inject(headers: MutableMapping[str, str]) -> None:
    """Add the current span's `traceparent` (and other configured propagators' headers) to an
    outgoing request's headers; nothing while tracing is off."""
    if _tracer is None:
        return
    from opentelemetry.propagate import inject as otel_inject

    otel_inject(headers)
