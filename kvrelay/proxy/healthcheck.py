"""`kvrelay healthcheck`: ask a running proxy's `/health` at the address `serve` listens on.

The image's HEALTHCHECK runs it. It reads the settings as `serve` does (flags, `KVRELAY_*`
env vars, the env file), so the check follows `--port`, an env file or a listen host other
than loopback. A HEALTHCHECK cannot repeat the flags the container was started with, so when
the first process of the container is `kvrelay serve ...` its flags come first (this command's
own flags after them, so they win) and its env file is read from its working directory.
Exit 0 when the proxy answers 200 `{"status": "ok"}`, 1 otherwise (a line on stderr says why).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from kvrelay.proxy.config import Settings, SettingsError

SERVE_PID = 1  # in a container, the entrypoint
# How `serve` appears in a process's argv: the console script or the module.
_LAUNCHERS = ("kvrelay", "kvrelay.proxy.cli")


def serve_args_of(
    pid: int = SERVE_PID, proc: Path = Path("/proc")
) -> tuple[list[str], Path] | None:
    """(flags after `serve`, working directory) of process `pid` when it runs `kvrelay serve`."""
    try:
        argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
        cwd = Path(os.readlink(proc / str(pid) / "cwd"))
    except OSError:
        return None
    args = [a.decode("utf-8", "surrogateescape") for a in argv if a]
    for i in range(1, len(args)):
        if args[i] == "serve" and os.path.basename(args[i - 1]) in _LAUNCHERS:
            return args[i + 1 :], cwd
    return None


def health_url(settings: Settings) -> str:
    """Where this proxy answers: a wildcard listen address is reached over loopback."""
    host = settings.host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.port}/health"


def check(url: str, timeout: float) -> str | None:
    """None when the proxy at `url` is healthy, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return f"{url} answered {exc.code}"
    except (OSError, ValueError) as exc:
        return f"{url}: {exc}"
    if not isinstance(body, dict) or body.get("status") != "ok":
        return f"{url} answered {body!r}"
    return None


def run(
    argv: list[str],
    parser: argparse.ArgumentParser,
    settings_from_args: Callable[[argparse.Namespace], Settings],
    timeout: float = 3.0,
) -> int:
    """Check the proxy that `kvrelay serve` would run with these flags (`parser`, `serve`'s own
    flags, is handed in by the cli so that this module does not import it back)."""
    parser.prog = "kvrelay healthcheck"
    parser.description = (
        "Exit 0 when the proxy that `kvrelay serve` with these settings runs answers /health."
    )
    serving = serve_args_of() if not argv else None
    try:
        if serving is not None:
            flags, cwd = serving
            args = parser.parse_args(flags)
            if args.env_file and not os.path.isabs(args.env_file):
                args.env_file = str(cwd / args.env_file)
        else:
            args = parser.parse_args(argv)
        settings = settings_from_args(args)
    except (SettingsError, SystemExit) as exc:
        print(f"kvrelay healthcheck: settings not readable: {exc}", file=sys.stderr)
        return 1
    problem = check(health_url(settings), timeout)
    if problem is not None:
        print(f"kvrelay healthcheck: {problem}", file=sys.stderr)
        return 1
    return 0
