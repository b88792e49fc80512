"""Membership changes under a partition, on the sandbox (real sshd, tmux, the CLI run inside the
nodes): 3 active nodes and 2 spares, a plain job (tests/helpers/membership.py). Split so that
one side holds a majority of the job's 5 nodes: only that side changes the membership and runs
the job, the other ends its part; healed, there is one membership and the job completes. And a
stop that reaches the spares but not a node cut off from the other members: that node's
supervisor cannot replace them (the spares hold the stop), and nothing runs once it heals."""

from __future__ import annotations

import re

import pytest
from helpers import membership
from helpers.membership import heal, launches, running, split, supervising
from helpers.sandbox_jobs import on_node, supervisor_said, wait_for

SANDBOX_NODES = 5
ACTIVE = [0, 1, 2]  # A, B, C
SPARES = [3, 4]  # S1, S2


@pytest.fixture(scope="module")
def meshed(cluster):
    hostfile = membership.mesh(cluster, "hostfile-parts", ACTIVE, SPARES)
    return cluster, membership.workdir(cluster), hostfile


def started(lay, work, session: str) -> None:
    """Once the job's first launch runs on A, B and C, each with its supervisor."""
    wait_for(lambda: len(launches(work, session)) == 3, timeout=90)
    wait_for(lambda: all(supervising(lay, index, session) for index in ACTIVE), timeout=60)


def test_a_split_leaves_one_side_running_and_one_membership_once_healed(meshed):
    """{A,S1,S2} | {B,C}: A's side (3 of 5) claims generation 2 and runs it on A,S1,S2; B's side
    (2 of 5) launches nothing and ends its part. Healed, B's and C's supervisors fence
    themselves, and the job completes in generation 2 alone."""
    lay, work, hostfile = meshed
    session = "split"
    with membership.logs_if_failed(work, session):
        a, b, c, s1, s2 = range(5)
        address = [node.address for node in lay.nodes]
        membership.train(lay, work, hostfile, session, "--min-nodes", "2")
        started(lay, work, session)
        assert launches(work, session) == [
            (1, 1, 0, "node0"),
            (1, 1, 1, "node1"),
            (1, 1, 2, "node2"),
        ]
        majority_side = [a, s1, s2]
        minority_side = [b, c]
        split(lay, majority_side, minority_side)
        try:
            wait_for(lambda: supervisor_said(work, session, "generation 2: replaced"), timeout=120)
            wait_for(lambda: len(launches(work, session)) == 6, timeout=90)
            assert launches(work, session)[3:] == [
                (2, 2, 0, "node0"),
                (2, 2, 1, "node3"),
                (2, 2, 2, "node4"),
            ]
            # the minority side ends its part (self-fence) and launches nothing
            wait_for(
                lambda: not running(lay, b, session) and not running(lay, c, session), timeout=60
            )
            assert supervisor_said(work, session, "no majority of the job's 5 nodes answers")
            for index in (a, s1, s2):
                assert running(lay, index, session), index
            # status from the majority side: generation 2 on A,S1,S2; B and C out of reach
            rows = membership.status(lay, work, session, a, hostfile)
            head = rows[0]
            assert [row["host"] for row in rows] == [address[a], address[s1], address[s2]]
            assert [row["state"] for row in rows] == ["running"] * 3
            assert head["generation"] == 2
            assert head["no_majority"] is None
            spares = {spare["node"]: spare for spare in head["spares"]}
            assert sorted(spares) == sorted([address[b], address[c]])
            for spare in spares.values():
                assert spare["healthy"] is False
                assert "not answering" in str(spare["why"])
            # status from the minority side: no majority; A, S1, S2 out of reach, never absent,
            # B and C never healthy spares
            rows = membership.status(lay, work, session, b, hostfile)
            head = rows[0]
            assert head["no_majority"] == "2 of 5"
            by_host = {row["host"]: row for row in rows}
            for index in (a, s1, s2):
                if address[index] in by_host:
                    assert by_host[address[index]]["state"] == "unreachable"
                    assert "of generation" in str(by_host[address[index]]["last_known"])
            assert all(row["state"] != "absent" for row in rows)
            # B and C ended their part: listed (the shared job file names generation 2), they
            # run nothing of the job, and are never a healthy spare that runs it
            for spare in head["spares"]:
                assert spare["healthy"] is not spare["running"]
            assert running(lay, b, session) == running(lay, c, session) == []
            out = on_node(lay, b, work, "status", "--session", session, "--hostfile", str(hostfile))
            assert out.returncode == 1
            assert "partitioned?" in out.stdout.splitlines()[1], out.stdout
        finally:
            heal(lay, majority_side, minority_side)
        # healed: B's and C's supervisors find generation 2 without them and end
        wait_for(lambda: not supervising(lay, b, session), timeout=90)
        wait_for(lambda: not supervising(lay, c, session), timeout=90)
        assert supervisor_said(work, session, "generation 2 does not include this node")
        membership.finish(work, session)
        wait_for(lambda: supervisor_said(work, session, " done: "), timeout=90)
        rows = membership.status(lay, work, session, b, hostfile)
        assert [row["host"] for row in rows] == [address[a], address[s1], address[s2]]
        assert [(row["state"], row["exit_code"]) for row in rows] == [("exited", 0)] * 3
        head = rows[0]
        assert head["generation"] == 2
        assert head["supervisor"] == "done"
        assert head["no_majority"] is None
        assert sorted(head["lost"]) == sorted([address[b], address[c]])
        for index in (b, c):
            assert running(lay, index, session) == []
        # generation 2 was claimed once, by A, and launched once, on A, S1, S2
        logs = membership.supervisor_logs(work, session)
        assert len(re.findall(r"generation 2: replaced", logs)) == 1, logs
        assert [launch for launch in launches(work, session) if launch[0] == 2] == [
            (2, 2, 0, "node0"),
            (2, 2, 1, "node3"),
            (2, 2, 2, "node4"),
        ]


