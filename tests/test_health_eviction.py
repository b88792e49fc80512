"""A node that answers but is broken, on the sandbox (real sshd, tmux, torch with gloo, 4 active
nodes and 1 spare, the example job that checkpoints, under torchrun and --spawn): an XID 79 in
node 2's own kernel log mid-run is seen within a poll (status, top, doctor, the events), node 2 is
evicted, the spare takes rank 2 (reason ``evicted``, no restart used) and the job completes from
its checkpoint; the history survives powering off node 0 (the leader and master), and --notify
got each event as JSON while a notify command that hangs changed nothing else."""

from __future__ import annotations

import json
import time

import pytest
from conftest import meshkit
from helpers import spares
from helpers.sandbox_jobs import on_node, supervisor_said, wait_for

from meshkit import sandbox

SANDBOX_NODES = 5

meshed = spares.meshed


def events(lay, workdir, session: str, node: int) -> list[dict[str, object]]:
    """``events --json`` from inside node ``node`` (exit 1 when a node could not be read, the
    others' history printed all the same)."""
    out = on_node(lay, node, workdir, "events", "--session", session, "--json")
    assert out.stdout.strip(), out.stderr
    return json.loads(out.stdout)


def kinds(found: list[dict[str, object]]) -> list[object]:
    return [event["kind"] for event in found]


@pytest.mark.parametrize("launcher", spares.LAUNCHERS)
def test_an_xid_79_mid_run_evicts_the_node_and_the_spare_takes_its_rank(meshed, launcher):
    lay, workdir, hostfile = meshed
    session = f"xid{launcher[0]}"
    spawn = launcher == "spawn"
    notified = workdir / f"{session}.notified"
    # each event's JSON kept, then the command hangs past its bound (config notify_timeout 3s)
    notify = f"cat >> {notified}; echo >> {notified}; sleep 60"
    spares.train(
        lay,
        workdir,
        hostfile,
        session,
        "--notify",
        notify,
        "--notify-on",
        "failed,evicted,replaced,shrunk,gave_up,done,health",
        spawn=spawn,
        replace_after="60s",
        env="MESHKIT_NOTIFY_TIMEOUT=3s",
    )
    spares.started(lay, workdir, session)
    rows = spares.status(lay, workdir, session, node=1)
    assert all(row["health"]["state"] in ("ok", "unknown") for row in rows), rows
    (workdir / f"{session}.sleep").write_text("0\n")  # the next attempt ends once it trained
    injected = time.time()
    sandbox.fault(lay, 2, xid=79)
    try:
        # within a poll: the events say node 2 is unhealthy, with the XID
        def unhealthy():
            found = events(lay, workdir, session, node=1)
            return [event for event in found if event["kind"] == "health"]

        seen = wait_for(unhealthy, timeout=30, interval=1)
        assert "XID 79" in str(seen[0]["detail"]), seen
        # top and doctor over the hostfile (every node) name node 2 unhealthy too
        out = on_node(lay, 1, workdir, "top", "--hostfile", str(hostfile), "--once", "--json")
        assert out.returncode == 0, out.stderr
        assert "unhealthy" in out.stdout and "XID 79" in out.stdout
        out = on_node(lay, 1, workdir, "doctor", "--hostfile", str(hostfile), "--session", "nojob")
        assert "health" in out.stdout and "XID 79" in out.stdout
        assert out.returncode != 0
        # within 60 s the job runs again with the spare as rank 2, told "evicted"
        rows = wait_for(
            lambda: spares.moved_to(lay, workdir, session, 2, 4), timeout=60, interval=1
        )
        assert time.time() - injected < 90
        assert rows[0]["restarts_left"] == 2  # no restart used
        assert any("XID 79" in line for line in rows[0]["evicted"]), rows[0]
        wait_for(lambda: spares.ran_to_the_end(workdir, session, spares.ACTIVE), timeout=120)
        told = spares.ATTEMPT.search(spares.last_attempt(workdir, session, 2))
        assert told is not None and told.group(2) == "evicted"
        wait_for(lambda: supervisor_said(workdir, session, " done: "), timeout=240, interval=2)
        rows = spares.status(lay, workdir, session, node=1)
        assert rows[0]["supervisor"] == "done" and rows[0]["restarts_left"] == 2
        assert "resumed from step" in spares.last_attempt(workdir, session, 0)
        # the history, read from node 3 once node 0 (the leader and master) is off
        spares.power_off(lay, 0)
        found = events(lay, workdir, session, node=3)
        for kind in ("launched", "health", "evicted", "replaced", "attempt", "done"):
            assert kind in kinds(found), kinds(found)
        for kind in ("evicted", "replaced"):  # each with the XID
            said = [event for event in found if event["kind"] == kind]
            assert "XID 79" in str(said[0]["detail"]), said
        evicted = [event for event in found if event["kind"] == "evicted"]
        assert evicted[0]["node"] == lay.nodes[2].address
        # --notify: each of its kinds as one JSON object; its hang was an event, nothing more
        told_events = [json.loads(line) for line in notified.read_text().splitlines() if line]
        assert {"health", "evicted", "replaced", "done"} <= set(kinds(told_events))
        assert "notify_failed" in kinds(found)
    finally:
        sandbox.fault(lay, 2, clear=True)
        spares.power_on(lay, 0)
        out = meshkit("stop", "--hostfile", str(hostfile), "--session", session, cwd=workdir)
