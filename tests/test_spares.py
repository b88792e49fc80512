"""Spare nodes on the sandbox (real sshd, tmux, torch with gloo): a node powered off for good mid-
run is lost after --replace-after: the spare takes its rank, every other node keeps its own, the
job runs again and completes from its checkpoint; the lost node powered on later runs nothing of
the job and is listed as a spare. 4 active nodes and 1 spare, the example job (it checkpoints)
under torchrun and under --spawn, each scenario a module of its own (each takes minutes, and
modules are what CI's workers share out; the shared parts: tests/helpers/spares.py)."""

from __future__ import annotations

import pytest
from helpers import spares
from helpers.sandbox_jobs import supervisor_said, wait_for

SANDBOX_NODES = 5


meshed = spares.meshed  # the fixture: this module's sandbox, meshed with a spare


@pytest.mark.parametrize("launcher", spares.LAUNCHERS)
def test_a_node_lost_for_good_is_replaced_by_the_spare_which_takes_its_rank(meshed, launcher):
    lay, workdir, hostfile = meshed
    session = f"lost2{launcher[0]}"
    # a longer bound here: status is asked while the leader waits (a status round waits its
    # connect timeout, 10 s, for the node that is off)
    spares.train(lay, workdir, hostfile, session, replace_after="30s", spawn=launcher == "spawn")
    spares.started(lay, workdir, session)
    rows = spares.status(lay, workdir, session, node=1)
    assert rows[0]["generation"] == 1
    assert [spare["node"] for spare in rows[0]["spares"]] == [lay.nodes[4].address]
    assert rows[0]["spares"][0]["healthy"] is True
    spares.power_off(lay, 2)
    (workdir / f"{session}.sleep").write_text("0\n")
    # while the leader waits for it, status says so, and that the supervisors are alive
    wait_for(lambda: supervisor_said(workdir, session, "waiting for"), timeout=90, interval=0.5)
    rows = spares.status(lay, workdir, session, node=1)
    assert lay.nodes[2].address in str(rows[0]["waiting"])
    assert "UTC" in str(rows[0]["waiting"])
    assert rows[0]["supervisor"] == "running"
    assert rows[0]["leader"] == 0
    # lost after --replace-after, replaced, relaunched, done: well within the bound + 30 s + the
    # relaunch itself (torchrun's start on 5 nodes sharing 2 cores)
    wait_for(lambda: supervisor_said(workdir, session, " done: "), timeout=240, interval=2)
    rows = spares.status(lay, workdir, session, node=1)
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
    assert "resumed from step 20" in spares.last_attempt(workdir, session, 0)
    for rank in range(spares.ACTIVE):
        attempt = spares.last_attempt(workdir, session, rank)
        told = spares.ATTEMPT.search(attempt)
        assert told is not None, attempt
        assert told.group(2) == "replaced"
        assert told.group(3) == "2"
        assert told.group(4) == lay.nodes[0].address
        found = spares.WHO.findall(attempt)
        assert len(found) == spares.NPROC
        for _rank, world, meshkit_rank, host, total, expected in found:
            assert int(world) == spares.ACTIVE * spares.NPROC
            assert int(meshkit_rank) == rank
            assert total == expected
            want = "node4" if rank == 2 else f"node{rank}"
            assert host == want
    # the lost node comes back: it runs nothing of the job and is a spare now
    spares.power_on(lay, 2)
    rows = wait_for(
        lambda: [
            row
            for row in [spares.status(lay, workdir, session, node=3)[0]]
            if [spare["node"] for spare in row["spares"] if spare["healthy"]]
            == [lay.nodes[2].address]
        ],
        timeout=60,
        interval=2,
    )
    assert rows
    assert spares.job_left(lay, 2) == []
