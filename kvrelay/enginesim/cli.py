"""Command line: `python -m kvrelay.enginesim …` or `kvrelay sim …` (flags in CONTRACTS §5)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

from kvrelay.connector.config import ConnectorConfig
from kvrelay.enginesim.config import DEFAULT_MODEL, EngineConfig
from kvrelay.enginesim.costs import (
    DEFAULT_LINK,
    DEFAULT_TRANSFER_LAYOUT,
    LINKS,
    PROFILES,
    TRANSFER_LAYOUTS,
    get_profile,
)
from kvrelay.enginesim.kvpool import KVLayout
from kvrelay.enginesim.model import DTYPES, ModelGeometry


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="enginesim",
        description="CPU engine simulator: OpenAI API, paged KV pool, kvrelay NIXL connector.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--engine-id", default=None, help="connector engine id (default: sim-PORT)")
    p.add_argument(
        "--side-channel-port",
        type=int,
        default=None,
        help="serve the connector side channel here (0: any free port); omit for a single "
        "engine without KV transfer",
    )
    p.add_argument("--side-channel-host", default="127.0.0.1")
    p.add_argument(
        "--role",
        choices=["both", "prefill", "decode"],
        default="both",
        help="a label for launch scripts: every engine's connector serves both directions",
    )
    p.add_argument("--prefill-us-per-token", type=float, default=0.0)
    p.add_argument("--decode-us-per-step", type=float, default=0.0)
    p.add_argument(
        "--cost-profile",
        choices=sorted(PROFILES),
        default=None,
        help="model a GPU's step and KV transfer times instead of the two flat knobs above; "
        "also sets the pool's block count and size and the context length (README)",
    )
    p.add_argument(
        "--kv-link",
        choices=sorted(LINKS),
        default=DEFAULT_LINK,
        help="the link a cost profile's KV transfers are modelled over",
    )
    p.add_argument(
        "--kv-transfer-layout",
        choices=TRANSFER_LAYOUTS,
        default=DEFAULT_TRANSFER_LAYOUT,
        help="how the modelled GPUs' caches are registered, which sets a modelled read's "
        "descriptors: block-major (one a run of blocks, what the connector asks vLLM for on a "
        "GPU) or per-layer (one a layer and run, vLLM 0.32's default)",
    )
    p.add_argument(
        "--kv-scale",
        type=float,
        default=1.0,
        help="with --cost-profile: the share of the profile's KV blocks this engine gets",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="vLLM's prefix caching: full blocks stay findable in the KV pool until an "
        "allocation takes them (off unless asked; vLLM 0.32 turns it on by default)",
    )
    # Unset: 1024 blocks of 16 tokens and 4096 tokens, or what --cost-profile says.
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="tokens one step may compute: decodes first, then prefill chunks (vLLM's flag; "
        "8192 is its online default on H100/H200)",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="vLLM's flag: waiting requests admitted in arrival order, or by the requests' "
        "priority (lower first) and then arrival",
    )
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--head-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    p.add_argument("--kv-layout", choices=[x.value for x in KVLayout], default="kv_first")
    p.add_argument("--eos-period", type=int, default=64, help="~1/N chance of EOS per token")
    p.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="usage.prompt_tokens_details in answers (vLLM's flag of the same name)",
    )
    p.add_argument(
        "--tokenizer-process",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="encode prompts in a child process, as vLLM's API server tokenizes apart from "
        "its engine core (the engine's steps then never wait on an encoding)",
    )
    p.add_argument(
        "--chat-template-first-line",
        default="",
        help="a line the chat template renders before the messages; {messages} is replaced by "
        "their number, so it changes every turn (as a template that prints the date does)",
    )
    p.add_argument(
        "--kv-events-config",
        default=None,
        help="vLLM's flag: a JSON object; with enable_kv_cache_events, the prefix cache's "
        "stored and evicted blocks are published on a ZMQ PUB socket at its endpoint",
    )
    p.add_argument(
        "--kv-cache-metrics",
        action="store_true",
        help="vLLM's flag: the KV cache residency metrics (a sampled block's idle time before "
        "eviction, vllm:kv_block_idle_before_evict_seconds)",
    )
    p.add_argument(
        "--kv-cache-metrics-sample",
        type=float,
        default=0.01,
        help="vLLM's flag: the share of allocated blocks the residency metrics follow",
    )
    p.add_argument("--kv-recompute-threshold", type=int, default=0)
    p.add_argument("--kv-load-failure-policy", choices=["recompute", "fail"], default="recompute")
    p.add_argument("--lease-seconds", type=float, help="default: the connector's")
    p.add_argument(
        "--hold-budget-fraction",
        type=float,
        help="share of the KV pool holds may pin (default: the connector's)",
    )
    p.add_argument(
        "--hold-max-fraction",
        type=float,
        help="share of the KV pool one hold may pin; a larger turn is not held "
        "(default: the connector's, 1.0)",
    )
    p.add_argument(
        "--hold-brief-max-fraction",
        type=float,
        help="share of the KV pool holds the proxy asked to be brief may pin, one or "
        "together (default: the connector's)",
    )
    p.add_argument(
        "--hold-brief-lease-s",
        type=float,
        help="seconds D keeps such a brief hold, never past --lease-seconds "
        "(default: the connector's)",
    )
    p.add_argument("--handshake-timeout", type=float, default=5.0)
    p.add_argument(
        "--claim-timeout",
        type=float,
        help="seconds a hold for this turn's transfer waits for its reader's claim before "
        "block pressure may reclaim it (default: the connector's)",
    )
    p.add_argument("--publish-finished-params", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--params-in-stream",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="kvrelay extra: put kv_transfer_params in the last stream chunk (stock vLLM "
        "never does; by default params are only on the side channel, as with vLLM)",
    )
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the parent process dies (test runs killed mid-way leave no engines)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def pool_from_args(args: argparse.Namespace) -> tuple[int, int, int]:
    """(num_blocks, block_size, max_model_len): given flags win; else the profile's GPU
    memory (times --kv-scale) and the model's context length, capped by the pool."""
    if args.cost_profile is None:
        return args.num_blocks or 1024, args.block_size or 16, args.max_model_len or 4096
    if args.kv_scale <= 0:
        raise ValueError("--kv-scale must be positive")
    profile = get_profile(args.cost_profile)
    block_size = args.block_size or profile.block_size
    num_blocks = args.num_blocks or max(1, round(profile.num_blocks() * args.kv_scale))
    max_model_len = args.max_model_len or min(profile.model.max_model_len, num_blocks * block_size)
    return num_blocks, block_size, max_model_len


