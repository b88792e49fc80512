"""A supervised job saved as its launch saves it, without launching it: what `meshkit env` reads
to place a node by the job's membership (shared by test_membership and test_spare_env)."""

from __future__ import annotations

import sys
from pathlib import Path

from meshkit.hostfile import members_text, parse
from meshkit.job import Job
from meshkit.record import replace

MASTER_PORT = 25123


def saved_job(
    hostfile: Path, members: tuple[str, ...], generation: int = 2, session: str = "s"
) -> Job:
    """A supervised job of ``hostfile`` in the workdir ``work`` beside it: its job file, its
    index beside the hostfile, and (after a change of membership, ``members`` not empty) the
    membership's hostfile, its nodes in rank order."""
    workdir = hostfile.parent / "work"
    job = Job("x", str(workdir), session, str(hostfile), sys.executable, MASTER_PORT, restarts=2)
    job = replace(job, generation=generation, members=members)
    for path, text in ((job.file, job.to_json()), (job.index, job.index_json())):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    if members:
        by_label = {host.label: host for host in parse(hostfile.read_text())}
        text = members_text([by_label[label] for label in members])
        Path(job.node_hostfile).write_text(text)
    return job
