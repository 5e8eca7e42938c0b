"""Engine-facing HTTP client options, side by side against the same zero-work fake D.

What the proxy's upstream client costs, measured apart from everything else the proxy does:
each client in its own process (pinned to `--client-cpus`, default CPU 1) sends
`/v1/completions` to one fake decode engine (`bench/fake_engine.py`, pinned to `--engine-cpus`,
default CPU 0) over keep-alive connections, closed loop at each concurrency, JSON answers read
whole and SSE answers (16 chunks) read chunk by chunk as a relay would. Reported: requests/s,
p50 latency and the client process's CPU time per request (all its threads), medians over
interleaved rounds.

Clients:
- `aiohttp-default`: one `ClientSession` with default settings and a `ClientTimeout` object
  per request, as kvrelay's relay uses it today;
- `aiohttp-tuned`: one `ClientSession`, `TCPConnector(limit=0, ttl_dns_cache=None)`, no
  per-request timeout, no automatic decompression;
- `pyreqwest`: the Rust reqwest client behind an asyncio API (PyPI `pyreqwest`), HTTP/1.1 only;
- `h1`: `kvrelay.proxy.engines` (the proxy's engine client since this comparison picked it), a
  keep-alive HTTP/1.1 client on asyncio protocols with httptools.

All clients run on uvloop. Rewrites the `## http clients` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import _common as c
from bench._closed_loop import closed_loop

SECTION = "http clients"
CLIENTS = ("aiohttp-default", "aiohttp-tuned", "pyreqwest", "h1")
MODES = ("json", "sse")
PATH = "/v1/completions"

Sender = Callable[[bytes, dict[str, str]], Awaitable[int]]


# --------------------------------------------------------------------------- the client process


async def _aiohttp_sender(url: str, tuned: bool) -> tuple[Sender, Callable[[], Awaitable[None]]]:
    import aiohttp

    if tuned:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,
        )
    else:
        session = aiohttp.ClientSession()

    async def send(body: bytes, headers: dict[str, str]) -> int:
        timeout = None if tuned else aiohttp.ClientTimeout(total=600, sock_connect=5, sock_read=60)
        async with session.post(url, data=body, headers=headers, timeout=timeout) as resp:
            n = 0
            async for chunk in resp.content.iter_any():
                n += len(chunk)
            return n

    return send, session.close


async def _pyreqwest_sender(url: str) -> tuple[Sender, Callable[[], Awaitable[None]]]:
    from pyreqwest.client import ClientBuilder

    client = ClientBuilder().http1_only().tcp_nodelay(True).build()

    async def send(body: bytes, headers: dict[str, str]) -> int:
        request = client.post(url).headers(headers).body_bytes(body).build_streamed()
        n = 0
        async with request as resp:
            while (chunk := await resp.body_reader.read_chunk()) is not None:
                n += len(chunk)
        return n

    return send, client.close


async def _h1_sender(url: str) -> tuple[Sender, Callable[[], Awaitable[None]]]:
    from urllib.parse import urlsplit

    from kvrelay.proxy.engines import Upstream

    parts = urlsplit(url)
    upstream = Upstream(connect_timeout=5.0)
    origin = upstream.for_url(url)

    async def send(body: bytes, headers: dict[str, str]) -> int:
        resp = await origin.request(
            "POST", parts.path, body, headers.items(), read_timeout=60.0, total_timeout=600.0
        )
        n = 0
        async for chunk in resp.iter_chunks():
            n += len(chunk)
        return n

    async def close() -> None:
        upstream.close()

    return send, close


async def run_client(job: dict[str, Any]) -> dict[str, Any]:
    """One client, one mode, one concurrency: warm-up, then the measured closed loop."""
    url = job["url"] + PATH
    name = job["client"]
    if name.startswith("aiohttp"):
        send, close = await _aiohttp_sender(url, tuned=name == "aiohttp-tuned")
    elif name == "pyreqwest":
        send, close = await _pyreqwest_sender(url)
    else:
        send, close = await _h1_sender(url)
    conc, total = int(job["concurrency"]), int(job["requests"])
    warmup = max(conc, 32)
    stream = job["mode"] == "sse"
    words = "lorem " * 32
    bodies = [
        json.dumps(
            {"model": "fake", "prompt": f"request {i} {words}", "max_tokens": 16, "stream": stream}
        ).encode()
        for i in range(warmup + total)
    ]
    headers = [
        {"Content-Type": "application/json", "X-Request-Id": f"hc-{i}"}
        for i in range(warmup + total)
    ]
    latencies: list[float] = []
    errors: list[str] = []

    async def attempt(i: int, record: bool) -> None:
        start = time.perf_counter()
        try:
            n = await send(bodies[i], headers[i])
        except Exception as exc:  # any client's failure is a counted error, not a crash
            errors.append(f"{type(exc).__name__}: {exc}"[:200])
            return
        if record and n:
            latencies.append(time.perf_counter() - start)

    wall, cpu = await closed_loop(attempt, conc, warmup, total)
    await close()
    return {"latencies": latencies, "errors": len(errors), "error_samples": errors[:3],
            "wall_s": wall, "cpu_s": cpu}  # fmt: skip


def worker_main() -> int:
    job = json.loads(sys.stdin.read())
    import uvloop

    result = uvloop.run(run_client(job))
    sys.stdout.write(json.dumps(result))
    return 0


# --------------------------------------------------------------------------- the benchmark


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--requests", type=int, default=3000, help="requests per case and round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported")
    p.add_argument("--engine-cpus", default="0", help="CPUs of the fake D (taskset list)")
    p.add_argument("--client-cpus", default="1", help="CPUs of the client processes")
    p.add_argument("--json", default=str(c.WORK_DIR / "http_clients.json"))
    p.add_argument("--no-results", action="store_true", help="do not rewrite bench/RESULTS.md")
    p.add_argument("--quick", action="store_true", help="smoke run: c=1 and 64, 300 requests")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests, args.rounds = [1, 64], 300, 1
    return args


def run_one(job: dict[str, Any], cpus: str) -> dict[str, Any]:
    proc = subprocess.run(
        c.pinned([sys.executable, "-m", "bench.http_clients", "--worker"], cpus),
        input=json.dumps(job).encode(),
        capture_output=True,
        timeout=600,
        env=c.bench_env(),
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{job['client']} failed:\n{proc.stderr.decode()[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    engine = c.start_fake_engine("decode", "fake-d", args.engine_cpus)
    runs: dict[tuple[str, int, str], list[dict[str, float]]] = {}
    samples: dict[tuple[str, int, str], list[str]] = {}
    try:
        case_no = 0
        for rnd in range(args.rounds):
            for mode in args.modes:
                for conc in args.concurrency:
                    shift = case_no % len(args.clients)
                    case_no += 1
                    for client in args.clients[shift:] + args.clients[:shift]:
                        job = {"client": client, "mode": mode, "concurrency": conc,
                               "requests": args.requests, "url": engine.url}  # fmt: skip
                        r = run_one(job, args.client_cpus)
                        ok = max(len(r["latencies"]), 1)
                        s = {
                            "rps": len(r["latencies"]) / r["wall_s"] if r["wall_s"] else math.nan,
                            "p50": c.percentile(r["latencies"], 50),
                            "cpu_us": r["cpu_s"] / ok * 1e6,
                            "errors": float(r["errors"]),
                        }
                        runs.setdefault((mode, conc, client), []).append(s)
                        samples.setdefault((mode, conc, client), []).extend(r["error_samples"])
                        print(
                            f"round {rnd + 1} {mode:4s} c={conc:<4d} {client:16s} "
                            f"{s['rps']:8.0f} req/s p50 {c.fmt_ms(s['p50'])} ms "
                            f"CPU {s['cpu_us']:.0f} us/req err {int(s['errors'])}",
                            flush=True,
                        )
    finally:
        c.stop_all(engine.process)
    cases = []
    for (mode, conc, client), rs in runs.items():
        case: dict[str, Any] = {"mode": mode, "concurrency": conc, "client": client}
        for key in ("rps", "p50", "cpu_us"):
            case[key] = statistics.median(r[key] for r in rs)
        case["errors"] = sum(r["errors"] for r in rs)
        case["error_samples"] = samples[(mode, conc, client)][:3]
        cases.append(case)
    cases.sort(key=lambda x: (MODES.index(x["mode"]), x["concurrency"], CLIENTS.index(x["client"])))
    return cases


def render(cases: list[dict[str, Any]], args: argparse.Namespace, header: str) -> str:
    lines = [header, ""]
    lines.append(
        f"One fake D (`bench/fake_engine.py`) on CPU {args.engine_cpus}, each client in its own "
        f"process on CPU {args.client_cpus} (uvloop), keep-alive, closed loop; `/v1/completions` "
        f"JSON answers read whole, SSE answers (16 chunks) read chunk by chunk; {args.requests} "
        f"requests per case and round, {args.rounds} interleaved rounds, medians. Client CPU = "
        "the client process's CPU time (all threads) per request. Ratios vs `aiohttp-tuned`."
    )
    lines += ["", "| mode | conc | client | req/s | ratio | p50 ms | client CPU us/req | ratio "
              "| errors |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for x in cases:
        ref = next(
            (y for y in cases if (y["mode"], y["concurrency"], y["client"])
             == (x["mode"], x["concurrency"], "aiohttp-tuned")),
            None,
        )  # fmt: skip
        rps_ratio = x["rps"] / ref["rps"] if ref and ref["rps"] else math.nan
        cpu_ratio = x["cpu_us"] / ref["cpu_us"] if ref and ref["cpu_us"] else math.nan
        lines.append(
            f"| {x['mode']} | {x['concurrency']} | {x['client']} | {x['rps']:.0f} "
            f"| {c.fmt_ratio(rps_ratio)} | {c.fmt_ms(x['p50'])} | {x['cpu_us']:.0f} "
            f"| {c.fmt_ratio(cpu_ratio)} | {int(x['errors'])} |"
        )
    lines += ["", *_verdict(cases)]
    return "\n".join(lines)


def _verdict(cases: list[dict[str, Any]]) -> list[str]:
    """Per client: in how many cases it had the most req/s and the least client CPU."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for x in cases:
        groups.setdefault((x["mode"], x["concurrency"]), []).append(x)
    fastest: dict[str, int] = {}
    leanest: dict[str, int] = {}
    for group in groups.values():
        top = max(group, key=lambda y: y["rps"])["client"]
        lean = min(group, key=lambda y: y["cpu_us"])["client"]
        fastest[top] = fastest.get(top, 0) + 1
        leanest[lean] = leanest.get(lean, 0) + 1
    n = len(groups)
    out = [
        f"- `{name}`: most req/s in {fastest.get(name, 0)} of {n} cases, least client CPU per "
        f"request in {leanest.get(name, 0)} of {n}"
        for name in sorted({x["client"] for x in cases})
    ]
    out.append(
        "\nThe proxy's engine client is `h1`, now `kvrelay.proxy.engines` (P, D and side-channel "
        "calls); aiohttp's client stays for health probes, load scrapes, `/v1/models` and the "
        "pass-through routes."
    )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main()
    header = c.run_header()
    started = time.monotonic()
    cases = measure(args)
    c.write_json(Path(args.json), {"cases": cases, "header": header})
    text = render(cases, args, header)
    c.publish(
        SECTION, text, args.no_results, wrote=f"{args.json} in {time.monotonic() - started:.0f}s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
