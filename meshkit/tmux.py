"""tmux on the nodes: argv builders (quoted with shlex.join, never glued by hand) and the wrapper
script every node runs inside its session."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from .job import Job

SESSION_TAG = "MESHKIT_SESSION"  # every process of a job inherits it: how stop finds them all


def meshkit_argv(job: Job, task: str, *extra: str) -> list[str]:
    """``python -m meshkit TASK`` with the job's discovery flags: the same on every node."""
    argv = [
        job.python,
        "-m",
        "meshkit",
        task,
        "--hostfile",
        job.hostfile,
        "--session",
        job.session,
        "--master-port",
        str(job.master_port),
    ]
    if job.nproc_per_node:
        argv += ["--nproc-per-node", str(job.nproc_per_node)]
    if job.include:
        argv += ["--include", job.include]
    if job.exclude:
        argv += ["--exclude", job.exclude]
    return [*argv, *extra]


def wrapper_script(job: Job) -> str:
    """What runs in the tmux session: setup lines, then ``meshkit run`` (which discovers this node's
    rank and tees its output to ``node<rank>.log``), then the exit code kept for ``status``."""
    state = job.state_dir
    lines = [
        f"export {SESSION_TAG}={shlex.quote(job.session)}",
        *(f"export {k}={shlex.quote(v)}" for k, v in sorted(job.env.items())),
        shlex.join(["mkdir", "-p", state, str(job.home)]),
        f"date +%s > {shlex.quote(state + '/started')}",
        shlex.join(["rm", "-f", f"{state}/exit"]),
        *job.setup,
        shlex.join(meshkit_argv(job, "run", "--log", job.log_pattern, "--cmd", job.cmd)),
        f"echo $? > {shlex.quote(state + '/exit')}",
    ]
    return "\n".join(lines) + "\n"


def new_session(job: Job) -> list[str]:
    return [
        "tmux",
        "new-session",
        "-d",
        "-s",
        job.session,
        "-c",
        job.workdir,
        "bash",
        "-c",
        wrapper_script(job),
    ]


def node_op(job: Job, op: str, *args: str) -> list[str]:
    """``python -m meshkit.node OP``: the node-side helpers (status, stop, port probe)."""
    return [job.python, "-m", "meshkit.node", op, *args]


def command(argv: Sequence[str]) -> str:
    return shlex.join(argv)
