"""Replay a Mooncake-format trace (Mooncake FAST'25 conversation trace, or any file in its
format) against an OpenAI-compatible endpoint: a kvrelay proxy, a router, or one engine.

What is sent (`bench/_trace.py` has the rules and the block-to-message mapping): each
`hash_id` becomes its own deterministic text of `--block-tokens` one-token words; a request
that extends an earlier one is a later turn of that conversation and is sent as a chat
history with the earlier turn's messages, the answer the engine actually gave (as streamed
back), and a new user message; other requests are first turns, with the prefix they share
with earlier requests or other first turns (a common system prompt) as a system message. A later
turn whose trace time comes before its predecessor's answer is complete waits for that answer
(counted in `waited_for_predecessor`).

How: `ChatStreams`, a lean client of the chat API on one aiohttp session (the OpenAI wire:
JSON request, server-sent events, the usage in the last event; not the `openai` SDK, whose
per-chunk model building cost about half a CPU at 9 req/s, taken from the engines the same
2 cores simulate, while the tests drive the proxy with the SDK itself), streamed with
`stream_options.include_usage`,
`max_tokens` = the trace's output length, `min_tokens` and `ignore_eos` in `extra_body` (vLLM
and enginesim honour both) so the answer has that length; `--conversation-ids` sends one
`X-Conversation-Id` per reconstructed conversation (without it the proxy matches histories).
Arrivals at the trace's timestamps divided by `--time-scale`; `--max-in-flight` bounds the
requests open at once (a request past the bound waits; TTFT counts from sending).

Time scaling: a scale of S shrinks every think time S-fold; the fleet's leases and TTLs must
shrink with it, or the blocks D holds outlive think times they would not outlive in
production and reuse is overstated. The replayer cannot set them (they belong to the fleet):
it prints the scale with that warning, records it in its JSON, and `--print-scaled-settings`
prints the settings to start the fleet with.

Records per request: arrival, send, first token, end, TTFT, TPOT, prompt/cached/completion
tokens from the engine's usage (`prompt_tokens_details.cached_tokens` when present), the
proxy's `X-Request-Id`/`X-KVRelay-*` response headers, turn and conversation. Summary: TTFT
p50/p90 for first and later turns, TPOT p90, SLO attainment and goodput at `--slo-ttft-ms`
and `--slo-tpot-ms`. `--lru-bound CAPACITY_BLOCKS` prints the prompt tokens an LRU prefix
cache of that many blocks would reuse on the slice (offline; no endpoint needed).

Example: `.venv/bin/python -m bench.trace_replay --start-s 600 --duration-s 1200
--time-scale 4 --base-url http://127.0.0.1:8000 --conversation-ids --lru-bound 50000`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import _common as c
from bench import _trace as tr
from kvrelay.devtools import sse

DEFAULT_TRACE = (
    c.REPO_ROOT.parent / "shared" / "workloads" / "mooncake" / ("conversation_trace.jsonl")
)
RECORDED_HEADERS = ("x-request-id", "x-kvrelay-")


def _defaults() -> dict[str, float]:
    """The unscaled time settings a think time races against, from the code's defaults."""
    from kvrelay.connector.config import ConnectorConfig
    from kvrelay.proxy.config import Settings

    def default(model: Any, name: str) -> float:
        return float(model.model_fields[name].default)

    return {
        "lease_seconds": default(ConnectorConfig, "lease_seconds"),
        "hold_brief_lease_s": default(ConnectorConfig, "hold_brief_lease_s"),
        "conversation_ttl_s": default(Settings, "conversation_ttl_s"),
        "entry_safety_margin_s": default(Settings, "entry_safety_margin_s"),
        "prefix_index_ttl_s": default(Settings, "prefix_index_ttl_s"),
        "hold_judge_s": default(Settings, "hold_judge_s"),
        "hold_brief_s": default(Settings, "hold_brief_s"),
    }


def brief_lease_s(scale: float) -> float:
    """D's brief-hold lease at `scale`: the part before the proxy's safety margin covers the
    next turn's queue on its reader, which runs in real time (not scaled); the margin is scaled
    as the other TTLs are."""
    base = _defaults()
    margin = base["entry_safety_margin_s"]
    return max(0.0, base["hold_brief_lease_s"] - margin) + margin / scale


