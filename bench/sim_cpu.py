"""What the simulated engines cost the host's own CPU (`python -m bench.sim_cpu`).

The comparisons run a whole simulated fleet, its router or proxy and the load generator on the
same few cores, so every microsecond enginesim spends per token is one the modelled GPUs do not
have; `behind` in the trace comparison shows when that adds up. This measures it in one
process, the modelled waits skipped (a clock that the engine's waits advance, so nothing
sleeps), with the trace comparison's engine: its cost profile, tiny geometry, prefix caching:

- prefill: CPU per prompt token computed, `--requests` distinct prompts of `--prompt-tokens`;
- decode: CPU per generated token while those requests decode `--output-tokens` each, in the
  batches the engine schedules;
- tokenizer: CPU per token of a text it has never seen, and for the prompts of one
  conversation of `--turns` turns, each the previous prompt, its answer and a new question
  (what a chat engine encodes as a conversation goes on).

Best (least) of `--reps` repetitions, each on a fresh engine and tokenizer. Writes the
`## simulator CPU` section of bench/RESULTS.md unless `--no-results`.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from bench import _common as c
from kvrelay.enginesim.chat import render_chat
from kvrelay.enginesim.config import EngineConfig
from kvrelay.enginesim.engine import EngineCore
from kvrelay.enginesim.model import ModelGeometry
from kvrelay.enginesim.request import Output, SamplingParams, SimRequest
from kvrelay.enginesim.tokenizer import Tokenizer

SECTION = "simulator CPU"
PROFILE = "llama3-8b-h100"  # the trace comparison's default profile
GEOMETRY = ModelGeometry(num_layers=1, num_kv_heads=1, head_size=8)  # its engines' geometry
WORDS = ("block", "cache", "prefix", "turn", "decode", "token", "engine", "pool", "route")


class _SkippedWaits:
    """The engine's clock: each modelled wait moves it on at once."""

    def __init__(self) -> None:
        self.now = 0.0

    def wait(self, seconds: float) -> None:
        self.now += seconds

    def clock(self) -> float:
        return self.now


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--text-words", type=int, default=20000, help="words of the unseen text")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--section", default=SECTION)
    p.add_argument("--no-results", action="store_true")
    return p.parse_args(argv)


def engine_costs(args: argparse.Namespace) -> tuple[float, float]:
    """(CPU s per prompt token computed, CPU s per token generated in a step without prefill)
    of one fresh engine."""
    waits = _SkippedWaits()
    config = EngineConfig(
        cost_profile=PROFILE,
        geometry=GEOMETRY,
        enable_prefix_caching=True,
        num_blocks=args.requests * (args.prompt_tokens + args.output_tokens) // 16 + 64,
        max_model_len=args.prompt_tokens + args.output_tokens + 16,
        max_num_seqs=args.requests,
    )
    core = EngineCore(config, wait=waits.wait, clock=waits.clock)
    generated = 0

    def sink(out: Output) -> None:
        nonlocal generated
        generated += len(out.token_ids)

    rng = random.Random(0)
    for i in range(args.requests):
        prompt = [rng.randrange(3, 250) for _ in range(args.prompt_tokens)]
        core.add_request(
            SimRequest(
                request_id=f"r{i}",
                client_request_id=f"r{i}",
                prompt_token_ids=prompt,
                sampling=SamplingParams(max_tokens=args.output_tokens, ignore_eos=True),
                kv_transfer_params=None,
                sink=sink,
            )
        )
    # A step that computed prompt tokens counts as prefill (the few tokens it also sampled
    # with it), every other step as decode.
    prefill_s = decode_s = 0.0
    decoded = 0
    while core.busy:
        prefilled, sampled = core.counters["prefill_tokens_computed"], generated
        start = time.process_time()
        core.step()
        core.deliver_outputs()
        spent = time.process_time() - start
        if core.counters["prefill_tokens_computed"] > prefilled:
            prefill_s += spent
        else:
            decode_s += spent
            decoded += generated - sampled
    assert generated == args.requests * args.output_tokens, generated
    return prefill_s / core.counters["prefill_tokens_computed"], decode_s / decoded


def _text(words: int, rng: random.Random) -> str:
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(1000)}" for _ in range(words))


def tokenizer_costs(args: argparse.Namespace) -> tuple[float, float]:
    """(CPU s per token of an unseen text, CPU s for one conversation's prompts)."""
    rng = random.Random(1)
    text = _text(args.text_words, rng)
    tokenizer = Tokenizer()
    start = time.process_time()
    tokens = len(tokenizer.encode(text))
    per_token = (time.process_time() - start) / tokens
    messages: list[dict[str, str]] = [{"role": "system", "content": _text(400, rng)}]
    prompts = []
    for _ in range(args.turns):
        messages.append({"role": "user", "content": _text(300, rng)})
        prompts.append(render_chat(messages))
        messages.append({"role": "assistant", "content": _text(200, rng)})
    tokenizer = Tokenizer()
    start = time.process_time()
    for prompt in prompts:
        tokenizer.encode(prompt)
    return per_token, time.process_time() - start


def best_of(reps: int, measure: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    runs = [measure() for _ in range(reps)]
    return min(r[0] for r in runs), min(r[1] for r in runs)


def render(args: argparse.Namespace, engine: tuple[float, float], text: tuple[float, float]) -> str:
    prefill_s, decode_s = engine
    per_token_s, conversation_s = text
    return "\n".join(
        [
            f"Command: `python -m bench.sim_cpu --requests {args.requests} --prompt-tokens "
            f"{args.prompt_tokens} --output-tokens {args.output_tokens} --text-words "
            f"{args.text_words} --turns {args.turns} --reps {args.reps}` ({PROFILE}, the trace "
            "comparison's tiny geometry, best of the repetitions).",
            "",
            "| what | CPU |",
            "|---|---:|",
            f"| prefill, per prompt token computed | {prefill_s * 1e6:.2f} us |",
            f"| decode, per generated token ({args.requests} in the batch) | "
            f"{decode_s * 1e6:.1f} us |",
            f"| tokenizer, per token of an unseen text | {per_token_s * 1e9:.0f} ns |",
            f"| tokenizer, the prompts of a {args.turns}-turn conversation | "
            f"{conversation_s * 1e3:.1f} ms |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engine = best_of(args.reps, lambda: engine_costs(args))
    text = best_of(args.reps, lambda: tokenizer_costs(args))
    c.publish(args.section, render(args, engine, text), args.no_results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
