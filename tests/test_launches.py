"""A new ``train`` is a launch of its own, on the sandbox (real sshd, tmux, the CLI run inside
the nodes): 3 active nodes and a spare, a plain job (tests/helpers/membership.py). Job 1 gave a
lost node's rank to the spare and was stopped; job 2, in the same workdir and session, starts
on the hostfile's nodes in the hostfile's ranks, and when it loses a node the spare (which still
holds job 1's stopped copy) takes its rank: job 1's stop ends nothing of job 2."""

from __future__ import annotations

import pytest
from helpers import membership, spares
from helpers.membership import launches, running, supervising
from helpers.sandbox_jobs import on_node, wait_for

SANDBOX_NODES = 4
ACTIVE = [0, 1, 2]  # A, B, C
SPARE = 3  # S


@pytest.fixture(scope="module")
def meshed(cluster):
    hostfile = membership.mesh(cluster, "hostfile-launches", ACTIVE, [SPARE])
    return cluster, membership.workdir(cluster), hostfile


def test_a_new_train_after_a_replacement_starts_and_its_spare_ignores_the_old_stop(meshed):
    lay, work, hostfile = meshed
    session = "again"
    first = "again-1"
    second = "again-2"
    a, b, c = ACTIVE
    address = [node.address for node in lay.nodes]
    with membership.logs_if_failed(work, session):
        # job 1: B powered off, the spare takes its rank; then stopped
        membership.train(lay, work, hostfile, session, name=first)
        wait_for(lambda: len(launches(work, session, first)) == 3, timeout=90)
        spares.power_off(lay, b)
        try:
            wait_for(lambda: len(launches(work, session, first)) == 6, timeout=120)
            assert launches(work, session, first)[3:] == [
                (2, 2, 0, "node0"),
                (2, 2, 1, "node3"),
                (2, 2, 2, "node2"),
            ]
            on_node(lay, a, work, "stop", "--session", session, "--hostfile", str(hostfile))
            for index in (a, c, SPARE):
                wait_for(lambda index=index: not supervising(lay, index, session), timeout=60)
                assert running(lay, index, first) == []
        finally:
            spares.power_on(lay, b)
        # job 2, same workdir and session: it starts (the old code refused it on B: "a spare
        # of that job now"), on the hostfile's nodes in the hostfile's ranks
        membership.train(lay, work, hostfile, session, name=second)
        wait_for(lambda: len(launches(work, session, second)) == 3, timeout=90)
        # its generation is one past job 1's last (a supervisor job 1 left behind cannot move it)
        first_generation = 3
        assert launches(work, session, second) == [
            (first_generation, 1, 0, "node0"),
            (first_generation, 1, 1, "node1"),
            (first_generation, 1, 2, "node2"),
        ]
        wait_for(lambda: all(supervising(lay, index, session) for index in ACTIVE), timeout=60)
        rows = membership.status(lay, work, session, a, hostfile)
        assert [row["host"] for row in rows] == [address[a], address[b], address[c]]
        assert rows[0]["generation"] == first_generation
        assert rows[0]["supervisor"] == "running"
        # job 2 loses C: the spare, which holds job 1's stopped copy, takes its rank
        spares.power_off(lay, c)
        try:
            wait_for(lambda: len(launches(work, session, second)) == 6, timeout=120)
            assert launches(work, session, second)[3:] == [
                (first_generation + 1, 2, 0, "node0"),
                (first_generation + 1, 2, 1, "node1"),
                (first_generation + 1, 2, 2, "node3"),
            ]
            assert running(lay, SPARE, second)
            rows = membership.status(lay, work, session, a, hostfile)
            assert [row["host"] for row in rows] == [address[a], address[b], address[SPARE]]
            assert [row["state"] for row in rows] == ["running"] * 3
            head = rows[0]
            assert head["generation"] == first_generation + 1
            assert head["supervisor"] == "running"
            assert head["replaced"] == [f"{address[c]} -> {address[SPARE]}"]
            membership.finish(work, second)
            wait_for(
                lambda: not any(supervising(lay, index, session) for index in (a, b, SPARE)),
                timeout=90,
            )
            rows = membership.status(lay, work, session, a, hostfile)
            assert [(row["state"], row["exit_code"]) for row in rows] == [("exited", 0)] * 3
            assert rows[0]["supervisor"] == "done"
        finally:
            spares.power_on(lay, c)
