"""Sandbox: what train --sync copies and refuses, on three nodes with no shared storage.

Every sandbox node has its own /tmp, so a workdir and a hostfile there are private to one node.
train detects it, copies the workdir (only what changed, excludes honoured) and stores the job on
every node; status, logs, stop and a re-syncing relaunch then work from any node. The copy plan
and the node side alone are test_sync_node, large workdirs test_sync_scale."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import meshkit
from helpers.sandbox_jobs import (
    RESULT,
    check_results,
    job_processes,
    on_node,
    private,
    wait_for,
)

SANDBOX_NODES = 3
NPROC = 1  # one rank a node: several local ranks are test_train's part (sandbox_jobs.NPROC)
REPO = Path(__file__).resolve().parent.parent
WORK = Path("/tmp/mkwork")  # under every node's own /tmp: private to each node
HOSTFILE = Path("/tmp/mkhosts/hostfile")


@pytest.fixture(scope="module")
def meshed(cluster):
    out = meshkit("mesh", "--hostfile", str(cluster.hostfile), "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    work = private(cluster, 0, WORK)
    (work / ".git").mkdir(parents=True)
    (work / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (work / "skipme").mkdir()
    (work / "skipme" / "data.bin").write_bytes(b"\0" * 1000)
    (work / "sub").mkdir()
    (work / "sub" / "big.bin").write_bytes(os.urandom(1_300_000))  # several put chunks
    shutil.copy(REPO / "meshkit" / "templates" / "example_train.py", work / "example_train.py")
    hostfile = private(cluster, 0, HOSTFILE)
    hostfile.parent.mkdir(parents=True)
    hostfile.write_text(cluster.hostfile.read_text())
    return cluster


def results(lay, session: str) -> list:
    found = []
    for rank in range(len(lay.nodes)):
        log = private(lay, rank, WORK / ".meshkit" / session / f"node{rank}.log")
        if log.exists():
            found += [(rank, match) for match in RESULT.finditer(log.read_text())]
    return found


def run_in(lay, index: int, *args: str, env: str = ""):
    out = on_node(lay, index, Path("/"), *args, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_private_workdirs_are_synced_and_the_job_works_from_any_node(meshed):
    lay = meshed
    nodes = len(lay.nodes)
    # --spawn: what is synced is the point, not the launcher (no torchrun booting torch on
    # every node before its rank does, twice)
    cmd = "python example_train.py --sleep 600"
    base = ["--workdir", str(WORK), "--session", "sy"]
    out = run_in(
        lay,
        0,
        "train",
        "--hostfile",
        str(HOSTFILE),
        *base,
        "--nproc-per-node",
        str(NPROC),
        "--restarts",
        "1",
        "--spawn",
        "--cmd",
        cmd,
        env="MESHKIT_SYNC_EXCLUDE='[\"skipme\"]'",
    )
    assert "is not shared with" in out.stdout
    assert "syncing it" in out.stdout
    assert f"synced 2 changed files to {lay.nodes[1].address}" in out.stdout, out.stdout
    for i in (1, 2):
        copy = private(lay, i, WORK)
        assert (copy / "sub" / "big.bin").read_bytes() == (
            private(lay, 0, WORK) / "sub" / "big.bin"
        ).read_bytes()
        assert not (copy / ".git").exists()
        assert not (copy / "skipme").exists()
        assert (copy / ".meshkit" / "sy" / "job.json").exists()  # the job is stored everywhere
        assert (copy / ".meshkit" / "sy" / "hostfile").exists()
        assert not private(lay, i, HOSTFILE).exists()  # only node0 has the hostfile's path

    def all_results() -> list | None:
        found = results(lay, "sy")
        if len(found) == nodes * NPROC:
            return found
        return None

    check_results(wait_for(all_results), nodes, NPROC)

    # status from a node without the hostfile: through --workdir, and through the index
    rows = json.loads(run_in(lay, 2, "status", *base, "--json").stdout)
    assert [row["state"] for row in rows] == ["running"] * nodes
    assert rows[0]["supervisor"] == "running"
    rows = json.loads(
        run_in(lay, 1, "status", "--hostfile", str(HOSTFILE), "--session", "sy", "--json").stdout
    )
    assert [row["node_rank"] for row in rows] == list(range(nodes))
    logs = run_in(lay, 1, "logs", *base, "--node", "2", "--lines", "5").stdout
    assert "[2] meshkit-example" in logs

    # a changed file (and a new one) is re-synced on a bare relaunch; unchanged ones are not
    with open(private(lay, 0, WORK) / "example_train.py", "a") as script:
        script.write("# v2\n")
    (private(lay, 0, WORK) / "new.txt").write_text("new\n")
    out = run_in(lay, 0, "train", *base)
    assert "relaunching saved job" in out.stdout
    # example_train.py and new.txt, and the example's checkpoint, which rank 0 wrote in node0's
    # copy of the workdir (checkpoints/sy.pt): the relaunch carries it to the others
    assert f"synced 3 changed files to {lay.nodes[2].address}" in out.stdout, out.stdout
    for i in (1, 2):
        assert (private(lay, i, WORK) / "example_train.py").read_text().endswith("# v2\n")
        assert (private(lay, i, WORK) / "new.txt").read_text() == "new\n"
    wait_for(lambda: len(results(lay, "sy")) == 2 * nodes * NPROC)

    out = run_in(lay, 2, "stop", *base)
    assert out.stdout.count("nothing left") == nodes
    assert job_processes(lay) == []
    rows = json.loads(run_in(lay, 1, "status", *base, "--json").stdout)
    assert [row["state"] for row in rows] == ["absent"] * nodes
    assert rows[0]["supervisor"] is None


def test_train_doctor_on_private_workdirs_checks_the_synced_copies(meshed):
    """--doctor runs `meshkit env` in the workdir on every node: a synced job's copies are made
    first, and a copy (not shared, so without the master's marker) passes the workdir check."""
    lay = meshed
    work = Path("/tmp/mkwork-doctor")
    private(lay, 0, work).mkdir(parents=True)
    (private(lay, 0, work) / "job.sh").write_text("sleep 120\n")
    base = ["--workdir", str(work), "--session", "sd"]
    out = run_in(
        lay, 0, "train", "--hostfile", str(HOSTFILE), *base, "--doctor", "--cmd", "bash job.sh"
    )
    assert "syncing it" in out.stdout, out.stdout
    assert "quick checks passed" in out.stdout, out.stdout
    assert out.stdout.count("synced 1 changed files") == len(lay.nodes) - 1, out.stdout
    for i in range(1, len(lay.nodes)):
        assert (private(lay, i, work) / "job.sh").exists()
    out = run_in(lay, 1, "stop", *base)
    assert out.stdout.count("nothing left") == len(lay.nodes)


def test_a_node_side_link_is_reported_and_nothing_is_written_through_it(meshed):
    """node1's workdir has data -> /tmp/dataset (its own, outside the workdir), where this
    machine has a directory: train copies everything else everywhere, says what is in the way on
    node1 and the fix, writes nothing through the link and starts nothing; excluding the name is
    the fix."""
    lay = meshed
    work = Path("/tmp/mkwork-link")
    here = private(lay, 0, work)
    (here / "data" / "shards").mkdir(parents=True)
    (here / "data" / "shards" / "train.bin").write_bytes(b"the controller's copy\n" * 100)
    (here / "data" / "new.bin").write_bytes(b"new\n")
    (here / "job.sh").write_text("sleep 120\n")
    dataset = private(lay, 1, Path("/tmp/dataset"))
    (dataset / "shards").mkdir(parents=True)
    (dataset / "shards" / "train.bin").write_bytes(b"node1's own dataset\n")
    (private(lay, 1, work)).mkdir()
    (private(lay, 1, work) / "data").symlink_to("/tmp/dataset")
    base = ["--workdir", str(work), "--session", "sl"]
    line = ["train", "--hostfile", str(HOSTFILE), *base, "--cmd", "bash job.sh"]
    out = on_node(lay, 0, Path("/"), *line)
    said = out.stdout + out.stderr
    assert out.returncode != 0, said
    link = f"{lay.nodes[1].address}: {work}/data is a symlink to /tmp/dataset on the node"
    assert link in said, said
    assert "exclude it (config sync_exclude: [data])" in said, said
    assert "nothing was started" in said, said
    assert lay.nodes[2].address not in said, said  # node2 had nothing in the way
    assert (dataset / "shards" / "train.bin").read_bytes() == b"node1's own dataset\n"
    assert sorted(os.listdir(dataset)) == ["shards"]
    assert sorted(os.listdir(dataset / "shards")) == ["train.bin"]
    assert (private(lay, 1, work) / "job.sh").read_text() == "sleep 120\n"  # the rest is there
    assert (private(lay, 2, work) / "data" / "shards" / "train.bin").exists()
    assert job_processes(lay) == []
    # the fix the message names: the link is left out, and the job starts
    out = run_in(lay, 0, *line, env="MESHKIT_SYNC_EXCLUDE='[\"data\"]'")
    assert (dataset / "shards" / "train.bin").read_bytes() == b"node1's own dataset\n"
    out = run_in(lay, 1, "stop", *base)
    assert out.stdout.count("nothing left") == len(lay.nodes)
