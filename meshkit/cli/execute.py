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

from ..envrun import Fallback, parse
from ..errors import MeshkitError
from ..ops.execute import NodeResult, execute, gather
from ..settings import Config, load


def run(
    conf: Config,
    cmd: str,
    *,
    hostfile: str | None = None,
    include: str | None = None,
    exclude: str | None = None,
    node: str | None = None,
    session: str | None = None,
    timeout: str | None = None,
    lines: bool = False,
    json: bool = False,
) -> str | None:
    """Run ``cmd`` on the nodes and print what they said; the failure message (exit 1) when any
    node failed or did not answer, each of those named on stderr, else None. Raises meshkit's
    errors (a bad flag, no hostfile) before any node is contacted."""
    results = execute(
        conf,
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
        return f"meshkit exec: {len(failed)} of {len(results)} nodes failed"
    return None


def main(argv: Sequence[str]) -> bool:
    """``meshkit exec FLAGS`` without invoke: run it and return True; False when the command line
    is not one the plain parser is sure of (help, an unknown flag), for invoke to handle. Exits
    as the task does: 1 when a node failed, a meshkit error's own code."""
    if not argv or argv[0] != "exec":
        return False
    try:
        flags = parse("exec", argv[1:])
    except Fallback:
        return False
    values = flags.values
    try:
        failure = run(
            load(),
            str(values["cmd"]),
            hostfile=values["hostfile"],
            include=values["include"],
            exclude=values["exclude"],
            node=values["node"],
            session=values["session"],
            timeout=values["timeout"],
            lines="lines" in flags.given,
            json="json" in flags.given,
        )
    except MeshkitError as exc:
        sys.stdout.flush()
        print(f"meshkit: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    if failure is not None:
        print(failure, file=sys.stderr)
        raise SystemExit(1)
    return True


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
