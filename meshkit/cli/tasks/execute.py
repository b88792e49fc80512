"""``exec``: parse, call ``ops.execute``, render as ``clush -b`` (or ``--lines``, ``--json``)."""

from __future__ import annotations

import json as jsonlib
import sys
from collections.abc import Sequence

from invoke.context import Context
from invoke.exceptions import Exit

from ...ops.execute import NodeResult, execute, gather
from ..common import conf, helps, reported, task

EXEC_HELP = helps(
    "hostfile",
    "include",
    "exclude",
    "session",
    cmd="the command every node runs (bash, in the user's home directory); $NODE_RANK, "
    "$MASTER_ADDR etc. expand there, with each node's own values",
    node="only these ranks: 2 or 0-3,5",
    timeout="seconds each node's command may take; then its process group is killed "
    "(default: config command_timeout, 120)",
    lines="each output line prefixed with its node, instead of identical outputs grouped",
    json='print [{"node", "rank", "exit_code", "stdout", "stderr", "error"}] instead',
)


@task(name="exec", help=EXEC_HELP)
def exec_(
    context: Context,
    cmd: str | None = None,
    hostfile: str | None = None,
    include: str | None = None,
    exclude: str | None = None,
    node: str | None = None,
    session: str | None = None,
    timeout: str | None = None,
    lines: bool = False,
    json: bool = False,
) -> None:
    """Run CMD on every node at once, each with its meshkit env variables; gather the output.

    Identical outputs are shown once under the nodes that printed them (node[0-3,5]), as
    clush -b does; stderr lines go to stderr, each prefixed with its node. Each node keeps the
    first and last 32 KiB of each stream and says how much it cut. Exit 1 when any node failed
    or did not answer (each named, with why); Ctrl-C ends the command on every node.
    """
    with reported():
        if cmd is None:
            from ...errors import UsageError

            raise UsageError("exec: give the command: meshkit exec --cmd CMD")
        results = execute(
            conf(),
            cmd,
            hostfile=hostfile,
            session=session,
            include=include,
            exclude=exclude,
            nodes=node,
            timeout=timeout,
        )
    if json:
        print(jsonlib.dumps([as_json(result) for result in results], indent=1))
    elif lines:
        print_lines(results)
    else:
        print_groups(results)
    sys.stdout.flush()
    failed = [result for result in results if not result.ok]
    for result in failed:
        print(f"meshkit exec: {result.node} (rank {result.rank}): {result.why}", file=sys.stderr)
    if failed:
        raise Exit(f"meshkit exec: {len(failed)} of {len(results)} nodes failed", 1)


def as_json(result: NodeResult) -> dict[str, object]:
    return {
        "node": result.node,
        "rank": result.rank,
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "error": result.error,
    }


def print_groups(results: Sequence[NodeResult]) -> None:
    """Standard output as ``clush -b`` shows it; standard error per node, on stderr."""
    for group in gather(results):
        header = f"{group.nodes} ({len(group.results)})"
        rule = "-" * len(header)
        print(f"{rule}\n{header}\n{rule}")
        print(group.stdout, end="" if group.stdout.endswith("\n") else "\n")
    sys.stdout.flush()
    for result in results:
        for line in result.stderr.splitlines():
            print(f"{result.node}: {line}", file=sys.stderr)


def print_lines(results: Sequence[NodeResult]) -> None:
    """Every line prefixed with its node, as pdsh prints (stdout's on stdout, stderr's on
    stderr), node by node in rank order."""
    for result in results:
        for line in result.stdout.splitlines():
            print(f"{result.node}: {line}")
    sys.stdout.flush()
    for result in results:
        for line in result.stderr.splitlines():
            print(f"{result.node}: {line}", file=sys.stderr)
