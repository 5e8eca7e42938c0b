"""`kvrelay` command line: `serve` (the proxy), `healthcheck`, `sim` (an engine simulator), `demo`,
`tenant-id`.

`serve` has one flag per setting, generated from `kvrelay.proxy.config.Settings` so the flags, the
env vars and the Helm values never drift apart. Flags override `KVRELAY_*` env vars.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from typing import Any

from pydantic.fields import FieldInfo

from kvrelay.proxy.config import Settings, SettingsError, env_name, flag_name, load_settings


def _is_list(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _is_list(typing.get_args(annotation)[0])
    return origin is list


def _is_dict(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _is_dict(typing.get_args(annotation)[0])
    return origin is dict


def _is_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    if isinstance(annotation, types.UnionType):
        return bool in typing.get_args(annotation)
    return False


def _add_setting_flag(parser: argparse.ArgumentParser, name: str, info: FieldInfo) -> None:
    help_text = f"{info.description or ''} [env {env_name(name)}]"
    annotation = info.annotation
    if _is_bool(annotation):
        parser.add_argument(
            flag_name(name),
            dest=name,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=help_text,
        )
    elif _is_list(annotation):
        parser.add_argument(
            flag_name(name), dest=name, nargs="+", default=None, metavar="VALUE", help=help_text
        )
    elif _is_dict(annotation):
        parser.add_argument(
            flag_name(name),
            dest=name,
            nargs="+",
            default=None,
            metavar="URL=HOST:PORT",
            help=help_text,
        )
    else:
        parser.add_argument(flag_name(name), dest=name, default=None, help=help_text)


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvrelay serve",
        description="Run the kvrelay proxy in front of prefill and decode engines.",
    )
    parser.add_argument("--env-file", default=".env", help="Optional dotenv file (default .env).")
    for name, info in Settings.model_fields.items():
        _add_setting_flag(parser, name, info)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {}
    for name, info in Settings.model_fields.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        if _is_list(info.annotation):
            # `--prefill a,b` and `--prefill a b` both work.
            value = [item for v in value for item in str(v).split(",") if item]
        elif _is_dict(info.annotation):
            value = ",".join(value)
        overrides[name] = value
    return load_settings(overrides, env_file=args.env_file)


def cmd_serve(argv: list[str]) -> int:
    args = serve_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
        from kvrelay.proxy.http import serve

        return serve(settings)
    except SettingsError as exc:
        print(f"kvrelay: {exc}", file=sys.stderr)
        return 2


def cmd_healthcheck(argv: list[str]) -> int:
    from kvrelay.proxy.healthcheck import run

    return run(argv, serve_parser(), settings_from_args)


def cmd_sim(argv: list[str]) -> int:
    from kvrelay.enginesim.cli import main as sim_main

    result: int = sim_main(argv)
    return result


def cmd_tenant_id(argv: list[str]) -> int:
    """Print the tenant id of the API key read from stdin (what `tenant_limits` is keyed by).

    The key is read from stdin, not argv, so it does not land in shell history or `ps`."""
    parser = argparse.ArgumentParser(
        prog="kvrelay tenant-id",
        description="Print the tenant id (for tenant_limits) of the API key given on stdin.",
    )
    parser.parse_args(argv)
    from kvrelay.proxy.turn import tenant_of

    key = sys.stdin.readline().strip()
    if not key:
        print("kvrelay: give the API key on stdin", file=sys.stderr)
        return 2
    print(tenant_of(key))
    return 0


def cmd_demo(argv: list[str]) -> int:
    from kvrelay.proxy.demo import main as demo_main

    return demo_main(argv)


COMMANDS = {
    "serve": (cmd_serve, "run the proxy"),
    "healthcheck": (cmd_healthcheck, "exit 0 when the proxy `serve` runs answers /health"),
    "sim": (cmd_sim, "run an engine simulator (enginesim)"),
    "demo": (cmd_demo, "local demo fleet and a five-turn chat"),
    "tenant-id": (cmd_tenant_id, "the tenant id of an API key (stdin), for tenant_limits"),
}


def usage() -> str:
    lines = ["usage: kvrelay <command> [options]", "", "commands:"]
    lines += [f"  {name:<11} {text}" for name, (_, text) in COMMANDS.items()]
    lines.append("\n`kvrelay <command> --help` shows the command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"kvrelay: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return command[0](args[1:])


if __name__ == "__main__":
    raise SystemExit(main())
