"""kvrelay with some of its per-turn features switched off: what each one costs, in isolation.

`python -m bench._features_off --without metrics,map -- serve ARGS...` runs `kvrelay serve`
after replacing the named features with the cheapest stand-in that still lets a turn through.
It exists for `instructions.py --without`, which counts the instructions per request with and
without each feature; the difference is that feature's price. A proxy started this way is
not kvrelay: with `map` or `entry` off nothing is reused, with `admission` off nothing is
limited or validated. Never deploy it.

The features (names for `--without`):

- `metrics`: every labelled metric's child is one shared object whose updates do nothing.
- `map`: the in-process map's `take` finds nothing and its `put` stores nothing.
- `entry`: D's params are validated into a `KVEntry` once; every later turn reuses that entry.
- `admission`: no API-key check, rate limit, body budget, JSON depth check, request validation
  or model check: the body is read and parsed, nothing more.
- `fingerprint`: the first request's prompt shape (digests of the prompt) stands for all.
- `finished_lookup`: a stream's end asks D's side channel for nothing (streams carry no params,
  so D's params are not stored).
- `accounting`: no leg's account is read from P's or D's answer, none is counted, no
  `X-Kvrelay-*` account header is sent and the router learns nothing from the turn.
- `spill`: the router never spills a turn to D (every turn the map cannot send straight to
  its holder goes through P, as before the spill existed): the setting
  `prefill_spill_factor=0`, added to the proxy's command line.

The others replace the proxy's own functions by name (`_replace` stops with an error when a
name is gone, so a renamed function cannot silently price nothing): no setting switches them
off, and none should, since no operator would run kvrelay without them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

FEATURES = (
    "metrics", "map", "entry", "admission", "fingerprint", "finished_lookup", "accounting",
    "spill",
)  # fmt: skip


class _NoUpdate:
    """A metric child whose updates do nothing."""

    def inc(self, amount: float = 1) -> None:
        return None

    def dec(self, amount: float = 1) -> None:
        return None

    def observe(self, amount: float) -> None:
        return None

    def set(self, value: float) -> None:
        return None


def launcher(without: str) -> tuple[str, ...]:
    """What `python` runs before the proxy's CLI arguments: the CLI itself, or with `without`
    (comma-separated features) this module, which switches them off and hands on to it."""
    if not without:
        return ("-m", "kvrelay.proxy.cli")
    return ("-m", "bench._features_off", "--without", without, "--")


def _replace(owner: object, name: str, stand_in: object) -> None:
    """Swap `owner.name` (a module's function, a class's method) for `stand_in`."""
    if not hasattr(owner, name):  # the proxy changed: price nothing rather than the wrong thing
        raise SystemExit(f"{owner!r} has no {name}: bench/_features_off.py is out of date")
    setattr(owner, name, stand_in)


def _metrics_off() -> None:
    from kvrelay.proxy.telemetry import metrics

    child = _NoUpdate()
    _replace(metrics.Labelled, "labels", lambda self, *values: child)


def _map_off() -> None:
    from kvrelay.kvcache_map import _memory

    async def take(self: Any, key: Any) -> None:
        return None

    async def put(self: Any, key: Any, entry: Any, ttl_s: float) -> None:
        return None

    _replace(_memory.MemoryMap, "take", take)
    _replace(_memory.MemoryMap, "put", put)


def _entry_off() -> None:
    from kvrelay.kvcache_map import _entry

    build = _entry.KVEntry.from_kv_transfer_params
    first: list[_entry.KVEntry] = []

    def reuse_first(params: Any, **kwargs: Any) -> _entry.KVEntry:
        if not first:
            first.append(build(params, **kwargs))
        return first[0]

    _replace(_entry.KVEntry, "from_kv_transfer_params", reuse_first)


def _admission_off() -> None:
    from kvrelay.proxy.fleet import ModelCatalog
    from kvrelay.proxy.http import app

    async def admit(request: web.Request) -> tuple[str, None]:
        return "", None

    async def read_json_object(request: web.Request, settings: Any, held: Any) -> Any:
        return orjson.loads(await request.read())

    async def check(self: Any, model: Any) -> None:
        return None

    _replace(app, "admit", admit)
    _replace(app, "read_json_object", read_json_object)
    _replace(app, "validate_chat", lambda body: None)
    _replace(app, "validate_completion", lambda body: None)
    _replace(ModelCatalog, "check", check)


def _fingerprint_off() -> None:
    from kvrelay.proxy.http import app

    def first_of(shape_of: Callable[[Any], Any]) -> Callable[[Any], Any]:
        first: list[Any] = []

        def shape(body: Any) -> Any:
            if not first:
                first.append(shape_of(body))
            return first[0]

        return shape

    for name in ("chat_shape", "completion_shape"):
        _replace(app, name, first_of(getattr(app, name)))


def _finished_lookup_off() -> None:
    from kvrelay.proxy.engines import Releaser

    async def finished_params(self: Any, host: str, port: int, request_id: str) -> None:
        return None

    _replace(Releaser, "finished_params", finished_params)


def _accounting_off() -> None:
    from kvrelay.proxy.turn import PromptAccount, Turn, TurnAccounts, TurnReport

    unknown = PromptAccount()

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    _replace(PromptAccount, "from_connector", classmethod(nothing))
    _replace(PromptAccount, "from_usage", classmethod(lambda cls, *args: unknown))
    _replace(PromptAccount, "headers", lambda self, prefilled_by: {})
    _replace(TurnAccounts, "decode_usage", nothing)
    _replace(TurnAccounts, "decode_reported", nothing)
    _replace(TurnAccounts, "settle", lambda self: unknown)
    _replace(TurnReport, "count_accounts", nothing)
    _replace(Turn, "_learn", nothing)


_SWITCHES: dict[str, Callable[[], None]] = {
    "metrics": _metrics_off,
    "map": _map_off,
    "entry": _entry_off,
    "admission": _admission_off,
    "fingerprint": _fingerprint_off,
    "finished_lookup": _finished_lookup_off,
    "accounting": _accounting_off,
}
# Switches a setting expresses: given to the proxy's command line, nothing replaced.
_SETTINGS: dict[str, tuple[str, ...]] = {
    "spill": ("--prefill-spill-factor", "0"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--without", required=True, help=f"comma-separated: {', '.join(FEATURES)}")
    p.add_argument("cli", nargs=argparse.REMAINDER, help="-- then `kvrelay` CLI arguments")
    args = p.parse_args(argv)
    names = [name for name in args.without.split(",") if name]
    unknown = sorted(set(names) - set(FEATURES))
    if unknown:
        p.error(f"unknown features {unknown}; known: {', '.join(FEATURES)}")
    rest = args.cli[1:] if args.cli[:1] == ["--"] else args.cli
    for name in names:
        if name in _SETTINGS:
            rest = [*rest, *_SETTINGS[name]]
        else:
            _SWITCHES[name]()
    from kvrelay.proxy import cli

    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main())