# Options passed to the config under their own names; the others are derived below.
_CONNECTOR_OPTIONS = (
    "side_channel_port",
    "side_channel_host",
    "kv_recompute_threshold",
    "kv_load_failure_policy",
    "lease_seconds",
    "hold_budget_fraction",
    "hold_max_fraction",
    "hold_brief_max_fraction",
    "hold_brief_lease_s",
    "publish_finished_params",
)
_ENGINE_OPTIONS = (
    "model",
    "max_num_seqs",
    "max_num_batched_tokens",
    "scheduling_policy",
    "prefill_us_per_token",
    "decode_us_per_step",
    "cost_profile",
    "kv_link",
    "kv_transfer_layout",
    "enable_prefix_caching",
    "eos_period",
    "params_in_stream",
    "enable_prompt_tokens_details",
    "tokenizer_process",
    "chat_template_first_line",
    "kv_events_config",
    "kv_cache_metrics",
    "kv_cache_metrics_sample",
)


def _options(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(args, name) for name in names}


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    connector = None
    if args.side_channel_port is not None:
        connector = ConnectorConfig(
            engine_id=args.engine_id or f"sim-{args.port}",
            handshake_timeout_s=args.handshake_timeout,
            **({} if args.claim_timeout is None else {"claim_timeout_s": args.claim_timeout}),
            # An option left unset keeps the connector's own default.
            **{k: v for k, v in _options(args, _CONNECTOR_OPTIONS).items() if v is not None},
        )
    num_blocks, block_size, max_model_len = pool_from_args(args)
    return EngineConfig(
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        block_size=block_size,
        geometry=ModelGeometry(args.num_layers, args.num_kv_heads, args.head_size, args.dtype),
        kv_layout=KVLayout(args.kv_layout),
        connector=connector,
        **_options(args, _ENGINE_OPTIONS),
    )


async def _watch_parent(task: asyncio.Task[None]) -> None:
    parent = os.getppid()
    while True:
        await asyncio.sleep(1.0)
        if os.getppid() != parent:  # re-parented: whoever started us is gone
            task.cancel()
            return


async def _amain(config: EngineConfig, host: str, port: int, exit_with_parent: bool) -> None:
    from kvrelay.enginesim.app import build_server
    from kvrelay.enginesim.server import serve

    server = build_server(config)
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    watcher = asyncio.create_task(_watch_parent(task)) if exit_with_parent else None
    try:
        await serve(server, host, port)
    except asyncio.CancelledError:
        pass
    finally:
        if watcher is not None:
            watcher.cancel()
        server.runner.stop()
        server.close()


def main(argv: list[str] | None = None) -> int:
    """Run one engine until SIGTERM/SIGINT; returns the exit status."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        config = config_from_args(args)
        config.validate()
    except ValueError as exc:
        print(f"enginesim: {exc}", file=sys.stderr)
        return 2
    # The engine thread runs Python between steps; a short GIL switch interval keeps the HTTP
    # event loop responsive next to it.
    sys.setswitchinterval(0.0005)
    asyncio.run(_amain(config, args.host, args.port, args.exit_with_parent))
    return 0
