"""``meshkit env`` and ``meshkit run`` without importing invoke (about 0.1s of start-up saved on
every node at every launch). Same flags as the invoke tasks (tests/test_fastcli.py checks) and the
same configuration loader (``meshkit.settings``). Anything else (help, other tasks, a flag it does
not know) goes to the invoke Program, which then reports it as usual."""

from __future__ import annotations

import sys
from collections.abc import Sequence

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
    "run": ("cmd", *DISCOVERY_FLAGS, "log", "spawn"),
}
BOOLEAN = {"json", "spawn"}


class _Fallback(Exception):
    """Not something the fast path handles: let the invoke Program do it."""


def parse(task: str, args: Sequence[str]) -> tuple[dict[str, str | None], set[str]]:
    """``--name value``, ``--name=value`` and the booleans (``--json``, ``--spawn``): (values,
    the booleans given). Anything
    else (a positional, an unknown or abbreviated flag, a missing value, a value that looks like
    a flag) is ``_Fallback``: invoke then parses it and reports it as usual. Not argparse: that
    is about 5 ms of imports at every ``meshkit env`` on every node."""
    values: dict[str, str | None] = {name: None for name in FLAGS[task] if name not in BOOLEAN}
    given: set[str] = set()
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        raw, eq, value = arg[2:].partition("=")
        name = raw.replace("-", "_")
        if not arg.startswith("--") or "_" in raw or name not in FLAGS[task]:
            raise _Fallback
        if name in BOOLEAN:
            if eq:
                raise _Fallback
            given.add(name)
            continue
        if not eq:
            if not rest or rest[0].startswith("-"):
                raise _Fallback
            value = rest.pop(0)
        values[name] = value
    return values, given


def run_fast(argv: Sequence[str]) -> bool:
    """Handle ``env``/``run`` here and return True (``run`` never returns); False: not ours."""
    if not argv or argv[0] not in FLAGS or {"-h", "--help"} & set(argv[1:]):
        return False
    try:
        flags, given = parse(argv[0], argv[1:])
    except _Fallback:
        return False
    if argv[0] == "run" and flags["cmd"] is None:
        return False
    from .. import settings
    from .envcmd import exec_run, node_env, print_env, spawn_run

    try:
        conf = settings.load()
        node = node_env(conf, **{name: flags[name] for name in DISCOVERY_FLAGS})
        if argv[0] == "env":
            print_env(node, "json" in given)
        elif "spawn" in given:
            spawn_run(node, str(flags["cmd"]), flags["log"])
        else:
            exec_run(node, str(flags["cmd"]), flags["log"])
    except MeshkitError as exc:
        print(f"meshkit: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    return True
