"""Proxy settings: one pydantic-settings model, read from `KVRELAY_*` env vars, an optional
`.env` file and `kvrelay serve --flag` options (flags win over env, env over `.env`).

Every field here is a documented knob: the Helm chart generates its env-var table from this
model, and `kvrelay serve --help` lists the same names as flags. List settings accept a JSON
array or a comma-separated string in the environment. Invalid values stop the proxy at start-up
with a message that names the setting (`SettingsError`).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kvrelay.proxy.config.specs import parse_dns_spec, parse_limit

ENV_PREFIX = "KVRELAY_"

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
LogFormat = Literal["text", "json"]  # kvrelay.proxy.telemetry.logs
TracingMode = Literal["auto", "on", "off"]  # kvrelay.proxy.telemetry.tracing
RoutingPolicy = Literal["always_p", "affinity", "conditional"]
CacheIsolation = Literal["tenant", "shared"]  # kvrelay.proxy.tenants.cache_scope
_TENANT_ID = re.compile(r"t[0-9a-f]{24}|anonymous")


class SettingsError(ValueError):
    """Configuration that cannot run; the message names the offending setting."""


def _split_list(value: Any) -> Any:
    """Env values arrive as one string: accept a JSON array or comma-separated items."""
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        if text.startswith("["):
            return json.loads(text)
        return [item.strip() for item in text.split(",") if item.strip()]
    return value


def _check_host_port(addr: str, what: str) -> None:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} is not host:port")


def _check_tenant_id(tenant: str) -> None:
    # A tenant id, never an API key: keys are secrets and must not sit in plain config.
    if not _TENANT_ID.fullmatch(tenant):
        raise ValueError(
            "keys must be tenant ids (t + 24 hex digits, from `kvrelay tenant-id`), not API keys"
        )


def _check_no_repeats(keys: list[str], what: str) -> None:
    if len(set(keys)) != len(keys):
        raise ValueError(f"the same {what} is listed twice")


def _split_mapping(value: Any) -> Any:
    """`url=host:port,url=host:port` or a JSON object."""
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return {}
        if text.startswith("{"):
            return json.loads(text)
        out: dict[str, str] = {}
        for item in text.split(","):
            if not item.strip():
                continue
            key, sep, val = item.partition("=")
            if not sep:
                raise ValueError(f"expected URL=HOST:PORT, got {item.strip()!r}")
            out[key.strip()] = val.strip()
        return out
    return value


def normalize_backend_url(url: str) -> str:
    """Validate an engine base URL (`http://host:port`) and drop any trailing slash."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s)://host:port URL")
    try:
        _ = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r} has an invalid port") from exc
    return url.strip().rstrip("/")


BackendList = Annotated[list[str], NoDecode]

DEFAULT_PASSTHROUGH_ROUTES = ("/v1/embeddings", "/v1/responses", "/tokenize", "/detokenize")
# Routes the proxy answers itself: a pass-through route may not shadow them.
OWN_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/health",
    "/ready",
    "/metrics",
    "/openapi.json",
    "/version",
)


# Headers `forward_headers` may not name: credentials (the client's key stays at the proxy),
# hop-by-hop and body framing, and what the proxy sets on engine requests itself.
NOT_FORWARDED_HEADERS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "x-admin-key",
        "cookie",
        "host",
        "content-length",
        "content-type",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "x-request-id",
        "traceparent",
        "tracestate",
        "baggage",
        "accept-encoding",
    }
)
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")


