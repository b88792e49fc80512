"""``meshkit diagnose``: where every rank of the job is (its live stack, grouped; the outliers
whose stack differs from the majority's) and, for a job that failed, the rank that failed first
with its error. ``diagnose`` asks every node once (``node/diagnose.py``); ``build`` is the verdict,
pure, unit-tested with plain replies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

from ..hostfile import Host
from ..job import Job
from ..outcome import Outcome
from ..protocol import DiagnoseReply, DiagnoseRequest, RankError
from .jobs import is_stalled
from .pool import NodePool, unanswered

State = Literal["running", "stalled", "failed", "done", "absent"]
SECONDS = 5.0  # per rank, for py-spy; a node's ranks are read in parallel
LIBRARY = ("/site-packages/", "/dist-packages/", "/lib/python")  # not the user's own frames
Replies = dict[Host, Outcome[DiagnoseReply]]
Errors = dict[int, tuple[int, RankError]]  # rank -> (node rank, its earliest error file)


@dataclass(frozen=True)
class Rank:
    rank: int
    node: str  # as the hostfile spells it
    pid: int
    frames: list[str]  # the main thread, innermost last: "function (file:line)"
    threads: list[list[str]]  # the other threads' innermost frames
    error: str | None = None  # why its stack could not be read
    seq: int | None = None  # flight recorder: the last collective it entered (None: no recorder)
    collective: str | None = None


@dataclass(frozen=True)
class Group:
    """Ranks whose main threads stand in the same place."""

    ranks: list[int]
    frames: list[str]

    @property
    def where(self) -> str:
        """ "all_reduce (train.py:42)": the innermost function, at the user's own innermost frame."""
        if not self.frames:
            return "?"
        inner = self.frames[-1].rpartition(" (")[0]
        own = [f for f in self.frames if not any(part in f for part in LIBRARY)]
        at = (own or self.frames)[-1].rpartition(" (")[2].rstrip(")")
        return f"{inner} ({at.rsplit('/', 1)[-1]})"


@dataclass(frozen=True)
class Failure:
    rank: int | None  # None: only the node's log said it (no rank's error file)
    node: str
    exit_code: int | None
    error: str
    traceback: list[str]
    time: float | None = None


@dataclass(frozen=True)
class NodeRow:
    node_rank: int
    host: str
    state: str
    exit_code: int | None
    idle_s: float | None
    error: str | None = None  # the node could not be asked, or no stack could be read there


@dataclass(frozen=True)
class Diagnosis:
    state: State
    first_failure: Failure | None
    ranks: list[Rank]
    outliers: list[int]
    groups: list[Group]  # the outliers' first, then the largest
    nodes: list[NodeRow]
    stall_after: float | None
    flight: str | None = None  # what torch's flight recorder says, where it is on

    @property
    def ok(self) -> bool:
        """Every node answered."""
        return not any(n.error for n in self.nodes)

    def as_json(self) -> dict[str, object]:
        data = asdict(self)
        data["groups"] = [{**asdict(g), "where": g.where} for g in self.groups]
        return data


def diagnose(pool: NodePool, job: Job, hosts: Sequence[Host]) -> Diagnosis:
    def request(h: Host) -> DiagnoseRequest:
        return DiagnoseRequest(job.id, str(job.home), job.log(hosts.index(h)), SECONDS)

    replies = pool.call_all("diagnose", request, DiagnoseReply, timeout=SECONDS + 30)
    return build(job, hosts, replies, pool.failures)


