"""Stopping a supervised job on the sandbox (real sshd, tmux), where a plain stop is not enough:
a stop during a network partition stays a stop once the partition heals (the supervisor it
could not reach relaunches nothing, and ends the job on its node and itself), and a stale pid
file that now names another job's supervisor ends nothing of that job."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from conftest import meshkit
from helpers.sandbox_jobs import on_node, supervisor_said, wait_for

from meshkit import sandbox
from meshkit.job import job_id
from meshkit.node.files import supervisor_pid_file

SANDBOX_NODES = 3
SLEEP = "sleep 600"


@pytest.fixture(scope="module")
def meshed(cluster):
    out = meshkit("mesh", "--hostfile", str(cluster.hostfile), "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    workdir = cluster.shared / "work"
    workdir.mkdir()
    return cluster, workdir


def train(lay, workdir: Path, session: str, *args: str, cmd: str = SLEEP) -> None:
    hostfile = str(lay.hostfile)
    flags = ["--hostfile", hostfile, "--session", session, "--restarts", "3", *args]
    out = on_node(lay, 0, workdir, "train", *flags, "--cmd", cmd)
    assert out.returncode == 0, out.stdout + out.stderr


def status(lay, workdir: Path, session: str, node: int = 1) -> list[dict[str, object]]:
    out = on_node(lay, node, workdir, "status", "--session", session, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def supervisors(lay, session: str) -> list[list[str]]:
    """Each node's supervisor processes of ``session`` ("PID command line", in the node)."""
    found = []
    for node in lay.nodes:
        out = sandbox.node_exec(node, ["pgrep", "-af", "meshkit supervise"]).stdout
        found.append([line for line in out.splitlines() if f"--session {session} " in line])
    return found


def sleeping(lay, index: int) -> bool:
    """Whether the job's command still runs on node ``index``."""
    out = sandbox.node_exec(lay.nodes[index], ["pgrep", "-f", f"^{SLEEP}"])
    return bool(out.stdout.strip())


def supervisor_log(workdir: Path, session: str, rank: int) -> str:
    path = workdir / ".meshkit" / session / f"supervisor-node{rank}.log"
    return path.read_text() if path.exists() else ""


def attempt_markers(workdir: Path, session: str, rank: int) -> int:
    log = workdir / ".meshkit" / session / f"node{rank}.log"
    return log.read_text().count("===== meshkit: attempt")


def test_a_job_stopped_during_a_partition_stays_stopped_once_it_heals(meshed):
    """Node 2 is cut off from nodes 0 and 1; its supervisor, alone, takes them for gone and
    waits for them to relaunch. ``stop`` from node 0 names node 2 as not reached, and what will
    happen there. When the partition heals, node 2's supervisor finds the stop: it ends the job
    on node 2 and itself, and nothing is relaunched anywhere."""
    lay, workdir = meshed
    train(lay, workdir, "parted")
    assert wait_for(lambda: all(supervisors(lay, "parted")), timeout=60)
    sandbox.cut(lay, 0, 2)
    sandbox.cut(lay, 1, 2)
    try:
        wait_for(lambda: "attempt 1 failed" in supervisor_log(workdir, "parted", 2), timeout=90)
        out = on_node(lay, 0, workdir, "stop", "--session", "parted")
        assert out.returncode == 1, out.stdout + out.stderr
        assert f"node 2 ({lay.nodes[2].address}) could not be asked: " in out.stdout
        assert "the supervisor relaunches nothing" in out.stdout
        assert "could not verify the job ended on: " in out.stderr
        out = on_node(lay, 0, workdir, "stop", "--session", "parted", "--json")
        assert out.returncode == 1, out.stdout + out.stderr
        report = json.loads(out.stdout)
        assert report["ok"] is False
        assert [node["node_rank"] for node in report["unreached"]] == [2]
        assert "relaunches nothing" in report["unreached"][0]["then"]
        assert [node["error"] is None for node in report["nodes"]] == [True, True, False]
        # what the stop reached has ended; node 2, out of reach, still runs its part
        assert supervisors(lay, "parted")[:2] == [[], []]
        assert [sleeping(lay, index) for index in range(3)] == [False, False, True]
        assert supervisors(lay, "parted")[2]
    finally:
        sandbox.mend(lay, 0, 2)
        sandbox.mend(lay, 1, 2)
    wait_for(lambda: supervisors(lay, "parted") == [[], [], []], timeout=120)
    assert not sleeping(lay, 2)
    log = supervisor_log(workdir, "parted", 2)
    assert "the job was stopped (meshkit stop) without reaching " in log
    assert "relaunching" not in log
    rows = status(lay, workdir, "parted")
    assert [row["state"] for row in rows] == ["absent"] * 3
    assert [row["supervisor"] for row in rows] == [None] * 3
    assert [attempt_markers(workdir, "parted", rank) for rank in range(3)] == [0, 0, 0]
    out = on_node(lay, 1, workdir, "stop", "--session", "parted")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "could not be asked" not in out.stdout


def test_stop_leaves_another_jobs_supervisor_that_a_stale_pid_file_names(meshed):
    """Job "mine" gave up and its supervisors ended, leaving their pid files; node 1's now names
    the pid of job "theirs"'s supervisor there (pids are reused): stopping "mine" leaves that
    one running."""
    lay, workdir = meshed
    train(lay, workdir, "mine", "--restart-on", "1", cmd="exit 5")
    # status (a second of CPU a round) only once a supervisor's log says so
    gave_up = functools.partial(supervisor_said, workdir, "mine", " gave up: ")
    wait_for(
        lambda: gave_up() and status(lay, workdir, "mine")[0]["supervisor"] == "gave up",
        timeout=60,
    )
    assert wait_for(lambda: supervisors(lay, "mine") == [[], [], []], timeout=60)
    train(lay, workdir, "theirs")
    assert wait_for(lambda: all(supervisors(lay, "theirs")), timeout=60)
    node = lay.nodes[1]
    theirs = supervisors(lay, "theirs")[1][0].split()[0]
    pid_file = supervisor_pid_file(job_id(str(workdir), "mine"))
    planted = sandbox.node_exec(node, ["sh", "-c", f"echo {theirs} > {pid_file}"])
    assert planted.returncode == 0
    out = on_node(lay, 2, workdir, "stop", "--session", "mine")
    assert out.returncode == 0, out.stdout + out.stderr
    assert supervisors(lay, "mine") == [[], [], []]
    assert [line.split()[0] for line in supervisors(lay, "theirs")[1]] == [theirs]
    assert status(lay, workdir, "theirs")[0]["supervisor"] == "running"
    out = on_node(lay, 2, workdir, "stop", "--session", "theirs")
    assert out.returncode == 0, out.stdout + out.stderr
    assert supervisors(lay, "theirs") == [[], [], []]
