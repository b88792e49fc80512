"""Controller side, no nodes: the supervisor's policy, its record and its loop, scripted.

Supervised jobs without a cluster: the supervisor's policy (pure: per-node views, restart
policy -> action), its record as status shows it, and the loop against scripted node answers."""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
from helpers.fake_pool import HOSTS, FakePool, healthy

from meshkit import protocol as p
from meshkit.hostfile import Host
from meshkit.job import Job
from meshkit.node.supervise import accepts, copy_of
from meshkit.ops import jobs as ops
from meshkit.ops import supervision as sup
from meshkit.ops.supervise import Supervisor
from meshkit.ops.supervision_policy import (
    Action,
    Heard,
    NodeView,
    Silence,
    Step,
    backoff,
    decide,
    next_step,
    restartable,
    views,
)
from meshkit.ops.verdicts import Check
from meshkit.outcome import Outcome
from meshkit.protocol import Supervision, SupervisorState
from meshkit.quorum import believe
from meshkit.record import replace


def newest(copies):
    """The copy that wins of the nodes' own (None: none): a stop, else the newest generation,
    then version (what ``quorum.believe`` takes when every copy is of one launch and
    membership)."""
    records = [copy for copy in copies if copy is not None]

    def precedence(copy: Supervision) -> tuple[bool, int, int]:
        return (copy.supervisor == SupervisorState.STOPPED, copy.generation, copy.version)

    return max(records, key=precedence, default=None)


def nodes(*states: tuple[str, int | None]) -> list[NodeView]:
    return [NodeView(i, f"10.0.0.{i + 1}", s, c, 100.0 + i) for i, (s, c) in enumerate(states)]


STARTED = {0: 100.0, 1: 101.0, 2: 102.0}
FAILED_NODE_1 = (("running", None), ("exited", 1), ("running", None))


def test_all_running_or_some_finished_ok_waits():
    assert decide(nodes(("running", None)) * 1, STARTED, (), 2).action == "wait"
    assert decide(nodes(("exited", 0), ("running", None)), STARTED, (), 2).action == "wait"


def test_every_node_exited_zero_is_done():
    every_node_done = nodes(("exited", 0), ("exited", 0), ("exited", 0))
    assert decide(every_node_done, STARTED, (), 0).action == SupervisorState.DONE


def test_a_failed_node_restarts_the_whole_job_while_restarts_are_left():
    decision = decide(nodes(*FAILED_NODE_1), STARTED, (), 1)
    assert decision.action == "restart"
    assert decision.reason == "node 1 (10.0.0.2) exited with code 1"
    decision = decide(nodes(*FAILED_NODE_1), STARTED, (), 0)
    assert decision.action == SupervisorState.GAVE_UP
    assert "no restarts left" in decision.reason
    assert "code 1" in decision.reason


def test_restart_on_limits_which_codes_restart():
    assert restartable(1, ())
    assert restartable(137, ())
    assert not restartable(0, ())
    assert restartable(1, (1, 137))
    assert not restartable(2, (1, 137))
    decision = decide(nodes(("exited", 2), ("running", None)), STARTED, (1,), 5)
    assert decision.action == SupervisorState.GAVE_UP
    assert "not in --restart-on" in decision.reason


def test_unreachable_absent_and_restarted_nodes_restart():
    assert "not answering" in decide(nodes(("unreachable", None)), STARTED, (), 1).reason
    gone = nodes(("running", None), ("absent", None))
    assert "gone there" in decide(gone, STARTED, (), 1).reason
    moved = [NodeView(0, "a", "running", None, 999.0)]
    decision = decide(moved, STARTED, (), 1)
    assert decision.action == "restart"
    assert "outside the supervisor" in decision.reason


def test_one_missed_poll_is_not_a_failure():
    row = ops.StatusRow(0, "a", "absent", None, None, None, "timeout")
    hosts = [Host("a")]
    silence = Silence()  # the one tracker, its count of status polls missed in a row
    assert views([row], hosts, silence)[0].state == "running"
    assert views([row], hosts, silence)[0].state == "unreachable"
    ok = ops.StatusRow(0, "a", "running", None, "2026-01-01T00:00:00+00:00", None)
    assert views([ok], hosts, silence)[0].started == 1767225600.0
    assert silence.misses == {}


def test_nodes_not_answering_are_a_replacement_whatever_restarts_are_left():
    """With --replace-after, nodes that do not answer are REPLACE, restarts left or not: a
    replacement uses up none. So are they beside other nodes' failures (a lost master's peers
    fail within seconds); a fatal code still gives up, and without --replace-after nothing
    changed."""
    silent = nodes(("running", None), ("unreachable", None))
    for left in (0, 2):
        decision = decide(silent, STARTED, (), left, replaceable=True)
        assert (decision.action, decision.cause) == (Action.REPLACE, "lost")
        assert decision.reason == "node 1 (10.0.0.2) is not answering"
    assert decide(silent, STARTED, (), 0).action == Action.GIVE_UP  # no --replace-after
    assert decide(silent, STARTED, (), 1).action == Action.RESTART
    mixed = nodes(("exited", 1), ("unreachable", None))
    for left in (0, 1):
        decision = decide(mixed, STARTED, (), left, replaceable=True)
        assert (decision.action, decision.cause) == (Action.REPLACE, "lost")
        reason = "node 0 (10.0.0.1) exited with code 1; node 1 (10.0.0.2) is not answering"
        assert decision.reason == reason
    assert decide(mixed, STARTED, (), 0).action == Action.GIVE_UP
    assert decide(mixed, STARTED, (), 1).action == Action.RESTART
    rebooted = nodes(("absent", None), ("unreachable", None))
    assert decide(rebooted, STARTED, (), 0, replaceable=True).action == Action.REPLACE
    fatal = nodes(("exited", 3), ("unreachable", None))
    assert decide(fatal, STARTED, (1,), 2, replaceable=True).action == Action.GIVE_UP


