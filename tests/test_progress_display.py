"""Issue 45's display, no nodes: the steps ranks tell (``meshkit.progress``) as ``status``,
``status --json``, ``top`` and ``top --format prometheus`` show them, and the stragglers named,
over fake rows and canned top replies."""

from __future__ import annotations

import json

import pytest
from helpers.fake_pool import HOSTS, FakePool
from prometheus_client.parser import text_string_to_metric_families

from meshkit.job import Job
from meshkit.ops import jobs as ops
from meshkit.ops import supervision_status as shown
from meshkit.ops import top as op
from meshkit.ops.odd_one_out import straggler_marks
from meshkit.ops.progress_status import NodeSteps, named, node_steps
from meshkit.ops.top_prometheus import prometheus
from meshkit.protocol import (
    PortRate,
    RankProgress,
    RankSample,
    Straggler,
    Supervision,
    SupervisorState,
    TopReply,
)
from meshkit.quorum import Belief
from meshkit.record import Invalid, build, replace

GIB = 1 << 30
PROGRESS_KEYS = {"rank", "step", "age", "rate", "step_s", "compute_s"}


def ranks(first: int, step: int, compute_s: float | None = 0.05) -> list[RankProgress]:
    """A node's two ranks ``first`` and ``first + 1`` at ``step``, 2 steps a second."""
    return [
        RankProgress(first, step, 0.4, 2.0, 0.5, compute_s),
        RankProgress(first + 1, step + 3, 1.2, 2.5, 0.4, compute_s),
    ]


def job() -> Job:
    return Job("train", "/w", "s", "/h", "/p", 1)


def rows(slow: float = 0.05) -> list[ops.StatusRow]:
    """Three running nodes whose ranks tell their steps; node 2's compute takes ``slow``."""
    found = []
    for index, host in enumerate(HOSTS):
        pace = slow if index == 2 else 0.05
        progress = ranks(2 * index, 1234, pace)
        row = ops.StatusRow(index, host.label, "running", None, None, "step", progress=progress)
        found.append(row)
    return found


def render(status: ops.JobStatus) -> str:
    from meshkit.cli.tasks.jobs import render_status

    return render_status(status, job())


def test_a_nodes_steps_are_its_slowest_ranks() -> None:
    told = node_steps(ranks(0, 1234))
    assert told == NodeSteps(1234, 2.0, 1.2)
    assert told.words() == "1234 2.0/s 1s ago"
    young = node_steps([RankProgress(0, 7, 0.2)])
    assert young is not None and young.words() == "7 0s ago"
    assert node_steps([]) is None


def test_status_shows_a_step_column_only_for_a_job_that_tells_steps() -> None:
    text = render(ops.JobStatus(rows()))
    header = text.splitlines()[1]
    assert header.split() == [
        "rank",
        "host",
        "state",
        "exit",
        "started",
        "stalled",
        "health",
        "step",
        "last",
        "line",
    ]
    line = next(line for line in text.splitlines() if line.startswith("1 "))
    assert "1234 2.0/s 1s ago" in line
    assert "straggler" not in text
    plain = [replace(row, progress=[]) for row in rows()]
    text = render(ops.JobStatus(plain))
    assert "step" not in text.splitlines()[1].split()
    assert "2.0/s" not in text


def test_status_names_this_polls_straggler_and_json_gives_its_ratio() -> None:
    status = ops.JobStatus(rows(slow=0.08))
    text = render(status)
    words = "straggler 10.0.0.3: 1.60x the nodes' median compute per step (80 ms, 50 ms)"
    assert words in text.splitlines()
    data = json.loads(json.dumps(status.as_json()))
    assert [node["straggler"] for node in data[:2]] == [None, None]
    assert data[2]["straggler"] == {"ratio": 1.6, "compute_s": 0.08, "median_s": 0.05}
    for node in data:
        assert [set(rank) for rank in node["progress"]] == [PROGRESS_KEYS] * 2
    assert data[0]["progress"][1] == {
        "rank": 1,
        "step": 1237,
        "age": 1.2,
        "rate": 2.5,
        "step_s": 0.4,
        "compute_s": 0.05,
    }
    # the job's --straggler-ratio decides
    assert ops.JobStatus(rows(slow=0.08), straggler_ratio=1.7).stragglers().lines == []


