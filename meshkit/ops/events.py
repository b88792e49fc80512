"""A job's history over its nodes (``meshkit events``): new events made (``new_event``), told
to every node of the job (``tell``: each keeps its copy, ``meshkit.node.events``), and read
back from every node and merged (``history``), so that losing any node, the leader's included,
loses nothing. ``train`` writes the launch, ``stop`` the stop, the supervisor the rest."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ..events import Blame, Event, EventKind, merge, new_id
from ..hostfile import Host
from ..job import Job
from ..outcome import ProgressFn
from ..protocol import MAX_LINE, EventsReply, EventsRequest
from ..record import asdict
from ..settings import Config
from .lookup import cluster_hosts, saved
from .pool import NodePool, connect, unanswered

PAGE = 1000  # events a node returns at most per request
MAX_PAGES = 50  # requests per node for one read: a history is bounded (rotation), this too
BATCH_BYTES = MAX_LINE // 4  # the encoded events of one tell request at most
POLL = 2.0  # seconds between the rounds of events --follow
LATE = 120.0  # seconds --follow looks back each round: an event another node wrote late, or
# with a clock a little behind, is still shown (once: the ids already shown are kept)


@dataclass(frozen=True)
class History:
    """Every node's copy of the job's history, merged (each event once, oldest first), and the
    nodes that could not be read, with why."""

    events: list[Event]
    failures: dict[Host, str] = field(default_factory=dict)


def new_event(
    job: Job,
    kind: EventKind,
    text: str,
    *,
    node: str | None = None,
    rank: int | None = None,
    attempt: int = 1,
    generation: int | None = None,
    blame: Blame | None = None,
    by: str = "",
) -> Event:
    """An event of ``job`` happening now: a new id, the job's launch, and its generation
    unless ``generation`` says otherwise."""
    return Event(
        id=new_id(),
        time=time.time(),
        kind=kind,
        text=text,
        launch=job.launch,
        generation=job.generation if generation is None else generation,
        attempt=attempt,
        node=node,
        rank=rank,
        blame=blame,
        by=by,
    )


def every_node(job: Job, hosts: Sequence[Host]) -> list[Host]:
    """The job's nodes (``hosts``), then the rest of its hostfile's (the spares, nodes it lost):
    where its history is kept and read."""
    return [*hosts, *(host for host in cluster_hosts(job) if host not in hosts)]


def batches(events: Sequence[Event]) -> list[list[Event]]:
    """``events`` in runs whose encoding fits a request line."""
    runs: list[list[Event]] = []
    used = 0
    for event in events:
        size = len(json.dumps(asdict(event)))
        if not runs or used + size > BATCH_BYTES:
            runs.append([])
            used = 0
        runs[-1].append(event)
        used += size
    return runs


def tell(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    events: Sequence[Event],
    timeout: float = 15.0,
) -> list[Host]:
    """Add ``events`` to the history on every node of ``hosts`` that answers, each request
    bounded by ``timeout``; the nodes that kept them all. A node's failure is never raised:
    it is a node that did not keep them."""
    kept = list(hosts)
    for run in batches(events):
        if not kept:
            break

        def request(host: Host, run: list[Event] = run) -> EventsRequest:
            return EventsRequest(job.id, str(job.home), add=run)

        # a node's failure (unreachable, its error, no reply in time) is its outcome
        replies = pool.call_all("", request, EventsReply, kept, timeout)
        kept = [host for host in kept if host in replies and replies[host].value is not None]
    return kept


def history(pool: NodePool, job: Job, hosts: Sequence[Host], since: float | None = None) -> History:
    """Every node's copy of the history (events at or after ``since``; None: all), merged.
    Each node is asked page by page (``more``) until it has no more, within ``MAX_PAGES``."""
    copies: dict[Host, list[Event]] = {host: [] for host in hosts}
    cursor: dict[Host, float] = {host: since or 0.0 for host in hosts}
    failures: dict[Host, str] = {}
    asking = list(hosts)
    phase = "events"
    for _ in range(MAX_PAGES):
        if not asking:
            break
        replies = pool.call_all(
            phase,
            lambda host: EventsRequest(job.id, str(job.home), since=cursor[host], limit=PAGE),
            EventsReply,
            asking,
        )
        phase = ""  # the progress line once
        still = []
        for host in asking:
            outcome = replies.get(host)
            if outcome is None or outcome.value is None:
                failures[host] = unanswered(outcome, host, pool.failures)
                continue
            reply = outcome.value
            known = {event.id for event in copies[host]}
            fresh = [event for event in reply.events if event.id not in known]
            copies[host] += fresh
            if reply.more and fresh:  # a page of only known events would repeat forever
                cursor[host] = reply.events[-1].time
                still.append(host)
        asking = still
    return History(merge(list(copies.values())), failures)


def read(
    conf: Config,
    hostfile: str | None,
    session: str | None,
    workdir: str | None,
    since: float | None = None,
    progress: ProgressFn | None = None,
) -> tuple[Job, History]:
    """``meshkit events``: the saved job of these flags (found as ``status`` finds it) and its
    history, read from every node of its hostfile, spares included."""
    job, hosts = saved(conf, hostfile, session, workdir)
    nodes = every_node(job, hosts)
    with connect(conf, job.hostfile, nodes, job.python, progress) as pool:
        return job, history(pool, job, nodes, since)


def follow(
    pool: NodePool, job: Job, hosts: Sequence[Host], since: float | None = None
) -> Iterator[History]:
    """The history (since ``since``), then each ``POLL`` seconds the events not yet shown,
    through the same agents; ends when the caller stops iterating (Ctrl-C)."""
    shown: dict[str, float] = {}
    cursor = since
    while True:
        found = history(pool, job, hosts, cursor)
        fresh = [event for event in found.events if event.id not in shown]
        for event in fresh:
            shown[event.id] = event.time
        yield History(fresh, found.failures)
        if shown:
            newest = max(shown.values())
            cursor = max(since or 0.0, newest - LATE)
            # only the ids a later round can return again are kept: bounded
            shown = {key: when for key, when in shown.items() if when >= cursor}
        time.sleep(POLL)