def test_backoff_doubles_and_is_capped():
    assert [backoff(k, 2.0, 10.0) for k in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 10.0]
    assert backoff(10**100, 2.0, 10.0) == 10.0  # a damaged record's attempt: no overflow


def test_the_record_round_trips_through_the_protocol_and_a_nodes_copy():
    reason = "node 1 exited with code 1"
    rec = Supervision(SupervisorState.GAVE_UP, 3, 0, reason, [1, 143, 143], 7, 1, None)
    assert copy_of(rec.to_json()) == rec
    assert copy_of("{}") is None
    assert copy_of(None) is None
    request = p.SupervisorRequest("ab" * 8, "s-abababab-sup", record=rec, version=7)
    assert p.decode_request(p.encode_request(request)) == ("supervisor", request)


def test_the_newest_copy_wins_and_the_lowest_live_rank_leads():
    old = Supervision(SupervisorState.RUNNING, 1, 2, version=3)
    new = Supervision(SupervisorState.RELAUNCHING, 2, 1, version=4, by=1)
    copies = [old.to_json(), None, "junk", new.to_json()]  # as the nodes store them
    assert newest(copy_of(copy) for copy in copies) == new
    assert newest([None]) is None
    assert next_step(0, {0, 1, 2}, old) == "watch"
    assert next_step(1, {0, 1, 2}, old) == Step.FOLLOW
    assert next_step(1, {1, 2}, old) == "watch"  # node 0's supervisor is gone: node 1 leads
    # a claimed relaunch: its live claimer finishes it, whoever leads ...
    assert next_step(0, {0, 1}, new) == "follow"
    assert next_step(1, {0, 1}, new) == "resume"
    # ... else the leader takes it over (the same attempt, never a new one)
    assert next_step(0, {0, 2}, new) == "resume"
    assert next_step(2, {0, 2}, new) == "follow"
    for final in (SupervisorState.DONE, SupervisorState.GAVE_UP):
        assert next_step(0, {0}, Supervision(final, 1, 0)) == "end"
    assert next_step(0, {0}, None) == Step.END


def test_liveness_is_a_live_pid_with_a_fresh_heartbeat():
    assert sup.alive(p.SupervisorReply(12, 1.0, [], None))
    assert not sup.alive(p.SupervisorReply(12, sup.STALE + 1, [], None))  # hung, or its clock
    assert not sup.alive(p.SupervisorReply(None, None, [], None))


# ---- the loop, against scripted node answers (no cluster) -----------------------------------


class ScriptedPool(FakePool):
    """``status`` answers come from a script, one poll at a time (the last one repeats); the
    ``supervisor`` op keeps each node's record copy as the node stores it, with the node's own
    compare-and-set rule, and says the supervisors of ``live`` ranks run (until an ``end``).
    A node in ``failures`` answers nothing."""

    def __init__(self, polls: list[list[p.StatusReply]], live: set[int]) -> None:
        super().__init__(healthy())
        self.polls = polls
        self.live = live
        self.copies: dict[object, str | None] = {host: None for host in HOSTS}

    def records(self) -> list[Supervision | None]:
        """Each node's copy, as the node reads it back."""
        return [copy_of(copy) for copy in self.copies.values()]

    def call_all(self, phase, request_for, expect, hosts=None, timeout=None):
        if expect is p.StatusReply:
            poll = self.polls.pop(0) if len(self.polls) > 1 else self.polls[0]
            self.replies["status"] = dict(zip(HOSTS, poll))
        if expect is p.SupervisorReply:
            answers = {}
            for host in hosts if hosts is not None else HOSTS:
                if host in self.failures:
                    continue
                request = request_for(host)
                self.calls.append(("supervisor", host, request))
                written = False
                self.copies.setdefault(host, None)
                if request.record is not None:
                    written = accepts(self.copies[host], request.record, request.version)
                if written:
                    self.copies[host] = request.record.to_json()
                rank = HOSTS.index(host) if host in HOSTS else None  # None: a spare
                pid = 1 if rank in self.live else None
                if request.action == "end" and rank is not None:
                    self.live.discard(rank)
                beat = 0.0 if pid else None
                copy = copy_of(self.copies[host])
                answers[host] = Outcome(p.SupervisorReply(pid, beat, [], copy, written))
            return answers
        return super().call_all(phase, request_for, expect, hosts, timeout)


