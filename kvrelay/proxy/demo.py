"""`kvrelay demo` (`make demo`): a local fleet and a five-turn chat that shows the reuse.

Starts one prefill and one decode enginesim and the proxy (in-memory map) on 127.0.0.1, runs
five chat turns through the proxy and prints, per turn, the prompt tokens, the tokens P pulled
from D, the tokens P computed and the latency (read from the engines' /metrics). Then it keeps
serving and prints how to talk to the proxy until Ctrl-C, which stops every process.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

import httpx

from kvrelay.devtools import DevFleet, fleet_env, free_port, prometheus

QUESTIONS = (
    "Hello! I am planning a trip to the mountains. What should I pack?",
    "Good list. How warm should the sleeping bag be for nights near freezing?",
    "And what about water: how much should I carry for a day of hiking?",
    "Could you summarise everything so far as a short checklist?",
    "Thanks. One last question: what is the best time of day to start the hike?",
)


def scrape(url: str) -> dict[str, float]:
    """Each metric of an engine's /metrics page, summed over its labels."""
    return prometheus.totals(prometheus.scrape(url))


def run_chat(proxy: str, p_url: str, max_tokens: int) -> list[dict[str, Any]]:
    """Five turns; per turn the token accounting from P's counters."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a concise outdoor guide."}
    ]
    rows = []
    with httpx.Client(base_url=proxy, timeout=120) as client:
        for i, question in enumerate(QUESTIONS, 1):
            messages.append({"role": "user", "content": question})
            before = scrape(p_url)
            start = time.perf_counter()
            resp = client.post(
                "/v1/chat/completions",
                json={"model": "kvrelay-sim", "messages": messages, "max_tokens": max_tokens},
            )
            latency = time.perf_counter() - start
            resp.raise_for_status()
            data = resp.json()
            after = scrape(p_url)
            reply = data["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": reply})
            rows.append(
                {
                    "turn": i,
                    "prompt_tokens": data["usage"]["prompt_tokens"],
                    "pulled": int(
                        after.get("enginesim_prompt_tokens_loaded_total", 0)
                        - before.get("enginesim_prompt_tokens_loaded_total", 0)
                    ),
                    "computed": int(
                        after.get("enginesim_prompt_tokens_computed_total", 0)
                        - before.get("enginesim_prompt_tokens_computed_total", 0)
                    ),
                    "latency_ms": latency * 1000,
                    "reply": reply,
                }
            )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'turn':>4} {'prompt tok':>10} {'pulled from D':>13} {'computed on P':>13} "
        f"{'latency ms':>10}"
    )
    for r in rows:
        print(
            f"{r['turn']:>4} {r['prompt_tokens']:>10} {r['pulled']:>13} {r['computed']:>13} "
            f"{r['latency_ms']:>10.1f}"
        )
    total_prompt = sum(r["prompt_tokens"] for r in rows)
    total_pulled = sum(r["pulled"] for r in rows)
    print(
        f"\n{total_pulled} of {total_prompt} prompt tokens came from D's KV instead of being "
        "recomputed on P."
    )


def usage_text(proxy: str) -> str:
    return f"""
The proxy keeps serving at {proxy} (Ctrl-C stops everything).

  curl -s {proxy}/v1/chat/completions -H 'Content-Type: application/json' \\
       -H 'X-Conversation-Id: my-chat' \\
       -d '{{"model": "kvrelay-sim", "max_tokens": 32,
            "messages": [{{"role": "user", "content": "Hi there"}}]}}'

  python - <<'EOF'
  from openai import OpenAI
  client = OpenAI(base_url="{proxy}/v1", api_key="unused")
  r = client.chat.completions.create(model="kvrelay-sim", max_tokens=32,
      messages=[{{"role": "user", "content": "Hi there"}}])
  print(r.choices[0].message.content)
  EOF

  realized reuse (prompt tokens not recomputed, by leg; kvrelay_reuse_total counts only
  map lookups): curl -s {proxy}/metrics | grep kvrelay_tokens_reused_total
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrelay demo", description=__doc__)
    parser.add_argument("--port", type=int, default=8000, help="proxy port (if free)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--no-serve", action="store_true", help="exit after the chat")
    args = parser.parse_args(argv)

    env = fleet_env()
    # The demo shows D->P reuse turn by turn: every turn through P (docs/OPERATIONS.md,
    # "Routing policy").
    env.setdefault("KVRELAY_ROUTING_POLICY", "always_p")
    fleet = DevFleet(
        engine_args=("--log-level", "WARNING", "--prefill-us-per-token", "200"),
        engine_base_args=(),
        proxy_args=("--map-url", "memory://", "--log-level", "WARNING"),
        proxy_port=free_port(preferred=args.port),
        proxy_name="proxy",
        flags=True,
        env=env,
        name="demo-",
        ready_timeout=120,
    )
    # A plain flag, not a threading.Event: a handler runs between the main thread's bytecodes,
    # possibly while that thread holds the Event's lock inside `wait`, and `set` would then
    # wait for that lock forever (the demo hung on a signal so). Assigning takes no lock.
    stopping: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        print("starting prefill engine, decode engine and proxy on 127.0.0.1 ...", flush=True)
        fleet.start()
        assert fleet.proxy is not None
        p_url, d_url = fleet.prefill_engines[0].url, fleet.decode_engines[0].url
        proxy_url = fleet.proxy.url
        print(f"  P {p_url}   D {d_url}   proxy {proxy_url}")
        rows = run_chat(proxy_url, p_url, args.max_tokens)
        for r in rows:
            print(
                f"\n[turn {r['turn']}] user: {QUESTIONS[r['turn'] - 1]}\n"
                f"         assistant: {r['reply'][:160]!r}"
            )
        print_table(rows)
        if args.no_serve:
            return 0
        print(usage_text(proxy_url), flush=True)
        while not stopping and fleet.alive:
            time.sleep(0.5)  # a signal ends the sleep early; its handler has run by then
        return 0
    except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        print("\nstopping ...", flush=True)
        fleet.stop()
        print("stopped.")
