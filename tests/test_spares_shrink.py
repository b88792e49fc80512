"""Spare nodes on the sandbox (real sshd, tmux, torch with gloo): the leader lost mid-replacement:
the next leader makes that one replacement, then, with no spare left and --min-nodes, the job
goes on with fewer nodes. 4 active nodes and 1 spare, the example job (it checkpoints) under
torchrun and under --spawn, each scenario a module of its own (each takes minutes, and modules
are what CI's workers share out; the shared parts: tests/helpers/spares.py)."""

from __future__ import annotations

import pytest
from helpers import spares
from helpers.sandbox_jobs import supervisor_said, wait_for

SANDBOX_NODES = 5


meshed = spares.meshed  # the fixture: this module's sandbox, meshed with a spare


@pytest.mark.parametrize("launcher", spares.LAUNCHERS)
def test_the_leader_lost_mid_replacement_makes_one_replacement_then_min_nodes_shrinks(
    meshed, launcher
):
    """Node 2 lost: the leader (node 0) replaces it with the spare; node 0 powered off as soon as
    it has claimed that replacement: the next leader finishes the same replacement (exactly
    one), then, with no spare left and --min-nodes 3, goes on without node 0 on 3 nodes."""
    lay, workdir, hostfile = meshed
    session = f"leader{launcher[0]}"
    spawn = launcher == "spawn"
    # under --spawn a script runs it: Cluster.train(replace_after=, min_nodes=) and
    # Cluster.status(), the Python API end to end through a loss
    api = hostfile if spawn else None
    args = ("--min-nodes", "3")
    spares.train(lay, workdir, hostfile, session, *args, node=3, spawn=spawn, api=api is not None)
    spares.started(lay, workdir, session)
    spares.power_off(lay, 2)
    (workdir / f"{session}.sleep").write_text("0\n")
    try:
        wait_for(
            lambda: supervisor_said(workdir, session, "generation 2: replaced"),
            timeout=120,
            interval=0.5,
        )
        spares.power_off(lay, 0)
        wait_for(lambda: supervisor_said(workdir, session, " done: "), timeout=300, interval=2)
        rows = spares.status(lay, workdir, session, node=3, hostfile=api)
        assert [row["host"] for row in rows] == [
            lay.nodes[1].address,
            lay.nodes[3].address,
            lay.nodes[4].address,
        ]
        head = rows[0]
        assert head["supervisor"] == "done"
        assert head["generation"] == 3
        assert head["replaced"] == [f"{lay.nodes[2].address} -> {lay.nodes[4].address}"]
        assert sorted(head["lost"]) == sorted([lay.nodes[0].address, lay.nodes[2].address])
        assert "shrunk" in str(head["last_restart_reason"])
        for rank in range(3):
            attempt = spares.last_attempt(workdir, session, rank)
            told = spares.ATTEMPT.search(attempt)
            assert told is not None, attempt
            assert told.group(2) == "shrunk"
            assert told.group(4) == lay.nodes[1].address
            found = spares.WHO.findall(attempt)
            assert len(found) == spares.NPROC
            assert all(int(world) == 3 * spares.NPROC for _r, world, *_rest in found)
    finally:
        spares.power_on(lay, 0)
        spares.power_on(lay, 2)
