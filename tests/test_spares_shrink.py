"""Spare nodes on the sandbox, when spares run out (real sshd, tmux, torch with gloo): 4 active
nodes and 1 spare. The leader lost mid-replacement: the next leader makes that one replacement,
then, with no spare left and --min-nodes, the job goes on with fewer nodes; with no spare and no
--min-nodes, the supervisor gives up after the bound, saying why, with nothing left running."""

from __future__ import annotations

import json

import pytest
from helpers.sandbox_jobs import NPROC, on_node, supervisor_said, wait_for
from helpers.spares import (
    ATTEMPT,
    WHO,
    job_left,
    last_attempt,
    mesh_with_spare,
    power_off,
    power_on,
    started,
    status,
    train,
)

SANDBOX_NODES = 5


@pytest.fixture(scope="module")
def meshed(cluster):
    return mesh_with_spare(cluster)


def test_the_leader_lost_mid_replacement_makes_one_replacement_then_min_nodes_shrinks(meshed):
    """Node 2 lost: the leader (node 0) replaces it with the spare; node 0 powered off as soon as
    it has claimed that replacement: the next leader finishes the same replacement (exactly
    one), then, with no spare left and --min-nodes 3, goes on without node 0 on 3 nodes."""
    lay, workdir, hostfile = meshed
    session = "leader"
    train(lay, workdir, hostfile, session, "--min-nodes", "3", node=3, spawn=True)
    started(lay, workdir, session)
    power_off(lay, 2)
    (workdir / f"{session}.sleep").write_text("0\n")
    try:
        wait_for(
            lambda: supervisor_said(workdir, session, "generation 2: replaced"),
            timeout=120,
            interval=0.5,
        )
        power_off(lay, 0)
        wait_for(lambda: supervisor_said(workdir, session, " done: "), timeout=300, interval=2)
        rows = status(lay, workdir, session, node=3)
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
            attempt = last_attempt(workdir, session, rank)
            told = ATTEMPT.search(attempt)
            assert told is not None, attempt
            assert told.group(2) == "shrunk"
            assert told.group(4) == lay.nodes[1].address
            found = WHO.findall(attempt)
            assert len(found) == NPROC
            assert all(int(world) == 3 * NPROC for _r, world, *_rest in found)
    finally:
        power_on(lay, 0)
        power_on(lay, 2)


def test_no_spare_and_no_min_nodes_gives_up_after_the_bound_saying_so(meshed):
    lay, workdir, _ = meshed
    two = lay.root / "hostfile-two"
    two.write_text(f"{lay.nodes[1].address}\n{lay.nodes[3].address}\n")
    session = "nospare"
    train(lay, workdir, two, session, node=1)
    started(lay, workdir, session, nodes=2)
    power_off(lay, 3)
    (workdir / f"{session}.sleep").write_text("0\n")
    try:
        wait_for(lambda: supervisor_said(workdir, session, " gave up: "), timeout=150, interval=2)
        out = on_node(
            lay, 1, workdir, "status", "--session", session, "--hostfile", str(two), "--json"
        )
        head = json.loads(out.stdout)[0]
        assert head["supervisor"] == "gave up"
        why = str(head["last_restart_reason"])
        assert lay.nodes[3].address in why
        assert "--replace-after" in why
        assert "no spare" in why
        assert job_left(lay, 1) == []  # what was left of the job is ended, not left waiting
    finally:
        power_on(lay, 3)
