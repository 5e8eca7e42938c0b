"""`kvrelay healthcheck` (the image's HEALTHCHECK): the address `serve` listens on, read from
the same settings, and from a running `kvrelay serve`'s own command line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from aiohttp import web

from kvrelay.devtools import ThreadedApp, free_port
from kvrelay.proxy.cli import cmd_healthcheck as run
from kvrelay.proxy.config import load_settings
from kvrelay.proxy.healthcheck import health_url, serve_args_of


def _fake_proc(root: Path, pid: int, argv: list[str], cwd: Path) -> Path:
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    os.symlink(cwd, root / str(pid) / "cwd")
    return root


def test_serve_flags_come_from_the_running_serve_command(tmp_path: Path) -> None:
    script = ["/opt/kvrelay/bin/python", "/opt/kvrelay/bin/kvrelay", "serve", "--port", "9100"]
    proc = _fake_proc(tmp_path / "a", 1, script, tmp_path)
    assert serve_args_of(1, proc) == (["--port", "9100"], tmp_path)
    module = ["python", "-m", "kvrelay.proxy.cli", "serve"]
    assert serve_args_of(1, _fake_proc(tmp_path / "b", 1, module, tmp_path)) == ([], tmp_path)
    other = ["/usr/bin/sleep", "serve"]
    assert serve_args_of(1, _fake_proc(tmp_path / "c", 1, other, tmp_path)) is None
    assert serve_args_of(1, tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("host", "url"),
    [("0.0.0.0", "http://127.0.0.1:9000/health"), ("::", "http://[::1]:9000/health"),
     ("10.1.2.3", "http://10.1.2.3:9000/health"), ("fd00::5", "http://[fd00::5]:9000/health")],
)  # fmt: skip
def test_wildcard_listen_addresses_are_reached_over_loopback(host: str, url: str) -> None:
    assert health_url(load_settings({"host": host, "port": 9000}, env_file=None)) == url


def test_exit_code_follows_the_proxy_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    status = {"code": 200}

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"}, status=status["code"])

    app = web.Application()
    app.router.add_get("/health", health)
    port = free_port()
    # The port from an env file, as `serve --env-file` would read it.
    env_file = tmp_path / "proxy.env"
    env_file.write_text(f"KVRELAY_PORT={port}\nKVRELAY_HOST=0.0.0.0\n")
    monkeypatch.delenv("KVRELAY_PORT", raising=False)
    with ThreadedApp(app, port, "fake-proxy-health"):
        assert run(["--env-file", str(env_file)]) == 0
        assert run(["--env-file", "", "--port", str(port)]) == 0
        status["code"] = 503
        assert run(["--env-file", str(env_file)]) == 1
        assert "answered 503" in capsys.readouterr().err
    assert run(["--env-file", "", "--port", str(free_port())]) == 1
    assert run(["--env-file", "", "--port", "not-a-port"]) == 1
