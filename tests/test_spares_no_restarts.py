"""Spare nodes on the sandbox (real sshd, tmux, torch with gloo): `train --restarts 0
--replace-after 30s` is supervised for lost nodes alone, and a node lost for good goes to the
spare, which takes its rank, and the job completes (a replacement uses up no restart). 4 active
nodes and 1 spare, the example job under torchrun and under --spawn, each scenario a module of
its own (the shared parts: tests/helpers/spares.py)."""

from __future__ import annotations

import pytest
from helpers import spares
from helpers.sandbox_jobs import supervisor_said, wait_for

SANDBOX_NODES = 5


meshed = spares.meshed  # the fixture: this module's sandbox, meshed with a spare


@pytest.mark.parametrize("launcher", spares.LAUNCHERS)
def test_with_no_restarts_a_node_lost_for_good_goes_to_the_spare(meshed, launcher):
    lay, workdir, hostfile = meshed
    session = f"norest{launcher[0]}"
    spawn = launcher == "spawn"
    spares.train(lay, workdir, hostfile, session, replace_after="30s", spawn=spawn, restarts=0)
    spares.started(lay, workdir, session)
    rows = spares.status(lay, workdir, session, node=1)
    assert rows[0]["supervisor"] == "running"  # supervised, though with no restart to make
    assert rows[0]["restarts_left"] == 0
    spares.power_off(lay, 2)
    (workdir / f"{session}.sleep").write_text("0\n")
    try:
        wait_for(lambda: supervisor_said(workdir, session, " done: "), timeout=240, interval=2)
        assert not supervisor_said(workdir, session, " gave up: ")
        rows = spares.status(lay, workdir, session, node=1)
        assert [row["host"] for row in rows] == [
            lay.nodes[0].address,
            lay.nodes[1].address,
            lay.nodes[4].address,
            lay.nodes[3].address,
        ]
        assert rows[0]["supervisor"] == "done"
        assert rows[0]["generation"] == 2
        assert rows[0]["replaced"] == [f"{lay.nodes[2].address} -> {lay.nodes[4].address}"]
        assert rows[0]["restarts_left"] == 0
        for rank in range(spares.ACTIVE):
            attempt = spares.last_attempt(workdir, session, rank)
            told = spares.ATTEMPT.search(attempt)
            assert told is not None, attempt
            assert (told.group(1), told.group(2), told.group(3)) == ("2", "replaced", "2")
        assert spares.ran_to_the_end(workdir, session, spares.ACTIVE)
    finally:
        spares.power_on(lay, 2)