def scaled_settings(scale: float, lease_s: float | None = None) -> dict[str, Any]:
    """The fleet settings that keep think times and leases in proportion at `scale`."""
    base = _defaults()
    if lease_s is not None:
        base["lease_seconds"] = lease_s
    lease = base["lease_seconds"] / scale
    brief = brief_lease_s(scale)
    return {
        "time_scale": scale,
        "unscaled": base,
        "proxy_env": {
            "KVRELAY_CONVERSATION_TTL_S": f"{base['conversation_ttl_s'] / scale:g}",
            "KVRELAY_ENTRY_SAFETY_MARGIN_S": f"{base['entry_safety_margin_s'] / scale:g}",
            "KVRELAY_PREFIX_INDEX_TTL_S": f"{base['prefix_index_ttl_s'] / scale:g}",
            "KVRELAY_HOLD_JUDGE_S": f"{base['hold_judge_s'] / scale:g}",
            # What counts as an answer at once is a think time (D's brief lease is not scaled:
            # it also covers the reader's queue, which runs in real time; D's scaled lease caps
            # it).
            "KVRELAY_HOLD_BRIEF_S": f"{base['hold_brief_s'] / scale:g}",
        },
        "enginesim_args": [
            "--lease-seconds",
            f"{lease:g}",
            "--hold-brief-lease-s",
            f"{brief:g}",
        ],
        "vllm_kv_connector_extra_config": {
            "lease_seconds": float(f"{lease:g}"),
            "hold_brief_lease_s": float(f"{brief:g}"),
        },
    }


def scale_warning(scale: float, settings: dict[str, Any]) -> str:
    if scale == 1:
        return "time not scaled: think times, leases and TTLs as in production"
    lease = settings["enginesim_args"][1]
    return (
        f"time scaled {scale:g}x faster: think times are {scale:g}x shorter, so the connector's "
        f"hold lease (lease_seconds, {settings['unscaled']['lease_seconds']:g} s; enginesim "
        f"--lease-seconds) must be {lease} s and the proxy's "
        + ", ".join(f"{k}={v}" for k, v in settings["proxy_env"].items())
        + " (the proxy has no lease of its own: it reads each hold's expiry from the engine),"
        " or holds outlive think times and reuse is overstated (--print-scaled-settings)"
    )


@dataclass
class Record:
    """One replayed request."""

    index: int  # line index in the trace file
    conversation: int
    turn: int
    predecessor: int | None  # trace index of the previous turn
    conversation_id: str | None
    expected_prompt_tokens: int
    expected_output_tokens: int
    arrival_s: float  # scheduled, from the replay's start
    ready_s: float = math.nan  # arrival, or the predecessor's end when later
    sent_s: float = math.nan
    first_token_s: float = math.nan
    end_s: float = math.nan
    ttft_s: float = math.nan
    tpot_s: float = math.nan
    waited_for_predecessor: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    # kvrelay's account in the stream's usage event: how the turn was routed and who prefilled.
    routing: str | None = None
    prefilled_by: str | None = None
    loaded_tokens: int | None = None  # read from another engine's KV (a pull), as it reported
    history_substituted: bool = False  # the predecessor failed: trace text stood in for it
    error: str | None = None
    reply: str | None = None  # with --record-messages
    messages: list[dict[str, str]] | None = None  # with --record-messages


class ApiError(Exception):
    """An answer other than 200, or an error event in the stream: status and body."""


@dataclass
class StreamedAnswer:
    """What one streamed chat completion gave: its response headers (names lower-cased), each
    content delta with when it arrived (the replayer's clock), and the last event's usage."""

    headers: dict[str, str]
    deltas: list[tuple[float, str]] = field(default_factory=list)
    usage: dict[str, Any] | None = None


