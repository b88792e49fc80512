"""Broken nodes without a cluster (pure): which members a poll's health evicts, whom a failure is
blamed on (and when it counts against a node), lemons, crash loops, the membership an eviction
makes and its claim, and what a launch admits (an unhealthy or evicted node's rank to a spare,
or a refusal naming it)."""

from __future__ import annotations

import pytest

from meshkit.errors import LaunchError, UsageError
from meshkit.events import Blame
from meshkit.health import Finding, HealthState, NodeHealth, SourceRead, judge
from meshkit.hostfile import parse
from meshkit.job import Job
from meshkit.ops.admission import admit
from meshkit.ops.attribution import blame, blame_words, lemon, signal_of
from meshkit.ops.diagnose import Failure
from meshkit.ops.membership import evict, reason_of_change, spares_of
from meshkit.ops.replacement import claim_of
from meshkit.ops.supervision_policy import NodeView, crashed, evictable, failed_start
from meshkit.protocol import JobState, RestartReason, Supervision, SupervisorState
from meshkit.record import replace

CLUSTER = parse("n0\nn1\nn2\nn3\ns1 spare\ns2 spare\n")
N0, N1, N2, N3, S1, S2 = CLUSTER
MEMBERS = [N0, N1, N2, N3]
XID = Finding("kernel", HealthState.UNHEALTHY, "xid:79", "XID 79: GPU has fallen off the bus")
SICK = judge([XID], [SourceRead("kernel", "/dev/kmsg")])
OK = judge([], [SourceRead("kernel", "/dev/kmsg")])
UNREAD = judge([], [SourceRead("kernel", "/dev/kmsg", "not readable by this user")])
SLOW = judge([Finding("gpu", HealthState.DEGRADED, "throttle:thermal", "GPU 0 throttled")], [])
JOB = Job(cmd="x", workdir="/w", session="s", hostfile="/h", python="p", master_port=1)


def running(rank: int) -> NodeView:
    return NodeView(rank, MEMBERS[rank].label, JobState.RUNNING)


def exited(rank: int, code: int, started: float | None = None) -> NodeView:
    return NodeView(rank, MEMBERS[rank].label, JobState.EXITED, code, started)


# ---- health that evicts -----------------------------------------------------------------------


def test_an_unhealthy_member_is_evicted_a_degraded_one_only_when_asked_unknown_never():
    nodes = [running(rank) for rank in range(4)]
    health: dict[int, NodeHealth | None] = {0: OK, 1: SLOW, 2: SICK, 3: UNREAD}
    assert list(evictable(nodes, health, "unhealthy", [])) == ["n2"]
    assert evictable(nodes, health, "unhealthy", [])["n2"].startswith("unhealthy: kernel: XID 79")
    assert sorted(evictable(nodes, health, "degraded", [])) == ["n1", "n2"]
    # noted already (no spare could take its rank): the job runs on it, not evicted again
    assert evictable(nodes, health, "unhealthy", ["n2: unhealthy: ..."]) == {}


def test_an_unreadable_source_makes_a_node_unknown_never_ok():
    assert UNREAD.state == HealthState.UNKNOWN
    assert UNREAD.reasons == ["kernel: not read: not readable by this user"]
    assert OK.state == HealthState.OK


# ---- whom a failure is blamed on --------------------------------------------------------------


def error(rank: int, node: str, text: str, at: float) -> Failure:
    return Failure(rank, node, 1, text, [], at)


def test_the_first_own_error_is_blamed_and_counted_its_peers_errors_are_consequences():
    nodes = [exited(0, 1), exited(1, 1), exited(2, 1), exited(3, 1)]
    errors = [
        error(1, "n0", "RuntimeError: Connection closed by peer [10.0.0.2]:1234", 100.0),
        error(2, "n1", "RuntimeError: simulated GPU fault", 100.2),
        error(5, "n2", "RuntimeError: Connection reset by peer", 100.3),
    ]
    found = blame(nodes, {}, {}, errors)
    assert (found.node, found.node_rank, found.rank, found.attributed) == ("n1", 1, 2, True)
    assert "counted against n1" in blame_words(found)


def test_one_error_of_its_own_from_every_node_is_the_programs_not_a_nodes():
    nodes = [exited(rank, 1) for rank in range(4)]
    errors = [error(rank, f"n{rank}", "ValueError: bad config", 100.0 + rank) for rank in range(4)]
    found = blame(nodes, {}, {}, errors)
    assert found.node == "n0" and not found.attributed


def test_without_error_files_the_only_failed_node_is_blamed_a_shared_code_at_once_is_not():
    alone = [running(0), exited(1, 3), running(2), running(3)]
    assert blame(alone, {1: 50.0}, {}, []).attributed
    # started seconds apart (a loaded machine), each failing at once: alike, the program's
    together = [exited(rank, 3, started=40.0 + 3 * rank) for rank in range(4)]
    ended = {rank: 40.2 + 3 * rank for rank in range(4)}
    found = blame(together, ended, {}, [])
    assert found.node == "n0" and found.exit_code == 3 and not found.attributed
    # a code of its own: its own
    apart = [exited(0, 1), exited(1, 7), exited(2, 1), exited(3, 1)]
    found = blame(apart, {1: 10.0, 0: 11.0, 2: 11.0, 3: 11.0}, {}, [])
    assert found.node == "n1" and found.attributed
    # the same code, but the others ran on long after it failed: its own
    late = [exited(rank, 1, started=0.0) for rank in range(4)]
    found = blame(late, {1: 5.0, 0: 60.0, 2: 61.0, 3: 60.5}, {}, [])
    assert found.node == "n1" and found.attributed


