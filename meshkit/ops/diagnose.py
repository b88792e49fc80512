"""``meshkit diagnose``: where every rank of the job is (its live stack, grouped; the outliers
whose stack differs from the majority's) and, for a job that failed, the rank that failed first
with its error. ``diagnose`` asks every node once (``node/diagnose.py``); ``build`` is the verdict,
pure, unit-tested with plain replies.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

from ..errors import MeshkitError
from ..hostfile import Host
from ..job import Job
from ..outcome import Outcome
from ..protocol import DiagnoseReply, DiagnoseRequest, JobState, RankError, RankProgress
from .pool import NodePool, unanswered
from .stall import Watched, stall

State = Literal["running", "stalled", "failed", "done", "absent"]
SECONDS = 5.0  # per rank, for py-spy; a node's ranks are read in parallel
LIBRARY = ("/site-packages/", "/dist-packages/", "/lib/python")  # not the user's own frames
Replies = dict[Host, Outcome[DiagnoseReply]]


@dataclass(frozen=True)
class ReportedError:
    """A rank's error file, and the node (by rank) whose reply carried it."""

    node_rank: int
    error: RankError


Errors = dict[int, ReportedError]  # rank -> its earliest error file
Offsets = dict[int, float]  # node rank -> its clock less this machine's, in seconds


@dataclass(frozen=True)
class Rank:
    rank: int
    node: str  # as the hostfile spells it
    pid: int
    frames: list[str]  # the main thread, innermost last: "function (file:line)"
    threads: list[list[str]]  # the other threads' innermost frames
    error: str | None = None  # why its stack could not be read
    # flight recorder: the last collective it entered (None: no recorder)
    seq: int | None = None
    collective: str | None = None


@dataclass(frozen=True)
class Group:
    """Ranks whose main threads stand in the same place."""

    ranks: list[int]
    frames: list[str]

    @property
    def where(self) -> str:
        """ "all_reduce (train.py:42)": the innermost function, at the user's own innermost
        frame (the innermost of all when none is the user's)."""
        if not self.frames:
            return "?"
        inner = self.frames[-1].rpartition(" (")[0]
        own = [frame for frame in self.frames if not any(part in frame for part in LIBRARY)]
        shown = own[-1] if own else self.frames[-1]
        location = shown.rpartition(" (")[2].rstrip(")")
        file_and_line = location.rsplit("/", 1)[-1]
        return f"{inner} ({file_and_line})"


@dataclass(frozen=True)
class Failure:
    rank: int | None  # None: only the node's log said it (no rank's error file)
    node: str
    exit_code: int | None
    error: str
    traceback: list[str]
    time: float | None = None  # when it raised, on this machine's clock


@dataclass(frozen=True)
class NodeRow:
    node_rank: int
    host: str
    state: JobState
    exit_code: int | None
    idle_s: float | None
    error: str | None = None  # the node could not be asked, or no stack could be read there
    progress: list[RankProgress] = field(default_factory=list)  # its ranks' steps, if told


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
    errors: list[Failure] = field(default_factory=list)  # each rank's error, earliest first

    @property
    def ok(self) -> bool:
        """Every node answered."""
        return not any(node.error for node in self.nodes)

    def as_json(self) -> dict[str, object]:
        data = asdict(self)
        data["groups"] = [{**asdict(each), "where": each.where} for each in self.groups]
        return data


def diagnose(pool: NodePool, job: Job, hosts: Sequence[Host], stacks: bool = True) -> Diagnosis:
    """Every rank's stack (``stacks``; False: only the errors ranks left and the logs, which a
    failure's cause record needs, without py-spy's seconds), the outliers, the first failure."""
    sent: dict[Host, float] = {}

    def request(host: Host) -> DiagnoseRequest:
        sent[host] = time.time()  # as the doctor's facts round does: see clock_offsets
        log = job.log(hosts.index(host))
        return DiagnoseRequest(job.id, str(job.home), log, SECONDS, stacks)

    replies = pool.call_all("diagnose", request, DiagnoseReply, hosts, SECONDS + 30)
    return build(job, hosts, replies, pool.failures, sent)


@dataclass(frozen=True)
class Saved:
    """A diagnosis saved in the job's directory: where, and its outliers ("rank 0-2", or
    "none")."""

    path: str
    outliers: str
    nodes: list[str]  # the suspects' nodes (``suspects``), in rank order, each once


