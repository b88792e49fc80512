"""Controller side, no nodes: the jobs ops (ops/jobs.py) over a fake pool's canned replies.

The jobs ops layer against a small fake cluster (in the spirit of invoke's MockContext): the
logic that otherwise only root sandbox tests reach - preflight verdicts, port choice, conflicts,
status and stop analysis, a supervised job's status - with canned node replies."""

from __future__ import annotations

import json
import time

import pytest
from helpers.fake_pool import HOSTS, FakePool, env_ok, healthy

from meshkit import protocol as p
from meshkit.errors import LaunchError, NodeFailed, RemoteError
from meshkit.hostfile import Host
from meshkit.job import Job
from meshkit.ops import jobs as ops
from meshkit.ops import supervision_status as shown
from meshkit.ops.supervision import View, view
from meshkit.outcome import Outcome
from meshkit.protocol import Supervision, SupervisorState
from meshkit.quorum import Belief
from meshkit.record import replace


def job() -> Job:
    return Job("train", "/w", "s", "/shared/hostfile", "/venv/bin/python", 25000)


def test_launch_saves_the_job_and_its_index_through_the_master_then_starts_everywhere():
    pool = FakePool(healthy())
    launch = ops.launch(pool, job(), HOSTS)
    assert launch.ok
    assert [r.state for r in launch.rows] == ["running"] * 3
    assert set(pool.files) == {
        (HOSTS[0], "/w/.meshkit/s/job.json"),
        (HOSTS[0], "/shared/.meshkit/jobs/hostfile--s.json"),
    }
    assert [op for op, _, _ in pool.calls].count("start") == 3


@pytest.mark.parametrize(
    "result",
    [
        {"variables": {"NODE_RANK": 0}, "source": "x", "matched": None, "interface_source": ""},
        {"variables": ["NODE_RANK"], "source": "x", "matched": None, "interface_source": ""},
        {"variables": {}, "source": 1, "matched": None, "interface_source": ""},
        {"variables": {}},
    ],
)
def test_an_env_reply_that_is_not_plain_variables_is_refused(result):
    line = json.dumps({"ok": True, "result": result})
    with pytest.raises(p.ProtocolViolation, match=r"result\."):
        p.decode_reply("env", line)


def test_a_node_whose_discovery_failed_is_named_with_its_reason():
    envs = {h: Outcome(env_ok(i)) for i, h in enumerate(HOSTS)}
    envs[HOSTS[0]] = Outcome(p.EnvReply({}, "", None, "", "hostfile: no such hostfile"))
    problems = ops.env_verdicts(job(), HOSTS, envs, {})
    assert problems == ["10.0.0.1: hostfile: no such hostfile"]


def test_preflight_problems_start_nothing_anywhere():
    bad = healthy(
        env={
            HOSTS[0]: env_ok(0),
            HOSTS[1]: env_ok(2),  # discovers the wrong rank
            HOSTS[2]: RemoteError(
                "interpreter /venv/bin/python not found on the node; install meshkit at the same "
                "path there or set meshkit.python"
            ),
        }
    )
    pool = FakePool(bad, failures={})
    with pytest.raises(LaunchError) as info:
        ops.launch(pool, job(), HOSTS)
    text = str(info.value)
    assert "10.0.0.2: is line 2" in text
    assert "NODE_RANK=2" in text
    assert "interpreter /venv/bin/python not found" in text
    assert "nothing was started" in text
    assert not any(op == "start" for op, _, _ in pool.calls)
    assert not pool.files


def test_nodes_that_disagree_or_cannot_connect_are_named():
    envs = {h: env_ok(i, port=25001 if i == 2 else 25000) for i, h in enumerate(HOSTS)}
    problems = ops.env_verdicts(job(), HOSTS, {h: Outcome(v) for h, v in envs.items()}, {})
    assert len(problems) == 1
    assert "disagree" in problems[0]
    assert "10.0.0.3" in problems[0]
    down = ops.env_verdicts(job(), HOSTS, {}, {HOSTS[1]: "connection refused on port 22"})
    assert down == ["10.0.0.2: cannot connect: connection refused on port 22"]


