"""A bare P→D relay for the proxy-bound mode: what a Python router costs with no features.

`python -m bench.bare_relay --port N --prefill URL --decode URL`. It answers
`/v1/completions` and `/v1/chat/completions` on aiohttp's server (uvloop, no middlewares)
and calls the engines with kvrelay's own engine client (`kvrelay.proxy.engines.upstream`): P with
`max_tokens` 1 and `do_remote_decode`, then D with P's params, D's answer relayed (JSON
re-encoded without `kv_transfer_params`; streams passed through chunk by chunk). No
conversation map, no holds, no side channel, no limits, no retries, no metrics, no error
shaping. What kvrelay costs beyond this is the price of its features; what this costs against
vllm-router is the price of Python, aiohttp and the engine client.
"""

from __future__ import annotations

import argparse

import orjson
import uvloop
from aiohttp import web

from kvrelay.proxy.engines import Upstream

_JSON_HEADERS = (("Content-Type", "application/json"),)
_TIMEOUTS = {"read_timeout": 60.0, "total_timeout": 300.0}


def make_app(prefill_url: str, decode_url: str) -> web.Application:
    upstream = Upstream(connect_timeout=5.0)
    prefill, decode = upstream.for_url(prefill_url), upstream.for_url(decode_url)

    async def relay(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        p_body = {**body, "max_tokens": 1, "stream": False}
        p_body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        answer = await prefill.request(
            "POST", request.path, orjson.dumps(p_body), _JSON_HEADERS, **_TIMEOUTS
        )
        params = orjson.loads(await answer.read()).get("kv_transfer_params")
        body["kv_transfer_params"] = params
        answer = await decode.request(
            "POST", request.path, orjson.dumps(body), _JSON_HEADERS, **_TIMEOUTS
        )
        if body.get("stream"):
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in answer.iter_chunks():
                await out.write(chunk)
            await out.write_eof()
            return out
        data = orjson.loads(await answer.read())
        data.pop("kv_transfer_params", None)
        return web.Response(body=orjson.dumps(data), content_type="application/json")

    async def ready(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def close_upstream(app: web.Application) -> None:
        upstream.close()

    app = web.Application()
    app.router.add_post("/v1/completions", relay)
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_get("/ready", ready)
    app.on_cleanup.append(close_upstream)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True, help="P's base URL")
    p.add_argument("--decode", required=True, help="D's base URL")
    args = p.parse_args(argv)
    uvloop.install()
    web.run_app(
        make_app(args.prefill, args.decode),
        host=args.host, port=args.port, access_log=None, print=None,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
