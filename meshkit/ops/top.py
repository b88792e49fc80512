"""``meshkit top``: one snapshot of every node at a time (its CPU, memory, load, network, GPUs and
the job's ranks there), asked of every node's agent in parallel over the pool's one connection
per node; the odd ones out marked (``odd_one_out``); the last minute of each node kept for a
sparkline. A node that stops answering is down, with why, and is connected again in the
background until it answers; the view goes on meanwhile.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from ..errors import JobError
from ..health import HealthState
from ..hostfile import Host
from ..job import Job
from ..protocol import (
    GpuSample,
    HealthRequest,
    JobState,
    RankProgress,
    RankSample,
    Straggler,
    TopReply,
    TopRequest,
)
from ..settings import Config
from . import lookup
from .health import health_request
from .odd_one_out import Odd, job_port, mark, straggler_marks
from .pool import NodePool, unanswered
from .progress_status import straggler_json
from .stall import Watched, stall
from .supervision import look
from .supervision_status import supervision_status, supervisor_words

HISTORY = 60.0  # seconds of each node's busy figure kept for its sparkline
MIN_TIMEOUT = 5.0  # seconds a node gets to answer one sample, at the shortest intervals


@dataclass(frozen=True)
class NodeLine:
    """One node's line in one snapshot: its sample, or why it is down."""

    node: str  # as the hostfile spells it
    node_rank: int
    sample: TopReply | None
    error: str | None = None  # why it did not answer (then it is down)
    down_for: float | None = None  # seconds since it was first seen down
    stalled: bool = False  # the job's: no running node wrote output for stall_after
    history: list[float] = field(default_factory=list)  # the last minute's busy %, oldest first

    @property
    def up(self) -> bool:
        return self.sample is not None


@dataclass(frozen=True)
class Snapshot:
    time: float  # wall clock, when the round ended
    interval: float
    nodes: list[NodeLine]
    odd: list[Odd]
    job: str | None = None  # "SESSION in WORKDIR" when the hostfile has a saved job
    supervisor: str | None = None  # a supervised job's supervision, as status says it
    stalled: bool = False
    stragglers: list[Straggler] = field(default_factory=list)  # also marked odd, with a reason

    def as_json(self) -> dict[str, object]:
        """The ``--json`` shape, with fixed keys (README, ``meshkit top``)."""
        return {
            "time": round(self.time, 3),
            "interval": self.interval,
            "job": self.job,
            "supervisor": self.supervisor,
            "stalled": self.stalled,
            "nodes": [node_json(node, self.odd, self.stragglers) for node in self.nodes],
            "odd": [asdict(odd) for odd in self.odd],
        }


