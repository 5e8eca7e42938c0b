"""Pass-through routes, `/v1/models` and the unknown-model 404.

Against enginesim (the engine answers the routes in vLLM's shapes) and against a fake upstream
(`tests/proxy/fake_upstream.py`) for what enginesim cannot show: that a stream is relayed as
it arrives, what exactly is forwarded, a retry after a dead engine, a stream cut mid-way.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kvrelay.devtools import ProxiedPair, ProxyFactory, sse
from tests.harness import free_port, wait_until
from tests.proxy.fake_upstream import FakeUpstream

MODEL = "kvrelay-sim"


def _not_found(resp: httpx.Response) -> None:
    assert resp.status_code == 404, resp.text
    error = resp.json()["error"]
    assert error["code"] == "model_not_found"
    assert error["type"] == "not_found_error"
    assert error["param"] == "model"
    assert "GET /v1/models" in error["message"]


@pytest.fixture
def fake() -> Iterator[FakeUpstream]:
    upstream = FakeUpstream().start()
    try:
        yield upstream
    finally:
        upstream.stop()


# -- enginesim ------------------------------------------------------------------------------


def test_tokenize_detokenize_embeddings_and_responses_pass_through(pd_fleet: ProxiedPair) -> None:
    with httpx.Client(base_url=pd_fleet.proxy.url, timeout=30) as client:
        tok = client.post("/tokenize", json={"model": MODEL, "prompt": "hello there"})
        assert tok.status_code == 200, tok.text
        tokens = tok.json()["tokens"]
        assert tok.json()["count"] == len(tokens) > 0
        detok = client.post("/detokenize", json={"model": MODEL, "tokens": tokens})
        assert detok.json() == {"prompt": "hello there"}

        emb = client.post("/v1/embeddings", json={"model": MODEL, "input": ["a b", "c"]})
        assert emb.status_code == 200, emb.text
        vectors = [d["embedding"] for d in emb.json()["data"]]
        assert len(vectors) == 2 and vectors[0] != vectors[1]
        again = client.post("/v1/embeddings", json={"model": MODEL, "input": "a b"})
        assert again.json()["data"][0]["embedding"] == vectors[0]  # deterministic

        resp = client.post("/v1/responses", json={"model": MODEL, "input": "hi"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["object"] == "response" and resp.json()["status"] == "completed"
        text = resp.json()["output"][0]["content"][0]["text"]

        streamed = client.post(
            "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}
        )
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(d) for d in sse.data_fields(streamed.content)]
        assert events[0]["type"] == "response.created"
        assert events[-1]["type"] == "response.completed"
        deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
        assert "".join(deltas) == text
    # Neither the P engine nor D's connector was involved: nothing held anywhere.
    assert pd_fleet.prefill.metric("enginesim_requests_total") == 0
    pd_fleet.wait_clean()
    samples = pd_fleet.proxy.metrics()
    assert samples['kvrelay_passthrough_total{outcome="ok",route="/v1/responses"}'] == 2
    assert samples['kvrelay_passthrough_total{outcome="ok",route="/tokenize"}'] == 1


def test_unknown_model_is_an_openai_404_on_every_route(pd_fleet: ProxiedPair) -> None:
    before = pd_fleet.decode.metric("enginesim_requests_total")
    with httpx.Client(base_url=pd_fleet.proxy.url, timeout=30) as client:
        _not_found(client.post("/v1/embeddings", json={"model": "nope", "input": "x"}))
        _not_found(client.post("/v1/chat/completions", json={
            "model": "nope", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        }))  # fmt: skip
        _not_found(
            client.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2})
        )
        # No engine was asked.
        assert pd_fleet.decode.metric("enginesim_requests_total") == before
        ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_models_merges_the_fleet_once_per_id(
    pd_fleet: ProxiedPair, proxy_factory: ProxyFactory
) -> None:
    other = FakeUpstream(models=("other-model", MODEL)).start()
    try:
        proxy = proxy_factory([pd_fleet.prefill], [pd_fleet.decode, other.url])
        with httpx.Client(base_url=proxy.url, timeout=30) as client:
            listed = client.get("/v1/models").json()
            assert listed["object"] == "list"
            assert sorted(m["id"] for m in listed["data"]) == [MODEL, "other-model"]
            # A model only the fake serves is known to the proxy (the fake answers it).
            resp = client.post("/v1/embeddings", json={"model": "other-model", "input": "x"})
            assert resp.status_code == 200 and resp.json()["path"] == "/v1/embeddings"
    finally:
        other.stop()


# -- fake upstream --------------------------------------------------------------------------


def test_stream_is_relayed_as_it_arrives(fake: FakeUpstream, proxy_factory: ProxyFactory) -> None:
    proxy = proxy_factory([fake.url], [fake.url])
    body = {"model": MODEL, "input": "x", "stream": True}
    with (
        httpx.Client(base_url=proxy.url, timeout=30) as client,
        client.stream("POST", "/v1/responses", json=body) as resp,
    ):
        assert resp.status_code == 200
        chunks = resp.iter_bytes()
        received = b""
        while b"\n\n" not in received:
            received += next(chunks)
        # The first event arrived while the fake still holds the rest back.
        assert b'"n":1' in received and not fake.gate.is_set()
        fake.gate.set()
        received += b"".join(chunks)
    assert [json.loads(d)["n"] for d in sse.data_fields(received)] == [1, 2]


def test_forwarded_body_has_no_kv_transfer_params_and_no_client_key(
    fake: FakeUpstream, proxy_factory: ProxyFactory
) -> None:
    proxy = proxy_factory([fake.url], [fake.url], api_keys="key-a")
    body = {"model": MODEL, "input": "x", "kv_transfer_params": {"do_remote_prefill": True}}
    resp = httpx.post(
        proxy.url + "/v1/embeddings?user=7",
        json=body,
        headers={"Authorization": "Bearer key-a", "X-Request-Id": "client-1"},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"] == "client-1"
    seen = fake.seen[-1]
    sent = json.loads(seen.body)
    assert isinstance(sent.pop("cache_salt"), str)  # the tenant's, set by the proxy
    assert sent == {"model": MODEL, "input": "x"}
    assert seen.query == "user=7"
    assert "authorization" not in seen.headers
    assert seen.headers["x-request-id"].startswith("client-1-")  # the upstream id
    # Without the key: refused before any engine sees it.
    refused = httpx.post(proxy.url + "/v1/embeddings", json=body, timeout=30)
    assert refused.status_code == 401 and len(fake.seen) == 1


def test_dead_engine_is_skipped_by_a_retry(fake: FakeUpstream, proxy_factory: ProxyFactory) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    # Probes far apart: the dead engine is still in the pool when the request comes.
    proxy = proxy_factory([fake.url], [dead, fake.url], probe_interval_s="60")
    resp = httpx.post(proxy.url + "/tokenize", json={"prompt": "x"}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["path"] == "/tokenize"
    samples = proxy.metrics()
    assert samples['kvrelay_retries_total{leg="passthrough"}'] == 1
    backends = proxy.call("GET", "/ready")[1]
    assert backends["decode_healthy"] == 2  # one failure (+ one probe) does not eject it


def test_all_engines_dead_is_a_shaped_503(proxy_factory: ProxyFactory) -> None:
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    proxy = proxy_factory(dead[:1], dead, probe_interval_s="60")
    resp = httpx.post(proxy.url + "/v1/embeddings", json={"input": "x"}, timeout=30)
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert error["code"] == "backends_unavailable"
    assert "127.0.0.1" not in error["message"]  # engines are named, never addressed


def test_engine_error_and_cut_stream_reach_the_client(
    fake: FakeUpstream, proxy_factory: ProxyFactory
) -> None:
    proxy = proxy_factory([fake.url], [fake.url])
    cut = {"model": MODEL, "input": "x", "stream": True, "cut": True}
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(proxy.url + "/v1/responses", json=cut, timeout=30)
    fake.status = 500
    failed = httpx.post(proxy.url + "/v1/embeddings", json={"input": "x"}, timeout=30)
    assert failed.status_code == 500 and failed.json() == {"error": {"message": "fake failure"}}
    wait_until(
        lambda: (
            proxy.metrics().get(
                'kvrelay_passthrough_total{outcome="upstream_cut",route="/v1/responses"}'
            )
            == 1
        ),
        timeout=10,
    )
    assert (
        proxy.metrics()[
            'kvrelay_passthrough_total{outcome="upstream_error",route="/v1/embeddings"}'
        ]
        == 1
    )


SMUGGLED: list[object] = ["x", ["a"], {"do_remote_prefill": True, "remote_host": "169.254.169.254"}]


@pytest.mark.parametrize("value", SMUGGLED, ids=["str", "list", "dict"])
def test_kv_transfer_params_inside_vllm_xargs_never_reach_an_engine(
    fake: FakeUpstream, proxy_factory: ProxyFactory, value: object
) -> None:
    # vLLM copies vllm_xargs into the sampling params' extra_args, where its scheduler reads
    # kv_transfer_params: smuggled there, they would reach the connector (a str crashes the
    # engine core). Every route, each leg: gone; the client's other xargs are kept.
    proxy = proxy_factory([fake.url], [fake.url])
    xargs = {"kv_transfer_params": value, "keep": 1}
    requests = [
        ("/v1/responses", {"model": MODEL, "input": "x", "vllm_xargs": xargs}),
        ("/tokenize", {"model": MODEL, "prompt": "x", "vllm_xargs": xargs}),
        # The fake P answers without params: D runs decode-only, a leg with no params of ours.
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "vllm_xargs": xargs}),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "vllm_xargs": xargs},
        ),
    ]
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        for path, body in requests:
            client.post(path, json=body)
    forwarded = [s for s in fake.seen if s.path.startswith(("/v1/", "/tokenize"))]
    assert {s.path for s in forwarded} == {path for path, _ in requests}
    for seen in forwarded:
        sent = json.loads(seen.body)
        assert "kv_transfer_params" not in sent.get("vllm_xargs", {}), (seen.path, sent)
        assert sent["vllm_xargs"]["keep"] == 1, (seen.path, sent)
        # Only the proxy's own params (P leg), never the client's.
        theirs = sent.get("kv_transfer_params") or {}
        assert theirs.get("remote_host") != "169.254.169.254", (seen.path, sent)


def test_the_token_in_routes_sampling_extra_args_lose_their_connector_params(
    fake: FakeUpstream, proxy_factory: ProxyFactory
) -> None:
    # vLLM's /inference/v1/generate takes a whole SamplingParams object; its extra_args'
    # kv_transfer_params reach the scheduler (a string kills the engine core). Allowed as a
    # pass-through route, they are gone; every other sampling field is kept.
    route = "/inference/v1/generate"
    proxy = proxy_factory([fake.url], [fake.url], passthrough_routes=route)
    sampling = {"max_tokens": 3, "extra_args": {"kv_transfer_params": "x", "keep": 1}}
    body = {"model": MODEL, "token_ids": [1, 2, 3], "sampling_params": sampling}
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        client.post(route, json=body)
    (seen,) = [s for s in fake.seen if s.path == route]
    sent = json.loads(seen.body)
    assert sent["sampling_params"] == {"max_tokens": 3, "extra_args": {"keep": 1}}
    assert sent["token_ids"] == [1, 2, 3]


def test_routes_that_compute_kv_carry_the_tenants_cache_salt(
    fake: FakeUpstream, proxy_factory: ProxyFactory
) -> None:
    # A generating route's usage reports cached tokens too: it gets the tenant's salt (the
    # client's own folded in); routes that compute no KV get none.
    proxy = proxy_factory([fake.url], [fake.url], api_keys="key-a,key-b")
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        for key in ("key-a", "key-b"):
            auth = {"Authorization": f"Bearer {key}"}
            client.post("/v1/responses", json={"model": MODEL, "input": "x"}, headers=auth)
            client.post("/tokenize", json={"model": MODEL, "prompt": "x"}, headers=auth)
            odd = {"model": MODEL, "input": "x", "cache_salt": "a/b"}
            bad = client.post("/v1/responses", json=odd, headers=auth)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
    routes = ("/v1/responses", "/tokenize")
    resp_a, tok_a, resp_b, tok_b = [json.loads(s.body) for s in fake.seen if s.path in routes]
    assert isinstance(resp_a["cache_salt"], str) and isinstance(resp_b["cache_salt"], str)
    assert resp_a["cache_salt"] != resp_b["cache_salt"]
    assert "cache_salt" not in tok_a and "cache_salt" not in tok_b


def test_strip_connector_fields_is_the_one_place_that_removes_them() -> None:
    from kvrelay.proxy.base import strip_connector_fields

    xargs = {"kv_transfer_params": {"a": 1}, "keep": "y"}
    body = {"kv_transfer_params": {"b": 2}, "vllm_xargs": xargs, "model": MODEL}
    assert strip_connector_fields(body) == {"vllm_xargs": {"keep": "y"}, "model": MODEL}
    assert xargs == {"kv_transfer_params": {"a": 1}, "keep": "y"}  # the caller's dict untouched
    odd = {"vllm_xargs": "not an object"}
    assert strip_connector_fields(odd) == {"vllm_xargs": "not an object"}  # the engine's 400
    sampling = {"extra_args": {"kv_transfer_params": {"a": 1}, "keep": 2}, "max_tokens": 3}
    token_in = {"sampling_params": sampling}
    assert strip_connector_fields(token_in) == {
        "sampling_params": {"extra_args": {"keep": 2}, "max_tokens": 3}
    }
    assert sampling["extra_args"] == {"kv_transfer_params": {"a": 1}, "keep": 2}
