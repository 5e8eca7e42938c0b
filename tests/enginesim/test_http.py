"""One enginesim over real HTTP: OpenAI shapes, streaming, validation, faults, disconnects."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvrelay.devtools import EngineFactory, EngineSim, sse
from kvrelay.enginesim.reference import reference_chat, reference_completion
from tests.harness import wait_until


@pytest.fixture(scope="module")
def solo_engine() -> Iterator[EngineSim]:
    """One engine without connector shared by this module (start-up is the slow part)."""
    factory = EngineFactory()
    try:
        yield factory("solo", "--num-blocks", "64", "--max-model-len", "512", connector=False)
    finally:
        factory.close()


@pytest.fixture
def engine(solo_engine: EngineSim) -> Iterator[EngineSim]:
    """The shared engine with faults cleared; its pool must be back to the start afterwards."""
    solo_engine.request("/admin/faults", {"fail_next_n": 0, "refuse_admission": False,
                                          "delay_ms": 0})  # fmt: skip
    yield solo_engine
    solo_engine.wait_idle()


def sse_events(text: str) -> list[Any]:
    """The stream's JSON events, then "[DONE]" when the stream ended with it."""
    stream = sse.parse(text)
    return [*stream.events, *(["[DONE]"] if stream.done else [])]


def test_completion_shape_and_reference(engine: EngineSim) -> None:
    status, body = engine.request(
        "/v1/completions", {"model": "kvrelay-sim", "prompt": "Hello there", "max_tokens": 12},
        headers={"X-Request-Id": "abc-1"},
    )  # fmt: skip
    assert status == 200
    assert body["id"] == "cmpl-abc-1" and body["object"] == "text_completion"
    assert body["model"] == "kvrelay-sim" and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["text"] == reference_completion("Hello there", 12)
    assert choice["finish_reason"] in ("length", "stop")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body["kv_transfer_params"] is None  # no connector: params ignored, none returned


def test_chat_shape_and_reference(engine: EngineSim) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    status, body = engine.request("/v1/chat/completions", {"messages": msgs, "max_tokens": 20})
    assert status == 200 and body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert message["content"] == reference_chat(msgs, 20)