def test_status_json_of_a_job_without_steps_has_empty_progress_and_no_straggler() -> None:
    plain = [replace(row, progress=[]) for row in rows()]
    for node in ops.JobStatus(plain).as_json():
        assert (node["progress"], node["straggler"]) == ([], None)


def supervised(stragglers: list[Straggler], state: SupervisorState) -> shown.SupervisionStatus:
    record = Supervision(state, 1, 3, None, [None, None, None], 1, 1, None)
    record = replace(record, stragglers=stragglers)
    return shown.supervision_status(shown.View(Belief(record, True, 3, 3), frozenset({0})))


def test_a_supervised_jobs_stragglers_are_its_leaders() -> None:
    """While a supervisor runs, status names the record's stragglers (what an eviction
    follows), not this poll's; once none runs, this poll's."""
    leader = Straggler("10.0.0.2", 1.52, 0.076, 0.05)
    status = ops.JobStatus(rows(slow=0.08), supervised([leader], SupervisorState.RUNNING))
    text = render(status)
    assert f"straggler {leader.words()}" in text.splitlines()
    assert "10.0.0.3: 1.60x" not in text
    data = status.as_json()
    assert data[1]["straggler"] == {"ratio": 1.52, "compute_s": 0.076, "median_s": 0.05}
    assert data[2]["straggler"] is None
    ended = ops.JobStatus(rows(slow=0.08), supervised([leader], SupervisorState.GAVE_UP))
    assert [line.split(":")[0] for line in ended.stragglers().lines] == ["10.0.0.3"]


def test_a_records_stragglers_keep_their_figures_and_a_node_cannot_drive_the_terminal() -> None:
    """The record a node stores carries each straggler's figures (read back as written, a
    non-number refused); its node name is the node's text, printed with its control characters
    made visible."""
    odd = Straggler("10.0.0.2 \x1b[31m", 1.5234, 0.0756, 0.05)
    record = replace(Supervision(SupervisorState.RUNNING, 1, 3), stragglers=[odd])
    stored = json.loads(record.to_json())
    assert build(Supervision, stored, "record").stragglers == [odd]
    stored["stragglers"][0]["ratio"] = "1.5x"
    with pytest.raises(Invalid, match="ratio"):
        build(Supervision, stored, "record")
    found = named({}, 1.2, [odd])
    assert found.nodes == {odd.node: odd}
    status = ops.JobStatus(rows(), supervised([odd], SupervisorState.RUNNING))
    from meshkit.terminal import visible

    assert f"straggler {visible(odd.words())}" in visible(render(status))  # as printed


def test_status_says_an_unattributed_slowdown() -> None:
    """Without compute sections no node can be named: the job's step time against its first
    minutes is said, as such."""
    slow = []
    for row in rows():
        told = [RankProgress(rank.rank, 10, 0.1, 1.0, 1.0, None, 0.5) for rank in row.progress]
        slow.append(replace(row, progress=told))
    text = render(ops.JobStatus(slow))
    assert (
        "slowdown: step time 2.00x the job's first minutes (1000 ms, 500 ms; no compute "
        "sections: not attributed to a node)"
    ) in text.splitlines()
    assert "straggler" not in text
    assert ops.JobStatus(rows(slow=0.08)).slowdown() is None


# ---- top ----------------------------------------------------------------------------------


def sample(progress: list[RankProgress], first: int) -> TopReply:
    port = PortRate("eth0", 10**9, 10**9, 0.0, 0.0)
    told = [
        RankSample(first, 100 + first, 90.0, GIB),
        RankSample(first + 1, 101 + first, 90.0, GIB),
    ]
    return TopReply(
        "node", 8, 90.0, GIB, 16 * GIB, [1.0, 1.0, 1.0], "eth0", [port], [], "none", told
    )


