"""A job's steps without a cluster (pure): the stall by steps (and by output where none are
told), stragglers against the nodes' median and the job's slowdown against its first minutes,
what the leader remembers of an attempt's steps (the crash-loop rule), and when a straggler is
named and evicted."""

from __future__ import annotations

import time

from meshkit.events import Blame, EventKind
from meshkit.hostfile import Host, parse
from meshkit.job import Job
from meshkit.ops.diagnose import Diagnosis, Rank, suspects
from meshkit.ops.jobs import StatusRow, watched
from meshkit.ops.pace import HOLD, Pace, slow_nodes, watch_pace
from meshkit.ops.stall import stall, stalled_at
from meshkit.ops.supervision_policy import Action, Call, Cause, Decision, NodeView
from meshkit.protocol import (
    JobState,
    RankProgress,
    RestartReason,
    Straggler,
    Supervision,
    SupervisorState,
)
from meshkit.record import replace
from meshkit.stragglers import node_pace, slowdown, stragglers

CLUSTER = parse("n0\nn1\nn2\nn3\ns1 spare\n")
MEMBERS = CLUSTER[:4]
JOB = Job(
    cmd="x",
    workdir="/w",
    session="s",
    hostfile="/h",
    python="p",
    master_port=1,
    stall_after=600.0,
    step_stall_after=60.0,
    replace_after=30.0,
    straggler_window=20.0,
)


def told(rank: int, step: int = 10, age: float = 1.0, compute: float | None = 0.1) -> RankProgress:
    return RankProgress(rank, step, age, 2.0, 0.5, compute, None)


def row(rank: int, progress: list[RankProgress], idle: float = 1.0) -> StatusRow:
    host = MEMBERS[rank].label
    return StatusRow(rank, host, JobState.RUNNING, None, None, "", idle_s=idle, progress=progress)


# ---- the stall ----


def test_a_job_that_tells_steps_stalls_by_its_steps_not_its_output():
    quiet = [row(0, [told(0)], idle=3600.0), row(1, [told(1)], idle=3600.0)]
    assert stall(JOB, watched(quiet)) is None  # silent, but stepping
    hung = [row(0, [told(0, age=75.0)], idle=0.0), row(1, [told(1, age=5.0)], idle=0.0)]
    why = stall(JOB, watched(hung))
    assert why is not None and why.words.startswith("rank 0 on n0: no step for 75s (its step 10)")
    assert (why.node, why.rank) == ("n0", 0)
    assert stalled_at(why, [], MEMBERS) == ("n0", 0)  # no outlier: the oldest step's node
    assert stalled_at(why, ["n2"], MEMBERS) == ("n2", 2)  # the one node whose stacks stand out
    assert stall(replace(JOB, step_stall_after=None), watched(hung)) is None


def test_a_job_that_tells_no_steps_stalls_by_its_output_as_before():
    rows = [row(0, [], idle=700.0), row(1, [], idle=650.0)]
    found = stall(JOB, watched(rows))
    assert found is not None and found.words == "no output for 600s (--stall-after)"
    assert stalled_at(found, ["n0", "n1"], MEMBERS) == (None, None)
    assert stall(JOB, watched([row(0, [], idle=700.0), row(1, [], idle=10.0)])) is None


# ---- stragglers, pure ----


def test_a_node_over_the_ratio_of_the_median_is_a_straggler_with_its_ratio():
    nodes = {
        "n0": [told(0, compute=0.10), told(1, compute=0.11)],
        "n1": [told(2, compute=0.10)],
        "n2": [told(3, compute=0.33)],
        "n3": [told(4, compute=0.10)],
    }
    assert node_pace(nodes["n0"]) == 0.11  # its slowest rank
    found = stragglers(nodes, 1.2)
    assert [straggler.node for straggler in found] == ["n2"]
    assert 3.0 < found[0].ratio < 3.2
    assert found[0].words().startswith("n2: 3.14x the nodes' median compute per step (330 ms")
    assert stragglers(nodes, 4.0) == []


def test_no_straggler_without_two_paces_and_none_from_step_time_alone():
    assert stragglers({"n0": [told(0, compute=1.0)]}, 1.2) == []
    untimed = {"n0": [told(0, compute=None)], "n1": [told(1, compute=None)]}
    assert stragglers(untimed, 1.2) == []


def test_without_compute_sections_the_slowdown_is_against_the_first_minutes():
    now = [
        RankProgress(0, 100, 1.0, 1.0, 0.9, None, 0.5),
        RankProgress(1, 100, 1.0, 1.0, 0.9, None, 0.5),
    ]
    found = slowdown(now)
    assert found is not None and 1.79 < found.ratio < 1.81
    assert "not attributed to a node" in found.words()
    timed = [RankProgress(0, 100, 1.0, 1.0, 0.9, 0.2, 0.5)]
    assert slowdown(timed) is None  # compute sections: stragglers attribute it