def loop(job: Job, pool: ScriptedPool, me: int = 0, gate=lambda *a: []):
    launched: list[int] = []

    def relaunch(pool_, job_, attempt):
        launched.append(attempt)
        return ops.Launch(
            job_,
            [ops.StartRow(i, host.label, "running", None, []) for i, host in enumerate(HOSTS)],
            None,
            False,
        )

    final = scripted(
        lambda hosts, wait: nullcontext(pool),
        job,
        me,
        lambda _m: None,
        relaunch=relaunch,
        gate=gate,
    ).run()
    return final, launched


def scripted(connect, job, me, say, relaunch, gate, cluster=()) -> Supervisor:
    """A supervisor of ``HOSTS`` over scripted nodes: no wait between polls, no backoff."""
    return Supervisor(
        connect,
        job,
        HOSTS,
        me,
        say,
        interval=0,
        base_backoff=0,
        relaunch=relaunch,
        gate=gate,
        cluster=cluster,
    )


def first_record(restarts: int) -> Supervision:
    return Supervision(SupervisorState.RUNNING, 1, restarts)


def run(job: Job, polls: list[list[p.StatusReply]]):
    pool = ScriptedPool(polls, {0})
    sup.write(pool, job, HOSTS, first_record(job.restarts), 0, every=True)
    final, launched = loop(job, pool)
    return final, launched, pool


def st(state: str, code: int | None = None, started: float = 1.0) -> p.StatusReply:
    return p.StatusReply(state, code, started, None)


def test_loop_restarts_a_failed_attempt_then_ends_done():
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=2)
    running = [st("running")] * 3
    failed = [st("running"), st("exited", 1), st("running")]
    ok = [st("exited", 0, 2.0)] * 3
    final, launched, pool = run(job, [running, failed, running, ok])
    assert launched == [2]
    assert (final.supervisor, final.attempt, final.restarts_left) == (SupervisorState.DONE, 2, 1)
    assert final.last_restart_reason == "node 1 (10.0.0.2) exited with code 1"
    assert [host for op, host, _ in pool.calls if op == "stop"] == HOSTS  # the whole job, once
    assert pool.records() == [final] * 3  # on every node
    starts = [r for op, _, r in pool.calls if op == "supervisor" and r.action == "start"]
    assert len(starts) == 3  # a supervisor on every node again where none is live


def test_loop_gives_up_when_restarts_run_out_keeping_exit_codes():
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=1)
    failed = [st("exited", 3)] * 3
    final, launched, pool = run(job, [failed])
    assert launched == [2]
    assert (final.supervisor, final.attempt, final.restarts_left) == (SupervisorState.GAVE_UP, 2, 0)
    assert final.exit_codes == [3, 3, 3]
    assert final.last_restart_reason.startswith("no restarts left")
    stops = [r for op, _, r in pool.calls if op == "stop"]
    assert len(stops) == 3
    assert not any(r.keep_exit for r in stops)  # only the restart's stop


def sent_started(started: str) -> str:
    """A running node's status reply line with ``started`` as the raw JSON text it sent."""
    fields = f'"state":"running","exit_code":null,"started":{started},"last_line":null'
    return '{"ok":true,"result":{' + fields + "}}"


def test_a_node_replying_a_time_no_clock_shows_is_a_node_that_did_not_answer():
    """A status reply whose ``started`` is NaN (or 1e300) is that node's protocol error: the
    leader takes it as a missed poll, as from a node that did not answer (one is no failure),
    and goes on watching; it does not end with a traceback."""
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=2)
    bad = sent_started("NaN")
    far = sent_started("1e300")
    running = [st("running")] * 3
    ok = [st("exited", 0, 2.0)] * 3
    polls = [running, [st("running"), bad, st("running")], running, [far, *running[1:]], ok]
    final, launched, _ = run(job, polls)
    assert launched == []
    assert (final.supervisor, final.attempt) == (SupervisorState.DONE, 1)
    rows = ops.status(
        FakePool(healthy(status=dict(zip(HOSTS, [st("running"), bad, far])))), job, HOSTS
    )
    assert [row.error is None for row in rows] == [True, False, False]
    assert "result.started" not in rows[1].error  # NaN is no JSON at all
    assert "not a number JSON allows" in rows[1].error
    assert "result.started: 1e+300 is not a time" in rows[2].error


def test_a_node_replying_bad_times_twice_in_a_row_is_gone_and_the_job_restarts():
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=2)
    bad = sent_started("-1e12")
    running = [st("running")] * 3
    ok = [st("exited", 0, 2.0)] * 3
    polls = [running, [st("running"), bad, st("running")], [st("running"), bad, st("running")]]
    final, launched, _ = run(job, [*polls, ok])
    assert launched == [2]
    assert final.last_restart_reason == "node 1 (10.0.0.2) is not answering"


class Died(Exception):
    """The leader's process ending mid-relaunch."""