class ChatStreams:
    """`POST /v1/chat/completions` streamed, on one keep-alive session (see the module
    docstring for why not the SDK)."""

    def __init__(self, base_url: str, api_key: str, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ChatStreams:
        connector = aiohttp.TCPConnector(limit=0)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, headers=self._headers
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("ChatStreams used outside `async with`")
        return self._session

    async def first_model(self) -> str:
        async with self.session.get(f"{self.base_url}/v1/models") as resp:
            if resp.status != 200:
                raise ApiError(f"GET /v1/models: {resp.status} {(await resp.text())[:300]}")
            return str((await resp.json())["data"][0]["id"])

    async def end_conversation(self, conversation_id: str) -> None:
        """`DELETE /v1/conversations/{id}`: the proxy releases what D holds for it."""
        url = f"{self.base_url}/v1/conversations/{conversation_id}"
        async with self.session.delete(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
            await resp.read()

    async def stream(
        self, body: dict[str, Any], headers: dict[str, str], clock: Callable[[], float]
    ) -> StreamedAnswer:
        """Send `body` (with `stream` set) and read its events as they come."""
        url = f"{self.base_url}/v1/chat/completions"
        async with self.session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                raise ApiError(f"{resp.status}: {(await resp.text())[:300]}")
            answer = StreamedAnswer({k.lower(): v for k, v in resp.headers.items()})
            reader = sse.EventReader()
            async for chunk in resp.content.iter_any():
                for data in reader.feed(chunk):
                    self._event(data, answer, clock)
            for data in reader.end():
                self._event(data, answer, clock)
            return answer

    @staticmethod
    def _event(data: str, answer: StreamedAnswer, clock: Callable[[], float]) -> None:
        if data.strip() == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise ApiError(f"error event: {json.dumps(event['error'])[:300]}")
        for choice in event.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                answer.deltas.append((clock(), content))
        if event.get("usage") is not None:
            answer.usage = event["usage"]


class Replayer:
    """Sends a plan's turns at their times and keeps each turn's messages and answer."""

    def __init__(self, plan: tr.Plan, client: ChatStreams, model: str, args: argparse.Namespace):
        self.plan = plan
        self.client = client
        self.model = model
        self.args = args
        self.run_tag = uuid.uuid4().hex[:8]
        self.records: list[Record] = []
        self.sent_messages: list[list[dict[str, str]]] = [[] for _ in plan.turns]
        self.answers: list[str | None] = [None for _ in plan.turns]
        self.done = [asyncio.Event() for _ in plan.turns]
        limit = args.max_in_flight
        self.slots = asyncio.Semaphore(limit) if limit > 0 else None
        self.t0 = 0.0
        origin = plan.turns[0].request.timestamp_ms if plan.turns else 0.0
        for turn in plan.turns:
            pred = turn.predecessor
            self.records.append(
                Record(
                    turn.request.index,
                    turn.conversation,
                    turn.turn,
                    None if pred is None else plan.turns[pred].request.index,
                    f"trace-{self.run_tag}-c{turn.conversation}" if args.conversation_ids else None,
                    turn.input_tokens,
                    turn.output_tokens,
                    (turn.request.timestamp_ms - origin) / 1000 / args.time_scale,
                )
            )

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def messages_for(self, i: int) -> tuple[list[dict[str, str]], bool]:
        turn = self.plan.turns[i]
        ids, bt = turn.request.hash_ids, self.plan.block_tokens
        user = {"role": "user", "content": tr.text_at(ids, turn.user_start, turn.input_tokens, bt)}
        if turn.predecessor is None:
            if turn.system_end == 0:
                return [user], False
            system = tr.text_at(ids, 0, turn.system_end, bt)
            return [{"role": "system", "content": system}, user], False
        prev = self.plan.turns[turn.predecessor]
        answer = self.answers[turn.predecessor]
        substituted = answer is None
        if answer is None:  # the predecessor failed: the trace's text where its answer was
            start = prev.input_tokens
            answer = tr.text_at(ids, start, start + prev.output_tokens, bt)
        history = self.sent_messages[turn.predecessor]
        return [*history, {"role": "assistant", "content": answer}, user], substituted

    async def run_turn(self, i: int) -> None:
        rec, turn = self.records[i], self.plan.turns[i]
        try:
            await asyncio.sleep(max(0.0, rec.arrival_s - self.now()))
            if turn.predecessor is not None and not self.done[turn.predecessor].is_set():
                rec.waited_for_predecessor = True
                await self.done[turn.predecessor].wait()
            rec.ready_s = self.now()
            messages, rec.history_substituted = self.messages_for(i)
            self.sent_messages[i] = messages
            if self.args.record_messages:
                rec.messages = messages
            if self.slots is None:
                await self.send(i, rec, messages)
            else:
                async with self.slots:
                    await self.send(i, rec, messages)
        except Exception as exc:  # one failed request is a result, not the end of the run
            rec.error = f"{type(exc).__name__}: {exc}"[:500]
            rec.end_s = self.now()
        finally:
            self.done[i].set()

    async def send(self, i: int, rec: Record, messages: list[dict[str, str]]) -> None:
        out = rec.expected_output_tokens
        extra_body: dict[str, Any] = {}
        if self.args.ignore_eos:
            extra_body = {"ignore_eos": True, "min_tokens": out}
        headers = {"X-Conversation-Id": rec.conversation_id} if rec.conversation_id else {}
        rec.sent_s = self.now()
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": out,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **extra_body,
        }
        answer = await self.client.stream(body, headers, self.now)
        rec.headers = {k: v for k, v in answer.headers.items() if k.startswith(RECORDED_HEADERS)}
        reply = [text for _, text in answer.deltas]
        last_token_s = answer.deltas[-1][0] if answer.deltas else math.nan
        if answer.deltas:
            rec.first_token_s = answer.deltas[0][0]
        usage = answer.usage
        if usage is not None:
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.completion_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                rec.cached_tokens = details["cached_tokens"]
            account = usage.get("kvrelay")
            if isinstance(account, dict):
                rec.routing = account.get("routing")
                rec.prefilled_by = account.get("prefilled_by")
                rec.loaded_tokens = account.get("loaded_tokens")
        rec.end_s = self.now()
        rec.ttft_s = rec.first_token_s - rec.sent_s
        tokens = rec.completion_tokens or len(reply)
        if tokens > 1 and not math.isnan(last_token_s):
            # vLLM's benchmark: (latency - TTFT) / (output tokens - 1), latency to the end of
            # the request; a request without a second token has no TPOT.
            rec.tpot_s = (rec.end_s - rec.first_token_s) / (tokens - 1)
        text = "".join(reply)
        self.answers[i] = text
        if self.args.record_messages:
            rec.reply = text

    async def run(self) -> float:
        self.t0 = time.perf_counter()
        await asyncio.gather(*(self.run_turn(i) for i in range(len(self.plan.turns))))
        return self.now()

    async def end_conversations(self) -> None:
        """Ask the proxy to release what D still holds for the replay's conversations (on the
        client's session: its key, its connections)."""
        ids = sorted({r.conversation_id for r in self.records if r.conversation_id})
        for conv_id in ids:
            await self.client.end_conversation(conv_id)


def within_slo(ttft_s: float, tpot_s: float | None, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    """An answered request within the SLO: its TTFT within, and its TPOT within unless it had no
    second token (vLLM's benchmark leaves such a request out of TPOT: it is judged on its TTFT
    alone)."""
    if ttft_s > slo_ttft_s:
        return False
    return tpot_s is None or math.isnan(tpot_s) or tpot_s <= slo_tpot_s


def summarize(records: list[Record], wall_s: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    first = [r.ttft_s for r in ok if r.turn == 1]
    later = [r.ttft_s for r in ok if r.turn > 1]
    tpots = [r.tpot_s for r in ok if not math.isnan(r.tpot_s)]
    slo_ttft, slo_tpot = args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000
    met = [r for r in ok if within_slo(r.ttft_s, r.tpot_s, slo_ttft, slo_tpot)]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "requests": len(records),
        "answered": len(ok),
        "errors": len(records) - len(ok),
        "waited_for_predecessor": sum(1 for r in records if r.waited_for_predecessor),
        "history_substituted": sum(1 for r in records if r.history_substituted),
        "wall_s": wall_s,
        "ttft_s_first_turns_p50": tr.percentile(first, 50),
        "ttft_s_first_turns_p90": tr.percentile(first, 90),
        "ttft_s_later_turns_p50": tr.percentile(later, 50),
        "ttft_s_later_turns_p90": tr.percentile(later, 90),
        "tpot_s_p90": tr.percentile(tpots, 90),
        "without_tpot": len(ok) - len(tpots),  # answered with fewer than two tokens
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "slo_attainment": len(met) / len(records) if records else math.nan,
        "goodput_rps": len(met) / wall_s if wall_s > 0 else math.nan,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "cached_tokens": sum(cached) if cached else None,
    }


def add_slo_arguments(p: argparse.ArgumentParser, ttft_ms: float) -> None:
    """The latency objective `summarize` counts goodput against (here and in trace_compare)."""
    p.add_argument("--slo-ttft-ms", type=float, default=ttft_ms)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    tr.add_slice_arguments(p, DEFAULT_TRACE, start_s=0.0, duration_s=None)
    p.add_argument(
        "--base-url",
        help="endpoint to replay against (e.g. the proxy's URL); "
        "without it only the offline figures are printed",
    )
    p.add_argument("--model", help="model name (default: the endpoint's first /v1/models)")
    p.add_argument("--api-key", default="bench")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="replay S times faster than the trace (arrivals at timestamp / S)",
    )
    p.add_argument("--first", type=int, help="first request index (trace line from 0)")
    p.add_argument("--last", type=int, help="request index the slice stops before")
    p.add_argument(
        "--conversations",
        type=int,
        help="keep only the slice's first N reconstructed conversations",
    )
    p.add_argument(
        "--min-turns",
        type=int,
        default=1,
        help="with --conversations: only conversations of at least this many turns",
    )
    p.add_argument(
        "--max-in-flight", type=int, default=0, help="open requests at most (0: no bound)"
    )
    p.add_argument(
        "--block-tokens",
        type=int,
        default=tr.TRACE_BLOCK_TOKENS,
        help="tokens per hash_id block; lengths scale by it/512 (small for tests)",
    )
    p.add_argument("--max-output-tokens", type=int, help="cap on each answer's tokens")
    p.add_argument(
        "--conversation-ids",
        action="store_true",
        help="send X-Conversation-Id per reconstructed conversation",
    )
    c.add_switch(
        p, "--ignore-eos", "send ignore_eos and min_tokens so answers have the trace's length"
    )
    add_slo_arguments(p, ttft_ms=2000.0)
    p.add_argument(
        "--lease-s",
        type=float,
        help="the fleet's unscaled hold lease (default: the connector's default)",
    )
    p.add_argument(
        "--print-scaled-settings",
        action="store_true",
        help="print the fleet settings for --time-scale and exit",
    )
    p.add_argument(
        "--lru-bound",
        type=int,
        metavar="CAPACITY_BLOCKS",
        help="print the reuse of an LRU prefix cache of that many 512-token blocks",
    )
    p.add_argument(
        "--record-messages",
        action="store_true",
        help="keep every request's messages and reply in the JSON",
    )
    p.add_argument("--json", type=Path, default=c.WORK_DIR / "trace_replay.json")
    args = p.parse_args(argv)
    if args.time_scale <= 0:
        p.error("--time-scale must be > 0")
    if args.block_tokens < 1 or args.max_in_flight < 0:
        p.error("--block-tokens must be >= 1 and --max-in-flight >= 0")
    return args


async def replay(plan: tr.Plan, args: argparse.Namespace) -> dict[str, Any]:
    async with ChatStreams(args.base_url, args.api_key) as client:
        model = args.model or await client.first_model()
        replayer = Replayer(plan, client, model, args)
        wall = await replayer.run()
        if args.conversation_ids:
            await replayer.end_conversations()
    records = replayer.records
    return {
        "model": model,
        "summary": summarize(records, wall, args),
        "records": [asdict(r) for r in records],
    }


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = scaled_settings(args.time_scale, args.lease_s)
    if args.print_scaled_settings:
        for k, v in settings["proxy_env"].items():
            print(f"export {k}={v}")
        print("# enginesim: " + " ".join(settings["enginesim_args"]))
        print(
            "# vLLM kv_connector_extra_config: "
            + json.dumps(settings["vllm_kv_connector_extra_config"])
        )
        return 0
    try:
        requests = tr.select(
            tr.load_trace(args.trace), args.start_s, args.duration_s, args.first, args.last
        )
    except (OSError, tr.TraceError) as err:
        print(f"trace_replay: {err}", file=sys.stderr)
        return 2
    plan = tr.reconstruct(requests, args.block_tokens, args.max_output_tokens)
    if args.conversations is not None:
        plan = tr.keep_conversations(plan, args.conversations, args.min_turns)
        kept = {t.request.index for t in plan.turns}
        requests = [r for r in requests if r.index in kept]
    warning = scale_warning(args.time_scale, settings)
    result: dict[str, Any] = {
        "trace": str(args.trace),
        "citation": tr.CITATION,
        "slice": {
            "start_s": args.start_s,
            "duration_s": args.duration_s,
            "first": args.first,
            "last": args.last,
            "conversations": args.conversations,
            "min_turns": args.min_turns,
            "requests": len(requests),
        },
        "time_scale": args.time_scale,
        "time_scale_warning": warning,
        "scaled_settings": settings,
        "block_tokens": args.block_tokens,
        "conversation_ids": args.conversation_ids,
        "reconstruction": plan.stats,
    }
    print(f"{tr.CITATION}: {len(requests)} requests; {warning}")
    print("reconstruction: " + json.dumps(plan.stats))
    if args.lru_bound is not None:
        bound = tr.lru_bound(requests, args.lru_bound)
        result["lru_bound"] = bound
        share = bound["reused_tokens"] / bound["prompt_tokens"] if bound["prompt_tokens"] else 0
        print(
            f"LRU bound ({args.lru_bound} blocks): {bound['reused_tokens']} of "
            f"{bound['prompt_tokens']} prompt tokens reused ({share:.1%})"
        )
    if args.base_url and plan.turns:
        result.update(asyncio.run(replay(plan, args)))
        print("summary: " + json.dumps(_json_safe(result["summary"])))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(_json_safe(result), indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
