"""Spare nodes on the sandbox (real sshd, tmux, torchrun with gloo): 4 active nodes and 1 spare.
A node powered off for good mid-run is lost after --replace-after: the spare takes its rank, every
other node keeps its own, the job runs again and completes from its checkpoint; the master's loss
moves rank 0 and MASTER_ADDR to the spare; a lost node powered on later runs nothing of the job
and is listed as a spare; a synced job's workdir reaches the spare first. Shrinking and giving up:
tests/test_spares_shrink.py (a module of its own: each takes minutes, and modules are what CI's
workers share out)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.sandbox_jobs import NPROC, private, supervisor_said, wait_for
from helpers.spares import (
    ACTIVE,
    ATTEMPT,
    REPO,
    WHO,
    job_left,
    last_attempt,
    mesh_with_spare,
    power_off,
    power_on,
    ran_to_the_end,
    started,
    status,
    train,
)

SANDBOX_NODES = 5


@pytest.fixture(scope="module")
def meshed(cluster):
    return mesh_with_spare(cluster)


def test_a_node_lost_for_good_is_replaced_by_the_spare_which_takes_its_rank(meshed):
    lay, workdir, hostfile = meshed
    session = "lost2"
    # a longer bound here: status is asked while the leader waits (a status round waits its
    # connect timeout, 10 s, for the node that is off)
    train(lay, workdir, hostfile, session, replace_after="30s")
    started(lay, workdir, session)
    rows = status(lay, workdir, session, node=1)
    assert rows[0]["generation"] == 1
    assert [spare["node"] for spare in rows[0]["spares"]] == [lay.nodes[4].address]
    assert rows[0]["spares"][0]["healthy"] is True
    power_off(lay, 2)
    (workdir / f"{session}.sleep").write_text("0\n")
    # while the leader waits for it, status says so, and that the supervisors are alive
    wait_for(lambda: supervisor_said(workdir, session, "waiting for"), timeout=90, interval=0.5)
    rows = status(lay, workdir, session, node=1)
    assert lay.nodes[2].address in str(rows[0]["waiting"])
    assert "UTC" in str(rows[0]["waiting"])
    assert rows[0]["supervisor"] == "running"
    assert rows[0]["leader"] == 0
    # lost after --replace-after, replaced, relaunched, done: well within the bound + 30 s + the
    # relaunch itself (torchrun's start on 5 nodes sharing 2 cores)
    wait_for(lambda: supervisor_said(workdir, session, " done: "), timeout=240, interval=2)
    rows = status(lay, workdir, session, node=1)
    assert [row["host"] for row in rows] == [
        lay.nodes[0].address,
        lay.nodes[1].address,
        lay.nodes[4].address,
        lay.nodes[3].address,
    ]
    assert rows[0]["supervisor"] == "done"
    assert rows[0]["generation"] == 2
    assert rows[0]["lost"] == [lay.nodes[2].address]
    assert rows[0]["replaced"] == [f"{lay.nodes[2].address} -> {lay.nodes[4].address}"]
    assert "replaced" in str(rows[0]["last_restart_reason"])
    assert rows[0]["restarts_left"] == 2  # a replacement uses up no restart
    # the relaunch resumed from the first attempt's last checkpoint, not from step 0
    assert "resumed from step 20" in last_attempt(workdir, session, 0)
    for rank in range(ACTIVE):
        attempt = last_attempt(workdir, session, rank)
        told = ATTEMPT.search(attempt)
        assert told is not None, attempt
        assert told.group(2) == "replaced"
        assert told.group(3) == "2"
        assert told.group(4) == lay.nodes[0].address
        found = WHO.findall(attempt)
        assert len(found) == NPROC
        for _rank, world, meshkit_rank, host, total, expected in found:
            assert int(world) == ACTIVE * NPROC
            assert int(meshkit_rank) == rank
            assert total == expected
            want = "node4" if rank == 2 else f"node{rank}"
            assert host == want
    # the lost node comes back: it runs nothing of the job and is a spare now
    power_on(lay, 2)
    rows = wait_for(
        lambda: [
            row
            for row in [status(lay, workdir, session, node=3)[0]]
            if [spare["node"] for spare in row["spares"] if spare["healthy"]]
            == [lay.nodes[2].address]
        ],
        timeout=60,
        interval=2,
    )
    assert rows
    assert job_left(lay, 2) == []


def test_the_master_lost_moves_rank_0_and_master_addr_to_the_spare(meshed):
    lay, workdir, hostfile = meshed
    # node 2 is back from the test above, now the hostfile's spare line is node 4 again
    session = "lost0"
    train(lay, workdir, hostfile, session, node=1, spawn=True)
    started(lay, workdir, session)
    power_off(lay, 0)
    (workdir / f"{session}.sleep").write_text("0\n")
    try:
        wait_for(lambda: supervisor_said(workdir, session, " done: "), timeout=240, interval=2)
        rows = status(lay, workdir, session, node=3)
        assert rows[0]["host"] == lay.nodes[4].address
        assert rows[0]["supervisor"] == "done"
        told = ATTEMPT.search(last_attempt(workdir, session, 1))
        assert told is not None
        assert told.group(4) == lay.nodes[4].address  # MASTER_ADDR moved
        assert ran_to_the_end(workdir, session, ACTIVE)
    finally:
        power_on(lay, 0)


def test_a_synced_job_syncs_the_workdir_to_the_spare_that_replaces_a_lost_node(meshed):
    """No shared storage: the workdir and hostfile live in node 0's own /tmp; the spare gets the
    workdir (and the job's hostfile) before it takes the lost node's rank."""
    lay, _, shared_hostfile = meshed
    work = Path("/tmp/mkspare")
    hosts = Path("/tmp/mkspare-hosts/hostfile")
    mine = private(lay, 0, work)
    mine.mkdir(parents=True)
    shutil.copy(REPO / "meshkit" / "templates" / "example_train.py", mine / "example_train.py")
    private(lay, 0, hosts).parent.mkdir(parents=True)
    private(lay, 0, hosts).write_text(shared_hostfile.read_text())
    session = "synced"
    train(lay, work, hosts, session, spawn=True)
    home = [private(lay, index, work / ".meshkit" / session) for index in range(SANDBOX_NODES)]

    def told(index: int, rank: int) -> str:
        log = home[index] / f"node{rank}.log"
        return log.read_text().split("===== meshkit: attempt ")[-1] if log.exists() else ""

    wait_for(
        lambda: all(len(WHO.findall(told(rank, rank))) == NPROC for rank in range(ACTIVE)),
        timeout=240,
        interval=2,
    )
    power_off(lay, 2)
    (mine / f"{session}.sleep").write_text("0\n")
    wait_for(
        lambda: (
            (home[0] / "supervisor-node0.log").exists()
            and " done: " in (home[0] / "supervisor-node0.log").read_text()
        ),
        timeout=240,
        interval=2,
    )
    assert (private(lay, 4, work) / "example_train.py").exists()
    attempt = told(4, 2)  # the spare's log of rank 2, in its own copy of the workdir
    assert ATTEMPT.search(attempt) is not None, attempt
    assert "reason=replaced" in attempt
    found = WHO.findall(attempt)
    assert len(found) == NPROC
    assert all(host == "node4" and int(rank) == 2 for _r, _w, rank, host, *_x in found)
    rows = status(lay, work, session, node=1)
    assert [row["host"] for row in rows][2] == lay.nodes[4].address
    assert rows[0]["supervisor"] == "done"
    power_on(lay, 2)