def test_a_leader_dying_mid_relaunch_leaves_one_relaunch_finished_by_the_next():
    """Node 0 claims attempt 2 and dies while its health gate holds; node 1, once node 0's
    supervisor is gone, finishes attempt 2: one relaunch, one attempt number, and the gate
    named in the record meanwhile."""
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=3)
    running = [st("running")] * 3
    failed = [st("running"), st("exited", 1), st("running")]
    pool = ScriptedPool([failed], {0, 1})
    sup.write(pool, job, HOSTS, first_record(3), 0, every=True)

    def dies(*_a):
        held = newest(pool.records())
        assert held is not None
        assert held.supervisor == SupervisorState.RELAUNCHING
        assert held.by == 0
        raise Died

    with pytest.raises(Died):
        loop(job, pool, 0, gate=dies)
    pool.live = {1}  # node 0's supervisor is gone; node 1's looks and leads
    holds = iter([[Check("workdir", "10.0.0.3", None, False, "/w: Read-only file system")], []])
    pool.polls = [running, [st("exited", 0, 2.0)] * 3]
    final, launched = loop(job, pool, 1, gate=lambda *a: next(holds))
    assert launched == [2]
    assert (final.supervisor, final.attempt, final.restarts_left) == (SupervisorState.DONE, 2, 2)
    writes = [r.record for op, _, r in pool.calls if op == "supervisor" and r.record]
    # the held gate, by the new leader
    assert any(write.held and write.by == 1 for write in writes)
    assert {write.attempt for write in writes} == {1, 2}


def test_two_claims_of_the_same_attempt_one_wins_and_nothing_of_the_other_is_written():
    """Both read version 1 and claim attempt 2: the first node decides, and the loser writes
    nowhere (so no node holds its claim)."""
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=3)
    pool = ScriptedPool([[st("running")] * 3], {0, 1})
    base = sup.write(pool, job, HOSTS, first_record(3), 0, every=True)
    claim = replace(base, supervisor=SupervisorState.RELAUNCHING, attempt=2, restarts_left=2)
    won = sup.write(pool, job, HOSTS, claim, 1, every=True)
    assert won is not None
    assert sup.write(pool, job, HOSTS, claim, 0, every=True) is None
    assert pool.records() == [won] * 3
    assert won.by == 1


def test_a_leader_that_hung_while_another_took_over_launches_nothing():
    """Node 0 claims attempt 2 and hangs in its health gate; node 1 takes the attempt over and
    finishes it. Node 0, going on, finds a newer copy when it renews its claim: no launch."""
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=3)
    pool = ScriptedPool([[st("running"), st("exited", 1), st("running")]], {0, 1})
    sup.write(pool, job, HOSTS, first_record(3), 0, every=True)

    def meanwhile(*_a):
        claim = newest(pool.records())
        taken = sup.write(pool, job, HOSTS, claim, 1, every=True)  # node 1 takes it over
        ended = replace(taken, supervisor=SupervisorState.DONE)
        sup.write(pool, job, HOSTS, ended, 1)  # ... and it ends
        return []

    final, launched = loop(job, pool, 0, gate=meanwhile)
    assert launched == []
    assert final.supervisor == SupervisorState.DONE
    assert final.by == 1


# ---- a stop is remembered: the stopped record, and a supervisor the stop did not reach --------


def test_the_state_machine_a_stop_is_final_and_wins_whatever_the_versions():
    """Each state's next step for a leader (rank 0), a follower (rank 1) and a claimer (rank 2),
    and the copy that wins: STOPPED over every other, whatever the versions."""
    running = Supervision(SupervisorState.RUNNING, 1, 2, version=9)
    claim = Supervision(SupervisorState.RELAUNCHING, 2, 1, version=10, by=2)
    stopped = Supervision(SupervisorState.STOPPED, 1, 2, version=4)
    done = Supervision(SupervisorState.DONE, 1, 2, version=11)
    every = {0, 1, 2}
    assert [next_step(me, every, running) for me in (0, 1, 2)] == [
        Step.WATCH,
        Step.FOLLOW,
        Step.FOLLOW,
    ]
    assert [next_step(me, every, claim) for me in (0, 1, 2)] == [
        Step.FOLLOW,
        Step.FOLLOW,
        Step.RESUME,
    ]
    assert [next_step(me, every, done) for me in (0, 1, 2)] == [Step.END] * 3
    assert [next_step(me, every, stopped) for me in (0, 1, 2)] == [Step.STOP] * 3
    assert next_step(2, {2}, stopped) == Step.STOP  # alone, cut off until now
    assert newest([running, claim, done, stopped]) == stopped
    assert newest([stopped, replace(stopped, version=5), claim]) == replace(stopped, version=5)
    # what stop writes: the winning copy, stopped, one version on, nothing holding it
    answers = {
        HOSTS[0]: p.SupervisorReply(1, 0.0, [], replace(claim, held="x: workdir: y")),
        HOSTS[1]: p.SupervisorReply(None, None, [], running),
    }
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=3)
    record = sup.stop_record(sup.view(answers, HOSTS, job, 3).record, job)
    assert record == replace(claim, supervisor=SupervisorState.STOPPED, version=11)
    assert sup.stop_record(None, job) == Supervision(SupervisorState.STOPPED, 0, 3, version=1)


