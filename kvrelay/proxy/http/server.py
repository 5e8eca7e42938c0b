"""Running the proxy: logging, uvloop, one process or `workers` processes on one port.

Several workers share the listening port with SO_REUSEPORT (the kernel spreads connections) and are
supervised by the parent (`kvrelay.proxy.http.supervisor`: a worker that exits is restarted). They
aggregate their metrics through prometheus-client's multiprocess mode, for which the parent creates
`PROMETHEUS_MULTIPROC_DIR` before any worker starts. They also need the shared Redis map
(`Settings.check_runnable` refuses otherwise)."""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
from multiprocessing.context import SpawnProcess

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from kvrelay.proxy.config import LogFormat, Settings, SettingsError
from kvrelay.proxy.http.parent_watch import exit_with_parent
from kvrelay.proxy.http.protocol_errors import install as shape_protocol_errors
from kvrelay.proxy.http.supervisor import Supervisor
from kvrelay.proxy.telemetry import logs, tracing

log = logging.getLogger(__name__)

# After answering a request whose body was not read (refused before or while reading it),
# read and drop what the client still sends for at most this long, then close. Short, so a
# client trickling a refused body cannot keep the connection.
LINGER_S = 1.0

# Allocations between young collections (CPython's default is 700); see `tune_gc`.
GC_YOUNG_THRESHOLD = 20_000


class ProtocolErrorFilter(logging.Filter):
    """Malformed HTTP from a client is the client's problem: one WARNING line, no traceback.

    aiohttp logs each such request at ERROR with the parser's traceback; anyone who can reach
    the port could fill the log with them."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            detail = " ".join(str(exc.message).split())[:200]  # one line, bounded
            record.msg = f"{record.getMessage()}: malformed HTTP ({type(exc).__name__}: {detail})"
            record.args = None
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def configure_logging(level: str, log_format: LogFormat = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logs.formatter(log_format))
    logging.basicConfig(level=level, handlers=[handler])
    logs.configure_turn_log(log_format)
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, ProtocolErrorFilter) for f in server_log.filters):
        server_log.addFilter(ProtocolErrorFilter())


def check_map_url(settings: Settings) -> None:
    """Open and close the map once so a malformed map URL fails at start-up, named."""
    from kvrelay.kvcache_map import open_map

    async def probe() -> None:
        kvmap = open_map(settings.map_url)
        await kvmap.close()

    try:
        asyncio.run(probe())
    except ValueError as exc:
        raise SettingsError(
            f"invalid setting `map_url` (KVRELAY_MAP_URL / --map-url): {exc}"
        ) from None


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # optional on platforms without it
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def tune_gc(app: web.Application) -> web.Application:
    """Keep the cyclic garbage collector off the request path's back.

    Every request allocates container objects (dicts, futures, tasks), and at CPython's default
    thresholds a young collection runs every few requests while the oldest generation's pass walks
    every object the proxy loaded at start-up (aiohttp, pydantic, prometheus-client ...). Freezing
    what start-up created takes those objects out of the collector's walk for good, and a larger
    young-generation threshold runs collections less often; what a request leaves in cycles is
    still collected.
    """

    async def freeze(_: web.Application) -> None:
        gc.collect()
        gc.freeze()

    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    app.on_startup.append(freeze)  # after the shared state: cleanup_ctx runs first
    return app


def run_worker(settings: Settings, reuse_port: bool, supervisor_pid: int | None = None) -> None:
    """One proxy process: serves until SIGINT/SIGTERM (and, under a supervisor, until the
    supervisor dies)."""
    from kvrelay.proxy.http.app import create_app

    configure_logging(settings.log_level, settings.log_format)
    shape_protocol_errors()
    if supervisor_pid is not None:
        exit_with_parent(supervisor_pid)
    tracing.configure(settings.tracing)
    _install_uvloop()
    app = tune_gc(create_app(settings))
    web.run_app(
        app,
        host=settings.host,
        port=settings.port,
        reuse_port=reuse_port,
        handler_cancellation=True,  # a client that goes away cancels its upstream legs
        access_log=None,
        print=None,
        # On SIGTERM let in-flight streams finish: none outlives total_timeout, and the chart's
        # grace period is longer than that, so a rolling update cuts no answer short.
        shutdown_timeout=settings.total_timeout,
        lingering_time=LINGER_S,
    )
    tracing.shutdown()  # export the spans still buffered


def serve(settings: Settings) -> int:
    """Run the proxy in the foreground; returns the exit code."""
    configure_logging(settings.log_level, settings.log_format)
    settings.check_runnable()
    check_map_url(settings)
    tracing.check(settings.tracing)
    log.info(
        "kvrelay proxy on %s:%d, settings %s", settings.host, settings.port, settings.public_dict()
    )
    if settings.workers == 1:
        run_worker(settings, reuse_port=False)
        return 0
    return _serve_workers(settings)


def _serve_workers(settings: Settings) -> int:
    own_dir = None
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        own_dir = tempfile.mkdtemp(prefix="kvrelay-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = own_dir
    ctx = multiprocessing.get_context("spawn")

    def make_worker(index: int) -> SpawnProcess:
        return ctx.Process(
            target=run_worker, args=(settings, True, os.getpid()), name=f"kvrelay-worker-{index}"
        )

    supervisor = Supervisor(settings.workers, make_worker)
    log.info("starting %d workers sharing port %d", settings.workers, settings.port)
    try:
        return supervisor.run()
    finally:
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
