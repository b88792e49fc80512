"""meshkit's invoke tasks: parse flags, call the core and the edge, report. User errors -> Exit.

Only ``env`` and ``run`` run on every node at every launch, so this module imports nothing heavy at
the top: SSH (fabric/paramiko) is imported inside the tasks that need it.
"""

from __future__ import annotations

import json as jsonlib
import os
import shlex
import sys
from typing import Any

from invoke.collection import Collection
from invoke.context import Context
from invoke.tasks import task

from . import tasks_mesh, tasks_sandbox, tasks_train
from .cli import helps, int_option, option, reported
from .config import DEFAULTS
from .errors import MeshkitError


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


@task(
    help=helps(
        *DISCOVERY, "cmd", log="also append all output to this file; {rank} becomes the node rank"
    )
)
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
    log: str | None = None,
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
        script = cmd
        if log:
            target = log.replace("{rank}", str(node.node_rank))
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            # A pipeline, not `exec > >(tee ...)`: bash then waits for tee, so the log is complete
            # by the time the exit code is recorded.
            script = f"{{ {cmd}\n}} 2>&1 | tee -a {shlex.quote(target)}\nexit ${{PIPESTATUS[0]}}"
        os.execvpe("bash", ["bash", "-c", script], {**os.environ, **variables(node), "PATH": path})


ns = Collection(
    env,
    run,
    tasks_mesh.mesh,
    tasks_mesh.check,
    tasks_mesh.unmesh,
    tasks_train.train,
    tasks_train.status,
    tasks_train.logs,
    tasks_train.stop,
    tasks_train.demo,
)
ns.add_collection(tasks_sandbox.ns)
ns.configure({"meshkit": DEFAULTS})
