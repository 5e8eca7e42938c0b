"""The simulated fleets the trace comparison (`bench/trace_compare.py`) replays against.

Every system runs on the same simulated hardware: `engines` enginesim engines with one cost
profile, the same KV pool and the same local prefix cache each (vLLM caches prefixes by
default). Disaggregated systems split them into `prefill_engines` P and the rest D; the aggregated
system serves from all of them.

- `kvrelay default`: the proxy's defaults (since 2026-12-01 with `decode_only_cached` on,
  `prefix_wait_max_s` 2, `prefill_spill_factor` 1 and the connector's `hold_max_fraction` 0.1);
  `kvrelay previous default` (the defaults before: those three at off, 0 and 2, D's one hold
  uncapped); `kvrelay always_p`; `kvrelay holds off` (the default
  policy, D's hold lease cut to `HOLDS_OFF_LEASE_S`, so nothing D keeps for a conversation
  outlives its turn: what holding buys is the difference to `kvrelay`); `kvrelay always hold`
  (every turn that can continue holds: `hold_min_use` 0); `kvrelay long spills` (a D takes
  spilled turns up to 128k prompt tokens still to prefill, `prefill_spill_max_inflight_tokens`
  131072, so a prompt over the default's 32k no longer waits for P); `kvrelay shorter first`
  and its holds-off variant (`prefill_priority_tokens` 1024: P's requests carry a priority by
  the tokens P computes, the Ps started with `--scheduling-policy priority`, so a short prompt
  queued on P goes ahead of the longer ones); `kvrelay load routing`
  (P by load and conversation affinity, every turn holding: the default before prefix routing
  and `hold_min_use`); `kvrelay kv events` (the default, its P chosen by the Ps' own KV cache
  events: each P started with `--kv-events-config` and `--scheduling-policy priority`, the
  proxy with `kv_events_endpoints`; a P pulls a prefix another P caches: `prefix_pull`);
  `kvrelay kv events no pull` (the same with `prefix_pull` off: each P computes what it lacks);
  `kvrelay kv events holds off` (the same with D's holds off, as `kvrelay holds off`);
  the steps that led to the default, each the previous default with what its label adds:
  `kvrelay decode-only cached` (`decode_only_cached`: a turn with no held
  history goes decode-only to the D whose prefix cache is expected to hold it) and its holds-off
  variant; `kvrelay kv events decode-only cached` (both: D's events, too, say what its cache
  holds, so a request sharing a prefix a D cached goes to that D alone, as aggregated serving
  would send it); `kvrelay kv events prefix wait` (the same, and a turn sharing most of its
  prompt with one whose engine is computing it waits for that, `prefix_wait_max_s` 2 s) and
  its holds-off variant; `kvrelay kv events prefix wait spill 1` (the same with
  `prefill_spill_factor` 1: a turn spills to a D once P's queue is as long as D's, instead of
  twice as long) and its holds-off variant; `kvrelay kv events prefix wait spill 1 hold max
  0.1` (the same with each D's `hold_max_fraction` at its hold budget's share, 0.1: a turn
  larger than that is not held, its blocks left to D's prefix cache, which D's events report
  and the routing follows); `kvrelay prefix wait spill 1 hold max 0.1` (the same without
  the engines' events: the routing-fed index of the prompts each D decoded says what its cache
  holds; these last two are the defaults' settings, spelt out);
- `vllm-router cache_aware P/D` (its defaults), `... cache_aware tuned P/D` (load balancing
  that engages: `--balance-abs-threshold 4 --balance-rel-threshold 1.2`; at the defaults, 64
  and 1.5, a few P never differ by 64 requests and cache_aware ignores their load),
  `... power_of_two P/D` (the load-aware policy) and `... round_robin P/D` (its NIXL P/D mode);
- `aggregated cache_aware`, `aggregated cache_aware tuned` and `aggregated power_of_two`: every
  engine serves whole requests, vllm-router in front (what many operators run today).

Each P/D system runs at a P:D split of the comparison's choosing (`split`).

Leases. D's hold lease is the one a think time races against, so it is scaled with time
(`trace_replay.scaled_settings`); P's lease only covers P -> D pulls of the same turn, so P
keeps the connector's unscaled default (a scaled P lease of a few seconds would expire under
queueing and turn pulls into recomputation, which production would not see).

`EngineSampler` reads every engine's `/metrics` while a replay runs: D's blocks held for
remote readers over time (`enginesim_blocks_held_for_remote`) and each D's queue, and at the
start and end the engines' own prompt token counters (`vllm:prompt_tokens_by_source`), so reuse
is counted by the engines, not by the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench import _common as c
from bench import trace_replay
from kvrelay.devtools import ServerProcess, free_port, http_ready, kv_events_args
from kvrelay.enginesim.costs import DEFAULT_TRANSFER_LAYOUT
from kvrelay.prometheus_text import bucket_counts, parse_samples, series_sum

# enginesim's KV tensors: one layer, one KV head of 8 values. The cost profile models the
# real model's time and block count; these only size the bytes NIXL really moves, and keep
# the per-token KV synthesis (most of enginesim's CPU per prompt token) small.
TINY_GEOMETRY = ("--num-layers", "1", "--num-kv-heads", "1", "--head-size", "8")
HOLDS_OFF_LEASE_S = 0.05  # shorter than any turn's decode: D's holds end with the turn
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# Every prompt token an engine computed in prefill, recomputation after preemption included.
GPU_PREFILL = "prefill_tokens_computed"
# enginesim's modelled step time, and the time its thread fell behind that and never made up:
# how far the host's CPU, not the modelled GPU, set the engines' pace.
MODELLED_STEP = "modelled_step_seconds"
BEHIND_MODEL = "behind_model_seconds"
ENGINE_COUNTERS = (*PROMPT_SOURCES, GPU_PREFILL, MODELLED_STEP, BEHIND_MODEL)
GIVEN_BACK = 'kvrelay_hold_decisions_total{decision="released"}'
# Holds a next turn took, as the engines' reports judged them: read (loaded by P or served from
# by the holder) or not (kvrelay's evidence for `hold_min_use`).
HOLDS_TAKEN = {
    "holds_read": 'kvrelay_hold_decisions_total{decision="read"}',
    "holds_unread": 'kvrelay_hold_decisions_total{decision="unread"}',
    # Read, but sooner than the holder's cache keeps an unused block (D's residency histogram).
    "holds_cache_kept": 'kvrelay_hold_decisions_total{decision="cache_kept"}',
    # Turns that asked D to hold, and those that did not (their tenant's holds did not pay).
    "holds_kept": 'kvrelay_hold_decisions_total{decision="kept"}',
    "holds_probe": 'kvrelay_hold_decisions_total{decision="probe"}',
    "holds_declined": 'kvrelay_hold_decisions_total{decision="declined"}',
    # Turns that did not ask: their conversation came back sooner than its D's cache keeps.
    "holds_cache_keeps": 'kvrelay_hold_decisions_total{decision="cache_keeps"}',
}
# D's residency histogram (vLLM's name), summed over the Ds: how long their caches kept an
# unused block, for the record beside the holds.
IDLE_BEFORE_EVICT = "vllm:kv_block_idle_before_evict_seconds"
# Reads of a held history by another engine (P, or a spilled turn's D), as the readers
# reported them: found, or gone (the holder had ended the hold; `HeldReads`).
HELD_READS = {
    "held_found": 'kvrelay_held_reads_total{result="found"}',
    "held_gone": 'kvrelay_held_reads_total{result="gone"}',
}
D_HOLDS = {
    "enginesim_connector_holds_over_budget": "d_holds_declined",
    "enginesim_connector_holds_brief": "d_holds_brief",
}
PULLS = "kvrelay_prefix_pulls_total"
PULL_RESULTS = ("pinned", "pulled", "not_pulled", "pin_failed", "pin_timeout")
LEGS = ("prefill", "decode")  # the leg that pulled: a turn's P, or a spilled turn's D
PULLED_TOKENS = "kvrelay_prefix_pulled_tokens_total"
PINS = "kvrelay_prefix_pins_total"
# From a pin's request to the holder's answer, by the holder's pool (a histogram).
PIN_SECONDS = "kvrelay_prefix_pin_seconds"
PREFILL_PACE = "kvrelay_prefill_pace_tokens_per_second"
# Turns that waited for another turn computing most of their prompt (`prefix_wait_max_s`):
# it computed it in time, or the wait ran out.
PREFIX_WAITS = {
    "prefix_waits_computed": 'kvrelay_prefix_waits_total{result="computed"}',
    "prefix_waits_timeout": 'kvrelay_prefix_waits_total{result="timeout"}',
}


@dataclass(frozen=True)
class System:
    """One system of the comparison: how its front is started and its engines split."""

    label: str
    front: str  # "kvrelay", "vllm-router-pd" or "vllm-router"
    policy: str  # kvrelay routing_policy or vllm-router policy
    holds: bool = True  # D's holds on (kvrelay only)
    router_args: tuple[str, ...] = ()  # vllm-router tuning flags
    proxy_settings: tuple[tuple[str, str], ...] = ()  # kvrelay settings, as environment
    kv_events: bool = False  # the Ps publish KV cache events, the proxy follows them
    # Share of a D's pool one hold may pin (its `hold_max_fraction`; None: the hardware's).
    d_hold_max: float | None = None
    # The proxy's `hold_brief_s` in unscaled seconds (0: the default's), divided by the time
    # scale as the other think-time settings are.
    brief_s: float = 0.0

    @property
    def disaggregated(self) -> bool:
        return self.front != "vllm-router"


# vllm-router's cache_aware balances load only past both thresholds (defaults 64 and 1.5).
BALANCED = ("--balance-abs-threshold", "4", "--balance-rel-threshold", "1.2")

ALWAYS_HOLD = ("KVRELAY_HOLD_MIN_USE", "0")
CACHED = ("KVRELAY_DECODE_ONLY_CACHED", "true")
# A turn sharing most of its prompt with one being computed waits for it, up to 2 s (a long
# prompt's prefill on a loaded engine).
PREFIX_WAIT = ("KVRELAY_PREFIX_WAIT_MAX_S", "2")
# A turn spills to a D once P's queued prompt work is as long as D's (the default since
# 2026-12-01; before, twice as long, sparing D's decodes the prefill).
SPILL_1 = ("KVRELAY_PREFILL_SPILL_FACTOR", "1")
# Long prompts spill too: a D takes spilled turns up to 128k prompt tokens still to prefill (a
# D's whole pool at the comparison's scale) instead of 32k, so a prompt over 32k tokens no
# longer waits for P's queue whatever its length.
SPILL_LONG = ("KVRELAY_PREFILL_SPILL_MAX_INFLIGHT_TOKENS", "131072")
# Shorter prefills first on P: a level of P's request priority per 1024 tokens it computes (the
# Ps then started with `--scheduling-policy priority`).
SHORTER_FIRST = ("KVRELAY_PREFILL_PRIORITY_TOKENS", "1024")

# The defaults before 2026-12-01 (decode_only_cached off, no prefix wait, spill factor 2; D's
# one hold uncapped), so the systems that name a step from them keep measuring that step.
BEFORE_BUNDLE = (
    ("KVRELAY_DECODE_ONLY_CACHED", "false"),
    ("KVRELAY_PREFIX_WAIT_MAX_S", "0"),
    ("KVRELAY_PREFILL_SPILL_FACTOR", "2"),
)


def _stepping_stone(
    label: str,
    settings: tuple[tuple[str, str], ...],
    *,
    holds: bool = True,
    kv_events: bool = False,
    d_hold_max: float = 1.0,
) -> System:
    """kvrelay at the defaults before 2026-12-01 with `settings` on top (later pairs win)."""
    return System(
        label,
        "kvrelay",
        "default",
        holds=holds,
        proxy_settings=BEFORE_BUNDLE + settings,
        kv_events=kv_events,
        d_hold_max=d_hold_max,
    )


SYSTEMS: tuple[System, ...] = (
    System("kvrelay default", "kvrelay", "default"),
    System(
        "kvrelay previous default",
        "kvrelay",
        "default",
        proxy_settings=BEFORE_BUNDLE,
        d_hold_max=1.0,
    ),
    System("kvrelay always_p", "kvrelay", "always_p"),
    System("kvrelay holds off", "kvrelay", "default", holds=False),
    System("kvrelay always hold", "kvrelay", "default", proxy_settings=(ALWAYS_HOLD,)),
    System("kvrelay long spills", "kvrelay", "default", proxy_settings=(SPILL_LONG,)),
    System("kvrelay shorter first", "kvrelay", "default", proxy_settings=(SHORTER_FIRST,)),
    System(
        "kvrelay shorter first holds off",
        "kvrelay",
        "default",
        holds=False,
        proxy_settings=(SHORTER_FIRST,),
    ),
    # Brief holds: a later turn back within 30 s (unscaled) since its last turn keeps a history
    # over D's hold_max_fraction as a brief hold (the default for run AL only).
    System("kvrelay brief holds", "kvrelay", "default", brief_s=30.0),
    System("kvrelay kv events", "kvrelay", "default", kv_events=True),
    # The same system under a second label: run against it, an A/A check of the comparison
    # (any difference between the two is the bench's, not kvrelay's).
    System("kvrelay kv events again", "kvrelay", "default", kv_events=True),
    System("kvrelay kv events holds off", "kvrelay", "default", holds=False, kv_events=True),
    System(
        "kvrelay kv events no pull",
        "kvrelay",
        "default",
        proxy_settings=(("KVRELAY_PREFIX_PULL", "false"),),
        kv_events=True,
    ),
    # The steps that led to the default (each the previous default and what its label adds).
    _stepping_stone("kvrelay decode-only cached", (CACHED,)),
    _stepping_stone("kvrelay decode-only cached holds off", (CACHED,), holds=False),
    _stepping_stone("kvrelay kv events decode-only cached", (CACHED,), kv_events=True),
    _stepping_stone("kvrelay kv events prefix wait", (CACHED, PREFIX_WAIT), kv_events=True),
    _stepping_stone(
        "kvrelay kv events prefix wait holds off",
        (CACHED, PREFIX_WAIT),
        holds=False,
        kv_events=True,
    ),
    _stepping_stone(
        "kvrelay kv events prefix wait spill 1", (CACHED, PREFIX_WAIT, SPILL_1), kv_events=True
    ),
    _stepping_stone(
        "kvrelay kv events prefix wait spill 1 holds off",
        (CACHED, PREFIX_WAIT, SPILL_1),
        holds=False,
        kv_events=True,
    ),
    _stepping_stone(
        "kvrelay kv events prefix wait spill 1 hold max 0.1",
        (CACHED, PREFIX_WAIT, SPILL_1),
        kv_events=True,
        d_hold_max=0.1,
    ),
    _stepping_stone(
        "kvrelay prefix wait spill 1 hold max 0.1",
        (CACHED, PREFIX_WAIT, SPILL_1),
        d_hold_max=0.1,
    ),
    _stepping_stone("kvrelay load routing", (ALWAYS_HOLD, ("KVRELAY_PREFIX_ROUTING", "false"))),
    System("vllm-router cache_aware P/D", "vllm-router-pd", "cache_aware"),
    System("vllm-router cache_aware tuned P/D", "vllm-router-pd", "cache_aware", True, BALANCED),
    System("vllm-router power_of_two P/D", "vllm-router-pd", "power_of_two"),
    System("vllm-router round_robin P/D", "vllm-router-pd", "round_robin"),
    System("aggregated cache_aware", "vllm-router", "cache_aware"),
    System("aggregated cache_aware tuned", "vllm-router", "cache_aware", True, BALANCED),
    System("aggregated power_of_two", "vllm-router", "power_of_two"),
)


def system_by_label(label: str) -> System:
    for s in SYSTEMS:
        if s.label == label:
            return s
    raise ValueError(f"unknown system {label!r} (known: {', '.join(s.label for s in SYSTEMS)})")


@dataclass(frozen=True)
class Hardware:
    """The simulated GPUs every system gets: count, cost profile, link and KV share."""

    engines: int
    prefill_engines: int  # of `engines`, for the P/D systems
    profile: str
    kv_link: str
    kv_scale: float
    unscaled_lease_s: float  # the connector's hold lease in trace (production) time
    # Share of each engine's KV pool its holds may pin (None: the connector's default).
    hold_budget: float | None = None
    # Share of it one hold may pin (None: the connector's default, 1.0).
    hold_max: float | None = None
    # How the modelled GPUs' caches are registered for KV transfers (enginesim's
    # `--kv-transfer-layout`): block-major, as the connector asks vLLM for on a GPU.
    kv_transfer_layout: str = DEFAULT_TRANSFER_LAYOUT

    def pool_blocks(self) -> int:
        """KV blocks of one engine (enginesim's rule for `--cost-profile` with `--kv-scale`)."""
        from kvrelay.enginesim.costs import get_profile

        return max(1, round(get_profile(self.profile).num_blocks() * self.kv_scale))

    def block_size(self) -> int:
        from kvrelay.enginesim.costs import get_profile

        return get_profile(self.profile).block_size

    def fleet_trace_blocks(self, trace_block_tokens: int = 512) -> int:
        """The fleet's KV memory in the trace's blocks: the LRU bound's capacity."""
        return self.engines * self.pool_blocks() * self.block_size() // trace_block_tokens


D_RESIDENCY_SAMPLE = 0.05


def engine_args(hw: Hardware, lease_s: float, hold_max: float | None = None) -> list[str]:
    """enginesim flags of one engine of `hw` whose hold lease is `lease_s` (replay seconds)
    and whose one hold may pin `hold_max` of its pool (None: `hw.hold_max`)."""
    hold_max = hw.hold_max if hold_max is None else hold_max
    return [
        "--cost-profile", hw.profile,
        "--kv-link", hw.kv_link,
        "--kv-transfer-layout", hw.kv_transfer_layout,
        "--kv-scale", f"{hw.kv_scale:g}",
        "--enable-prefix-caching",
        "--lease-seconds", f"{lease_s:g}",
        *(["--hold-budget-fraction", f"{hw.hold_budget:g}"] if hw.hold_budget else []),
        *(["--hold-max-fraction", f"{hold_max:g}"] if hold_max else []),
        "--enable-prompt-tokens-details",
        # Prompts encoded beside the engine, as vLLM's API server does: a router's /tokenize
        # then never holds up the modelled steps (bench/RESULTS.md, run O).
        "--tokenizer-process",
        "--log-level", "WARNING",
        *TINY_GEOMETRY,
    ]  # fmt: skip


def roles(system: System, hw: Hardware, time_scale: float) -> list[tuple[str, list[str]]]:
    """(role, enginesim flags) per engine: P then D, or all `both` when aggregated."""
    scaled = hw.unscaled_lease_s / time_scale
    if system.front == "vllm-router":
        return [("both", engine_args(hw, scaled)) for _ in range(hw.engines)]
    n_p = hw.prefill_engines
    d_lease = scaled if system.holds else HOLDS_OFF_LEASE_S
    p_args = [engine_args(hw, hw.unscaled_lease_s) for _ in range(n_p)]
    d_args = [engine_args(hw, d_lease, system.d_hold_max) for _ in range(hw.engines - n_p)]
    brief = trace_replay.brief_lease_s(time_scale)
    for args in d_args:
        args += ["--hold-brief-lease-s", f"{brief:g}"]
        # D reports how long its cache keeps an unused block (vLLM's residency histogram), which
        # the proxy weighs holds against; a twentieth of the blocks sampled (vLLM's default is
        # a hundredth) for enough evictions within a replay of a few minutes.
        args += ["--kv-cache-metrics", "--kv-cache-metrics-sample", str(D_RESIDENCY_SAMPLE)]
    if system.kv_events:
        for args in (*p_args, *d_args):
            args += kv_events_args(free_port())
            # kvrelay's deployment with events: pins go ahead of the queue (prefix_pull), on a
            # P or on a D whose cache a P pulls a history from.
            args += ["--scheduling-policy", "priority"]
    elif any(name == SHORTER_FIRST[0] for name, _ in system.proxy_settings):
        for args in p_args:
            args += ["--scheduling-policy", "priority"]  # what the proxy's priorities need
    return [("prefill", args) for args in p_args] + [("decode", args) for args in d_args]


def events_endpoints(engines: Sequence[c.Engine], wanted: Sequence[list[str]]) -> str:
    """`kv_events_endpoints` for engines started with `wanted` flags, in the same order."""
    pairs = []
    for engine, args in zip(engines, wanted, strict=True):
        config = json.loads(args[args.index("--kv-events-config") + 1])
        port = config["endpoint"].rsplit(":", 1)[1]
        pairs.append(f"{engine.url}=tcp://127.0.0.1:{port}")
    return ",".join(pairs)


def proxy_env(system: System, settings: dict[str, Any]) -> dict[str, str]:
    """kvrelay's environment: the scaled TTLs and safety margin, the policy and the system's
    own settings."""
    env = dict(settings["proxy_env"])
    env.update(system.proxy_settings)
    if system.brief_s:
        env["KVRELAY_HOLD_BRIEF_S"] = f"{system.brief_s / settings['time_scale']:g}"
    if system.policy != "default":
        env["KVRELAY_ROUTING_POLICY"] = system.policy
    return env


def start_vllm_router_aggregated(
    engines: Sequence[c.Engine], policy: str, extra: Sequence[str] = ()
) -> c.RunningRouter:
    """vllm-router in its regular (not P/D) mode in front of whole-request engines."""
    launcher = c.ensure_router_venv()
    port, metrics_port = free_port(), free_port()
    argv = [
        str(launcher),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port),
        "--policy", policy,
        "--log-level", "warning",
        "--max-concurrent-requests", "4096",
        "--queue-size", "4096",
        "--worker-startup-check-interval", "1",
        "--disable-retries",
        *extra,
        "--worker-urls", *(e.url for e in engines),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    proc = ServerProcess(
        argv, http_ready(f"{url}/health"), env=c.bench_env(), ready_timeout=90,
        name="vllm-router-aggregated",
    ).start()  # fmt: skip
    return c.RunningRouter(name="vllm-router-aggregated", url=url, process=proc)


@dataclass
class Fleet:
    """A started system: its URL, engines by role, and the processes to stop."""

    system: System
    url: str
    prefill: list[c.Engine]
    decode: list[c.Engine]
    both: list[c.Engine]
    front: c.RunningRouter

    @property
    def engines(self) -> list[c.Engine]:
        return [*self.prefill, *self.decode, *self.both]

    @property
    def holders(self) -> list[c.Engine]:
        """The engines whose holds pin memory for later turns (D, or every engine)."""
        return self.decode or self.both


@contextlib.contextmanager
def fleet(
    system: System, hw: Hardware, time_scale: float, settings: dict[str, Any], tag: str
) -> Iterator[Fleet]:
    """Start the system's engines and front; stop every process on exit."""
    started: list[c.Engine] = []
    front: c.RunningRouter | None = None
    try:
        by_role: dict[str, list[c.Engine]] = {"prefill": [], "decode": [], "both": []}
        wanted = roles(system, hw, time_scale)
        # Engines start side by side: each start mostly waits for an import and a port.
        with ThreadPoolExecutor(max_workers=len(wanted)) as pool:
            futures = [
                pool.submit(c.start_engine, f"{tag}-{role[0]}{i}", args)
                for i, (role, args) in enumerate(wanted)
            ]
            errors = []
            for i, ((role, args), future) in enumerate(zip(wanted, futures, strict=True)):
                try:
                    engine = future.result()
                except Exception:
                    # `free_port` closes the port it found; a NIXL listener of an engine
                    # starting beside it may take it first. Once more, alone, on new ports.
                    try:
                        engine = c.start_engine(f"{tag}-{role[0]}{i}", args)
                    except Exception as exc:  # stop the ones that did start, then report
                        errors.append(exc)
                        continue
                started.append(engine)
                by_role[role].append(engine)
            if errors:
                raise errors[0]
        if system.front == "kvrelay":
            env = proxy_env(system, settings)
            if system.kv_events:
                # `wanted` lists the Ps, then the Ds, in the order they were started.
                followed = [*by_role["prefill"], *by_role["decode"]]
                env["KVRELAY_KV_EVENTS_ENDPOINTS"] = events_endpoints(
                    followed, [args for _, args in wanted]
                )
            front = c.start_kvrelay(
                f"kvrelay-{tag}", by_role["prefill"], by_role["decode"], env=env
            )
        elif system.front == "vllm-router-pd":
            front = c.start_vllm_router(
                by_role["prefill"], by_role["decode"], policy=system.policy,
                extra=system.router_args,
            )  # fmt: skip
        else:
            front = start_vllm_router_aggregated(by_role["both"], system.policy, system.router_args)
        yield Fleet(
            system, front.url, by_role["prefill"], by_role["decode"], by_role["both"], front
        )
    finally:
        c.stop_all(front.process if front else None, *(e.process for e in started))


# --------------------------------------------------------------------------- engine metrics


def engine_counters(samples: dict[str, float]) -> dict[str, float]:
    """`vllm:prompt_tokens_by_source` of one engine's page, by source, the tokens it computed
    in prefill (`GPU_PREFILL`) and its modelled and behind-the-model step time (enginesim's
    counters)."""
    out = dict.fromkeys(PROMPT_SOURCES, 0.0)
    for name in (GPU_PREFILL, MODELLED_STEP, BEHIND_MODEL):
        out[name] = samples.get(f"enginesim_{name}_total", 0.0)
    for key, value in samples.items():
        if key.startswith("vllm:prompt_tokens_by_source_total{") or key.startswith(
            "vllm:prompt_tokens_by_source{"
        ):
            for source in PROMPT_SOURCES:
                if f'source="{source}"' in key:
                    out[source] += value
    return out


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ENGINE_COUNTERS}


