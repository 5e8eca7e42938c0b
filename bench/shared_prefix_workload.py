"""A generated shared-prefix workload in the Mooncake trace format
(`python -m bench.shared_prefix_workload`): where reuse is prefixes shared across requests.

The conversation trace reuses mostly along conversations; production traffic also reuses what
many requests share: a long system prompt, a tool schema, a document several questions are
asked about. This workload is that case, shaped like SGLang's `generated-shared-prefix`
benchmark dataset (its parameters: `--gsp-num-groups`, `--gsp-prompts-per-group`,
`--gsp-system-prompt-len`, `--gsp-question-len`, `--gsp-output-len`; its defaults are 64, 16,
2048, 128 and 256): `groups` groups of requests, every request of a group starting with the
group's system prompt and ending with a short question of its own, in a random order, with
Poisson arrivals at `rate` requests per second. Each request is a conversation of one turn.

In the Mooncake format (`bench/_trace.py`): a group's system prompt is `system_tokens / 512`
blocks of its own ids, each question one (partial) block of an id nobody else has, so the
replayer makes the shared blocks the same text in every request of the group and the question
text unique. `system_tokens` must be a multiple of 512 (a shared block is a whole block).
Deterministic: the same parameters and seed give the same file, byte for byte.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from bench import _common as c
from bench._trace import TRACE_BLOCK_TOKENS

DEFAULT_OUT = c.WORK_DIR / "shared_prefix.jsonl"


def generate(
    groups: int,
    per_group: int,
    system_tokens: int,
    question_tokens: int,
    output_tokens: int,
    rate: float,
    seed: int,
) -> list[dict[str, Any]]:
    """The workload's requests in arrival order, as Mooncake-format objects."""
    if system_tokens <= 0 or system_tokens % TRACE_BLOCK_TOKENS:
        raise ValueError(f"system_tokens must be a positive multiple of {TRACE_BLOCK_TOKENS}")
    if not 0 < question_tokens <= TRACE_BLOCK_TOKENS:
        raise ValueError(f"question_tokens must be in 1..{TRACE_BLOCK_TOKENS}")
    if groups < 1 or per_group < 1 or rate <= 0 or output_tokens < 1:
        raise ValueError("groups, per_group, rate and output_tokens must be positive")
    rng = random.Random(seed)
    system_blocks = system_tokens // TRACE_BLOCK_TOKENS
    next_id = 0
    prompts: list[list[int]] = []
    for _ in range(groups):
        system = list(range(next_id, next_id + system_blocks))
        next_id += system_blocks
        for _ in range(per_group):
            prompts.append([*system, next_id])
            next_id += 1
    rng.shuffle(prompts)
    out: list[dict[str, Any]] = []
    t_s = 0.0
    for ids in prompts:
        out.append(
            {
                "timestamp": round(t_s * 1000),
                "input_length": system_tokens + question_tokens,
                "output_length": output_tokens,
                "hash_ids": ids,
            }
        )
        t_s += rng.expovariate(rate)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--groups", type=int, default=16, help="shared system prompts")
    p.add_argument("--per-group", type=int, default=16, help="requests per system prompt")
    p.add_argument("--system-tokens", type=int, default=2048, help="shared prefix length")
    p.add_argument("--question-tokens", type=int, default=128, help="each request's own part")
    p.add_argument("--output-tokens", type=int, default=256, help="tokens generated")
    p.add_argument("--rate", type=float, default=0.25, help="requests per trace second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    requests = generate(
        args.groups,
        args.per_group,
        args.system_tokens,
        args.question_tokens,
        args.output_tokens,
        args.rate,
        args.seed,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in requests), encoding="utf-8")
    print(f"{len(requests)} requests over {requests[-1]['timestamp'] / 1000:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
