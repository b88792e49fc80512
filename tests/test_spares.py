"""Spare nodes on the sandbox (real sshd, tmux, torchrun with gloo): 4 active nodes and 1 spare.
A node powered off for good mid-run is lost after --replace-after: the spare takes its rank, every
other node keeps its own, the job runs again and completes; the master's loss moves rank 0 and
MASTER_ADDR to the spare; a lost node powered on later runs nothing of the job and is listed as a
spare; with no spare, --min-nodes shrinks the job, and without it the supervisor gives up saying
why."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import meshkit
from helpers.sandbox_jobs import NPROC, on_node, private, supervisor_said, wait_for

from meshkit import sandbox

SANDBOX_NODES = 5
ACTIVE = 4
REPO = Path(__file__).resolve().parent.parent
REPLACE_AFTER = "8s"
WHO = re.compile(
    r"meshkit-example rank=(\d+) world_size=(\d+) node_rank=\S+ meshkit_node_rank=(\d+) "
    r"local_rank=\S+ host=(\S+) sum=(\d+) expected=(\d+)"
)
ATTEMPT = re.compile(r"attempt=(\d+) reason=(\S+) generation=(\d+) master=(\S+)")


def job_cmd(session: str, spawn: bool = False) -> str:
    """The example job under torchrun (or spawned by meshkit run). Each attempt first says what
    it was told; the first sleeps (so it still runs when the test powers a node off) until the
    test writes SESSION.sleep."""
    said = "echo attempt=$((MESHKIT_RESTART_COUNT + 1)) reason=$MESHKIT_RESTART_REASON"
    said += " generation=$MESHKIT_GENERATION master=$MASTER_ADDR"
    sleep = f"$(cat {session}.sleep 2>/dev/null || echo 600)"
    launcher = "python" if spawn else "torchrun"
    return f"{said}; {launcher} example_train.py --sleep {sleep}"


@pytest.fixture(scope="module")
def meshed(cluster):
    hostfile = cluster.root / "hostfile-spares"  # beside the sandbox's: its ssh settings
    lines = [node.address for node in cluster.nodes[:ACTIVE]]
    lines += [f"{node.address} spare" for node in cluster.nodes[ACTIVE:]]
    hostfile.write_text("\n".join(lines) + "\n")
    out = meshkit("mesh", "--hostfile", str(hostfile), "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    workdir = cluster.shared / "work"
    workdir.mkdir()
    shutil.copy(REPO / "meshkit" / "templates" / "example_train.py", workdir / "example_train.py")
    return cluster, workdir, hostfile


def power_off(lay, index: int) -> None:
    sandbox.poweroff(lay, index)


def power_on(lay, index: int) -> None:
    sandbox.poweron(lay, index)


def train(
    lay,
    workdir: Path,
    hostfile: Path,
    session: str,
    *args: str,
    node: int = 0,
    spawn: bool = False,
    replace_after: str = REPLACE_AFTER,
):
    flags = ["--hostfile", str(hostfile), "--session", session, "--nproc-per-node", str(NPROC)]
    flags += ["--restarts", "2", "--replace-after", replace_after, *args]
    if spawn:
        flags.append("--spawn")
    out = on_node(lay, node, workdir, "train", *flags, "--cmd", job_cmd(session, spawn))
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def status(lay, workdir: Path, session: str, node: int) -> list[dict[str, object]]:
    out = on_node(lay, node, workdir, "status", "--session", session, "--json")
    assert out.stdout.strip(), out.stderr
    return json.loads(out.stdout)


def last_attempt(workdir: Path, session: str, rank: int) -> str:
    log = workdir / ".meshkit" / session / f"node{rank}.log"
    if not log.exists():
        return ""
    return log.read_text().split("===== meshkit: attempt ")[-1]


def ran_to_the_end(workdir: Path, session: str, ranks: int) -> bool:
    """Whether every rank of the last attempt of ``ranks`` nodes reported its all_reduce."""
    for rank in range(ranks):
        if len(WHO.findall(last_attempt(workdir, session, rank))) != NPROC:
            return False
    return True


def started(lay, workdir: Path, session: str, nodes: int = ACTIVE) -> None:
    """Once every node's first attempt runs (each rank's all_reduce reported)."""
    wait_for(lambda: ran_to_the_end(workdir, session, nodes), timeout=240, interval=2)


def node_of(lay, address: str) -> int:
    return next(node.index for node in lay.nodes if node.address == address)


def job_left(lay, index: int) -> list[str]:
    out = sandbox.node_exec(
        lay.nodes[index], ["pgrep", "-af", "example_train|torchrun|-m meshkit (run|supervise)"]
    )
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


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