def test_another_job_blocks_the_launch_unless_replace():
    other = p.RunningJob("f" * 16, "'s' in /elsewhere")
    replies = healthy(jobs={h: p.JobsReply([other] if h == HOSTS[1] else []) for h in HOSTS})
    with pytest.raises(
        LaunchError, match=r"10.0.0.2: another meshkit job is running there: 's' in /elsewhere"
    ):
        ops.launch(FakePool(replies), job(), HOSTS)
    pool = FakePool(replies)
    assert ops.launch(pool, job(), HOSTS, replace=True).ok
    starts = [request for op, _, request in pool.calls if op == "start"]
    assert all(request.replace for request in starts)  # type: ignore[union-attr]


def test_port_choice():
    j = job()
    busy = p.PortsReply(
        [p.PortState(25000, False), p.PortState(25001, False), p.PortState(25002, True)], False
    )
    assert ops.pick_port(busy, j, HOSTS[0])[0] == 25002
    ours = p.PortsReply([p.PortState(25000, False)], True)
    assert ops.pick_port(ours, j, HOSTS[0]) == (25000, None)  # our own old run: replaced
    full = p.PortsReply([p.PortState(25000, False), p.PortState(25001, False)], False)
    with pytest.raises(LaunchError, match="all busy"):
        ops.pick_port(full, j, HOSTS[0])


def test_a_node_that_did_not_start_fails_the_launch():
    replies = healthy(
        start={
            h: p.StartReply(
                h != HOSTS[2],
                "running" if h != HOSTS[2] else "absent",
                [],
                [],
                None if h != HOSTS[2] else "tmux failed",
            )
            for h in HOSTS
        }
    )
    launch = ops.launch(FakePool(replies), job(), HOSTS)
    assert not launch.ok
    assert launch.rows[2].error == "tmux failed"


def test_status_and_stop_rows_never_claim_what_was_not_seen():
    replies = healthy(
        status={
            HOSTS[0]: p.StatusReply("exited", 0, 1.7e9, "done"),
            HOSTS[1]: RemoteError("agent gone"),
        },
        stop={HOSTS[0]: p.StopReply(True, 3, []), HOSTS[1]: p.StopReply(True, 3, [4242])},
    )
    pool = FakePool(replies, failures={HOSTS[2]: "no answer within 10s on port 22"})
    rows = ops.status(pool, job(), HOSTS)
    assert [r.state for r in rows] == ["exited", "absent", "absent"]
    assert rows[1].error == "agent gone"
    assert "no answer" in (rows[2].error or "")
    assert rows[0].as_json()["started"].startswith("2023-11-14T22:13:20")
    stops = ops.stop(pool, job(), HOSTS)
    assert [s.ok for s in stops] == [True, False, False]
    assert stops[1].left == [4242]
    assert "no answer" in (stops[2].error or "")


# ---- a supervised job's status: its record and its leader --------------------------------


def supervised(
    record: Supervision | None, leader: int | None, spares: list[shown.SpareRow] | None = None
) -> shown.SupervisionStatus:
    """What ``job_status`` shows of a supervised job whose nodes believe ``record`` and whose
    live supervisors are ``leader``'s alone (None: none live)."""
    live = frozenset() if leader is None else frozenset({leader})
    belief = Belief(record, True, 3, 3)  # every node answered, a majority carries it
    return shown.supervision_status(View(belief, live), spares or [])


def first_json(rows: list[ops.StatusRow], supervision: shown.SupervisionStatus | None) -> dict:
    """The first node's ``status --json`` object."""
    return ops.JobStatus(rows, supervision).as_json()[0]


