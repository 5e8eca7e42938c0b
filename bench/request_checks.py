"""What checking a request body costs the request path: the hand checks (`validation.py`) against
validating with the declarations they follow (`request_bodies`, pydantic), per body.

The request path runs the hand checks on every turn; `request_bodies` says why they are not
pydantic's. This script is where that figure comes from: chat bodies of 1 and 41 messages and a
completion of a text and of token ids, each checked both ways (`timeit`, best of `--repeat`
runs of `--number` calls). Rewrites the `## request checks` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable
from typing import Any

from bench import _common as c
from kvrelay.proxy.http import request_bodies, validate_chat, validate_completion

SECTION = "request checks"


def bodies() -> list[tuple[str, str, dict[str, Any]]]:
    """(label, declaration, body): what a turn's body looks like, short and long."""
    words = "lo mi ne su " * 25

    def chat(messages: int) -> dict[str, Any]:
        roles = ("user", "assistant")
        history = [{"role": roles[i % 2], "content": words} for i in range(messages)]
        return {"model": "m", "max_tokens": 16, "stream": True, "messages": history}

    return [
        ("chat, 1 message", "ChatRequest", chat(1)),
        ("chat, 41 messages", "ChatRequest", chat(41)),
        ("completion, text", "CompletionRequest", {"model": "m", "prompt": words}),
        ("completion, 512 token ids", "CompletionRequest", {"prompt": list(range(512))}),
    ]


def best_us(call: Callable[[], object], number: int, repeat: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--number", type=int, default=20_000, help="calls per timed run")
    p.add_argument("--repeat", type=int, default=7, help="timed runs; the best counts")
    p.add_argument("--no-results", action="store_true", help="do not rewrite bench/RESULTS.md")
    args = p.parse_args(argv)
    hand = {"ChatRequest": validate_chat, "CompletionRequest": validate_completion}
    lines = [
        c.run_header(),
        "",
        f"Best of {args.repeat} runs of {args.number} calls, one process. Hand: "
        "`validation.py`, what the request path runs; declared: `TypeAdapter.validate_python` "
        "of the same rules (`request_bodies`).",
        "",
        "| body | hand us | declared us | declared / hand |",
        "|---|---:|---:|---:|",
    ]
    for label, name, body in bodies():
        check, adapter = hand[name], request_bodies.adapters()[name]
        ours = best_us(lambda: check(body), args.number, args.repeat)  # noqa: B023
        theirs = best_us(lambda: adapter.validate_python(body), args.number, args.repeat)  # noqa: B023
        lines.append(f"| {label} | {ours:.2f} | {theirs:.2f} | {c.fmt_ratio(theirs / ours)} |")
    c.publish(SECTION, "\n".join(lines), args.no_results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