def test_a_stop_that_misses_a_node_is_remembered_and_its_supervisor_relaunches_nothing(
    tmp_path,
):
    """``stop`` with node 2 cut off: nodes 0 and 1 keep a stopped record, and stop names node 2
    and what happens there. Node 2's supervisor, on its own side, counted a version on; once it
    reconnects it finds the stop, ends the job on its node, leaves the stop there, and ends
    without a launch."""
    hostfile = tmp_path / "hostfile"  # stop reads it: a copy far ahead is judged by its size
    hostfile.write_text("".join(f"{host.host}\n" for host in HOSTS))
    job = Job("x", "/w", "s", str(hostfile), "/p", 1, restarts=2)
    pool = ScriptedPool([[st("running")] * 3], {0, 1, 2})
    base = sup.write(pool, job, HOSTS, first_record(2), 0, every=True)
    assert base is not None
    pool.failures = {HOSTS[2]: "No route to host"}
    stopped = ops.stop_with_supervisors(pool, job, HOSTS)
    assert not stopped.ok
    assert [row.ok for row in stopped.rows] == [True, True, False]
    then = ops.UNREACHED_SUPERVISED
    assert stopped.unreached == [
        ops.Unreached(2, "10.0.0.3", "unreachable: No route to host", then)
    ]
    shown = stopped.as_json()
    assert shown["unreached"] == [
        {"node_rank": 2, "host": "10.0.0.3", "error": "unreachable: No route to host", "then": then}
    ]
    assert [node["node_rank"] for node in shown["nodes"]] == [0, 1, 2]  # type: ignore[index]
    marked = replace(base, supervisor=SupervisorState.STOPPED, version=base.version + 1)
    assert pool.records() == [marked, marked, base]
    # meanwhile node 2's supervisor, alone, gave up on its side: a newer version, there only
    alone = replace(base, supervisor=SupervisorState.GAVE_UP, version=base.version + 5)
    pool.copies[HOSTS[2]] = alone.to_json()
    # the partition heals
    pool.failures = {}
    pool.live = {2}
    pool.calls.clear()
    final, launched = loop(job, pool, me=2)
    assert final == marked
    assert launched == []
    assert [host for op, host, _ in pool.calls if op == "stop"] == [HOSTS[2]]
    assert pool.records() == [marked] * 3
    starts = [
        request for op, _, request in pool.calls if op == "supervisor" and request.action == "start"
    ]
    assert starts == []
    status = ops.job_status(pool, job, HOSTS)
    assert status.supervision is not None
    assert status.supervision.supervisor == SupervisorState.STOPPED
    assert status.as_json()[0]["supervisor"] is None  # the fixed names: no supervisor


# ---- the heartbeat: a thread of its own, on the node's monotonic clock -----------------------

SLOW_RELAUNCH = """
import sys, time
from contextlib import nullcontext
sys.path.insert(0, sys.argv[1])
from meshkit.node import files
files.supervisors_root = lambda: sys.argv[2]
from test_supervise import HOSTS, ScriptedPool, first_record, launched_rows, st
from meshkit.hostfile import Host
from meshkit.job import Job
from meshkit.ops import supervision as sup
from meshkit.node.supervise import Heartbeat
from meshkit.ops.supervise import Supervisor

job = Job("x", sys.argv[5], sys.argv[4], "/h", "/p", 1, restarts=2)
failed = [st("running"), st("exited", 1), st("running")]
pool = ScriptedPool([failed, [st("exited", 0, 2.0)] * 3], {0, 1})
sup.write(pool, job, HOSTS, first_record(2), 0, every=True)

def slow_gate(*_args):
    print("held", flush=True)
    time.sleep(float(sys.argv[3]))
    return []

with Heartbeat(job.id, every=0.1).beating() as heart:
    final = Supervisor(
        lambda hosts, wait: nullcontext(pool), job, HOSTS, 0, lambda _m: None, interval=0,
        base_backoff=0, relaunch=launched_rows, gate=slow_gate, heart=heart,
    ).run()
print(final.supervisor, final.attempt, flush=True)
"""


def launched_rows(pool, job, attempt):
    """A relaunch that starts every node."""
    rows = [ops.StartRow(i, host.label, "running", None, []) for i, host in enumerate(HOSTS)]
    return ops.Launch(job, rows, None, False)


def test_a_relaunch_slower_than_the_staleness_limit_is_not_taken_over(tmp_path, monkeypatch):
    """A supervisor process whose relaunch (its health checks) takes twice the staleness
    limit: its node's agent sees it beat throughout, so the next rank follows it instead of
    taking the attempt over; the relaunch then finishes, attempt 2."""
    from meshkit.node import files
    from meshkit.node import supervise as nsup

    monkeypatch.setattr(files, "supervisors_root", lambda: str(tmp_path))
    monkeypatch.setattr(sup, "STALE", 1.5)
    workdir = str(tmp_path / "work")
    job = Job("x", workdir, "slow", "/h", "/p", 1, restarts=2)
    tests = str(Path(__file__).resolve().parent)
    argv = [sys.executable, "-c", SLOW_RELAUNCH, tests, str(tmp_path), "3", "slow", workdir]
    argv += ["supervise", "--session", "slow", "--workdir", workdir]  # as `meshkit supervise`
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "held\n"
        claim = Supervision(SupervisorState.RELAUNCHING, 2, 1, by=0)
        look = p.SupervisorRequest(job.id, "", session="slow", workdir=workdir)
        steps = []
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            reply = nsup.supervisor(look)
            assert reply.pid == child.pid
            live = sup.live_ranks(HOSTS[:1], {HOSTS[0]: reply}) | {1}
            steps.append(next_step(1, live, claim))
            time.sleep(0.05)
        assert len(steps) > 10
        assert set(steps) == {Step.FOLLOW}  # never RESUME: rank 0 is live all along
        assert child.stdout.readline() == "done 2\n"
        assert child.wait(30) == 0
    finally:
        child.kill()
        child.wait()