def test_a_supervised_jobs_status_fields():
    reason = "node 1 exited with code 1"
    rec = Supervision(SupervisorState.GAVE_UP, 3, 0, reason, [1, 143, 143], 7, 1, None)
    rows = [ops.StatusRow(0, "a", "exited", 1, None, None)]
    out = first_json(rows, supervised(rec, None))
    assert (out["supervisor"], out["attempt"], out["restarts_left"]) == ("gave up", 3, 0)
    assert out["exit_code"] == 1
    assert out["last_restart_reason"] == "node 1 exited with code 1"
    plain = Job("x", "/w", "s", "/h", "/p", 1)
    unsupervised = ops.job_status(FakePool(healthy()), plain, HOSTS)
    assert unsupervised.supervision is None  # not supervised: no supervision keys
    assert "supervisor" not in unsupervised.as_json()[0]
    assert "supervisor" not in first_json(rows, None)
    assert first_json(rows, supervised(None, None))["supervisor"] is None


def test_status_names_the_leader_and_a_held_relaunch_and_an_unbacked_record():
    """Status shows the lowest live supervisor as the leader and what holds a relaunch; a
    running record that no live supervisor backs (every node's died) is "not responding"."""
    rows = [ops.StatusRow(0, "a", "absent", None, None, None)]
    why = "b: workdir: /w: Read-only"
    held = Supervision(SupervisorState.RELAUNCHING, 2, 1, "node 1 exited", held=why)
    out = first_json(rows, supervised(held, 1))
    # the JSON keeps its fixed names: a claimed relaunch is a running supervisor, relaunching
    assert (out["supervisor"], out["relaunching"]) == (SupervisorState.RUNNING, True)
    assert (out["leader"], out["held"]) == (1, held.held)
    running = Supervision(SupervisorState.RUNNING, 1, 2)
    gone = first_json(rows, supervised(running, None))
    assert gone["supervisor"] == "not responding"
    assert "no node has a live" in str(gone["last_restart_reason"])
    done = Supervision(SupervisorState.DONE, 1, 2)
    ended = first_json(rows, supervised(done, 0))
    assert ended["supervisor"] == SupervisorState.DONE
    assert ended["leader"] is None


def test_one_view_gives_the_believed_record_and_the_leader():
    """``supervision.view``: the record believed of the nodes' copies (a copy no majority
    carries left out) and the live supervisors, the lowest of them leading."""
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=2)
    old = Supervision(SupervisorState.RUNNING, 1, 2, version=3)
    new = replace(old, version=4)
    absurd = replace(old, version=9, generation=10**9)
    answers = {
        HOSTS[0]: p.SupervisorReply(None, None, [], old),  # no supervisor runs there
        HOSTS[1]: p.SupervisorReply(11, 0.0, [], absurd),
        HOSTS[2]: p.SupervisorReply(12, 1.0, [], new),
    }
    seen = view(answers, HOSTS, job, 3)
    assert seen.record == new
    assert (seen.live, seen.leader) == ({1, 2}, 1)
    stale = {HOSTS[2]: p.SupervisorReply(12, 600.0, [], new)}  # its heartbeat long gone
    alone = view(stale, HOSTS, job, 3)
    assert (alone.record, alone.leader) == (new, None)
    assert not alone.belief.settled  # one node of three answered: shown, not acted on
    nobody = view({}, HOSTS, job, 3)
    assert (nobody.record, nobody.live, nobody.belief.quorum) == (None, frozenset(), False)