def pinned_share(held: Sequence[tuple[float, float]]) -> dict[str, float]:
    """Mean and peak of (held blocks / pool blocks) samples; NaN when none."""
    shares = [h / total for h, total in held if total > 0]
    if not shares:
        return {"mean": math.nan, "max": math.nan}
    return {"mean": sum(shares) / len(shares), "max": max(shares)}


# Each holder's queue in a sample (`EngineSampler.series`' "d": these, then its held blocks),
# to see where turns waited while holds were pinned.
D_QUEUE = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


@dataclass
class EngineSampler:
    """Samples the holders' held blocks, and each holder's queue and KV usage (`D_QUEUE`),
    every `interval_s` while a replay runs."""

    fleet: Fleet
    interval_s: float = 1.0
    series: list[dict[str, Any]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def scrape(self, http: aiohttp.ClientSession, url: str) -> dict[str, float]:
        async with http.get(f"{url}/metrics") as resp:
            return parse_samples(await resp.text())

    async def counters(self) -> dict[str, float]:
        """The fleet's engine counters (`engine_counters`), summed over every engine."""
        total = dict.fromkeys(ENGINE_COUNTERS, 0.0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            for e in self.fleet.engines:
                for k, v in engine_counters(await self.scrape(http, e.url)).items():
                    total[k] += v
        return total

    async def frees(self) -> dict[str, float]:
        """Holds freed so far by reason, per role (`p_budget`, `d_expiry`, ...)."""
        out: dict[str, float] = {}
        prefix = "enginesim_connector_freed_by_"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            for role, engines in (("p", self.fleet.prefill), ("d", self.fleet.holders)):
                for e in engines:
                    page = await self.scrape(http, e.url)
                    for key, value in page.items():
                        if key.startswith(prefix):
                            name = f"{role}_{key.removeprefix(prefix)}"
                            out[name] = out.get(name, 0.0) + value
                        elif role == "d" and key in D_HOLDS:
                            # Holds declined as over D's max, and those kept brief instead.
                            name = D_HOLDS[key]
                            out[name] = out.get(name, 0.0) + value
                    if role == "d" and (idle := bucket_counts(page, IDLE_BEFORE_EVICT)):
                        # d_idle_<le> per bucket bound (cumulative, le as the page writes it),
                        # d_idle_count and d_idle_sum
                        for bound, count in idle.items():
                            le = "+Inf" if bound == math.inf else repr(bound)
                            out[f"d_idle_{le}"] = out.get(f"d_idle_{le}", 0.0) + count
                        for part in ("count", "sum"):
                            total = series_sum(page, f"{IDLE_BEFORE_EVICT}_{part}")
                            out[f"d_idle_{part}"] = out.get(f"d_idle_{part}", 0.0) + total
            if self.fleet.system.front == "kvrelay":
                # Holds kvrelay gave back unused (its tenant's holds did not pay): D counts
                # them as released, like the ones a next turn used.
                page = await self.scrape(http, self.fleet.url)
                out["d_given_back"] = page.get(GIVEN_BACK, 0.0)
                for name, sample in (
                    *HOLDS_TAKEN.items(),
                    *HELD_READS.items(),
                    *PREFIX_WAITS.items(),
                ):
                    out[name] = page.get(sample, 0.0)
                # Prefix pulls (prefix_pull): what came of the pins (both legs; pulls_d_*: a
                # spilled turn's D's), the tokens the engines loaded.
                for result in PULL_RESULTS:
                    p, d = (
                        page.get(f'{PULLS}{{leg="{leg}",result="{result}"}}', 0.0) for leg in LEGS
                    )
                    out[f"pulls_{result}"], out[f"pulls_d_{result}"] = p + d, d
                out["pulled_tokens"] = page.get(PULLED_TOKENS, 0.0)
                # Pins made on a D (a history or prefix in D's cache, pulled by a P).
                out["pins_on_d"] = page.get(f'{PINS}{{holder="decode"}}', 0.0)
                # The pace the routing turns a pin's measured wait into tokens at.
                out["prefill_pace"] = page.get(PREFILL_PACE, 0.0)
                # The pins' answer times (pin_s_<pool>_sum / _count): what a pull waited.
                for pool in ("prefill", "decode"):
                    for part in ("sum", "count"):
                        sample = f'{PIN_SECONDS}_{part}{{holder="{pool}"}}'
                        out[f"pin_s_{pool}_{part}"] = page.get(sample, 0.0)
        return out

    async def run(self) -> None:
        t0 = time.perf_counter()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while not self._stop.is_set():
                held = total = 0.0
                per_d: list[list[float]] = []
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    for e in self.fleet.holders:
                        page = await self.scrape(http, e.url)
                        d_held = page.get("enginesim_blocks_held_for_remote", 0.0)
                        held += d_held
                        total += page.get("enginesim_blocks_total", 0.0)
                        per_d.append([series_sum(page, name) for name in D_QUEUE] + [d_held])
                    self.series.append(
                        {"t_s": time.perf_counter() - t0, "held": held, "total": total, "d": per_d}
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.interval_s)

    def stop(self) -> None:
        self._stop.set()
