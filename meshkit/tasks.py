"""meshkit's invoke tasks: parse flags, call the core and the edge, report. User errors -> Exit.

Only ``env`` and ``run`` run on every node at every launch, so this module imports nothing heavy at
the top: SSH (fabric/paramiko) is imported inside the tasks that need it.
"""

from __future__ import annotations

import json as jsonlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from invoke.collection import Collection
from invoke.context import Context
from invoke.exceptions import Exit
from invoke.tasks import task

from .config import DEFAULTS, settings
from .errors import MeshkitError

HELP = {
    "hostfile": "hostfile path (default: config meshkit.hostfile, i.e. ./hostfile)",
    "include": "only these nodes: comma list of names, patterns (gpu*) or ranges (node[01-04])",
    "exclude": "leave out these nodes (same forms as --include)",
    "session": "job/session name (default: config meshkit.session, 'meshkit')",
    "json": "print JSON instead of text",
    "node_rank": "this node's rank, skipping discovery (also MESHKIT_NODE_RANK)",
    "master_port": "master port (default: derived from the hostfile and session, same on every node)",
    "nproc_per_node": "processes per node, or 'auto' (hostfile slots, else GPUs, else 1)",
    "cmd": "the command to run (bash); $NODE_RANK, $MASTER_ADDR etc. expand in it",
}


def helps(*names: str, **extra: str) -> dict[str, str]:
    """Help texts for the flags a task takes: shared wording from HELP, plus the task's own."""
    return {**{n: HELP[n] for n in names}, **extra}


@contextmanager
def reported() -> Iterator[None]:
    """Turn meshkit's user errors into a message and exit code 1, never a traceback."""
    try:
        yield
    except MeshkitError as exc:
        raise Exit(f"meshkit: {exc}", 1) from None
    except KeyboardInterrupt:
        raise Exit("meshkit: interrupted", 130) from None


def option(c: Any, name: str, flag: Any) -> Any:
    """A flag when given, else the configured value (flags are the last config level)."""
    return flag if flag is not None else settings(c.config)[name]


def int_option(c: Any, name: str, flag: Any, *, allow_auto: bool = False) -> int | None:
    value = option(c, name, flag)
    if value is None or value == "" or (allow_auto and str(value) == "auto"):
        return None
    text = str(value)
    if not text.isdigit() or int(text) < 1:
        hint = " or 'auto'" if allow_auto else ""
        raise MeshkitError(
            f"--{name.replace('_', '-')} {text!r}: expected a whole number >= 1{hint}"
        )
    return int(text)


def _node_env(
    c: Any,
    hostfile: Any,
    node_rank: Any,
    session: Any,
    master_port: Any,
    nproc_per_node: Any,
    include: Any,
    exclude: Any,
) -> Any:
    from .discovery import discover

    rank = None
    if node_rank is not None:
        if not str(node_rank).isdigit():
            raise MeshkitError(f"--node-rank {node_rank!r}: expected a whole number >= 0")
        rank = int(node_rank)
    return discover(
        option(c, "hostfile", hostfile),
        session=option(c, "session", session),
        node_rank=rank,
        master_port=int_option(c, "master_port", master_port),
        nproc_per_node=int_option(c, "nproc_per_node", nproc_per_node, allow_auto=True),
        include=option(c, "include", include),
        exclude=option(c, "exclude", exclude),
    )


DISCOVERY = (
    "hostfile",
    "node_rank",
    "session",
    "master_port",
    "nproc_per_node",
    "include",
    "exclude",
)


@task(help=helps(*DISCOVERY, "json"))
def env(
    c: Context,
    hostfile: str | None = None,
    json: bool = False,
    node_rank: str | None = None,
    session: str | None = None,
    master_port: str | None = None,
    nproc_per_node: str | None = None,
    include: str | None = None,
    exclude: str | None = None,
) -> None:
    """Work out this node's rank and print `export K=V` lines (or --json).

    Sources, first match wins: --node-rank/MESHKIT_NODE_RANK, torchrun, SLURM, OpenMPI, PBS, then
    the hostfile matched against this machine's addresses. Use: eval "$(meshkit env)".
    """
    from .distenv import as_json, export_lines

    with reported():
        node = _node_env(
            c, hostfile, node_rank, session, master_port, nproc_per_node, include, exclude
        )
        print(jsonlib.dumps(as_json(node)) if json else export_lines(node))


@task(help=helps(*DISCOVERY, "cmd"))
def run(
    c: Context,
    cmd: str,
    hostfile: str | None = None,
    node_rank: str | None = None,
    session: str | None = None,
    master_port: str | None = None,
    nproc_per_node: str | None = None,
    include: str | None = None,
    exclude: str | None = None,
) -> None:
    """Discover this node's rank, then exec CMD under bash with the variables exported.

    This is what every node runs inside tmux for `meshkit train`.
    """
    from .distenv import variables

    with reported():
        node = _node_env(
            c, hostfile, node_rank, session, master_port, nproc_per_node, include, exclude
        )
        sys.stdout.flush()
        # Nodes share the venv path: make its tools (torchrun) reachable as if it were activated.
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
        os.execvpe("bash", ["bash", "-c", cmd], {**os.environ, **variables(node), "PATH": path})


ns = Collection(env, run)
ns.configure({"meshkit": DEFAULTS})
