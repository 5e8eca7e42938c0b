"""Closed-loop HTTP load generator, run in its own process by the benchmarks.

Reads one JSON job on stdin, sends a fixed number of chat or completion requests with a fixed
number of concurrent clients (aiohttp on uvloop, keep-alive connections), and writes one JSON
result (to the job's `out` file, else stdout): per-request latency (send to last byte), time to
first byte, errors and wall time. Benchmarks start it with `run_in_process` and read the result
with `summarize`.

It runs in a separate process so its CPU time is never mistaken for the server's event loop,
and request bodies are built before the clock starts so the client costs as little as possible.

`mode`:
- `single`: POST the body to `url` (a router, or one engine directly).
- `pd`: the two legs a P/D router makes, done by the client itself against the engines, as
  the no-router baseline: P with `max_tokens=1` and `do_remote_decode`, then D with the
  `kv_transfer_params` P returned. Same engine work as a router, no extra hop.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import _common as c
from bench._closed_loop import closed_loop

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def build_bodies(job: dict[str, Any], n: int, tag: str) -> list[dict[str, Any]]:
    """Distinct bodies: a unique prompt per request so no router finds reuse.

    `route` "chat" (default) sends `/v1/chat/completions` messages, "completions" a `prompt`.
    """
    words = " ".join(["lorem"] * int(job.get("prompt_words", 32)))
    completions = job.get("route") == "completions"
    history = _history(int(job.get("history_turns", 0)), int(job.get("history_words", 100)))
    bodies = []
    for i in range(n):
        body: dict[str, Any] = {"model": job.get("model", "kvrelay-sim")}
        text = f"request {tag}-{i}: {words}"
        if completions:
            body["prompt"] = text
        else:
            body["messages"] = [*history, {"role": "user", "content": text}]
        body.update(
            max_tokens=int(job.get("max_tokens", 8)),
            temperature=0,
            stream=bool(job.get("stream", False)),
        )
        bodies.append(body)
    return bodies


def _history(turns: int, words: int) -> list[dict[str, str]]:
    """`turns` earlier user/assistant exchanges of `words` words per message: a long chat
    resent whole with every request, as chat clients do."""
    out = [{"role": "system", "content": "You are a helpful assistant."}] if turns else []
    for t in range(turns):
        out.append({"role": "user", "content": f"question {t}: " + " ".join(["lorem"] * words)})
        out.append({"role": "assistant", "content": f"answer {t}: " + " ".join(["ipsum"] * words)})
    return out


def build_headers(job: dict[str, Any], n: int, tag: str) -> list[dict[str, str]]:
    """Per-request headers; with `conversation_ids` each request opens its own conversation
    (`X-Conversation-Id`), so kvrelay asks D to hold and stores D's params, as for a first turn.
    Routers that know no conversations ignore the header."""
    base = {"Content-Type": "application/json"}
    if not job.get("conversation_ids"):
        return [base] * n
    return [{**base, "X-Conversation-Id": f"conv-{tag}-{i}"} for i in range(n)]


async def _read_answer(resp: aiohttp.ClientResponse, what: str) -> float:
    """Reads the whole answer; the clock time of its first byte (0.0 when it had none)."""
    first = 0.0
    async for _chunk in resp.content.iter_any():
        if not first:
            first = time.perf_counter()
    if resp.status != 200:
        raise RuntimeError(f"{what}HTTP {resp.status}")
    return first


async def one_single(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]
) -> tuple[float, float]:
    start = time.perf_counter()
    async with session.post(url, data=body, headers=headers) as resp:
        first = await _read_answer(resp, "")
    end = time.perf_counter()
    return end - start, (first or end) - start


async def one_pd(
    session: aiohttp.ClientSession, p_url: str, d_url: str, body: dict[str, Any]
) -> tuple[float, float]:
    start = time.perf_counter()
    p_body = dict(body)
    p_body.update(stream=False, max_tokens=1, kv_transfer_params=PREFILL_PARAMS)
    async with session.post(p_url, json=p_body) as resp:
        p_json = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"P HTTP {resp.status}")
    params = p_json.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise RuntimeError("P returned no kv_transfer_params")
    d_body = dict(body)
    d_body["kv_transfer_params"] = {**params, "do_remote_prefill": True, "do_remote_decode": False}
    async with session.post(d_url, json=d_body) as resp:
        first = await _read_answer(resp, "D ")
    end = time.perf_counter()
    return end - start, (first or end) - start


async def run(job: dict[str, Any]) -> dict[str, Any]:
    concurrency = int(job["concurrency"])
    total = int(job["requests"])
    warmup = int(job.get("warmup", concurrency))
    mode = job.get("mode", "single")
    tag = str(job.get("tag", "x"))
    dicts = build_bodies(job, warmup + total, tag)
    raw = [json.dumps(b).encode() for b in dicts]
    headers = build_headers(job, warmup + total, tag)
    completions = job.get("route") == "completions"
    path = job.get("path", "/v1/completions" if completions else "/v1/chat/completions")

    async def send(session: aiohttp.ClientSession, i: int) -> tuple[float, float]:
        if mode == "pd":
            return await one_pd(session, job["p_url"] + path, job["d_url"] + path, dicts[i])
        return await one_single(session, job["url"] + path, raw[i], headers[i])

    latencies: list[float] = []
    ttfbs: list[float] = []
    errors: list[str] = []
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=float(job.get("timeout_s", 120)))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def attempt(i: int, record: bool) -> None:
            try:
                lat, first = await send(session, i)
            except (TimeoutError, aiohttp.ClientError, RuntimeError, ValueError) as e:
                if record:
                    errors.append(f"{type(e).__name__}: {e}"[:200])
                return
            if record:
                latencies.append(lat)
                ttfbs.append(first)

        # Warm-up opens the keep-alive connections (and the routers' upstream pools).
        wall, cpu = await closed_loop(attempt, concurrency, warmup, total)
    return {
        "latencies": latencies,
        "ttfbs": ttfbs,
        "errors": len(errors),
        "error_samples": errors[:5],
        "wall_s": wall,
        "cpu_s": cpu,  # the load generator's own CPU time over the measured requests
        "warmup": warmup,
        "requests": total,
        "concurrency": concurrency,
    }


def run_in_process(
    job: dict[str, Any], cpus: str | None = None, timeout: float = 600.0
) -> dict[str, Any]:
    """Run `job` in a load-generator process (pinned to `cpus`); return its JSON result.

    The result comes back through a file: results of thousands of requests outgrow a pipe.
    """
    with tempfile.TemporaryDirectory(prefix="kvrelay-loadgen-") as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.run(
            c.pinned([sys.executable, "-m", "bench._loadgen"], cpus),
            input=json.dumps({**job, "out": str(out)}).encode(),
            capture_output=True,
            timeout=timeout,
            env=c.bench_env(),
            check=False,
            cwd=c.REPO_ROOT,
        )
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"load generator failed:\n{proc.stderr.decode()[-4000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
    return result


def summarize(result: dict[str, Any]) -> dict[str, float]:
    """Throughput, latency and time-to-first-byte percentiles and errors of one result."""
    lat, ttfb = result["latencies"], result["ttfbs"]
    return {
        "rps": len(lat) / result["wall_s"] if result["wall_s"] > 0 else math.nan,
        "p50": c.percentile(lat, 50),
        "p99": c.percentile(lat, 99),
        "ttfb_p50": c.percentile(ttfb, 50),
        "ttfb_p99": c.percentile(ttfb, 99),
        "errors": float(result["errors"]),
    }


def main() -> int:
    job = json.loads(sys.stdin.read())
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(run(job))
    else:
        result = uvloop.run(run(job))
    if job.get("out"):
        # A file, not stdout: results of thousands of requests outgrow a pipe's buffer, and a
        # pipe write can come back short once the event loop has made the descriptor non-blocking.
        with open(job["out"], "w") as f:
            f.write(json.dumps(result))
    else:
        sys.stdout.write(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