class Settings(BaseSettings):
    """All proxy settings. Field name = CLI flag (`--first-byte-timeout`) = env var
    (`KVRELAY_FIRST_BYTE_TIMEOUT`)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        validate_default=True,
    )

    # Fleet -----------------------------------------------------------------------------
    prefill: BackendList = Field(
        default_factory=list, description="Prefill (P) engine base URLs, e.g. http://p0:8000."
    )
    decode: BackendList = Field(
        default_factory=list, description="Decode (D) engine base URLs, e.g. http://d0:8000."
    )
    side_channels: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description=(
            "Engine URL -> side-channel host:port, for engines whose side channel is not yet "
            "known from the kv_transfer_params they returned (streamed responses)."
        ),
    )
    # Conversation map ---------------------------------------------------------------------
    map_url: str = Field(
        default="memory://",
        description=(
            "Conversation map: memory://?max_entries=N, redis://host:port/db, "
            "redis+sentinel://s1:26379,s2:26379/service or redis+cluster://n1:6379,n2:6379."
        ),
    )
    # Listener -----------------------------------------------------------------------------
    host: str = Field(default="0.0.0.0", description="Listen address.")
    port: int = Field(default=8000, ge=1, le=65535, description="Listen port.")
    workers: int = Field(
        default=1, ge=1, le=256, description="Worker processes sharing the port (SO_REUSEPORT)."
    )
    # Security -----------------------------------------------------------------------------
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Accepted client API keys (Bearer); empty = open. Each key is a tenant.",
    )
    admin_key: SecretStr | None = Field(
        default=None, description="Key for /admin endpoints; unset = admin API disabled."
    )
    connector_secret: SecretStr | None = Field(
        default=None,
        description="Shared HMAC secret of the engines' side channels (release, finished).",
    )
    metrics_key: SecretStr | None = Field(
        default=None,
        description="Key (Bearer) that /metrics requires; unset = /metrics is open.",
    )
    cache_isolation: CacheIsolation = Field(
        default="tenant",
        description=(
            "tenant: each API key's requests carry their own vLLM cache_salt (set by the "
            "proxy, the client's own folded in), so no tenant reuses, or learns from hit "
            "counts, another's prompts; shared: one prefix cache for all (the client's "
            "cache_salt passes as sent)."
        ),
    )
    cache_share_groups: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description=(
            "With cache_isolation tenant: tenant id -> group name; tenants of one group share "
            "one prefix cache (e.g. `t3f9...=team-a,t08c...=team-a`)."
        ),
    )
    # Timeouts and retries ---------------------------------------------------------------
    connect_timeout: float = Field(
        default=2.0, gt=0, description="Seconds to connect to an engine, per leg."
    )
    first_byte_timeout: float = Field(
        default=60.0, gt=0, description="Seconds until an engine's response headers, per leg."
    )
    total_timeout: float = Field(
        default=600.0, gt=0, description="Seconds for a whole leg including the stream."
    )
    retries: int = Field(
        default=1, ge=0, le=10, description="Extra attempts on another engine, per leg."
    )
    side_channel_timeout: float = Field(
        default=2.0, gt=0, description="Seconds for a side-channel call (release, finished)."
    )
    body_limit_bytes: int = Field(
        default=8 * 1024 * 1024, ge=1024, description="Largest accepted request body."
    )
    # Hostile input ------------------------------------------------------------------------
    body_read_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a client may take to send a whole request body (then 408, closed).",
    )
    inflight_body_bytes: int = Field(
        default=128 * 1024 * 1024,
        ge=1024,
        description=(
            "Bytes all request bodies being received or served may hold together, per worker "
            "process, counting each JSON body's bytes plus a bound on its parsed objects; a "
            "body that does not fit is answered 503, one that never could 413."
        ),
    )
    json_max_depth: int = Field(
        default=64,
        ge=4,
        le=512,
        description="Deepest nesting of arrays and objects accepted in a JSON request body.",
    )
    tenant_failure_limit: int = Field(
        default=5,
        ge=0,
        description=(
            "Requests of one API key that made every engine tried fail (5xx) within "
            "tenant_cooldown_s, after which that key gets 429 for tenant_cooldown_s; 0 = off."
        ),
    )
    tenant_cooldown_s: float = Field(
        default=60.0,
        gt=0,
        description="Window and pause of the per-API-key breaker (tenant_failure_limit).",
    )
    engine_5xx_window_s: float = Field(
        default=60.0,
        gt=0,
        description=(
            "Seconds in which 5xx answers that no other engine contradicted count against an "
            "engine, and only once they come from at least two API keys."
        ),
    )
    # Per-tenant limits (proxy/limits.py) ------------------------------------------------
    tenant_max_inflight: int = Field(
        default=0,
        ge=0,
        description=(
            "Requests one API key may have in flight at once, over all workers and replicas "
            "when the map is Redis (else per process); more get 429; 0 = unlimited."
        ),
    )
    tenant_rps: float = Field(
        default=0.0,
        ge=0,
        description=(
            "Requests per second one API key may start (token bucket, shared like "
            "tenant_max_inflight); more get 429 with Retry-After; 0 = unlimited."
        ),
    )
    tenant_burst: int = Field(
        default=0,
        ge=0,
        description=(
            "Requests an idle API key may start at once under tenant_rps (bucket size); "
            "0 = tenant_rps rounded up (at least 1)."
        ),
    )
    tenant_limits: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description=(
            "Per-key overrides: tenant id (`kvrelay tenant-id` prints a key's) -> "
            "`inflight=N;rps=R;burst=B` (any of the three; 0 = unlimited), e.g. "
            "`t3f9...=inflight=4;rps=2`."
        ),
    )
    tenant_slot_lease_s: float = Field(
        default=30.0,
        ge=1,
        description=(
            "With Redis: an in-flight slot expires this long after its worker last renewed it "
            "(every third of it), so a crashed worker's slots come back."
        ),
    )
    # Pass-through routes (proxy/passthrough.py) ------------------------------------------
    passthrough_routes: BackendList = Field(
        default_factory=lambda: list(DEFAULT_PASSTHROUGH_ROUTES),
        description=(
            "Engine routes forwarded as they are (no disaggregation), with the proxy's auth, "
            "limits, timeouts and engine choice; any HTTP method."
        ),
    )
    forward_headers: BackendList = Field(
        default_factory=list,
        description=(
            "Client request headers passed on to the engines (both legs, pass-through routes), "
            "e.g. X-Session-ID; none by default: engines get only X-Request-Id and the trace "
            "context. Credentials and the headers the proxy sets itself are refused."
        ),
    )
    passthrough_pool: Literal["decode", "prefill"] = Field(
        default="decode", description="Engine pool that serves pass-through routes."
    )
    models_refresh_s: float = Field(
        default=10.0,
        gt=0,
        description=(
            "Seconds the fleet's model list is cached (/v1/models, the unknown-model 404)."
        ),
    )
    # Reuse --------------------------------------------------------------------------------
    entry_safety_margin_s: float = Field(
        default=5.0, ge=0, description="Never use held blocks this close to their expiry."
    )
    conversation_ttl_s: float = Field(
        default=600.0, gt=0, description="How long a conversation's entry stays in the map."
    )
    fingerprint_conversations: bool = Field(
        default=True,
        description="Match chat requests without a conversation id by message history.",
    )
    stock_vllm_reuse: bool = Field(
        default=False,
        description=(
            "Reuse D's blocks from engines without block hashes (stock vLLM); caps pulled "
            "tokens at the previous turn's prompt tokens."
        ),
    )
    # Health and routing -------------------------------------------------------------------
    probe_interval_s: float = Field(
        default=2.0, gt=0, description="Seconds between health probes of each engine."
    )
    probe_timeout_s: float = Field(default=1.0, gt=0, description="Timeout of one probe.")
    eject_after_failures: int = Field(
        default=3, ge=1, description="Consecutive failures that take an engine out of its pool."
    )
    readmit_after_successes: int = Field(
        default=2, ge=1, description="Consecutive probe successes that bring it back."
    )
    decode_overload_inflight: int = Field(
        default=64,
        ge=1,
        description="In-flight requests above which D affinity yields to the least loaded D.",
    )
    # Multi-turn routing (fleet/routing.py, fleet/engine_load.py; docs/OPERATIONS.md "Routing
    # policy") ---------------------------------------------------------------------------
    routing_policy: RoutingPolicy = Field(
        default="conditional",
        description=(
            "How a conversation's turn is routed: always_p (every turn P then D), affinity "
            "(P leg to the P of the previous turn) or conditional (affinity, and a short "
            "follow-up goes straight to the D that holds the conversation, no P, no transfer)."
        ),
    )
    prefill_overload_inflight: int = Field(
        default=16,
        ge=1,
        description="In-flight requests above which P affinity yields to the normal choice.",
    )
    conditional_max_uncached_tokens: int = Field(
        default=256,
        ge=0,
        description=(
            "conditional: the most prompt tokens D does not hold (estimated from the previous "
            "turn's characters per token) for a turn to skip P."
        ),
    )
    # The four defaults decode_only_cached, prefix_wait_max_s 2, prefill_spill_factor 1 and the
    # connector's hold_max_fraction 0.1 go together: measured on the conversation trace
    # (bench/RESULTS.md, "trace compare (conversation)", runs K and L) they kept reuse at
    # 0.92-0.97 of the LRU bound with D's pool pinned by unused holds at 5-6% (11-16% before),
    # and they are the shared-prefix workload's best configuration.
    decode_only_cached: bool = Field(
        default=True,
        description=(
            "conditional with prefix_routing: a turn with no held history goes straight to a "
            "D whose prefix cache is expected to hold the prompt (the routing-fed index "
            "counts every prompt a D decoded; with kv_events_endpoints, D's own events say "
            "what it caches, prefixes other requests left there included) when the rest is within "
            "conditional_max_uncached_tokens and D's decode-only budget: D's own prefix cache "
            "serves it, nothing pinned; a D whose such turns show no cached tokens is "
            "withdrawn from them for reuse_probe_interval_s."
        ),
    )
    conditional_max_inflight_tokens: int = Field(
        default=4096,
        ge=0,
        description=(
            "conditional: the most prompt tokens a D prefills for decode-only turns at once "
            "(their sum while in flight, a streamed turn's until its first token); beyond it "
            "turns go through P, so a burst of follow-ups does not stall D's decoding."
        ),
    )
    prefill_spill_factor: float = Field(
        default=1.0,
        ge=0,
        description=(
            "conditional: a turn (first turns too) goes straight to a D that is not busy, "
            "which prefills it itself, when P's queued prompt tokens plus the turn's exceed "
            "this many times what D would prefill (its decode-only tokens in flight plus this "
            "turn's), and D's decode-only tokens still to prefill are under "
            "prefill_spill_max_inflight_tokens (0: never)."
        ),
    )
    prefill_spill_max_inflight_tokens: int = Field(
        default=32768,
        ge=0,
        description=(
            "conditional: a D takes a spilled turn only while the prompt tokens it still has "
            "to prefill for decode-only turns are under this, and no more than this with the "
            "turn's own (a spilled first turn is a whole prompt; this bounds how much of D's "
            "decoding waits on prefill: a longer prompt goes through P)."
        ),
    )
    prefill_spill_max_inter_token_ms: float = Field(
        default=0.0,
        ge=0,
        description=(
            "conditional: a D takes no spilled turn while its decodes ran slower than this "
            "between its last two load readings (mean gap between output tokens, from its "
            "vllm:inter_token_latency_seconds), so prefill moved onto D stays within a "
            "time-per-output-token target (0: no bound; needs load_poll_interval_s)."
        ),
    )
    prefill_priority_tokens: int = Field(
        default=0,
        ge=0,
        description=(
            "A turn's request to P carries a vLLM priority: the prompt tokens P is expected to "
            "compute (those of a held history it pulls left out) over this many, rounded down, "
            "so a P started with --scheduling-policy priority admits shorter prefills ahead of "
            "longer ones queued (0: no priority is set; a client's own priority passes through "
            "to P unchanged). On, it replaces the client's priority on P's request only."
        ),
    )
    prefix_routing: bool = Field(
        default=True,
        description=(
            "Choose each turn's P by the prompt prefix its prefix cache is expected to hold "
            "(an index fed by the turns this worker routed: a shared system prompt, tools, a "
            "document, a conversation's history) weighed against its queued prompt work; off: "
            "the least loaded P, or the conversation's previous P."
        ),
    )
    prefix_index_ttl_s: float = Field(
        default=600.0,
        gt=0,
        description=(
            "prefix_routing: how long a prompt a P prefilled counts as still in its prefix "
            "cache (the cache turns over under memory pressure; recorded again on each use)."
        ),
    )
    prefix_index_max_entries: int = Field(
        default=200_000,
        ge=1,
        description=(
            "prefix_routing: prompt prefixes a worker's index keeps (about 420 bytes each), "
            "least recently used forgotten first."
        ),
    )
    kv_events_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description=(
            "prefix_routing from the engines' own KV cache events: the port each P and D "
            "publishes them on (vLLM's --kv-events-config endpoint, e.g. 5557), on the host of "
            "its URL; 0: only the engines in kv_events_endpoints. Events make the index exact "
            "(what an engine evicted is known); the prompt is then tokenized by a P's /tokenize "
            "for the lookup. A D's events let a P pull a history from D's cache (prefix_pull)."
        ),
    )
    kv_events_endpoints: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description=(
            "Engine URL (P or D) -> its KV events endpoint (tcp://host:port), for engines not "
            "at kv_events_port on their own host."
        ),
    )
    kv_events_replay_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description=(
            "The port each engine answers KV event replay requests on (vLLM's "
            "--kv-events-config replay_endpoint, e.g. 5558), on the host of its URL; 0: only "
            "the engines in kv_events_replay_endpoints. With replay, the events an engine "
            "published before this proxy subscribed (as many as its buffer_steps keeps) and "
            "those lost in a gap are asked for again instead of the engine being forgotten."
        ),
    )
    kv_events_replay_endpoints: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description=(
            "Engine URL (P or D) -> its KV event replay endpoint (tcp://host:port), for "
            "engines not at kv_events_replay_port on their own host."
        ),
    )
    kv_events_max_blocks: int = Field(
        default=2_000_000,
        ge=1,
        description=(
            "(engine, block) pairs the KV-events index keeps (about 200 bytes each); over "
            "it, the oldest reported blocks of the engines holding the most are forgotten, "
            "down to 1/64 under it."
        ),
    )
    prefix_pull: bool = Field(
        default=True,
        description=(
            "With KV events: when the engine whose cache holds a prompt's prefix (another P, "
            "or a D that decoded it: a history no hold names) is not where the turn would be "
            "done first, the P that would be pulls that prefix from it over NIXL instead of "
            "computing it. The holder keeps the prefix for the pull through a one-token "
            "request of its own (a pin); the engines should run --scheduling-policy "
            "priority, so a pin does not wait in the holder's queue. With or without "
            "events, a turn spilled to a D other than the conversation's holder reads the "
            "held history from the holder (no pin: the hold keeps it) where that costs less "
            "than computing it."
        ),
    )
    prefix_pull_min_tokens: int = Field(
        default=256,
        ge=1,
        description=(
            "prefix_pull: the fewest prefix tokens worth a pin and a pull (fewer are computed)."
        ),
    )
    prefill_step_tokens: int = Field(
        default=8192,
        ge=1,
        description=(
            "prefix_pull: the prompt tokens one P engine step computes (its vLLM "
            "--max-num-batched-tokens; 8192 is vLLM's online default on H100/H200). A pin waits "
            "at most for the holder's current step, so a pull is weighed with that wait."
        ),
    )
    prefix_pull_priority: int = Field(
        default=-1,
        description=(
            "prefix_pull: the vLLM request priority of a pin (lower runs earlier under "
            "--scheduling-policy priority; ignored under fcfs)."
        ),
    )
    prefix_wait_max_s: float = Field(
        default=2.0,
        ge=0,
        description=(
            "prefix_routing: a turn whose prompt is mostly a prefix another turn of this "
            "worker is computing now (at least half of it, and prefix_pull_min_tokens) waits "
            "up to this long for that computation, then goes where the prefix is cached, "
            "instead of computing its own copy beside it (0: never waits)."
        ),
    )
    prefix_pull_timeout_s: float = Field(
        default=0.5,
        gt=0,
        description=(
            "prefix_pull: how long a turn waits for the holder's pin; past it the turn's P "
            "computes the prefix, and that holder serves no pulls for four times this, twice "
            "as long after each further late pin in a row, up to reuse_probe_interval_s."
        ),
    )
    hold_min_use: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description=(
            "A tenant's turns stop asking D to hold their blocks while fewer than this share "
            "of its recent holds were read by a next turn (taken, and loaded by P or served "
            "from by the holder: holds that pay nothing pin D's pool); one turn in "
            "1/hold_min_use still holds, to see when that changes (0: always hold)."
        ),
    )
    hold_judge_s: float = Field(
        default=60.0,
        gt=0,
        description=(
            "hold_min_use: how long a hold waits for its next turn before it counts as unused, "
            "for a tenant none of whose holds has been taken yet (once one has: "
            "conversation_ttl_s); a later take still counts as taken. Shorter: a tenant of "
            "one-off requests stops pinning D sooner."
        ),
    )
    hold_brief_s: float = Field(
        default=0.0,
        ge=0,
        description=(
            "A later turn whose conversation came back sooner than this since its last turn "
            "(an agent's loop) has D asked to keep its hold over D's hold_max_fraction as a "
            "brief hold instead of declining it (D keeps it for its hold_brief_lease_s, brief "
            "holds together within its hold_brief_max_fraction of the pool, outside its hold "
            "budget). 0 (the default: at 30 s it cost D's pool and bought no reuse on the "
            "conversation trace, bench/RESULTS.md run AL): such holds are always declined."
        ),
    )
    reuse_probe_interval_s: float = Field(
        default=60.0,
        gt=0,
        description=(
            "A D whose decode-only turns (or a P whose affinity turns) showed no cached "
            "tokens gets no such turns, except one probe turn this often, until it shows "
            "cached tokens again."
        ),
    )
    decode_max_waiting: int = Field(
        default=4,
        ge=0,
        description=(
            "A D with more queued requests (vllm:num_requests_waiting) is busy: no "
            "decode-only turns there, and affinity to it yields."
        ),
    )
    decode_max_kv_usage: float = Field(
        default=0.9,
        ge=0,
        le=1,
        description="A D above this KV-cache usage (vllm:kv_cache_usage_perc, 0..1) is busy.",
    )
    load_poll_interval_s: float = Field(
        default=1.0,
        ge=0,
        description=(
            "Seconds between scrapes of each engine's /metrics for load signals (0: off). "
            "Readings older than 3 intervals are ignored."
        ),
    )
    metrics_backend_urls: bool = Field(
        default=False,
        description=(
            "Label /metrics series with engine URLs instead of role-hash names (engine ids "
            "as in client errors and /admin/backends)."
        ),
    )
    log_level: LogLevel = Field(default="INFO", description="Log level.")
    log_format: LogFormat = Field(
        default="text",
        description=(
            "Log format: text lines, or json (one JSON object per line, plus one summary line "
            "per turn on the kvrelay.turn logger)."
        ),
    )
    tracing: TracingMode = Field(
        default="auto",
        description=(
            "OpenTelemetry traces (needs the otel extra): auto = on when OTEL_TRACES_EXPORTER "
            "names an exporter or an OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT is set; "
            "OTEL_SDK_DISABLED=true always turns them off. Exporter and endpoint come from "
            "the OTEL_* variables."
        ),
    )
    # Fleet sync and discovery (proxy/fleet_sync.py, proxy/discovery/) -------------------
    fleet_sync_interval_s: float = Field(
        default=2.0,
        gt=0,
        description=(
            "With the Redis map: seconds between checks of the shared fleet record (changes "
            "also arrive at once by pub/sub)."
        ),
    )
    prefill_dns: str | None = Field(
        default=None,
        description=(
            "Discover P engines by DNS beside `prefill`: name:port (A/AAAA, e.g. a headless "
            "Service) or an _service._proto.name SRV name."
        ),
    )
    decode_dns: str | None = Field(
        default=None, description="Discover D engines by DNS beside `decode` (as prefill_dns)."
    )
    dns_interval_s: float = Field(
        default=5.0, gt=0, description="Seconds between DNS discovery lookups."
    )
    dns_server: str | None = Field(
        default=None,
        description="DNS server host:port for discovery; unset = the system resolver.",
    )
    discovery_side_channel_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Side-channel port of discovered engines (at the engine's address).",
    )
    prefill_selector: str | None = Field(
        default=None,
        description=(
            "Discover P engines from Kubernetes EndpointSlices with this label selector "
            "(e.g. app=vllm-p); needs the kubernetes extra and list/watch RBAC."
        ),
    )
    decode_selector: str | None = Field(
        default=None, description="Discover D engines from EndpointSlices (as prefill_selector)."
    )
    kube_namespace: str | None = Field(
        default=None,
        description="Namespace of the engines' EndpointSlices; unset = the proxy's own.",
    )
    kube_config: str | None = Field(
        default=None, description="Kubeconfig file; unset = the in-cluster service account."
    )
    kube_port_name: str = Field(
        default="http", description="EndpointSlice port name of the engines' HTTP port."
    )
    kube_side_channel_port_name: str = Field(
        default="side-channel",
        description=(
            "EndpointSlice port name of the connector side channel (else the slice "
            "annotation kvrelay.io/side-channel-port)."
        ),
    )

    @field_validator(
        "prefill", "decode", "api_keys", "passthrough_routes", "forward_headers", mode="before"
    )
    @classmethod
    def _lists(cls, value: Any) -> Any:
        return _split_list(value)

    @field_validator(
        "side_channels",
        "tenant_limits",
        "cache_share_groups",
        "kv_events_endpoints",
        "kv_events_replay_endpoints",
        mode="before",
    )
    @classmethod
    def _mapping(cls, value: Any) -> Any:
        return _split_mapping(value)

    @field_validator("prefill", "decode")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        urls = [normalize_backend_url(u) for u in value]
        _check_no_repeats(urls, "URL")
        return urls

    @field_validator("side_channels")
    @classmethod
    def _side_channels(cls, value: dict[str, str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for url, addr in value.items():
            _check_host_port(addr, f"{addr!r} for {url!r}")
            out[normalize_backend_url(url)] = addr
        return out

    @field_validator("kv_events_endpoints", "kv_events_replay_endpoints")
    @classmethod
    def _kv_events_endpoints(cls, value: dict[str, str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for url, endpoint in value.items():
            if not endpoint.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{endpoint!r} for {url!r} is not a tcp:// or ipc:// endpoint")
            out[normalize_backend_url(url)] = endpoint
        return out

    @field_validator("tenant_limits")
    @classmethod
    def _tenant_limits(cls, value: dict[str, str]) -> dict[str, str]:
        for tenant, spec in value.items():
            _check_tenant_id(tenant)
            parse_limit(spec, where=tenant)
        return value

    @field_validator("cache_share_groups")
    @classmethod
    def _cache_share_groups(cls, value: dict[str, str]) -> dict[str, str]:
        for tenant, group in value.items():
            _check_tenant_id(tenant)
            if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", group):
                raise ValueError(f"group {group!r} of {tenant} is not a name of [A-Za-z0-9._-]")
        return value

    @field_validator("passthrough_routes")
    @classmethod
    def _passthrough_routes(cls, value: list[str]) -> list[str]:
        for route in value:
            if not route.startswith("/") or any(c in route for c in "{}?# "):
                raise ValueError(f"{route!r} is not a plain path such as /v1/embeddings")
            if route in OWN_ROUTES or route.startswith(("/admin", "/v1/conversations")):
                raise ValueError(f"{route!r} is a route the proxy answers itself")
        _check_no_repeats(value, "route")
        return value

    @field_validator("forward_headers")
    @classmethod
    def _forward_headers(cls, value: list[str]) -> list[str]:
        for name in value:
            if not _HEADER_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an HTTP header name")
            if name.lower() in NOT_FORWARDED_HEADERS:
                raise ValueError(f"{name!r} is never forwarded (a credential or the proxy's own)")
        _check_no_repeats([n.lower() for n in value], "header")
        return value

    @field_validator("map_url")
    @classmethod
    def _map_url(cls, value: str) -> str:
        scheme = urlsplit(value).scheme
        schemes = (
            "memory",
            "redis",
            "rediss",
            "redis+sentinel",
            "rediss+sentinel",
            "redis+cluster",
            "rediss+cluster",
        )
        if scheme not in schemes:
            raise ValueError(
                "must start with memory://, redis[s]://, redis[s]+sentinel:// or "
                "redis[s]+cluster://"
            )
        return value

    @field_validator("prefill_dns", "decode_dns")
    @classmethod
    def _dns_spec(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parse_dns_spec(value)
        return value.strip()

    @field_validator("dns_server")
    @classmethod
    def _dns_server(cls, value: str | None) -> str | None:
        if value is None:
            return None
        _check_host_port(value, repr(value))
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("log_format", "tracing", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.first_byte_timeout > self.total_timeout:
            raise ValueError("first_byte_timeout must not exceed total_timeout")
        if any(not k.get_secret_value() for k in self.api_keys):
            raise ValueError("api_keys contains an empty key")
        if self.inflight_body_bytes < self.body_limit_bytes:
            raise ValueError(
                "inflight_body_bytes must be at least body_limit_bytes (one largest body fits)"
            )
        return self

    @property
    def uses_shared_map(self) -> bool:
        """True when the map is shared between processes (Redis)."""
        return not self.map_url.startswith("memory:")

    def check_runnable(self) -> None:
        """Checks that only `serve` needs (a fleet to route to, a shared map for workers)."""
        if not self.decode and not self.discovers("decode"):
            raise SettingsError(
                "setting `decode` (KVRELAY_DECODE / --decode) is empty: give at least one "
                "decode engine URL"
            )
        if not self.prefill and not self.discovers("prefill"):
            raise SettingsError(
                "setting `prefill` (KVRELAY_PREFILL / --prefill) is empty: give at least one "
                "prefill engine URL"
            )
        if self.workers > 1 and not self.uses_shared_map:
            raise SettingsError(
                f"setting `workers` is {self.workers} but `map_url` is {self.map_url!r}: "
                "several workers need the shared Redis map (KVRELAY_MAP_URL=redis://...), "
                "otherwise a conversation's next turn misses on another worker"
            )

    def discovers(self, role: str) -> bool:
        """True when engines of `role` come from a discovery source."""
        if role == "prefill":
            return self.prefill_dns is not None or self.prefill_selector is not None
        return self.decode_dns is not None or self.decode_selector is not None

    def public_dict(self) -> dict[str, Any]:
        """Settings for logs and /admin: secrets reduced to whether they are set."""
        data = self.model_dump(mode="json")
        data["api_keys"] = f"{len(self.api_keys)} key(s)"
        data["admin_key"] = "set" if self.admin_key else "unset"
        data["connector_secret"] = "set" if self.connector_secret else "unset"
        data["metrics_key"] = "set" if self.metrics_key else "unset"
        return data


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def load_settings(
    overrides: dict[str, Any] | None = None, env_file: str | None = ".env"
) -> Settings:
    """Build settings (CLI overrides > env > env file > defaults) or raise `SettingsError`."""
    try:
        return Settings(_env_file=env_file, **(overrides or {}))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = [str(p) for p in err.get("loc", ()) if not isinstance(p, int)]
            name = loc[0] if loc else "settings"
            if name in Settings.model_fields:
                where = f"`{name}` ({env_name(name)} / {flag_name(name)})"
            else:
                where = "settings"
            msg = str(err.get("msg", "invalid"))
            problems.append(f"invalid setting {where}: {msg}")
        raise SettingsError("; ".join(problems)) from None
    except (json.JSONDecodeError, ValueError) as exc:
        raise SettingsError(f"invalid settings: {exc}") from None