def test_a_loop_that_stops_moving_lets_its_heartbeat_go_stale(tmp_path, monkeypatch):
    """The beats go on while the loop moves, and stop once it has not moved for ``hung``: a
    supervisor stuck past every bound of its steps goes stale as a frozen one does."""
    from meshkit.node import files
    from meshkit.node import supervise as nsup
    from meshkit.node.supervise import Heartbeat

    monkeypatch.setattr(files, "supervisors_root", lambda: str(tmp_path))
    job_id = "ab" * 8
    with Heartbeat(job_id, every=0.05, hung=0.4).beating() as heart:
        for _ in range(6):
            heart.moved()
            time.sleep(0.1)
            age = nsup.beat_age(job_id)
            assert age is not None
            assert age < 0.3
        time.sleep(0.9)
        age = nsup.beat_age(job_id)
        assert age is not None
        assert age > 0.3


def test_a_lost_node_back_in_a_newer_generation_ends_its_part_and_relaunches_nothing():
    """Fencing: node 2 was lost and a spare took its rank (generation 2); node 2's supervisor,
    which survived (a partition), sees the newer generation without its node: it ends what its
    node still runs of the job, keeps the newer record there, and ends, launching nothing."""
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=2)
    spare = Host("10.0.0.9", lineno=9, spare=True)
    members = [HOSTS[0].label, HOSTS[1].label, spare.label]
    newer = Supervision(SupervisorState.RUNNING, 2, 2, version=4, generation=2, members=members)
    pool = ScriptedPool([[st("running")] * 3], {0, 1, 2})
    pool.copies[HOSTS[0]] = newer.to_json()
    pool.copies[HOSTS[1]] = newer.to_json()
    pool.copies[spare] = newer.to_json()  # the claim: on a majority of the 4 nodes
    pool.copies[HOSTS[2]] = first_record(2).to_json()  # its own, from before
    launched: list[int] = []
    final = scripted(
        lambda hosts, wait: nullcontext(pool),
        job,
        2,
        lambda _m: None,
        relaunch=lambda pool_, job_, attempt: launched.append(attempt),  # type: ignore[func-returns-value]
        gate=lambda *a: [],
        cluster=[*HOSTS, spare],
    ).run()
    assert final == newer
    assert launched == []
    assert [host for op, host, _ in pool.calls if op == "stop"] == [HOSTS[2]]
    assert copy_of(pool.copies[HOSTS[2]]) == newer  # the newer generation, on its node too


def test_the_newer_generation_wins_over_a_copy_counted_further_and_a_stop_over_both():
    old = Supervision(SupervisorState.GAVE_UP, 1, 0, version=9, generation=1)
    moved_on = Supervision(SupervisorState.RUNNING, 2, 2, version=5, generation=2)
    stopped = Supervision(SupervisorState.STOPPED, 1, 0, version=1, generation=1)
    assert newest([old, moved_on]) == moved_on
    assert newest([old, moved_on, stopped]) == stopped


# ---- a node that stops answering: the bound counts from its first unanswered poll -------------


def test_a_silent_node_is_lost_once_a_new_connection_failed_and_the_bound_ran_from_its_first_miss():
    """The state machine of ``Silence``: a missed poll makes a node SILENT from that poll's
    start; a failed new connection makes it UNREACHABLE (still counted from the first miss);
    the bound run out, LOST; any answer ends it all."""
    node = HOSTS[2]
    silence = Silence()
    assert silence.state(node, 100.0, 10.0) == Heard.ANSWERS
    silence.missed(node, 100.0)
    silence.missed(node, 117.0)  # a later miss does not move the start
    assert silence.state(node, 200.0, 10.0) == Heard.SILENT  # no new connection failed yet
    silence.unreachable(node, 127.0)
    assert silence.state(node, 109.0, 10.0) == Heard.UNREACHABLE
    assert silence.state(node, 110.0, 10.0) == Heard.LOST  # 10 s after the first miss
    assert silence.silent(HOSTS) == [node]
    assert silence.until(HOSTS, 10.0, 300.0) == 110.0  # only node 2 is waited for
    assert silence.until(HOSTS[:2], 10.0, 300.0) == 300.0 + 10.0  # none silent: from now
    assert silence.first(HOSTS, 300.0) == 100.0
    silence.heard(node)
    assert silence.state(node, 300.0, 10.0) == Heard.ANSWERS
    assert silence.first(HOSTS, 300.0) == 300.0
    # a node whose connection failed outright starts its silence there; the latest start of
    # several bounds the wait for them all
    silence.unreachable(HOSTS[0], 50.0)
    silence.missed(node, 60.0)
    assert silence.until(HOSTS, 10.0, 300.0) == 70.0
    silence.forget([HOSTS[1], node])  # a new membership without node 0
    assert silence.silent(HOSTS) == [node]


