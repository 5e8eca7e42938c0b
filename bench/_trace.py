"""Mooncake-format traces offline: loading, slicing, conversation reconstruction, block text
and the LRU reuse bound (no network; `trace_replay.py` sends what this plans).

Format (any file shaped like the Mooncake FAST'25 conversation trace): one JSON object per
line, `timestamp` (ms from the trace start), `input_length` (prompt tokens), `output_length`
(generated tokens), `hash_ids` (the prompt as blocks of 512 tokens, the last one partial; equal
ids are equal blocks).

Block text. Each hash id becomes its own sequence of `block_tokens` words, drawn by a random
generator seeded with the id (same id, same text, in every run and process). The words are
the 66 in `WORDS`: each, with its leading space, is ONE token on enginesim's tokenizer
(`kvrelay/enginesim/tokenizer.py`) and on the tiny model's tokenizer the real-vLLM tests train
(`kvrelay/devtools/tiny_model.py`), and both pre-tokenize on `" word"` boundaries, so a block
of N words is N tokens wherever it sits and neighbouring blocks never merge tokens across their
boundary. A prompt position p (in tokens) is word `p % block_tokens` of block
`hash_ids[p // block_tokens]`: a message covering positions [a, b) is those words in order.

Conversations. The last block of a request is usually partial, and the trace gives it a new
id once it fills, so a later turn does not repeat its predecessor's ids exactly: it repeats
all of them but the last. Request r is a later turn of q (q its predecessor) when q arrived
earlier, all of q's blocks but its last are a leading prefix of r's, r's prompt is longer
than q's, and the prefix r shares with q goes past (a) the prefix q shared with the requests
before it and (b) q's last branch point in the slice: the deepest prefix of q above its
last full block that two different continuations share, or that last full block itself
when `END_FANOUT` (8) continuations share it. A turn chain gives each turn's end two
continuations (the partial block and its filled successor), a few more when a turn is
answered again and followed up differently; a system prompt block that every conversation
starts with gives many, so it does not make two requests one conversation. Among several
such q, the one sharing the longest prefix, then the latest. Any other request is a first
turn: a new conversation. The ids cannot tell a conversation whose first turn is one full
block plus a partial one from a new conversation with the same system block.

Messages (positions in tokens of the trace, scaled by `block_tokens / 512`):
- first turn r: a system message with positions [0, s) where s is the longer of the prefix r
  shares with any earlier request of the slice and the prefix it shares with any other first
  turn, earlier or later (nothing when s = 0; at most the prompt less one token), then a user
  message with positions [s, L_r). An application sends its system prompt as a system message
  from its first request on: were the first of the conversations sharing it sent as one user
  message, the chat template's role header would make its blocks differ from every later
  request's from the first token, and every system would compute that prefix twice;
- later turn r of q: q's messages exactly as q sent them, then the answer q received from the
  engine as the assistant message (the trace counts q's output inside r's input: positions
  [L_q, L_q + O_q) of r are that answer), then a user message with positions
  [L_q + O_q, L_r) of r's blocks. When the trace's growth is smaller than q's output
  (L_r < L_q + O_q + 1) the user message keeps one word; such turns are counted.
The chat template adds a few tokens per message, and the answer the engine streams back may
re-tokenize to a slightly different count, so a replayed prompt is within a few tokens per
turn of the trace's `input_length`.

Think time here is the gap between a turn's arrival and its predecessor's arrival (the trace
has no completion times); the replayer measures the gap from the predecessor's answer.

LRU bound. An LRU cache of `capacity` hash-id blocks sees the slice's prompts in arrival order
and reuses, per request, the leading run of its blocks it holds (a prefix cache stops at the
first miss), each block counted with its tokens (the last one partial); then the request's
blocks are touched from last to first, so its first blocks are the most recent and the tail
goes first on eviction (vLLM's prefix cache frees a request's blocks in that order).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvrelay.connector.block_hash import matching_prefix_blocks

TRACE_BLOCK_TOKENS = 512  # the block size the Mooncake format's hash_ids stand for
# A branch point at a turn's last full block needs this many continuations (module docstring).
END_FANOUT = 8
CITATION = "Mooncake FAST'25 conversation trace"

# One token each (with the leading space) on enginesim's tokenizer and on the tiny model's;
# tests/bench/test_trace_replay.py checks the first, the module docstring says how.
WORDS: tuple[str, ...] = (
    "about",
    "all",
    "an",
    "and",
    "are",
    "as",
    "at",
    "be",
    "block",
    "but",
    "by",
    "cache",
    "can",
    "could",
    "do",
    "every",
    "for",
    "from",
    "go",
    "good",
    "have",
    "he",
    "how",
    "if",
    "in",
    "is",
    "it",
    "just",
    "know",
    "light",
    "like",
    "make",
    "me",
    "model",
    "more",
    "my",
    "new",
    "no",
    "of",
    "on",
    "one",
    "or",
    "out",
    "right",
    "so",
    "some",
    "that",
    "the",
    "their",
    "there",
    "they",
    "this",
    "time",
    "to",
    "token",
    "turn",
    "up",
    "was",
    "we",
    "what",
    "when",
    "will",
    "with",
    "would",
    "you",
    "your",
)


class TraceError(ValueError):
    """A trace line that is not a Mooncake-format request."""


@dataclass(frozen=True)
class TraceRequest:
    """One line of the trace."""

    index: int  # line number from 0, the request's id in results
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _int_field(obj: dict[str, Any], name: str, line: int, minimum: int) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceError(f"line {line}: {name!r} must be an integer >= {minimum}")
    return value


def parse_line(text: str, line: int, index: int) -> TraceRequest:
    try:
        obj = json.loads(text)
    except ValueError as err:
        raise TraceError(f"line {line}: not JSON ({err})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"line {line}: not a JSON object")
    stamp = obj.get("timestamp")
    if not isinstance(stamp, int | float) or isinstance(stamp, bool) or stamp < 0:
        raise TraceError(f"line {line}: 'timestamp' must be a number of ms >= 0")
    ids = obj.get("hash_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids)
    ):
        raise TraceError(f"line {line}: 'hash_ids' must be a non-empty list of integers")
    length = _int_field(obj, "input_length", line, 1)
    if not (len(ids) - 1) * TRACE_BLOCK_TOKENS < length <= len(ids) * TRACE_BLOCK_TOKENS:
        raise TraceError(
            f"line {line}: {len(ids)} hash_ids do not cover input_length {length} in blocks "
            f"of {TRACE_BLOCK_TOKENS}"
        )
    return TraceRequest(
        index, float(stamp), length, _int_field(obj, "output_length", line, 0), tuple(ids)
    )


def add_slice_arguments(
    p: argparse.ArgumentParser, trace: Path, start_s: float | None, duration_s: float | None
) -> None:
    """The trace file and the slice of it a script replays (`select`'s window), with its
    defaults."""
    p.add_argument("--trace", type=Path, default=trace, help="Mooncake-format JSONL")
    p.add_argument("--start-s", type=float, default=start_s, help="slice start, trace seconds")
    p.add_argument(
        "--duration-s", type=float, default=duration_s, help="slice length, trace seconds"
    )


def load_trace(path: Path) -> list[TraceRequest]:
    """Every request of the file, in arrival order (stable for equal timestamps)."""
    out: list[TraceRequest] = []
    with path.open(encoding="utf-8") as fh:
        for line, text in enumerate(fh, start=1):
            if text.strip():
                out.append(parse_line(text, line, len(out)))
    out.sort(key=lambda r: r.timestamp_ms)
    return out


def select(
    requests: Sequence[TraceRequest],
    start_s: float = 0.0,
    duration_s: float | None = None,
    first: int | None = None,
    last: int | None = None,
) -> list[TraceRequest]:
    """The requests arriving in [start_s, start_s + duration_s) of trace time whose index is
    in [first, last)."""
    end_s = math.inf if duration_s is None else start_s + duration_s
    return [
        r
        for r in requests
        if start_s <= r.timestamp_ms / 1000 < end_s
        and (first is None or r.index >= first)
        and (last is None or r.index < last)
    ]


# --- block text -------------------------------------------------------------------------------


@lru_cache(maxsize=1 << 14)
def block_words(hash_id: int, block_tokens: int) -> tuple[str, ...]:
    """The block's words, each with its leading space (one token each)."""
    rng = random.Random(f"kvrelay-trace-block-{hash_id}")
    return tuple(" " + rng.choice(WORDS) for _ in range(block_tokens))


def text_at(hash_ids: Sequence[int], start: int, end: int, block_tokens: int) -> str:
    """The text at prompt positions [start, end) (see the module docstring)."""
    parts: list[str] = []
    pos = start
    while pos < end:
        block, offset = divmod(pos, block_tokens)
        words = block_words(hash_ids[min(block, len(hash_ids) - 1)], block_tokens)
        take = min(end - pos, block_tokens - offset)
        parts.extend(words[offset : offset + take])
        pos += take
    return "".join(parts)


# --- conversation reconstruction ---------------------------------------------------------------


@dataclass
class PlannedTurn:
    """A request of the slice with its place in a reconstructed conversation."""

    request: TraceRequest
    conversation: int
    turn: int  # 1 for a first turn
    predecessor: int | None  # index into the plan of the previous turn
    shared_blocks: int  # leading blocks shared with an earlier request of the slice
    input_tokens: int  # scaled to block_tokens
    output_tokens: int  # scaled to block_tokens (and capped)
    system_end: int = 0  # first turns: positions [0, system_end) are the system message
    user_start: int = 0  # positions [user_start, input_tokens) are the new user message
    short_growth: bool = False  # the trace's growth was under the predecessor's output
    branch_depth: int = 0  # a later turn must share more blocks than this (module docstring)


@dataclass
class Plan:
    """The slice as conversations, ready to send."""

    turns: list[PlannedTurn]
    block_tokens: int
    conversations: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


class _Trie:
    """Prefixes of hash-id lists seen so far; node 0 is the empty prefix."""

    def __init__(self) -> None:
        self.children: dict[tuple[int, int], int] = {}
        # Requests (plan indices) whose ids less the last one end at a node.
        self.ending: dict[int, list[int]] = {}

    def walk(self, ids: Sequence[int]) -> list[int]:
        """Nodes along the longest known prefix of `ids` (node of depth d at position d)."""
        nodes = [0]
        for hid in ids:
            child = self.children.get((nodes[-1], hid))
            if child is None:
                break
            nodes.append(child)
        return nodes

    def insert(self, ids: Sequence[int]) -> list[int]:
        nodes = [0]
        for hid in ids:
            key = (nodes[-1], hid)
            if key not in self.children:
                self.children[key] = len(self.children) + 1
            nodes.append(self.children[key])
        return nodes


def _branch_depths(requests: Sequence[TraceRequest]) -> list[int]:
    """Per request: its last branch point in the whole slice (module docstring)."""
    full = _Trie()
    for r in requests:
        full.insert(r.hash_ids)
    fanout: dict[int, int] = {}
    for parent, _ in full.children:
        fanout[parent] = fanout.get(parent, 0) + 1
    out = []
    for r in requests:
        nodes = full.walk(r.hash_ids)
        end = len(r.hash_ids) - 1  # depth of the node before the last block
        depth = 0
        for d in range(end):
            if fanout.get(nodes[d], 0) >= 2:
                depth = d
        if fanout.get(nodes[end], 0) >= END_FANOUT:
            depth = end
        out.append(depth)
    return out


def _scale(tokens: int, block_tokens: int) -> int:
    return max(1, round(tokens * block_tokens / TRACE_BLOCK_TOKENS))


def reconstruct(
    requests: Sequence[TraceRequest],
    block_tokens: int = TRACE_BLOCK_TOKENS,
    max_output_tokens: int | None = None,
) -> Plan:
    """Conversations of the slice (rules in the module docstring)."""
    branch_depth = _branch_depths(requests)
    trie = _Trie()
    turns: list[PlannedTurn] = []
    conversations = 0
    for r, own_branch in zip(requests, branch_depth, strict=True):
        nodes = trie.walk(r.hash_ids)
        shared = len(nodes) - 1
        best: tuple[int, float, int] | None = None  # (lcp, timestamp, plan index)
        for depth in range(len(nodes) - 1, -1, -1):
            for qi in trie.ending.get(nodes[depth], ()):
                q = turns[qi].request
                lcp = matching_prefix_blocks(q.hash_ids, r.hash_ids)
                floor = max(turns[qi].branch_depth, turns[qi].shared_blocks)
                if lcp > floor and r.input_length > q.input_length:
                    cand = (lcp, q.timestamp_ms, qi)
                    if best is None or cand > best:
                        best = cand
            if best is not None:
                break
        out_tokens = _scale(r.output_length, block_tokens) if r.output_length else 1
        if max_output_tokens is not None:
            out_tokens = min(out_tokens, max_output_tokens)
        in_tokens = _scale(r.input_length, block_tokens)
        if best is None:
            conversations += 1
            system_end = min(shared * block_tokens, in_tokens - 1)
            turn = PlannedTurn(
                r,
                conversations,
                1,
                None,
                shared,
                in_tokens,
                out_tokens,
                system_end=max(system_end, 0),
                user_start=max(system_end, 0),
            )
        else:
            prev = turns[best[2]]
            start = prev.input_tokens + prev.output_tokens
            short = start >= in_tokens
            turn = PlannedTurn(
                r,
                prev.conversation,
                prev.turn + 1,
                best[2],
                shared,
                in_tokens,
                out_tokens,
                user_start=in_tokens - 1 if short else start,
                short_growth=short,
            )
        turn.branch_depth = own_branch
        turns.append(turn)
        trie.insert(r.hash_ids)
        trie.ending.setdefault(trie.walk(r.hash_ids[:-1])[-1], []).append(len(turns) - 1)
    for turn, shared_blocks in zip(turns, _shared_with_other_first_turns(turns), strict=True):
        if shared_blocks:
            system_end = min(shared_blocks * block_tokens, turn.input_tokens - 1)
            if system_end > turn.system_end:
                turn.system_end = turn.user_start = system_end
    plan = Plan(turns, block_tokens, conversations)
    plan.stats = plan_stats(plan)
    return plan


def _shared_with_other_first_turns(turns: Sequence[PlannedTurn]) -> list[int]:
    """Per turn: the leading blocks its prompt shares with another first turn of the slice,
    earlier or later (0 for a later turn): the system prompt conversations have in common."""
    trie = _Trie()
    passing: dict[int, int] = {}  # node -> first turns whose prompt passes through it
    paths = [trie.insert(t.request.hash_ids)[1:] if t.predecessor is None else [] for t in turns]
    for path in paths:
        for node in path:
            passing[node] = passing.get(node, 0) + 1
    out = []
    for path in paths:
        shared = 0
        for depth, node in enumerate(path, start=1):
            if passing[node] < 2:
                break
            shared = depth
        out.append(shared)
    return out


def keep_conversations(plan: Plan, count: int, min_turns: int = 1) -> Plan:
    """The first `count` conversations (by first arrival) with at least `min_turns` turns."""
    sizes: dict[int, int] = {}
    for t in plan.turns:
        sizes[t.conversation] = sizes.get(t.conversation, 0) + 1
    chosen = [c for c in sorted(sizes) if sizes[c] >= min_turns][:count]
    return _only(plan, chosen)


def sample_conversations(plan: Plan, fraction: float, seed: int = 0) -> Plan:
    """Whole conversations, each kept with probability `fraction` by a draw seeded with
    (`seed`, the first turn's trace index): the sample keeps the slice's arrival pattern over
    its whole length (first-N would keep only conversations that start early), and each
    kept conversation keeps every turn."""
    if not 0 < fraction <= 1:
        raise ValueError("fraction must be in (0, 1]")
    firsts = {t.conversation: t.request.index for t in plan.turns if t.predecessor is None}
    chosen = sorted(
        conv
        for conv, index in firsts.items()
        if random.Random(f"kvrelay-trace-sample-{seed}-{index}").random() < fraction
    )
    return _only(plan, chosen)


def _only(plan: Plan, chosen: list[int]) -> Plan:
    """The plan with only the `chosen` conversations, renumbered 1.. in that order, each turn
    still pointing at its predecessor."""
    renumber = {conv: i + 1 for i, conv in enumerate(chosen)}
    moved: dict[int, int] = {}
    kept: list[PlannedTurn] = []
    for i, t in enumerate(plan.turns):
        if t.conversation in renumber:
            moved[i] = len(kept)
            pred = None if t.predecessor is None else moved[t.predecessor]
            kept.append(replace(t, conversation=renumber[t.conversation], predecessor=pred))
    out = Plan(kept, plan.block_tokens, len(chosen))
    out.stats = plan_stats(out)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (NaN for no values)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def plan_stats(plan: Plan) -> dict[str, Any]:
    """What the reconstruction finds: conversations, turns, growth, think times."""
    turns = plan.turns
    per_conv: dict[int, int] = {}
    for t in turns:
        per_conv[t.conversation] = per_conv.get(t.conversation, 0) + 1
    later = [t for t in turns if t.predecessor is not None]
    gaps = [
        (t.request.timestamp_ms - turns[t.predecessor].request.timestamp_ms) / 1000
        for t in later
        if t.predecessor is not None
    ]
    growth = [
        t.request.input_length - turns[t.predecessor].request.input_length
        for t in later
        if t.predecessor is not None
    ]
    counts = sorted(per_conv.values())
    return {
        "requests": len(turns),
        "conversations": plan.conversations,
        "later_turns": len(later),
        "later_turn_share": len(later) / len(turns) if turns else math.nan,
        "turns_per_conversation_mean": len(turns) / plan.conversations if turns else math.nan,
        "turns_per_conversation_p50": percentile(counts, 50),
        "turns_per_conversation_p90": percentile(counts, 90),
        "turns_per_conversation_max": counts[-1] if counts else 0,
        "multi_turn_conversations": sum(1 for c in counts if c > 1),
        "prompt_growth_tokens_p50": percentile(growth, 50),
        "think_time_arrival_gap_s_p50": percentile(gaps, 50),
        "think_time_arrival_gap_s_p90": percentile(gaps, 90),
        "short_growth_turns": sum(1 for t in later if t.short_growth),
        "first_turns_with_shared_prefix": sum(
            1 for t in turns if t.predecessor is None and t.shared_blocks > 0
        ),
    }


# --- offline LRU bound ------------------------------------------------------------------------


def block_tokens_of(request: TraceRequest, i: int) -> int:
    """Tokens of the request's i-th block (the last one may be partial)."""
    if i < len(request.hash_ids) - 1:
        return TRACE_BLOCK_TOKENS
    return request.input_length - TRACE_BLOCK_TOKENS * (len(request.hash_ids) - 1)


def lru_bound(requests: Iterable[TraceRequest], capacity_blocks: int) -> dict[str, int]:
    """Prompt tokens (and blocks) an LRU prefix cache of `capacity_blocks` would reuse."""
    if capacity_blocks < 0:
        raise ValueError("capacity_blocks must be >= 0")
    cache: OrderedDict[int, None] = OrderedDict()
    reused_tokens = reused_blocks = prompt_tokens = prompt_blocks = 0
    for r in requests:
        prompt_tokens += r.input_length
        prompt_blocks += len(r.hash_ids)
        for i, hid in enumerate(r.hash_ids):
            if hid not in cache:
                break
            reused_blocks += 1
            reused_tokens += block_tokens_of(r, i)
        if capacity_blocks == 0:
            continue
        for hid in reversed(r.hash_ids):
            cache[hid] = None
            cache.move_to_end(hid)
            if len(cache) > capacity_blocks:
                cache.popitem(last=False)
    return {
        "capacity_blocks": capacity_blocks,
        "prompt_tokens": prompt_tokens,
        "prompt_blocks": prompt_blocks,
        "reused_tokens": reused_tokens,
        "reused_blocks": reused_blocks,
    }