def _rounded(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def gpu_json(gpu: GpuSample) -> dict[str, object]:
    return {
        "index": gpu.index,
        "name": gpu.name,
        "utilization_percent": gpu.utilization,
        "memory_used_bytes": gpu.memory_used,
        "memory_total_bytes": gpu.memory_total,
        "power_watts": _rounded(gpu.power),
        "power_limit_watts": _rounded(gpu.power_limit),
        "temperature_celsius": gpu.temperature,
    }


def rank_json(rank: RankSample, progress: Sequence[RankProgress] = ()) -> dict[str, object]:
    """A rank's figures; ``step``, ``rate`` (steps/s) and ``age`` (seconds since its last
    step) from ``progress`` (null: the rank does not tell its steps, or no rate yet)."""
    told = None
    for each in progress:
        if each.rank == rank.rank:
            told = each
    return {
        "rank": rank.rank,
        "pid": rank.pid,
        "cpu_percent": _rounded(rank.cpu),
        "rss_bytes": rank.rss,
        "step": None if told is None else told.step,
        "rate": None if told is None else _rounded(told.rate, 3),
        "age": None if told is None else _rounded(told.age),
    }


def node_json(
    view: NodeLine, odd: Sequence[Odd], stragglers: Sequence[Straggler] = ()
) -> dict[str, object]:
    sample = view.sample
    straggler = None
    for each in stragglers:
        if each.node == view.node:
            straggler = each
    data: dict[str, object] = {
        "node": view.node,
        "node_rank": view.node_rank,
        "up": view.up,
        "error": view.error,
        "odd": [each.reason for each in odd if each.node == view.node],
    }
    port = job_port(sample) if sample else None
    data.update(
        {
            "hostname": sample.hostname if sample else None,
            "cpus": sample.cpus if sample else None,
            "cpu_percent": _rounded(sample.cpu) if sample else None,
            "memory_used_bytes": sample.memory_used if sample else None,
            "memory_total_bytes": sample.memory_total if sample else None,
            "load": [round(each, 2) for each in sample.load] if sample else None,
            "interface": sample.interface if sample else None,
            "receive_bytes_per_s": _rounded(port.receive_rate) if port else None,
            "transmit_bytes_per_s": _rounded(port.send_rate) if port else None,
            "ports": [
                {
                    "name": each.name,
                    "receive_bytes_per_s": _rounded(each.receive_rate),
                    "transmit_bytes_per_s": _rounded(each.send_rate),
                }
                for each in (sample.ports if sample else [])
            ],
            "gpu_source": sample.gpu_source if sample else None,
            "gpus": [gpu_json(gpu) for gpu in sample.gpus] if sample else [],
            "ranks": [rank_json(rank, sample.progress) for rank in sample.ranks] if sample else [],
            "job_state": sample.job_state if sample else None,
            "idle_s": _rounded(sample.idle) if sample else None,
            "stalled": view.stalled,
            "history": [round(each, 1) for each in view.history],
            "health": sample.health.as_json() if sample and sample.health else None,
            "straggler": straggler_json(straggler),
        }
    )
    return data


def unhealthy_marks(answered: Sequence[tuple[str, TopReply]]) -> list[Odd]:
    """Pure: each unhealthy node marked as top marks the odd one out, its reasons the mark's."""
    marks = []
    for node, sample in answered:
        if sample.health is not None and sample.health.state == HealthState.UNHEALTHY:
            reason = f"{node} is unhealthy: {'; '.join(sample.health.reasons)}"
            marks.append(Odd("node", node, node, reason))
    return marks


def busy_figure(sample: TopReply) -> float | None:
    """What a node's sparkline shows: its GPUs' mean utilisation, else its CPU %."""
    utilizations = [gpu.utilization for gpu in sample.gpus if gpu.utilization is not None]
    if utilizations:
        return statistics.mean(utilizations)
    return sample.cpu


@dataclass(frozen=True)
class Target:
    """What top watches: the nodes, the saved job on them (if the hostfile has one), the
    interpreter their agents run with."""

    hostfile: str
    hosts: list[Host]
    job: Job | None
    python: str


def target(
    conf: Config,
    hostfile: str | None,
    session: str | None,
    workdir: str | None,
    include: str | None = None,
    exclude: str | None = None,
) -> Target:
    """The saved job of these flags and its nodes, else the hostfile's nodes without a job."""
    import os

    from ..discovery import read_hosts
    from ..settings import pick

    try:
        job, hosts = lookup.saved(conf, hostfile, session, workdir)
    except JobError:
        path = os.path.abspath(str(pick(conf, "hostfile", hostfile)))
        chosen = read_hosts(
            path, pick(conf, "include", include), pick(conf, "exclude", exclude), spares=True
        )
        return Target(path, chosen, None, str(conf.python or sys.executable))
    return Target(job.hostfile, hosts, job, job.python)


def supervisor_state(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    asked: Sequence[Host],
    cluster: Sequence[Host],
) -> str | None:
    """A supervised job's supervision in ``supervisor_words``, as ``status`` says it, from the
    nodes ``asked`` (None: not supervised, or no record); ``cluster``: the hostfile's nodes,
    spares included (a majority of which carries what is believed)."""
    if not job.supervised:
        return None
    seen = look(pool, job, hosts, cluster, asked)
    return supervisor_words(supervision_status(seen))


class Watch:
    """Snapshots of the same nodes over one pool: each node's previous counters stay in its agent,
    its last minute here."""

    def __init__(
        self,
        pool: NodePool,
        hosts: Sequence[Host],
        job: Job | None,
        interval: float,
        settle: float = 0.5,
        reconnect_down: bool = True,
    ) -> None:
        """``reconnect_down``: connect to a node that is down again in the background (a live view;
        one snapshot has no later round to show it in)."""
        self.pool = pool
        self.reconnect_down = reconnect_down
        self.hosts = list(hosts)
        self.job = job
        self.interval = interval
        self.settle = settle
        self.timeout = max(MIN_TIMEOUT, 2 * interval)
        self.history: dict[Host, deque[tuple[float, float]]] = {}
        self.down_since: dict[Host, float] = {}
        self.reconnecting: set[Host] = set()
        self.lock = threading.Lock()
        # a supervised job's hostfile nodes, spares included (a majority of them carries what
        # is believed): read here, where a missing hostfile is an error before the view
        # starts, not in the middle of it
        self.cluster: list[Host] = list(self.hosts)
        if job is not None and job.supervised:
            self.cluster = lookup.cluster_hosts(job)

    def request_for(self, host: Host) -> TopRequest:
        rank = self.hosts.index(host)
        if self.job is None:
            # no job: the GPUs the hostfile gives the node, the state directory's free space
            health = HealthRequest("", gpus=host.slots)
            return TopRequest(host.host, settle=self.settle, health=health)
        health = health_request(self.job, host)
        log = self.job.log(rank)
        window = self.job.straggler_window  # the rates over the window stragglers are judged by
        return TopRequest(host.host, self.job.id, log, self.settle, health, window)

    def snapshot(self) -> Snapshot:
        with self.lock:
            asked = [host for host in self.hosts if host not in self.reconnecting]
        replies = self.pool.call_all(
            "", self.request_for, TopReply, hosts=asked, timeout=self.timeout
        )
        supervisor = None
        if self.job is not None:
            cluster = self.cluster
            supervisor = supervisor_state(self.pool, self.job, self.hosts, asked, cluster)
        now = time.monotonic()
        views = []
        answered: list[tuple[str, TopReply]] = []
        for rank, host in enumerate(self.hosts):
            outcome = replies.get(host)
            if outcome is None or outcome.value is None:
                error = unanswered(outcome, host, self.pool.failures)
                if outcome is None and host not in self.pool.failures:
                    error = "connection lost; connecting again"
                since = self.down_since.setdefault(host, now)
                views.append(NodeLine(host.label, rank, None, error, now - since))
                self.reconnect_later(host)
                continue
            self.down_since.pop(host, None)
            sample = outcome.value
            answered.append((host.label, sample))
            views.append(NodeLine(host.label, rank, sample, history=self.remember(host, sample)))
        stalled = False
        if self.job is not None:
            nodes = []
            for view in views:
                got = view.sample
                if got is not None and got.job_state is not None:
                    nodes.append(Watched(view.node, got.job_state, got.idle, got.progress))
            stalled = stall(self.job, nodes) is not None
        if stalled:
            marked = []
            for view in views:
                running = view.sample is not None and view.sample.job_state == JobState.RUNNING
                marked.append(replace(view, stalled=running))
            views = marked
        label = self.job.label if self.job else None
        odd = unhealthy_marks(answered) + mark(answered)
        stragglers: list[Straggler] = []
        if self.job is not None:
            stragglers, marks = straggler_marks(answered, self.job.straggler_ratio)
            odd += marks
        return Snapshot(
            time.time(), self.interval, views, odd, label, supervisor, stalled, stragglers
        )

    def remember(self, host: Host, sample: TopReply) -> list[float]:
        kept = self.history.setdefault(host, deque())
        figure = busy_figure(sample)
        now = time.monotonic()
        if figure is not None:
            kept.append((now, figure))
        while kept and kept[0][0] < now - HISTORY:
            kept.popleft()
        return [value for _, value in kept]

    def reconnect_later(self, host: Host) -> None:
        """Open a down node's connection again in the background (a cut node's connect takes
        the whole connect timeout; the view does not wait for it)."""
        if not self.reconnect_down:
            return
        with self.lock:
            if host in self.reconnecting:
                return
            self.reconnecting.add(host)

        def attempt() -> None:
            try:
                self.pool.reconnect(host)
            except Exception:  # still down: the pool keeps why, the next round tries again
                time.sleep(self.interval)
            finally:
                with self.lock:
                    self.reconnecting.discard(host)

        # a daemon: Ctrl-C leaves at once, whatever connect is still waiting
        threading.Thread(target=attempt, name=f"reconnect {host.label}", daemon=True).start()


ONCE_SETTLE = 1.0  # seconds between a lone snapshot's two samples: rates over a whole second


def snapshot(pool: NodePool, hosts: Sequence[Host], job: Job | None) -> Snapshot:
    """One snapshot (``top --once``, ``Cluster.top()``)."""
    return Watch(
        pool, hosts, job, interval=0.0, settle=ONCE_SETTLE, reconnect_down=False
    ).snapshot()
