"""Broken nodes on the sandbox (real sshd, tmux, torch with gloo, 4 active nodes and 1 spare):
a lemon (node 1's part fails at every attempt) is evicted after two failures attributed to it
and the spare completes the job, no restart spent on a third; a node unhealthy before launch
gives its rank to the spare from the start, and without a spare `train` refuses, naming it and
starting nothing; a command that fails at once everywhere ends after three attempts, "restarting
is not helping", each attempt's cause listed."""

from __future__ import annotations

import pytest
from conftest import meshkit
from helpers import spares
from helpers.sandbox_jobs import private, supervisor_said, wait_for

from meshkit import sandbox

SANDBOX_NODES = 5

meshed = spares.meshed


def lemon_cmd(session: str, spawn: bool) -> str:
    """The example job, but a node holding /tmp/lemon (its own /tmp) fails at once."""
    return (
        f"if [ -e /tmp/lemon ]; then echo lemon >&2; exit 3; fi; {spares.job_cmd(session, spawn)}"
    )


@pytest.mark.parametrize("launcher", spares.LAUNCHERS)
def test_a_lemon_is_evicted_after_two_failures_and_the_spare_completes_the_job(meshed, launcher):
    lay, workdir, hostfile = meshed
    session = f"lemon{launcher[0]}"
    spawn = launcher == "spawn"
    marker = private(lay, 1, sandbox_tmp("lemon"))
    marker.write_text("")
    (workdir / f"{session}.sleep").write_text("0\n")
    try:
        cmd = lemon_cmd(session, spawn)
        spares.train(lay, workdir, hostfile, session, spawn=spawn, cmd=cmd, restarts=3)
        wait_for(lambda: supervisor_said(workdir, session, " done: "), timeout=300, interval=2)
        rows = spares.status(lay, workdir, session, node=0)
        assert [row["host"] for row in rows][1] == lay.nodes[4].address
        assert rows[0]["supervisor"] == "done"
        assert rows[0]["restarts_left"] == 2  # one restart for the first failure, none after
        assert any("lemon" in line for line in rows[0]["evicted"]), rows[0]
        assert spares.ran_to_the_end(workdir, session, spares.ACTIVE)
    finally:
        marker.unlink(missing_ok=True)
        meshkit("stop", "--hostfile", str(hostfile), "--session", session, cwd=workdir)


def sandbox_tmp(name: str):
    from pathlib import Path

    return Path("/tmp") / name


def test_an_unhealthy_node_before_launch_goes_to_the_spare_or_nothing_starts(meshed):
    lay, workdir, hostfile = meshed
    sandbox.fault(lay, 2, xid=79)
    try:
        # with a spare and --restarts: the spare takes rank 2 from the start
        session = "before"
        (workdir / f"{session}.sleep").write_text("0\n")
        spares.train(lay, workdir, hostfile, session)
        wait_for(lambda: supervisor_said(workdir, session, " done: "), timeout=240, interval=2)
        rows = spares.status(lay, workdir, session, node=0)
        assert [row["host"] for row in rows][2] == lay.nodes[4].address
        assert any("XID 79" in line for line in rows[0]["evicted"])
        # without one (--restarts 0 and no --replace-after: unsupervised): refused, nothing ran
        session = "refused"
        out = spares.train(
            lay, workdir, hostfile, session, restarts=0, replace_after="off", check=False
        )
        assert out.returncode != 0
        said = out.stdout + out.stderr
        assert f"node 2 ({lay.nodes[2].address}): unhealthy: kernel: XID 79" in said, said
        assert "nothing started" in said and "Traceback" not in said
        assert not (workdir / ".meshkit" / session / "node0.log").exists()
    finally:
        sandbox.fault(lay, 2, clear=True)


def test_a_command_that_fails_at_once_ends_after_three_attempts(meshed):
    lay, workdir, hostfile = meshed
    session = "crash"
    cmd = "echo starting; exit 3"
    spares.train(lay, workdir, hostfile, session, cmd=cmd, restarts=5)
    wait_for(lambda: supervisor_said(workdir, session, " gave up: "), timeout=240, interval=2)
    rows = spares.status(lay, workdir, session, node=0)
    reason = str(rows[0]["last_restart_reason"])
    assert rows[0]["supervisor"] == "gave up"
    assert "restarting is not helping" in reason
    for attempt in (1, 2, 3):
        assert f"attempt {attempt}: node " in reason, reason
    assert rows[0]["restarts_left"] == 3  # two restarts made, then it stopped spending them
    assert rows[0]["evicted"] == []  # the program's failure, no node's