def top_snapshot(slow: float = 0.08) -> op.Snapshot:
    replies = {}
    for index, host in enumerate(HOSTS):
        pace = slow if index == 2 else 0.05
        replies[host] = replace(sample([], 2 * index), progress=ranks(2 * index, 500, pace))
    pool = FakePool({"top": replies})
    return op.snapshot(pool, HOSTS, replace(job(), straggler_window=20.0))


def test_top_asks_over_the_straggler_window_and_marks_the_straggler() -> None:
    replies = {host: sample([], 0) for host in HOSTS}
    pool = FakePool({"top": replies})
    op.snapshot(pool, HOSTS, replace(job(), straggler_window=20.0))
    assert {request.window for name, _, request in pool.calls if name == "top"} == {20.0}
    snapshot = top_snapshot()
    assert [straggler.node for straggler in snapshot.stragglers] == ["10.0.0.3"]
    reasons = [odd.reason for odd in snapshot.odd if odd.node == "10.0.0.3"]
    assert "straggler 10.0.0.3: 1.60x the nodes' median compute per step (80 ms, 50 ms)" in reasons
    data = json.loads(json.dumps(snapshot.as_json()))
    nodes = data["nodes"]
    assert nodes[2]["straggler"] == {"ratio": 1.6, "compute_s": 0.08, "median_s": 0.05}
    assert nodes[0]["straggler"] is None
    assert nodes[0]["ranks"][1] | {"cpu_percent": None} == {
        "rank": 1,
        "pid": 101,
        "cpu_percent": None,
        "rss_bytes": GIB,
        "step": 503,
        "rate": 2.5,
        "age": 1.2,
    }
    assert straggler_marks([], 1.2) == ([], [])


def test_top_without_a_job_or_steps_marks_no_straggler() -> None:
    pool = FakePool({"top": {host: sample([], 0) for host in HOSTS}})
    snapshot = op.snapshot(pool, HOSTS, None)
    assert snapshot.stragglers == []
    data = snapshot.as_json()
    assert all(node["straggler"] is None for node in data["nodes"])
    assert data["nodes"][0]["ranks"][0]["step"] is None


def test_top_text_has_a_step_column_when_ranks_tell_steps() -> None:
    from meshkit.cli.tasks.top import plain

    text = plain(top_snapshot(), False)
    lines = text.splitlines()
    headers = lines[1].split()
    assert "step" in headers
    assert headers.index("step") < headers.index("idle")
    assert "500 2.0/s 1s ago" in lines[2]
    assert (
        "odd one out: straggler 10.0.0.3: 1.60x the nodes' median compute per step (80 ms, 50 ms)"
        in lines
    )
    pool = FakePool({"top": {host: sample([], 0) for host in HOSTS}})
    assert "step" not in plain(op.snapshot(pool, HOSTS, job()), False).splitlines()[1].split()


@pytest.mark.parametrize("name", ["meshkit_rank_step", "meshkit_rank_steps_per_second"])
def test_prometheus_has_the_ranks_steps(name: str) -> None:
    text = prometheus(top_snapshot())
    families = {family.name: family for family in text_string_to_metric_families(text)}
    values = {
        (each.labels["node"], each.labels["rank"]): each.value for each in families[name].samples
    }
    assert len(values) == 6
    if name == "meshkit_rank_step":
        assert values[("10.0.0.1", "1")] == 503
    else:
        assert values[("10.0.0.2", "2")] == 2.0
    ages = families["meshkit_rank_step_age_seconds"].samples
    assert {each.labels["node_rank"] for each in ages} == {"0", "1", "2"}
    assert 'meshkit_rank_step{node="10.0.0.1",node_rank="0",rank="0"} 500' in text.splitlines()