def test_a_stop_that_reaches_the_spares_but_not_a_cut_off_member_ends_everything(meshed):
    """A is cut off from B and C, not from the spares; ``stop`` from B reaches B, C, S1 and S2.
    A's supervisor, past --replace-after, would give B's and C's ranks to the spares: they hold
    the stop, so no majority keeps its claim. Healed, nothing of the job runs anywhere, no
    supervisor is left, and no attempt was launched after the stop."""
    lay, work, hostfile = meshed
    session = "cutstop"
    with membership.logs_if_failed(work, session):
        a, b, c = ACTIVE
        everyone = [*ACTIVE, *SPARES]
        membership.train(lay, work, hostfile, session)
        started(lay, work, session)
        split(lay, [a], [b, c])
        try:
            out = on_node(lay, b, work, "stop", "--session", session, "--hostfile", str(hostfile))
            assert out.returncode == 1, out.stdout + out.stderr
            assert f"node 0 ({lay.nodes[a].address}) could not be asked: " in out.stdout
            for index in (b, c, *SPARES):
                assert running(lay, index, session) == []
                assert supervising(lay, index, session) == []
            # A's supervisor, alone with the spares, finds the stop or fails to claim
            stopped = "the job was stopped (meshkit stop)"
            said = [stopped, "no majority", "did not keep the claim"]
            wait_for(
                lambda: any(text in membership.supervisor_logs(work, session) for text in said),
                timeout=90,
            )
        finally:
            heal(lay, [a], [b, c])
        wait_for(
            lambda: not any(supervising(lay, index, session) for index in everyone), timeout=120
        )
        for index in everyone:
            assert running(lay, index, session) == [], index
            sessions = membership.tmux_sessions(lay, index)
            assert [name for name in sessions if name.startswith(f"{session}-")] == [], index
        assert launches(work, session) == [
            (1, 1, 0, "node0"),
            (1, 1, 1, "node1"),
            (1, 1, 2, "node2"),
        ]
        logs = membership.supervisor_logs(work, session)
        assert "the job was stopped (meshkit stop) without reaching " in logs
        assert "relaunching" not in logs
        assert "generation 2" not in logs
        for rank in ACTIVE:
            log = (work / ".meshkit" / session / f"node{rank}.log").read_text()
            assert "===== meshkit: attempt" not in log