def test_status_and_top_say_the_supervision_in_the_same_words():
    from meshkit.cli.tasks.jobs import supervisor_lines

    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=3)
    running = supervised(Supervision(SupervisorState.RUNNING, 2, 2, "node 1 exited"), 0)
    assert shown.supervisor_words(running) == "running, attempt 2 of 4 (leader: node 0)"
    assert supervisor_lines(running, job) == [
        "supervisor: running, attempt 2 of 4 (leader: node 0), restarts left 2, "
        "last restart: node 1 exited"
    ]
    gave_up = supervised(Supervision(SupervisorState.GAVE_UP, 3, 0), 0)
    assert shown.supervisor_words(gave_up) == "gave up, attempt 3 of 3"
    assert supervisor_lines(gave_up, job) == [
        "supervisor: gave up, attempt 3 of 3, restarts left 0"
    ]
    unbacked = supervised(Supervision(SupervisorState.RUNNING, 1, 3), None)
    assert shown.supervisor_words(unbacked) == "not responding"
    said = supervisor_lines(unbacked, job)
    assert said == [f"supervisor: not responding: {shown.NOT_BACKED}"]
    nothing = supervised(None, None)
    assert shown.supervisor_words(nothing) is None
    assert supervisor_lines(nothing, job) == ["supervisor: none (restarts 3)"]


def test_status_json_spells_the_states_as_before():
    """``status --json`` prints the states as plain strings, byte for byte."""
    rows = [ops.StatusRow(0, "a", p.JobState.EXITED, 1, None, None)]
    record = Supervision(SupervisorState.GAVE_UP, 3, 0)
    out = first_json(rows, supervised(record, None))
    text = json.dumps(out)
    assert '"state": "exited"' in text
    assert '"supervisor": "gave up"' in text
    assert f"{SupervisorState.GAVE_UP}" == "gave up"


# ---- a supervised job's membership in status: generation, lost, replaced, waiting, spares ------


def test_status_json_carries_the_membership_for_a_supervised_job_only():
    rows = [ops.StatusRow(0, "a", p.JobState.RUNNING, None, None, None)]
    record = Supervision(
        SupervisorState.RELAUNCHING,
        3,
        2,
        "replaced: 10.0.0.2 -> 10.0.0.9 (10.0.0.2 lost)",
        generation=2,
        members=["10.0.0.1", "10.0.0.9", "10.0.0.3"],
        lost=["10.0.0.2"],
        replaced=["10.0.0.2 -> 10.0.0.9"],
        waiting="node 2 (10.0.0.3) until 21:00:00 UTC, lost then (--replace-after)",
    )
    spares = [
        shown.SpareRow("10.0.0.2", False, "not answering: timed out"),
        shown.SpareRow("s2", True),
    ]
    out = first_json(rows, supervised(record, 0, spares))
    assert out["generation"] == 2
    assert out["lost"] == ["10.0.0.2"]
    assert out["replaced"] == ["10.0.0.2 -> 10.0.0.9"]
    assert out["waiting"] == record.waiting
    assert out["spares"] == [
        {"node": "10.0.0.2", "healthy": False, "why": "not answering: timed out", "running": False},
        {"node": "s2", "healthy": True, "why": None, "running": False},
    ]
    json.dumps(out)  # every value is plain JSON
    # no record yet (or after a stop): the keys are there, empty
    bare = first_json(rows, supervised(None, None))
    assert (bare["generation"], bare["lost"], bare["waiting"], bare["spares"]) == (
        None,
        [],
        None,
        [],
    )
    unsupervised = first_json(rows, None)  # a job that is not supervised (``job_status``)
    for key in ("generation", "lost", "replaced", "waiting", "spares"):
        assert key not in unsupervised


def facts(**changes: object) -> p.FactsReply:
    base: dict[str, object] = dict(hostname="n", python="3.11.7", meshkit="0.1.0", torch="2.5.0")
    base |= dict(cuda=None, nccl=None, gpus=0, clock=1000.0, writable=None, marker="x")
    base.update(changes)
    return p.FactsReply(**base)  # type: ignore[arg-type]


