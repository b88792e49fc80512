"""``meshkit exec`` on the command line: the run and its output, as ``clush -b`` shows it (or
``--lines``, ``--json``). Called by the invoke task (``cli/tasks/execute.py``: its help, and any
command line the plain parser leaves to invoke) and, for an ordinary command line, straight from
the console script (``main``): without invoke and the other tasks' modules, which cost the
controller about half of its start before the first node is contacted.
"""

from __future__ import annotations

import json as jsonlib
import sys
from collections.abc import Sequence

from ..errors import MeshkitError
from ..flagparse import Fallback, parse
from ..ops.execute import NodeResult, execute, gather
from ..record import build, fields, record
from ..settings import Config, load
from .printing import relay, say


@record
class ExecFlags:
    """``meshkit exec``'s flags, declared once: the invoke task takes these (``FlagsTask``), and
    the plain parser reads the same (``parse_exec``). A flag whose default is a bool is a boolean
    flag, as invoke tells them."""

    cmd: str | None = None
    hostfile: str | None = None
    include: str | None = None
    exclude: str | None = None
    node: str | None = None
    session: str | None = None
    timeout: str | None = None
    lines: bool = False
    json: bool = False


def declared() -> tuple[list[str], set[str]]:
    """``ExecFlags``' flag names, and which of them are booleans."""
    names = []
    booleans = set()
    for flag in fields(ExecFlags):
        names.append(flag.name)
        if isinstance(flag.default, bool):
            booleans.add(flag.name)
    return names, booleans


def parse_exec(args: Sequence[str]) -> ExecFlags:
    """exec's flags by the plain parser; ``Fallback`` when it is not sure of them, and without
    ``--cmd`` (the task's usage error says what is missing)."""
    names, booleans = declared()
    parsed = parse(names, booleans, args, required=("cmd",))
    values: dict[str, str | bool | None] = {**parsed.values}
    for name in parsed.given:
        values[name] = True
    return build(ExecFlags, values, "exec")


def run(conf: Config, cmd: str, flags: ExecFlags) -> str | None:
    """Run ``cmd`` (``flags.cmd``, which the caller found given) on the nodes and print what they
    said; the failure message (exit 1) when any node failed or did not answer, each of those
    named on stderr, else None. Raises meshkit's errors (a bad flag, no hostfile) before any
    node is contacted."""
    results = execute(
        conf,
        cmd,
        hostfile=flags.hostfile,
        session=flags.session,
        include=flags.include,
        exclude=flags.exclude,
        nodes=flags.node,
        timeout=flags.timeout,
    )
    if flags.json:
        print(jsonlib.dumps([as_json(result) for result in results], indent=1))
    elif flags.lines:
        print_lines(results)
    else:
        print_groups(results)
    sys.stdout.flush()
    failed = [result for result in results if not result.ok]
    for result in failed:
        say(f"meshkit exec: {result.node} (rank {result.rank}): {result.why}", sys.stderr)
    if failed:
        return f"meshkit exec: {len(failed)} of {len(results)} nodes failed"
    return None


def main(argv: Sequence[str]) -> bool:
    """``meshkit exec FLAGS`` without invoke: run it and return True; False when the command line
    is not one the plain parser is sure of (help, an unknown flag), for invoke to handle. Exits
    as the task does: 1 when a node failed, a meshkit error's own code."""
    if not argv or argv[0] != "exec":
        return False
    try:
        flags = parse_exec(argv[1:])
    except Fallback:
        return False
    try:
        failure = run(load(), str(flags.cmd), flags)
    except MeshkitError as exc:
        sys.stdout.flush()
        say(f"meshkit: {exc}", sys.stderr)
        raise SystemExit(exc.exit_code) from None
    if failure is not None:
        print(failure, file=sys.stderr)
        raise SystemExit(1)
    return True


def as_json(result: NodeResult) -> dict[str, object]:
    """One node's object of ``exec --json`` (json escapes its control characters); the
    ``*_cut_bytes``: how many bytes the node left out of the middle of each stream."""
    return {
        "node": result.node,
        "rank": result.rank,
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "error": result.error,
        "stdout_cut_bytes": result.stdout_cut,
        "stderr_cut_bytes": result.stderr_cut,
    }


def print_groups(results: Sequence[NodeResult]) -> None:
    """Standard output as ``clush -b`` shows it; standard error per node, on stderr. The nodes'
    output goes through ``relay``: visible on a terminal, as sent into a pipe or a file."""
    for group in gather(results):
        header = f"{group.nodes} ({len(group.results)})"
        rule = "-" * len(header)
        say(f"{rule}\n{header}\n{rule}")
        relay(group.stdout, end="" if group.stdout.endswith("\n") else "\n")
    sys.stdout.flush()
    for result in results:
        for line in result.stderr.splitlines():
            relay(f"{result.node}: {line}", sys.stderr)


def print_lines(results: Sequence[NodeResult]) -> None:
    """Every line prefixed with its node, as pdsh prints (stdout's on stdout, stderr's on
    stderr), node by node in rank order; through ``relay``, as ``print_groups``."""
    for result in results:
        for line in result.stdout.splitlines():
            relay(f"{result.node}: {line}")
    sys.stdout.flush()
    for result in results:
        for line in result.stderr.splitlines():
            relay(f"{result.node}: {line}", sys.stderr)
