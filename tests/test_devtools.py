"""The dev tools: one Prometheus parser and one SSE reader for demo, tests and bench; every
module light to import; a threaded app that stops; one environment and one launcher for a dev
fleet, which stops every process it started."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.devtools import (
    LOOPBACK_UCX,
    DevFleet,
    ServerProcess,
    ThreadedApp,
    fleet_env,
    free_port,
    live_children,
    prometheus,
    sse,
    tcp_ready,
    vllm_servers,
    wait_until,
    with_loopback_ucx,
)
from tests.harness import REPO_ROOT

PAGE = """# HELP x_total things
# TYPE x_total counter
x_total{role="prefill",url="http://a b"} 3.0
x_total{role="decode"} 4 1700000000000
plain_gauge 2.5
broken_line
nan_ok NaN
"""


def test_prometheus_series_keep_labels_and_ignore_timestamps() -> None:
    samples = prometheus.parse_samples(PAGE)
    assert samples['x_total{role="prefill",url="http://a b"}'] == 3.0
    assert samples['x_total{role="decode"}'] == 4.0
    assert samples["plain_gauge"] == 2.5
    assert "broken_line" not in samples
    assert prometheus.totals(samples)["x_total"] == 7.0
    assert prometheus.series_sum(samples, "x_total") == 7.0
    assert prometheus.series_sum(samples, "x") == 0.0


def test_sse_reads_lf_and_crlf_events_multiline_data_and_done() -> None:
    raw = (
        b'data: {"a": 1}\n\n'
        b'data: {"b":\r\ndata: 2}\r\n\r\n'
        b": comment only\n\n"
        b"event: ping\ndata: not json\n\n"
        b"data: [DONE]\n\n"
    )
    stream = sse.parse(raw)
    assert stream.events == [{"a": 1}, {"b": 2}]
    assert stream.done and stream.not_json == ["not json"]
    assert sse.events(raw.decode()) == [{"a": 1}, {"b": 2}]


_SSE_STREAM = (
    b'data: {"a": 1}\n\n'
    b'data: {"b":\r\ndata: 2}\r\n\r\n'
    b": comment only\n\n"
    b"event: ping\ndata: not json\n\n"
    b"data: [DONE]\n\n"
    b"data: unended"
)
# Events with data ended once this many of the stream's blank lines arrived (the third one ends
# the comment, which has none).
_EVENTS_AFTER_BLANK_LINES = (0, 1, 2, 2, 3, 4)


@given(st.lists(st.integers(min_value=0, max_value=len(_SSE_STREAM)), max_size=12))
@settings(max_examples=200, deadline=None)
def test_sse_event_reader_gives_each_event_once_its_blank_line_arrives(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(_SSE_STREAM)]
    reader = sse.EventReader()
    fed: list[str] = []
    for start, stop in itertools.pairwise(bounds):
        chunk = _SSE_STREAM[start:stop]
        got = reader.feed(chunk)
        # An event is handed out by the chunk that brings its blank line, not before.
        ended = _SSE_STREAM[:stop].count(b"\n\n") + _SSE_STREAM[:stop].count(b"\r\n\r\n")
        assert len(fed) + len(got) == _EVENTS_AFTER_BLANK_LINES[ended]
        fed += got
    assert fed + reader.end() == sse.data_fields(_SSE_STREAM)
    assert sse.data_fields(_SSE_STREAM) == [
        '{"a": 1}',
        '{"b":\n2}',
        "not json",
        "[DONE]",
        "unended",
    ]


def test_sse_text_of_chat_and_completion_streams() -> None:
    chat = [
        {"choices": [{"delta": {"content": "He"}}]},
        {"choices": [{"delta": {}}]},
        {"choices": [{"delta": {"content": "llo"}}]},
        {"usage": {"prompt_tokens": 3}},
    ]
    assert sse.text_of(chat, chat=True) == "Hello"
    completion = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}]
    assert sse.text_of(completion, chat=False) == "ab"


def test_every_devtools_module_imports_without_torch_nixl_vllm_or_tests() -> None:
    # bench imports these from the wheel's package: none may drag in heavy extras or tests/.
    code = (
        "import importlib, pkgutil, sys, kvrelay.devtools as d\n"
        "for m in pkgutil.iter_modules(d.__path__):\n"
        "    importlib.import_module('kvrelay.devtools.' + m.name)\n"
        "heavy = ('torch', 'nixl', 'vllm', 'transformers', 'tests', 'bench')\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
        cwd=REPO_ROOT,
    )  # fmt: skip
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_threaded_app_serves_until_stopped() -> None:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hi")

    app = web.Application()
    app.router.add_get("/", hello)
    server = ThreadedApp(app, free_port(), "hello")
    with server, urllib.request.urlopen(server.url + "/", timeout=5) as resp:
        assert resp.read() == b"hi"
    assert not tcp_ready("127.0.0.1", server.port)()


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_bound() -> None:
    """A port the kernel could also give an outgoing connection is not handed to a server
    that binds it minutes later (vLLM's side channel did hit one in use)."""
    import socket
    from pathlib import Path

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(port < low for port in ports), (sorted(ports), low)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        assert free_port(preferred=taken) != taken


@pytest.mark.parametrize("keep", ["", "0", "1"])
def test_a_stopped_server_keeps_its_output_file_only_when_asked(
    keep: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`KVRELAY_KEEP_SERVER_LOGS` keeps a benchmark's engine and proxy output for a diagnosis
    after the fleet is stopped; by default the file goes with the server."""
    monkeypatch.setenv("KVRELAY_KEEP_SERVER_LOGS", keep)
    code = "import time; print('started', flush=True); time.sleep(60)"
    server = ServerProcess([sys.executable, "-c", code], ready=lambda: True, name="keep-logs")
    with server:
        wait_until(lambda: "started" in server.output(), 30, what="the server's first line")
        path = server.log_path
    assert path is not None and not server.alive
    try:
        if keep == "1":
            assert path.read_text() == "started\n"
            assert f"keep-logs: output kept in {path}" in capsys.readouterr().err
        else:
            assert not path.exists()
    finally:
        path.unlink(missing_ok=True)


def test_makefile_exports_the_devtools_ucx_defaults() -> None:
    # The Makefile's exports are the shell's copy of `kvrelay.devtools.ucx`: they must agree.
    makefile = (REPO_ROOT / "Makefile").read_text()
    exported = dict(re.findall(r"^export (UCX_\w+) \?= (\S+)$", makefile, re.MULTILINE))
    assert exported == LOOPBACK_UCX


def test_loopback_ucx_fills_only_what_is_unset() -> None:
    env = {"UCX_TLS": "rc"}
    assert with_loopback_ucx(env) == {"UCX_TLS": "rc", "UCX_NET_DEVICES": "lo"}


def test_loopback_ucx_for_cuda_adds_the_cuda_transports_to_the_default_only() -> None:
    env = with_loopback_ucx({}, cuda=True)
    assert env["UCX_TLS"].split(",") == ["tcp", "self", "sm", "cuda_copy", "cuda_ipc"]
    assert env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"  # NIXL's READ over cuda_ipc, no NVLink
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in with_loopback_ucx({})
    # A process that already took the CPU default (a test's parent) gets them added too...
    assert "cuda_ipc" in with_loopback_ucx(dict(LOOPBACK_UCX), cuda=True)["UCX_TLS"]
    # ...and an operator's own choice is theirs.
    assert with_loopback_ucx({"UCX_TLS": "rc,cuda_copy"}, cuda=True)["UCX_TLS"] == "rc,cuda_copy"


def test_fleet_env_keeps_a_set_secret_fills_ucx_and_puts_the_tree_first() -> None:
    base = {"UCX_TLS": "rc", "PYTHONPATH": "/elsewhere", "KVRELAY_CONNECTOR_SECRET": "mine"}
    env = fleet_env(pythonpath=Path("/tree"), base=base)
    assert env["KVRELAY_CONNECTOR_SECRET"] == "mine"
    assert (env["UCX_TLS"], env["UCX_NET_DEVICES"]) == ("rc", "lo")
    assert env["PYTHONPATH"] == os.pathsep.join(["/tree", "/elsewhere"])
    assert fleet_env("given", base=base)["KVRELAY_CONNECTOR_SECRET"] == "given"
    # None set (or empty): one secret for the whole run, the same for every process of it.
    first, second = fleet_env(base={}), fleet_env(base={"KVRELAY_CONNECTOR_SECRET": ""})
    assert first["KVRELAY_CONNECTOR_SECRET"] == second["KVRELAY_CONNECTOR_SECRET"] != ""
    assert "PYTHONPATH" not in first


def test_dev_fleet_serves_a_turn_through_its_proxy_and_stops_every_process() -> None:
    before = live_children()
    with DevFleet(prefill=1, decode=1, redis=True, name="t-") as fleet:
        assert fleet.proxy is not None and fleet.redis_server is not None
        assert [e.name for e in fleet.prefill_engines] == ["t-P0"]
        assert [e.name for e in fleet.decode_engines] == ["t-D0"]
        assert fleet.proxy.env()["KVRELAY_MAP_URL"] == fleet.redis_server.url
        status, body, _ = fleet.proxy.call(
            "POST", "/v1/chat/completions",
            {"model": "kvrelay-sim", "messages": [{"role": "user", "content": "hi"}],
             "max_tokens": 4},
        )  # fmt: skip
        assert status == 200, body
        assert fleet.decode_engines[0].metric("enginesim_requests_total") >= 1
        assert fleet.alive
        assert len(live_children()) == len(before) + 4  # redis, P, D, proxy
    assert live_children() == before


def test_dev_fleet_that_fails_to_start_stops_what_it_had_started() -> None:
    before = live_children()
    fleet = DevFleet(prefill=1, decode=1, redis=True, engine_args=("--no-such-flag",))
    with pytest.raises(RuntimeError, match="exited"):
        fleet.start()
    assert not fleet.alive
    assert live_children() == before


def _fake_stock_engine(d_failures: int) -> tuple[web.Application, list[dict[str, object]]]:
    """A fake stock P and D in one app: a request carrying `do_remote_decode` is prefilled
    (answered with P's transfer params), one carrying `remote_block_ids` is decoded, failing
    with vLLM's 500 body `d_failures` times first. Returns the app and the decoded bodies."""
    decoded: list[dict[str, object]] = []

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        params = body["kv_transfer_params"]
        if params.get("do_remote_decode"):
            blocks = {"remote_block_ids": [7], "remote_engine_id": "P", "do_remote_prefill": True}
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": blocks})
        if len(decoded) < d_failures:
            decoded.append(body)
            error = {"message": "Internal server error", "type": "InternalServerError"}
            return web.json_response({"error": error}, status=500)
        decoded.append(body)
        return web.json_response({"choices": [{"text": "xy"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app, decoded


@pytest.mark.parametrize("d_failures", [0, 1])
def test_warm_stock_pair_opens_the_pair_within_its_tries(d_failures: int) -> None:
    app, decoded = _fake_stock_engine(d_failures)
    with ThreadedApp(app, free_port(), "fake-stock") as server:
        engine = vllm_servers.VLLMServer("fake-stock", Path("."), port=server.port)
        vllm_servers.warm_stock_pair(engine, engine, timeout=10)
    assert len(decoded) == d_failures + 1
    assert all(
        b["kv_transfer_params"]
        == {"remote_block_ids": [7], "remote_engine_id": "P", "do_remote_prefill": True}
        for b in decoded
    )


def test_warm_stock_pair_that_never_reads_reports_every_try() -> None:
    app, decoded = _fake_stock_engine(d_failures=vllm_servers.STOCK_WARM_TRIES)
    with ThreadedApp(app, free_port(), "fake-stock") as server:
        engine = vllm_servers.VLLMServer("fake-stock", Path("."), port=server.port)
        with pytest.raises(RuntimeError) as raised:
            vllm_servers.warm_stock_pair(engine, engine, timeout=10)
    assert len(decoded) == vllm_servers.STOCK_WARM_TRIES
    message = str(raised.value)
    assert message.count("stock D did not read P's blocks: 500") == vllm_servers.STOCK_WARM_TRIES
    assert message.count("--- end of fake-stock's log ---") == vllm_servers.STOCK_WARM_TRIES
