"""The supervisor's policy (pure: per-node views, restart policy -> action), its record, and sync
planning; no mocks, no cluster."""

from __future__ import annotations

import pytest

from meshkit.errors import UsageError
from meshkit.job import Job, from_json, parse_restart_on
from meshkit.ops import jobs as ops
from meshkit.ops import supervise as sup
from meshkit.ops.supervise import (
    DONE,
    GAVE_UP,
    RELAUNCHING,
    RUNNING,
    NodeView,
    Record,
    backoff,
    decide,
    newest,
    next_step,
    record_from_json,
    restartable,
    views,
)
from meshkit.ops.sync import plan
from meshkit.protocol import FileState
from meshkit.record import replace


def nodes(*states: tuple[str, int | None]) -> list[NodeView]:
    return [NodeView(i, f"10.0.0.{i + 1}", s, c, 100.0 + i) for i, (s, c) in enumerate(states)]


STARTED = {0: 100.0, 1: 101.0, 2: 102.0}


def test_all_running_or_some_finished_ok_waits():
    assert decide(nodes(("running", None)) * 1, STARTED, (), 2).action == "wait"
    assert decide(nodes(("exited", 0), ("running", None)), STARTED, (), 2).action == "wait"


def test_every_node_exited_zero_is_done():
    assert decide(nodes(("exited", 0), ("exited", 0), ("exited", 0)), STARTED, (), 0).action == DONE


def test_a_failed_node_restarts_the_whole_job_while_restarts_are_left():
    d = decide(nodes(("running", None), ("exited", 1), ("running", None)), STARTED, (), 1)
    assert d.action == "restart" and d.reason == "node 1 (10.0.0.2) exited with code 1"
    d = decide(nodes(("running", None), ("exited", 1), ("running", None)), STARTED, (), 0)
    assert d.action == GAVE_UP and "no restarts left" in d.reason and "code 1" in d.reason


def test_restart_on_limits_which_codes_restart():
    assert restartable(1, ()) and restartable(137, ()) and not restartable(0, ())
    assert restartable(1, (1, 137)) and not restartable(2, (1, 137))
    d = decide(nodes(("exited", 2), ("running", None)), STARTED, (1,), 5)
    assert d.action == GAVE_UP and "not in --restart-on" in d.reason


def test_unreachable_absent_and_restarted_nodes_restart():
    assert "not answering" in decide(nodes(("unreachable", None)), STARTED, (), 1).reason
    assert "gone there" in decide(nodes(("running", None), ("absent", None)), STARTED, (), 1).reason
    moved = [NodeView(0, "a", "running", None, 999.0)]
    d = decide(moved, STARTED, (), 1)
    assert d.action == "restart" and "outside the supervisor" in d.reason


def test_one_missed_poll_is_not_a_failure():
    row = ops.StatusRow(0, "a", "absent", None, None, None, "timeout")
    misses: dict[int, int] = {}
    assert views([row], misses)[0].state == "running"
    assert views([row], misses)[0].state == "unreachable"
    ok = ops.StatusRow(0, "a", "running", None, "2026-01-01T00:00:00+00:00", None)
    assert views([ok], misses)[0].started == 1767225600.0 and misses == {}


def test_backoff_doubles_and_is_capped():
    assert [backoff(k, 2.0, 10.0) for k in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 10.0]


def test_record_round_trip_and_status_fields():
    rec = Record(GAVE_UP, 3, 0, "node 1 exited with code 1", [1, 143, 143], 7, 1, None)
    assert record_from_json(rec.to_json()) == rec
    assert record_from_json("{}") is None and record_from_json(None) is None
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=2)
    rows = [ops.StatusRow(0, "a", "exited", 1, None, None)]
    out = sup.with_supervision(job, rows, rec, None)[0].as_json()
    assert (out["supervisor"], out["attempt"], out["restarts_left"]) == (GAVE_UP, 3, 0)
    assert out["exit_code"] == 1 and out["last_restart_reason"] == "node 1 exited with code 1"
    plain = Job("x", "/w", "s", "/h", "/p", 1)
    assert "supervisor" not in sup.with_supervision(plain, rows, None, None)[0].as_json()
    assert sup.with_supervision(job, rows, None, None)[0].as_json()["supervisor"] is None


def test_status_names_the_leader_and_a_held_relaunch_and_an_unbacked_record():
    """Status shows the lowest live supervisor as the leader and what holds a relaunch; a
    running record that no live supervisor backs (every node's died) is "not responding"."""
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=2)
    rows = [ops.StatusRow(0, "a", "absent", None, None, None)]
    held = Record(RELAUNCHING, 2, 1, "node 1 exited", held="b: workdir: /w: Read-only")
    out = sup.with_supervision(job, rows, held, 1)[0].as_json()
    # the JSON keeps its fixed names: a claimed relaunch is a running supervisor, relaunching
    assert (out["supervisor"], out["relaunching"]) == (RUNNING, True)
    assert (out["leader"], out["held"]) == (1, held.held)
    gone = sup.with_supervision(job, rows, Record(RUNNING, 1, 2), None)[0].as_json()
    assert gone["supervisor"] == "not responding" and "no node has a live" in str(
        gone["last_restart_reason"]
    )
    done = sup.with_supervision(job, rows, Record(DONE, 1, 2), 0)[0].as_json()
    assert done["supervisor"] == DONE and done["leader"] is None


