"""`meshkit env` inside a sandbox node (its own namespaces and addresses, as a user logged in there)
whose hostfile line is a spare: it says it is a spare and exits non-zero, unless the saved job's
membership gave it a rank, which it then prints; a node whose line is not a spare likewise
prints its rank in a changed membership, or says it is in none. The replacement that gives a
spare its rank is tested with real jobs in test_spares.py; here the job is saved as its launch
saves it."""

from __future__ import annotations

from helpers.sandbox_jobs import on_node
from helpers.saved_jobs import MASTER_PORT, saved_job

SANDBOX_NODES = 3
SPARE = 2  # the node whose line is the spare


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
    env = ["env", "--hostfile", str(hostfile), "--session", "s"]

    out = on_node(lay, SPARE, workdir, *env)
    assert out.returncode != 0
    assert f"{hostfile}:3: this machine" in out.stderr
    assert "is a spare of this hostfile" in out.stderr
    assert "Traceback" not in out.stderr
    out = on_node(lay, 1, workdir, *env)  # a node that takes a rank is not affected
    assert out.returncode == 0, out.stderr
    assert "export NODE_RANK=1\n" in out.stdout

    # node 0 was lost: the spare holds rank 0 and is the master
    saved_job(hostfile, (addresses[SPARE], addresses[1]), generation=2)
    out = on_node(lay, SPARE, workdir, *env)
    assert out.returncode == 0, out.stderr
    assert "export NODE_RANK=0\n" in out.stdout
    assert "export NNODES=2\n" in out.stdout
    assert f"export MASTER_ADDR={addresses[SPARE]}\n" in out.stdout
    assert f"export MASTER_PORT={MASTER_PORT}\n" in out.stdout

    # a node whose line is not a spare takes its rank from the membership too: node 0, lost,
    # has none; node 1, after node 0's loss shrank the job, is rank 0 and the master
    out = on_node(lay, 0, workdir, *env)
    assert out.returncode != 0
    assert "is not in the membership of session s's job (generation 2)" in out.stderr
    assert "Traceback" not in out.stderr
    saved_job(hostfile, (addresses[1], addresses[SPARE]), generation=3)
    out = on_node(lay, 1, workdir, *env)
    assert out.returncode == 0, out.stderr
    assert "export NODE_RANK=0\n" in out.stdout
    assert f"export MASTER_ADDR={addresses[1]}\n" in out.stdout

    # a newer generation without it (it was lost in turn): a spare again
    saved_job(hostfile, (addresses[0], addresses[1]), generation=4)
    out = on_node(lay, SPARE, workdir, *env)
    assert out.returncode != 0
    assert "is a spare of this hostfile" in out.stderr