def test_a_node_refused_by_a_new_connection_is_unreachable_at_once():
    row = ops.StatusRow(1, "b", "absent", None, None, None, "timed out")
    hosts = [Host("a"), Host("b")]
    assert views([row], hosts, Silence())[0].state == "running"  # one missed poll: maybe a blip
    refused = Silence()
    refused.unreachable(hosts[1], 0.0)  # a new connection could not reach it
    assert views([row], hosts, refused)[0].state == "unreachable"


class Claimed(Exception):
    """The replacement was claimed and is being launched: where the test stops the loop."""


class PoweredOff(ScriptedPool):
    """Node 2 is powered off right after the first connection: a call to it then goes
    unanswered for its whole timeout (a silent channel), and a new connection to it fails after
    the connect timeout (``CONNECT``), as with a real machine that is off."""

    CONNECT = 0.5

    def __init__(self, polls: list[list[p.StatusReply]], live: set[int]) -> None:
        super().__init__(polls, live)
        self.off = HOSTS[2]
        self.connected = False
        self.first_missed: float | None = None
        self.written_to_the_silent_node = False

    def connect(self, hosts, wait):
        if self.off in hosts and self.connected:
            time.sleep(self.CONNECT + wait)
            self.failures[self.off] = "timed out connecting"
        self.connected = True
        return nullcontext(self)

    def call_all(self, phase, request_for, expect, hosts=None, timeout=None):
        wanted = list(hosts if hosts is not None else HOSTS)
        if self.off in wanted and self.off not in self.failures:
            if self.first_missed is None:
                self.first_missed = time.monotonic()
            if expect is p.SupervisorReply and request_for(self.off).record is not None:
                self.written_to_the_silent_node = True
            time.sleep(timeout if timeout is not None else 5.0)
            wanted.remove(self.off)
        if expect is p.StatusReply:
            poll = self.polls[0]
            self.replies["status"] = dict(zip(HOSTS, poll))
            return FakePool.call_all(self, phase, request_for, expect, wanted, timeout)
        return super().call_all(phase, request_for, expect, wanted, timeout)


def powered_off(job: Job) -> tuple[PoweredOff, Host]:
    """``HOSTS`` running the job, node 2 to be powered off (``PoweredOff``), a spare that
    answers, and the job's first record on the two nodes that stay up."""
    spare = Host("10.0.0.9", lineno=9, spare=True)
    pool = PoweredOff([[st("running")] * 3], {0, 1})
    pool.replies["stop"][spare] = p.StopReply(True, 4, [])
    sup.write(pool, job, HOSTS[:2], first_record(job.restarts), 0)
    return pool, spare


def test_a_node_that_goes_silent_is_replaced_the_bound_after_its_first_unanswered_poll(
    monkeypatch,
):
    """The leader's poll of node 2 waits its whole bound, then a new connection waits its
    connect timeout: both run inside --replace-after, counted from the poll node 2 first left
    unanswered, so the spare's claim comes about the bound after it, not the bound after the
    leader noticed. Meanwhile the record says what the leader waits for, written only where
    nodes answer."""
    from meshkit.ops import supervise

    monkeypatch.setattr(supervise, "POLL_TIMEOUT", 1.0)
    monkeypatch.setattr(supervise, "RECONNECT", 0.5)
    bound = 1.0
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=2, replace_after=bound)
    pool, spare = powered_off(job)
    said: list[str] = []
    claimed: list[float] = []
    gated: list[list[Host]] = []

    def relaunch(pool_, job_, attempt):
        claimed.append(time.monotonic())
        raise Claimed

    def gate(pool_, job_, hosts):
        gated.append(list(hosts))
        return []

    with pytest.raises(Claimed):
        scripted(
            pool.connect,
            job,
            0,
            said.append,
            relaunch=relaunch,
            gate=gate,
            cluster=[*HOSTS, spare],
        ).run()
    assert pool.first_missed is not None
    took = claimed[0] - pool.first_missed
    # the poll (1 s) and the new connection (0.5 s) ran inside the bound, or past it: lost at
    # once then; before, the bound began after them and a second missed poll
    assert bound <= took < bound + 1.0, said
    assert not pool.written_to_the_silent_node
    waits = [line for line in said if line.startswith("waiting for node 2 (10.0.0.3) until")]
    assert waits
    assert any(line.startswith("lost: 10.0.0.3") for line in said)
    claim = newest(pool.records())
    assert claim is not None
    assert (claim.generation, claim.members) == (2, ["10.0.0.1", "10.0.0.2", "10.0.0.9"])
    assert claim.waiting is None
    # the new membership's quick checks ran once, before the claim, not again before the launch
    assert gated == [[HOSTS[0], HOSTS[1], spare]]


# ---- a copy no majority carries: not believed, not followed -------------------------------


def test_a_copy_ahead_that_no_majority_carries_is_not_believable():
    """``quorum.believe``: one copy a generation ahead (or far ahead, or naming a node twice) is
    not what the job is at; the copies of the membership a majority carries are."""
    record = Supervision(SupervisorState.RUNNING, 1, 2, generation=2, members=["a", "b", "c"])
    known = (2, ("a", "b", "c"))
    for ahead in (
        replace(record, generation=3, members=["a", "b", "d"]),
        replace(record, generation=10**9, members=["d"]),
        replace(record, generation=3, members=["a", "a", "b"]),
    ):
        belief = believe([record, record, ahead], 3, "", known)
        assert belief.record == record
        assert belief.settled