def test_an_unhealthy_node_is_blamed_whatever_failed_first():
    nodes = [exited(0, 1), exited(1, 1), exited(2, 137), exited(3, 1)]
    errors = [error(0, "n0", "RuntimeError: own", 1.0)]
    found = blame(nodes, {}, {2: SICK}, errors)
    assert found.node == "n2" and found.attributed and found.signal == "SIGKILL"
    assert found.health == ["kernel: XID 79: GPU has fallen off the bus"]


def test_the_cause_names_what_the_node_found_an_oom_kill_too():
    oom = Finding("kernel", HealthState.OK, "oom", "out-of-memory kill of python (pid 7)")
    noted = judge([oom], [SourceRead("kernel", "/dev/kmsg")])
    found = blame([running(0), exited(1, 137)], {}, {1: noted}, [])
    assert found.health == ["kernel: out-of-memory kill of python (pid 7)"]
    assert found.attributed and found.signal == "SIGKILL"


def test_signals_and_lemons():
    assert signal_of(137) == "SIGKILL" and signal_of(1) is None and signal_of(None) is None
    assert not lemon(["n1"], "n1", 2)
    assert lemon(["n1", "n2", "n1"], "n1", 2)
    assert not lemon(["n1", "n1"], "n1", 0)  # --evict-after 0: never


def test_a_crash_loop_is_failed_starts_in_a_row():
    assert failed_start(100.0, 130.0, 300.0)
    assert not failed_start(100.0, 500.0, 300.0)
    assert not failed_start(None, 130.0, 300.0)
    assert crashed(["a", "b", "c"], 3) and not crashed(["a", "b"], 3)
    assert not crashed(["a", "b", "c"], 0)


def test_blame_words_without_a_node():
    assert blame_words(Blame()) == "no node to blame (the nodes did not say)"


# ---- the membership an eviction makes ---------------------------------------------------------


def test_an_evicted_nodes_rank_goes_to_a_spare_and_it_is_kept_out_not_lost():
    change = evict(MEMBERS, {N2: "unhealthy: XID 79"}, [S1, S2], CLUSTER, None)
    assert change is not None
    assert change.members == [N0, N1, S1, N3]
    assert change.reason == RestartReason.EVICTED
    assert reason_of_change(change) == "evicted: n2 -> s1 (n2: unhealthy: XID 79)"
    seen = Supervision(SupervisorState.RUNNING, 3, 2, unhealthy=["n2: old note"])
    claim = claim_of(seen, change)
    assert claim.members == ["n0", "n1", "s1", "n3"]
    assert claim.evicted == ["n2: unhealthy: XID 79"]
    assert claim.lost == [] and claim.unhealthy == []
    assert claim.restarts_left == 2 and claim.reason == RestartReason.EVICTED
    # never its spare again, until readmitted
    assert spares_of(CLUSTER, change.members, claim.evicted) == [S2]


def test_no_spare_and_no_min_nodes_no_eviction_with_min_nodes_a_shrink():
    assert evict(MEMBERS, {N2: "sick"}, [], CLUSTER, None) is None
    shrunk = evict(MEMBERS, {N2: "sick"}, [], CLUSTER, 3)
    assert shrunk is not None and shrunk.members == [N0, N1, N3]
    assert shrunk.reason == RestartReason.SHRUNK
    assert reason_of_change(shrunk) == "evicted and shrunk: n2: sick; running on 3 nodes"


# ---- what a launch admits ---------------------------------------------------------------------


def test_an_unhealthy_node_at_launch_gives_its_rank_to_a_healthy_spare_with_restarts():
    job = replace(JOB, restarts=2)
    health: dict = {N0: OK, N1: OK, N2: SICK, N3: OK, S1: SICK, S2: OK}
    admitted = admit(job, MEMBERS, [S1, S2], health, [])
    assert admitted.hosts == [N0, N1, S2, N3]
    assert admitted.swapped == ["n2 -> s2"]
    assert admitted.evicted == ["n2: unhealthy: kernel: XID 79: GPU has fallen off the bus"]


def test_without_restarts_or_a_spare_nothing_starts_and_the_refusal_names_node_and_fix():
    health: dict = {host: OK for host in CLUSTER}
    health[N2] = SICK
    with pytest.raises(LaunchError) as raised:
        admit(JOB, MEMBERS, [], health, [])
    text = str(raised.value)
    assert "node 2 (n2): unhealthy: kernel: XID 79" in text
    assert "nothing started" in text and "--exclude n2" in text and "--restarts N" in text
    with pytest.raises(LaunchError, match="0 healthy spare"):
        admit(replace(JOB, restarts=1), MEMBERS, [], health, [])


def test_an_evicted_node_stays_out_until_readmitted():
    health: dict = {host: OK for host in CLUSTER}
    before = ["n1: a lemon: 2 failures attributed to it"]
    job = replace(JOB, restarts=1)
    admitted = admit(job, MEMBERS, [S1, S2], health, before)
    assert admitted.hosts == [N0, S1, N2, N3] and admitted.evicted == before
    back = admit(job, MEMBERS, [S1, S2], health, before, readmit="n1")
    assert back.hosts == MEMBERS and back.evicted == [] and back.readmitted == "n1"
    with pytest.raises(UsageError, match="--readmit n3: not evicted from this job"):
        admit(job, MEMBERS, [S1], health, before, readmit="n3")
    # an evicted spare is never chosen
    assert admit(job, MEMBERS, [S1, S2], {**health, N3: SICK}, ["s1: x"]).hosts == [N0, N1, N2, S2]
