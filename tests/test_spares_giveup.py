"""Spare nodes on the sandbox (real sshd, tmux, torch with gloo): with no spare and no --min-nodes,
the supervisor gives up after the bound, saying why, with nothing left running. 4 active nodes
and 1 spare, the example job (it checkpoints) under torchrun and under --spawn, each scenario a
module of its own (each takes minutes, and modules are what CI's workers share out; the shared
parts: tests/helpers/spares.py)."""

from __future__ import annotations

import json

import pytest
from helpers import spares
from helpers.sandbox_jobs import on_node, supervisor_said, wait_for

SANDBOX_NODES = 5


meshed = spares.meshed  # the fixture: this module's sandbox, meshed with a spare


@pytest.mark.parametrize("launcher", spares.LAUNCHERS)
def test_no_spare_and_no_min_nodes_gives_up_after_the_bound_saying_so(meshed, launcher):
    lay, workdir, _ = meshed
    two = lay.root / "hostfile-two"
    two.write_text(f"{lay.nodes[1].address}\n{lay.nodes[3].address}\n")
    session = f"nospare{launcher[0]}"
    spares.train(lay, workdir, two, session, node=1, spawn=launcher == "spawn")
    spares.started(lay, workdir, session, nodes=2)
    spares.power_off(lay, 3)
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
        assert spares.job_left(lay, 1) == []  # what was left of the job is ended, not left waiting
    finally:
        spares.power_on(lay, 3)