# ---- the leader's memory ----


def test_an_attempt_that_made_no_step_is_a_failed_start_once_the_job_tells_steps():
    pace = Pace()
    pace.see(1, [row(0, [])])
    assert pace.made_step() is None  # no steps told yet: the crash window decides
    pace.see(1, [row(0, [told(0, step=3)])])
    assert pace.made_step() is True
    pace.see(2, [row(0, [])])  # the next attempt, failing before its first step
    assert pace.made_step() is False


class Loop:
    """What ``pace`` takes of the supervisor's loop."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.hosts: list[Host] = list(MEMBERS)
        self.cluster: list[Host] = list(CLUSTER)
        self.me = 0
        self.quorum: list[Host] = []
        self.said: list[str] = []
        self.told: list[tuple[EventKind, str]] = []

    def say(self, message: str) -> None:
        self.said.append(message)

    def tell(
        self,
        kind: EventKind,
        text: str,
        node: str | None = None,
        rank: int | None = None,
        blame: Blame | None = None,
        attempt: int | None = None,
    ) -> None:
        self.told.append((kind, text))


def slow_rows(compute: float = 0.33) -> list[StatusRow]:
    return [
        row(0, [told(0, compute=0.1)]),
        row(1, [told(1, compute=0.1)]),
        row(2, [told(2, compute=compute)]),
        row(3, [told(3, compute=0.1)]),
    ]


def test_a_straggler_is_named_once_it_stayed_slow_and_forgotten_once_fast_for_a_window():
    loop = Loop(JOB)
    pace = Pace()
    pace.see(1, slow_rows())
    assert slow_nodes(loop, pace, slow_rows()) == []  # first seen now
    pace.since["n2"] = time.monotonic() - HOLD * JOB.straggler_window - 1
    held = slow_nodes(loop, pace, slow_rows())
    assert [straggler.node for straggler in held] == ["n2"]
    fast = slow_rows(compute=0.1)
    assert [straggler.node for straggler in slow_nodes(loop, pace, fast)] == ["n2"]  # for now
    pace.fine["n2"] = time.monotonic() - JOB.straggler_window - 1  # fast for a whole window
    assert slow_nodes(loop, pace, fast) == []
    assert pace.since == {} and pace.named == {}


def waiting(record: Supervision) -> Call:
    views = [NodeView(rank, host.label, JobState.RUNNING) for rank, host in enumerate(MEMBERS)]
    return Call(Decision(Action.WAIT), record, record, views)


def test_with_evict_stragglers_a_named_straggler_is_evicted_with_a_spare_else_only_named():
    named = [Straggler("n2", 3.3, 0.33, 0.1)]
    record = Supervision(SupervisorState.RUNNING, 1, 2, "", stragglers=named)
    pace = Pace()
    pace.see(1, slow_rows())
    pace.since["n2"] = time.monotonic() - JOB.straggler_window
    kept = watch_pace(Loop(JOB), None, pace, waiting(record), slow_rows())  # type: ignore[arg-type]
    assert kept.decision.action == Action.WAIT  # named (already), not evicted
    evicting = Loop(replace(JOB, evict_stragglers=True))
    call = watch_pace(evicting, None, pace, waiting(record), slow_rows())  # type: ignore[arg-type]
    assert call.decision.action == Action.EVICT
    assert call.decision.cause == Cause.STRAGGLER
    assert call.decision.told == RestartReason.EVICTED
    assert list(call.evict) == ["n2"] and "--evict-stragglers" in call.evict["n2"]
    # a failing poll is the failure's, not the pace's
    failing = replace(waiting(record), decision=Decision(Action.RESTART, Cause.FAILURE))
    assert watch_pace(evicting, None, pace, failing, slow_rows()) is failing  # type: ignore[arg-type]


def test_a_stall_points_at_the_outliers_else_at_the_ranks_whose_stack_could_not_be_read():
    waiting = ["all_reduce (distributed_c10d.py:3252)"]
    ranks = [
        Rank(0, "n0", 10, waiting, []),
        Rank(1, "n1", 11, waiting, []),
        Rank(2, "n2", 12, [], [], "cannot read its stack: Error: Failed to get stack traces"),
    ]
    found = Diagnosis("stalled", None, ranks, [], [], [], 60.0)
    assert [rank.node for rank in suspects(found)] == ["n2"]  # stopped: unreadable
    outlier = Diagnosis("stalled", None, ranks, [1], [], [], 60.0)
    assert [rank.node for rank in suspects(outlier)] == ["n1"]
    unread = [replace(rank, error="py-spy missing", frames=[]) for rank in ranks]
    assert suspects(Diagnosis("stalled", None, unread, [], [], [], 60.0)) == []
