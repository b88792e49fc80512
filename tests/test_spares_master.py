"""Spare nodes on the sandbox (real sshd, tmux, torch with gloo): the master powered off moves rank
0 and MASTER_ADDR to the spare; a synced job's workdir reaches the spare before it takes a rank.
4 active nodes and 1 spare, the example job (it checkpoints) under torchrun and under --spawn,
each scenario a module of its own (each takes minutes, and modules are what CI's workers share
out; the shared parts: tests/helpers/spares.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import spares
from helpers.sandbox_jobs import EXAMPLE, private, supervisor_said, wait_for

SANDBOX_NODES = 5


meshed = spares.meshed  # the fixture: this module's sandbox, meshed with a spare


@pytest.mark.parametrize("launcher", spares.LAUNCHERS)
def test_the_master_lost_moves_rank_0_and_master_addr_to_the_spare(meshed, launcher):
    lay, workdir, hostfile = meshed
    session = f"lost0{launcher[0]}"
    spares.train(lay, workdir, hostfile, session, node=1, spawn=launcher == "spawn")
    spares.started(lay, workdir, session)
    spares.power_off(lay, 0)
    (workdir / f"{session}.sleep").write_text("0\n")
    try:
        wait_for(lambda: supervisor_said(workdir, session, " done: "), timeout=240, interval=2)
        rows = spares.status(lay, workdir, session, node=3)
        assert rows[0]["host"] == lay.nodes[4].address
        assert rows[0]["supervisor"] == "done"
        told = spares.ATTEMPT.search(spares.last_attempt(workdir, session, 1))
        assert told is not None
        assert told.group(4) == lay.nodes[4].address  # MASTER_ADDR moved
        assert spares.ran_to_the_end(workdir, session, spares.ACTIVE)
    finally:
        spares.power_on(lay, 0)


def test_a_synced_job_syncs_the_workdir_to_the_spare_that_replaces_a_lost_node(meshed):
    """No shared storage: the workdir and hostfile live in node 0's own /tmp; the spare gets the
    workdir (and the job's hostfile) before it takes the lost node's rank."""
    lay, _, shared_hostfile = meshed
    work = Path("/tmp/mkspare")
    hosts = Path("/tmp/mkspare-hosts/hostfile")
    mine = private(lay, 0, work)
    mine.mkdir(parents=True)
    shutil.copy(EXAMPLE, mine / "example_train.py")
    private(lay, 0, hosts).parent.mkdir(parents=True)
    private(lay, 0, hosts).write_text(shared_hostfile.read_text())
    session = "synced"
    spares.train(lay, work, hosts, session, spawn=True)
    home = [private(lay, index, work / ".meshkit" / session) for index in range(SANDBOX_NODES)]

    def told(index: int, rank: int) -> str:
        log = home[index] / f"node{rank}.log"
        return log.read_text().split("===== meshkit: attempt ")[-1] if log.exists() else ""

    wait_for(
        lambda: all(
            len(spares.WHO.findall(told(rank, rank))) == spares.NPROC
            for rank in range(spares.ACTIVE)
        ),
        timeout=240,
        interval=2,
    )
    spares.power_off(lay, 2)
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
    assert spares.ATTEMPT.search(attempt) is not None, attempt
    assert "reason=replaced" in attempt
    found = spares.WHO.findall(attempt)
    assert len(found) == spares.NPROC
    assert all(host == "node4" and int(rank) == 2 for _r, _w, rank, host, *_x in found)
    rows = spares.status(lay, work, session, node=1)
    assert [row["host"] for row in rows][2] == lay.nodes[4].address
    assert rows[0]["supervisor"] == "done"
    spares.power_on(lay, 2)
