"""``python -m meshkit.node serve`` (the agent) or ``python -m meshkit.node keep STATE_DIR``."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if argv == ["serve"]:
        from .agent import serve

        serve(sys.stdin, sys.stdout)
        return 0
    if len(argv) == 2 and argv[0] == "keep":
        from .files import UnsafeStateDir
        from .keeper import keep

        try:
            return keep(argv[1])
        except UnsafeStateDir as exc:
            print(f"meshkit keeper: {exc}", file=sys.stderr)
            return 2
    print("usage: python -m meshkit.node serve | keep STATE_DIR", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
