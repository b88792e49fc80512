"""``doctor``: per node and per pair, can this cluster train? Parse, call ``ops.doctor``, render."""

from __future__ import annotations

import json as jsonlib
import os
import sys
from typing import TYPE_CHECKING

from invoke.context import Context
from invoke.exceptions import Exit

from ...errors import JobError, UsageError
from ...hostfile import Host
from ...job import Job, check_session
from ..common import conf, helps, int_option, option, progress, reported, table, task
from .mesh import ssh_settings

if TYPE_CHECKING:
    from ...ops.doctor import Report
    from ...ops.jobs import NodePool

DOCTOR_HELP = helps(
    "hostfile",
    "session",
    "workdir",
    "json",
    "include",
    "exclude",
    "master_port",
    quick="leave out the slow parts: the N x N SSH check and the collective probe",
    timeout="seconds the collective probe may take to connect and all_reduce (default 30)",
)


def _target(
    hostfile: str | None,
    session: str | None,
    workdir: str | None,
    master_port: str | None,
    include: str | None,
    exclude: str | None,
) -> tuple[Job, list[Host], str]:
    """The saved job of ``--session`` when there is one (its port, workdir, interpreter), else
    what ``train`` would start with these flags."""
    from ...discovery import read_hosts
    from ...ops import jobs
    from ...topology import derive_master_port

    name = check_session(str(option("session", session)))
    path = os.path.abspath(str(option("hostfile", hostfile)))
    try:
        job = jobs.find_job(
            name, workdir=option("workdir", workdir), hostfile=path, cwd=os.getcwd()
        )
        source = f"saved job {job.label}"
    except JobError:
        chosen = (option("include", include), option("exclude", exclude))
        hosts = read_hosts(path, *chosen)
        job = Job(
            cmd="meshkit doctor",
            workdir=os.path.abspath(option("workdir", workdir) or os.getcwd()),
            session=name,
            hostfile=path,
            python=str(conf().python or sys.executable),
            master_port=int_option("master_port", master_port) or derive_master_port(hosts, name),
            include=chosen[0],
            exclude=chosen[1],
        )
        source = f"session {name!r} (no saved job; port derived)"
    else:
        hosts = read_hosts(job.hostfile, job.include, job.exclude)
        port = int_option("master_port", master_port)
        if port and port != job.master_port:
            from ...record import replace

            job = replace(job, master_port=port)
    return job, hosts, source


def render(report: Report) -> str:
    return table(
        ["check", "node", "peer", "ok", "detail", "fix"],
        [
            (c.check, c.node, c.peer or "", "ok" if c.ok else "FAIL", c.detail[:90], c.fix[:80])
            for c in report.checks
        ],
    )


def train_preflight(pool: NodePool, job: Job, hosts: list[Host]) -> None:
    """``train --doctor``: the doctor's quick checks before anything starts; any failure starts
    nothing (LaunchError lists each failed check with its fix)."""
    from ...errors import LaunchError
    from ...ops import doctor as ops

    report = ops.quick(pool, job, hosts)
    if not report.ok:
        print(render(report))
        raise LaunchError(
            [
                f"{c.node}{' -> ' + c.peer if c.peer else ''}: {c.check}: {c.detail}; fix: {c.fix}"
                for c in report.failures
            ]
            + ["train --doctor: checks failed; nothing was started"]
        )
    print(f"doctor: {len(report.checks)} quick checks passed")


@task(help=DOCTOR_HELP)
def doctor(
    c: Context,
    hostfile: str | None = None,
    session: str | None = None,
    workdir: str | None = None,
    json: bool = False,
    include: str | None = None,
    exclude: str | None = None,
    master_port: str | None = None,
    quick: bool = False,
    timeout: str = "30",
) -> None:
    """Check that the cluster can train, per node and per pair: SSH N x N, rank discovery and the
    interface each node's backends will use, the master port (free on the master, reachable from
    every node), node-to-node TCP on those interfaces, versions, GPUs vs slots, the shared
    workdir, clocks, and a tiny all_reduce. Every check is bounded in time; exit 1 if any fails."""
    from ...ops import doctor as ops
    from ...ops.mesh import verify
    from ...remote import AgentPool

    with reported():
        try:
            seconds = float(timeout)
        except ValueError:
            seconds = -1.0
        if not 1 <= seconds <= 600:
            raise UsageError(f"--timeout {timeout!r}: expected seconds between 1 and 600")
        job, hosts, source = _target(hostfile, session, workdir, master_port, include, exclude)
        settings = ssh_settings(c, job.hostfile)
        with AgentPool.connect(hosts, settings, job.python, None if json else progress) as pool:
            report = ops.run(
                pool,
                job,
                hosts,
                verify=None if quick else (lambda: verify(pool.cluster, hosts).failures),
                collective=not quick,
                probe_seconds=seconds,
            )
    if json:
        print(jsonlib.dumps(report.as_json()))
    else:
        print(f"doctor: {len(hosts)} nodes, {source}, master port {job.master_port}")
        print(render(report))
        bad = report.failures
        print(f"\n{len(report.checks) - len(bad)}/{len(report.checks)} checks passed")
    if not report.ok:
        raise Exit(code=1)