def save_diagnosis(pool: NodePool, job: Job, hosts: Sequence[Host], attempt: int) -> Saved:
    """Before a stalled job is stopped (the supervisor, --restart-on-stall): its diagnosis
    (every rank's stack) into the job's directory (every node's copy of it when synced), where
    it outlives the restart, as ``diagnosis-ATTEMPT.json``."""
    found = diagnose(pool, job, hosts)
    path = str(job.home / f"diagnosis-{attempt}.json")
    text = json.dumps(found.as_json(), indent=1) + "\n"
    for host in job.home_copies(hosts):
        with contextlib.suppress(MeshkitError):  # the restart goes on without it
            pool.write_file(host, path, text, 0o600)  # stacks and paths: this user's only
    outliers = f"rank {spans(found.outliers)}" if found.outliers else "none"
    nodes: list[str] = []
    for rank in suspects(found):
        if rank.node not in nodes:
            nodes.append(rank.node)
    return Saved(path, outliers, nodes)


def suspects(found: Diagnosis) -> list[Rank]:
    """Pure: the ranks a stall points at: the outliers; else, where some ranks' stacks were
    read, those whose stack could not be (a stopped or dying process is not where its peers
    wait either)."""
    outliers = [rank for rank in found.ranks if rank.rank in found.outliers]
    if outliers:
        return outliers
    unread = [rank for rank in found.ranks if rank.error]
    if len(unread) < len(found.ranks):
        return unread
    return []


def build(
    job: Job,
    hosts: Sequence[Host],
    replies: Replies,
    failures: dict[Host, str],
    sent: dict[Host, float] | None = None,
) -> Diagnosis:
    """Pure: the replies as one diagnosis. ``sent``: when each node's request left (this
    machine's clock), to correct its clock (``clock_offsets``)."""
    nodes: list[NodeRow] = []
    ranks: list[Rank] = []
    errors: Errors = {}
    for number, host in enumerate(hosts):
        outcome = replies.get(host)
        if outcome is None or outcome.value is None:
            why = unanswered(outcome, host, failures)
            nodes.append(NodeRow(number, host.label, JobState.ABSENT, None, None, str(why)))
            continue
        reply = outcome.value
        row = NodeRow(
            number,
            host.label,
            reply.state,
            reply.exit_code,
            reply.idle,
            reply.problem,
            reply.progress,
        )
        nodes.append(row)
        for stack in reply.ranks:
            ranks.append(
                Rank(
                    stack.rank,
                    host.label,
                    stack.pid,
                    stack.frames,
                    stack.threads,
                    stack.error,
                    stack.seq,
                    stack.collective,
                )
            )
        for error in reply.errors:  # shared storage: every node may return every file
            if error.rank not in errors or error.time < errors[error.rank].error.time:
                errors[error.rank] = ReportedError(number, error)
    ranks.sort(key=lambda rank: rank.rank)
    answered = [node for node in nodes if node.error is None or node.state != JobState.ABSENT]
    state = job_state(job, answered)
    groups, outliers = group(ranks)
    failure = None
    offsets = clock_offsets(hosts, replies, sent or {})
    if state == "failed" or errors:
        failure = first_failure(hosts, nodes, errors, replies, offsets)
    raised = rank_errors(nodes, errors, offsets)
    stall_after = job.stall_after
    return Diagnosis(
        state, failure, ranks, outliers, groups, nodes, stall_after, flight(ranks), raised
    )


def rank_errors(nodes: Sequence[NodeRow], errors: Errors, offsets: Offsets) -> list[Failure]:
    """Pure: each rank's error file as a ``Failure`` on its node, at its time on this machine's
    clock (``offsets``), earliest first."""
    found = []
    for reported in errors.values():
        node = nodes[ran_on(reported, len(nodes))]
        when = reported.error.time - offsets.get(ran_on(reported, len(nodes)), 0.0)
        error = reported.error
        found.append(
            Failure(error.rank, node.host, node.exit_code, error.error, error.traceback, when)
        )
    found.sort(key=lambda failure: failure.time or 0.0)
    return found


def job_state(job: Job, answered: Sequence[NodeRow]) -> State:
    """Pure: the job's state from the nodes that answered."""
    if any(node.state == JobState.EXITED and node.exit_code for node in answered):
        return "failed"
    if any(node.state == JobState.RUNNING for node in answered):
        nodes = [Watched(node.host, node.state, node.idle_s, node.progress) for node in answered]
        stalled = stall(job, nodes) is not None
        return "stalled" if stalled else "running"
    if answered and all(node.state == JobState.EXITED for node in answered):
        return "done"
    return "absent"


