"""`kvrelay` command line: `serve` (the proxy), `sim` (an engine simulator), `demo`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print(f"kvrelay: no command implemented yet ({args})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
