"""``doctor``: per node and per pair, can this cluster train? Parse, call ``ops.doctor``, render."""

from __future__ import annotations

import json as jsonlib
from typing import TYPE_CHECKING

from invoke.context import Context
from invoke.exceptions import Exit

from ...errors import UsageError
from ..common import conf, helps, progress, reported, table, task

if TYPE_CHECKING:
    from ...ops.doctor import Report

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


def render(report: Report) -> str:
    return table(
        ["check", "node", "peer", "ok", "detail", "fix"],
        [
            (c.check, c.node, c.peer or "", "ok" if c.ok else "FAIL", c.detail[:90], c.fix[:80])
            for c in report.checks
        ],
    )


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
    from ...ops.lookup import saved_or_new
    from ...ops.mesh import verify
    from ...ops.pool import connect

    with reported():
        try:
            seconds = float(timeout)
        except ValueError:
            seconds = -1.0
        if not 1 <= seconds <= 600:
            raise UsageError(f"--timeout {timeout!r}: expected seconds between 1 and 600")
        job, hosts, source = saved_or_new(
            conf(), hostfile, session, workdir, master_port, include, exclude
        )
        shown = None if json else progress
        with connect(conf(), job.hostfile, hosts, job.python, shown) as pool:
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