def test_the_newest_copy_wins_and_the_lowest_live_rank_leads():
    old, new = Record(RUNNING, 1, 2, version=3), Record(RELAUNCHING, 2, 1, version=4, by=1)
    assert newest([old.to_json(), None, "junk", new.to_json()]) == new
    assert newest([None]) is None
    assert next_step(0, {0, 1, 2}, old) == "watch"
    assert next_step(1, {0, 1, 2}, old) == "follow"
    assert next_step(1, {1, 2}, old) == "watch"  # node 0's supervisor is gone: node 1 leads
    # a claimed relaunch: its live claimer finishes it, whoever leads ...
    assert next_step(0, {0, 1}, new) == "follow" and next_step(1, {0, 1}, new) == "resume"
    # ... else the leader takes it over (the same attempt, never a new one)
    assert next_step(0, {0, 2}, new) == "resume" and next_step(2, {0, 2}, new) == "follow"
    for final in (DONE, GAVE_UP):
        assert next_step(0, {0}, Record(final, 1, 0)) == "end"
    assert next_step(0, {0}, None) == "end"


def test_liveness_is_a_live_pid_with_a_fresh_heartbeat():
    assert sup.alive(p.SupervisorReply(12, 1.0, [], None))
    assert not sup.alive(p.SupervisorReply(12, sup.STALE + 1, [], None))  # hung, or its clock
    assert not sup.alive(p.SupervisorReply(None, None, [], None))


def test_job_keeps_its_policy_and_marks_later_attempts():
    job = Job("torchrun t.py", "/w", "s", "/h", "/p", 1, restarts=2, restart_on=(1,), sync=True)
    again = from_json(job.to_json(), "job.json")
    assert again == job and again.node_hostfile == "/w/.meshkit/s/hostfile"
    assert job.node_job(1).argv[-1] == "torchrun t.py"
    assert job.node_job(2).argv[-1] == "echo '===== meshkit: attempt 2 of 3 ====='\ntorchrun t.py"
    assert parse_restart_on("137, 1") == (1, 137) and parse_restart_on(None) == ()
    with pytest.raises(UsageError, match="not an exit code"):
        parse_restart_on("1,x")


def test_sync_plan_sends_only_what_differs():
    local = [
        FileState("a.py", 3, 10.0, 0o644),
        FileState("b.py", 4, 10.0, 0o644),
        FileState("c.py", 5, 10.0, 0o644),
    ]
    remote = [
        FileState("a.py", 3, 10.0, 0o644),
        FileState("b.py", 4, 11.0, 0o644),
        FileState("old.py", 1, 1.0, 0o644),
    ]
    assert [f.path for f in plan(local, remote)] == ["b.py", "c.py"]


# ---- the loop, against scripted node answers (no cluster) -----------------------------------

from contextlib import nullcontext  # noqa: E402

from helpers.fake_pool import HOSTS, FakePool, healthy  # noqa: E402

from meshkit import protocol as p  # noqa: E402
from meshkit.node.supervise import version_of  # noqa: E402
from meshkit.ops.supervise import Supervisor  # noqa: E402
from meshkit.outcome import Outcome  # noqa: E402


class ScriptedPool(FakePool):
    """``status`` answers come from a script, one poll at a time (the last one repeats); the
    ``supervisor`` op keeps each node's record copy with the node's own compare-and-set rule,
    and says the supervisors of ``live`` ranks run."""

    def __init__(self, polls: list[list[p.StatusReply]], live: set[int]) -> None:
        super().__init__(healthy())
        self.polls, self.live = polls, live
        self.copies: dict[object, str | None] = {h: None for h in HOSTS}

    def call_all(self, phase, request_for, expect, hosts=None, timeout=None):
        if expect is p.StatusReply:
            poll = self.polls.pop(0) if len(self.polls) > 1 else self.polls[0]
            self.replies["status"] = dict(zip(HOSTS, poll))
        if expect is p.SupervisorReply:
            out = {}
            for h in hosts if hosts is not None else HOSTS:
                r = request_for(h)
                self.calls.append(("supervisor", h, r))
                written = r.record is not None and version_of(self.copies[h]) <= r.version
                if written:
                    self.copies[h] = r.record
                pid = 1 if HOSTS.index(h) in self.live else None
                beat = 0.0 if pid else None
                out[h] = Outcome(p.SupervisorReply(pid, beat, [], self.copies[h], written))
            return out
        return super().call_all(phase, request_for, expect, hosts, timeout)