def flight(ranks: Sequence[Rank]) -> str | None:
    """Pure: the newest collective any rank entered, and the ranks that never joined it."""
    seen = [rank for rank in ranks if rank.seq is not None]
    if not seen:
        return None
    top = max(seen, key=lambda rank: rank.seq or 0)
    if not top.seq:
        return "flight recorder: no rank has entered a collective yet"
    behind = [rank.rank for rank in seen if (rank.seq or 0) < top.seq]
    joined = f"ranks {spans(behind)} never joined it" if behind else "every rank entered it"
    return f"flight recorder: collective #{top.seq}, {top.collective}: {joined}"


def group(ranks: Sequence[Rank]) -> tuple[list[Group], list[int]]:
    """Pure: ranks by identical main-thread stacks; the outliers are the ranks outside the
    largest group (on a tie, the group waiting in torch.distributed is the majority: two ranks,
    one in the all_reduce and one not, make the other one the outlier)."""
    stacks: dict[tuple[str, ...], list[int]] = {}
    for rank in ranks:
        if rank.frames:
            stacks.setdefault(tuple(rank.frames), []).append(rank.rank)
    groups = [Group(numbers, list(frames)) for frames, numbers in stacks.items()]
    if len(groups) < 2:
        return groups, []

    def size_then_torch(candidate: Group) -> tuple[int, bool]:
        in_torch = any("torch/distributed" in frame for frame in candidate.frames)
        return len(candidate.ranks), in_torch

    major = max(groups, key=size_then_torch)
    groups.sort(key=lambda each: (each is major, -len(each.ranks), each.ranks))
    outliers = [number for each in groups if each is not major for number in each.ranks]
    return groups, sorted(outliers)


def clock_offsets(hosts: Sequence[Host], replies: Replies, sent: dict[Host, float]) -> Offsets:
    """Pure: each answering node's clock less this machine's, by node rank: the node's
    clock when the request arrived less this machine's when it left. The request's one-way
    trip (milliseconds) makes it that much too large; what it corrects is larger: the
    clocks of nodes without time sync differ by seconds or more."""
    offsets: Offsets = {}
    for number, host in enumerate(hosts):
        outcome = replies.get(host)
        if outcome is None or outcome.value is None:
            continue
        arrived = outcome.value.clock
        if arrived is not None and host in sent:
            offsets[number] = arrived - sent[host]
    return offsets


def ran_on(reported: ReportedError, nodes: int) -> int:
    """The node (by rank) an error file's rank ran on: as the file says (with shared storage
    every node returns every file), else the node that returned it."""
    said = reported.error.node_rank
    if said is not None and 0 <= said < nodes:
        return said
    return reported.node_rank


def first_failure(
    hosts: Sequence[Host],
    nodes: Sequence[NodeRow],
    errors: Errors,
    replies: Replies,
    offsets: Offsets | None = None,
) -> Failure | None:
    """The rank that raised first (by its error file's time, on this machine's clock by the
    ``offsets`` of the nodes' clocks: a peer that died of the closed connection raised later);
    without error files, the first failed node's log traceback."""
    if errors:
        known = offsets or {}

        def raised(reported: ReportedError) -> float:
            """When it raised, on this machine's clock."""
            return reported.error.time - known.get(ran_on(reported, len(nodes)), 0.0)

        earliest = min(errors.values(), key=raised)
        error = earliest.error
        node = nodes[ran_on(earliest, len(nodes))]
        when = raised(earliest)
        return Failure(error.rank, node.host, node.exit_code, error.error, error.traceback, when)
    for node in nodes:
        if node.state == JobState.EXITED and node.exit_code:
            outcome = replies.get(hosts[node.node_rank])
            tail: list[str] = []
            if outcome is not None and outcome.value is not None:
                tail = outcome.value.log_traceback
            no_traceback = f"exited with code {node.exit_code}; no traceback in its log"
            said = tail[-1] if tail else no_traceback
            return Failure(None, node.host, node.exit_code, said, tail)
    return None


def spans(numbers: Sequence[int]) -> str:
    """[0, 1, 2, 4, 5] -> "0-2,4-5"."""
    runs: list[list[int]] = []
    for number in sorted(numbers):
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    texts = []
    for first, last in runs:
        texts.append(str(first) if first == last else f"{first}-{last}")
    return ",".join(texts)