def test_chat_stream_with_usage(engine: EngineSim) -> None:
    msgs = [{"role": "user", "content": "stream please"}]
    body = {"messages": msgs, "max_tokens": 15, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    resp = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == reference_chat(msgs, 15)
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    assert all("kv_transfer_params" not in c for c in chunks)


def test_completion_stream_without_usage(engine: EngineSim) -> None:
    body = {"prompt": "abc", "max_tokens": 8, "stream": True, "ignore_eos": True}
    resp = httpx.post(engine.url + "/v1/completions", json=body, timeout=30)
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    assert "usage" not in events[-2]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == reference_completion("abc", 8, ignore_eos=True)


def test_stop_strings_truncate_and_finish(engine: EngineSim) -> None:
    full = reference_completion("stop test", 60, ignore_eos=True)
    stop = full[20:23]
    expected = full[: full.index(stop)]
    status, body = engine.request(
        "/v1/completions",
        {"prompt": "stop test", "max_tokens": 60, "ignore_eos": True, "stop": [stop]},
    )
    assert status == 200
    assert body["choices"][0] == {**body["choices"][0], "text": expected, "finish_reason": "stop"}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "model"),
        ("/v1/completions", {"prompt": "x " * 600}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "stream_options": {}}, 400, "stream_options"),
        ("/v1/completions", {"prompt": "x", "priority": "high"}, 400, "priority"),
        ("/v1/completions", {"prompt": "x", "priority": 2**63}, 400, "priority"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, 400,
         "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "max_completion_tokens": 0}, 400, "max_tokens"),
    ],
)  # fmt: skip
def test_invalid_requests_are_openai_errors(
    engine: EngineSim, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    got, err = engine.request(path, body)
    assert got == status
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["param"] == param and err["error"]["code"] == status


def test_bad_json_and_non_object(engine: EngineSim) -> None:
    resp = httpx.post(engine.url + "/v1/completions", content=b"{nope", timeout=10)
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    status, err = engine.request("/v1/completions", [1, 2])
    assert status == 400 and err["error"]["type"] == "BadRequestError"


def test_models_and_health(engine: EngineSim) -> None:
    status, body = engine.request("/v1/models")
    assert status == 200 and body["data"][0]["id"] == "kvrelay-sim"
    assert body["data"][0]["max_model_len"] == 512
    assert engine.request("/health")[0] == 200


def test_faults(engine: EngineSim) -> None:
    status, faults = engine.request("/admin/faults", {"fail_next_n": 2, "fail_status": 503})
    assert status == 200 and faults["fail_next_n"] == 2
    for _ in range(2):
        assert engine.request("/v1/completions", {"prompt": "x"})[0] == 503
    assert engine.request("/v1/completions", {"prompt": "x"})[0] == 200
    engine.request("/admin/faults", {"refuse_admission": True})
    status, err = engine.request("/v1/completions", {"prompt": "x"})
    assert status == 503 and err["error"]["code"] == 503
    engine.request("/admin/faults", {"refuse_admission": False})
    assert engine.request("/admin/faults", {"bogus": 1})[0] == 400
    assert engine.request("/admin/faults", {"delay_ms": -1})[0] == 400


def test_client_disconnect_aborts_and_frees(engine_factory: EngineFactory) -> None:
    # Slow decode so the request is surely running when the client goes away.
    eng = engine_factory("slow", "--decode-us-per-step", "20000", "--num-blocks", "64",
                         "--max-model-len", "512", connector=False)  # fmt: skip
    body = json.dumps({"prompt": "long job", "max_tokens": 400, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", eng.port)) as sock:
        sock.sendall(head + body)
        wait_until(lambda: eng.metric("enginesim_requests_running") == 1, 10,
                   what="request running")  # fmt: skip
    wait_until(lambda: eng.metric('enginesim_requests_by_outcome_total{outcome="aborted"}') == 1,
               10, what="abort after disconnect")  # fmt: skip
    eng.wait_idle()
    assert eng.metric("enginesim_generation_tokens_total") < 400


def test_stream_disconnect_aborts_and_frees(engine_factory: EngineFactory) -> None:
    eng = engine_factory("slow-stream", "--decode-us-per-step", "20000", "--num-blocks", "64",
                         "--max-model-len", "512", connector=False)  # fmt: skip
    body = {"prompt": "streamed job", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", eng.url + "/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"]
    # Leaving the block closed the connection mid-stream.
    wait_until(lambda: eng.metric('enginesim_requests_by_outcome_total{outcome="aborted"}') == 1,
               10, what="abort after stream disconnect")  # fmt: skip
    eng.wait_idle()
    assert eng.metric("enginesim_generation_tokens_total") < 400


def test_stream_events_have_vllm_shapes(engine: EngineSim) -> None:
    msgs = [{"role": "user", "content": "shapes"}]
    body = {"messages": msgs, "max_tokens": 6, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    resp = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=30)
    events = sse_events(resp.text)
    assert resp.text.endswith("data: [DONE]\n\n") and events[-1] == "[DONE]"
    first, last, usage = events[0], events[-3], events[-2]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None
    # The last choice carries the finish reason and vLLM's stop_reason; usage comes alone.
    assert last["choices"][0]["finish_reason"] == "length"
    assert "stop_reason" in last["choices"][0] and "usage" not in last
    assert usage["choices"] == [] and usage["object"] == "chat.completion.chunk"
    assert usage["id"] == first["id"] and usage["model"] == "kvrelay-sim"
    assert usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 6
    assert all(e == "[DONE]" or "kv_transfer_params" not in e for e in events)


def test_a_chat_stream_sends_nothing_before_its_first_output(
    engine_factory: EngineFactory,
) -> None:
    """vLLM sends a chat stream's role event with the request's first output: a request still
    queued (or prefilling) has sent nothing but headers, which is what a router reads its
    first byte as (the end of prefill, for kvrelay's spill budget)."""
    # One sequence at a time: the chat request waits until the slow first one has finished.
    eng = engine_factory("one-at-a-time", "--max-num-seqs", "1", "--decode-us-per-step",
                         "20000", connector=False)  # fmt: skip
    body = json.dumps({"prompt": "first job", "max_tokens": 50, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    finished = 'enginesim_requests_by_outcome_total{outcome="finished"}'
    msgs = [{"role": "user", "content": "queued"}]
    chat = {"messages": msgs, "max_tokens": 4, "stream": True, "ignore_eos": True}
    with socket.create_connection(("127.0.0.1", eng.port)) as first:
        first.sendall(head + body)
        wait_until(lambda: eng.metric("enginesim_requests_running") == 1, 10,
                   what="the first request running")  # fmt: skip
        with httpx.stream("POST", eng.url + "/v1/chat/completions", json=chat,
                          timeout=30) as resp:  # fmt: skip
            assert resp.status_code == 200
            lines = (line for line in resp.iter_lines() if line.startswith("data: "))
            role = json.loads(next(lines)[6:])
            # Its first event came only once the engine ran it, after the first one ended.
            assert eng.metric(finished) >= 1 and eng.metric("enginesim_requests_waiting") == 0
            assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            content = json.loads(next(lines)[6:])
            assert content["choices"][0]["delta"]["content"]
            rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    eng.wait_idle()