def test_a_spare_is_healthy_when_its_facts_match_the_master_and_else_says_why():
    master = Host("10.0.0.1", lineno=1, slots=2)
    spare = Host("10.0.0.9", lineno=4, spare=True)
    down = Host("10.0.0.8", lineno=5, spare=True)
    silent = Host("10.0.0.7", lineno=6, spare=True)
    old = Host("10.0.0.6", lineno=7, spare=True)
    now = time.time()  # the facts' clocks: read within the round trip
    replies = {
        "doctor_facts": {
            master: facts(gpus=2, clock=now),
            spare: facts(gpus=2, clock=now),
            silent: RemoteError("10.0.0.7: agent exited"),
            old: facts(torch="2.4.0", gpus=1, clock=now),
        }
    }
    absent = p.StatusReply(p.JobState.ABSENT, None, None, None)
    replies["status"] = {spare: absent, silent: absent, old: absent}
    pool = FakePool(replies, failures={down: "connection timed out"})
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=1)
    rows = shown.spare_rows(pool, job, [master], [spare, down, silent, old])
    assert rows[:3] == [
        shown.SpareRow("10.0.0.9", True),
        shown.SpareRow("10.0.0.8", False, "not answering: connection timed out"),
        shown.SpareRow("10.0.0.7", False, "10.0.0.7: agent exited"),
    ]
    assert not rows[3].healthy
    assert "versions: torch 2.4.0 (master: 2.5.0)" in str(rows[3].why)
    assert "gpus: 1 GPUs, slots=2" in str(rows[3].why)
    # the facts request writes nothing of the job's (no marker)
    asked = [request for op, _, request in pool.calls if op == "doctor_facts"]
    assert {request.write_marker for request in asked} == {False}
    # a clock far off, a workdir missing: missing is fine for a synced job (the sync makes it)
    timing = (now, now)
    late = shown.spare_health(spare, facts(clock=now + 600), None, None, timing, False)
    assert not late.healthy
    assert str(late.why).startswith("clock: +600.00s")
    missing = facts(writable="/w: missing", clock=now)
    assert shown.spare_health(spare, missing, None, None, timing, True).healthy
    shared = shown.spare_health(spare, missing, None, None, timing, False)
    assert shared == shown.SpareRow("10.0.0.9", False, "workdir: /w: missing")
    assert shown.spare_rows(pool, job, [master], []) == []


def test_status_shows_the_generation_who_replaced_whom_the_lost_nodes_and_each_spare():
    from meshkit.cli.tasks.jobs import membership_lines, render_status

    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=2)
    rows = [ops.StatusRow(0, "10.0.0.1", p.JobState.RUNNING, None, None, None)]
    supervision = shown.SupervisionStatus(
        attempt=2,
        restarts_left=2,
        supervisor=SupervisorState.RUNNING,
        leader=0,
        generation=2,
        lost=["10.0.0.2"],
        replaced=["10.0.0.2 -> 10.0.0.9"],
        spares=[shown.SpareRow("10.0.0.2", False, "not answering: timed out")],
    )
    assert membership_lines(supervision) == [
        "membership: generation 2",
        "  replaced 10.0.0.2 -> 10.0.0.9",
        "  lost: 10.0.0.2",
        "  spare 10.0.0.2: not healthy: not answering: timed out",
    ]
    waiting = replace(supervision, waiting="node 1 (10.0.0.2) until 21:00:00 UTC, lost then")
    assert "waiting for node 1 (10.0.0.2) until 21:00:00 UTC, lost then" in render_status(
        ops.JobStatus(rows, waiting), job
    )
    # the first generation with a healthy spare: the generation and the spare
    first = replace(
        supervision, generation=1, lost=[], replaced=[], spares=[shown.SpareRow("s", True)]
    )
    assert membership_lines(first) == ["membership: generation 1", "  spare s: healthy"]
    # the first generation, no spare line: nothing about membership
    assert membership_lines(replace(first, spares=[])) == []