def test_status_top_and_stop_believe_what_a_supervisor_follows():
    """``view``: a copy no majority carries is left out of what status and top show and of what
    stop writes (which would otherwise carry its membership); the stop lands all the same."""
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=2, generation=2, members=("a",))
    known = Supervision(SupervisorState.RUNNING, 1, 2, version=4, generation=2, members=["a"])
    absurd = replace(known, version=40, generation=10**9, members=["b"])
    answers = {
        HOSTS[0]: p.SupervisorReply(1, 0.0, [], known),
        HOSTS[1]: p.SupervisorReply(1, 0.0, [], absurd),
    }
    seen = sup.view(answers, HOSTS, job, 3)
    assert seen.record == known
    assert seen.belief.unproven == (10**9,)
    stopped = sup.stop_record(seen.record, job)
    assert (stopped.generation, stopped.members) == (2, ["a"])
    assert (stopped.supervisor, stopped.version) == (SupervisorState.STOPPED, 5)
    assert accepts(absurd.to_json(), stopped, 0)  # a stop of the launch lands over it


def test_a_node_whose_copy_claims_an_absurd_generation_is_ignored():
    """Node 1's copy says generation 10^9, with a membership that leaves node 1 out: believed,
    it would move the job there and fence a healthy node. The leader names it in the log once,
    follows nothing, and the job ends DONE on the majority that keeps its writes."""
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=2)
    pool = ScriptedPool([[st("running")] * 3, [st("exited", 0, 2.0)] * 3], {0, 1, 2})
    sup.write(pool, job, HOSTS, first_record(2), 0, every=True)
    bad = Supervision(
        SupervisorState.RUNNING,
        1,
        2,
        version=40,
        generation=10**9,
        members=[HOSTS[0].label, HOSTS[2].label],
    )
    pool.copies[HOSTS[1]] = bad.to_json()
    said: list[str] = []
    final = scripted(
        lambda hosts, wait: nullcontext(pool),
        job,
        0,
        said.append,
        relaunch=launched_rows,
        gate=lambda *a: [],
    ).run()
    assert final.supervisor == SupervisorState.DONE
    assert (final.generation, final.members) == (1, [])
    assert pool.records() == [final, bad, final]  # node 1 keeps its own: a newer generation
    ignored = [line for line in said if "not followed" in line]
    assert ignored == [
        "generation 1000000000 is claimed by fewer than a majority of the job's 3 nodes: "
        "not followed"
    ]
    assert not any("this node is rank" in line for line in said)


def test_a_restart_claim_goes_past_a_generation_no_majority_carries():
    """A restart while node 1 holds a claim no majority took (generation 5): node 1 would
    refuse a claim of generation 1, so the claim is of generation 6, same members; the job is
    relaunched on every node, node 1 included."""
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=2)
    failed = [st("exited", 1, 2.0), st("running"), st("running")]
    pool = ScriptedPool([failed, [st("exited", 0, 3.0)] * 3], {0, 1, 2})
    sup.write(pool, job, HOSTS, first_record(2), 0, every=True)
    stray = Supervision(SupervisorState.RELAUNCHING, 2, 1, version=3, generation=5, by=1)
    pool.copies[HOSTS[1]] = replace(stray, members=[HOSTS[1].label]).to_json()
    final, launched = loop(job, pool)
    assert launched == [2]
    assert final.supervisor == SupervisorState.DONE
    assert final.generation == 6
    assert pool.records() == [final] * 3


@pytest.mark.parametrize("peers", ["running", "failed"])
def test_a_lost_node_goes_to_a_spare_with_no_restarts_left(monkeypatch, peers):
    """``--restarts 0 --replace-after``: a replacement uses up no restart, so a node lost with
    none left still goes to the spare (the policy does not give up first), also when the other
    nodes' ranks failed meanwhile (as torchrun's do within seconds of losing the master), and
    the claim of the new generation keeps ``restarts_left`` at 0."""
    from meshkit.ops import supervise

    monkeypatch.setattr(supervise, "POLL_TIMEOUT", 0.2)
    monkeypatch.setattr(supervise, "RECONNECT", 0.2)
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=0, replace_after=0.5)
    pool, spare = powered_off(job)
    pool.CONNECT = 0.1
    if peers == "failed":  # every poll: nodes 0 and 1 exited 1 (node 2 is off)
        pool.polls = [[st("exited", 1), st("exited", 1), st("running")]]
    said: list[str] = []

    def relaunch(pool_, job_, attempt):
        raise Claimed

    with pytest.raises(Claimed):
        scripted(
            pool.connect,
            job,
            0,
            said.append,
            relaunch=relaunch,
            gate=lambda *a: [],
            cluster=[*HOSTS, spare],
        ).run()
    assert not any("gave up" in line for line in said), said
    claim = newest(pool.records())
    assert claim is not None
    assert (claim.generation, claim.members) == (2, ["10.0.0.1", "10.0.0.2", "10.0.0.9"])
    assert (claim.attempt, claim.restarts_left) == (2, 0)
    assert claim.reason == p.RestartReason.REPLACED
