"""meshkit's invoke tasks: parse flags, call the core and the edge, report. User errors -> Exit.

Only ``env`` and ``run`` run on every node at every launch, so this module imports nothing heavy at
the top: SSH (fabric/paramiko) is imported inside the tasks that need it.
"""

from __future__ import annotations

from invoke.collection import Collection
from invoke.context import Context

from ...envrun import DISCOVERY_FLAGS
from ...errors import UsageError
from ..common import conf, helps, reported, task
from . import doctor, events, execute, jobs, mesh, sandbox, top


@task(help=helps(*DISCOVERY_FLAGS, "json"))
def env(
    context: Context,
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
    from ...envrun import node_env, print_env

    with reported():
        node = node_env(
            conf(),
            hostfile=hostfile,
            node_rank=node_rank,
            session=session,
            master_port=master_port,
            nproc_per_node=nproc_per_node,
            include=include,
            exclude=exclude,
        )
        print_env(node, json)


LOG_HELP = "also append all output to this file; {rank} becomes the node rank"


@task(help=helps(*DISCOVERY_FLAGS, "cmd", "spawn", log=LOG_HELP))
def run(
    context: Context,
    cmd: str | None = None,
    hostfile: str | None = None,
    node_rank: str | None = None,
    session: str | None = None,
    master_port: str | None = None,
    nproc_per_node: str | None = None,
    include: str | None = None,
    exclude: str | None = None,
    log: str | None = None,
    spawn: bool = False,
) -> None:
    """Discover this node's rank, then exec CMD under bash with the variables exported.

    This is what every node runs inside tmux for `meshkit train`. With --spawn, CMD runs
    NPROC_PER_NODE times, each with its rank's variables, as torchrun would start it.
    """
    from ...envrun import exec_run, node_env, spawn_run

    with reported():
        if cmd is None:  # a flag, not a positional: `meshkit run -h` is help
            raise UsageError("run: give the command: meshkit run --cmd CMD")
        node = node_env(
            conf(),
            hostfile=hostfile,
            node_rank=node_rank,
            session=session,
            master_port=master_port,
            nproc_per_node=nproc_per_node,
            include=include,
            exclude=exclude,
        )
        if spawn:
            spawn_run(node, cmd, log)
        exec_run(node, cmd, log)


ns = Collection(env, run, mesh.mesh, mesh.check, mesh.unmesh, doctor.doctor, jobs.train)
ns.add_task(execute.exec_)
ns.add_collection(sandbox.ns)
for job_task in (jobs.status, jobs.diagnose, jobs.logs, jobs.stop, jobs.supervise, jobs.demo):
    ns.add_task(job_task)
ns.add_task(top.top)
ns.add_task(events.events)