def test_status_says_a_node_that_does_not_answer_does_not_and_why_whole():
    from meshkit.cli.tasks.jobs import render_status

    job = Job("x", "/w", "s", "/h", "/p", 1)
    down = "no answer within 10s on port 22: is the node up and reachable?"
    status = ops.job_status(FakePool(healthy(), failures={HOSTS[2]: down}), job, HOSTS)
    rows = status.rows
    assert rows[2].state == "absent"  # not seen there: to the supervisor, as before
    # whether the job runs there is unknown: never "absent" (issue 43)
    assert status.as_json()[2]["state"] == "unreachable"
    text = render_status(status, job)
    line = next(line for line in text.splitlines() if line.startswith("2 "))
    assert "unreachable" in line
    assert "absent" not in line
    assert "(the node does not answer: see below)" in line
    assert text.endswith(f"\nnode 2 (10.0.0.3) does not answer: unreachable: {down}")


def test_status_tells_a_node_that_answered_with_its_error_from_one_that_did_not_answer():
    from meshkit.cli.tasks.jobs import render_status

    job = Job("x", "/w", "s", "/h", "/p", 1)
    damaged = NodeFailed("StatusRequest failed on the node: DamagedState: 'nan', not a time")
    replies = healthy(status={**healthy()["status"], HOSTS[1]: damaged})
    status = ops.job_status(FakePool(replies), job, HOSTS)
    rows = status.rows
    assert (rows[1].state, rows[1].silent) == ("absent", False)  # the job is not seen there
    # --json says what the text table says: the node answered, with an error
    assert [node["state"] for node in status.as_json()] == ["running", "error", "running"]
    text = render_status(status, job)
    line = next(line for line in text.splitlines() if line.startswith("1 "))
    assert line.split()[2] == "error"
    assert "no answer" not in text
    assert text.endswith(f"\nnode 1 (10.0.0.2) answered with an error: {damaged}")


def _unhealthy() -> p.NodeHealth:
    from meshkit.health import Finding, HealthState, SourceRead, judge

    xid = Finding("kernel", HealthState.UNHEALTHY, "xid:79", "XID 79 on PCI:0000:3b:00: off")
    return judge([xid], [SourceRead("kernel", "/dev/kmsg")])


def test_status_asks_each_node_its_health_and_shows_it():
    """Issue 44: status reads each node's health (its job's workdir, id, limits and slots);
    the table has a health column and an unhealthy node's reasons below; --json rows carry
    {"state", "reasons"} (null for a node that did not answer)."""
    from meshkit.cli.tasks.jobs import render_status
    from meshkit.health import judge

    job = Job("x", "/w", "s", "/h", "/p", 1)
    hosts = [replace(HOSTS[0], slots=2), HOSTS[1], HOSTS[2]]
    running = p.StatusReply("running", None, 1.7e9, "step 1", health=judge([], []))
    sick = replace(running, health=_unhealthy())
    replies = {"status": {hosts[0]: running, hosts[1]: sick}}
    pool = FakePool(replies, failures={hosts[2]: "no answer"})
    status = ops.job_status(pool, job, hosts)
    asked = [request for op, _, request in pool.calls if op == "status"]
    assert asked[0].health == p.HealthRequest("/w", job.id, 2, job.health)
    assert asked[1].health.gpus is None
    data = status.as_json()
    assert data[0]["health"] == {"state": "ok", "reasons": []}
    assert data[1]["health"] == {
        "state": "unhealthy",
        "reasons": ["kernel: XID 79 on PCI:0000:3b:00: off"],
    }
    assert data[2]["health"] is None
    text = render_status(status, job)
    assert "health" in text.splitlines()[1]
    line = next(line for line in text.splitlines() if line.startswith("1 "))
    assert "unhealthy: kernel: XID 79 on PCI:0000..." in line
    assert "node 1 (10.0.0.2) is unhealthy: kernel: XID 79 on PCI:0000:3b:00: off" in text
    # the supervisor's polls ask only when they say so
    pool.calls.clear()
    ops.status(pool, job, hosts)
    assert all(request.health is None for _, _, request in pool.calls)