def loop(job: Job, pool: ScriptedPool, me: int = 0, gate=lambda *a: []):
    launched: list[int] = []

    def relaunch(pool_, job_, attempt):
        launched.append(attempt)
        return ops.Launch(
            job_,
            [ops.StartRow(i, h.label, "running", None, []) for i, h in enumerate(HOSTS)],
            None,
            False,
        )

    final = Supervisor(
        lambda wait: nullcontext(pool),
        job,
        HOSTS,
        me,
        lambda _m: None,
        interval=0,
        base_backoff=0,
        relaunch=relaunch,
        gate=gate,
    ).run()
    return final, launched


def run(job: Job, polls: list[list[p.StatusReply]]):
    pool = ScriptedPool(polls, {0})
    sup.write(pool, job, HOSTS, Record(RUNNING, 1, job.restarts), 0, every=True)
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
    assert (final.supervisor, final.attempt, final.restarts_left) == (DONE, 2, 1)
    assert final.last_restart_reason == "node 1 (10.0.0.2) exited with code 1"
    assert [h for op, h, _ in pool.calls if op == "stop"] == HOSTS  # the whole job, once
    assert all(newest([c]) == final for c in pool.copies.values())  # on every node
    starts = [r for op, _, r in pool.calls if op == "supervisor" and r.action == "start"]
    assert len(starts) == 3  # a supervisor on every node again where none is live


def test_loop_gives_up_when_restarts_run_out_keeping_exit_codes():
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=1)
    failed = [st("exited", 3)] * 3
    final, launched, pool = run(job, [failed])
    assert launched == [2] and (final.supervisor, final.attempt, final.restarts_left) == (
        GAVE_UP,
        2,
        0,
    )
    assert final.exit_codes == [3, 3, 3] and final.last_restart_reason.startswith(
        "no restarts left"
    )
    stops = [r for op, _, r in pool.calls if op == "stop"]
    assert len(stops) == 3 and not any(r.keep_exit for r in stops)  # only the restart's stop


class Died(Exception):
    """The leader's process ending mid-relaunch."""


def test_a_leader_dying_mid_relaunch_leaves_one_relaunch_finished_by_the_next():
    """Node 0 claims attempt 2 and dies while its health gate holds; node 1, once node 0's
    supervisor is gone, finishes attempt 2: one relaunch, one attempt number, and the gate
    named in the record meanwhile."""
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=3)
    running, failed = [st("running")] * 3, [st("running"), st("exited", 1), st("running")]
    pool = ScriptedPool([failed], {0, 1})
    sup.write(pool, job, HOSTS, Record(RUNNING, 1, 3), 0, every=True)

    def dies(*_a):
        held = newest(pool.copies.values())
        assert held is not None and held.supervisor == RELAUNCHING and held.by == 0
        raise Died

    with pytest.raises(Died):
        loop(job, pool, 0, gate=dies)
    pool.live = {1}  # node 0's supervisor is gone; node 1's looks and leads
    holds = iter([["10.0.0.3: workdir: /w: Read-only file system"], []])
    pool.polls = [running, [st("exited", 0, 2.0)] * 3]
    final, launched = loop(job, pool, 1, gate=lambda *a: next(holds))
    assert launched == [2] and (final.supervisor, final.attempt, final.restarts_left) == (
        DONE,
        2,
        2,
    )
    writes = [newest([r.record]) for op, h, r in pool.calls if op == "supervisor" and r.record]
    assert any(w and w.held and w.by == 1 for w in writes)  # the held gate, by the new leader
    assert {w.attempt for w in writes if w} == {1, 2}


def test_two_claims_of_the_same_attempt_one_wins_and_nothing_of_the_other_is_written():
    """Both read version 1 and claim attempt 2: the first node decides, and the loser writes
    nowhere (so no node holds its claim)."""
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=3)
    pool = ScriptedPool([[st("running")] * 3], {0, 1})
    base = sup.write(pool, job, HOSTS, Record(RUNNING, 1, 3), 0, every=True)
    claim = replace(base, supervisor=RELAUNCHING, attempt=2, restarts_left=2)
    won = sup.write(pool, job, HOSTS, claim, 1, every=True)
    assert won is not None and sup.write(pool, job, HOSTS, claim, 0, every=True) is None
    assert [newest([c]) for c in pool.copies.values()] == [won] * 3 and won.by == 1


def test_a_leader_that_hung_while_another_took_over_launches_nothing():
    """Node 0 claims attempt 2 and hangs in its health gate; node 1 takes the attempt over and
    finishes it. Node 0, going on, finds a newer copy when it renews its claim: no launch."""
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=3)
    pool = ScriptedPool([[st("running"), st("exited", 1), st("running")]], {0, 1})
    sup.write(pool, job, HOSTS, Record(RUNNING, 1, 3), 0, every=True)

    def meanwhile(*_a):
        claim = newest(pool.copies.values())
        taken = sup.write(pool, job, HOSTS, claim, 1, every=True)  # node 1 takes it over
        sup.write(pool, job, HOSTS, replace(taken, supervisor=DONE), 1)  # ... and it ends
        return []

    final, launched = loop(job, pool, 0, gate=meanwhile)
    assert launched == [] and final.supervisor == DONE and final.by == 1
