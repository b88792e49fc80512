"""``meshkit env`` and ``meshkit run`` without importing invoke (about 0.1s of start-up saved on
every node at every launch). Same flags as the invoke tasks (tests/test_fastcli.py checks) and the
same configuration loader (``meshkit.settings``). Anything else (help, other tasks, a flag it does
not know) goes to the invoke Program, which then reports it as usual."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from ..errors import MeshkitError

DISCOVERY_FLAGS = (
    "hostfile",
    "node_rank",
    "session",
    "master_port",
    "nproc_per_node",
    "include",
    "exclude",
)
FLAGS: dict[str, tuple[str, ...]] = {
    "env": ("json", *DISCOVERY_FLAGS),
    "run": ("cmd", *DISCOVERY_FLAGS, "log"),
}
BOOLEAN = {"json"}


class _Fallback(Exception):
    """Not something the fast path handles: let the invoke Program do it."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _Fallback


def _parser(task: str) -> argparse.ArgumentParser:
    parser = _Parser(add_help=False, allow_abbrev=False)
    for name in FLAGS[task]:
        long = "--" + name.replace("_", "-")
        if name in BOOLEAN:
            parser.add_argument(long, dest=name, action="store_true")
        else:
            parser.add_argument(long, dest=name)
    return parser


def run_fast(argv: Sequence[str]) -> bool:
    """Handle ``env``/``run`` here and return True (``run`` never returns); False: not ours."""
    if not argv or argv[0] not in FLAGS or {"-h", "--help"} & set(argv[1:]):
        return False
    try:
        flags = vars(_parser(argv[0]).parse_args(list(argv[1:])))
    except _Fallback:
        return False
    if argv[0] == "run" and flags["cmd"] is None:
        return False
    from .. import settings
    from .envcmd import exec_run, node_env, print_env

    try:
        conf = settings.load()
        node = node_env(conf, **{name: flags[name] for name in DISCOVERY_FLAGS})
        if argv[0] == "env":
            print_env(node, bool(flags["json"]))
        else:
            exec_run(node, flags["cmd"], flags["log"])
    except MeshkitError as exc:
        print(f"meshkit: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    return True