def build(
    job: Job, hosts: Sequence[Host], replies: Replies, failures: dict[Host, str]
) -> Diagnosis:
    """Pure: the replies as one diagnosis."""
    nodes: list[NodeRow] = []
    ranks: list[Rank] = []
    errors: Errors = {}
    for number, h in enumerate(hosts):
        outcome = replies.get(h)
        if outcome is None or outcome.value is None:
            why = unanswered(outcome, h, failures)
            nodes.append(NodeRow(number, h.label, "absent", None, None, str(why)))
            continue
        r = outcome.value
        nodes.append(NodeRow(number, h.label, r.state, r.exit_code, r.idle, r.problem))
        ranks += [
            Rank(s.rank, h.label, s.pid, s.frames, s.threads, s.error, s.seq, s.collective)
            for s in r.ranks
        ]
        for e in r.errors:  # shared storage: every node may return every file
            if e.rank not in errors or e.time < errors[e.rank][1].time:
                errors[e.rank] = (number, e)
    ranks.sort(key=lambda r: r.rank)
    answered = [n for n in nodes if n.error is None or n.state != "absent"]
    state: State
    if any(n.state == "exited" and n.exit_code for n in answered):
        state = "failed"
    elif any(n.state == "running" for n in answered):
        stalled = is_stalled(job.stall_after, [(n.state, n.idle_s) for n in answered])
        state = "stalled" if stalled else "running"
    elif answered and all(n.state == "exited" for n in answered):
        state = "done"
    else:
        state = "absent"
    groups, outliers = group(ranks)
    failure = first_failure(hosts, nodes, errors, replies) if state == "failed" or errors else None
    return Diagnosis(state, failure, ranks, outliers, groups, nodes, job.stall_after, flight(ranks))


def flight(ranks: Sequence[Rank]) -> str | None:
    """Pure: the newest collective any rank entered, and the ranks that never joined it."""
    seen = [r for r in ranks if r.seq is not None]
    if not seen:
        return None
    top = max(seen, key=lambda r: r.seq or 0)
    if not top.seq:
        return "flight recorder: no rank has entered a collective yet"
    behind = [r.rank for r in seen if (r.seq or 0) < top.seq]
    joined = f"ranks {spans(behind)} never joined it" if behind else "every rank entered it"
    return f"flight recorder: collective #{top.seq}, {top.collective}: {joined}"


def group(ranks: Sequence[Rank]) -> tuple[list[Group], list[int]]:
    """Pure: ranks by identical main-thread stacks; the outliers are the ranks outside the
    largest group (on a tie, the group waiting in torch.distributed is the majority: two ranks,
    one in the all_reduce and one not, make the other one the outlier)."""
    by: dict[tuple[str, ...], list[int]] = {}
    for r in ranks:
        if r.frames:
            by.setdefault(tuple(r.frames), []).append(r.rank)
    groups = [Group(v, list(k)) for k, v in by.items()]
    if len(groups) < 2:
        return groups, []
    major = max(
        groups, key=lambda g: (len(g.ranks), any("torch/distributed" in f for f in g.frames))
    )
    groups.sort(key=lambda g: (g is major, -len(g.ranks), g.ranks))
    return groups, sorted(r for g in groups if g is not major for r in g.ranks)


def first_failure(
    hosts: Sequence[Host], nodes: Sequence[NodeRow], errors: Errors, replies: Replies
) -> Failure | None:
    """The rank that raised first (by its error file's time: a peer that died of the closed
    connection raised later); without error files, the first failed node's log traceback."""
    if errors:
        number, e = min(errors.values(), key=lambda ne: ne[1].time)
        if e.node_rank is not None and 0 <= e.node_rank < len(nodes):
            number = e.node_rank
        node = nodes[number]
        return Failure(e.rank, node.host, node.exit_code, e.error, e.traceback, e.time)
    for n in nodes:
        if n.state == "exited" and n.exit_code:
            outcome = replies.get(hosts[n.node_rank])
            tail = outcome.value.log_traceback if outcome and outcome.value else []
            error = tail[-1] if tail else f"exited with code {n.exit_code}; no traceback in its log"
            return Failure(None, n.host, n.exit_code, error, tail)
    return None


def spans(numbers: Sequence[int]) -> str:
    """[0, 1, 2, 4, 5] -> "0-2,4-5"."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
