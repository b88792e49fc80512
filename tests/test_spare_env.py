"""`meshkit env` inside a sandbox node (its own namespaces and addresses, as a user logged in there)
whose hostfile line is a spare: it says it is a spare and exits non-zero, unless the saved job's
membership gave it a rank, which it then prints. The replacement that gives a spare its rank is
tested with real jobs in test_spares.py; here the job is saved as its launch saves it."""

from __future__ import annotations

import sys
from pathlib import Path

from helpers.sandbox_jobs import on_node

from meshkit.hostfile import members_text, parse
from meshkit.job import Job
from meshkit.record import replace

SANDBOX_NODES = 3
SPARE = 2  # the node whose line is the spare


def save_job(hostfile: Path, workdir: Path, members: tuple[str, ...], generation: int) -> Job:
    """The job file, its index beside the hostfile and the membership's hostfile."""
    job = Job("x", str(workdir), "spare", str(hostfile), sys.executable, 25321, restarts=2)
    job = replace(job, members=members, generation=generation)
    Path(job.file).parent.mkdir(parents=True, exist_ok=True)
    Path(job.file).write_text(job.to_json())
    Path(job.index).parent.mkdir(parents=True, exist_ok=True)
    Path(job.index).write_text(job.index_json())
    if members:
        by_label = {host.label: host for host in parse(hostfile.read_text())}
        Path(job.node_hostfile).write_text(members_text([by_label[name] for name in members]))
    return job


def test_env_on_a_spare_node_says_so_until_the_jobs_membership_gives_it_a_rank(cluster):
    lay = cluster
    addresses = [node.address for node in lay.nodes]
    hostfile = lay.shared / "hostfile-spare"
    lines = [
        f"{addresses[0]} slots=2",
        f"{addresses[1]} slots=2",
        f"{addresses[SPARE]} slots=2 spare",
    ]
    hostfile.write_text("\n".join(lines) + "\n")
    workdir = lay.shared / "work"
    workdir.mkdir()
    env = ["env", "--hostfile", str(hostfile), "--session", "spare"]

    out = on_node(lay, SPARE, workdir, *env)
    assert out.returncode != 0
    assert f"{hostfile}:3: this machine" in out.stderr
    assert "is a spare of this hostfile" in out.stderr
    assert "Traceback" not in out.stderr
    out = on_node(lay, 1, workdir, *env)  # a node that takes a rank is not affected
    assert out.returncode == 0, out.stderr
    assert "export NODE_RANK=1\n" in out.stdout

    # node 0 was lost: the spare holds rank 0 and is the master
    save_job(hostfile, workdir, (addresses[SPARE], addresses[1]), generation=2)
    out = on_node(lay, SPARE, workdir, *env)
    assert out.returncode == 0, out.stderr
    assert "export NODE_RANK=0\n" in out.stdout
    assert "export NNODES=2\n" in out.stdout
    assert f"export MASTER_ADDR={addresses[SPARE]}\n" in out.stdout
    assert "export MASTER_PORT=25321\n" in out.stdout

    # a newer generation without it (it was lost in turn): a spare again
    save_job(hostfile, workdir, (addresses[0], addresses[1]), generation=3)
    out = on_node(lay, SPARE, workdir, *env)
    assert out.returncode != 0
    assert "is a spare of this hostfile" in out.stderr
